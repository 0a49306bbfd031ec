#!/usr/bin/env bash
# Builds hotpath and runs the whole test suite through ctest. When nvcc is present the CUDA
# preset is built as well, so CUDA compile errors fail here, and its `gpu` tests run (they skip,
# each saying so, on machines without a GPU). Then the CPU suite: every label -- unit, mpi (the
# multi-rank cases under mpirun), cli (the hotpath executable end to end), hf (Hugging Face
# import and export), tools (the Python data tools), sweep (the scaling sweep runner), slurm (real jobs on a single-node Slurm cluster this script starts as root,
# tests/slurm/cluster.sh, and stops by pid when done; without one those tests skip, saying why).
# Before it, the sanitizer stage (asan preset, clang): the unit suite under AddressSanitizer +
# UndefinedBehaviorSanitizer, then every libFuzzer harness of tests/fuzz for HOTPATH_FUZZ_SECONDS
# (60) each; HP_SANITIZERS=0 skips it. The CPU suite runs last and its summary line ends the
# output.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/../launch/setup.sh"
source "$(dirname "${BASH_SOURCE[0]}")/slurm/cluster.sh"
sanitizers=${HP_SANITIZERS:-1}
if [ "$sanitizers" != 0 ]; then hp_install_deps "${HP_SANITIZER_PACKAGES[@]}"; else hp_install_deps; fi
hp_build cpu
cd "$HP_ROOT"
# Tests run two at a time on small machines: idle OpenMP threads sleep instead of spinning.
export OMP_WAIT_POLICY=passive

# summary LOG: "<ctest's closing line> (label counts, skips)" of a ctest run's output.
summary() {
  local result labels skipped
  result=$(grep -E 'tests passed|tests failed' "$1" | tail -1 || true)
  labels=$(sed -n '/^Label Time Summary:/,/^$/p' "$1" |
    sed -nE 's/^ *([A-Za-z0-9_]+) *=.*\(([0-9]+) tests?\).*/\1 \2/p' | paste -sd, - | sed 's/,/, /g' || true)
  skipped=$(grep -c '(Skipped)' "$1" || true)
  echo "${result:-no ctest result} (${labels:-no labels}; ${skipped} skipped)"
}

log=$(mktemp)
slurm_dir=$(mktemp -d /tmp/hp-slurm.XXXXXX)
slurm_started=0
cleanup() {
  rm -f "$log"
  [ "$slurm_started" = 1 ] && hp_slurm_stop "$slurm_dir"
  rm -rf "$slurm_dir"
  return 0
}
trap cleanup EXIT

gpu_summary="CUDA backend not built (nvcc not found)"
nvcc=$(hp_nvcc)
if [ -n "$nvcc" ]; then
  export PATH="$(dirname "$nvcc"):$PATH"
  hp_build cuda
  if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "[tests] no GPU visible: the CUDA build compiled; its gpu tests start and skip here"
  fi
  ctest --test-dir build/cuda -L gpu --output-on-failure --timeout 900 2>&1 | tee "$log"
  if nvidia-smi -L >/dev/null 2>&1; then
    gpu_summary="gpu tests on $(nvidia-smi -L | head -1): $(summary "$log")"
  else
    gpu_summary="gpu tests (no GPU visible, so skipped): $(summary "$log")"
  fi
fi

echo "[tests] $gpu_summary"
rc=0

san_summary="sanitizer stage skipped (HP_SANITIZERS=0)"
if [ "$sanitizers" != 0 ]; then
  san_start=$(date +%s)
  hp_build asan
  echo "[tests] unit suite under ASan + UBSan (preset asan):"
  ctest --preset asan -j "$(nproc)" --timeout 900 2>&1 | tee "$log" || rc=$?
  san_unit=$(summary "$log")
  echo "[tests] fuzzers (preset asan-fuzz, ${HOTPATH_FUZZ_SECONDS:-60} s each):"
  ctest --preset asan-fuzz -j "$(nproc)" 2>&1 | tee "$log" || rc=$?
  san_summary="ASan + UBSan unit suite: $san_unit; fuzzers: $(summary "$log"); $(($(date +%s) - san_start)) s"
fi
echo "[tests] $san_summary"

# The slurm tests' cluster: up in seconds where it can be (every wait in it is bounded).
slurm_summary="no Slurm cluster: the slurm tests skip"
if hp_slurm_start "$slurm_dir"; then
  slurm_started=1
  slurm_summary="Slurm cluster up ($SLURM_CONF)"
else
  unset SLURM_CONF
fi
echo "[tests] $slurm_summary"
echo "[tests] CPU suite (labels unit, mpi, cli, hf, tools, sweep, slurm):"
ctest --preset cpu -j "$(nproc)" --timeout 900 2>&1 | tee "$log" || rc=$?
# Summaries last, so the end of the log says what ran.
echo "[tests] $gpu_summary"
echo "[tests] $san_summary"
echo "[tests] $slurm_summary"
echo "[tests] CPU suite: $(summary "$log")"
exit $rc
