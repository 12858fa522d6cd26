// Cost of a chain of small kernels in one CUDA graph, with and without programmatic dependent launch (PDL): the
// question behind TOKEN_SELECT's hit path, which replays a dozen kernels that mostly exit at once.
//   nvcc -O2 -gencode=arch=compute_90a,code=sm_90a -o launch_chain bench/gpu/launch_chain.cu && ./launch_chain
// Prints the time per graph replay for chains of 1 and 14 kernels (every third one with `wide` blocks, the rest 32),
// whose blocks exit at once (skip 1) or touch one int each (skip 0).
#include <cuda_runtime.h>

#include <cstdio>

namespace {

constexpr int kThreads = 256;
constexpr int kReplays = 2000, kWarmups = 50;

template <bool kDependent>
__global__ void step(const int* skip, int* out, int n) {
  if (kDependent) {
    asm volatile("griddepcontrol.wait;" ::: "memory");  // the previous kernel's writes are visible
    asm volatile("griddepcontrol.launch_dependents;");
  }
  if (*skip) return;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] += 1;
}

template <bool kDependent>
void launch(dim3 grid, const int* skip, int* out, int n, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = kThreads;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = kDependent ? 1 : 0;
  cudaLaunchKernelEx(&config, step<kDependent>, skip, out, n);
}

template <bool kDependent>
float microseconds_per_replay(int chain, int wide, int skip_value) {
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  int *skip = nullptr, *out = nullptr;
  const int n = 1 << 20;
  cudaMalloc(&skip, sizeof(int));
  cudaMalloc(&out, n * sizeof(int));
  cudaMemcpy(skip, &skip_value, sizeof(int), cudaMemcpyHostToDevice);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
  for (int i = 0; i < chain; ++i) launch<kDependent>(dim3(i % 3 == 0 ? wide : 32), skip, out, n, stream);
  cudaStreamEndCapture(stream, &graph);
  if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) return -1.0f;
  for (int i = 0; i < kWarmups; ++i) cudaGraphLaunch(exec, stream);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  cudaEventRecord(start, stream);
  for (int i = 0; i < kReplays; ++i) cudaGraphLaunch(exec, stream);
  cudaEventRecord(stop, stream);
  cudaEventSynchronize(stop);
  float ms = 0.0f;
  cudaEventElapsedTime(&ms, start, stop);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) std::printf("error: %s\n", cudaGetErrorString(status));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(skip);
  cudaFree(out);
  cudaStreamDestroy(stream);
  return ms * 1000.0f / kReplays;
}

}  // namespace

int main() {
  for (int wide : {64, 4096}) {
    for (int skip : {1, 0}) {
      for (int chain : {1, 14}) {
        const float plain = microseconds_per_replay<false>(chain, wide, skip);
        const float dependent = microseconds_per_replay<true>(chain, wide, skip);
        std::printf("chain %2d, wide grid %4d, skip %d: plain %.2f us, PDL %.2f us\n", chain, wide, skip, plain,
                    dependent);
      }
    }
  }
  return 0;
}
