module goroot

go 1.25
