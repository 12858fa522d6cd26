package org.sparsa;

import org.sparsa.jni.SparsaNative;
import org.sparsa.jni.sparsa_attention_args;

/**
 * Immutable arguments of one attention run (mirror of {@code sparsa_attention_args}), made with
 * {@link #builder()}. Shapes (§0): q [B, Sq, Hq, D]; k, v [B, Skv, Hkv, D]; out like q; see sparsa.h for the
 * varlen, paged and introspection tensors. The tensors are kept referenced and read or written during each run.
 */
public final class AttentionArgs {
  private final sparsa_attention_args raw;
  private final Object[] kept; // the tensors and cache the native struct points at
  private final SelectionCache cache;

  private AttentionArgs(Builder builder) {
    raw = new sparsa_attention_args();
    SparsaNative.sparsa_java_attention_args_copy(raw, builder.raw);
    kept = builder.kept.clone();
    cache = (SelectionCache) kept[Builder.SELECTION_CACHE];
  }

  public static Builder builder() {
    return new Builder();
  }

  /** The native arguments; refuses a closed selection cache (its native memory is gone). */
  sparsa_attention_args raw() {
    if (cache != null) {
      cache.handle();
    }
    return raw;
  }

  /** Sets the arguments; {@link #build()} snapshots them (the builder may be reused). */
  public static final class Builder {
    private static final int Q = 0;
    private static final int K = 1;
    private static final int V = 2;
    private static final int OUT = 3;
    private static final int LSE = 4;
    private static final int CU_SEQLENS_Q = 5;
    private static final int CU_SEQLENS_K = 6;
    private static final int PAGE_TABLE = 7;
    private static final int SEQ_LENS_K = 8;
    private static final int SELECTION_CACHE = 9;
    private static final int SELECTED_INDICES = 10;
    private static final int BLOCK_MASK_OUT = 11;
    private static final int STATS = 12;
    private static final int QUERY_OFFSETS = 13;
    private static final int KEPT_COUNT = 14;

    private final sparsa_attention_args raw = new sparsa_attention_args();
    private final Object[] kept = new Object[KEPT_COUNT];

    private Builder() {
      SparsaNative.sparsa_java_attention_args_init(raw);
    }

    /** Queries (required). */
    public Builder q(Tensor value) {
      kept[Q] = value;
      raw.setQ(Tensor.descriptorOf(value));
      return this;
    }

    /** Keys, or the paged key cache (required). */
    public Builder k(Tensor value) {
      kept[K] = value;
      raw.setK(Tensor.descriptorOf(value));
      return this;
    }

    /** Values, same layout as k (required). */
    public Builder v(Tensor value) {
      kept[V] = value;
      raw.setV(Tensor.descriptorOf(value));
      return this;
    }

    /** Output, q's shape and dtype (required). */
    public Builder out(Tensor value) {
      kept[OUT] = value;
      raw.setOut(Tensor.descriptorOf(value));
      return this;
    }

    /** Optional F32 natural-log LSE output [B, Hq, Sq] ([Hq, Tq] packed). */
    public Builder lse(Tensor value) {
      kept[LSE] = value;
      raw.setLse(Tensor.descriptorOf(value));
      return this;
    }

    /** Bottom-right causal mask. */
    public Builder causal(boolean value) {
      raw.setCausal(value ? 1 : 0);
      return this;
    }

    /** Score scale; 0 (default) = 1/sqrt(D). */
    public Builder softmaxScale(float value) {
      raw.setSoftmax_scale(value);
      return this;
    }

    /** Optional int32 [B+1] offsets of each sequence in packed q/out. */
    public Builder cuSeqlensQ(Tensor value) {
      kept[CU_SEQLENS_Q] = value;
      raw.setCu_seqlens_q(Tensor.descriptorOf(value));
      return this;
    }

    /** Optional int32 [B+1] offsets of each sequence in packed k/v. */
    public Builder cuSeqlensK(Tensor value) {
      kept[CU_SEQLENS_K] = value;
      raw.setCu_seqlens_k(Tensor.descriptorOf(value));
      return this;
    }

    /** Optional int32 [B, max_pages] page table of paged k/v caches. */
    public Builder pageTable(Tensor value) {
      kept[PAGE_TABLE] = value;
      raw.setPage_table(Tensor.descriptorOf(value));
      return this;
    }

    /** Optional int32 [B] key count of each sequence. */
    public Builder seqLensK(Tensor value) {
      kept[SEQ_LENS_K] = value;
      raw.setSeq_lens_k(Tensor.descriptorOf(value));
      return this;
    }

    /** TOKEN_SELECT's selection cache; null = none. */
    public Builder selectionCache(SelectionCache value) {
      kept[SELECTION_CACHE] = value;
      raw.setSelection_cache(value == null ? null : value.handle());
      return this;
    }

    /** Optional int32 [B, H_sel, cap] output: the index set each (sequence, head) attended to. */
    public Builder selectedIndices(Tensor value) {
      kept[SELECTED_INDICES] = value;
      raw.setSelected_indices(Tensor.descriptorOf(value));
      return this;
    }

    /** Optional uint8 output: the block mask SPARGE predicted. */
    public Builder blockMaskOut(Tensor value) {
      kept[BLOCK_MASK_OUT] = value;
      raw.setBlock_mask_out(Tensor.descriptorOf(value));
      return this;
    }

    /** Optional int64 [n] output: the first n counters of {@link Stat}. */
    public Builder stats(Tensor value) {
      kept[STATS] = value;
      raw.setStats(Tensor.descriptorOf(value));
      return this;
    }

    /**
     * Optional int32 [B]: the offset o of each sequence (row i aligned with key i + o); null = bottom-right. Read by
     * DENSE, SINK_WINDOW, BLOCK_SPARSE, SPARGE and TOKEN_INDICES without Δ.
     */
    public Builder queryOffsets(Tensor value) {
      kept[QUERY_OFFSETS] = value;
      raw.setQuery_offsets(Tensor.descriptorOf(value));
      return this;
    }

    public AttentionArgs build() {
      return new AttentionArgs(this);
    }
  }

  /** Indices into the stats output (values of {@code sparsa_stat_index}). */
  public static final class Stat {
    public static final int PAIRS_COMPUTED = 0;
    public static final int PAIRS_DENSE = 1;
    public static final int BLOCKS_COMPUTED = 2;
    public static final int BLOCKS_TOTAL = 3;
    public static final int PV_BLOCKS_SKIPPED = 4;
    public static final int CACHE_HITS = 5;
    public static final int CACHE_MISSES = 6;
    public static final int COUNT = 7;

    private Stat() {}
  }
}
