#!/usr/bin/env bash
# The two commands of README.md, each self-contained on a fresh Debian 12 machine:
#   tools/setup-and-run.sh demo [demo options]   installs what the build needs, builds the CPU library and the
#                                                `sparsa` tool (preset "cpu"), runs `sparsa demo`
#   tools/setup-and-run.sh test                  installs what the build and every test need, configures and builds
#                                                everything (preset "ci"), runs every ctest (a binding or install
#                                                test skipped for a missing toolchain fails the run), then the CPU
#                                                suite under ASan+UBSan and TSan (clang), cross-built for aarch64
#                                                under qemu-user, and a short fuzz run (tools/run-fuzz.sh); exits
#                                                non-zero on the first failure (docs/testing.md)
#   tools/setup-and-run.sh bindings [ctest opts] installs what the bindings need, builds the CPU library with every
#                                                binding (preset "cpu": no GPU code is compiled), runs the binding
#                                                tests and the install/consumer tests (ctest labels bindings, install)
# Idempotent: apt is skipped when every package is present, and builds are incremental. Works as root (CI) and as a
# user with sudo.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mode=${1:-}
shift || true

# Debian packages. The build: compiler, CMake, pkg-config, GoogleTest, Google Benchmark. The tests (docs/testing.md):
# the HIP toolchain (compile-only), SWIG + JUnit (Java binding), Go, bindgen (Rust binding), DLPack, numpy + pytest
# for Debian's /usr/bin/python3 (the python3 on PATH may be a pyenv that cannot see them).
build_packages=(g++ cmake pkg-config libgtest-dev libbenchmark-dev)
test_packages=(hipcc libamdhip64-dev swig golang-go bindgen libdlpack-dev junit5 python3-numpy python3-pytest
  python3-pip python3-setuptools python3-wheel python3-venv)
# The Rust and Java bindings' toolchains (a cargo from rustup in ~/.cargo may come first on PATH; CI gets Debian's),
# clang with its sanitizer runtimes (sanitizer presets), the aarch64 cross compiler and qemu-user (aarch64 preset).
binding_toolchain_packages=(cargo rustc rustfmt openjdk-17-jdk-headless)
check_packages=(clang libclang-rt-dev g++-aarch64-linux-gnu qemu-user)

# The bindings' tests on a CPU-only build (mode `bindings`): SWIG + JUnit + JDK (Java), Go, cargo's bindgen check,
# numpy + pytest, and Debian's pip/setuptools/wheel/venv for the Python wheel test.
binding_packages=(swig openjdk-17-jdk-headless golang-go bindgen libdlpack-dev junit5 python3-numpy python3-pytest
  python3-pip python3-setuptools python3-wheel python3-venv)

log() { printf 'setup-and-run: %s\n' "$*" >&2; }

install_packages() {
  local missing=() package
  for package in "$@"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed' || missing+=("$package")
  done
  if ((${#missing[@]} == 0)); then
    log "Debian packages present: $*"
    return
  fi
  local sudo=()
  if [[ $(id -u) != 0 ]]; then
    command -v sudo >/dev/null || { log "need root or sudo to install: ${missing[*]}"; exit 1; }
    sudo=(sudo)
  fi
  log "installing: ${missing[*]}"
  # Another apt run (a parallel setup) may hold the lock: wait for it rather than fail.
  local apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -y -q)
  "${apt[@]}" update
  "${apt[@]}" install "${missing[@]}"
}

configure_and_build() {
  local preset=$1 target=${2:-}
  cd "$repo"
  log "configuring (cmake --preset $preset)"
  cmake --preset "$preset"
  log "building (cmake --build --preset $preset${target:+ --target $target})"
  cmake --build --preset "$preset" ${target:+--target "$target"}
}

# CPU library + every binding, then the tests a binding user cares about. The `cpu` preset turns the GPU backends
# off, so this never runs nvcc or hipcc even where they are installed.
run_bindings() {
  install_packages "${build_packages[@]}" "${binding_packages[@]}"
  configure_and_build cpu
  log "running the binding and install tests (ctest --preset cpu -L 'bindings|install')"
  cd "$repo"
  exec ctest --preset cpu -L 'bindings|install' "$@"
}

# Steps of `test` after the main ctest run; each fails the command (set -e) on any failure or finding.

# ctest counts a skipped test as not failed. `test` installs every binding's toolchain, so a binding test that skipped
# (exit 77 / "SKIPPED": its toolchain is missing) fails the run instead of leaving CI green.
fail_on_skipped_binding_tests() {
  local build_dir=$1 junit=$2
  /usr/bin/python3 - "$build_dir" "$junit" <<'PY'
import json, subprocess, sys
import xml.etree.ElementTree as ET
build_dir, junit = sys.argv[1], sys.argv[2]
listing = json.loads(subprocess.run(["ctest", "--test-dir", build_dir, "--show-only=json-v1"], check=True,
                                    capture_output=True, text=True).stdout)
binding_tests = set()
for test in listing["tests"]:
    for prop in test.get("properties", []):
        if prop["name"] == "LABELS" and ("bindings" in prop["value"] or "install" in prop["value"]):
            binding_tests.add(test["name"])
skipped = [case.get("name") for case in ET.parse(junit).getroot().iter("testcase")
           if case.get("name") in binding_tests and (case.get("status") == "notrun" or case.find("skipped") is not None)]
if not binding_tests:
    sys.exit("setup-and-run: no binding tests configured (bindings off?)")
if skipped:
    sys.exit("setup-and-run: binding tests skipped (a toolchain is missing): " + ", ".join(sorted(skipped)))
print(f"setup-and-run: all {len(binding_tests)} binding tests ran (none skipped)", file=sys.stderr)
PY
}

# The CPU suite under a sanitizer: clang, CPU backend, no bindings or benchmarks (presets asan-ubsan, tsan). Any
# report aborts its test (-fno-sanitize-recover=all, halt_on_error=1), so ctest fails.
run_sanitizer_suite() {
  local preset=$1
  configure_and_build "$preset"
  log "running the CPU suite under $preset (ctest --preset $preset)"
  ctest --preset "$preset"
}

# The CPU library, CLI and CPU suite cross-built for aarch64 (Debian's g++-aarch64-linux-gnu, portable kernels) and
# run under qemu-aarch64 (preset aarch64; the tests that exec the binaries outside ctest are excluded there).
run_aarch64_suite() {
  configure_and_build aarch64
  log "running the CPU suite for aarch64 under qemu-user (ctest --preset aarch64)"
  ctest --preset aarch64
}

# A short fuzz run (docs/testing.md); skipped with a note where tools/run-fuzz.sh is absent.
run_fuzz_smoke() {
  if [[ -x tools/run-fuzz.sh || -f tools/run-fuzz.sh ]]; then
    log "fuzzing (bash tools/run-fuzz.sh 100)"
    bash tools/run-fuzz.sh 100
  else
    log "tools/run-fuzz.sh not present: no fuzz run"
  fi
}

# Prints how long each step of `test` took (the figures docs/testing.md records).
step_seconds=()
timed() {
  local name=$1 start=$SECONDS
  shift
  "$@"
  step_seconds+=("$name: $((SECONDS - start)) s")
  log "step done: $name in $((SECONDS - start)) s"
}

case "$mode" in
  demo)
    install_packages "${build_packages[@]}"
    configure_and_build cpu sparsa_cli
    log "running: build/cpu/tools/sparsa demo $*"
    exec "$repo/build/cpu/tools/sparsa" demo "$@"
    ;;
  test)
    timed "apt packages" install_packages "${build_packages[@]}" "${test_packages[@]}" \
      "${binding_toolchain_packages[@]}" "${check_packages[@]}"
    timed "build (preset ci)" configure_and_build ci
    log "running every test (ctest --preset ci: output on failure, 2 in parallel)"
    cd "$repo"
    junit=$repo/build/ci/ctest-results.xml
    timed "ctest (preset ci)" ctest --preset ci --output-junit "$junit" "$@"
    fail_on_skipped_binding_tests "$repo/build/ci" "$junit"
    timed "ASan+UBSan build + CPU suite" run_sanitizer_suite asan-ubsan
    timed "TSan build + CPU suite" run_sanitizer_suite tsan
    timed "aarch64 cross build + CPU suite under qemu" run_aarch64_suite
    cd "$repo"
    timed "fuzz" run_fuzz_smoke
    log "every step passed; times:"
    printf '  %s\n' "${step_seconds[@]}" >&2
    ;;
  bindings)
    run_bindings "$@"
    ;;
  *)
    echo "usage: tools/setup-and-run.sh demo [sparsa demo options] | test [ctest options]" \
      "| bindings [ctest options]" >&2
    exit 2
    ;;
esac
