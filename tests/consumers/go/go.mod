module example.com/sparsaconsumer

go 1.19

require github.com/sparsa-project/sparsa/bindings/go v0.0.0-00010101000000-000000000000

replace github.com/sparsa-project/sparsa/bindings/go => SPARSA_GO_PATH
