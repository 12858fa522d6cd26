/*
 * sparsa.h — the public C API of sparsa, a sparse-attention kernel library.
 *
 * This header is the whole contract. It is C99, compiles as C and as C++, and carries no C++, CUDA or HIP type
 * (streams are `void*`). Semantics of every policy are those of docs/algorithms.md (a copy of the project's
 * ALGORITHMS.md); section numbers below (§n) refer to it.
 *
 * ABI rules kept here (docs/abi.md):
 *   - every struct the caller fills starts with `uint32_t struct_size` and follows the extensible-struct rules of the
 *     Linux kernel's copy_struct_from_user (clone3, openat2), described under "Caller-filled structs" below;
 *   - enums have explicit values, are never renumbered, and cross the ABI as fixed-width integers;
 *   - a changed signature ships as a new `_v2` function, the old one stays;
 *   - only `sparsa_*` symbols are exported.
 *
 * Errors: every fallible call returns a `sparsa_status`. On failure no output tensor and no out-parameter is
 * written, and `sparsa_last_error_message()` returns a message that names the argument, what was expected and what
 * came. The message is thread-local: read it on the thread (and, for bindings, in the same native call) that failed.
 * No C++ exception crosses this API and nothing aborts.
 *
 * Threads: a `sparsa_context` and a `sparsa_selection_cache` may be used by one thread at a time; separate objects
 * on separate threads are safe. Functions that take no context and only `const` inputs are safe to call
 * concurrently. Every call that takes a context (or a selection cache, which belongs to its context) marks the
 * context in use for its duration; a call that finds it in use by another thread returns
 * SPARSA_STATUS_INVALID_ARGUMENT ("ctx: in use by a call on another thread") and does nothing, so a sharing bug
 * shows as an error rather than as wrong results. (sparsa_context_destroy cannot check this: destroying a context
 * while another thread uses it stays undefined.)
 *
 * NaN and Inf (docs/algorithms.md §0): a query row's output depends only on its own q row and on the k and v rows
 * of the keys the policy lets it see. If one of those holds a NaN or ±Inf, the row's output is all NaN and its LSE
 * NaN; a non-finite value in any row it does not see (masked by causality, window, block mask or index set) never
 * changes it. Policies that score keys to choose them (SPARGE, TOKEN_SPARSE, TOKEN_SELECT) may choose differently
 * because of a non-finite k, but never pass an unseen key's value on. Guaranteed by the CPU backend; the GPU
 * backends do not check for non-finite inputs yet.
 *
 * Memory: the library never frees or keeps caller memory past a call. Scratch memory is owned by the context: it
 * grows on demand and is reused; `sparsa_attention_plan` grows it ahead of time so that later runs of the same or
 * smaller sizes allocate nothing.
 */
#ifndef SPARSA_SPARSA_H
#define SPARSA_SPARSA_H

#include <stddef.h>
#include <stdint.h>

/* ---------------------------------------------------------------------------------------------------------------- */
/* Export macro and version                                                                                          */
/* ---------------------------------------------------------------------------------------------------------------- */

#if defined(SWIG)
#define SPARSA_API
#elif defined(_WIN32)
#if defined(SPARSA_BUILDING_LIBRARY)
#define SPARSA_API __declspec(dllexport)
#else
#define SPARSA_API __declspec(dllimport)
#endif
#else
#define SPARSA_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define SPARSA_VERSION_MAJOR 0
#define SPARSA_VERSION_MINOR 4
#define SPARSA_VERSION_PATCH 0
/** Encoded as MAJOR * 10000 + MINOR * 100 + PATCH, the same encoding `sparsa_version()` returns. */
#define SPARSA_VERSION (SPARSA_VERSION_MAJOR * 10000 + SPARSA_VERSION_MINOR * 100 + SPARSA_VERSION_PATCH)

/** Version of the loaded library, encoded as SPARSA_VERSION. Compare with SPARSA_VERSION to detect a mismatch. */
SPARSA_API uint32_t sparsa_version(void);
/** Version of the loaded library as "MAJOR.MINOR.PATCH"; a static string. */
SPARSA_API const char* sparsa_version_string(void);

/* ---------------------------------------------------------------------------------------------------------------- */
/* Status codes                                                                                                      */
/* ---------------------------------------------------------------------------------------------------------------- */

/** Return code of every fallible call (values of `sparsa_status_code`). */
typedef int32_t sparsa_status;

typedef enum sparsa_status_code {
  SPARSA_STATUS_SUCCESS = 0,
  SPARSA_STATUS_INVALID_ARGUMENT = 1,    /**< a parameter value outside its domain, or a forbidden combination */
  SPARSA_STATUS_NULL_POINTER = 2,        /**< a required pointer (or a required tensor's data) is NULL */
  SPARSA_STATUS_DTYPE_MISMATCH = 3,      /**< a tensor's dtype is unsupported or differs from its partner's */
  SPARSA_STATUS_SHAPE_MISMATCH = 4,      /**< wrong rank, wrong extent, non-unit last stride, Hq % Hkv != 0, k > N */
  SPARSA_STATUS_INDEX_OUT_OF_RANGE = 5,  /**< an index tensor holds a value outside its documented range */
  SPARSA_STATUS_DEVICE_MISMATCH = 6,     /**< a tensor lives on a device the context does not run on */
  SPARSA_STATUS_STRUCT_SIZE = 7,         /**< struct_size too small, or from a newer sparsa than the one loaded */
  SPARSA_STATUS_UNSUPPORTED = 8,         /**< valid, but not implemented by this backend (message says why) */
  SPARSA_STATUS_BACKEND_UNAVAILABLE = 9, /**< backend not compiled in, or no device/driver present */
  SPARSA_STATUS_OUT_OF_MEMORY = 10,      /**< host or device allocation failed */
  SPARSA_STATUS_DEVICE_ERROR = 11,       /**< the CUDA/HIP runtime reported an error (message carries it) */
  SPARSA_STATUS_INTERNAL = 12            /**< a bug in sparsa; please report the message */
} sparsa_status_code;

/** A static, human-readable name for a status ("SPARSA_STATUS_SHAPE_MISMATCH"); "unknown status" otherwise. */
SPARSA_API const char* sparsa_status_string(sparsa_status status);

/**
 * The detailed message of the last failed call on this thread (e.g. "k: shape [2, 4096, 8, 128] but q has
 * head_dim 64"). Every fallible call clears it on entry, so it is empty after a success. The getters that cannot
 * fail (sparsa_version, sparsa_version_string, sparsa_status_string, sparsa_dtype_size, sparsa_policy_kind_name and
 * this function) leave it alone. Valid until the next fallible sparsa call on this thread.
 */
SPARSA_API const char* sparsa_last_error_message(void);

/* ---------------------------------------------------------------------------------------------------------------- */
/* Caller-filled structs                                                                                             */
/* ---------------------------------------------------------------------------------------------------------------- */

/*
 * sparsa_tensor, sparsa_context_options, sparsa_policy, sparsa_attention_args and sparsa_sparge_tune_options start
 * with `uint32_t struct_size`, the size in bytes of the layout the caller was compiled against (its `sizeof`):
 *   - Init: every `*_init(s, size, ...)` takes the caller's size (pass `sizeof *s`, or use the SPARSA_*_INIT macros)
 *     and writes exactly `size` bytes and no more: struct_size = size, the documented defaults of the fields this
 *     sparsa knows that fit in `size`, zero beyond. A size below the struct's SPARSA_*_SIZE_V0_1 (its layout in
 *     sparsa 0.1, the first release) or above SPARSA_STRUCT_SIZE_MAX is refused with SPARSA_STATUS_STRUCT_SIZE and
 *     nothing is written.
 *   - Read: every entry point reads only the first struct_size bytes of each caller struct (tensors reached through
 *     other structs included). Fields past an older caller's struct_size take their documented defaults. A
 *     struct_size below SPARSA_*_SIZE_V0_1 or above SPARSA_STRUCT_SIZE_MAX, or a newer caller's larger struct whose
 *     bytes past this sparsa's `sizeof` are not all zero (a field this version does not know was set), fails with
 *     SPARSA_STATUS_STRUCT_SIZE and a message naming the struct and both sizes; a zero unknown tail is accepted.
 *   - Layout: new fields are only ever appended; no struct has implicit tail padding (explicit `reserved` fields pad
 *     to an 8-byte boundary, are written 0 by the init functions, are not read, and never gain a meaning), so every
 *     appended field changes `sizeof`. Sizes are those of an LP64 target (64-bit pointers).
 */

/** The largest struct_size accepted for any struct: a bound on how far past its own layout the library reads. */
#define SPARSA_STRUCT_SIZE_MAX 4096
/** sizeof of each caller-filled struct in sparsa 0.1, the smallest struct_size accepted. */
#define SPARSA_TENSOR_SIZE_V0_1 160
#define SPARSA_CONTEXT_OPTIONS_SIZE_V0_1 32
#define SPARSA_POLICY_SIZE_V0_1 152
#define SPARSA_ATTENTION_ARGS_SIZE_V0_1 120
#define SPARSA_SPARGE_TUNE_OPTIONS_SIZE_V0_1 24

/* ---------------------------------------------------------------------------------------------------------------- */
/* Tensors                                                                                                           */
/* ---------------------------------------------------------------------------------------------------------------- */

/** Element types. */
typedef enum sparsa_dtype {
  SPARSA_DTYPE_INVALID = 0,
  SPARSA_DTYPE_F32 = 1,
  SPARSA_DTYPE_F16 = 2,
  SPARSA_DTYPE_BF16 = 3,
  SPARSA_DTYPE_F64 = 4,
  SPARSA_DTYPE_I32 = 5,
  SPARSA_DTYPE_I64 = 6,
  SPARSA_DTYPE_U8 = 7,
  SPARSA_DTYPE_I8 = 8
} sparsa_dtype;

/** Device types; the values are DLPack's `DLDeviceType` codes so a DLTensor converts without a table. */
typedef enum sparsa_device_type {
  SPARSA_DEVICE_CPU = 1,
  SPARSA_DEVICE_CUDA = 2,
  SPARSA_DEVICE_CUDA_HOST = 3, /**< pinned host memory, readable by the CPU and by CUDA copies */
  SPARSA_DEVICE_ROCM = 10
} sparsa_device_type;

/** Largest rank a tensor descriptor carries. */
#define SPARSA_MAX_DIMS 8

/**
 * A non-owning view of caller memory, the same information as a DLPack `DLTensor`.
 * `data` points at element [0, ..., 0]; element [i0, ..., in] lives at `data + Σ i_k * strides[k]` elements.
 * Strides are in elements (not bytes), may be any non-negative value, and the last dimension must have stride 1
 * wherever this header says "last stride 1" (every attention tensor). Entries past `ndim` are ignored. An output
 * (anything a call writes) must not overlap itself: taken by ascending stride, each dimension of extent > 1 must
 * step past everything the smaller ones span (so no stride 0 on an extent above 1), else SHAPE_MISMATCH. Inputs may
 * be broadcast (stride 0).
 * Every call refuses (SHAPE_MISMATCH) a tensor whose element count, or whose byte span from element [0, ..., 0] to
 * the last element its strides reach, does not fit int64. Attention runs also refuse batch, head, sequence, packed
 * token and page counts above INT32_MAX (token positions are int32 in every index tensor): nothing is ever
 * truncated. Misaligned `data` is INVALID_ARGUMENT.
 * Fill it with `sparsa_tensor_init` / SPARSA_TENSOR_INIT (contiguous row-major strides), or by hand after zeroing it
 * and setting struct_size = sizeof(sparsa_tensor).
 */
typedef struct sparsa_tensor {
  uint32_t struct_size;           /**< the caller's sizeof(sparsa_tensor); set by sparsa_tensor_init */
  int32_t dtype;                  /**< sparsa_dtype */
  int32_t device_type;            /**< sparsa_device_type; default SPARSA_DEVICE_CPU */
  int32_t device_id;              /**< device ordinal; 0 for CPU; default 0 */
  int32_t ndim;                   /**< 1..SPARSA_MAX_DIMS */
  void* data;                     /**< first element, aligned to the element size; the library never frees it */
  int64_t shape[SPARSA_MAX_DIMS];   /**< extents, each >= 0 */
  int64_t strides[SPARSA_MAX_DIMS]; /**< in elements */
} sparsa_tensor;

/**
 * Fills the `size` bytes at `t` (the caller's sizeof(sparsa_tensor)) as a contiguous row-major CPU tensor of `ndim`
 * dims over `data` (device CPU, id 0), zero past the fields this sparsa knows. Returns SPARSA_STATUS_NULL_POINTER
 * for a NULL `t` or `shape`, STRUCT_SIZE for a size outside [SPARSA_TENSOR_SIZE_V0_1, SPARSA_STRUCT_SIZE_MAX],
 * SHAPE_MISMATCH for ndim outside 1..SPARSA_MAX_DIMS or a negative extent, DTYPE_MISMATCH for an unknown dtype.
 * Set device_type/device_id afterwards for device memory.
 */
SPARSA_API sparsa_status sparsa_tensor_init(sparsa_tensor* t, size_t size, void* data, int32_t dtype, int32_t ndim,
                                            const int64_t* shape);
/** sparsa_tensor_init with the caller's size: `SPARSA_TENSOR_INIT(&t, data, dtype, ndim, shape)`. */
#define SPARSA_TENSOR_INIT(t, data, dtype, ndim, shape) \
  sparsa_tensor_init((t), sizeof(*(t)), (data), (dtype), (ndim), (shape))

/** Size in bytes of one element of `dtype`; 0 for an unknown dtype. */
SPARSA_API size_t sparsa_dtype_size(int32_t dtype);

/* ---------------------------------------------------------------------------------------------------------------- */
/* Context                                                                                                           */
/* ---------------------------------------------------------------------------------------------------------------- */

typedef struct sparsa_context sparsa_context;

typedef struct sparsa_context_options {
  uint32_t struct_size; /**< the caller's sizeof(sparsa_context_options); set by sparsa_context_options_init */
  int32_t device_type;  /**< backend: SPARSA_DEVICE_CPU (default), SPARSA_DEVICE_CUDA or SPARSA_DEVICE_ROCM */
  int32_t device_id;    /**< GPU ordinal; ignored on CPU; default 0 */
  void* stream;         /**< cudaStream_t / hipStream_t every GPU run enqueues on; NULL = default stream. The
                             context's scratch memory is shared by its runs: runs of one context enqueued on
                             different streams (sparsa_context_set_stream) must not overlap in time. */
  int32_t num_threads;  /**< CPU worker threads, 0..SPARSA_MAX_NUM_THREADS; 0 (default) = one per online core
                             (at most SPARSA_MAX_NUM_THREADS); a thread the system refuses to start fails the
                             create with SPARSA_STATUS_OUT_OF_MEMORY */
  int32_t reserved0;    /**< tail padding made explicit; written 0 by init, not read */
} sparsa_context_options;

/** Largest `sparsa_context_options.num_threads` accepted (INVALID_ARGUMENT above it). */
#define SPARSA_MAX_NUM_THREADS 1024

/** Fills the `size` bytes at `options` (the caller's sizeof) with struct_size = size, the defaults above, zero
    beyond. STRUCT_SIZE for a size outside [SPARSA_CONTEXT_OPTIONS_SIZE_V0_1, SPARSA_STRUCT_SIZE_MAX]. */
SPARSA_API sparsa_status sparsa_context_options_init(sparsa_context_options* options, size_t size);
/** `SPARSA_CONTEXT_OPTIONS_INIT(&o)` = sparsa_context_options_init(&o, sizeof o). */
#define SPARSA_CONTEXT_OPTIONS_INIT(options) sparsa_context_options_init((options), sizeof(*(options)))

/**
 * Creates a context on the backend `options` names (NULL options = CPU defaults). Fails with
 * SPARSA_STATUS_BACKEND_UNAVAILABLE when that backend was not built or no device/driver is present (CPU always
 * works). `*out` is written only on success.
 */
SPARSA_API sparsa_status sparsa_context_create(const sparsa_context_options* options, sparsa_context** out);

/** Destroys a context and its scratch memory. NULL is a no-op. Waits for nothing: synchronise the stream first.
    Selection caches created with it must be destroyed before it. */
SPARSA_API void sparsa_context_destroy(sparsa_context* ctx);

/** Changes the stream later runs enqueue on (GPU backends); ignored by the CPU backend. */
SPARSA_API sparsa_status sparsa_context_set_stream(sparsa_context* ctx, void* stream);

/** The context's backend as a sparsa_device_type, written to `*device_type`. */
SPARSA_API sparsa_status sparsa_context_device_type(const sparsa_context* ctx, int32_t* device_type);

/** Bytes of scratch memory the context currently holds (host memory on CPU, device memory on GPUs). */
SPARSA_API sparsa_status sparsa_context_scratch_bytes(const sparsa_context* ctx, uint64_t* bytes);

/* ---------------------------------------------------------------------------------------------------------------- */
/* Selection cache (TokenSelect, §6.5)                                                                               */
/* ---------------------------------------------------------------------------------------------------------------- */

/**
 * State that TOKEN_SELECT keeps between calls: one slot per batch row (sequence) of one layer, holding the last
 * concatenated mean query (Hq * D floats) and the top-k selection T it produced. A run with a cache reuses T for
 * row b when cos(mean query, cached) >= select_cache_theta, and counts hits and misses. Keep one cache per layer
 * and pass sequences in the same batch order on every call. Lives on the device of the context it was made with.
 * A slot is a miss (T recomputed and stored) when it is empty, when cos < theta, when either mean query is all zero,
 * when the run's top_k or set count (per_kv_head) differs from the stored one, or when a cached id is no longer a
 * candidate of the current N (outside [n_init, N - n_local)). A row that falls back to dense attention (§6.2) or
 * has no query rows leaves its slot alone and counts neither.
 */
typedef struct sparsa_selection_cache sparsa_selection_cache;

/**
 * Creates an empty cache for up to `max_batch` sequences, `num_q_heads` query heads, `num_kv_heads` kv heads,
 * `head_dim` D and selections of up to `max_top_k` tokens per set (per kv head when select_per_kv_head is on).
 * A run whose shapes exceed these fails with SHAPE_MISMATCH. The cache allocates about max_batch · (num_q_heads ·
 * head_dim · 8 · c + num_kv_heads · max_top_k · 4) bytes here, c = 1 on the CPU and 2 on a GPU (a run writes its mean
 * query beside the cached one), OUT_OF_MEMORY when that fails; a size that does not fit int64 is INVALID_ARGUMENT.
 */
SPARSA_API sparsa_status sparsa_selection_cache_create(sparsa_context* ctx, int32_t max_batch, int32_t num_q_heads,
                                                       int32_t num_kv_heads, int32_t head_dim, int32_t max_top_k,
                                                       sparsa_selection_cache** out);
/** Empties every slot (next run of each row is a miss) and zeroes the hit/miss counts. */
SPARSA_API sparsa_status sparsa_selection_cache_reset(sparsa_selection_cache* cache);
/** Destroys the cache. NULL is a no-op. Destroy every cache before the context it was created with. */
SPARSA_API void sparsa_selection_cache_destroy(sparsa_selection_cache* cache);
/** Hits and misses counted since creation or the last reset, over all rows (either pointer may be NULL). On a GPU
    context the counts live in device memory: this call synchronises the context's stream to read them (call it
    outside CUDA-graph capture and off the hot path). */
SPARSA_API sparsa_status sparsa_selection_cache_counts(const sparsa_selection_cache* cache, int64_t* hits,
                                                       int64_t* misses);

/* ---------------------------------------------------------------------------------------------------------------- */
/* Policies                                                                                                          */
/* ---------------------------------------------------------------------------------------------------------------- */

/** Which keys each query row attends to (§1–§7). */
typedef enum sparsa_policy_kind {
  SPARSA_POLICY_DENSE = 0,         /**< §1 every (causal-)allowed key */
  SPARSA_POLICY_SINK_WINDOW = 1,   /**< §2 attention sinks + local window (StreamingLLM, Δ-Attention's base) */
  SPARSA_POLICY_BLOCK_SPARSE = 2,  /**< §3 the caller's block mask */
  SPARSA_POLICY_SPARGE = 3,        /**< §4 SpargeAttn predicted block mask, optional PV skip and int8 path */
  SPARSA_POLICY_TOKEN_SPARSE = 4,  /**< §5 Token Sparse Attention (prefill, per-head token gather) */
  SPARSA_POLICY_TOKEN_SELECT = 5,  /**< §6 TokenSelect (decode/chunked prefill, head soft vote, selection cache) */
  SPARSA_POLICY_TOKEN_INDICES = 6  /**< §7 STS: indices known in advance (e.g. from a draft model) */
} sparsa_policy_kind;

/** Bits of `sparsa_policy.flags`. */
typedef enum sparsa_policy_flag {
  /** §8 Δ-Attention correction on top of the policy (prefill; requires causal = 1; forbids LSE output). */
  SPARSA_POLICY_FLAG_DELTA = 1u << 0
} sparsa_policy_flag;

/**
 * A selection policy: `kind` plus the parameters of every kind, flat and prefixed by the kind that reads them.
 * Fields a kind does not read are ignored by it. Fill with `sparsa_policy_init(&p, sizeof p, kind)` (or
 * SPARSA_POLICY_INIT(&p, kind)), which sets struct_size and every default below, then change what you need.
 * Integer fields are counts of tokens unless stated.
 */
typedef struct sparsa_policy {
  uint32_t struct_size; /**< the caller's sizeof(sparsa_policy); set by sparsa_policy_init */
  int32_t kind;         /**< sparsa_policy_kind */
  uint32_t flags;       /**< OR of sparsa_policy_flag; default 0 */

  /* SINK_WINDOW (§2). Causal: key j visible iff j <= i+o and (j < sink_tokens or (i+o)-j < sink_window);
     non-causal: j < sink_tokens or |i+o-j| < sink_window. */
  int32_t sink_tokens; /**< leading keys every row sees; >= 0; default 128 */
  int32_t sink_window; /**< local window width in keys; >= 0; default 2048 */

  /* BLOCK_SPARSE (§3) and SPARGE (§4). */
  int32_t block_q; /**< query rows per block; > 0; default 128 */
  int32_t block_k; /**< keys per block; > 0; default 64 */
  /** BLOCK_SPARSE input: uint8 [B, Hq, ceil(Sq/block_q), ceil(Skv/block_k)] of 0/1 (varlen: max lengths).
      Key j visible to row i iff mask[b, h, i/block_q, j/block_k] != 0 (and causal-allowed when causal). */
  const sparsa_tensor* block_mask;

  /* SPARGE (§4). */
  /** self-similarity threshold, in [-1, 1]; a block is self-similar iff its sim (in [0, 1]; an all-zero row counts
      as a zero vector) > theta, so theta = 1 keeps every block (dense); default 0.6 */
  float sparge_theta;
  float sparge_tau;            /**< TopCdf mass, in (0, 1]; read when sparge_topk_fraction == 0; default 0.98 */
  float sparge_topk_fraction;  /**< in [0, 1]; > 0 selects the top-k variant instead of TopCdf; default 0 */
  float sparge_lambda;         /**< PV-skip threshold, natural-log units, <= 0; -INFINITY (default) = off */
  int32_t sparge_attention_sink; /**< 1 = always keep key block 0; default 0 */
  /** 1 = Sage path: int8 Q·Kᵀ with centred K (§4, quantized path; round half to even); scale·q·mean(K) is added
      back, so LSE is that of the uncentred scores. P·V: the CPU keeps V unquantized; a CUDA device of compute
      capability >= 8.9 that runs this build's sm_90a code (Hopper) uses fp8 e4m3 P and V (V scaled per channel;
      about 3 % relative error on zero-mean data), other GPUs fp16/bf16; default 0 */
  int32_t sparge_quantized;
  /** Optional per-head overrides: f32 [Hq, 4] holding (theta, tau, topk_fraction, lambda) per query head; a NaN
      entry falls back to the scalar field. `sparsa_sparge_tune` writes exactly this layout. */
  const sparsa_tensor* sparge_head_params;

  /* TOKEN_SPARSE (§5). Always causal; requires Sq == Skv per sequence. */
  int32_t token_sparse_window;      /**< W, the scoring window of last queries; > 0; default 128 */
  int32_t token_sparse_pool_kernel; /**< odd avg-pool kernel; > 0; default 7 */
  float token_sparse_coverage;      /**< τ, dropped score mass, in [0, 1]; 0 = dense; default 0.005 */
  int32_t token_sparse_min_tokens;  /**< minimum budget; >= 0; default 1024 */

  /* TOKEN_SELECT (§6). Always causal (bottom-right), so decode callers may leave causal = 0. */
  int32_t select_n_init;      /**< leading tokens always kept; >= 0; default 128 */
  int32_t select_n_local;     /**< trailing tokens always kept; >= 0; default 512 */
  int32_t select_top_k;       /**< selected candidates; > 0; default 2048 */
  int32_t select_scale_scores; /**< 1 = score with scale · q̄·k instead of the raw dot product; default 0 */
  float select_cache_theta;   /**< cosine threshold of the selection cache, in [-1, 1]; >= 1 disables; default 0.9 */
  int32_t select_per_kv_head; /**< 1 = one selection per kv head (vote over its group); default 0 = shared */

  /* TOKEN_INDICES (§7). Always causal (bottom-right), like TOKEN_SELECT. */
  /** int32 [B, H_idx, k]: token ids (index_block_size == 1) or block ids, -1 = unused slot. Any other value
      outside [0, N) (token ids) or [0, ceil(N/index_block_size)) (block ids): in host memory the run fails with
      SPARSA_STATUS_INDEX_OUT_OF_RANGE and writes nothing; in device memory the contents are not read by the host
      (that would need a synchronisation), so such a value is ignored like -1 (no error, never read out of bounds).
      The same holds for head_map entries outside [0, H_idx). */
  const sparsa_tensor* indices;
  /** Optional int32 [Hq]: row of `indices` each query head uses, in [0, H_idx); NULL = h / (Hq / H_idx). */
  const sparsa_tensor* head_map;
  int32_t index_block_size; /**< 1 = token ids; > 1 = block ids covering [id*bs, (id+1)*bs); default 1 */
  int32_t index_n_init;     /**< leading tokens always included; >= 0; default 0 */
  int32_t index_n_local;    /**< trailing tokens always included; >= 0; default 0 */

  /* DELTA (§8), read when flags has SPARSA_POLICY_FLAG_DELTA. */
  int32_t delta_gamma;    /**< stride of the dense anchor rows; > 0; default 64 */
  int32_t delta_tail_min; /**< minimum dense tail rows; >= 0; default 128 */
  int32_t reserved0;      /**< tail padding made explicit; written 0 by init, not read */
} sparsa_policy;

/** Fills the `size` bytes at `policy` (the caller's sizeof) with struct_size = size, `kind`, flags 0, every default
    above, zero beyond. INVALID_ARGUMENT for an unknown kind; STRUCT_SIZE for a size outside
    [SPARSA_POLICY_SIZE_V0_1, SPARSA_STRUCT_SIZE_MAX]. */
SPARSA_API sparsa_status sparsa_policy_init(sparsa_policy* policy, size_t size, int32_t kind);
/** `SPARSA_POLICY_INIT(&p, kind)` = sparsa_policy_init(&p, sizeof p, kind). */
#define SPARSA_POLICY_INIT(policy, kind) sparsa_policy_init((policy), sizeof(*(policy)), (kind))

/** A static name for a policy kind ("DENSE", "SPARGE", ...); "unknown" otherwise. */
SPARSA_API const char* sparsa_policy_kind_name(int32_t kind);

/* ---------------------------------------------------------------------------------------------------------------- */
/* The attention run                                                                                                 */
/* ---------------------------------------------------------------------------------------------------------------- */

/** Indices into the optional `stats` output of a run (int64 counters). */
typedef enum sparsa_stat_index {
  SPARSA_STAT_PAIRS_COMPUTED = 0,  /**< query·key pairs whose score was computed (incl. λ-skipped tiles; with Δ,
                                        plus the pairs of its dense anchor and tail rows) */
  SPARSA_STAT_PAIRS_DENSE = 1,     /**< pairs dense attention with the same causal flag would compute */
  /** (query block, key block) tiles with at least one visible pair: BLOCK_SPARSE and SPARGE at block_q × block_k,
      DENSE and SINK_WINDOW on a fixed 128 × 64 reference grid (the same on every backend, whatever tiles a
      kernel runs: the CUDA wgmma kernel computes 128 × 128 tiles); 0 for the token policies */
  SPARSA_STAT_BLOCKS_COMPUTED = 2,
  SPARSA_STAT_BLOCKS_TOTAL = 3,    /**< tiles dense attention would compute at the same tiling (else 0) */
  SPARSA_STAT_PV_BLOCKS_SKIPPED = 4, /**< tiles whose PV product the SPARGE λ test skipped */
  SPARSA_STAT_CACHE_HITS = 5,      /**< selection-cache hits in this run (TOKEN_SELECT) */
  SPARSA_STAT_CACHE_MISSES = 6,    /**< selection-cache misses in this run (TOKEN_SELECT with a cache) */
  SPARSA_STAT_COUNT = 7            /**< number of counters defined by this version */
} sparsa_stat_index;

/**
 * Arguments of one attention run. Tensor pointers are borrowed for the call only; NULL means "absent".
 * Shapes (§0): q [B, Sq, Hq, D]; k, v [B, Skv, Hkv, D]; out [B, Sq, Hq, D]; last stride 1, other strides free.
 * Varlen: with cu_seqlens_q, q/out are packed [Tq, Hq, D]; with cu_seqlens_k, k/v are packed [Tk, Hkv, D].
 * Paged KV: with page_table, k/v are caches [P, page_size, Hkv, D] and seq_lens_k gives each sequence's length.
 * Dtypes: q, k, v, out share one of F32, F16, BF16 (fp32 accumulation always); lse is F32.
 */
typedef struct sparsa_attention_args {
  uint32_t struct_size; /**< the caller's sizeof(sparsa_attention_args); set by sparsa_attention_args_init */

  const sparsa_tensor* q;   /**< in: queries (required) */
  const sparsa_tensor* k;   /**< in: keys, or the paged key cache (required) */
  const sparsa_tensor* v;   /**< in: values, same layout as k (required) */
  const sparsa_tensor* out; /**< out: attention output, q's shape and dtype (required); every element written */
  /** out, optional: f32 natural-log LSE [B, Hq, Sq] ([Hq, Tq] with cu_seqlens_q); -inf for a row that sees no key.
      Forbidden with SPARSA_POLICY_FLAG_DELTA (undefined for corrected rows, §8). */
  const sparsa_tensor* lse;

  int32_t causal;      /**< 1 = bottom-right causal mask (§0); default 0. TOKEN_SPARSE, TOKEN_SELECT and
                            TOKEN_INDICES are causal by definition (§5–§7) and treat 0 as 1 */
  float softmax_scale; /**< score scale; 0 (default) = 1/sqrt(D); otherwise finite and > 0 */

  /** in, optional: int32 [B+1] prefix offsets of each sequence's rows in packed q/out (non-decreasing, from 0). */
  const sparsa_tensor* cu_seqlens_q;
  /** in, optional: int32 [B+1] prefix offsets of each sequence's keys in packed k/v. Not with page_table. */
  const sparsa_tensor* cu_seqlens_k;
  /** in, optional: int32 [B, max_pages]; token t of sequence b lives at page page_table[b][t / page_size], slot
      t % page_size of the caches. The first ceil(seq_lens_k[b] / page_size) entries of row b must be page ids in
      [0, P); later entries are never read (-1 padding is fine). In host memory an id outside [0, P) among the
      entries read is SPARSA_STATUS_INDEX_OUT_OF_RANGE; in device memory it is not checked (that would need a
      synchronisation) and is undefined behaviour, as in FlashAttention and FlashInfer. Requires seq_lens_k. */
  const sparsa_tensor* page_table;
  /** in, optional: int32 [B], each sequence's key count. Required with page_table; with padded k/v it shortens
      each sequence (values in [0, Skv]). */
  const sparsa_tensor* seq_lens_k;

  /** in/out, optional: TokenSelect's selection cache (§6.5); NULL (default) = no cache. */
  sparsa_selection_cache* selection_cache;

  /* Introspection outputs (optional; NULL = not written). */
  /** out: int32 [B, H_sel, cap], the sorted index set each (sequence, head) attended to, -1-padded:
      TOKEN_SELECT H_sel = 1 (shared) or Hkv (select_per_kv_head), TOKEN_SPARSE and TOKEN_INDICES H_sel = Hq.
      `cap` must be at least the largest set the policy can produce (TOKEN_SELECT n_init+top_k+n_local, or N when
      it falls back to dense; TOKEN_SPARSE and TOKEN_INDICES N). Other policies: SPARSA_STATUS_UNSUPPORTED. */
  const sparsa_tensor* selected_indices;
  /** out: uint8 [B, Hq, ceil(Sq/block_q), ceil(Skv/block_k)] (varlen: max lengths, 0 outside each sequence's
      part): the block mask SPARGE predicted (after forced rows, columns and causal pruning). Other policies:
      SPARSA_STATUS_UNSUPPORTED. */
  const sparsa_tensor* block_mask_out;
  /** out: int64 [n], n >= 1, on the run's device: the first min(n, SPARSA_STAT_COUNT) counters of
      sparsa_stat_index. Achieved sparsity = 1 - PAIRS_COMPUTED / PAIRS_DENSE. */
  const sparsa_tensor* stats;

  /* Appended after sparsa 0.1 (an older caller's struct_size ends before them: they take their defaults). */
  /** in, optional: int32 [B], the offset o of §0 per sequence: row i of sequence b is aligned with key i + o[b], so
      causally it sees keys j <= i + o[b], and SINK_WINDOW measures its window from i + o[b]. NULL (default) = the
      bottom-right alignment Skv_b - Sq_b. Lets a run cover rows [o, o + Sq) of a longer sequence whose keys it is
      given in full (context-parallel prefill: a shard's query rows against every key, SPARGE predicting the mask
      of the whole sequence), or rows that lie after a shard's keys (context-parallel decode of several rows). Read
      by DENSE, SINK_WINDOW, BLOCK_SPARSE, SPARGE and TOKEN_INDICES (whose n_local still counts from Skv_b) without
      SPARSA_POLICY_FLAG_DELTA; with TOKEN_SPARSE, TOKEN_SELECT or DELTA: SPARSA_STATUS_UNSUPPORTED. Values outside [-Sq_b, Skv_b] (where every row
      sees no key, or every key, causally): in host memory SPARSA_STATUS_INDEX_OUT_OF_RANGE; in device memory they
      are not read by the host and act as the nearer end of that range. */
  const sparsa_tensor* query_offsets;
} sparsa_attention_args;

/** Fills the `size` bytes at `args` (the caller's sizeof) with struct_size = size and the defaults above (every
    pointer NULL, causal 0, softmax_scale 0), zero beyond. STRUCT_SIZE for a size outside
    [SPARSA_ATTENTION_ARGS_SIZE_V0_1, SPARSA_STRUCT_SIZE_MAX]. */
SPARSA_API sparsa_status sparsa_attention_args_init(sparsa_attention_args* args, size_t size);
/** `SPARSA_ATTENTION_ARGS_INIT(&a)` = sparsa_attention_args_init(&a, sizeof a). */
#define SPARSA_ATTENTION_ARGS_INIT(args) sparsa_attention_args_init((args), sizeof(*(args)))

/**
 * Computes `out` (and the optional outputs) for one attention call under `policy` (NULL = DENSE defaults).
 * Validates every argument first; on any error nothing is written. On GPU backends it only enqueues on the
 * context's stream: no host synchronisation, and no allocation once planned or warmed up.
 */
SPARSA_API sparsa_status sparsa_attention_run(sparsa_context* ctx, const sparsa_attention_args* args,
                                              const sparsa_policy* policy);

/**
 * Validates like sparsa_attention_run and grows the context's scratch memory for this problem, computing nothing.
 * After it, runs of the same shapes and policy allocate nothing (required before CUDA graph capture).
 */
SPARSA_API sparsa_status sparsa_attention_plan(sparsa_context* ctx, const sparsa_attention_args* args,
                                               const sparsa_policy* policy);

/* ---------------------------------------------------------------------------------------------------------------- */
/* Utilities                                                                                                         */
/* ---------------------------------------------------------------------------------------------------------------- */

/**
 * Merges two partial attention states over disjoint key sets (§0): with m = max(lse_a, lse_b),
 * w_x = exp(lse_x - m): out = (w_a o_a + w_b o_b) / (w_a + w_b), out_lse = m + log(w_a + w_b); both -inf gives 0 and
 * -inf. o_*: [B, S, H, D] (or packed [T, H, D]) of F32/F16/BF16, all the same shape and dtype; lse_*: F32 [B, H, S]
 * (packed: [H, T]). out/out_lse may alias o_a/lse_a (in place). out_lse may be NULL.
 */
SPARSA_API sparsa_status sparsa_merge_states(sparsa_context* ctx, const sparsa_tensor* o_a,
                                             const sparsa_tensor* lse_a, const sparsa_tensor* o_b,
                                             const sparsa_tensor* lse_b, const sparsa_tensor* out,
                                             const sparsa_tensor* out_lse);

/**
 * Top-k from draft attention scores (§7): scores F32 [B, H, N]. block_size == 1: the k largest scores' token ids;
 * block_size > 1: scores summed over each block [id*bs, (id+1)*bs) (the tail block over its real tokens), the k
 * largest blocks' ids. Ties: smaller id wins. out_indices: int32 [B, H, k], each row sorted ascending.
 * k must be in [1, number of tokens or blocks], else SHAPE_MISMATCH.
 */
SPARSA_API sparsa_status sparsa_topk_from_scores(sparsa_context* ctx, const sparsa_tensor* scores, int32_t k,
                                                 int32_t block_size, const sparsa_tensor* out_indices);

/**
 * STS head mapping (§7), host memory: draft F32 [T, Hd, N] and target F32 [T, Ht, N] attention traces. For each
 * target head, the draft head with the largest Σ over traces t of |topk(draft[t, hd]) ∩ topk(target[t, ht])| (ties:
 * smaller draft head). out_map: int32 [Ht]. k in [1, N].
 */
SPARSA_API sparsa_status sparsa_head_mapping(const sparsa_tensor* draft, const sparsa_tensor* target, int32_t k,
                                             const sparsa_tensor* out_map);

/**
 * KV prefetch (§7): copies the K/V rows of the tokens `indices` selects from host memory (CPU or pinned
 * CUDA_HOST) into compact buffers on the context's device, asynchronously on its stream (a plain gather on CPU).
 *   k_src, v_src: [B, N, Hkv, D]; indices: int32 [B, H_idx, k] token ids, -1 = unused;
 *   k_dst, v_dst: [B, C, Hkv, D], same dtype as the sources; C >= the largest per-sequence union;
 *   positions (out): int32 [B, C], the original token id of each compact row, ascending, -1-padded;
 *   remapped (out): int32 [B, H_idx, k], each index replaced by its compact row (-1 stays -1).
 * The union per sequence is sorted, so order is kept; a TOKEN_INDICES decode run (Sq = 1) over k_dst/v_dst with
 * `remapped` and seq_lens_k = the union sizes computes what it would over the full cache. counts (out, optional):
 * int32 [B], union sizes. Rows of k_dst/v_dst past the union are left untouched. GPU contexts: B, Hkv, D, H_idx, k
 * and B*C below 2^31, else UNSUPPORTED.
 */
SPARSA_API sparsa_status sparsa_kv_prefetch(sparsa_context* ctx, const sparsa_tensor* k_src,
                                            const sparsa_tensor* v_src, const sparsa_tensor* indices,
                                            const sparsa_tensor* k_dst, const sparsa_tensor* v_dst,
                                            const sparsa_tensor* positions, const sparsa_tensor* remapped,
                                            const sparsa_tensor* counts);

/**
 * SpargeAttn's Hilbert permutation (§4): for a T×H×W token grid (token id t*H*W + h*W + w), the order of a 3-D
 * Hilbert curve over the enclosing power-of-two cube, skipping cells outside the grid. Writes n = T*H*W entries to
 * `perm` (perm[i] = token id visited i-th) and `inverse` (inverse[perm[i]] = i); either may be NULL. Host memory.
 * `capacity` is the number of int32 entries each non-NULL buffer holds; nothing is written past it.
 * INVALID_ARGUMENT for an extent < 1, a grid of more than INT32_MAX cells or a negative capacity; SHAPE_MISMATCH
 * when a buffer is given and capacity < n (the message gives both).
 */
SPARSA_API sparsa_status sparsa_hilbert_permutation(int32_t t, int32_t h, int32_t w, int32_t* perm,
                                                    int32_t* inverse, int64_t capacity);

/**
 * Drift-based layer selection (§5): h_in, h_out: [L, T, D] (F32/F16/BF16, host memory), the hidden states before
 * and after each layer. R_l = mean_t ‖h_out − h_in‖₂ / (‖h_in‖₂ + 1e-8); layer l is sparse iff R_l <= the δ-quantile
 * of R (linear interpolation, as numpy's default). out_ratio: F32 [L] (optional); out_sparse: uint8 [L] (optional).
 * delta in [0, 1]. A NaN or infinite input can make some R_l NaN; the quantile is then NaN (as numpy's) and no layer
 * is sparse; out_ratio still gets every R_l.
 */
SPARSA_API sparsa_status sparsa_drift_select_layers(const sparsa_tensor* h_in, const sparsa_tensor* h_out,
                                                    float delta, const sparsa_tensor* out_ratio,
                                                    const sparsa_tensor* out_sparse);

/** Targets of the SpargeAttn tuner (§4). */
typedef struct sparsa_sparge_tune_options {
  uint32_t struct_size; /**< the caller's sizeof(sparsa_sparge_tune_options); set by its init */
  float l1;             /**< relative-L1 target of the (theta, tau) search; > 0; default 0.07 */
  float pv_l1;          /**< relative-L1 target of the lambda search; >= l1; default 0.08 */
  int32_t search_steps; /**< bisection steps for tau and for lambda; >= 1; default 10 */
  float dense_below;    /**< a head whose best sparsity is <= this goes dense; default 0.1 */
  float lambda_min;     /**< most negative lambda tried; < 0; default -20 */
} sparsa_sparge_tune_options;

/** Fills the `size` bytes at `options` (the caller's sizeof) with struct_size = size and the defaults above, zero
    beyond. STRUCT_SIZE for a size outside [SPARSA_SPARGE_TUNE_OPTIONS_SIZE_V0_1, SPARSA_STRUCT_SIZE_MAX]. */
SPARSA_API sparsa_status sparsa_sparge_tune_options_init(sparsa_sparge_tune_options* options, size_t size);
/** `SPARSA_SPARGE_TUNE_OPTIONS_INIT(&o)` = sparsa_sparge_tune_options_init(&o, sizeof o). */
#define SPARSA_SPARGE_TUNE_OPTIONS_INIT(options) sparsa_sparge_tune_options_init((options), sizeof(*(options)))

/**
 * Tunes SPARGE per query head on one calibration call (`args` as for a run; out, lse and the introspection outputs
 * are not read): for each theta in {-1 + 2i/16, i = 0..16}, bisects tau for relative L1 Σ|O−O'|/Σ|O| < l1, then
 * lambda for < pv_l1, and keeps the setting of largest sparsity; a head at <= dense_below sparsity goes dense
 * (written as theta = 1, which no block exceeds, so every block is kept; tau = 1; lambda = -inf). `policy` gives
 * block_q, block_k, attention_sink and quantized (NULL = SPARGE defaults).
 * out_params: F32 [Hq, 4] (theta, tau, topk_fraction = 0, lambda), ready for policy.sparge_head_params;
 * out_metrics (optional): F32 [Hq, 2] (achieved relative L1, achieved sparsity).
 */
SPARSA_API sparsa_status sparsa_sparge_tune(sparsa_context* ctx, const sparsa_attention_args* args,
                                            const sparsa_policy* policy, const sparsa_sparge_tune_options* options,
                                            const sparsa_tensor* out_params, const sparsa_tensor* out_metrics);

/* ---------------------------------------------------------------------------------------------------------------- */
/* Context parallelism: TOKEN_SELECT over a KV cache sharded by position (docs/context_parallel.md)                  */
/* ---------------------------------------------------------------------------------------------------------------- */

/*
 * The KV cache of every sequence is split by position over G shards (usually GPUs): shard r holds keys
 * [kv_start[b], kv_start[b] + L_b) of sequence b, whose full length is kv_total[b]. Each shard runs the calls below
 * on its own keys; the caller combines their small outputs with its own collectives (NCCL, torch.distributed, MPI:
 * sparsa has no transport) between them. The selection that comes out is the one a single-device CPU run of
 * TOKEN_SELECT makes over the whole cache, bit for bit, whatever G and whatever the split (§6; the per-head softmax
 * normaliser is an order-independent fixed-point sum on both paths). Then each shard attends to its part of the
 * index set (TOKEN_INDICES with LSE) and the shards' states are combined with sparsa_merge_states; the result
 * equals the single-device run within fp32 rounding.
 *
 *   1. sparsa_cp_select_max  → out_max F64 [B, Hq];           combine: element-wise max  (ncclAllReduce, ncclMax)
 *   2. sparsa_cp_select_sum  → out_sum I64 [B, Hq, DIGITS];   combine: element-wise sum  (ncclAllReduce, ncclSum)
 *   3. sparsa_cp_select_topk → votes F64, positions I32 [B, n_sets, top_k];  combine: all-gather to [G, ...]
 *   4. sparsa_cp_select_indices → this shard's index set, local key ids, for a TOKEN_INDICES run.
 *
 * Common arguments: `args` as for the shard's sparsa_attention_run (q: every query row of the call, the same on
 * every shard; k, v: this shard's keys in any KV layout; seq_lens_k/cu_seqlens_k/page_table give L_b); out, lse,
 * the introspection outputs and the selection cache are not read or written (out may be NULL; a selection cache is
 * INVALID_ARGUMENT: each shard would keep a different part of T). `policy`: TOKEN_SELECT (every field as for a
 * run). kv_start, kv_total: I32 [B] in host memory with 0 <= kv_start[b] and kv_start[b] + L_b <= kv_total[b]
 * (else SPARSA_STATUS_INDEX_OUT_OF_RANGE); shards must not overlap and must cover [0, kv_total[b]) (a single call
 * cannot check that). n_sets = 1, or Hkv with select_per_kv_head.
 * A sequence that runs dense (n_init + top_k + n_local >= kv_total[b], §6.2) or has no query row contributes
 * nothing to steps 1–3 (max -inf, sum 0, no votes). Tensors live where the context computes (host memory for a
 * CPU context, the context's device for a GPU context), except kv_start and kv_total. v is validated but not read (k
 * may stand in for it). Every backend gives the CPU backend's bits (same maxima, digits, votes and index sets). On a
 * GPU context steps 1 and 2 only enqueue on the context's stream; steps 3 and 4 first read their combined inputs
 * (global_sum; the gathered lists) back to the host to check them, which waits for the stream.
 * Causality: the shard's keys are treated as visible to every query row (decode, Sq = 1, or a chunk whose rows
 * all come after the shard's keys); the selection itself does not depend on it (§6.3).
 */

/** Fixed-point digits of one partial normaliser in sparsa_cp_select_sum's output (see there). */
#define SPARSA_CP_SUM_DIGITS 6

/** Step 1. out_max: F64 [B, Hq], the largest selection score s[h, t] (§6.3) over this shard's candidates
    (C ∩ shard), -inf where it has none. The global maximum is the element-wise max over shards. */
SPARSA_API sparsa_status sparsa_cp_select_max(sparsa_context* ctx, const sparsa_attention_args* args,
                                              const sparsa_policy* policy, const sparsa_tensor* kv_start,
                                              const sparsa_tensor* kv_total, const sparsa_tensor* out_max);

/** Step 2. global_max: F64 [B, Hq], the element-wise max of every shard's step-1 output. out_sum: I64
    [B, Hq, SPARSA_CP_SUM_DIGITS], this shard's Σ_t exp(s[h, t] − global_max) as integer digits, each term
    truncated to a multiple of 2^-128: (count of NaN terms, integer part, then four 32-bit fraction digits, most
    significant first). Each digit is in [0, 2^32) (the integer part below 2^31), so adding the outputs of up to
    2^31 shards element-wise in int64 (in any order) cannot overflow, and gives the same normaliser. */
SPARSA_API sparsa_status sparsa_cp_select_sum(sparsa_context* ctx, const sparsa_attention_args* args,
                                              const sparsa_policy* policy, const sparsa_tensor* kv_start,
                                              const sparsa_tensor* kv_total, const sparsa_tensor* global_max,
                                              const sparsa_tensor* out_sum);

/** Step 3. global_max as in step 2; global_sum: I64 [B, Hq, SPARSA_CP_SUM_DIGITS], the element-wise int64 sum of
    every shard's step-2 output (digits any size >= 0, carries are resolved here). Writes this shard's top_k best
    candidates by vote (§6.3; ties: smaller position): out_votes F64 [B, n_sets, top_k] and out_positions I32
    [B, n_sets, top_k] (global positions, ascending); slots past the shard's candidate count hold -1 and -inf. */
SPARSA_API sparsa_status sparsa_cp_select_topk(sparsa_context* ctx, const sparsa_attention_args* args,
                                               const sparsa_policy* policy, const sparsa_tensor* kv_start,
                                               const sparsa_tensor* kv_total, const sparsa_tensor* global_max,
                                               const sparsa_tensor* global_sum, const sparsa_tensor* out_votes,
                                               const sparsa_tensor* out_positions);

/** Step 4. all_votes F64 and all_positions I32 [G, B, n_sets, top_k]: every shard's step-3 outputs gathered in any
    shard order. Picks the global top_k (vote descending, smaller position on ties; entries -1 ignored) and writes
    this shard's index set I ∩ shard (§6.4: sinks, selected tokens, local window; or all its keys for a dense
    sequence) as local key ids (position − kv_start[b]) to out_indices: I32 [B, n_sets, cap], ascending, -1-padded;
    cap must hold min(L_b, n_init + top_k + n_local) ids (L_b when dense), else SHAPE_MISMATCH. INVALID_ARGUMENT
    when the gathered lists hold fewer than top_k candidates of a selecting sequence or one position twice among
    the chosen; INDEX_OUT_OF_RANGE for a position that is not a candidate. Then a TOKEN_INDICES run with
    indices = out_indices (H_idx = n_sets, default head_map, index_n_init = index_n_local = 0) and LSE gives this
    shard's partial state. */
SPARSA_API sparsa_status sparsa_cp_select_indices(sparsa_context* ctx, const sparsa_attention_args* args,
                                                  const sparsa_policy* policy, const sparsa_tensor* kv_start,
                                                  const sparsa_tensor* kv_total, const sparsa_tensor* all_votes,
                                                  const sparsa_tensor* all_positions, const sparsa_tensor* out_indices);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SPARSA_SPARSA_H */
