#!/usr/bin/env bash
# Builds the libFuzzer targets (the `fuzz` preset: clang, ASan + UBSan, CPU backend) into build/fuzz and runs every
# target with the committed seed corpus (tests/fuzz/corpus/<target>/) for SECONDS in total, split evenly.
#   bash tools/run-fuzz.sh SECONDS
# Exits non-zero when a target finds a crash, leak, sanitizer report or timeout (its reproducer is left in
# build/fuzz/artifacts/), or when the build fails. New inputs go to build/fuzz/corpus/<target>/ (not committed).
# Installs clang and its runtime from Debian when missing (like tools/setup-and-run.sh).
set -euo pipefail

total_seconds=${1:?usage: tools/run-fuzz.sh SECONDS}
[[ $total_seconds =~ ^[0-9]+$ ]] && ((total_seconds >= 2)) || { echo "run-fuzz: SECONDS must be an integer >= 2" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
targets=(fuzz_attention_run fuzz_utilities)
log() { printf 'run-fuzz: %s\n' "$*" >&2; }

packages=(clang libclang-rt-14-dev cmake)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' || missing+=("$package")
done
if ((${#missing[@]})); then
  sudo=()
  if [[ $(id -u) != 0 ]]; then
    command -v sudo >/dev/null || { log "need root or sudo to install: ${missing[*]}"; exit 1; }
    sudo=(sudo)
  fi
  log "installing: ${missing[*]}"
  apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -y -q)
  "${apt[@]}" update
  "${apt[@]}" install "${missing[@]}"
fi

log "configuring and building the fuzz preset in build/fuzz"
cmake --preset fuzz >build/fuzz-configure.log 2>&1 || { mkdir -p build; cat build/fuzz-configure.log >&2; exit 1; }
cmake --build build/fuzz -j"$(nproc)" --target "${targets[@]}"

per_target=$((total_seconds / ${#targets[@]}))
mkdir -p build/fuzz/artifacts
status=0
for target in "${targets[@]}"; do
  work=build/fuzz/corpus/$target
  mkdir -p "$work"
  log "$target: ${per_target} s (seeds: tests/fuzz/corpus/$target)"
  # -timeout: one input may take at most 10 s; -rss_limit_mb: a run that sizes memory from a parameter shows up.
  if ! ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      "build/fuzz/tests/fuzz/$target" -max_total_time="$per_target" -timeout=10 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="build/fuzz/artifacts/$target-" \
      "$work" "tests/fuzz/corpus/$target" >"build/fuzz/$target.log" 2>&1; then
    log "$target FAILED: see build/fuzz/$target.log and build/fuzz/artifacts/"
    tail -n 60 "build/fuzz/$target.log" >&2
    status=1
  fi
  # The last status line (execs, cov, ft, corpus) and the final stats.
  grep -E '^#[0-9]+' "build/fuzz/$target.log" | tail -n 1 >&2 || true
  grep -E '^stat::(number_of_executed_units|new_units_added|peak_rss_mb)' "build/fuzz/$target.log" >&2 || true
done
exit $status
