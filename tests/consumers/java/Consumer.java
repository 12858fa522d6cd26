// A user's program: causal attention over two tokens (one head, head_dim 2) through the Java binding, compiled and
// run against an install prefix's sparsa.jar only (the JNI library is found next to libsparsa, or on
// java.library.path).
import java.nio.ByteBuffer;
import java.util.Arrays;
import org.sparsa.AttentionArgs;
import org.sparsa.Context;
import org.sparsa.DType;
import org.sparsa.Policy;
import org.sparsa.PolicyKind;
import org.sparsa.Sparsa;
import org.sparsa.Tensor;

public final class Consumer {
  public static void main(String[] args) {
    long[] shape = {1, 2, 1, 2};
    ByteBuffer q = Tensor.allocate(DType.F32, shape);
    ByteBuffer k = Tensor.allocate(DType.F32, shape);
    ByteBuffer v = Tensor.allocate(DType.F32, shape);
    ByteBuffer out = Tensor.allocate(DType.F32, shape);
    q.asFloatBuffer().put(new float[] {1, 0, 0, 0});
    k.asFloatBuffer().put(new float[] {1, 0, 0, 1});
    v.asFloatBuffer().put(new float[] {1, 2, 3, 4});
    try (Context ctx = Context.create()) {
      ctx.attention(AttentionArgs.builder().q(Tensor.of(q, DType.F32, shape)).k(Tensor.of(k, DType.F32, shape))
          .v(Tensor.of(v, DType.F32, shape)).out(Tensor.of(out, DType.F32, shape)).causal(true).build(),
          Policy.builder(PolicyKind.DENSE).build());
    }
    float[] result = new float[4];
    out.asFloatBuffer().get(result);
    System.out.println("sparsa " + Sparsa.versionString() + " out " + Arrays.toString(result));
  }
}
