module sparsa

go 1.19
