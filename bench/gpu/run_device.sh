#!/usr/bin/env bash
# Everything the GPU checks need, in one invocation on a GPU machine: build (sm_90a + sm_80), the GPU tests,
# compute-sanitizer (memcheck on all GPU tests, racecheck on a small case), and the benchmark against the peers.
# Logs go under $OUT.
#
#   bash bench/gpu/run_device.sh [build|tests|python|bench|profile|cp|all]   (default all = tests + python + bench;
#   cp = the context-parallel tests, the torchrun example on every GPU present, and both context-parallel benchmarks
#   at G = 2, 4 and 8 where the machine has that many GPUs)
#   SPARSA_PREBUILT=DIR skips the build and runs the binaries in DIR (libsparsa.so*, tests/sparsa_tests,
#   tests/gpu/sparsa_gpu_tests), e.g. built on another machine for sm_90a and carried.
#
# GoogleTest: uses the machine's if present, else builds the source carried in .peers/googletest (a copy of
# /usr/src/googletest, for a GPU machine without one). FlexAttention/SDPA peers come from the image's torch.
set -u -o pipefail
STEPS=${1:-all}
OUT=${OUT:-/tmp/sparsa-gpu-out}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BUILD=/tmp/sparsa-gpu-build
JOBS=$(nproc)
export PATH=/usr/local/cuda/bin:$PATH

LOGS=/tmp/sparsa-gpu-logs  # logs not worth keeping ($OUT holds only the few files worth reading)
mkdir -p $LOGS
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$LOGS/device.txt"

GTEST_PREFIX=""
if [ -d "$ROOT/.peers/googletest" ]; then
  GTEST_PREFIX=/tmp/gtest
  if [ ! -d $GTEST_PREFIX ]; then
    cmake -S "$ROOT/.peers/googletest" -B /tmp/gtest-build -DCMAKE_INSTALL_PREFIX=$GTEST_PREFIX -DBUILD_GMOCK=OFF \
      -DCMAKE_BUILD_TYPE=Release > "$LOGS/gtest.log" 2>&1 &&
      cmake --build /tmp/gtest-build -j "$JOBS" >> "$LOGS/gtest.log" 2>&1 &&
      cmake --install /tmp/gtest-build >> "$LOGS/gtest.log" 2>&1 || echo "googletest build failed (see gtest.log)"
  fi
fi

if [ -n "${SPARSA_PREBUILT:-}" ]; then  # binaries built elsewhere: lib*.so*, tests/sparsa_tests, tests/gpu/sparsa_gpu_tests
  BUILD=$SPARSA_PREBUILT
  export LD_LIBRARY_PATH=$BUILD${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  echo "prebuilt binaries in $BUILD"
else
  t0=$(date +%s)
  cmake -S "$ROOT" -B $BUILD -DCMAKE_BUILD_TYPE=Release ${GTEST_PREFIX:+-DCMAKE_PREFIX_PATH=$GTEST_PREFIX} \
    "-DCMAKE_CUDA_ARCHITECTURES=90a;80" -DSPARSA_BUILD_BINDINGS=OFF -DSPARSA_BUILD_TOOLS=OFF -DSPARSA_BUILD_BENCH=OFF \
    > "$LOGS/configure.log" 2>&1 || { echo "configure failed"; tail -30 "$LOGS/configure.log"; exit 1; }
  grep "sparsa:" "$LOGS/configure.log"
  cmake --build $BUILD -j "$JOBS" --target sparsa sparsa_gpu_tests sparsa_tests > "$LOGS/build.log" 2>&1 ||
    { echo "build failed"; grep -E -A3 "error" "$LOGS/build.log" | head -40; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s; warnings: $(grep -c 'warning' "$LOGS/build.log")"
fi
TESTS=$BUILD/tests/gpu/sparsa_gpu_tests
SHARED=$BUILD/tests/sparsa_tests  # the backend-parameterised suite; its CUDA instances run here
LIB=$(ls $BUILD/libsparsa.so.*.*.* | head -1)

if [ "$STEPS" = all ] || [ "$STEPS" = tests ]; then
  summary() {  # pass/fail/skip counts of a gtest log, and the failed tests' names
    echo "passed $(grep -c '^\[       OK \]' "$1") failed $(grep -c '^\[  FAILED  \].*(' "$1") skipped $(grep -c '^\[  SKIPPED \].*(' "$1")"
    grep -E '^\[  FAILED  \].*\(' "$1" | head -30
  }
  echo "=== GPU tests ==="
  timeout 150 $TESTS > "$OUT/gpu_tests.log" 2>&1; echo "exit $?"; summary "$OUT/gpu_tests.log"
  grep -B2 -A10 "Failure" "$OUT/gpu_tests.log" | head -40
  echo "=== shared suite, CUDA instances ==="
  timeout 200 $SHARED --gtest_filter='*/CUDA:*_CUDA' > "$OUT/shared_cuda.log" 2>&1; rc=$?; echo "exit $rc"
  if [ $rc -ge 124 ]; then  # a crash or hang ends the process: run every test in its own process instead
    echo "whole-suite run ended abnormally after: $(grep '^\[ RUN' "$OUT/shared_cuda.log" | tail -1); one process per test:"
    : > "$OUT/shared_cuda.log"
    for t in $($SHARED --gtest_filter='*/CUDA:*_CUDA' --gtest_list_tests | awk '/^[^ ]/{s=$1} /^  /{print s $1}'); do
      timeout 60 $SHARED --gtest_filter="$t" >> "$OUT/shared_cuda.log" 2>&1
      trc=$?; [ $trc -ge 124 ] && echo "[  FAILED  ] $t (crashed: exit $trc) (" >> "$OUT/shared_cuda.log"
    done
  fi
  summary "$OUT/shared_cuda.log"
  grep -A8 "Failure" "$OUT/shared_cuda.log" | head -60
  echo "--- skip reasons (distinct) ---"
  grep -A1 ": Skipped" "$OUT/shared_cuda.log" | grep -v -E ": Skipped|^--" | cut -c1-150 | sort | uniq -c | sort -rn | head -15
  echo "=== compute-sanitizer memcheck (shared suite, CUDA instances) ==="
  timeout ${MEMCHECK_S:-150} compute-sanitizer --tool memcheck --error-exitcode 3 $SHARED --gtest_filter='*/CUDA:*_CUDA' > "$OUT/memcheck_shared.log" 2>&1
  echo "memcheck exit $? ; $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_shared.log" | tail -1); $(summary "$OUT/memcheck_shared.log" | head -1)"
  echo "=== compute-sanitizer racecheck (TOKEN_INDICES, stats, sink/window, small attention case-table rows) ==="
  timeout 60 compute-sanitizer --tool racecheck --error-exitcode 3 $SHARED \
    --gtest_filter='Backends/TokenIndices.*/CUDA:Backends/Common.Stats*/CUDA:*PvSkip*/CUDA:Backends/PrefillCases.*/dense_f16_d64_noncausal_CUDA:Backends/PrefillCases.*/paged_ps1*_CUDA:Backends/PrefillCases.*/block_sparse_bf16*_CUDA:Backends/PrefillCases.*/decode_split_kv*_CUDA' > "$LOGS/racecheck_shared.log" 2>&1
  echo "racecheck exit $? ; $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$LOGS/racecheck_shared.log" | tail -1); $(summary "$LOGS/racecheck_shared.log" | head -1)"
  echo "=== compute-sanitizer memcheck (GPU tests) ==="
  timeout ${MEMCHECK_S:-150} compute-sanitizer --tool memcheck --error-exitcode 3 $TESTS > "$OUT/memcheck.log" 2>&1
  echo "memcheck exit $? ; $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1); $(summary "$OUT/memcheck.log" | head -1)"
  echo "=== compute-sanitizer racecheck (the GPU tests' graph captures: decode, TOKEN_SELECT, TOKEN_SPARSE, Δ rows) ==="
  timeout 150 compute-sanitizer --tool racecheck --error-exitcode 3 $TESTS \
    --gtest_filter='GpuDecodeGraph*:GpuTokenSelect*:GpuTokenSparseGraph*:GpuDeltaRows*' > "$LOGS/racecheck.log" 2>&1
  echo "racecheck exit $? ; $(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$LOGS/racecheck.log" | tail -1); $(summary "$LOGS/racecheck.log" | head -1)"
fi

if [ "$STEPS" = all ] || [ "$STEPS" = python ]; then
  # The Python binding on the device: the torch op on the default and a side stream, torch.compile, CUDA-graph
  # capture (test_torch_streams.py) and the transformers client (test_transformers.py), against this build's
  # CUDA library. pytest comes from .peers/pylib when the image has none (a copy of Debian's pure-Python pytest).
  echo "=== Python binding tests (torch op on CUDA, transformers) ==="
  PYPATH="$ROOT/bindings/python"
  python3 -c "import pytest" 2>/dev/null || PYPATH="$PYPATH:$ROOT/.peers/pylib"
  ( cd /tmp && SPARSA_LIBRARY="$LIB" PYTHONPATH="$PYPATH" timeout 300 python3 -m pytest -q -rs -p no:cacheprovider \
      "$ROOT/bindings/python/tests" > "$LOGS/python.log" 2>&1; echo "pytest exit $?" >> "$LOGS/python.log" )
  cp "$LOGS/python.log" "$OUT/python.log"
  tail -25 "$LOGS/python.log"
fi

if [ "$STEPS" = cp ]; then  # context parallelism (docs/context_parallel.md): needs >= 2 GPUs for the NCCL parts
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # NVLink multicast stays off
  GPUS=$(nvidia-smi -L | wc -l)
  echo "=== context-parallel, TOKEN_SELECT and query-offset tests, CUDA instances ($GPUS GPUs) ==="
  timeout 200 $SHARED --gtest_filter='*ContextParallel*/CUDA:*Merge*/CUDA:*TokenSelect*/CUDA:Backends/SelectCases.*_CUDA:Backends/QueryOffsetCases.*_CUDA' \
    > "$OUT/cp_shared_cuda.log" 2>&1; echo "exit $?"
  for tool in memcheck racecheck; do
    timeout 100 compute-sanitizer --tool $tool --error-exitcode 3 $SHARED --gtest_filter='*ContextParallel*/CUDA:*Merge*/CUDA:Backends/QueryOffsetCases.*_CUDA' \
      > "$LOGS/cp_$tool.log" 2>&1
    echo "$tool exit $? ; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/cp_$tool.log" | tail -1)"
  done
  grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/cp_shared_cuda.log" | head -20
  grep -A8 "Failure" "$OUT/cp_shared_cuda.log" | head -40
  timeout 120 $TESTS --gtest_filter='*TokenSelect*' > "$OUT/cp_gpu_tests.log" 2>&1; echo "GPU TOKEN_SELECT tests exit $?"
  grep -E '^\[  (PASSED|FAILED) ' "$OUT/cp_gpu_tests.log"
  PYPATH="$ROOT/bindings/python"
  python3 -c "import pytest" 2>/dev/null || PYPATH="$PYPATH:$ROOT/.peers/pylib"
  echo "=== sparsa.distributed tests (threads on the CPU backend, the example on two processes) ==="
  ( cd /tmp && SPARSA_LIBRARY="$LIB" PYTHONPATH="$PYPATH" timeout 200 python3 -m pytest -q -p no:cacheprovider \
      "$ROOT/bindings/python/tests/test_distributed.py" 2>&1 | tail -4 )
  if [ "$GPUS" -ge 2 ]; then
    echo "=== the torchrun example on $GPUS GPUs (NCCL), --check against one context ==="
    ( cd /tmp && SPARSA_LIBRARY="$LIB" PYTHONPATH="$ROOT/bindings/python" timeout 200 torchrun --nproc-per-node "$GPUS" \
        "$ROOT/bindings/python/examples/context_parallel_torchrun.py" --check > "$OUT/cp_example.log" 2>&1;
      echo "torchrun exit $?" >> "$OUT/cp_example.log" )
    grep -v -E "^\s*$|Warning|warn\(" "$OUT/cp_example.log" | tail -8
    for G in $(seq 2 "$GPUS" | grep -E '^(2|4|8)$'); do  # strong scaling at each power of two the machine has
      echo "=== context-parallel benchmark ($G GPUs vs one) ==="
      PYTHONUNBUFFERED=1 timeout ${CP_BENCH_S:-300} python3 "$ROOT/bench/gpu/bench_context_parallel.py" "$LIB" \
        --ranks "$G" --out "$OUT" ${CP_BENCH_ARGS:-} > "$OUT/cp_bench_x$G.log" 2>&1; echo "bench exit $?"
      grep -v -E "Warning|warn\(" "$OUT/cp_bench_x$G.log" | tail -20
    done
    echo "=== context-parallel decode through the C API and NCCL (bench_cp_decode.cpp) ==="
    NCCL_HOME=""  # the CUDA toolkit's NCCL, else the one torch's wheels bring
    for d in /usr/local/cuda $(python3 -c "import nvidia.nccl as m; print(list(m.__path__)[0])" 2>/dev/null); do
      [ -f "$d/include/nccl.h" ] && { NCCL_HOME=$d; break; }
    done
    NCCL_LIB=$(ls "$NCCL_HOME"/lib*/libnccl.so* 2>/dev/null | head -1)
    if [ -z "$NCCL_HOME" ] || [ -z "$NCCL_LIB" ]; then
      echo "no NCCL header and library found: not built"
    elif g++ -O2 -std=c++17 "$ROOT/bench/gpu/bench_cp_decode.cpp" -I"$ROOT/include" -I/usr/local/cuda/include \
        -I"$NCCL_HOME/include" -L"$BUILD" -lsparsa -Wl,-rpath,"$BUILD" "$NCCL_LIB" -Wl,-rpath,"$(dirname "$NCCL_LIB")" \
        -L/usr/local/cuda/lib64 -lcudart -lpthread -o /tmp/bench_cp_decode > "$LOGS/bench_cp_decode_build.log" 2>&1; then
      for G in $(seq 2 "$GPUS" | grep -E '^(2|4|8)$'); do
        timeout 200 /tmp/bench_cp_decode --gpus "$G" --json "$OUT/cp_decode_c_api_x$G.json" 2>&1 |
          tee "$OUT/cp_decode_c_api_x$G.log"
      done
    else
      echo "bench_cp_decode build failed:"; head -20 "$LOGS/bench_cp_decode_build.log"
    fi
    echo "=== the C example (examples/context_parallel_nccl.c) against the CPU oracle (cp_example_check.c) ==="
    if [ -n "$NCCL_LIB" ] && gcc -O2 -std=gnu99 "$ROOT/bench/gpu/cp_example_check.c" -I"$ROOT/include" \
        -I/usr/local/cuda/include -I"$NCCL_HOME/include" -L"$BUILD" -lsparsa -Wl,-rpath,"$BUILD" "$NCCL_LIB" \
        -Wl,-rpath,"$(dirname "$NCCL_LIB")" -L/usr/local/cuda/lib64 -lcudart -lpthread -lm -o /tmp/cp_example_check \
        > "$LOGS/cp_example_check_build.log" 2>&1; then
      for G in $(seq 2 "$GPUS" | grep -E '^(2|4|8)$'); do
        timeout 300 /tmp/cp_example_check --gpus "$G" 2>&1 | tee "$OUT/cp_example_check_x$G.log"
      done
    else
      echo "cp_example_check not built:"; head -20 "$LOGS/cp_example_check_build.log" 2>/dev/null
    fi
  fi
fi

if [ "$STEPS" = profile ]; then  # not part of "all": ncu takes minutes
  echo "=== decode paths kernel by kernel (torch.profiler) ==="
  (cd "$ROOT/bench/gpu" && timeout 200 python3 profile_decode.py "$LIB") > "$OUT/profile_decode.log" 2>&1
  echo "exit $?"; cat "$OUT/profile_decode.log" | grep -v Warning | head -120
  echo "=== ncu (dense decode, TOKEN_SELECT miss, cuDNN decode at 128K) ==="
  (cd "$ROOT/bench/gpu" && timeout 240 ncu --clock-control none \
    -k regex:'decode_mma|score_f32|log_vote|merge_kernel|device_topk|topk|list_kernel|prepare|combine|cudnn|sm90|fmha' \
    --launch-count 14 --section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    --section WarpStateStats python3 profile_decode.py "$LIB" --ncu) > "$OUT/ncu.log" 2>&1
  echo "ncu exit $?"
  grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Grid Size|Block Size|Warp Cycles Per Issued" "$OUT/ncu.log" | head -120
fi

if [ "$STEPS" = all ] || [ "$STEPS" = bench ]; then
  echo "=== benchmark ==="
  PYTHONUNBUFFERED=1 python3 "$ROOT/bench/gpu/bench_gpu.py" "$LIB" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -30
  # bench/results/<card>.json (the form docs/performance.md quotes); SPARSA_COMMIT names the commit measured
  python3 "$ROOT/bench/gpu/results_file.py" "$OUT/bench_gpu.json" "${SPARSA_COMMIT:-unknown}" "$OUT"
fi
