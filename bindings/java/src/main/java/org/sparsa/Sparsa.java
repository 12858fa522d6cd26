package org.sparsa;

import java.lang.ref.Reference;
import java.nio.ByteBuffer;
import java.nio.IntBuffer;
import org.sparsa.jni.SparsaNative;
import org.sparsa.jni.SparsaNativeConstants;

/** Version information and the utilities that take no context (host memory). */
public final class Sparsa {
  /** Version of sparsa.h this binding was generated from (MAJOR*10000 + MINOR*100 + PATCH). */
  public static final int HEADER_VERSION = SparsaNativeConstants.SPARSA_VERSION_MAJOR * 10000
      + SparsaNativeConstants.SPARSA_VERSION_MINOR * 100 + SparsaNativeConstants.SPARSA_VERSION_PATCH;

  private Sparsa() {}

  /** Version of the loaded library, encoded as HEADER_VERSION. */
  public static int version() {
    return (int) SparsaNative.sparsa_version();
  }

  /** Version of the loaded library as "MAJOR.MINOR.PATCH". */
  public static String versionString() {
    return SparsaNative.sparsa_version_string();
  }

  /** The library's name of a status ("SPARSA_STATUS_SHAPE_MISMATCH"). */
  public static String statusName(Status status) {
    return SparsaNative.sparsa_status_string(status.code());
  }

  /** The library's name of a policy kind ("SPARGE"). */
  public static String policyKindName(PolicyKind kind) {
    return SparsaNative.sparsa_policy_kind_name(kind.code());
  }

  /**
   * STS head mapping (§7): draft F32 [T, Hd, N], target F32 [T, Ht, N]; outMap int32 [Ht] receives, per target
   * head, the draft head whose top-k overlaps it most.
   */
  public static void headMapping(Tensor draft, Tensor target, int k, Tensor outMap) {
    try {
      SparsaNative.sparsa_head_mapping(Tensor.descriptorOf(draft), Tensor.descriptorOf(target), k,
          Tensor.descriptorOf(outMap));
    } finally {
      Reference.reachabilityFence(new Object[] {draft, target, outMap});
    }
  }

  /**
   * Drift-based layer selection (§5): hIn, hOut [L, T, D] (F32/F16/BF16); outRatio F32 [L] and outSparse uint8 [L]
   * are optional outputs.
   */
  public static void driftSelectLayers(Tensor hIn, Tensor hOut, float delta, Tensor outRatio, Tensor outSparse) {
    try {
      SparsaNative.sparsa_drift_select_layers(Tensor.descriptorOf(hIn), Tensor.descriptorOf(hOut), delta,
          Tensor.descriptorOf(outRatio), Tensor.descriptorOf(outSparse));
    } finally {
      Reference.reachabilityFence(new Object[] {hIn, hOut, outRatio, outSparse});
    }
  }

  /** SpargeAttn's 3-D Hilbert order of a t×h×w grid (§4): {perm, inverse}, inverse[perm[i]] = i. */
  public static int[][] hilbertPermutation(int t, int h, int w) {
    long count = (long) t * h * w;
    if (t < 0 || h < 0 || w < 0 || count > Integer.MAX_VALUE / Integer.BYTES) {
      hilbertPermutation(t, h, w, null, null); // the library names the bad extent
      throw new SparsaException(Status.INVALID_ARGUMENT, "t, h, w: a " + t + " x " + h + " x " + w
          + " grid does not fit in one buffer");
    }
    ByteBuffer perm = Tensor.allocate(DType.I32, Math.max(count, 0));
    ByteBuffer inverse = Tensor.allocate(DType.I32, Math.max(count, 0));
    hilbertPermutation(t, h, w, perm, inverse);
    return new int[][] {toArray(perm.asIntBuffer()), toArray(inverse.asIntBuffer())};
  }

  /**
   * Writes the permutation into direct buffers (native order) of exactly t*h*w int32 from their position; either
   * may be null.
   */
  public static void hilbertPermutation(int t, int h, int w, ByteBuffer perm, ByteBuffer inverse) {
    long count = (long) t * h * w;
    if (t >= 0 && h >= 0 && w >= 0) {
      checkPermutationBuffer("perm", perm, count);
      checkPermutationBuffer("inverse", inverse, count);
    }
    SparsaNative.sparsa_java_hilbert_permutation(t, h, w, slice(perm), slice(inverse));
  }

  private static void checkPermutationBuffer(String name, ByteBuffer buffer, long count) {
    if (buffer == null) {
      return;
    }
    if (!buffer.isDirect() || buffer.order() != java.nio.ByteOrder.nativeOrder()) {
      throw new SparsaException(Status.INVALID_ARGUMENT, name + ": expected a direct ByteBuffer in raw order");
    }
    if (buffer.remaining() != count * Integer.BYTES) {
      throw new SparsaException(Status.SHAPE_MISMATCH, name + ": expected t*h*w = " + count
          + " int32 entries, the buffer has " + buffer.remaining() + " bytes remaining");
    }
  }

  private static ByteBuffer slice(ByteBuffer buffer) {
    return buffer == null || !buffer.hasRemaining() ? null : buffer.slice();
  }

  private static int[] toArray(IntBuffer buffer) {
    int[] values = new int[buffer.remaining()];
    buffer.get(values);
    return values;
  }
}
