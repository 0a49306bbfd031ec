#!/usr/bin/env bash
# The node lane arbiter across processes: the LaneArbiterMulti.* cases of parallel_tests under
# mpirun on 2 and 3 ranks of one host (a simulated shared link: equal demands share it fairly,
# a light rank waits at most one chunk behind a heavy one, reloads go before pending offloads,
# the activation store offloading through it on every rank computes the same bits).
# Every rank must pass every case, none skipped. The LaneArbiterUnit.* cases run once, alone.
#   mpi_lane_arbiter.sh HOTPATH_BINARY [SOURCE_DIR]   (parallel_tests sits next to hotpath)
set -u
if [[ $# -lt 1 ]]; then
  echo "usage: $0 <path-to-hotpath> [source-dir]" >&2
  exit 2
fi
tests="$(cd "$(dirname "$1")" && pwd)/parallel_tests"
if [[ ! -x $tests ]]; then
  echo "mpi_lane_arbiter: $tests not found; build the parallel_tests target" >&2
  exit 1
fi
if ! command -v mpirun >/dev/null; then echo "mpirun not found"; exit 1; fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
work=$(mktemp -d "${TMPDIR:-/tmp}/hp_lane.XXXXXX")
trap 'rm -rf "$work"' EXIT
passes=0
fails=0
pass() { passes=$((passes + 1)); echo "ok: $*"; }
fail() { fails=$((fails + 1)); echo "FAIL: $*"; }

if timeout 120 "$tests" --gtest_color=no --gtest_filter='LaneArbiterUnit.*' \
     >"$work/unit.log" 2>&1; then
  pass "LaneArbiterUnit.* ($(grep -c '^\[       OK' "$work/unit.log") cases)"
else
  fail "LaneArbiterUnit.*: $(grep -E 'FAILED|Failure' "$work/unit.log" | head -5)"
fi

cases=4
for np in 2 3; do
  log="$work/np$np.log"
  if timeout 300 mpirun --oversubscribe --bind-to none -x OMP_NUM_THREADS -np "$np" "$tests" \
       --gtest_color=no --gtest_filter='LaneArbiterMulti.*' >"$log" 2>&1; then
    ok_lines=$(grep -c '^\[       OK \] LaneArbiterMulti' "$log")
    skipped=$(grep -c '^\[  SKIPPED \]' "$log")
    if [[ $ok_lines -eq $((np * cases)) && $skipped -eq 0 ]]; then
      pass "$np ranks: $ok_lines of $((np * cases)) rank-cases passed"
      grep '^\[lane\]' "$log" | sed 's/^/    /'
    else
      fail "$np ranks: $ok_lines rank-cases passed, $skipped skipped (want $((np * cases)), 0)"
    fi
  else
    fail "$np ranks: $(grep -E 'Failure|FAILED|Expected|Which is|waited|error' "$log" | head -12)"
  fi
done

echo "$passes passed, $fails failed"
[[ $fails -eq 0 ]]
