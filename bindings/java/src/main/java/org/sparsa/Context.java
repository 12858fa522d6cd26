package org.sparsa;

import java.lang.ref.Reference;
import org.sparsa.jni.SWIGTYPE_p_sparsa_context;
import org.sparsa.jni.SparsaNative;
import org.sparsa.jni.sparsa_context_options;
import org.sparsa.jni.sparsa_sparge_tune_options;

/**
 * Runs attention and the device utilities on one backend, and owns their scratch memory. Use from one thread at a
 * time; close it (try-with-resources) when done — {@link #close()} is idempotent. Close its selection caches first.
 */
public final class Context implements AutoCloseable {
  private SWIGTYPE_p_sparsa_context handle;

  private Context(SWIGTYPE_p_sparsa_context handle) {
    this.handle = handle;
  }

  /** A CPU context using every core. */
  public static Context create() {
    return create(new ContextOptions());
  }

  /** A context on the backend the options name; BACKEND_UNAVAILABLE when it was not built or has no device. */
  public static Context create(ContextOptions options) {
    sparsa_context_options raw = new sparsa_context_options();
    try {
      SparsaNative.sparsa_java_context_options_init(raw);
      raw.setDevice_type(options.device().code());
      raw.setDevice_id(options.deviceId());
      raw.setNum_threads(options.numThreads());
      return new Context(SparsaNative.sparsa_java_context_create(raw, options.stream()));
    } finally {
      raw.delete();
    }
  }

  /** Destroys the context and its scratch memory; later calls do nothing. */
  @Override
  public synchronized void close() {
    if (handle != null) {
      SparsaNative.sparsa_context_destroy(handle);
      handle = null;
    }
  }

  SWIGTYPE_p_sparsa_context handle() {
    SWIGTYPE_p_sparsa_context current = handle;
    if (current == null) {
      throw new SparsaException(Status.NULL_POINTER, "ctx: the Context is closed");
    }
    return current;
  }

  /** Changes the stream later GPU runs enqueue on (ignored on CPU). */
  public void setStream(long stream) {
    SparsaNative.sparsa_java_context_set_stream(handle(), stream);
  }

  public DeviceType deviceType() {
    return DeviceType.fromCode(SparsaNative.sparsa_java_context_device_type(handle()));
  }

  /** Bytes of scratch memory the context holds. */
  public long scratchBytes() {
    return SparsaNative.sparsa_java_context_scratch_bytes(handle());
  }

  /** A TokenSelect selection cache (§6.5) for up to these sizes. */
  public SelectionCache newSelectionCache(int maxBatch, int numQHeads, int numKvHeads, int headDim, int maxTopK) {
    return new SelectionCache(this, SparsaNative.sparsa_java_selection_cache_create(handle(), maxBatch, numQHeads,
        numKvHeads, headDim, maxTopK));
  }

  /** Computes the outputs of {@code args} under the DENSE policy. */
  public void attention(AttentionArgs args) {
    attention(args, null);
  }

  /** Computes the outputs of {@code args} under {@code policy} (null = DENSE); on error nothing is written. */
  public void attention(AttentionArgs args, Policy policy) {
    try {
      SparsaNative.sparsa_attention_run(handle(), args.raw(), Policy.nativeOf(policy));
    } finally {
      Reference.reachabilityFence(args);
      Reference.reachabilityFence(policy);
    }
  }

  /** Validates like {@link #attention} and grows scratch memory for this problem, computing nothing. */
  public void plan(AttentionArgs args, Policy policy) {
    try {
      SparsaNative.sparsa_attention_plan(handle(), args.raw(), Policy.nativeOf(policy));
    } finally {
      Reference.reachabilityFence(args);
      Reference.reachabilityFence(policy);
    }
  }

  /**
   * Tunes SPARGE per query head on one calibration call (§4). outParams: F32 [Hq, 4]; outMetrics (optional): F32
   * [Hq, 2]. policy null = SPARGE defaults; options null = the library's defaults.
   */
  public void spargeTune(AttentionArgs args, Policy policy, SpargeTuneOptions options, Tensor outParams,
      Tensor outMetrics) {
    sparsa_sparge_tune_options raw = new sparsa_sparge_tune_options();
    try {
      SparsaNative.sparsa_java_sparge_tune_options_init(raw);
      if (options != null) {
        options.fill(raw);
      }
      SparsaNative.sparsa_sparge_tune(handle(), args.raw(), Policy.nativeOf(policy), raw,
          Tensor.descriptorOf(outParams), Tensor.descriptorOf(outMetrics));
    } finally {
      raw.delete();
      Reference.reachabilityFence(args);
      Reference.reachabilityFence(policy);
      Reference.reachabilityFence(outParams);
      Reference.reachabilityFence(outMetrics);
    }
  }

  /**
   * Merges two partial attention states over disjoint key sets (§0). outLse may be null; out/outLse may be
   * oA/lseA (in place).
   */
  public void mergeStates(Tensor oA, Tensor lseA, Tensor oB, Tensor lseB, Tensor out, Tensor outLse) {
    try {
      SparsaNative.sparsa_merge_states(handle(), Tensor.descriptorOf(oA), Tensor.descriptorOf(lseA),
          Tensor.descriptorOf(oB), Tensor.descriptorOf(lseB), Tensor.descriptorOf(out), Tensor.descriptorOf(outLse));
    } finally {
      Reference.reachabilityFence(new Object[] {oA, lseA, oB, lseB, out, outLse});
    }
  }

  /** Top-k of draft scores F32 [B, H, N] (§7) into int32 [B, H, k], rows ascending; blockSize > 1 = block ids. */
  public void topkFromScores(Tensor scores, int k, int blockSize, Tensor outIndices) {
    try {
      SparsaNative.sparsa_topk_from_scores(handle(), Tensor.descriptorOf(scores), k, blockSize,
          Tensor.descriptorOf(outIndices));
    } finally {
      Reference.reachabilityFence(scores);
      Reference.reachabilityFence(outIndices);
    }
  }

  /** KV prefetch (§7): gathers the selected K/V rows into compact buffers; counts may be null. */
  public void kvPrefetch(Tensor kSrc, Tensor vSrc, Tensor indices, Tensor kDst, Tensor vDst, Tensor positions,
      Tensor remapped, Tensor counts) {
    try {
      SparsaNative.sparsa_kv_prefetch(handle(), Tensor.descriptorOf(kSrc), Tensor.descriptorOf(vSrc),
          Tensor.descriptorOf(indices), Tensor.descriptorOf(kDst), Tensor.descriptorOf(vDst),
          Tensor.descriptorOf(positions), Tensor.descriptorOf(remapped), Tensor.descriptorOf(counts));
    } finally {
      Reference.reachabilityFence(new Object[] {kSrc, vSrc, indices, kDst, vDst, positions, remapped, counts});
    }
  }
}
