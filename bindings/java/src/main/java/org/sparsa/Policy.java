package org.sparsa;

import org.sparsa.jni.SparsaNative;
import org.sparsa.jni.sparsa_policy;

/**
 * An immutable selection policy (mirror of {@code sparsa_policy}): {@code Policy.builder(PolicyKind.SPARGE)
 * .spargeTheta(0.5f).build()}. The builder starts from {@code sparsa_policy_init(kind)}'s defaults. Tensor fields
 * are kept referenced by the policy and read during each call. Generated once from the field list of sparsa.h;
 * keep it in step with the header.
 */
public final class Policy {
  /** Bit of {@link Builder#flags}: the Δ-Attention correction (§8). */
  public static final int FLAG_DELTA = 1;

  private final sparsa_policy raw;
  private final Tensor blockMask;
  private final Tensor spargeHeadParams;
  private final Tensor indices;
  private final Tensor headMap;

  private Policy(Builder builder) {
    raw = new sparsa_policy();
    SparsaNative.sparsa_java_policy_copy(raw, builder.raw);
    this.blockMask = builder.blockMask;
    this.spargeHeadParams = builder.spargeHeadParams;
    this.indices = builder.indices;
    this.headMap = builder.headMap;
  }

  /** A builder holding every default of {@code kind}. */
  public static Builder builder(PolicyKind kind) {
    return new Builder(kind.code());
  }

  /** A builder from a raw kind value (an unknown kind throws INVALID_ARGUMENT from the library). */
  public static Builder builder(int kind) {
    return new Builder(kind);
  }

  static sparsa_policy nativeOf(Policy policy) {
    return policy == null ? null : policy.raw;
  }

  public int kindCode() {
    return raw.getKind();
  }

  /** OR of FLAG_* bits. */
  public int flags() {
    return (int) raw.getFlags();
  }

  /** SINK_WINDOW: leading keys every row sees. */
  public int sinkTokens() {
    return raw.getSink_tokens();
  }

  /** SINK_WINDOW: local window width in keys. */
  public int sinkWindow() {
    return raw.getSink_window();
  }

  /** BLOCK_SPARSE/SPARGE: query rows per block. */
  public int blockQ() {
    return raw.getBlock_q();
  }

  /** BLOCK_SPARSE/SPARGE: keys per block. */
  public int blockK() {
    return raw.getBlock_k();
  }

  /** SPARGE: self-similarity threshold in [-1, 1]. */
  public float spargeTheta() {
    return raw.getSparge_theta();
  }

  /** SPARGE: TopCdf mass in (0, 1]. */
  public float spargeTau() {
    return raw.getSparge_tau();
  }

  /** SPARGE: > 0 selects the top-k variant. */
  public float spargeTopkFraction() {
    return raw.getSparge_topk_fraction();
  }

  /** SPARGE: PV-skip threshold (<= 0; -infinity = off). */
  public float spargeLambda() {
    return raw.getSparge_lambda();
  }

  /** SPARGE: always keep key block 0. */
  public boolean spargeAttentionSink() {
    return raw.getSparge_attention_sink() != 0;
  }

  /** SPARGE: int8 Q·Kᵀ path. */
  public boolean spargeQuantized() {
    return raw.getSparge_quantized() != 0;
  }

  /** TOKEN_SPARSE: scoring window of last queries. */
  public int tokenSparseWindow() {
    return raw.getToken_sparse_window();
  }

  /** TOKEN_SPARSE: odd avg-pool kernel. */
  public int tokenSparsePoolKernel() {
    return raw.getToken_sparse_pool_kernel();
  }

  /** TOKEN_SPARSE: dropped score mass in [0, 1]. */
  public float tokenSparseCoverage() {
    return raw.getToken_sparse_coverage();
  }

  /** TOKEN_SPARSE: minimum budget. */
  public int tokenSparseMinTokens() {
    return raw.getToken_sparse_min_tokens();
  }

  /** TOKEN_SELECT: leading tokens always kept. */
  public int selectNInit() {
    return raw.getSelect_n_init();
  }

  /** TOKEN_SELECT: trailing tokens always kept. */
  public int selectNLocal() {
    return raw.getSelect_n_local();
  }

  /** TOKEN_SELECT: selected candidates. */
  public int selectTopK() {
    return raw.getSelect_top_k();
  }

  /** TOKEN_SELECT: score with scale · q̄·k. */
  public boolean selectScaleScores() {
    return raw.getSelect_scale_scores() != 0;
  }

  /** TOKEN_SELECT: cosine threshold of the cache. */
  public float selectCacheTheta() {
    return raw.getSelect_cache_theta();
  }

  /** TOKEN_SELECT: one selection per kv head. */
  public boolean selectPerKvHead() {
    return raw.getSelect_per_kv_head() != 0;
  }

  /** TOKEN_INDICES: 1 = token ids, > 1 = block ids. */
  public int indexBlockSize() {
    return raw.getIndex_block_size();
  }

  /** TOKEN_INDICES: leading tokens always included. */
  public int indexNInit() {
    return raw.getIndex_n_init();
  }

  /** TOKEN_INDICES: trailing tokens always included. */
  public int indexNLocal() {
    return raw.getIndex_n_local();
  }

  /** DELTA: stride of the dense anchor rows. */
  public int deltaGamma() {
    return raw.getDelta_gamma();
  }

  /** DELTA: minimum dense tail rows. */
  public int deltaTailMin() {
    return raw.getDelta_tail_min();
  }

  /** BLOCK_SPARSE: uint8 [B, Hq, ceil(Sq/block_q), ceil(Skv/block_k)]; null = absent. */
  public Tensor blockMask() {
    return blockMask;
  }

  /** SPARGE: optional f32 [Hq, 4] per-head (theta, tau, topk_fraction, lambda); null = absent. */
  public Tensor spargeHeadParams() {
    return spargeHeadParams;
  }

  /** TOKEN_INDICES: int32 [B, H_idx, k] token or block ids, -1 = unused; null = absent. */
  public Tensor indices() {
    return indices;
  }

  /** TOKEN_INDICES: optional int32 [Hq], the row of indices each query head uses; null = absent. */
  public Tensor headMap() {
    return headMap;
  }

  /** Sets the fields of a policy; {@link #build()} snapshots them (the builder may be reused). */
  public static final class Builder {
    private final sparsa_policy raw = new sparsa_policy();
    private Tensor blockMask;
    private Tensor spargeHeadParams;
    private Tensor indices;
    private Tensor headMap;

    private Builder(int kind) {
      SparsaNative.sparsa_java_policy_init(raw, kind);
    }

    /** OR of Policy.FLAG_* bits. */
    public Builder flags(int value) {
      raw.setFlags(Integer.toUnsignedLong(value));
      return this;
    }

    /** SINK_WINDOW: leading keys every row sees. */
    public Builder sinkTokens(int value) {
      raw.setSink_tokens(value);
      return this;
    }

    /** SINK_WINDOW: local window width in keys. */
    public Builder sinkWindow(int value) {
      raw.setSink_window(value);
      return this;
    }

    /** BLOCK_SPARSE/SPARGE: query rows per block. */
    public Builder blockQ(int value) {
      raw.setBlock_q(value);
      return this;
    }

    /** BLOCK_SPARSE/SPARGE: keys per block. */
    public Builder blockK(int value) {
      raw.setBlock_k(value);
      return this;
    }

    /** SPARGE: self-similarity threshold in [-1, 1]. */
    public Builder spargeTheta(float value) {
      raw.setSparge_theta(value);
      return this;
    }

    /** SPARGE: TopCdf mass in (0, 1]. */
    public Builder spargeTau(float value) {
      raw.setSparge_tau(value);
      return this;
    }

    /** SPARGE: > 0 selects the top-k variant. */
    public Builder spargeTopkFraction(float value) {
      raw.setSparge_topk_fraction(value);
      return this;
    }

    /** SPARGE: PV-skip threshold (<= 0; -infinity = off). */
    public Builder spargeLambda(float value) {
      raw.setSparge_lambda(value);
      return this;
    }

    /** SPARGE: always keep key block 0. */
    public Builder spargeAttentionSink(boolean value) {
      raw.setSparge_attention_sink(value ? 1 : 0);
      return this;
    }

    /** SPARGE: int8 Q·Kᵀ path. */
    public Builder spargeQuantized(boolean value) {
      raw.setSparge_quantized(value ? 1 : 0);
      return this;
    }

    /** TOKEN_SPARSE: scoring window of last queries. */
    public Builder tokenSparseWindow(int value) {
      raw.setToken_sparse_window(value);
      return this;
    }

    /** TOKEN_SPARSE: odd avg-pool kernel. */
    public Builder tokenSparsePoolKernel(int value) {
      raw.setToken_sparse_pool_kernel(value);
      return this;
    }

    /** TOKEN_SPARSE: dropped score mass in [0, 1]. */
    public Builder tokenSparseCoverage(float value) {
      raw.setToken_sparse_coverage(value);
      return this;
    }

    /** TOKEN_SPARSE: minimum budget. */
    public Builder tokenSparseMinTokens(int value) {
      raw.setToken_sparse_min_tokens(value);
      return this;
    }

    /** TOKEN_SELECT: leading tokens always kept. */
    public Builder selectNInit(int value) {
      raw.setSelect_n_init(value);
      return this;
    }

    /** TOKEN_SELECT: trailing tokens always kept. */
    public Builder selectNLocal(int value) {
      raw.setSelect_n_local(value);
      return this;
    }

    /** TOKEN_SELECT: selected candidates. */
    public Builder selectTopK(int value) {
      raw.setSelect_top_k(value);
      return this;
    }

    /** TOKEN_SELECT: score with scale · q̄·k. */
    public Builder selectScaleScores(boolean value) {
      raw.setSelect_scale_scores(value ? 1 : 0);
      return this;
    }

    /** TOKEN_SELECT: cosine threshold of the cache. */
    public Builder selectCacheTheta(float value) {
      raw.setSelect_cache_theta(value);
      return this;
    }

    /** TOKEN_SELECT: one selection per kv head. */
    public Builder selectPerKvHead(boolean value) {
      raw.setSelect_per_kv_head(value ? 1 : 0);
      return this;
    }

    /** TOKEN_INDICES: 1 = token ids, > 1 = block ids. */
    public Builder indexBlockSize(int value) {
      raw.setIndex_block_size(value);
      return this;
    }

    /** TOKEN_INDICES: leading tokens always included. */
    public Builder indexNInit(int value) {
      raw.setIndex_n_init(value);
      return this;
    }

    /** TOKEN_INDICES: trailing tokens always included. */
    public Builder indexNLocal(int value) {
      raw.setIndex_n_local(value);
      return this;
    }

    /** DELTA: stride of the dense anchor rows. */
    public Builder deltaGamma(int value) {
      raw.setDelta_gamma(value);
      return this;
    }

    /** DELTA: minimum dense tail rows. */
    public Builder deltaTailMin(int value) {
      raw.setDelta_tail_min(value);
      return this;
    }

    /** BLOCK_SPARSE: uint8 [B, Hq, ceil(Sq/block_q), ceil(Skv/block_k)]; null = absent. */
    public Builder blockMask(Tensor value) {
      blockMask = value;
      raw.setBlock_mask(Tensor.descriptorOf(value));
      return this;
    }

    /** SPARGE: optional f32 [Hq, 4] per-head (theta, tau, topk_fraction, lambda); null = absent. */
    public Builder spargeHeadParams(Tensor value) {
      spargeHeadParams = value;
      raw.setSparge_head_params(Tensor.descriptorOf(value));
      return this;
    }

    /** TOKEN_INDICES: int32 [B, H_idx, k] token or block ids, -1 = unused; null = absent. */
    public Builder indices(Tensor value) {
      indices = value;
      raw.setIndices(Tensor.descriptorOf(value));
      return this;
    }

    /** TOKEN_INDICES: optional int32 [Hq], the row of indices each query head uses; null = absent. */
    public Builder headMap(Tensor value) {
      headMap = value;
      raw.setHead_map(Tensor.descriptorOf(value));
      return this;
    }

    public Policy build() {
      return new Policy(this);
    }
  }
}
