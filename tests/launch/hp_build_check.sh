#!/usr/bin/env bash
# hp_build (launch/setup.sh) builds the targets it is named, or every target when none is; the
# quick start builds the hotpath program only. cmake is replaced by a function that records
# its arguments.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
source "$root/launch/setup.sh"
calls=()
cmake() { calls+=("cmake $*"); }
nproc() { echo 4; }
fail() {
  echo "[hp_build_check] FAILED: $*"
  exit 1
}
hp_build cpu hotpath 2>/dev/null
[ "${calls[1]}" = "cmake --build --preset cpu -j 4 --target hotpath" ] ||
  fail "hp_build cpu hotpath ran '${calls[1]}'"
calls=()
hp_build cpu 2>/dev/null
[ "${calls[1]}" = "cmake --build --preset cpu -j 4" ] || fail "hp_build cpu ran '${calls[1]}'"
grep -qx 'hp_build cpu hotpath' "$root/launch/quickstart.sh" ||
  fail "launch/quickstart.sh does not build just the hotpath target"
grep -qx 'hp_build cpu' "$root/tests/run.sh" || fail "tests/run.sh does not build every target"
echo "[hp_build_check] hp_build builds the named targets, or all"
