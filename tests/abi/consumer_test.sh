#!/usr/bin/env bash
# Installs the build tree into a fresh prefix, then builds and runs tests/abi/consumer/main.c three ways:
#   1. CMake:       find_package(sparsa) -> sparsa::sparsa (and find_package(sparsa 1.0) must fail: SameMajorVersion);
#   2. pkg-config:  the installed lib/pkgconfig/sparsa.pc (run with LD_LIBRARY_PATH, as a system install would be);
#   3. pkg-config:  the uninstalled <build>/pkgconfig/sparsa.pc the Go binding uses (runs through its rpath alone).
# and checks that an installed bin/sparsa runs through its own rpath.
# Usage: consumer_test.sh <build dir> <consumer source dir> <C compiler> <libdir name> <version> [C flags]
set -euo pipefail
build_dir=$1 consumer_dir=$2 cc=$3 libdir=$4 version=$5 cflags=${6:-}
work=$build_dir/abi-consumer
prefix=$work/prefix
rm -rf "$work" && mkdir -p "$work"

step() { printf '\n== %s\n' "$*"; }
fail() { printf 'consumer_test: FAILED: %s\n' "$*" >&2; exit 1; }

step "cmake --install into $prefix"
cmake --install "$build_dir" --prefix "$prefix" >"$work/install.log" || { cat "$work/install.log"; fail "install"; }
for f in include/sparsa/sparsa.h "$libdir/libsparsa.so" "$libdir/libsparsa.so.${version%%.*}" \
         "$libdir/cmake/sparsa/sparsaConfig.cmake" "$libdir/cmake/sparsa/sparsaConfigVersion.cmake" \
         "$libdir/cmake/sparsa/sparsaTargets.cmake" "$libdir/pkgconfig/sparsa.pc"; do
  [[ -e $prefix/$f ]] || fail "the install has no $f"
done

if [[ -x $prefix/bin/sparsa ]]; then
  step "installed bin/sparsa finds its library through its rpath"
  env -u LD_LIBRARY_PATH "$prefix/bin/sparsa" version || fail "installed bin/sparsa does not run"
fi

step "find_package(sparsa) consumer"
cmake -S "$consumer_dir" -B "$work/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_C_FLAGS="$cflags" -DCMAKE_BUILD_TYPE=Release >"$work/cmake-configure.log" \
  || { cat "$work/cmake-configure.log"; fail "configure of the find_package consumer"; }
cmake --build "$work/cmake-build" || fail "build of the find_package consumer"
"$work/cmake-build/consumer" || fail "the find_package consumer"

step "find_package(sparsa 1.0) must be refused (SameMajorVersion, installed $version)"
if cmake -S "$consumer_dir" -B "$work/cmake-build-v1" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
     -DSPARSA_CONSUMER_WANTS=1.0 >"$work/cmake-v1.log" 2>&1; then
  fail "find_package(sparsa 1.0) accepted version $version"
fi
echo "refused, as it should be"

step "pkg-config consumer (installed .pc)"
export PKG_CONFIG_PATH=$prefix/$libdir/pkgconfig
[[ $(pkg-config --modversion sparsa) == "$version" ]] || fail "pkg-config --modversion sparsa is not $version"
# shellcheck disable=SC2046,SC2086  # word splitting of the flags is intended
"$cc" $cflags "$consumer_dir/main.c" $(pkg-config --cflags --libs sparsa) -lm -o "$work/pc-consumer" \
  || fail "build with pkg-config --cflags --libs sparsa"
LD_LIBRARY_PATH=$prefix/$libdir "$work/pc-consumer" || fail "the pkg-config consumer"

step "pkg-config consumer (uninstalled $build_dir/pkgconfig/sparsa.pc, rpath only)"
export PKG_CONFIG_PATH=$build_dir/pkgconfig
# shellcheck disable=SC2046,SC2086
"$cc" $cflags "$consumer_dir/main.c" $(pkg-config --cflags --libs sparsa) -lm -o "$work/pc-uninstalled-consumer" \
  || fail "build with the uninstalled pkg-config file"
env -u LD_LIBRARY_PATH "$work/pc-uninstalled-consumer" || fail "the uninstalled pkg-config consumer"

echo
echo "consumer_test: all consumers built and ran"
