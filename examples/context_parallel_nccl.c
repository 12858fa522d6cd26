/*
 * One TOKEN_SELECT decode step over a KV cache sharded by position, for an engine that holds its own NCCL
 * communicator (docs/context_parallel.md). CMake builds it wherever the CUDA backend is built and NCCL is found, as
 * part of bench/gpu/cp_example_check.c, which runs it on the GPUs of one machine and checks it against the CPU oracle
 * (bench/gpu/run_device.sh cp).
 *
 * Rank r of G holds keys [kv_start[b], kv_start[b] + L_b) of every sequence b (full length kv_total[b]) on its GPU.
 * The whole step runs on that GPU, through one CUDA context whose stream is the engine's `stream`: the four selection
 * steps (sparsa_cp_select_*) write their small outputs to device buffers, NCCL combines those in place on the same
 * stream, and the rank then attends to its part of the index set (TOKEN_INDICES with LSE), gathers every rank's
 * partial state and merges them in rank order. Only kv_start and kv_total live in host memory.
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <sparsa/sparsa.h>
#include <stdint.h>
#include <stddef.h>

/* What one rank holds, on its GPU: q [B, 1, Hq, D] (the same on every rank), k/v [B, Lmax, Hkv, D] (this rank's
   keys), seq_lens [B] int32 (L_b). kv_start, kv_total: int32 [B] in host memory. */
typedef struct cp_rank {
  int32_t rank, num_ranks;
  int64_t batch, num_q_heads, head_dim, max_shard_len;
  const sparsa_tensor *q_dev, *k_dev, *v_dev, *seq_lens_dev;
  sparsa_tensor kv_start, kv_total;
} cp_rank;

/* In cp_token_select_decode: on failure, record the code and release everything at `done`. */
#define TRY_SPARSA(call)                                      \
  do {                                                        \
    sparsa_status status_ = (call);                           \
    if (status_ != SPARSA_STATUS_SUCCESS) {                   \
      result = status_;                                       \
      goto done;                                              \
    }                                                         \
  } while (0)
#define TRY(call)                                             \
  do {                                                        \
    if ((result = (call)) != 0) goto done;                    \
  } while (0)
#define TRY_NCCL(call) TRY((call) == ncclSuccess ? 0 : -1)
#define TRY_CUDA(call) TRY((call) == cudaSuccess ? 0 : -2)

/* Describes `t` (filled by SPARSA_TENSOR_INIT) as memory on GPU `device_id`: every call checks that its tensors
   are on the context's device. */
static void on_gpu(sparsa_tensor* t, int32_t device_id) {
  t->device_type = SPARSA_DEVICE_CUDA;
  t->device_id = device_id;
}

/* The NCCL type of a tensor dtype the partial states can have (a run's out has q's dtype). */
static int nccl_type_of(int32_t dtype, ncclDataType_t* type, size_t* bytes) {
  switch (dtype) {
    case SPARSA_DTYPE_F32: *type = ncclFloat32; *bytes = 4; return 0;
    case SPARSA_DTYPE_F16: *type = ncclFloat16; *bytes = 2; return 0;
    case SPARSA_DTYPE_BF16: *type = ncclBfloat16; *bytes = 2; return 0;
    default: return -1;
  }
}

/*
 * Writes the merged decode output of the whole cache to out_dev [B, 1, Hq, D] (q's dtype, on the GPU) and its LSE
 * (F32) to lse_dev [B, Hq, 1], the same on every rank. `policy`: TOKEN_SELECT with select_per_kv_head = 0 (one shared set;
 * with per-kv-head sets, n_sets = Hkv below). ctx is a CUDA context on the rank's GPU (the device of q_dev) whose
 * stream is `stream`. Returns 0, a sparsa_status, -1 (NCCL) or -2 (CUDA); everything it allocated is freed either
 * way.
 */
int cp_token_select_decode(const cp_rank* r, sparsa_context* ctx, const sparsa_policy* policy, ncclComm_t comm,
                           cudaStream_t stream, const sparsa_tensor* out_dev, const sparsa_tensor* lse_dev) {
  const int64_t B = r->batch, Hq = r->num_q_heads, D = r->head_dim, G = r->num_ranks;
  const int64_t n_sets = 1, top_k = policy->select_top_k, digits = SPARSA_CP_SUM_DIGITS;
  const size_t stats = (size_t)(B * Hq), list = (size_t)(B * n_sets * top_k), state = (size_t)(B * Hq * D);
  const size_t index_count = (size_t)(B * n_sets * r->max_shard_len);
  const int32_t device_id = r->q_dev->device_id;
  ncclDataType_t state_type;
  size_t state_bytes;
  int result = 0;
  if (nccl_type_of(r->q_dev->dtype, &state_type, &state_bytes) != 0) return SPARSA_STATUS_DTYPE_MISMATCH;

  /* The protocol's arrays, the rank's index set and the gather buffers of the partial states, all on the GPU. */
  void *global_max = NULL, *global_sum = NULL, *votes = NULL, *positions = NULL, *all_votes = NULL,
       *all_positions = NULL, *indices = NULL, *all_out = NULL, *all_lse = NULL;
  if (cudaMalloc(&global_max, stats * sizeof(double)) != cudaSuccess ||
      cudaMalloc(&global_sum, stats * (size_t)digits * sizeof(int64_t)) != cudaSuccess ||
      cudaMalloc(&votes, list * sizeof(double)) != cudaSuccess ||
      cudaMalloc(&positions, list * sizeof(int32_t)) != cudaSuccess ||
      cudaMalloc(&all_votes, (size_t)G * list * sizeof(double)) != cudaSuccess ||
      cudaMalloc(&all_positions, (size_t)G * list * sizeof(int32_t)) != cudaSuccess ||
      cudaMalloc(&indices, index_count * sizeof(int32_t)) != cudaSuccess ||
      cudaMalloc(&all_out, (size_t)G * state * state_bytes) != cudaSuccess ||
      cudaMalloc(&all_lse, (size_t)G * stats * sizeof(float)) != cudaSuccess) {
    result = -2;
    goto done;
  }

  {
    /* The selection steps read the rank's run arguments; out is not needed. */
    sparsa_attention_args select_args;
    SPARSA_ATTENTION_ARGS_INIT(&select_args);
    select_args.q = r->q_dev;
    select_args.k = r->k_dev;
    select_args.v = r->v_dev;
    select_args.seq_lens_k = r->seq_lens_dev;

    sparsa_tensor max_t, sum_t, votes_t, positions_t, all_votes_t, all_positions_t, indices_t;
    const int64_t stats_shape[2] = {B, Hq}, sum_shape[3] = {B, Hq, digits}, list_shape[3] = {B, n_sets, top_k};
    const int64_t all_shape[4] = {G, B, n_sets, top_k}, indices_shape[3] = {B, n_sets, r->max_shard_len};
    SPARSA_TENSOR_INIT(&max_t, global_max, SPARSA_DTYPE_F64, 2, stats_shape);
    SPARSA_TENSOR_INIT(&sum_t, global_sum, SPARSA_DTYPE_I64, 3, sum_shape);
    SPARSA_TENSOR_INIT(&votes_t, votes, SPARSA_DTYPE_F64, 3, list_shape);
    SPARSA_TENSOR_INIT(&positions_t, positions, SPARSA_DTYPE_I32, 3, list_shape);
    SPARSA_TENSOR_INIT(&all_votes_t, all_votes, SPARSA_DTYPE_F64, 4, all_shape);
    SPARSA_TENSOR_INIT(&all_positions_t, all_positions, SPARSA_DTYPE_I32, 4, all_shape);
    SPARSA_TENSOR_INIT(&indices_t, indices, SPARSA_DTYPE_I32, 3, indices_shape);
    on_gpu(&max_t, device_id);
    on_gpu(&sum_t, device_id);
    on_gpu(&votes_t, device_id);
    on_gpu(&positions_t, device_id);
    on_gpu(&all_votes_t, device_id);
    on_gpu(&all_positions_t, device_id);
    on_gpu(&indices_t, device_id);

    /* The sparsa calls enqueue on the context's stream, which must be `stream`, the stream of the collectives: each
       step then reads what the collective before it wrote, with no cudaStreamSynchronize in between. Steps 3 and 4
       read small arrays back to the host inside the library (the combined digits, the gathered lists): a
       synchronisation on the stream, as documented for the CUDA backend. */

    /* 1. per-head maximum over the rank's candidates → max over ranks (exact), in place. */
    TRY_SPARSA(sparsa_cp_select_max(ctx, &select_args, policy, &r->kv_start, &r->kv_total, &max_t));
    TRY_NCCL(ncclAllReduce(global_max, global_max, stats, ncclFloat64, ncclMax, comm, stream));
    /* 2. fixed-point partial normalisers → int64 sum over ranks (exact, any order), in place. */
    TRY_SPARSA(sparsa_cp_select_sum(ctx, &select_args, policy, &r->kv_start, &r->kv_total, &max_t, &sum_t));
    TRY_NCCL(ncclAllReduce(global_sum, global_sum, stats * (size_t)digits, ncclInt64, ncclSum, comm, stream));
    /* 3. the rank's top_k candidates by vote → all-gather, rank order. */
    TRY_SPARSA(sparsa_cp_select_topk(ctx, &select_args, policy, &r->kv_start, &r->kv_total, &max_t, &sum_t,
                                     &votes_t, &positions_t));
    TRY_NCCL(ncclAllGather(votes, all_votes, list, ncclFloat64, comm, stream));
    TRY_NCCL(ncclAllGather(positions, all_positions, list, ncclInt32, comm, stream));
    /* 4. the global top_k, and this rank's part of the index set as local key ids. */
    TRY_SPARSA(sparsa_cp_select_indices(ctx, &select_args, policy, &r->kv_start, &r->kv_total, &all_votes_t,
                                        &all_positions_t, &indices_t));

    /* The rank's partial state: TOKEN_INDICES over its part of the index set, with LSE. */
    sparsa_tensor part_out, part_lse;
    sparsa_policy indices_policy;
    SPARSA_POLICY_INIT(&indices_policy, SPARSA_POLICY_TOKEN_INDICES);
    indices_policy.indices = &indices_t;
    sparsa_attention_args run;
    SPARSA_ATTENTION_ARGS_INIT(&run);
    run.q = r->q_dev;
    run.k = r->k_dev;
    run.v = r->v_dev;
    run.seq_lens_k = r->seq_lens_dev;
    /* The partial output goes straight into this rank's slot of the gather buffers. */
    const int64_t slot_out_shape[4] = {B, 1, Hq, D}, slot_lse_shape[3] = {B, Hq, 1};
    char* my_out = (char*)all_out + (size_t)r->rank * state * state_bytes;
    float* my_lse = (float*)all_lse + (size_t)r->rank * stats;
    SPARSA_TENSOR_INIT(&part_out, my_out, r->q_dev->dtype, 4, slot_out_shape);
    SPARSA_TENSOR_INIT(&part_lse, my_lse, SPARSA_DTYPE_F32, 3, slot_lse_shape);
    on_gpu(&part_out, device_id);
    on_gpu(&part_lse, device_id);
    run.out = &part_out;
    run.lse = &part_lse;
    TRY_SPARSA(sparsa_attention_run(ctx, &run, &indices_policy));

    /* Every rank gathers every partial state (in place: ncclAllGather accepts sendbuff = recvbuff + rank·count). */
    TRY_NCCL(ncclAllGather(my_out, all_out, state, state_type, comm, stream));
    TRY_NCCL(ncclAllGather(my_lse, all_lse, stats, ncclFloat32, comm, stream));

    /* Merge in rank order into out_dev / lse_dev (the same order, hence the same bits, on every rank). */
    TRY_CUDA(cudaMemcpyAsync(out_dev->data, all_out, state * state_bytes, cudaMemcpyDeviceToDevice, stream));
    TRY_CUDA(cudaMemcpyAsync(lse_dev->data, all_lse, stats * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    for (int64_t g = 1; g < G; ++g) {
      sparsa_tensor other_out, other_lse;
      SPARSA_TENSOR_INIT(&other_out, (char*)all_out + (size_t)g * state * state_bytes, r->q_dev->dtype, 4,
                         slot_out_shape);
      SPARSA_TENSOR_INIT(&other_lse, (float*)all_lse + (size_t)g * stats, SPARSA_DTYPE_F32, 3, slot_lse_shape);
      on_gpu(&other_out, device_id);
      on_gpu(&other_lse, device_id);
      TRY_SPARSA(sparsa_merge_states(ctx, out_dev, lse_dev, &other_out, &other_lse, out_dev, lse_dev));
    }
  }

done:
  cudaStreamSynchronize(stream);
  cudaFree(global_max);
  cudaFree(global_sum);
  cudaFree(votes);
  cudaFree(positions);
  cudaFree(all_votes);
  cudaFree(all_positions);
  cudaFree(indices);
  cudaFree(all_out);
  cudaFree(all_lse);
  return result;
}
