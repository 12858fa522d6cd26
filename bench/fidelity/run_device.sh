#!/usr/bin/env bash
# The fidelity model's GPU work in one invocation on a GPU machine (docs/fidelity.md). Repository root as cwd, $OUT writable.
#
#   bash bench/fidelity/run_device.sh train [TRAIN_SECONDS]   # libsparsa build (background) + training
#   bash bench/fidelity/run_device.sh sweep [SWEEP_SECONDS]   # build libsparsa if needed + the harness sweep
#   bash bench/fidelity/run_device.sh all [TRAIN_SECONDS] [SWEEP_SECONDS]
#
# Needs bench/fidelity/data/{train,heldout}.bin in the working tree (git-ignored: made by prepare_data.py and
# carried). SPARSA_LIBRARY=/path/libsparsa.so skips the build. The sweep's checkpoint: $CKPT if set, else the one a
# train step on this machine left in build/fidelity/checkpoint.npz (build/ is git-ignored and not carried, so it stays
# on a warm machine; bench/fidelity/data would be replaced by the carried copy), else bench/fidelity/checkpoint.npz.
# Files under $OUT (at most 8): checkpoint.npz, train_log.jsonl, train.log, build.log, fidelity_results.json,
# sweep.log, run_device.log.
set -u -o pipefail
MODE=${1:-all}
OUT=${OUT:-/tmp/sparsa-fidelity-out}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
PY=${PYTHON:-python3}
BUILD=${BUILD:-build/dev}
JOBS=$(( $(nproc) > 4 ? $(nproc) - 2 : 2 ))  # leave cores to the training loop
export PATH=/usr/local/cuda/bin:$PATH
exec > >(tee -a "$OUT/run_device.log") 2>&1
case $MODE in
  train) TRAIN_SECONDS=${2:-360} ;;
  sweep) SWEEP_SECONDS=${2:-150} ;;
  all) TRAIN_SECONDS=${2:-300}; SWEEP_SECONDS=${3:-180} ;;
  *) echo "usage: $0 train|sweep|all [seconds...]"; exit 2 ;;
esac

echo "=== $(date -u +%FT%TZ) mode $MODE, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" || exit 1
for f in bench/fidelity/data/train.bin bench/fidelity/data/heldout.bin; do
  [ -s "$f" ] || { echo "missing $f: run bench/fidelity/prepare_data.py here and carry bench/fidelity/data"; exit 1; }
done

BUILD_PID=""
start_build() {  # libsparsa with the CUDA backend (sm_90a), library target only
  if [ -n "${SPARSA_LIBRARY:-}" ]; then echo "library: $SPARSA_LIBRARY (given)"; return; fi
  if grep -q "SPARSA_CUDA:BOOL=ON" "$BUILD/CMakeCache.txt" 2>/dev/null; then
    echo "library: $BUILD exists, building incrementally"
  fi
  ( t0=$(date +%s)
    cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DSPARSA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DSPARSA_HIP=OFF \
      -DSPARSA_BUILD_TESTS=OFF -DSPARSA_BUILD_BINDINGS=OFF -DSPARSA_BUILD_TOOLS=OFF -DSPARSA_BUILD_BENCH=OFF &&
    nice -n 10 cmake --build "$BUILD" -j "$JOBS" --target sparsa
    echo "build exit $? after $(( $(date +%s) - t0 )) s" ) > "$OUT/build.log" 2>&1 &
  BUILD_PID=$!
}
wait_build() {
  if [ -n "$BUILD_PID" ]; then wait "$BUILD_PID"; BUILD_PID=""; fi
  if [ -z "${SPARSA_LIBRARY:-}" ]; then
    grep -E "sparsa: CUDA backend|build exit" "$OUT/build.log"
    SPARSA_LIBRARY=$(ls "$ROOT/$BUILD"/libsparsa.so.*.*.* 2>/dev/null | head -1)
    if [ -z "$SPARSA_LIBRARY" ]; then
      echo "libsparsa build failed:"; grep -E -A3 "error" "$OUT/build.log" | head -30; return 1
    fi
    grep -q "SPARSA_CUDA:BOOL=ON" "$BUILD/CMakeCache.txt" || { echo "built without CUDA"; return 1; }
  fi
  export SPARSA_LIBRARY
  echo "library: $SPARSA_LIBRARY"
}

start_build
if [ "$MODE" = train ] || [ "$MODE" = all ]; then
  echo "=== train: $TRAIN_SECONDS s budget"
  $PY bench/fidelity/train.py --time-budget "$TRAIN_SECONDS" --out "$OUT/checkpoint.npz" \
    --log "$OUT/train_log.jsonl" ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1
  rc=$?
  grep -E "parameters|compile|done|Error|error" "$OUT/train.log" | head -20; tail -3 "$OUT/train.log"
  [ $rc -eq 0 ] || { echo "training failed (exit $rc)"; exit 1; }
  mkdir -p build/fidelity && cp "$OUT/checkpoint.npz" build/fidelity/checkpoint.npz
fi
wait_build || exit 1
$PY -c "import sys; sys.path.insert(0, 'bindings/python'); import sparsa; print('sparsa', sparsa.__version__)" || exit 1

if [ "$MODE" = sweep ] || [ "$MODE" = all ]; then
  CKPT=${CKPT:-}
  [ -n "$CKPT" ] || { [ -s build/fidelity/checkpoint.npz ] && CKPT=build/fidelity/checkpoint.npz; }
  [ -n "$CKPT" ] || CKPT=bench/fidelity/checkpoint.npz
  $PY -c "
import json, sys, numpy as np
meta = json.loads(bytes(np.load(sys.argv[1])['__meta__']).decode())
print('checkpoint', sys.argv[1], meta['config'], meta['extra'].get('steps'), 'steps')
if meta['config']['d_model'] < 128: print('WARNING: this is the tiny placeholder checkpoint, not the trained model')
" "$CKPT"
  echo "=== sweep: $SWEEP_SECONDS s limit"
  # HARNESS_ARGS: extra harness options (a local dry run uses "--backend torch-cpu --quick ...")
  $PY bench/fidelity/harness.py --backend cuda --checkpoint "$CKPT" --out "$OUT/fidelity_results.json" \
    --time-limit "$SWEEP_SECONDS" ${HARNESS_ARGS:-} > "$OUT/sweep.log" 2>&1
  echo "harness exit $?"; tail -5 "$OUT/sweep.log"
fi
echo "=== $(date -u +%FT%TZ) done"
