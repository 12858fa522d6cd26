package org.sparsa;

import java.nio.ByteBuffer;
import java.nio.FloatBuffer;

/** The example of bindings/java/README.md, verbatim; ReadmeExampleTest runs it. */
final class ReadmeExample {
  private ReadmeExample() {}

  // Causal attention over two tokens, one head of dimension 2, on the CPU. Row 0 sees only key 0 and gets v0;
  // row 1 has a zero query, weighs both keys equally and gets the mean of v0 and v1.
  static float[] run() {
    long[] shape = {1, 2, 1, 2}; // [batch, tokens, heads, head_dim]
    ByteBuffer q = Tensor.allocate(DType.F32, shape); // direct, native byte order
    ByteBuffer k = Tensor.allocate(DType.F32, shape);
    ByteBuffer v = Tensor.allocate(DType.F32, shape);
    ByteBuffer out = Tensor.allocate(DType.F32, shape);
    q.asFloatBuffer().put(new float[] {1, 0, 0, 0});
    k.asFloatBuffer().put(new float[] {1, 0, 0, 1});
    v.asFloatBuffer().put(new float[] {1, 2, 3, 4});

    try (Context ctx = Context.create()) {
      AttentionArgs args = AttentionArgs.builder()
          .q(Tensor.of(q, DType.F32, shape))
          .k(Tensor.of(k, DType.F32, shape))
          .v(Tensor.of(v, DType.F32, shape))
          .out(Tensor.of(out, DType.F32, shape))
          .causal(true)
          .build();
      ctx.attention(args, Policy.builder(PolicyKind.DENSE).build());
    } catch (SparsaException e) {
      System.err.println(e.status() + ": " + e.detail()); // e.g. SHAPE_MISMATCH: out: expected shape ...
      throw e;
    }
    float[] result = new float[4];
    FloatBuffer values = out.asFloatBuffer();
    values.get(result); // {1, 2, 2, 3}
    return result;
  }
}
