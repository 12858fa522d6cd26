#!/usr/bin/env bash
# Uses sparsa as a user's own project would, from a temporary folder outside the repository, against an install
# prefix made by `cmake --install` (or, for c-build-tree, the build tree itself), and checks the consumer's output.
#   tests/consumers/run.sh KIND SOURCE_DIR BUILD_DIR
# KIND: c-cmake | c-pkgconfig | c-build-tree | python | rust | go | java. Tools come from PATH unless named by
# CMAKE, PYTHON, CARGO, GO, JAVAC, JAVA (ctest passes the ones CMake found). Exit 77 = a needed tool is missing.
set -euo pipefail

kind=$1
source_dir=$(cd "$2" && pwd)
build_dir=$(cd "$3" && pwd)
consumers=$source_dir/tests/consumers
cmake=${CMAKE:-cmake}
skip_code=77

work=$(mktemp -d "${TMPDIR:-/tmp}/sparsa-consumer-$kind.XXXXXX")
trap 'rm -rf "$work"' EXIT
case "$work" in "$source_dir"/* | "$build_dir"/*)
  echo "FAIL: temporary folder $work is inside the repository or the build tree" >&2; exit 1 ;;
esac

say() { printf '[%s] %s\n' "$kind" "$*"; }
fail() { printf 'FAIL [%s]: %s\n' "$kind" "$*" >&2; exit 1; }
need() {
  command -v "$1" >/dev/null 2>&1 || { echo "SKIPPED: $1 not found"; exit $skip_code; }
}
expect_output() {  # expect_output PATTERN OUTPUT
  grep -qE -- "$1" <<<"$2" || fail "expected output matching '$1', got: $2"
  say "ok: $(head -1 <<<"$2")"
}

prefix=$work/prefix
install_prefix() {
  say "cmake --install $build_dir --prefix $prefix"
  "$cmake" --install "$build_dir" --prefix "$prefix" >"$work/install.log" ||
    { cat "$work/install.log"; fail "install"; }
  libdir=$(dirname "$(find "$prefix" -name 'libsparsa.so' | head -1)")
  [[ -f $libdir/libsparsa.so ]] || fail "no libsparsa.so under $prefix"
}

# A copy of a consumer in the temporary folder, so nothing of it is inside the repository.
copy_consumer() { cp -r "$consumers/$1" "$work/$1"; }

case "$kind" in
  c-cmake | c-build-tree)
    copy_consumer c
    if [[ $kind == c-cmake ]]; then
      install_prefix
      where=(-DCMAKE_PREFIX_PATH="$prefix")
    else
      where=(-Dsparsa_DIR="$build_dir")
    fi
    "$cmake" -S "$work/c" -B "$work/c-build" "${where[@]}" >"$work/configure.log" 2>&1 ||
      { cat "$work/configure.log"; fail "configuring the consumer (${where[*]})"; }
    "$cmake" --build "$work/c-build" >"$work/build.log" 2>&1 || { cat "$work/build.log"; fail "building"; }
    expect_output '^sparsa [0-9]+\.[0-9]+\.[0-9]+, policy DENSE' "$(env -u LD_LIBRARY_PATH "$work/c-build/consumer")"
    ;;

  c-pkgconfig)
    need pkg-config
    need cc
    copy_consumer c
    install_prefix
    export PKG_CONFIG_PATH=$libdir/pkgconfig
    read -r -a flags <<<"$(pkg-config --cflags --libs sparsa)"
    pc_libdir=$(pkg-config --variable=libdir sparsa)
    [[ $(realpath "$pc_libdir") == $(realpath "$libdir") ]] || fail "pkg-config libdir $pc_libdir is not $libdir"
    cc -o "$work/with-rpath" "$work/c/main.c" "${flags[@]}" "-Wl,-rpath,$pc_libdir"
    expect_output '^sparsa [0-9.]+, policy DENSE' "$(env -u LD_LIBRARY_PATH "$work/with-rpath")"
    # Without an rpath the loader needs LD_LIBRARY_PATH (what README.md says): both halves checked.
    cc -o "$work/no-rpath" "$work/c/main.c" "${flags[@]}"
    if env -u LD_LIBRARY_PATH "$work/no-rpath" >"$work/no-rpath.log" 2>&1; then
      fail "a binary without rpath found libsparsa on its own: the README's rule is wrong here"
    fi
    grep -q 'libsparsa.so.0' "$work/no-rpath.log" || fail "unexpected failure: $(cat "$work/no-rpath.log")"
    expect_output '^sparsa [0-9.]+, policy DENSE' "$(LD_LIBRARY_PATH=$libdir "$work/no-rpath")"
    ;;

  python)
    python=${PYTHON:-/usr/bin/python3}
    "$python" -c 'import venv, setuptools, wheel, pip' 2>/dev/null ||
      { echo "SKIPPED: $python lacks venv/setuptools/wheel/pip (apt-get install python3-venv python3-setuptools \
python3-wheel python3-pip)"; exit $skip_code; }
    say "pip wheel (offline, Debian's setuptools) with SPARSA_BUILD_DIR=$build_dir"
    SPARSA_BUILD_DIR=$build_dir "$python" -m pip wheel --no-build-isolation --no-deps --no-index -q \
      -w "$work/wheels" "$source_dir/bindings/python" || fail "pip wheel"
    wheel=$(ls "$work"/wheels/sparsa-*.whl)
    "$python" -m zipfile -l "$wheel" | grep 'sparsa/libsparsa.so' >/dev/null || fail "$wheel carries no libsparsa.so"
    # A fresh venv that sees Debian's numpy (the package's one dependency; no index is reachable offline).
    "$python" -m venv --system-site-packages "$work/venv"
    "$work/venv/bin/python" -m pip install --no-index -q "$wheel" || fail "pip install $wheel"
    # The README's example, run from a folder outside the repository with no sparsa variable in the environment.
    "$python" - "$source_dir/bindings/python/README.md" "$work/example.py" <<'EOF'
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()
example = re.search(r"## Example\s*```python\n(.*?)```", text, re.S)
open(sys.argv[2], "w").write(example.group(1))
EOF
    cd "$work"
    out=$(env -i PATH=/usr/bin:/bin HOME="$work" "$work/venv/bin/python" "$work/example.py") || fail "example: $out"
    where=$(env -i PATH=/usr/bin:/bin "$work/venv/bin/python" -c \
      'import sparsa, sparsa._library as L; print(sparsa.__file__, L.lib._name)')
    case "$where" in "$work/venv/"*"/sparsa/__init__.py $work/venv/"*"/sparsa/libsparsa.so"*) ;;
      *) fail "import sparsa did not use the venv's package and library: $where" ;;
    esac
    say "imported from the venv: $where"
    expect_output '^sparsity 0\.[0-9]+, max' "$out"
    expect_output '^refused: ' "$(sed -n 2p <<<"$out")"
    ;;

  rust)
    cargo=${CARGO:-cargo}
    need "$cargo"
    need pkg-config
    install_prefix
    copy_consumer rust
    sed -i "s|SPARSA_CRATE_PATH|$source_dir/bindings/rust/sparsa|" "$work/rust/Cargo.toml"
    export CARGO_TARGET_DIR=$work/target
    build() { (cd "$work/rust" && env -u SPARSA_LIB_DIR "$@" "$cargo" build --offline -q 2>&1); }
    say "cargo build with no library location: must fail with one line naming what was looked for"
    if missing=$(build PKG_CONFIG_PATH="$work/none"); then fail "built without any library location"; fi
    grep -E -c '^ *error: sparsa-sys: cannot find libsparsa: SPARSA_LIB_DIR is not set and .*PKG_CONFIG_PATH' \
      <<<"$missing" | grep -qx 1 || fail "unclear failure: $missing"
    say "cargo build through pkg-config ($libdir/pkgconfig)"
    build PKG_CONFIG_PATH="$libdir/pkgconfig" || fail "cargo build (pkg-config)"
    expect_output 'out \[1\.0, 2\.0, 2\.0, 3\.0\]' "$(LD_LIBRARY_PATH=$libdir "$work/target/debug/sparsa-consumer")"
    say "cargo build through SPARSA_LIB_DIR"
    (cd "$work/rust" && SPARSA_LIB_DIR=$libdir PKG_CONFIG_PATH="$work/none" "$cargo" build --offline -q) ||
      fail "cargo build (SPARSA_LIB_DIR)"
    expect_output 'out \[1\.0, 2\.0, 2\.0, 3\.0\]' "$(LD_LIBRARY_PATH=$libdir "$work/target/debug/sparsa-consumer")"
    ;;

  go)
    go=${GO:-go}
    need "$go"
    need pkg-config
    install_prefix
    copy_consumer go
    sed -i "s|SPARSA_GO_PATH|$source_dir/bindings/go|" "$work/go/go.mod"
    cd "$work/go"
    out=$(env PKG_CONFIG_PATH="$libdir/pkgconfig" LD_LIBRARY_PATH="$libdir" GOFLAGS=-mod=mod GOPROXY=off \
      GOTOOLCHAIN=local CGO_ENABLED=1 GOCACHE="$work/gocache" GOPATH="$work/gopath" "$go" run . 2>&1) ||
      fail "go run: $out"
    expect_output 'out \[1 2 2 3\]' "$out"
    ;;

  java)
    javac=${JAVAC:-javac}
    java=${JAVA:-java}
    need "$javac"
    need readelf
    install_prefix
    jar=$prefix/share/java/sparsa.jar
    [[ -f $jar && -f $prefix/share/java/pom.xml ]] || fail "no sparsa.jar + pom.xml in $prefix/share/java"
    coordinates=$("${PYTHON:-/usr/bin/python3}" -c '
import sys, xml.dom.minidom
pom = xml.dom.minidom.parse(sys.argv[1]).documentElement
print(":".join(pom.getElementsByTagName(t)[0].firstChild.data for t in ("groupId", "artifactId", "version")))
' "$prefix/share/java/pom.xml") || fail "pom.xml is not well-formed XML"
    [[ $coordinates =~ ^org\.sparsa:sparsa:[0-9]+\.[0-9]+\.[0-9]+$ ]] || fail "pom.xml coordinates: $coordinates"
    say "pom.xml: $coordinates"
    jni=$libdir/libsparsa_java.so
    [[ -f $jni ]] || fail "no libsparsa_java.so beside libsparsa.so in $libdir"
    for library in "$jni" "$libdir/libsparsa.so"; do
      runpath=$(readelf -d "$library" | grep -E 'RUNPATH|RPATH' || true)
      if grep -qF "$build_dir" <<<"$runpath"; then fail "$library has a run path into the build tree: $runpath"; fi
      say "$(basename "$library"): ${runpath:-no RUNPATH}"
    done
    copy_consumer java
    "$javac" -d "$work/classes" -cp "$jar" "$work/java/Consumer.java"
    cd "$work"
    say "loaded next to libsparsa (found from the jar's place, no -D option)"
    expect_output 'out \[1\.0, 2\.0, 2\.0, 3\.0\]' \
      "$(env -u LD_LIBRARY_PATH "$java" -cp "$jar:$work/classes" Consumer 2>&1)"
    say "loaded through java.library.path (the jar copied elsewhere)"
    mkdir -p "$work/elsewhere" && cp "$jar" "$work/elsewhere/"
    expect_output 'out \[1\.0, 2\.0, 2\.0, 3\.0\]' \
      "$(env -u LD_LIBRARY_PATH "$java" -Djava.library.path="$libdir" -cp "$work/elsewhere/sparsa.jar:$work/classes" \
        Consumer 2>&1)"
    ;;

  *)
    echo "usage: $0 c-cmake|c-pkgconfig|c-build-tree|python|rust|go|java SOURCE_DIR BUILD_DIR" >&2
    exit 2
    ;;
esac
