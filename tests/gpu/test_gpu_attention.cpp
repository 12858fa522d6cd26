// What only the CUDA backend has, through the public C API: a run captured in a CUDA graph replays to the eager
// result, and a case beyond this backend's own limits (head_dim > 256; the CPU backend computes it) is refused with
// UNSUPPORTED and a reason, its output untouched. Everything else moved to the backend-parameterised suite: the
// attention cases and TOKEN_INDICES split-KV are rows of tests/test_attention_case_tables.cpp (DecodeCases), device
// ids out of range TokenIndices.IdsOutsideTheirRangeInDeviceMemoryActAsUnusedSlots (tests/test_token_indices.cpp),
// merge_states the table MergeCases (tests/test_merge.cpp). Skips cleanly when no CUDA device/driver is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sparsa/sparsa.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_case.h"
#include "gpu_test_util.h"

namespace {

using namespace sparsa_gpu_test;

// A run is captured in a CUDA graph after plan() and replays to the same result (ABI.md rule 9).
TEST(GpuAttentionGraph, CaptureAndReplay) {
  SKIP_WITHOUT_GPU();
  Case c;
  c.name = "graph";
  c.head_dim = 128;
  c.seq_q = {200};
  c.seq_k = {200};
  c.causal = true;
  std::mt19937 rng(7);
  Inputs in = make_inputs(c, rng);
  Physical ph = build_physical(c, in, rng);
  const RunResult eager = run_case(c, in, ph, true);
  ASSERT_EQ(eager.status, SPARSA_STATUS_SUCCESS) << eager.message;

  ScopedStream owned_stream;
  CUDA_OK(cudaStreamCreate(owned_stream.out()));
  const cudaStream_t stream = owned_stream.get();
  ScopedContext context(context_options(SPARSA_DEVICE_CUDA, stream));
  SPARSA_OK(context.status());
  sparsa_context* const ctx = context.get();
  DeviceBuffer q(ph.q.size()), k(ph.k.size()), v(ph.v.size()), out(ph.q.size());
  q.upload(ph.q.data(), ph.q.size());
  k.upload(ph.k.data(), ph.k.size());
  v.upload(ph.v.data(), ph.v.size());
  out.poison();
  sparsa_tensor tq = make_tensor(q.data(), c.dtype, ph.q_shape, SPARSA_DEVICE_CUDA);
  sparsa_tensor tk = make_tensor(k.data(), c.dtype, ph.kv_shape, SPARSA_DEVICE_CUDA);
  sparsa_tensor tv = make_tensor(v.data(), c.dtype, ph.kv_shape, SPARSA_DEVICE_CUDA);
  sparsa_tensor tout = make_tensor(out.data(), c.dtype, ph.out_shape, SPARSA_DEVICE_CUDA);
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  args.q = &tq;
  args.k = &tk;
  args.v = &tv;
  args.out = &tout;
  args.causal = 1;
  SPARSA_OK(sparsa_attention_plan(ctx, &args, nullptr));
  ScopedGraph graph;
  CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const sparsa_status captured = sparsa_attention_run(ctx, &args, nullptr);
  CUDA_OK(cudaStreamEndCapture(stream, graph.out()));
  ASSERT_EQ(captured, SPARSA_STATUS_SUCCESS) << sparsa_last_error_message();
  ScopedGraphExec exec;
  CUDA_OK(cudaGraphInstantiate(exec.out(), graph.get(), 0));
  for (int replay = 0; replay < 3; ++replay) CUDA_OK(cudaGraphLaunch(exec.get(), stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  const std::vector<float> replayed = decode(out.download<uint8_t>(ph.q.size()), c.dtype);
  ASSERT_EQ(replayed.size(), eager.out.size());
  for (size_t i = 0; i < replayed.size(); ++i) ASSERT_EQ(replayed[i], eager.out[i]) << "element " << i;
}

// What the backend does not implement is refused with UNSUPPORTED and a reason, never computed wrongly.
// Every policy runs on the GPU now; a case beyond the backend's limits (head_dim > 256) must still be refused up
// front with UNSUPPORTED and a reason naming the limit, with the output untouched.
TEST(GpuAttentionSupport, CaseBeyondTheLimitsIsUnsupportedWithAReason) {
  SKIP_WITHOUT_GPU();
  constexpr int64_t kTooLargeHeadDim = 320;
  ScopedContext context(context_options(SPARSA_DEVICE_CUDA));
  SPARSA_OK(context.status());
  sparsa_context* const ctx = context.get();
  const int64_t shape[4] = {1, 1, 2, kTooLargeHeadDim};
  const size_t bytes = 2 * kTooLargeHeadDim * 2;
  DeviceBuffer buf(bytes);
  sparsa_tensor t;
  sparsa_tensor_init(&t, sizeof t, buf.data(), SPARSA_DTYPE_F16, 4, shape);
  t.device_type = SPARSA_DEVICE_CUDA;
  sparsa_attention_args args;
  sparsa_attention_args_init(&args, sizeof args);
  DeviceBuffer out(bytes);
  const std::vector<uint8_t> poison(bytes, 0xAB);
  CUDA_OK(cudaMemcpy(out.data(), poison.data(), bytes, cudaMemcpyHostToDevice));
  sparsa_tensor tout = t;
  tout.data = out.data();
  args.q = &t;
  args.k = &t;
  args.v = &t;
  args.out = &tout;
  sparsa_policy policy;
  sparsa_policy_init(&policy, sizeof policy, SPARSA_POLICY_DENSE);
  EXPECT_EQ(sparsa_attention_run(ctx, &args, &policy), SPARSA_STATUS_UNSUPPORTED);
  EXPECT_NE(std::string(sparsa_last_error_message()).find("head_dim"), std::string::npos)
      << sparsa_last_error_message();
  std::vector<uint8_t> after(bytes);
  CUDA_OK(cudaMemcpy(after.data(), out.data(), bytes, cudaMemcpyDeviceToHost));
  EXPECT_EQ(after, poison);
}

}  // namespace
