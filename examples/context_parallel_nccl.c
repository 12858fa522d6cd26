/*
 * One TOKEN_SELECT decode step over a KV cache sharded by position, for an engine that holds its own NCCL
 * communicator (docs/context_parallel.md). CMake compiles it (an object library, bench/CMakeLists.txt) wherever the
 * CUDA backend is built and NCCL is found; running it needs an engine around it and several GPUs.
 *
 * Rank r of G holds keys [kv_start[b], kv_start[b] + L_b) of every sequence b (full length kv_total[b]) on its GPU.
 * The selection steps (sparsa_cp_select_*) run on a CPU context over host copies of q and of the rank's keys: the
 * CUDA backend answers SPARSA_STATUS_UNSUPPORTED to them for now. Their small outputs travel through NCCL from a
 * device staging buffer. The attention over the rank's part of the index set and the merge run on the GPU.
 */
#include <cuda_runtime.h>
#include <nccl.h>
#include <sparsa/sparsa.h>
#include <stdint.h>
#include <stdlib.h>

/* What one rank holds. Tensors: q [B, 1, Hq, D] (the same on every rank), k/v [B, Lmax, Hkv, D] (this rank's keys),
   seq_lens [B] int32 (L_b); *_host in host memory, *_dev on the rank's GPU (v_host may be k_host: the selection
   steps validate v but do not read it). kv_start, kv_total: host int32 [B]. */
typedef struct cp_rank {
  int32_t rank, num_ranks;
  int64_t batch, num_q_heads, head_dim, max_shard_len;
  const sparsa_tensor *q_host, *k_host, *v_host, *seq_lens_host;
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
/* In host_all_reduce and host_all_gather: return the code. */
#define RETURN_NCCL(call)                                     \
  do {                                                        \
    if ((call) != ncclSuccess) return -1;                     \
  } while (0)
#define RETURN_CUDA(call)                                     \
  do {                                                        \
    if ((call) != cudaSuccess) return -2;                     \
  } while (0)

/* All-reduce of `count` elements of a host array, in place, through the device buffer `staging`. */
static int host_all_reduce(void* host, size_t count, size_t element_size, ncclDataType_t type, ncclRedOp_t op,
                           void* staging, ncclComm_t comm, cudaStream_t stream) {
  RETURN_CUDA(cudaMemcpyAsync(staging, host, count * element_size, cudaMemcpyHostToDevice, stream));
  RETURN_NCCL(ncclAllReduce(staging, staging, count, type, op, comm, stream));
  RETURN_CUDA(cudaMemcpyAsync(host, staging, count * element_size, cudaMemcpyDeviceToHost, stream));
  RETURN_CUDA(cudaStreamSynchronize(stream));
  return 0;
}

/* All-gather of `count` elements per rank from a host array into host `gathered` ([G][count], rank order). */
static int host_all_gather(const void* host, void* gathered, size_t count, size_t element_size, int32_t num_ranks,
                           ncclDataType_t type, void* staging, ncclComm_t comm, cudaStream_t stream) {
  char* received = (char*)staging + count * element_size;
  RETURN_CUDA(cudaMemcpyAsync(staging, host, count * element_size, cudaMemcpyHostToDevice, stream));
  RETURN_NCCL(ncclAllGather(staging, received, count, type, comm, stream));
  RETURN_CUDA(cudaMemcpyAsync(gathered, received, (size_t)num_ranks * count * element_size, cudaMemcpyDeviceToHost,
                           stream));
  RETURN_CUDA(cudaStreamSynchronize(stream));
  return 0;
}

/*
 * Writes the merged decode output of the whole cache to out_dev [B, 1, Hq, D] (f32, on the GPU) and its LSE to
 * lse_dev [B, Hq, 1], the same on every rank. `policy`: TOKEN_SELECT with select_per_kv_head = 0 (one shared set;
 * with per-kv-head sets, n_sets = Hkv below). gpu_ctx runs on `stream`, host_ctx is a CPU context. Returns 0, a
 * sparsa_status, -1 (NCCL), -2 (CUDA) or -3 (host allocation); everything it allocated is freed either way.
 */
int cp_token_select_decode(const cp_rank* r, sparsa_context* host_ctx, sparsa_context* gpu_ctx,
                           const sparsa_policy* policy, ncclComm_t comm, cudaStream_t stream,
                           const sparsa_tensor* out_dev, const sparsa_tensor* lse_dev) {
  const int64_t B = r->batch, Hq = r->num_q_heads, D = r->head_dim, G = r->num_ranks;
  const int64_t n_sets = 1, top_k = policy->select_top_k, digits = SPARSA_CP_SUM_DIGITS;
  const size_t stats = (size_t)(B * Hq), list = (size_t)(B * n_sets * top_k), state = (size_t)(B * Hq * D);
  int result = 0;

  /* Host arrays of the protocol and one device staging buffer, big enough for the largest exchange. */
  double* global_max = malloc(stats * sizeof(double));
  int64_t* global_sum = malloc(stats * (size_t)digits * sizeof(int64_t));
  double* votes = malloc(list * sizeof(double));
  int32_t* positions = malloc(list * sizeof(int32_t));
  double* all_votes = malloc((size_t)G * list * sizeof(double));
  int32_t* all_positions = malloc((size_t)G * list * sizeof(int32_t));
  int32_t* indices_host = malloc((size_t)(B * n_sets * r->max_shard_len) * sizeof(int32_t));
  size_t staging_bytes =
      (size_t)(G + 1) * (list * sizeof(double) + state * sizeof(float)) + stats * (size_t)digits * sizeof(int64_t);
  void *staging = NULL, *indices_dev = NULL, *all_out = NULL, *all_lse = NULL;
  if (!global_max || !global_sum || !votes || !positions || !all_votes || !all_positions || !indices_host) {
    result = -3;
    goto done;
  }
  if (cudaMalloc(&staging, staging_bytes) != cudaSuccess ||
      cudaMalloc(&indices_dev, (size_t)(B * n_sets * r->max_shard_len) * sizeof(int32_t)) != cudaSuccess ||
      cudaMalloc(&all_out, (size_t)G * state * sizeof(float)) != cudaSuccess ||
      cudaMalloc(&all_lse, (size_t)G * stats * sizeof(float)) != cudaSuccess) {
    result = -2;
    goto done;
  }

  {
    /* The selection steps read the rank's run arguments (host copies); out is not needed. */
    sparsa_attention_args select_args;
    SPARSA_ATTENTION_ARGS_INIT(&select_args);
    select_args.q = r->q_host;
    select_args.k = r->k_host;
    select_args.v = r->v_host;
    select_args.seq_lens_k = r->seq_lens_host;

    sparsa_tensor max_t, sum_t, votes_t, positions_t, all_votes_t, all_positions_t, indices_t;
    const int64_t stats_shape[2] = {B, Hq}, sum_shape[3] = {B, Hq, digits}, list_shape[3] = {B, n_sets, top_k};
    const int64_t all_shape[4] = {G, B, n_sets, top_k}, indices_shape[3] = {B, n_sets, r->max_shard_len};
    SPARSA_TENSOR_INIT(&max_t, global_max, SPARSA_DTYPE_F64, 2, stats_shape);
    SPARSA_TENSOR_INIT(&sum_t, global_sum, SPARSA_DTYPE_I64, 3, sum_shape);
    SPARSA_TENSOR_INIT(&votes_t, votes, SPARSA_DTYPE_F64, 3, list_shape);
    SPARSA_TENSOR_INIT(&positions_t, positions, SPARSA_DTYPE_I32, 3, list_shape);
    SPARSA_TENSOR_INIT(&all_votes_t, all_votes, SPARSA_DTYPE_F64, 4, all_shape);
    SPARSA_TENSOR_INIT(&all_positions_t, all_positions, SPARSA_DTYPE_I32, 4, all_shape);
    SPARSA_TENSOR_INIT(&indices_t, indices_host, SPARSA_DTYPE_I32, 3, indices_shape);

    /* 1. per-head maximum over the rank's candidates → max over ranks (exact). */
    TRY_SPARSA(sparsa_cp_select_max(host_ctx, &select_args, policy, &r->kv_start, &r->kv_total, &max_t));
    TRY(host_all_reduce(global_max, stats, sizeof(double), ncclFloat64, ncclMax, staging, comm, stream));
    /* 2. fixed-point partial normalisers → int64 sum over ranks (exact, any order). */
    TRY_SPARSA(sparsa_cp_select_sum(host_ctx, &select_args, policy, &r->kv_start, &r->kv_total, &max_t, &sum_t));
    TRY(host_all_reduce(global_sum, stats * (size_t)digits, sizeof(int64_t), ncclInt64, ncclSum, staging, comm,
                        stream));
    /* 3. the rank's top_k candidates by vote → all-gather. */
    TRY_SPARSA(sparsa_cp_select_topk(host_ctx, &select_args, policy, &r->kv_start, &r->kv_total, &max_t, &sum_t,
                                     &votes_t, &positions_t));
    TRY(host_all_gather(votes, all_votes, list, sizeof(double), (int32_t)G, ncclFloat64, staging, comm, stream));
    TRY(host_all_gather(positions, all_positions, list, sizeof(int32_t), (int32_t)G, ncclInt32, staging, comm,
                        stream));
    /* 4. the global top_k, and this rank's part of the index set as local key ids. */
    TRY_SPARSA(sparsa_cp_select_indices(host_ctx, &select_args, policy, &r->kv_start, &r->kv_total, &all_votes_t,
                                        &all_positions_t, &indices_t));
  }

  {
    /* The rank's partial state on the GPU: TOKEN_INDICES over its part of the index set, with LSE. */
    const int64_t indices_shape[3] = {B, n_sets, r->max_shard_len};
    sparsa_tensor indices_dev_t, part_out, part_lse;
    TRY_CUDA(cudaMemcpyAsync(indices_dev, indices_host, (size_t)(B * n_sets * r->max_shard_len) * sizeof(int32_t),
                             cudaMemcpyHostToDevice, stream));
    SPARSA_TENSOR_INIT(&indices_dev_t, indices_dev, SPARSA_DTYPE_I32, 3, indices_shape);
    indices_dev_t.device_type = SPARSA_DEVICE_CUDA;
    sparsa_policy indices_policy;
    SPARSA_POLICY_INIT(&indices_policy, SPARSA_POLICY_TOKEN_INDICES);
    indices_policy.indices = &indices_dev_t;
    sparsa_attention_args run;
    SPARSA_ATTENTION_ARGS_INIT(&run);
    run.q = r->q_dev;
    run.k = r->k_dev;
    run.v = r->v_dev;
    run.seq_lens_k = r->seq_lens_dev;
    /* The partial output goes straight into this rank's slot of the gather buffers. */
    const int64_t slot_out_shape[4] = {B, 1, Hq, D}, slot_lse_shape[3] = {B, Hq, 1};
    float* my_out = (float*)all_out + (size_t)r->rank * state;
    float* my_lse = (float*)all_lse + (size_t)r->rank * stats;
    SPARSA_TENSOR_INIT(&part_out, my_out, SPARSA_DTYPE_F32, 4, slot_out_shape);
    SPARSA_TENSOR_INIT(&part_lse, my_lse, SPARSA_DTYPE_F32, 3, slot_lse_shape);
    part_out.device_type = part_lse.device_type = SPARSA_DEVICE_CUDA;
    run.out = &part_out;
    run.lse = &part_lse;
    TRY_SPARSA(sparsa_attention_run(gpu_ctx, &run, &indices_policy));

    /* Every rank gathers every partial state (in place: ncclAllGather accepts sendbuff = recvbuff + rank·count). */
    TRY_NCCL(ncclAllGather(my_out, all_out, state, ncclFloat32, comm, stream));
    TRY_NCCL(ncclAllGather(my_lse, all_lse, stats, ncclFloat32, comm, stream));

    /* Merge in rank order into out_dev / lse_dev (the same order, hence the same bits, on every rank). */
    TRY_CUDA(cudaMemcpyAsync(out_dev->data, all_out, state * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    TRY_CUDA(cudaMemcpyAsync(lse_dev->data, all_lse, stats * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    for (int64_t g = 1; g < G; ++g) {
      sparsa_tensor other_out, other_lse;
      SPARSA_TENSOR_INIT(&other_out, (float*)all_out + (size_t)g * state, SPARSA_DTYPE_F32, 4, slot_out_shape);
      SPARSA_TENSOR_INIT(&other_lse, (float*)all_lse + (size_t)g * stats, SPARSA_DTYPE_F32, 3, slot_lse_shape);
      other_out.device_type = other_lse.device_type = SPARSA_DEVICE_CUDA;
      TRY_SPARSA(sparsa_merge_states(gpu_ctx, out_dev, lse_dev, &other_out, &other_lse, out_dev, lse_dev));
    }
  }

done:
  cudaStreamSynchronize(stream);
  cudaFree(staging);
  cudaFree(indices_dev);
  cudaFree(all_out);
  cudaFree(all_lse);
  free(global_max);
  free(global_sum);
  free(votes);
  free(positions);
  free(all_votes);
  free(all_positions);
  free(indices_host);
  return result;
}
