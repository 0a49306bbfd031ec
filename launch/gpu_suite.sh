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
# sanitized training steps).
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
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)

if want tests; then
  for t in "$bin"/*_tests; do
    [ -x "$t" ] && run "$(basename "$t")" "$t"
  done
  if [ "${gpus:-0}" -ge 2 ] && [ -x "$bin/gpu_tests" ]; then
    run gpu_tests_nccl_np2 mpirun -np 2 "$bin/gpu_tests" --gtest_filter='Nccl*'
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
# The OpenMP variables are set so hotpath does not execute itself again (launch/cpu_threads.h)
# under the tool.
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
  docs="$log_dir/docs_uniform_64_4096.h5"
  # Token ids below 128001 fit every model's vocabulary; 128001 ends each document.
  [ -f "$docs" ] || python3 "$anchors/make_uniform_docs.py" "$docs" --eot 128001 --tokens 1048576 >/dev/null
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
  docs="$log_dir/docs_uniform_64_4096.h5"
  [ -f "$docs" ] || python3 "$anchors/make_uniform_docs.py" "$docs" --eot 128001 --tokens 1048576 >/dev/null
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
