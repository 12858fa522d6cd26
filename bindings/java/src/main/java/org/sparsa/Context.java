package org.sparsa;

import java.lang.ref.Reference;
import org.sparsa.jni.SWIGTYPE_p_sparsa_context;
import org.sparsa.jni.SparsaNative;
import org.sparsa.jni.SparsaNativeConstants;
import org.sparsa.jni.sparsa_context_options;
import org.sparsa.jni.sparsa_sparge_tune_options;

/**
 * Runs attention and the device utilities on one backend, and owns their scratch memory. Use from one thread at a
 * time; close it (try-with-resources) when done — {@link #close()} is idempotent. Close its selection caches first.
 */
public final class Context implements AutoCloseable {
  /** Fixed-point digits of one partial normaliser in {@link #cpSelectSum}'s output (SPARSA_CP_SUM_DIGITS). */
  public static final int CP_SUM_DIGITS = SparsaNativeConstants.SPARSA_CP_SUM_DIGITS;

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

  // Context-parallel TOKEN_SELECT decode (docs/context_parallel.md): a sequence's keys are split by position over G
  // shards, and four calls per shard, with the caller's collectives between them, make every shard's selection the
  // single-context one. Each call takes the arguments of the shard's run (q: every query row, the same on every
  // shard; k, v: the shard's keys, any KV layout; out is not written and may be left unset) and a TOKEN_SELECT
  // policy; a selection cache is refused. kvStart, kvTotal: int32 [B] in host memory, the shard's first global key
  // position and each sequence's full key count. On error nothing is written. The CPU backend implements them; the
  // GPU backends throw UNSUPPORTED (run the calls on a CPU context over host copies of q and k).

  /**
   * Context-parallel step 1: outMax F64 [B, Hq] receives the largest selection score over the shard's candidates
   * (-Infinity where it has none). Combine across shards with an element-wise max.
   */
  public void cpSelectMax(AttentionArgs args, Policy policy, Tensor kvStart, Tensor kvTotal, Tensor outMax) {
    try {
      SparsaNative.sparsa_cp_select_max(handle(), args.raw(), Policy.nativeOf(policy), Tensor.descriptorOf(kvStart),
          Tensor.descriptorOf(kvTotal), Tensor.descriptorOf(outMax));
    } finally {
      Reference.reachabilityFence(new Object[] {args, policy, kvStart, kvTotal, outMax});
    }
  }

  /**
   * Context-parallel step 2: from globalMax F64 [B, Hq] (the max over shards), outSum I64 [B, Hq, CP_SUM_DIGITS]
   * receives the shard's normaliser as fixed-point digits. Combine across shards with an element-wise long sum.
   */
  public void cpSelectSum(AttentionArgs args, Policy policy, Tensor kvStart, Tensor kvTotal, Tensor globalMax,
      Tensor outSum) {
    try {
      SparsaNative.sparsa_cp_select_sum(handle(), args.raw(), Policy.nativeOf(policy), Tensor.descriptorOf(kvStart),
          Tensor.descriptorOf(kvTotal), Tensor.descriptorOf(globalMax), Tensor.descriptorOf(outSum));
    } finally {
      Reference.reachabilityFence(new Object[] {args, policy, kvStart, kvTotal, globalMax, outSum});
    }
  }

  /**
   * Context-parallel step 3: from globalMax and globalSum I64 [B, Hq, CP_SUM_DIGITS] (the sum over shards), the
   * shard's best candidates: outVotes F64 and outPositions int32 [B, nSets, topK] (global positions; -Infinity and
   * -1 past the shard's candidates). nSets is 1, or Hkv with selectPerKvHead. All-gather both to
   * [G, B, nSets, topK] (any shard order).
   */
  public void cpSelectTopk(AttentionArgs args, Policy policy, Tensor kvStart, Tensor kvTotal, Tensor globalMax,
      Tensor globalSum, Tensor outVotes, Tensor outPositions) {
    try {
      SparsaNative.sparsa_cp_select_topk(handle(), args.raw(), Policy.nativeOf(policy), Tensor.descriptorOf(kvStart),
          Tensor.descriptorOf(kvTotal), Tensor.descriptorOf(globalMax), Tensor.descriptorOf(globalSum),
          Tensor.descriptorOf(outVotes), Tensor.descriptorOf(outPositions));
    } finally {
      Reference.reachabilityFence(
          new Object[] {args, policy, kvStart, kvTotal, globalMax, globalSum, outVotes, outPositions});
    }
  }

  /**
   * Context-parallel step 4: from every shard's gathered votes F64 and positions int32 [G, B, nSets, topK],
   * outIndices int32 [B, nSets, cap] receives the shard's part of the index set as local key ids (ascending,
   * -1-padded; cap must hold min(L_b, n_init + top_k + n_local) ids). A TOKEN_INDICES run with these indices and an
   * LSE output then gives the shard's partial state; merge the shards' states with {@link #mergeStates}.
   */
  public void cpSelectIndices(AttentionArgs args, Policy policy, Tensor kvStart, Tensor kvTotal, Tensor allVotes,
      Tensor allPositions, Tensor outIndices) {
    try {
      SparsaNative.sparsa_cp_select_indices(handle(), args.raw(), Policy.nativeOf(policy),
          Tensor.descriptorOf(kvStart), Tensor.descriptorOf(kvTotal), Tensor.descriptorOf(allVotes),
          Tensor.descriptorOf(allPositions), Tensor.descriptorOf(outIndices));
    } finally {
      Reference.reachabilityFence(
          new Object[] {args, policy, kvStart, kvTotal, allVotes, allPositions, outIndices});
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
