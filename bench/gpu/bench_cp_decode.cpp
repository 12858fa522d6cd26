// Context-parallel decode through the C API and NCCL, one host thread driving every GPU of the machine
// (docs/context_parallel.md): GPU g holds keys [g·N/G, (g+1)·N/G) of one sequence, runs its shard's attention with
// LSE, the partial states are all-gathered (ncclAllGather) and merged with sparsa_merge_states in rank order on
// every GPU. Against the same problem in one sparsa call on GPU 0, in the same process. No Python on the path: the
// step an engine that calls the C API pays. bf16 Q/K/V, fp32 outputs, B = 1, GQA 32/8, D = 128.
//
//   bench_cp_decode [--n N] [--reps R] [--gpus G] [--json FILE]
//
// Policies: DENSE; SINK_WINDOW 128 + 2048 (each shard runs SINK_WINDOW with its sinks and window cut to the shard);
// TOKEN_INDICES with one row of N/10 keys per kv head plus n_init 128 / n_local 512 (each shard gets its own keys'
// entries as local ids, compacted, and n_init / n_local cut to the shard). Times: CUDA events around `reps` steps
// enqueued back to back on each GPU's stream, per step, the slowest GPU's. Outputs are bf16 like the queries (a run's
// out has q's dtype), so the partial states travel as bf16, as they do through sparsa.distributed. Needs NCCL (not a dependency of
// libsparsa); bench/gpu/run_device.sh cp builds and runs it.
#include <cuda_runtime.h>
#include <nccl.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kHeadsQ = 32, kHeadsKv = 8, kHeadDim = 128;
constexpr int32_t kSinks = 128, kWindow = 2048;
constexpr int32_t kIndexInit = 128, kIndexLocal = 512, kIndexEvery = 10;
constexpr int kWarmup = 3;

[[noreturn]] void die(const char* what, const char* detail) {
  std::fprintf(stderr, "bench_cp_decode: %s: %s\n", what, detail);
  std::exit(1);
}
void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(what, cudaGetErrorString(e));
}
void nccl_ok(ncclResult_t e, const char* what) {
  if (e != ncclSuccess) die(what, ncclGetErrorString(e));
}
void sparsa_ok(sparsa_status s, const char* what) {
  if (s != SPARSA_STATUS_SUCCESS) die(what, sparsa_last_error_message());
}

uint64_t mix(uint64_t x) {  // splitmix64: deterministic values, so a shard is a slice of the whole cache
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
uint16_t bf16_of(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);  // round to nearest even
}
float float_of_bf16(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// Uniform values in [-1, 1) as bf16, element i of a tensor seeded `seed`, filled by all cores.
std::vector<uint16_t> random_bf16(size_t count, uint64_t seed) {
  std::vector<uint16_t> out(count);
  const unsigned workers = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> threads;
  for (unsigned w = 0; w < workers; ++w) {
    threads.emplace_back([&, w] {
      for (size_t i = w * count / workers; i < (w + 1) * count / workers; ++i) {
        out[i] = bf16_of(float(int64_t(mix(seed ^ (i * 0x100000001B3ull)) >> 11) * 0x1.0p-52 - 1.0));
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

sparsa_tensor device_tensor(void* data, int32_t dtype, std::vector<int64_t> shape, int device) {
  sparsa_tensor t;
  sparsa_ok(SPARSA_TENSOR_INIT(&t, data, dtype, int32_t(shape.size()), shape.data()), "sparsa_tensor_init");
  t.device_type = SPARSA_DEVICE_CUDA;
  t.device_id = device;
  return t;
}

void* device_copy(const void* host, size_t bytes) {
  void* p = nullptr;
  cuda_ok(cudaMalloc(&p, std::max<size_t>(bytes, 4)), "cudaMalloc");
  if (bytes != 0) cuda_ok(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
  return p;
}

// What one policy needs on one device: the policy struct and the index buffer it points at. policy.indices points
// into the object itself, so it is set where the object stays (point_at_indices), not where it is built.
struct PolicyOnDevice {
  sparsa_policy policy;
  sparsa_tensor indices;
  void* indices_memory = nullptr;
  void point_at_indices() { policy.indices = indices_memory != nullptr ? &indices : nullptr; }
};

// The policy of a run over keys [start, start + length) of a cache of `total` keys, for the decode row (global
// position total - 1). Global sinks / n_init are a prefix of the shard if anything, the window / n_local a suffix.
PolicyOnDevice shard_policy(const std::string& name, const std::vector<std::vector<int32_t>>& rows, int64_t start,
                            int64_t length, int64_t total, int device) {
  auto head = [&](int64_t n) { return int32_t(std::clamp<int64_t>(n - start, 0, length)); };
  auto tail = [&](int64_t n) { return int32_t(std::clamp<int64_t>(start + length - (total - n), 0, length)); };
  PolicyOnDevice p;
  if (name == "dense") {
    sparsa_ok(SPARSA_POLICY_INIT(&p.policy, SPARSA_POLICY_DENSE), "policy_init");
  } else if (name == "sink_window") {
    sparsa_ok(SPARSA_POLICY_INIT(&p.policy, SPARSA_POLICY_SINK_WINDOW), "policy_init");
    p.policy.sink_tokens = head(kSinks);
    p.policy.sink_window = tail(kWindow);
  } else {
    sparsa_ok(SPARSA_POLICY_INIT(&p.policy, SPARSA_POLICY_TOKEN_INDICES), "policy_init");
    p.policy.index_n_init = head(kIndexInit);
    p.policy.index_n_local = tail(kIndexLocal);
    std::vector<std::vector<int32_t>> local(rows.size());
    size_t width = 1;
    for (size_t r = 0; r < rows.size(); ++r) {
      for (int32_t t : rows[r]) {
        if (t >= start && t < start + length) local[r].push_back(int32_t(t - start));
      }
      width = std::max(width, local[r].size());
    }
    std::vector<int32_t> flat(rows.size() * width, -1);
    for (size_t r = 0; r < rows.size(); ++r) std::copy(local[r].begin(), local[r].end(), flat.begin() + r * width);
    p.indices_memory = device_copy(flat.data(), flat.size() * 4);
    p.indices = device_tensor(p.indices_memory, SPARSA_DTYPE_I32, {1, int64_t(rows.size()), int64_t(width)}, device);
  }
  return p;
}

// One GPU's part: its context, stream, shard and outputs.
struct Rank {
  int device = 0;
  cudaStream_t stream = nullptr;
  sparsa_context* ctx = nullptr;
  ncclComm_t comm = nullptr;
  void *q = nullptr, *k = nullptr, *v = nullptr;
  uint16_t *out = nullptr, *gathered_out = nullptr, *merged_out = nullptr;  // bf16
  float *lse = nullptr, *gathered_lse = nullptr, *merged_lse = nullptr;
  sparsa_tensor tq, tk, tv, tout, tlse, tmerged_out, tmerged_lse;
  std::vector<sparsa_tensor> part_out, part_lse;  // views of the gathered states, rank order
  sparsa_attention_args args;
  cudaEvent_t begin = nullptr, end = nullptr;
};

constexpr int64_t kStateFloats = kHeadsQ * kHeadDim;  // one decode row's output, all heads

void enqueue_step(std::vector<Rank>& ranks, std::vector<PolicyOnDevice>& policies) {
  const int g_count = int(ranks.size());
  for (int g = 0; g < g_count; ++g) {
    cuda_ok(cudaSetDevice(ranks[g].device), "cudaSetDevice");
    sparsa_ok(sparsa_attention_run(ranks[g].ctx, &ranks[g].args, &policies[g].policy), "shard attention");
  }
  nccl_ok(ncclGroupStart(), "ncclGroupStart");
  for (Rank& r : ranks) {
    nccl_ok(ncclAllGather(r.out, r.gathered_out, kStateFloats, ncclBfloat16, r.comm, r.stream), "all-gather out");
    nccl_ok(ncclAllGather(r.lse, r.gathered_lse, kHeadsQ, ncclFloat32, r.comm, r.stream), "all-gather lse");
  }
  nccl_ok(ncclGroupEnd(), "ncclGroupEnd");
  for (Rank& r : ranks) {
    cuda_ok(cudaSetDevice(r.device), "cudaSetDevice");
    sparsa_ok(sparsa_merge_states(r.ctx, &r.part_out[0], &r.part_lse[0], &r.part_out[1], &r.part_lse[1],
                                  &r.tmerged_out, &r.tmerged_lse), "merge");
    for (int m = 2; m < g_count; ++m) {
      sparsa_ok(sparsa_merge_states(r.ctx, &r.tmerged_out, &r.tmerged_lse, &r.part_out[m], &r.part_lse[m],
                                    &r.tmerged_out, &r.tmerged_lse), "merge");
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int64_t n = int64_t(1) << 20;
  int reps = 50, gpus = 0;
  const char* json_path = nullptr;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--n") n = std::atoll(argv[i + 1]);
    else if (flag == "--reps") reps = std::atoi(argv[i + 1]);
    else if (flag == "--gpus") gpus = std::atoi(argv[i + 1]);
    else if (flag == "--json") json_path = argv[i + 1];
    else die("unknown option", argv[i]);
  }
  int available = 0;
  cuda_ok(cudaGetDeviceCount(&available), "cudaGetDeviceCount");
  const int g_count = gpus > 0 ? std::min(gpus, available) : available;
  if (g_count < 2) die("needs at least two GPUs", std::to_string(available).c_str());
  if (n % g_count != 0 || n < 4 * kWindow) die("--n must be a multiple of the GPU count and >= 8192", "");
  cudaDeviceProp props;
  cuda_ok(cudaGetDeviceProperties(&props, 0), "cudaGetDeviceProperties");

  const size_t kv_elements = size_t(n) * kHeadsKv * kHeadDim;
  const std::vector<uint16_t> q_host = random_bf16(kStateFloats, 1), k_host = random_bf16(kv_elements, 2),
                              v_host = random_bf16(kv_elements, 3);
  std::vector<std::vector<int32_t>> rows(kHeadsKv);  // TOKEN_INDICES: one key of every kIndexEvery, jittered
  for (int64_t h = 0; h < kHeadsKv; ++h) {
    for (int64_t j = 0; j < n / kIndexEvery; ++j) {
      rows[h].push_back(int32_t(j * kIndexEvery + int64_t(mix(uint64_t(h * n + j)) % kIndexEvery)));
    }
  }
  const char* names[] = {"dense", "sink_window", "token_indices"};

  // One GPU: the whole cache on GPU 0.
  cuda_ok(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream0;
  cuda_ok(cudaStreamCreateWithFlags(&stream0, cudaStreamNonBlocking), "cudaStreamCreate");
  sparsa_context_options options;
  sparsa_ok(SPARSA_CONTEXT_OPTIONS_INIT(&options), "context_options_init");
  options.device_type = SPARSA_DEVICE_CUDA;
  options.device_id = 0;
  options.stream = stream0;
  sparsa_context* ctx0 = nullptr;
  sparsa_ok(sparsa_context_create(&options, &ctx0), "context_create");
  void* q0 = device_copy(q_host.data(), q_host.size() * 2);
  void* k0 = device_copy(k_host.data(), kv_elements * 2);
  void* v0 = device_copy(v_host.data(), kv_elements * 2);
  uint16_t* out0 = nullptr;
  cuda_ok(cudaMalloc(&out0, kStateFloats * 2), "cudaMalloc");
  sparsa_attention_args args0;
  sparsa_ok(SPARSA_ATTENTION_ARGS_INIT(&args0), "args_init");
  sparsa_tensor tq0 = device_tensor(q0, SPARSA_DTYPE_BF16, {1, 1, kHeadsQ, kHeadDim}, 0);
  sparsa_tensor tk0 = device_tensor(k0, SPARSA_DTYPE_BF16, {1, n, kHeadsKv, kHeadDim}, 0);
  sparsa_tensor tv0 = device_tensor(v0, SPARSA_DTYPE_BF16, {1, n, kHeadsKv, kHeadDim}, 0);
  sparsa_tensor tout0 = device_tensor(out0, SPARSA_DTYPE_BF16, {1, 1, kHeadsQ, kHeadDim}, 0);
  args0.q = &tq0;
  args0.k = &tk0;
  args0.v = &tv0;
  args0.out = &tout0;
  cudaEvent_t begin0, end0;
  cuda_ok(cudaEventCreate(&begin0), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&end0), "cudaEventCreate");
  double single_ms[3];
  std::vector<std::vector<uint16_t>> single_out(3, std::vector<uint16_t>(kStateFloats));
  for (int p = 0; p < 3; ++p) {
    PolicyOnDevice policy = shard_policy(names[p], rows, 0, n, n, 0);
    policy.point_at_indices();
    for (int i = 0; i < kWarmup; ++i) sparsa_ok(sparsa_attention_run(ctx0, &args0, &policy.policy), "run");
    cuda_ok(cudaEventRecord(begin0, stream0), "cudaEventRecord");
    for (int i = 0; i < reps; ++i) sparsa_ok(sparsa_attention_run(ctx0, &args0, &policy.policy), "run");
    cuda_ok(cudaEventRecord(end0, stream0), "cudaEventRecord");
    cuda_ok(cudaEventSynchronize(end0), "cudaEventSynchronize");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, begin0, end0), "cudaEventElapsedTime");
    single_ms[p] = ms / reps;
    cuda_ok(cudaMemcpy(single_out[p].data(), out0, kStateFloats * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    cuda_ok(cudaFree(policy.indices_memory), "cudaFree");
  }
  for (void* p : {q0, k0, v0, static_cast<void*>(out0)}) cuda_ok(cudaFree(p), "cudaFree");
  sparsa_context_destroy(ctx0);

  // G GPUs: the shards, one communicator per GPU.
  std::vector<Rank> ranks(g_count);
  std::vector<int> devices(g_count);
  for (int g = 0; g < g_count; ++g) devices[g] = g;
  std::vector<ncclComm_t> comms(g_count);
  nccl_ok(ncclCommInitAll(comms.data(), g_count, devices.data()), "ncclCommInitAll");
  const int64_t length = n / g_count;
  for (int g = 0; g < g_count; ++g) {
    Rank& r = ranks[g];
    r.device = g;
    r.comm = comms[g];
    cuda_ok(cudaSetDevice(g), "cudaSetDevice");
    cuda_ok(cudaStreamCreateWithFlags(&r.stream, cudaStreamNonBlocking), "cudaStreamCreate");
    options.device_id = g;
    options.stream = r.stream;
    sparsa_ok(sparsa_context_create(&options, &r.ctx), "context_create");
    const size_t shard_elements = size_t(length) * kHeadsKv * kHeadDim;
    r.q = device_copy(q_host.data(), q_host.size() * 2);
    r.k = device_copy(k_host.data() + size_t(g) * shard_elements, shard_elements * 2);
    r.v = device_copy(v_host.data() + size_t(g) * shard_elements, shard_elements * 2);
    for (uint16_t** p : {&r.out, &r.merged_out}) cuda_ok(cudaMalloc(p, kStateFloats * 2), "cudaMalloc");
    for (float** p : {&r.lse, &r.merged_lse}) cuda_ok(cudaMalloc(p, kHeadsQ * 4), "cudaMalloc");
    cuda_ok(cudaMalloc(&r.gathered_out, g_count * kStateFloats * 2), "cudaMalloc");
    cuda_ok(cudaMalloc(&r.gathered_lse, g_count * kHeadsQ * 4), "cudaMalloc");
    r.tq = device_tensor(r.q, SPARSA_DTYPE_BF16, {1, 1, kHeadsQ, kHeadDim}, g);
    r.tk = device_tensor(r.k, SPARSA_DTYPE_BF16, {1, length, kHeadsKv, kHeadDim}, g);
    r.tv = device_tensor(r.v, SPARSA_DTYPE_BF16, {1, length, kHeadsKv, kHeadDim}, g);
    r.tout = device_tensor(r.out, SPARSA_DTYPE_BF16, {1, 1, kHeadsQ, kHeadDim}, g);
    r.tlse = device_tensor(r.lse, SPARSA_DTYPE_F32, {1, kHeadsQ, 1}, g);
    r.tmerged_out = device_tensor(r.merged_out, SPARSA_DTYPE_BF16, {1, 1, kHeadsQ, kHeadDim}, g);
    r.tmerged_lse = device_tensor(r.merged_lse, SPARSA_DTYPE_F32, {1, kHeadsQ, 1}, g);
    for (int m = 0; m < g_count; ++m) {
      r.part_out.push_back(device_tensor(r.gathered_out + m * kStateFloats, SPARSA_DTYPE_BF16,
                                         {1, 1, kHeadsQ, kHeadDim}, g));
      r.part_lse.push_back(device_tensor(r.gathered_lse + m * kHeadsQ, SPARSA_DTYPE_F32, {1, kHeadsQ, 1}, g));
    }
    sparsa_ok(SPARSA_ATTENTION_ARGS_INIT(&r.args), "args_init");
    r.args.q = &r.tq;
    r.args.k = &r.tk;
    r.args.v = &r.tv;
    r.args.out = &r.tout;
    r.args.lse = &r.tlse;
    cuda_ok(cudaEventCreate(&r.begin), "cudaEventCreate");
    cuda_ok(cudaEventCreate(&r.end), "cudaEventCreate");
  }

  FILE* json = json_path != nullptr ? std::fopen(json_path, "w") : nullptr;
  if (json_path != nullptr && json == nullptr) die("cannot write", json_path);
  if (json != nullptr) {  // the results form of bench/gpu/results_file.py: commit (SPARSA_COMMIT), date, card, rows
    const char* commit = std::getenv("SPARSA_COMMIT");
    char date[16];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    std::fprintf(json, "{\"commit\": \"%s\", \"date\": \"%s\", \"card\": \"%s\", \"gpus\": %d, \"rows\": [",
                 commit != nullptr ? commit : "unknown", date, props.name, g_count);
  }
  std::printf("C API + NCCL, %s x %d, N = %lld, %d steps back to back\n", props.name, g_count, (long long)n, reps);
  for (int p = 0; p < 3; ++p) {
    std::vector<PolicyOnDevice> policies;
    for (int g = 0; g < g_count; ++g) {
      cuda_ok(cudaSetDevice(g), "cudaSetDevice");
      policies.push_back(shard_policy(names[p], rows, g * length, length, n, g));
    }
    for (PolicyOnDevice& policy : policies) policy.point_at_indices();
    for (int i = 0; i < kWarmup; ++i) enqueue_step(ranks, policies);
    for (Rank& r : ranks) cuda_ok(cudaStreamSynchronize(r.stream), "cudaStreamSynchronize");
    for (Rank& r : ranks) cuda_ok(cudaEventRecord(r.begin, r.stream), "cudaEventRecord");
    for (int i = 0; i < reps; ++i) enqueue_step(ranks, policies);
    double cp_ms = 0;
    for (Rank& r : ranks) {
      cuda_ok(cudaEventRecord(r.end, r.stream), "cudaEventRecord");
      cuda_ok(cudaEventSynchronize(r.end), "cudaEventSynchronize");
      float ms = 0;
      cuda_ok(cudaEventElapsedTime(&ms, r.begin, r.end), "cudaEventElapsedTime");
      cp_ms = std::max(cp_ms, double(ms) / reps);
    }
    std::vector<uint16_t> merged(kStateFloats);
    double worst = 0, scale = 0;
    for (Rank& r : ranks) {  // every GPU holds the merged state
      cuda_ok(cudaMemcpy(merged.data(), r.merged_out, kStateFloats * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
      for (int64_t i = 0; i < kStateFloats; ++i) {
        const double want = float_of_bf16(single_out[p][i]);
        worst = std::max(worst, std::fabs(double(float_of_bf16(merged[i])) - want));
        scale = std::max(scale, std::fabs(want));
      }
    }
    const double relative = worst / std::max(scale, 1e-30), efficiency = single_ms[p] / (g_count * cp_ms);
    std::printf("decode %-14s one GPU %8.4f ms, %d GPUs %8.4f ms, efficiency %.3f, max relative difference %.2e\n",
                names[p], single_ms[p], g_count, cp_ms, efficiency, relative);
    if (json != nullptr) {
      std::fprintf(json,
                   "%s\n {\"workload\": \"%s_decode_%lldk_cp_c_api\", \"sparsa_ms\": %.5f, \"peer\": "
                   "\"sparsa_one_gpu\", \"peer_ms\": %.5f, \"speedup\": %.4f, \"gpus\": %d, \"efficiency\": %.4f, "
                   "\"check_relative\": %.3g}",
                   p == 0 ? "" : ",", names[p], (long long)(n / 1024), cp_ms, single_ms[p], single_ms[p] / cp_ms,
                   g_count, efficiency, relative);
    }
    for (int g = 0; g < g_count; ++g) {
      cuda_ok(cudaSetDevice(g), "cudaSetDevice");
      cuda_ok(cudaFree(policies[g].indices_memory), "cudaFree");
    }
  }
  if (json != nullptr) {
    std::fprintf(json, "\n]}\n");
    std::fclose(json);
  }
  for (Rank& r : ranks) {
    cuda_ok(cudaSetDevice(r.device), "cudaSetDevice");
    sparsa_context_destroy(r.ctx);
    ncclCommDestroy(r.comm);
  }
  return 0;
}
