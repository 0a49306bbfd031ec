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

missing=$(for p in "$bin"/*; do ldd "$p" | grep "not found"; done | sort -u)
[ -z "$missing" ] || echo "gpu_suite: libraries not found on this host: $missing" >&2

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
  sed 's/^/gpu: /' || true

# ---- 1. tests: every GoogleTest program in the bundle ------------------------------------------
for t in "$bin"/*_tests; do
  [ -x "$t" ] || continue
  run "$(basename "$t")" "$t"
done

# Multi-rank NCCL tests: one rank per GPU (they skip in the single-process run above).
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -ge 2 ] && [ -x "$bin/gpu_tests" ] && command -v mpirun >/dev/null; then
  run gpu_tests_nccl_np2 mpirun -np 2 "$bin/gpu_tests" --gtest_filter='Nccl*'
fi

# ---- 2. timings (disabled tests that print tables, never assert times) --------------------------
if [ "${GPU_SUITE_PERF:-1}" != 0 ] && [ -x "$bin/gpu_tests" ]; then
  run gpu_perf "$bin/gpu_tests" --gtest_also_run_disabled_tests --gtest_filter='CudaPerf.*'
fi

# ---- 3. training runs and benchmarks with the hotpath executable ------------------------------
# bench_row NAME: the "step" row of a bench log as the summary detail.
bench_detail() {
  awk '/^step /{printf "ms/step=%s tok/s=%s syncs=%s MFU=%s", $2, $3, $4, $5}' "$log_dir/$1.log"
}
if [ -x "$bin/hotpath" ]; then
  cfg=examples/configs
  run train_tiny_moe "$bin/hotpath" train --config $cfg/tiny-moe.ini --device=cuda --steps=120 \
    --log_every=20 --metrics_path="$log_dir/train_tiny_moe.jsonl"
  details[${#details[@]}-1]=$(grep -o 'done:.*' "$log_dir/train_tiny_moe.log" | cut -c1-90)
  run train_baselines "$bin/hotpath" train --config $cfg/tiny-moe.ini --device=cuda --steps=3 \
    --metadata=per-layer --routing=per-expert --metrics_path="$log_dir/train_baselines.jsonl"
  details[${#details[@]}-1]="syncs/step $(tail -1 "$log_dir/train_baselines.jsonl" | grep -o '"syncs":{[^}]*}')"
  for spec in "llama1b:llama-3.2-1b.ini:16" "gptoss20b_4l:gptoss-20b.ini:4"; do
    IFS=: read -r name ini layers <<<"$spec"
    for md in cached per-layer; do
      run "bench_${name}_$md" "$bin/hotpath" bench step --config $cfg/$ini --device=cuda \
        --n_layers=$layers --seq_len=4096 --batch_tokens=16384 --metadata=$md --bench_warmup=2 \
        --bench_steps=5
      details[${#details[@]}-1]=$(bench_detail "bench_${name}_$md")
    done
  done
fi

# MoE routing (one GPU) and the token all-to-all over NCCL (two GPUs): bench_comm.h.
if [ -x "$bin/hotpath" ] && [ "${GPU_SUITE_PERF:-1}" != 0 ]; then
  run bench_routing "$bin/hotpath" bench routing --config examples/configs/tiny-moe.ini \
    --device=cuda --bench_json="$log_dir/bench_routing.json"
  details[${#details[@]}-1]=$(awk '$1 ~ /^[0-9]+$/ && NF == 5 {
      printf "E=%s %s %sms %s; ", $1, $2, $3, $4}' "$log_dir/bench_routing.log")
  if [ "${gpus:-0}" -ge 2 ] && command -v mpirun >/dev/null; then
    run bench_alltoall_np2 mpirun -np 2 "$bin/hotpath" bench alltoall \
      --config examples/configs/tiny-moe.ini --device=cuda \
      --bench_json="$log_dir/bench_alltoall.json"
    details[${#details[@]}-1]=$(awk '$1 == "moe_exchange" && $2 == 16384 {e = $6; r = $7}
      $1 == "all_to_all_v" && $2 == 16384 {p = $6} $1 == "even" && $3 > 500 {v = $6}
      END {printf "16k tok: exchange %s GB/s vs plain %s (%s); even 512MiB %s GB/s", e, p, r, v}' \
      "$log_dir/bench_alltoall_np2.log")
  fi
fi

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
