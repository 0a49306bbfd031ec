#!/usr/bin/env bash
# Runs every GPU program packed under .gpu/bin (launch/gpu_bundle.sh), on a GPU host, from the
# repository root, after `source .gpu/env.sh`. Builds nothing. Each run's full log goes to
# LOG_DIR (default ./gpu_logs); a short summary table prints last. Exit status: 0 when every run
# passed.
#
#   source .gpu/env.sh && bash launch/gpu_suite.sh
#
# Environment: GPU_BIN (default .gpu/bin), LOG_DIR, GPU_SUITE_PERF=0 to skip the timings,
# GPU_SUITE_NCU=1 to add an Nsight Compute speed-of-light pass, GPU_SUITE_ONLY=a,b,... to run
# only some sections: tests, train, step, metadata, attention, moe, profile, offload, ckpt,
# breakdown (all by default; the whole suite takes about ten minutes on 2x H200).
set -uo pipefail

# want SECTION: true when SECTION is selected.
want() { [ -z "${GPU_SUITE_ONLY:-}" ] || [[ ",$GPU_SUITE_ONLY," == *",$1,"* ]]; }

bin=${GPU_BIN:-.gpu/bin}
log_dir=${LOG_DIR:-gpu_logs}
mkdir -p "$log_dir"
[ -d "$bin" ] || { echo "gpu_suite: no $bin (pack the programs with launch/gpu_bundle.sh first)" >&2; exit 2; }

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
if want tests; then
  for t in "$bin"/*_tests; do
    [ -x "$t" ] || continue
    run "$(basename "$t")" "$t"
  done
fi

# Multi-rank NCCL tests: one rank per GPU (they skip in the single-process run above).
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if want tests && [ "${gpus:-0}" -ge 2 ] && [ -x "$bin/gpu_tests" ] && command -v mpirun >/dev/null; then
  run gpu_tests_nccl_np2 mpirun -np 2 "$bin/gpu_tests" --gtest_filter='Nccl*'
fi

# ---- 2. timings (disabled tests that print tables, never assert times) --------------------------
if { want attention || want tests; } && [ "${GPU_SUITE_PERF:-1}" != 0 ] && [ -x "$bin/gpu_tests" ]; then
  run gpu_perf "$bin/gpu_tests" --gtest_also_run_disabled_tests --gtest_filter='CudaPerf.*'
fi

# ---- 3. training runs and benchmarks with the hotpath executable ------------------------------
# bench_row NAME: the "step" row of a bench log as the summary detail.
bench_detail() {
  awk '/^step /{printf "ms/step=%s tok/s=%s syncs=%s MFU=%s", $2, $3, $4, $5}' "$log_dir/$1.log"
}
cfg=examples/configs
if want train && [ -x "$bin/hotpath" ]; then
  run train_tiny_moe "$bin/hotpath" train --config $cfg/tiny-moe.ini --device=cuda --steps=120 \
    --log_every=20 --metrics_path="$log_dir/train_tiny_moe.jsonl"
  details[${#details[@]}-1]=$(grep -o 'done:.*' "$log_dir/train_tiny_moe.log" | cut -c1-90)
  run train_baselines "$bin/hotpath" train --config $cfg/tiny-moe.ini --device=cuda --steps=3 \
    --metadata=per-layer --routing=per-expert --metrics_path="$log_dir/train_baselines.jsonl"
  details[${#details[@]}-1]="syncs/step $(tail -1 "$log_dir/train_baselines.jsonl" | grep -o '"syncs":{[^}]*}')"
fi
if want step && [ -x "$bin/hotpath" ]; then
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
# Packed metadata: cached vs the per-layer rebuild, on the 16- and 28-layer dense shapes.
if want metadata && [ -x "$bin/hotpath" ]; then
  for spec in "llama1b:llama-3.2-1b.ini" "qwen06b:qwen3-0.6b.ini"; do
    IFS=: read -r name ini <<<"$spec"
    run "bench_metadata_$name" "$bin/hotpath" bench metadata --config $cfg/$ini --device=cuda \
      --seq_len=4096 --batch_tokens=16384 --bench_warmup=2 --bench_steps=7
    details[${#details[@]}-1]=$(awk '$1 == "cached" {c = $4} $1 == "per-layer" {p = $4; s = $5}
      /^per-layer rebuild/ {m = $3} END {printf "fwd+bwd cached %s ms, per-layer %s ms (%s syncs), %s", c, p, s, m}' \
      "$log_dir/bench_metadata_$name.log")
  done
fi
# A Llama-3.2-1B-shaped model trains on the GPU (synthetic data over 1024 token ids).
if want train && [ -x "$bin/hotpath" ]; then
  run train_llama1b "$bin/hotpath" train --config $cfg/llama-3.2-1b.ini --device=cuda --steps=30 \
    --seq_len=4096 --batch_tokens=16384 --synthetic_vocab=1024 --synthetic_mean_doc_len=512 \
    --lr=1e-3 --min_lr=1e-4 --warmup_steps=5 --log_every=5
  details[${#details[@]}-1]=$(grep -oE 'step=(1|30) loss=[0-9.]+' "$log_dir/train_llama1b.log" | tr '\n' ' ')
fi

# Attention against PyTorch's varlen attention (FlashAttention-2) where PyTorch is installed.
if want attention && [ -f "$log_dir/gpu_perf.log" ] && command -v python3 >/dev/null; then
  run attention_vs_torch python3 examples/benchmarks/attention_vs_torch.py "$log_dir/gpu_perf.log"
  details[${#details[@]}-1]=$(awk '$1 != "shape" && $NF ~ /^[0-9.]+$/ {printf "%s ", $NF}' \
    "$log_dir/attention_vs_torch.log" | sed 's/^/ratios hotpath\/torch: /')
fi

# MoE routing (one GPU) and the token all-to-all over NCCL (two GPUs): bench_comm.h.
if want moe && [ -x "$bin/hotpath" ] && [ "${GPU_SUITE_PERF:-1}" != 0 ]; then
  run bench_routing "$bin/hotpath" bench routing --config examples/configs/tiny-moe.ini \
    --device=cuda --bench_json="$log_dir/bench_routing.json"
  details[${#details[@]}-1]=$(awk '$1 ~ /^[0-9]+$/ && NF == 6 {
      printf "E=%s %s layer %sms routing %sms; ", $1, $2, $3, $5}' "$log_dir/bench_routing.log")
  if [ "${gpus:-0}" -ge 2 ] && command -v mpirun >/dev/null; then
    run bench_alltoall_np2 mpirun -np 2 "$bin/hotpath" bench alltoall \
      --config examples/configs/tiny-moe.ini --device=cuda \
      --bench_json="$log_dir/bench_alltoall.json"
    details[${#details[@]}-1]=$(awk '$1 == "moe_exchange" && $2 == 16384 {e = $6; r = $7; n = $NF}
      $1 == "all_to_all_v" && $2 == 16384 {p = $6} $1 == "even" && $3 > 500 {v = $6; vn = $NF}
      END {printf "16k tok: exchange %s GB/s vs plain %s (%s), vs NCCL %s; even 512MiB %s GB/s (vs NCCL %s)", e, p, r, n, v, vn}' \
      "$log_dir/bench_alltoall_np2.log")
    # Gradient all-reduces on the comm stream (overlapping backward) vs on the compute stream
    # (NCCL_LAUNCH_ORDER_IMPLICIT=0 keeps them there): 2 ranks, dp=2, the Llama-3.2-1B shape.
    for order in 1 0; do
      run "grad_overlap_np2_order$order" mpirun -np 2 -x NCCL_LAUNCH_ORDER_IMPLICIT=$order \
        "$bin/hotpath" train --config $cfg/llama-3.2-1b.ini --device=cuda --steps=12 \
        --seq_len=4096 --batch_tokens=32768 --synthetic_vocab=1024 --log_every=4 \
        --metrics_path="$log_dir/grad_overlap_np2_order$order.jsonl"
      details[${#details[@]}-1]=$(grep -oE '"step":([5-9]|1[0-2]),.*' "$log_dir/grad_overlap_np2_order$order.jsonl" |
        grep -oE '"ms":[0-9.]+' | cut -d: -f2 | sort -n | awk '{a[NR] = $1} END {
          printf "median ms/step (steps 5-12) %s; %s", a[int((NR + 1) / 2)], (o ? "comm stream" : "compute stream")}' o=$order)
    done
  fi
fi

# Where a step's GPU time goes (when Nsight Systems is installed): kernel time by kernel.
if want profile && [ -x "$bin/hotpath" ] && command -v nsys >/dev/null && [ "${GPU_SUITE_PERF:-1}" != 0 ]; then
  run profile_llama1b nsys profile -t cuda,nvtx -o "$log_dir/llama1b" --force-overwrite true \
    "$bin/hotpath" bench step --config examples/configs/llama-3.2-1b.ini --device=cuda \
    --seq_len=4096 --batch_tokens=16384 --bench_warmup=1 --bench_steps=3
  nsys stats -r cuda_gpu_kern_sum -f csv -o "$log_dir/llama1b" "$log_dir/llama1b.nsys-rep" \
    >/dev/null 2>&1 || true
  rm -f "$log_dir/llama1b.nsys-rep" "$log_dir/llama1b.sqlite"
fi

# Activation offload: step time none / single / double (lookahead 1, 2) at a dense 8B-like layer
# shape (d 4096, ffn 14336, 32 heads, 8 kv heads; 28 layers, the most that fit in one H200 next
# to fp32 master weights, gradients and moments) and at the GPT-OSS-20b shape.
if want offload && [ -x "$bin/hotpath" ] && [ "${GPU_SUITE_PERF:-1}" != 0 ]; then
  run bench_offload_8b timeout 240 "$bin/hotpath" bench offload \
    --config examples/configs/llama-3.2-1b.ini --device=cuda --d_model=4096 --n_heads=32 \
    --n_kv_heads=8 --head_dim=128 --ffn_dim=14336 --n_layers=28 --tie_embeddings=false \
    --seq_len=4096 --batch_tokens=16384 --bench_warmup=1 --bench_steps=3
  details[${#details[@]}-1]=$(awk '$1 ~ /^(none|single|double)/ {printf "%s %s %s ", $1, $2, $3}
    /faster step/ {print "| " $0}' "$log_dir/bench_offload_8b.log")
  run bench_offload_gptoss20b timeout 240 "$bin/hotpath" bench offload \
    --config examples/configs/gptoss-20b.ini --device=cuda --n_layers=4 --seq_len=4096 \
    --batch_tokens=16384 --bench_warmup=1 --bench_steps=3
  details[${#details[@]}-1]=$(awk '$1 ~ /^(none|single|double)/ {printf "%s %s %s ", $1, $2, $3}
    /faster step/ {print "| " $0}' "$log_dir/bench_offload_gptoss20b.log")
  # Two ranks offloading at once over their host links: lane arbiter off vs on.
  if [ "${gpus:-0}" -ge 2 ] && command -v mpirun >/dev/null; then
    run bench_offload_lane_np2 timeout 240 mpirun -np 2 "$bin/hotpath" bench offload \
      --config $cfg/llama-3.2-1b.ini --device=cuda --d_model=4096 --n_heads=32 --n_kv_heads=8 \
      --head_dim=128 --ffn_dim=14336 --n_layers=8 --tie_embeddings=false --seq_len=4096 \
      --batch_tokens=32768 --bench_warmup=1 --bench_steps=3 --lane_chunk_mib=8 --lane_inflight=1 \
      --pcie_groups="0,1" \
      --bench_json="$log_dir/bench_offload_lane_np2.json"
    details[${#details[@]}-1]=$(awk '$1 ~ /^(off|on)$/ && NF == 4 {printf "%s: %s %s %s; ", $1, $2, $3, $4}' \
      "$log_dir/bench_offload_lane_np2.log")
    # Training through the arbiter with links found from the GPUs' PCIe root ports.
    run train_lane_auto_np2 mpirun -np 2 "$bin/hotpath" train --config $cfg/tiny-moe.ini \
      --device=cuda --ep_size=2 --steps=4 --offload=double --lane_arbiter=on --pcie_groups=auto \
      --metrics_path="$log_dir/train_lane_auto_np2.jsonl"
    details[${#details[@]}-1]="$(grep -o 'link ranks=[0-9,]*' "$log_dir/train_lane_auto_np2.log" | head -1); $(tail -1 "$log_dir/train_lane_auto_np2.jsonl" | grep -oE '"jain":[0-9.]+|"offload":[0-9]+' | tr '\n' ' ')"
  fi
fi

# Checkpoints with the CUDA backend: a save/resume round trip (2 ranks, ep=2, when 2 GPUs are
# visible) continues with the same losses as an uninterrupted run; save and load time of the
# GPT-OSS-20b shape with 4 layers (about 53 GB of fp32 params and moments).
if want ckpt && [ -x "$bin/hotpath" ]; then
  ck=$(mktemp -d)
  launcher=()
  ep=1
  if [ "${gpus:-0}" -ge 2 ] && command -v mpirun >/dev/null; then launcher=(mpirun -np 2); ep=2; fi
  tiny=(train --config examples/configs/tiny-moe.ini --device=cuda --steps=6 --ep_size=$ep)
  run ckpt_straight "${launcher[@]}" "$bin/hotpath" "${tiny[@]}" --metrics_path="$ck/a.jsonl"
  run ckpt_first_half "${launcher[@]}" "$bin/hotpath" "${tiny[@]}" --stop_at_step=3 \
    --checkpoint_dir="$ck/run" --metrics_path="$ck/b1.jsonl"
  run ckpt_resumed "${launcher[@]}" "$bin/hotpath" "${tiny[@]}" --resume=auto \
    --checkpoint_dir="$ck/run" --metrics_path="$ck/b2.jsonl"
  straight=$(grep -oE '"step":[4-6],"loss":[^,]*' "$ck/a.jsonl" 2>/dev/null | tr '\n' ' ')
  resumed=$(grep -oE '"step":[4-6],"loss":[^,]*' "$ck/b2.jsonl" 2>/dev/null | tr '\n' ' ')
  if [ -n "$straight" ] && [ "$straight" = "$resumed" ]; then
    details[${#details[@]}-1]="ranks=$((ep)) steps 4-6 identical to the straight run"
  else
    details[${#details[@]}-1]="MISMATCH straight: $straight resumed: $resumed"
    statuses[${#statuses[@]}-1]="FAIL(diff)"
    failed=1
  fi
  # GPT-OSS-20b, 4 layers: about 53 GB. Written where there is room for it: the file system
  # behind mktemp, or /dev/shm when that is larger (it measures the software, not the disk). The
  # disk's own sequential write rate, with fdatasync, is measured next to it as the baseline.
  big_dir=$ck/big
  shm_free=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1)
  tmp_free=$(df -k --output=avail "$ck" | tail -1)
  if [ "${shm_free:-0}" -gt 70000000 ] && [ "${shm_free:-0}" -gt "${tmp_free:-0}" ]; then
    big_dir=$(mktemp -d -p /dev/shm)
  fi
  run disk_write_baseline dd if=/dev/zero of="$ck/dd.bin" bs=64M count=64 conv=fdatasync
  details[${#details[@]}-1]="$(df -h --output=source,fstype "$ck" | tail -1 | tr -s ' '): $(grep -oE '[0-9.]+ [GM]B/s' "$log_dir/disk_write_baseline.log")"
  rm -f "$ck/dd.bin"
  big=(train --config examples/configs/gptoss-20b.ini --device=cuda --n_layers=4 --seq_len=4096
       --batch_tokens=16384 --steps=2 --checkpoint_dir="$big_dir")
  run ckpt_gptoss20b_save timeout 240 "$bin/hotpath" "${big[@]}" --stop_at_step=1
  details[${#details[@]}-1]="to $big_dir: $(grep -oE 'saved .* MiB/s' "$log_dir/ckpt_gptoss20b_save.log" | sed 's/^saved [^ ]* //')"
  # Resumes at step 1 and stops there: a load and no further save.
  run ckpt_gptoss20b_load timeout 240 "$bin/hotpath" "${big[@]}" --resume=auto --stop_at_step=1
  details[${#details[@]}-1]=$(grep -oE 'this rank read .* MiB/s' "$log_dir/ckpt_gptoss20b_load.log")
  rm -rf "$big_dir"
  rm -rf "$ck"
fi

# Where the Llama-shaped step goes, by timing variants: 1 layer vs 16 layers separates the
# per-layer cost from the fixed cost (embedding, 128K-vocabulary unembedding and loss, optimizer);
# and, where Nsight Compute is installed, speed-of-light figures for a window of kernels.
if want breakdown && [ -x "$bin/hotpath" ] && [ "${GPU_SUITE_PERF:-1}" != 0 ]; then
  run bench_llama1b_1layer "$bin/hotpath" bench step --config examples/configs/llama-3.2-1b.ini \
    --device=cuda --n_layers=1 --seq_len=4096 --batch_tokens=16384 --bench_warmup=2 --bench_steps=5
  details[${#details[@]}-1]=$(bench_detail bench_llama1b_1layer)
  if [ "${GPU_SUITE_NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
    run ncu_llama1b timeout 120 ncu --section SpeedOfLight --csv --launch-skip 400 \
      --launch-count 60 "$bin/hotpath" bench step --config examples/configs/llama-3.2-1b.ini \
      --device=cuda --n_layers=2 --seq_len=4096 --batch_tokens=16384 --bench_warmup=1 --bench_steps=1
  fi
fi

# ---- summary ------------------------------------------------------------------------------------
if [ -f "$log_dir/gpu_perf.log" ]; then
  echo
  grep -E '^(attention|gpt-oss|d[0-9])' "$log_dir/gpu_perf.log" || true
fi
[ -f "$log_dir/attention_vs_torch.log" ] && { echo; cat "$log_dir/attention_vs_torch.log"; }
for f in "$log_dir"/llama1b*kern_sum*.csv; do
  [ -f "$f" ] || continue
  echo
  echo "GPU kernel time, llama-3.2-1b step (top 12: % time, total ms, calls, kernel)"
  awk -F'","' 'NR > 1 {gsub(/"/, "", $1); gsub(/"/, "", $NF);
      printf "%6s%% %10.1f %7s  %.70s\n", $1, $2 / 1e6, $3, $NF}' "$f" | head -12
done
echo
printf '%-22s %-9s %6s  %s\n' "run" "status" "sec" "details"
for i in "${!names[@]}"; do
  printf '%-22s %-9s %6s  %s\n' "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}" "${details[$i]}"
done
exit $failed
