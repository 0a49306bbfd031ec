#!/usr/bin/env bash
# Runs every GPU program packed under .gpu/bin, on the GPU machine, from the repository root,
# after `source .gpu/env.sh`. Builds nothing. Each run's full log goes to LOG_DIR (default: $OUT
# when set, else ./gpu_logs); a short summary table prints last. Exit status: 0 when every run
# passed.
#
#   source .gpu/env.sh && bash launch/gpu_suite.sh
#
# Environment: GPU_BIN (default .gpu/bin), LOG_DIR, GPU_SUITE_PERF=0 to skip the timings.
set -uo pipefail

bin=${GPU_BIN:-.gpu/bin}
log_dir=${LOG_DIR:-${OUT:-gpu_logs}}
mkdir -p "$log_dir"
[ -d "$bin" ] || { echo "gpu_suite: no $bin (pack the programs with bundle.sh first)" >&2; exit 2; }

names=() statuses=() seconds=() details=()
failed=0

# run NAME COMMAND...: runs one program, logs it, records a summary row.
run() {
  local name=$1
  shift
  local log="$log_dir/$name.log" start end rc detail
  echo "== $name: $*"
  start=$(date +%s)
  "$@" >"$log" 2>&1
  rc=$?
  end=$(date +%s)
  # GoogleTest programs: pass/fail/skip counts from their own summary lines.
  detail=""
  if grep -q '^\[==========\]' "$log"; then
    local p f s
    p=$(grep -m1 '^\[  PASSED  \]' "$log" | grep -oE '[0-9]+' | head -1)
    f=$(grep -m1 '^\[  FAILED  \] [0-9]' "$log" | grep -oE '[0-9]+' | head -1)
    s=$(grep -m1 '^\[  SKIPPED \] [0-9]' "$log" | grep -oE '[0-9]+' | head -1)
    detail="passed ${p:-0}, failed ${f:-0}, skipped ${s:-0}"
  fi
  tail -n 3 "$log"
  names+=("$name")
  statuses+=("$([ $rc -eq 0 ] && echo ok || echo "FAIL($rc)")")
  seconds+=("$((end - start))")
  details+=("$detail")
  [ $rc -eq 0 ] || failed=1
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
  sed 's/^/gpu: /' || true

# ---- 1. tests: every GoogleTest program in the bundle ------------------------------------------
for t in "$bin"/*_tests; do
  [ -x "$t" ] || continue
  run "$(basename "$t")" "$t"
done

# ---- 2. timings (disabled tests that print tables, never assert times) --------------------------
if [ "${GPU_SUITE_PERF:-1}" != 0 ] && [ -x "$bin/gpu_tests" ]; then
  run gpu_perf "$bin/gpu_tests" --gtest_also_run_disabled_tests --gtest_filter='CudaPerf.*'
fi

# ---- 3. benchmarks: add `hotpath bench ...` runs here --------------------------------------------
# if [ -x "$bin/hotpath" ]; then
#   run bench_step "$bin/hotpath" bench step --config examples/configs/<config> ...
# fi

# ---- summary ------------------------------------------------------------------------------------
if [ -f "$log_dir/gpu_perf.log" ]; then
  echo
  grep -E '^(attention|gpt-oss|d[0-9])' "$log_dir/gpu_perf.log" || true
fi
echo
printf '%-22s %-9s %6s  %s\n' "run" "status" "sec" "details"
for i in "${!names[@]}"; do
  printf '%-22s %-9s %6s  %s\n' "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}" "${details[$i]}"
done
exit $failed
