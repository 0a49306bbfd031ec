#!/usr/bin/env bash
# The GPU tests and benchmarks, on a GPU host, from the repository root, after
# `source .gpu/env.sh` (launch/scripts/gpu_bundle.sh packs the programs built elsewhere). Builds
# nothing. Full logs and JSON go to LOG_DIR (default ./gpu_logs); a short table prints last.
#
#   source .gpu/env.sh && bash launch/gpu_suite.sh [SECTION...]
#
# Sections (all by default):
#   tests      every GoogleTest program of the bundle (the CUDA-vs-CPU consistency of every op and
#              attention path, whole-model steps, offload, resume); NCCL cases on 2+ GPUs
#   attention  attention forward+backward per path (tiled, cuDNN) next to PyTorch's varlen_attn
#   step       `hotpath bench step` next to the PyTorch anchor (torch_ref.py with torch.compile)
#              on one HDF5 token file of documents uniform in 64..4095 tokens, 16,384 tokens a step
#   experts    the MoE layers' expert GEMMs run each way `expert_gemm` offers (serial, streams,
#              grouped): `bench step` at GPT-OSS-20b (4 layers) and GPT-OSS-120b (1 layer) on the
#              step section's token file; ms a step and the expert-GEMM time, against serial
#   hf         Hugging Face fixtures imported, fine-tuned on the GPU, exported in bf16 and loaded by
#              transformers; logits compared (tests/hf/gpu_check.sh; needs hp_hf_compare bundled)
#   sweep      the one-GPU scaling sweep (examples/scaling/sweeps/gpu-1x.ini) into LOG_DIR/scaling,
#              with its report (not in the default set: a few minutes)
#   pair       (2+ GPUs; not in the default set) the NCCL tests on 2 ranks; optimizer_sharding
#              zero1 against none over 20 training steps of GPT-OSS-20b (4 layers, ep=2), losses
#              compared; `bench step` on 2 ranks with comm_overlap on and off (ep=2 with either
#              sharding, dp=2 for GPT-OSS and Llama-3.2-1B) and on one GPU, for the weak-scaling
#              efficiency and memory per rank; the MoE exchange against NCCL's all-to-all at
#              1K-32K tokens per rank; the lane arbiter off vs on with both ranks offloading
#   node       (4+ GPUs; not in the default set) full GPT-OSS-20b (24 layers, ep=all GPUs, zero1):
#              its memory plan, 200 steps with a checkpoint at 100, that checkpoint resumed at
#              dp=2 x ep=GPUs/2 and its next 10 losses compared; the most GPT-OSS-120b layers the
#              memory plan fits, benchmarked; the lane arbiter with every rank offloading
#   sweep_node (2+ GPUs; not in the default set) examples/scaling/sweeps/gpu-node.ini, the points
#              that fit this host, into SWEEP_OUT (default LOG_DIR/scaling-node); a sweep stopped
#              by the call's time limit resumes from the results.csv left there
#   sanitize   compute-sanitizer's memcheck (--leak-check full), racecheck, initcheck and
#              synccheck over the GPU tests of SANITIZE_FILTER (racecheck: RACECHECK_FILTER) in
#              SANITIZE_SHARDS processes (default 8), and over two steps of tiny-moe on the GPU;
#              each row gives the tool's error count (0 to pass), after a canary row per tool (a
#              defective kernel the tool must report)
# Environment: GPU_BIN (default .gpu/bin), LOG_DIR, ANCHOR_DIR (default .gpu/anchors: the
# anchor's torch_ref.py and make_uniform_docs.py), STEP_MODELS (default "gptoss llama qwen"),
# STEP_ARGS (extra hotpath flags for every bench step), COMPUTE_SANITIZER (default: on PATH, else
# the CUDA toolkit's), SANITIZE_TOOLS (default "memcheck racecheck initcheck synccheck"),
# SANITIZE_FILTER, RACECHECK_FILTER (gtest filters), SANITIZE_ARGS (extra hotpath flags for the
# sanitized training steps), SUITE_GPUS (the GPU count to plan for; default: nvidia-smi's), and
# for pair and node the model and data flags MOE_ARGS, DENSE_ARGS, DATA_ARGS, TOKENS_PER_GPU and
# OFFLOAD_ARGS (defaults: GPT-OSS-20b with 4 layers, Llama-3.2-1B, the step section's token file,
# 16384, a dense 8B-like shape), NODE_ARGS, NODE_TOKENS_PER_GPU, NODE_STEPS, NODE_CKPT_DIR,
# NODE_GPU_GIB, BIG_ARGS and BIG_MAX_LAYERS (full GPT-OSS-20b, 16384, 200, /dev/shm/hotpath-node,
# h200, GPT-OSS-120b, 36), so the same commands can be rehearsed on the CPU backend with tiny
# models, SUITE_REHEARSAL=1 leaving out what only GPUs can run (docs/testing.md: CI does this).
set -uo pipefail

bin=${GPU_BIN:-.gpu/bin}
log_dir=${LOG_DIR:-gpu_logs}
anchors=${ANCHOR_DIR:-.gpu/anchors}
sections=${*:-tests sanitize attention step}
mkdir -p "$log_dir"
[ -d "$bin" ] || { echo "gpu_suite: no $bin (pack the programs with launch/scripts/gpu_bundle.sh)" >&2; exit 2; }
want() { [[ " $sections " == *" $1 "* ]]; }

# cuDNN: the host's PyTorch carries it; hotpath loads libcudnn.so.9 at run time.
cudnn_lib=$(python3 -c 'import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], "lib"))' 2>/dev/null || true)
[ -n "$cudnn_lib" ] && [ -d "$cudnn_lib" ] && export LD_LIBRARY_PATH="$cudnn_lib:${LD_LIBRARY_PATH:-}"

rows=()
sanitize_origin=()
# A compute-sanitizer log's count of reports: memcheck, initcheck and synccheck end with
# "ERROR SUMMARY: N errors", racecheck with "RACECHECK SUMMARY: N hazards displayed (...)"; the
# numbers of every such line (one per process), summed.
summary_re='^========= (ERROR|RACECHECK) SUMMARY: [0-9]'
# sum_counts REGEX LOG: the first number of each line of LOG matching REGEX, summed (0 if none).
sum_counts() {
  grep -E "$1" "$2" | sed -E 's/^[^0-9]*([0-9]+).*/\1/' | awk '{s += $1} END {print s + 0}'
}
tool_reports() { sum_counts "$summary_re" "$1"; }
failed=0
# run NAME COMMAND...: one program, its log, one summary row.
run() {
  local name=$1 log="$log_dir/$1.log" start rc detail=""
  shift
  echo "== $name: $*"
  start=$(date +%s)
  "$@" >"$log" 2>&1
  rc=$?
  if grep -q '^\[==========\]' "$log"; then
    detail="passed $(grep -m1 '^\[  PASSED  \]' "$log" | grep -oE '[0-9]+' | head -1)"
    detail+=", failed $(grep -m1 '^\[  FAILED  \] [0-9]' "$log" | grep -oE '[0-9]+' | head -1)"
    detail+=", skipped $(grep -m1 '^\[  SKIPPED \] [0-9]' "$log" | grep -oE '[0-9]+' | head -1)"
    grep '^\[  FAILED  \] [A-Z]' "$log" | head -20
  fi
  if grep -qE "$summary_re" "$log"; then
    detail+="${detail:+, }sanitizer errors $(tool_reports "$log")"
  fi
  tail -n 2 "$log"
  rows+=("$(printf '%-28s %-8s %5ss  %s' "$name" "$([ $rc -eq 0 ] && echo ok || echo "FAIL($rc)")" "$(($(date +%s) - start))" "$detail")")
  [ $rc -eq 0 ] || failed=1
}

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
gpus=${SUITE_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
# mpirun for N ranks on this host: as root Open MPI wants to be told; ranks share the cores.
mpi_n() {
  local extra=()
  [ "$(id -u)" = 0 ] && extra=(--allow-run-as-root)
  echo mpirun -np "$1" "${extra[@]}" --oversubscribe --bind-to none
}
# The realistic documents (uniform 64..4095 tokens; ids below 128001 fit every model's vocabulary,
# 128001 ends each document), made once per LOG_DIR.
docs="$log_dir/docs_uniform_64_4096.h5"
make_docs() {
  [ -f "$docs" ] || python3 "$anchors/make_uniform_docs.py" "$docs" --eot 128001 --tokens 1048576 >/dev/null
}
# skip_row NAME WHY: a section this host cannot run, shown in the summary (not a failure).
skip_row() {
  echo "gpu_suite: $1: $2; skipped"
  rows+=("$(printf '%-28s %-8s %5s   %s' "$1" SKIP - "$2")")
}

if want tests; then
  for t in "$bin"/*_tests; do
    [ -x "$t" ] && run "$(basename "$t")" "$t"
  done
  if [ "${gpus:-0}" -ge 2 ] && [ -x "$bin/gpu_tests" ]; then
    # shellcheck disable=SC2046
    run gpu_tests_nccl_np2 $(mpi_n 2) "$bin/gpu_tests" --gtest_filter='Nccl*'
  fi
fi

# The CUDA resume check: 6 steps straight against 3 + save + resume + 3, metrics bitwise.
if want tests && [ -x "$bin/hotpath" ]; then
  r="$log_dir/resume"
  rm -rf "$r" && mkdir -p "$r"
  train=("$bin/hotpath" train --config examples/configs/tiny-moe.ini --device=cuda --deterministic=true --steps=6)
  run resume_straight "${train[@]}" --checkpoint_dir="$r/straight" --metrics_path="$r/s.jsonl"
  run resume_first_half "${train[@]}" --stop_at_step=3 --checkpoint_dir="$r/run" --metrics_path="$r/a.jsonl"
  run resume_second_half "${train[@]}" --resume=auto --checkpoint_dir="$r/run" --metrics_path="$r/b.jsonl"
  run resume_bitwise python3 -c '
import json, sys
s = {j["step"]: j for j in map(json.loads, open(sys.argv[1]))}
b = {j["step"]: j for j in map(json.loads, open(sys.argv[2]))}
bad = [k for k in (4, 5, 6) if k not in b or (b[k]["loss"], b[k]["grad_norm"]) != (s[k]["loss"], s[k]["grad_norm"])]
print("steps 4-6 after resume", "differ at " + str(bad) if bad else "are bitwise the straight run")
sys.exit(1 if bad else 0)' "$r/s.jsonl" "$r/b.jsonl"
  # optimizer_sharding=zero1 on one GPU: the same losses and norms as none, bit for bit.
  run zero1_one_gpu "${train[@]}" --optimizer_sharding=zero1 --metrics_path="$r/z.jsonl"
  run zero1_equals_none python3 -c '
import json, sys
s = [(j["loss"], j["grad_norm"]) for j in map(json.loads, open(sys.argv[1]))]
z = [(j["loss"], j["grad_norm"]) for j in map(json.loads, open(sys.argv[2]))]
print("zero1 vs none on one GPU:", "bitwise equal" if s == z else "DIFFER")
sys.exit(0 if s == z and len(s) == 6 else 1)' "$r/s.jsonl" "$r/z.jsonl"
fi

# compute-sanitizer over the GPU tests (every op and attention path against the CPU reference,
# the allocator, whole-model steps) and two training steps of tiny-moe. The test runs are split
# into SANITIZE_SHARDS processes at once (GoogleTest sharding), one GPU for all: the tools are
# bound by host-side checking, so the shards overlap. Every tool sees every kernel, except that
# synccheck leaves out NVIDIA's warp-specialized Hopper library kernels (cuDNN's generated
# attention, cuBLAS's nvjet): it reports their named barriers as divergent, or overflows its
# table of tracked barriers, and the kernels then fail, and the tests with them. racecheck
# cannot leave kernels out: with a kernel filter it stops with an internal error inside
# cuBLASLt's kernels.
# Each tool first runs its canary (a kernel with one defect of the tool's kind,
# tests/gpu/sanitizer_canary.cu) under the same options, which must be reported: a tool that
# does not see hotpath's kernels would otherwise pass everything.
# The OpenMP variables give each process a fixed thread count and idle threads that sleep, so the
# shards and the tool share the host's cores (launch/cpu_threads.h).
# run_shards NAME SHARDS COMMAND...: COMMAND (a GoogleTest program) as SHARDS processes at once,
# one log each, joined into NAME.log; one summary row with the counts summed.
run_shards() {
  local name=$1 shards=$2 log="$log_dir/$1.log" start rc=0 i pids=() detail
  shift 2
  echo "== $name ($shards shards): $*"
  start=$(date +%s)
  for ((i = 0; i < shards; i++)); do
    GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i "$@" >"$log_dir/$name.shard$i.log" 2>&1 &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i" || rc=1; done
  cat "$log_dir/$name".shard*.log >"$log"
  rm -f "$log_dir/$name".shard*.log
  # Each shard's counts, summed.
  detail="passed $(sum_counts '^\[  PASSED  \] [0-9]' "$log")"
  detail+=", failed $(sum_counts '^\[  FAILED  \] [0-9]' "$log")"
  detail+=", skipped $(sum_counts '^\[  SKIPPED \] [0-9]' "$log")"
  grep '^\[  FAILED  \] [A-Z]' "$log" | head -20
  grep -qE "$summary_re" "$log" && detail+=", sanitizer errors $(tool_reports "$log")"
  tail -n 2 "$log"
  rows+=("$(printf '%-28s %-8s %5ss  %s' "$name" "$([ $rc -eq 0 ] && echo ok || echo "FAIL($rc)")" "$(($(date +%s) - start))" "$detail")")
  [ $rc -eq 0 ] || failed=1
}
if want sanitize; then
  cs=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || true)}
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
    [ -n "$cs" ] || { [ -x "$c" ] && cs=$c; }
  done
  if [ -z "$cs" ]; then
    echo "gpu_suite: sanitize: no compute-sanitizer (set COMPUTE_SANITIZER)" >&2
    rows+=("$(printf '%-28s %-8s' sanitize "FAIL(no compute-sanitizer)")")
    failed=1
  else
    "$cs" --version | tail -1
    # Left out: CudaBackend.ErrorsNameTheStatement makes a failing cudaSetDevice on purpose, which
    # the tools report as an API error; CudaBackend.ProfileNames* profiles through CUPTI, which
    # cannot subscribe under a tool.
    filter=${SANITIZE_FILTER:-'CudaConsistency.*:*CudaAttention.*:CudaBackend.*:CudaAllocator.*:CudaModel.*-CudaBackend.ErrorsNameTheStatement:CudaBackend.ProfileNames*'}
    race_filter=${RACECHECK_FILTER:-$filter}
    shards=${SANITIZE_SHARDS:-8}
    declare -A tool_args=([memcheck]="--leak-check full" [racecheck]=""
                          [initcheck]="--nvtx yes"
                          [synccheck]="--kernel-name-exclude kns=cudnn_generated --kernel-name-exclude kns=nvjet")
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
      f=$filter
      [ "$tool" = racecheck ] && f=$race_filter
      # shellcheck disable=SC2206
      san=("$cs" --tool "$tool" ${tool_args[$tool]} --error-exitcode 1 --print-limit 50)
      if [ -x "$bin/gpu_tests" ]; then
        # The canary passes when the tool reports its defect (exit 1 from --error-exitcode).
        canary="$log_dir/sanitize_${tool}_canary.log"
        timeout 120 env OMP_WAIT_POLICY=passive "${san[@]}" "$bin/gpu_tests" --gtest_also_run_disabled_tests \
          --gtest_filter="Tool/SanitizerCanary.DISABLED_Defect/$tool" >"$canary" 2>&1
        seen=$(tool_reports "$canary")
        if [ "$seen" -gt 0 ]; then
          rows+=("$(printf '%-28s %-8s %5s   the tool reports the defect of its canary (%s)' "sanitize_${tool}_canary" ok - "$seen")")
        else
          rows+=("$(printf '%-28s %-8s %5s   the tool did not report its canary: its 0 would mean nothing' "sanitize_${tool}_canary" FAIL -)")
          failed=1
        fi
        run_shards "sanitize_${tool}_tests" "$shards" env OMP_WAIT_POLICY=passive OMP_NUM_THREADS=2 \
          "${san[@]}" "$bin/gpu_tests" --gtest_filter="$f"
      fi
      # shellcheck disable=SC2086
      [ -x "$bin/hotpath" ] && run "sanitize_${tool}_train" env OMP_WAIT_POLICY=passive OMP_NUM_THREADS=4 \
        "${san[@]}" "$bin/hotpath" train --config examples/configs/tiny-moe.ini --device=cuda \
        --steps=2 --log_every=1 ${SANITIZE_ARGS:-}
    done
    # Where the reports point: hotpath's own kernels, or NVIDIA's library kernels (cuBLAS nvjet,
    # cuDNN's generated attention). Printed under the summary.
    for f in "$log_dir"/sanitize_*.log; do
      [ -f "$f" ] || continue
      case $f in *_canary.log) continue ;; esac
      own=$(grep -A4 -E '^========= (Race reported|Uninitialized|Invalid|Barrier|Error|Warning)' "$f" | grep -cE ' at (void )?hp::' || true)
      lib=$(grep -A4 -E '^========= (Race reported|Uninitialized|Invalid|Barrier|Error|Warning)' "$f" | grep -cE ' at (void )?(nvjet|cudnn|cutlass|sm90_|cublas)' || true)
      sanitize_origin+=("$(printf '%-32s reports in hotpath kernels: %s, in library kernels: %s' "$(basename "$f" .log)" "$own" "$lib")")
    done
  fi
fi

if want attention && [ -x "$bin/gpu_tests" ]; then
  run attention_perf "$bin/gpu_tests" --gtest_also_run_disabled_tests --gtest_filter='CudaPerf.DISABLED_Attention'
  run attention_vs_torch python3 examples/benchmarks/attention_vs_torch.py "$log_dir/attention_perf.log"
fi

if want step; then
  make_docs
  declare -A cfg=([gptoss]="examples/configs/gptoss-20b.ini --n_layers=4" [llama]="examples/configs/llama-3.2-1b.ini" [qwen]="examples/configs/qwen3-0.6b.ini")
  declare -A ref=([gptoss]=gptoss20b-4L [llama]=llama1b [qwen]=qwen06b)
  for m in ${STEP_MODELS:-gptoss llama qwen}; do
    # shellcheck disable=SC2086
    run "step_$m" "$bin/hotpath" bench step --config ${cfg[$m]} --data="$docs" --eot_token=128001 \
      --shuffle=false --batch_tokens=16384 --bench_steps=6 --bench_warmup=2 \
      --bench_json="$log_dir/step_$m.json" ${STEP_ARGS:-}
    run "torch_$m" python3 "$anchors/torch_ref.py" --config "${ref[$m]}" --tokens 16384 --compile \
      --steps 6 --h5 "$docs"
  done
fi

if want experts; then
  make_docs
  declare -A ecfg=([20b]="examples/configs/gptoss-20b.ini --n_layers=4" [120b]="examples/configs/gptoss-120b.ini --n_layers=1")
  for shape in 20b 120b; do
    for impl in serial streams grouped; do
      # shellcheck disable=SC2086
      run "experts_${shape}_$impl" "$bin/hotpath" bench step --config ${ecfg[$shape]} --data="$docs" \
        --eot_token=128001 --shuffle=false --batch_tokens=16384 --bench_steps=6 --bench_warmup=2 \
        --expert_gemm=$impl --bench_json="$log_dir/experts_${shape}_$impl.json" ${STEP_ARGS:-}
    done
  done
fi

# ---- two GPUs: the NCCL tests, zero1, the overlap, the exchange, the lanes -------------------
# Model and data flags are variables so the commands can be rehearsed on the CPU backend
# (MOE_ARGS="--config examples/configs/tiny-moe.ini --device=cpu" and so on).
moe_args=${MOE_ARGS:-"--config examples/configs/gptoss-20b.ini --n_layers=4"}
dense_args=${DENSE_ARGS:-"--config examples/configs/llama-3.2-1b.ini"}
per_gpu=${TOKENS_PER_GPU:-16384}
if want pair; then
  if [ "${gpus:-0}" -lt 2 ]; then
    skip_row pair "needs 2 GPUs, this host has ${gpus:-0}"
  else
    [ -n "${DATA_ARGS:-}" ] || make_docs
    data_args=${DATA_ARGS:-"--data=$docs --eot_token=128001 --shuffle=false"}
    read -ra mpi2 <<<"$(mpi_n 2)"
    read -ra moe <<<"$moe_args $data_args"
    read -ra dense <<<"$dense_args $data_args"
    if ! want tests && [ -x "$bin/gpu_tests" ]; then
      run pair_nccl_tests "${mpi2[@]}" "$bin/gpu_tests" --gtest_filter='Nccl*'
    fi
    # zero1 against none: 20 steps on the same global batches, the losses side by side.
    for z in none zero1; do
      run "pair_train_$z" "${mpi2[@]}" "$bin/hotpath" train "${moe[@]}" --ep_size=2 \
        --batch_tokens=$((2 * per_gpu)) --steps=20 --log_every=5 --optimizer_sharding=$z \
        --metrics_path="$log_dir/pair_train_$z.jsonl"
    done
    run pair_zero1_losses python3 tests/tools/hp_check.py losses "$log_dir/pair_train_zero1.jsonl" \
      "$log_dir/pair_train_none.jsonl" --rel 1e-2 --steps 20
    # bench step on 2 ranks (16K tokens each) with the reductions overlapped and not, and one GPU.
    step2() {
      local name=$1
      shift
      run "$name" "${mpi2[@]}" "$bin/hotpath" bench step "$@" --batch_tokens=$((2 * per_gpu)) \
        --bench_steps=6 --bench_warmup=2 --bench_json="$log_dir/$name.json"
    }
    run pair_step_1gpu "$bin/hotpath" bench step "${moe[@]}" --batch_tokens="$per_gpu" \
      --bench_steps=6 --bench_warmup=2 --bench_json="$log_dir/pair_step_1gpu.json"
    for z in none zero1; do
      for ov in true false; do
        step2 "pair_step_ep2_${z}_overlap_$ov" "${moe[@]}" --ep_size=2 --optimizer_sharding=$z \
          --comm_overlap=$ov
      done
    done
    for ov in true false; do
      step2 "pair_step_dp2_moe_overlap_$ov" "${moe[@]}" --ep_size=1 --comm_overlap=$ov
      step2 "pair_step_dp2_dense_overlap_$ov" "${dense[@]}" --ep_size=1 --comm_overlap=$ov
    done
    if [ -n "${SUITE_REHEARSAL:-}" ]; then
      skip_row pair_alltoall "rehearsal: bench alltoall measures NCCL, which needs GPUs"
    else
      # shellcheck disable=SC2086
      run pair_alltoall "${mpi2[@]}" "$bin/hotpath" bench alltoall $moe_args \
        --bench_json="$log_dir/pair_alltoall.json"
    fi
    # Both ranks offloading at once: the links as pcie_groups=auto finds them, then both ranks
    # on one link (the case the arbiter is for).
    for g in auto 0,1; do
      # shellcheck disable=SC2086
      run "pair_offload_${g/,/_}" "${mpi2[@]}" "$bin/hotpath" bench offload ${OFFLOAD_ARGS:-$dense_args \
        --d_model=4096 --n_heads=32 --n_kv_heads=8 --head_dim=128 --ffn_dim=14336 --n_layers=8 \
        --tie_embeddings=false --seq_len=4096} --batch_tokens=$((2 * per_gpu)) --bench_warmup=1 \
        --bench_steps=3 --pcie_groups="$g" --bench_json="$log_dir/pair_offload_${g/,/_}.json"
    done
  fi
fi

# ---- four to eight GPUs: full GPT-OSS-20b, GPT-OSS-120b layers, the lanes ---------------------
# n = every GPU of the host (at most 8). The layouts come from the memory plan (`--dry-run`),
# tried in order; the first that fits runs. A full GPT-OSS-20b checkpoint holds fp32 masters and
# both moments (about 12 bytes a parameter, 234 GiB), more than these hosts' disks: it goes to
# NODE_CKPT_DIR (default /dev/shm/hotpath-node), and only when that has room for it.
# plan_fits NAME ARGS...: the memory plan of ARGS on n ranks (its log NAME.log); 0 when it fits.
plan_fits() {
  local name=$1
  shift
  "$bin/hotpath" train "$@" --dry-run --plan_world="$n" --device_memory_gib="${NODE_GPU_GIB:-h200}" \
    >"$log_dir/$name.log" 2>&1
}
if want node; then
  if [ "${gpus:-0}" -lt 4 ]; then
    skip_row node "needs 4 GPUs, this host has ${gpus:-0}"
  else
    n=$((gpus > 8 ? 8 : gpus))
    read -ra mpin <<<"$(mpi_n "$n")"
    node_tokens=$((n * ${NODE_TOKENS_PER_GPU:-16384}))
    read -ra full <<<"${NODE_ARGS:-"--config examples/configs/gptoss-20b.ini --synthetic_doc_len=uniform:64:4096"} --batch_tokens=$node_tokens"
    steps=${NODE_STEPS:-200}
    # The training layout (experts over every GPU) and the one the checkpoint is resumed under
    # (dp=2 x ep=n/2), each with what the plan needs to fit.
    pick_layout() {
      local name=$1 ep=$2 extra
      for extra in "" "--checkpoint_activations=true" "--checkpoint_activations=true --offload=double"; do
        # shellcheck disable=SC2086
        if plan_fits "$name" "${full[@]}" --ep_size="$ep" --optimizer_sharding=zero1 $extra; then
          echo "--ep_size=$ep --optimizer_sharding=zero1 $extra"
          return 0
        fi
      done
      return 1
    }
    if ! train_layout=$(pick_layout node_plan_20b "$n"); then
      rows+=("$(printf '%-28s %-8s %5s   no layout of %s GPUs fits (%s)' node_plan_20b FAIL - "$n" "$log_dir/node_plan_20b.log")")
      failed=1
    else
      read -ra tl <<<"$train_layout"
      run node_plan_20b "$bin/hotpath" train "${full[@]}" "${tl[@]}" --dry-run --plan_world="$n" \
        --device_memory_gib="${NODE_GPU_GIB:-h200}" --plan_json="$log_dir/node_plan_20b.json"
      ck=${NODE_CKPT_DIR:-/dev/shm/hotpath-node}
      rm -rf "$ck" && mkdir -p "$ck"
      params=$(grep -m1 -oE 'params: total=[0-9]+' "$log_dir/node_plan_20b.log" | grep -oE '[0-9]+$')
      need=$((${params:-0} * 13))  # masters and moments in fp32, plus room for the metadata
      avail=$(df --output=avail -B1 "$ck" 2>/dev/null | tail -1 | tr -d ' ')
      stop=$((steps - 5))  # the checkpoint's step: the last 5 steps run from it twice
      if [ "${avail:-0}" -ge "$need" ]; then
        run node_train_20b "${mpin[@]}" "$bin/hotpath" train "${full[@]}" "${tl[@]}" \
          --steps="$steps" --stop_at_step="$stop" --log_every=10 --checkpoint_dir="$ck" \
          --metrics_path="$log_dir/node_train_20b.jsonl"
        # From the checkpoint: the same layout, then dp=2 x ep=n/2; no checkpoint is written.
        run node_resume_same "${mpin[@]}" "$bin/hotpath" train "${full[@]}" "${tl[@]}" \
          --steps="$steps" --resume="$ck" --log_every=1 --metrics_path="$log_dir/node_resume_same.jsonl"
        if other_layout=$(pick_layout node_plan_20b_resume $((n / 2))); then
          read -ra ol <<<"$other_layout"
          run node_resume_other "${mpin[@]}" "$bin/hotpath" train "${full[@]}" "${ol[@]}" \
            --steps="$steps" --resume="$ck" --log_every=1 \
            --metrics_path="$log_dir/node_resume_other.jsonl"
          run node_resume_losses python3 tests/tools/hp_check.py losses \
            "$log_dir/node_resume_other.jsonl" "$log_dir/node_resume_same.jsonl" --rel 2e-2 --steps 5
        else
          rows+=("$(printf '%-28s %-8s %5s   no dp=2 x ep=%s layout fits' node_resume_other FAIL - $((n / 2)))")
          failed=1
        fi
        rm -rf "$ck"
      else
        # Without room for the checkpoint: the 200 steps alone.
        skip_row node_checkpoint "$ck has $((${avail:-0} >> 30)) GiB free, the checkpoint needs $((need >> 30)) GiB"
        run node_train_20b "${mpin[@]}" "$bin/hotpath" train "${full[@]}" "${tl[@]}" \
          --steps="$steps" --log_every=10 --metrics_path="$log_dir/node_train_20b.jsonl"
      fi
    fi
    # GPT-OSS-120b: the most of its 36 layers whose plan fits n GPUs (experts over all of them).
    read -ra big <<<"${BIG_ARGS:-"--config examples/configs/gptoss-120b.ini --synthetic_doc_len=uniform:64:4096"} --batch_tokens=$node_tokens --ep_size=$n --optimizer_sharding=zero1 --checkpoint_activations=true"
    layers=0
    for ((l = ${BIG_MAX_LAYERS:-36}; l >= 1; l--)); do
      if plan_fits node_plan_120b "${big[@]}" --n_layers=$l; then layers=$l; break; fi
    done
    echo "$layers" >"$log_dir/node_120b_layers"
    if [ "$layers" -gt 0 ]; then
      run node_plan_120b "$bin/hotpath" train "${big[@]}" --n_layers=$layers --dry-run \
        --plan_world="$n" --device_memory_gib="${NODE_GPU_GIB:-h200}" --plan_json="$log_dir/node_plan_120b.json"
      run node_step_120b "${mpin[@]}" "$bin/hotpath" bench step "${big[@]}" --n_layers=$layers \
        --bench_steps=4 --bench_warmup=2 --bench_json="$log_dir/node_step_120b.json"
    else
      rows+=("$(printf '%-28s %-8s %5s   not one layer fits' node_plan_120b FAIL -)")
      failed=1
    fi
    # Every rank offloading at once, the links as pcie_groups=auto finds them.
    # shellcheck disable=SC2086
    run node_offload "${mpin[@]}" "$bin/hotpath" bench offload ${OFFLOAD_ARGS:-$dense_args \
      --d_model=4096 --n_heads=32 --n_kv_heads=8 --head_dim=128 --ffn_dim=14336 --n_layers=8 \
      --tie_embeddings=false --seq_len=4096} --batch_tokens=$((n * per_gpu)) --bench_warmup=1 \
      --bench_steps=3 --pcie_groups=auto --bench_json="$log_dir/node_offload.json"
  fi
fi

if want sweep_node; then
  if [ "${gpus:-0}" -lt 2 ]; then
    skip_row sweep_node "needs 2 GPUs, this host has ${gpus:-0}"
  else
    out=${SWEEP_OUT:-$log_dir/scaling-node}
    run sweep_node python3 examples/scaling/sweep.py run examples/scaling/sweeps/gpu-node.ini \
      --out "$out" --hotpath "$bin/hotpath" --max-gpus "$gpus"
    run sweep_node_report python3 examples/scaling/sweep.py report "$out/results.csv" \
      --md "$out/scaling.md"
  fi
fi

if want hf && [ -x "$bin/hotpath" ]; then
  run hf_vs_transformers env HP="$bin/hotpath" CMP="$bin/hp_hf_compare" PY=python3 \
    sh tests/hf/gpu_check.sh "$log_dir/hf"
fi

if want sweep; then
  run sweep_gpu_1x python3 examples/scaling/sweep.py run examples/scaling/sweeps/gpu-1x.ini \
    --out "$log_dir/scaling" --hotpath "$bin/hotpath"
  run sweep_report python3 examples/scaling/sweep.py report "$log_dir/scaling/results.csv" \
    --md "$log_dir/scaling/scaling.md"
fi

echo
echo "== summary"
printf '%s\n' "${rows[@]}"
[ ${#sanitize_origin[@]} -gt 0 ] && printf '%s\n' "${sanitize_origin[@]}"
if want attention && [ -f "$log_dir/attention_vs_torch.log" ]; then
  echo "-- attention fwd+bwd vs torch varlen_attn (ratio = hotpath / torch)"
  cat "$log_dir/attention_vs_torch.log"
fi
if want experts; then
  echo "-- expert GEMMs by expert_gemm (ratio: tok/s against serial's; ms from the profiled steps)"
  python3 - "$log_dir" <<'PY'
import json, os, sys
d = sys.argv[1]
print(f"{'shape':6s} {'impl':8s} {'step ms':>8s} {'expert ms':>9s} {'tok/s':>8s} {'ratio':>6s}")
for shape in ("20b", "120b"):
    base = None
    for impl in ("serial", "streams", "grouped"):
        f = os.path.join(d, f"experts_{shape}_{impl}.json")
        if not os.path.exists(f):
            print(f"{shape:6s} {impl:8s} (no result)"); continue
        j = json.load(open(f))
        ms = j["profile"]["wall_ms"]; ex = j["profile"]["by_family_ms"].get("expert_gemm", 0)
        base = base or j["tokens_per_s"]
        print(f"{shape:6s} {impl:8s} {ms:8.1f} {ex:9.1f} {j['tokens_per_s']:8.0f} {j['tokens_per_s']/base:6.3f}")
PY
fi
if want pair && [ "${gpus:-0}" -ge 2 ]; then
  echo "-- two GPUs (targets: zero1 = none within bf16 tolerance; weak scaling >= 95%)"
  python3 - "$log_dir" "$per_gpu" <<'PY'
import json, os, sys
d, per_gpu = sys.argv[1], int(sys.argv[2])
def load(name):
    try:
        return json.load(open(os.path.join(d, name + ".json")))
    except Exception:
        return None
def losses(name):
    try:
        return [json.loads(l)["loss"] for l in open(os.path.join(d, name + ".jsonl")) if l.strip()]
    except Exception:
        return []
a, b = losses("pair_train_none"), losses("pair_train_zero1")
if a and len(a) == len(b):
    worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    print(f"zero1 vs none, {len(a)} steps: loss {a[0]:.4f} -> {a[-1]:.4f} (none), "
          f"{b[0]:.4f} -> {b[-1]:.4f} (zero1); max relative difference {worst:.2e}")
else:
    print(f"zero1 vs none: no result ({len(a)} and {len(b)} steps)")
one = load("pair_step_1gpu")
print(f"{f'run (2 ranks, {per_gpu} tokens each)':34s} {'ms':>8s} {'tok/s/GPU':>10s} {'MFU':>6s} "
      f"{'busy':>6s} {'reductions':>10s} {'MiB/rank max':>12s} {'weak scaling':>12s}")
def row(label, j):
    if not j:
        print(f"{label:34s} (no result)"); return
    per_gpu = j["tokens_per_s"] / j["world"]
    mem = j.get("memory", {}).get("max_bytes", 0) / 2**20
    eff = f"{100 * per_gpu / one['tokens_per_s']:11.1f}%" if one and j["world"] > 1 else f"{'':12s}"
    print(f"{label:34s} {j['ms_per_step']:8.1f} {per_gpu:10.0f} {100 * j['mfu']:5.1f}% "
          f"{100 * j['gpu_busy_fraction']:5.1f}% {j.get('reduction_stream', '?'):>10s} {mem:12.0f} {eff}")
row(f"one GPU, {per_gpu} tokens", one)
for z in ("none", "zero1"):
    for ov in ("true", "false"):
        row(f"ep=2 {z} comm_overlap={ov}", load(f"pair_step_ep2_{z}_overlap_{ov}"))
for m in ("moe", "dense"):
    for ov in ("true", "false"):
        row(f"dp=2 {m} comm_overlap={ov}", load(f"pair_step_dp2_{m}_overlap_{ov}"))
for m in ("ep2_none", "ep2_zero1", "dp2_moe", "dp2_dense"):
    on, off = load(f"pair_step_{m}_overlap_true"), load(f"pair_step_{m}_overlap_false")
    if on and off:
        print(f"overlap {m}: {off['ms_per_step'] / on['ms_per_step']:.3f}x the step time without it")
a2a = load("pair_alltoall")
if a2a:
    print("MoE exchange (dispatch + combine) vs NCCL reference all-to-all of the same rows")
    for r in a2a["rows"]:
        if r["variant"] in ("moe_exchange", "even"):
            what = f"{r['tokens']:6d} tokens" if r["variant"] == "moe_exchange" else f"even {r['mib_per_rank']:7.1f} MiB"
            print(f"  {what:>18s}: {r['ms']:7.3f} ms, busbw {r['busbw_gbs']:6.1f} GB/s, "
                  f"vs NCCL {100 * r.get('vs_nccl', float('nan')):5.1f}%")
for g in ("auto", "0_1"):
    off = load(f"pair_offload_{g}")
    if not off or "lane" not in off:
        print(f"lanes pcie_groups={g}: no result"); continue
    print(f"lanes pcie_groups={off.get('pcie_groups')} (links: {off.get('pcie_links') or 'one'}):")
    for l in off["lane"]:
        print(f"  arbiter {l['lane_arbiter']:3s}: step ms {', '.join(f'{x:.1f}' for x in l['step_ms'])}; "
              f"copy GB/s {', '.join(f'{x:.1f}' for x in l['gbps'])}; step max/min "
              f"{l['step_max_over_min']:.3f}; Jain {l['jain']:.4f}")
PY
fi
if want node && [ "${gpus:-0}" -ge 4 ]; then
  echo "-- the node (targets: loss falling; the resumed losses within 2e-2 of the same layout's)"
  python3 - "$log_dir" <<'PY'
import json, os, re, sys
d = sys.argv[1]
def jsonl(name):
    try:
        return [json.loads(l) for l in open(os.path.join(d, name + ".jsonl")) if l.strip()]
    except Exception:
        return []
def text(name):
    try:
        return open(os.path.join(d, name + ".log")).read()
    except Exception:
        return ""
for name in ("node_plan_20b", "node_plan_20b_resume", "node_plan_120b"):
    t = text(name)
    m = re.search(r"memory plan per rank: (.*)", t)
    tot = re.search(r"total\s+([\d.]+ [KMGT]iB)", t)
    if m:
        print(f"{name}: {m.group(1)}; {tot.group(1) if tot else '?'} per rank")
tr = jsonl("node_train_20b") + jsonl("node_resume_same")
if tr:
    tps = sorted(r["tokens_per_s"] for r in tr[len(tr) // 2:] if "tokens_per_s" in r)
    mfu = sorted(r["mfu"] for r in tr[len(tr) // 2:] if "mfu" in r)
    print(f"GPT-OSS-20b: steps {tr[0]['step']}..{tr[-1]['step']}, loss {tr[0]['loss']:.3f} -> "
          f"{tr[-1]['loss']:.3f}; tok/s {tps[len(tps) // 2] if tps else float('nan'):.0f} "
          f"(median of the second half), MFU {100 * mfu[len(mfu) // 2] if mfu else float('nan'):.1f}%")
for name in ("node_train_20b", "node_resume_same", "node_resume_other"):
    t = text(name)
    for m in re.finditer(r"checkpoint: (saved|loaded) .*", t):
        print(f"{name}: {m.group(0)[:200]}")
same, other = jsonl("node_resume_same"), jsonl("node_resume_other")
if same and other:
    print("after the checkpoint: " + "; ".join(
        f"step {a['step']} {a['loss']:.4f} vs {b['loss']:.4f}" for a, b in zip(same, other)))
try:
    j = json.load(open(os.path.join(d, "node_step_120b.json")))
    layers = open(os.path.join(d, "node_120b_layers")).read().strip()
    print(f"GPT-OSS-120b, {layers} layers on {j['world']} GPUs: "
          f"{j['tokens_per_s'] / j['world']:.0f} tok/s/GPU, MFU {100 * j['mfu']:.1f}%, "
          f"memory {j['memory']['max_bytes'] / 2**30:.1f} GiB max of the plan's "
          f"{j['memory_plan_bytes'] / 2**30:.1f}")
except Exception:
    print("GPT-OSS-120b layers: no result")
try:
    off = json.load(open(os.path.join(d, "node_offload.json")))
    print(f"lanes, {len(off['lane'][0]['step_ms'])} ranks, pcie_groups=auto found links "
          f"{off.get('pcie_links') or 'one for the node'}")
    for l in off["lane"]:
        print(f"  arbiter {l['lane_arbiter']:3s}: step max/min {l['step_max_over_min']:.3f}, "
              f"copy GB/s min {min(l['gbps']):.1f} max {max(l['gbps']):.1f}, Jain {l['jain']:.4f}")
except Exception:
    print("lanes: no result")
PY
fi
if want step; then
  echo "-- bench step vs torch.compile, same token file (documents uniform 64..4095)"
  python3 - "$log_dir" ${STEP_MODELS:-gptoss llama qwen} <<'PY'
import json, os, re, sys
d = sys.argv[1]
print(f"{'model':8s} {'hotpath tok/s':>13s} {'MFU':>6s} {'busy':>6s} {'torch tok/s':>11s} {'MFU':>6s} {'ratio':>6s}")
for m in sys.argv[2:]:
    try:
        j = json.load(open(os.path.join(d, f"step_{m}.json")))
    except Exception:
        print(f"{m:8s} (no hotpath result)"); continue
    t = open(os.path.join(d, f"torch_{m}.log")).read() if os.path.exists(os.path.join(d, f"torch_{m}.log")) else ""
    r = re.search(r"tok_s=(\d+) mfu=([\d.]+)%", t)
    ts, tm = (float(r.group(1)), float(r.group(2))) if r else (float("nan"), float("nan"))
    print(f"{m:8s} {j['tokens_per_s']:13.0f} {100*j['mfu']:5.1f}% {100*j['gpu_busy_fraction']:5.1f}% "
          f"{ts:11.0f} {tm:5.1f}% {j['tokens_per_s']/ts:6.3f}")
    p = j["profile"]
    fam = sorted(p["by_family_ms"].items(), key=lambda kv: -kv[1])
    print("         " + " ".join(f"{k}={v:.1f}" for k, v in fam if v >= 0.5) + f" idle={p['idle_ms']:.1f} (ms)")
    mem = j.get("memory", {}).get("max_bytes", 0) / 2**30
    print(f"         start-up {j.get('startup_s', 0):.1f} s; memory peak {mem:.2f} GiB, "
          f"plan {j.get('memory_plan_bytes', 0) / 2**30:.2f} GiB; "
          f"tuned: GEMM buckets {j.get('gemm_tuned_buckets', 0)}, "
          f"attention graphs {j.get('attention_tuned_graphs', 0)}; "
          f"expert GEMM algorithms warmed {j.get('gemm_warmed_algos', 0)}")
PY
fi
exit $failed
