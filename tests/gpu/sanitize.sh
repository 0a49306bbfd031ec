#!/usr/bin/env bash
# compute-sanitizer's cases of CTest (tests/gpu/gpu_cases.cmake), one tool each:
#
#   sanitize.sh TOOL canary GPU_TESTS              the tool must report the defect of its canary
#   sanitize.sh TOOL tests GPU_TESTS INDEX SHARDS  shard INDEX of SHARDS of the GPU tests: no report
#   sanitize.sh TOOL train HOTPATH CONFIG          two training steps of CONFIG on the GPU: no report
#
# TOOL: memcheck (--leak-check full), racecheck, initcheck or synccheck. The tool's exit status
# when it reports anything is 86 (--error-exitcode), told apart from a failing program (1) or a
# tool that cannot start. The canary (tests/gpu/sanitizer_canary.cu) is a kernel with one defect
# of the tool's kind: a tool that does not see hotpath's kernels would otherwise pass everything.
# synccheck leaves out NVIDIA's warp-specialized Hopper library kernels (cuDNN's generated
# attention, cuBLAS's nvjet), whose named barriers it reports as divergent. racecheck cannot leave
# kernels out (with a kernel filter it stops inside cuBLASLt's kernels) and reports hazards inside
# those library kernels: its tests and train cases pass when the program ran to its end and no
# report points into hotpath's own kernels (a frame in namespace hp), and print both counts. The
# tests leave out
# CudaBackend.ErrorsNameTheStatement, which fails a cudaSetDevice on purpose (an API error to the
# tools), and CudaBackend.ProfileNames*, which profiles through CUPTI, unavailable under a tool.
# The OpenMP settings give each process a fixed thread count and idle threads that sleep, so
# shards running at once share the host's cores. Environment: COMPUTE_SANITIZER (default: on
# PATH, else the CUDA toolkit's), SANITIZE_FILTER (a gtest filter replacing the one above).
set -uo pipefail
tool=${1:?usage: sanitize.sh TOOL canary|tests|train ...}
mode=${2:?usage: sanitize.sh TOOL canary|tests|train ...}
shift 2
cs=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [ -n "$cs" ] || { [ -x "$c" ] && cs=$c; }
done
[ -n "$cs" ] || { echo "sanitize.sh: no compute-sanitizer on PATH or in /usr/local/cuda (set COMPUTE_SANITIZER)" >&2; exit 1; }
case $tool in
  memcheck) extra=(--leak-check full) ;;
  racecheck) extra=() ;;
  initcheck) extra=(--nvtx yes) ;;
  synccheck) extra=(--kernel-name-exclude kns=cudnn_generated --kernel-name-exclude kns=nvjet) ;;
  *) echo "sanitize.sh: unknown tool '$tool' (valid: memcheck, racecheck, initcheck, synccheck)" >&2; exit 2 ;;
esac
reported=86
san=("$cs" --tool "$tool" "${extra[@]}" --error-exitcode "$reported" --print-limit 50)
export OMP_WAIT_POLICY=passive
# run_tool COMMAND...: COMMAND under the tool. racecheck: exit 0 when the program ended normally
# and no report points into hotpath's kernels; the other tools: the tool's own status.
run_tool() {
  if [ "$tool" != racecheck ]; then
    "${san[@]}" "$@"
    return
  fi
  local log rc own lib
  log=$(mktemp)
  "${san[@]}" "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  reports='^========= (Race reported|Error|Warning)'
  own=$(grep -A4 -E "$reports" "$log" | grep -cE ' at (void )?hp::' || true)
  lib=$(grep -A4 -E "$reports" "$log" | grep -cE ' at (void )?(nvjet|cudnn|cutlass|sm90_|cublas)' || true)
  rm -f "$log"
  echo "sanitize.sh: racecheck reports in hotpath's kernels: $own, in library kernels: $lib"
  [ "$rc" -eq 0 ] || [ "$rc" -eq "$reported" ] || return "$rc"
  [ "$own" -eq 0 ]
}
case $mode in
  canary)
    "${san[@]}" "$1" --gtest_also_run_disabled_tests --gtest_filter="Tool/SanitizerCanary.DISABLED_Defect/$tool"
    rc=$?
    if [ $rc -eq $reported ]; then
      echo "sanitize.sh: $tool reported the defect of its canary"
      exit 0
    fi
    echo "sanitize.sh: $tool did not report its canary's defect (exit status $rc, expected $reported)" >&2
    exit 1 ;;
  tests)
    filter=${SANITIZE_FILTER:-'CudaConsistency.*:*CudaAttention.*:CudaBackend.*:CudaAllocator.*:CudaModel.*-CudaBackend.ErrorsNameTheStatement:CudaBackend.ProfileNames*'}
    GTEST_TOTAL_SHARDS=$3 GTEST_SHARD_INDEX=$2 OMP_NUM_THREADS=2 run_tool "$1" --gtest_filter="$filter" ;;
  train)
    OMP_NUM_THREADS=4 run_tool "$1" train --config "$2" --device=cuda --steps=2 --log_every=1 ;;
  *) echo "sanitize.sh: unknown mode '$mode' (valid: canary, tests, train)" >&2; exit 2 ;;
esac
rc=$?
[ $rc -eq $reported ] && echo "sanitize.sh: $tool reported errors (above)" >&2
exit $rc
