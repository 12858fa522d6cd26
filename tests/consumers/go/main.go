// A user's program: causal attention over two tokens (one head, head_dim 2) through the Go binding.
package main

import (
	"fmt"
	"log"

	sparsa "github.com/sparsa-project/sparsa/bindings/go"
)

func main() {
	ctx, err := sparsa.NewContext(nil)
	if err != nil {
		log.Fatal(err)
	}
	defer ctx.Close()
	shape := []int64{1, 2, 1, 2}
	out := make([]float32, 4)
	args := sparsa.AttentionArgs{Causal: true}
	if args.Q, err = sparsa.Float32([]float32{1, 0, 0, 0}, shape...); err != nil {
		log.Fatal(err)
	}
	if args.K, err = sparsa.Float32([]float32{1, 0, 0, 1}, shape...); err != nil {
		log.Fatal(err)
	}
	if args.V, err = sparsa.Float32([]float32{1, 2, 3, 4}, shape...); err != nil {
		log.Fatal(err)
	}
	if args.Out, err = sparsa.Float32(out, shape...); err != nil {
		log.Fatal(err)
	}
	policy, err := sparsa.NewPolicy(sparsa.PolicyDense)
	if err != nil {
		log.Fatal(err)
	}
	if err := ctx.Attention(&args, &policy); err != nil {
		log.Fatal(err)
	}
	fmt.Printf("sparsa %s out %v\n", sparsa.VersionString(), out)
}
