module github.com/sparsa-project/sparsa/bindings/go

go 1.19
