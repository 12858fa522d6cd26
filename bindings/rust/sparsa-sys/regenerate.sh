#!/bin/sh
# Regenerates src/bindings.rs from include/sparsa/sparsa.h with Debian's bindgen CLI (0.60: needs
# --size_t-is-usize). The output is committed; the ctest rust_sys_bindings_up_to_date runs
# `regenerate.sh <tmpfile>` and diffs it with the committed file, ignoring bindgen's own version line.
#   usage: regenerate.sh [output]   (default: src/bindings.rs beside this script)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../../.." && pwd)
output=${1:-$here/src/bindings.rs}
BINDGEN=${BINDGEN:-bindgen}
# bindgen formats its output with rustfmt (found through RUSTFMT, else PATH); without it the output is one long
# line, so a missing rustfmt must not produce a different file.
if [ -z "${RUSTFMT:-}" ]; then
  RUSTFMT=$(command -v rustfmt || true)
  [ -z "$RUSTFMT" ] && [ -x "${HOME:-/nonexistent}/.cargo/bin/rustfmt" ] && RUSTFMT=$HOME/.cargo/bin/rustfmt
fi
if [ -z "$RUSTFMT" ]; then
  echo "regenerate.sh: rustfmt not found (bindgen formats its output with it; set RUSTFMT)" >&2
  exit 1
fi
export RUSTFMT
{
  echo "// Generated from include/sparsa/sparsa.h by bindings/rust/sparsa-sys/regenerate.sh. Do not edit."
  cd "$root"
  "$BINDGEN" include/sparsa/sparsa.h --size_t-is-usize \
    --allowlist-function 'sparsa_.*' --allowlist-type 'sparsa_.*' --allowlist-var 'SPARSA_.*' \
    --no-prepend-enum-name -- -Iinclude
} > "$output.tmp"
mv "$output.tmp" "$output"
