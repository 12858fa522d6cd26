#!/usr/bin/env bash
# The two commands of README.md, each self-contained on a fresh Debian 12 machine:
#   tools/setup-and-run.sh demo [demo options]   installs what the build needs, builds the CPU library and the
#                                                `sparsa` tool (preset "cpu"), runs `sparsa demo`
#   tools/setup-and-run.sh test                  installs what the build and every test need, configures and builds
#                                                everything (preset "ci"), runs every ctest; exits non-zero on failure
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
test_packages=(hipcc libamdhip64-dev swig golang-go bindgen libdlpack-dev junit5 python3-numpy python3-pytest)

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

case "$mode" in
  demo)
    install_packages "${build_packages[@]}"
    configure_and_build cpu sparsa_cli
    log "running: build/cpu/tools/sparsa demo $*"
    exec "$repo/build/cpu/tools/sparsa" demo "$@"
    ;;
  test)
    install_packages "${build_packages[@]}" "${test_packages[@]}"
    configure_and_build ci
    log "running every test (ctest --preset ci: output on failure, 2 in parallel)"
    cd "$repo"
    exec ctest --preset ci "$@"
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
