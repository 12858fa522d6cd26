package sparsa_test

import (
	"errors"
	"fmt"
	"log"

	sparsa "github.com/sparsa-project/sparsa/bindings/go"
)

// Causal attention over two tokens, one head of dimension 2, on the CPU. Row 0 sees only key 0, so it gets v0;
// row 1 has a zero query, so it weighs both keys equally and gets the mean of v0 and v1. The README shows this
// example.
func ExampleContext_Attention() {
	ctx, err := sparsa.NewContext(nil) // CPU, every core
	if err != nil {
		log.Fatal(err)
	}
	defer ctx.Close()

	// [batch 1, 2 tokens, 1 head, head_dim 2], row-major.
	q := []float32{1, 0, 0, 0}
	k := []float32{1, 0, 0, 1}
	v := []float32{1, 2, 3, 4}
	out := make([]float32, 4)
	shape := []int64{1, 2, 1, 2}

	args := sparsa.AttentionArgs{Causal: true}
	if args.Q, err = sparsa.Float32(q, shape...); err != nil {
		log.Fatal(err)
	}
	if args.K, err = sparsa.Float32(k, shape...); err != nil {
		log.Fatal(err)
	}
	if args.V, err = sparsa.Float32(v, shape...); err != nil {
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
	fmt.Printf("%.3f\n", out)

	// Errors carry the library's status and message.
	args.Out, _ = sparsa.Float32(make([]float32, 2), 1, 1, 1, 2)
	err = ctx.Attention(&args, &policy)
	fmt.Println(errors.Is(err, sparsa.ErrShapeMismatch))
	// Output:
	// [1.000 2.000 2.000 3.000]
	// true
}
