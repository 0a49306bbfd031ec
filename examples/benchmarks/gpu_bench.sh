#!/usr/bin/env bash
# The GPU benchmarks, on a GPU host, from the repository root, after `source .gpu/env.sh`
# (launch/scripts/gpu_bundle.sh packs the programs; the GPU checks are `.gpu/run_gpu_tests.sh`).
# Every hotpath run writes --bench_json; the tables are read from those files. Logs and JSON go
# to LOG_DIR (default gpu_logs/bench).
#
#   source .gpu/env.sh && bash examples/benchmarks/gpu_bench.sh [SECTION...]
#
# Sections (default: attention step experts):
#   attention  `hotpath bench attention` (every path: tiled, cudnn, cudnn-fast) at GPT-OSS's
#              attention (64 heads, 8 kv heads, d64, sinks, window 128) and at 32/8 heads of d128,
#              16,384 tokens as rows of 4,096, one sequence, realistic documents; next to
#              PyTorch's varlen_attn on the same shapes (attention_vs_torch.py)
#   step       `hotpath bench step` (packing stream and whole; each precision of PRECISIONS) next
#              to the anchor's torch_ref.py --compile, on one HDF5 file of documents uniform in
#              64..4095 tokens, 16,384 tokens a step, for GPT-OSS-20b (4 layers), Llama-3.2-1B and
#              Qwen3-0.6B
#   experts    the MoE expert GEMMs each way `expert_gemm` offers (serial, streams, grouped):
#              `bench step` at GPT-OSS-20b (4 layers) and GPT-OSS-120b (1 layer)
#   pair       (2+ GPUs) `bench step` on 2 ranks with comm_overlap on and off (ep=2 under none
#              and zero1; dp=2 for GPT-OSS and Llama) and on one GPU, for the weak scaling; the
#              MoE exchange against NCCL's all-to-all (`bench alltoall`); both ranks offloading
#              (`bench offload`) with pcie_groups auto and 0,1
#   node       (4+ GPUs) the most GPT-OSS-120b layers whose memory plan fits every GPU of the
#              host (at most 8), benchmarked; every rank offloading
#   sweep      the one-GPU scaling sweep (examples/scaling/sweeps/gpu-1x.ini) and its report
#   gemm       `hotpath bench gemm`: bf16 against FP8 GEMMs (quantization included, and alone) at
#              8192^3 and at the layer products of GPT-OSS-20b (expert rows 16,384 * 4 / 32) and
#              Llama-3.2-1B, 16,384 tokens
# Environment: GPU_BIN (default .gpu/bin), LOG_DIR, ANCHOR_DIR (default .gpu/anchors: the
# anchor's torch_ref.py and make_uniform_docs.py), MODELS (default "gptoss llama qwen"),
# PACKINGS (default "stream whole"), PRECISIONS (the step section's; default "bf16", e.g.
# "bf16 fp8 fp8+unembedding fp8+unembedding,unembedding_wgrad": fp8+CLASSES adds the comma list
# CLASSES to the default fp8_gemms), STEP_ARGS (extra
# flags for every bench step), STEP_STEPS (the step section's timed
# steps on both sides, medians over them; default 20: medians of 6 moved by about 2% between
# identical runs, and the anchor's step times spread by 4% within one), BENCH_GPUS
# (the GPU count to plan for; default nvidia-smi's), TOKENS_PER_GPU (default 16384).
set -uo pipefail
bin=${GPU_BIN:-.gpu/bin}
log_dir=${LOG_DIR:-gpu_logs/bench}
anchors=${ANCHOR_DIR:-.gpu/anchors}
sections=${*:-attention step experts}
per_gpu=${TOKENS_PER_GPU:-16384}
step_steps=${STEP_STEPS:-20}
gpus=${BENCH_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
[ -x "$bin/hotpath" ] || { echo "gpu_bench.sh: no $bin/hotpath (pack it with launch/scripts/gpu_bundle.sh; see GPU_BIN)" >&2; exit 2; }
for s in $sections; do
  case $s in attention | step | experts | pair | node | sweep | gemm) ;;
    *) echo "gpu_bench.sh: unknown section '$s' (valid: attention step experts pair node sweep gemm)" >&2; exit 2 ;;
  esac
done
mkdir -p "$log_dir"
want() { [[ " $sections " == *" $1 "* ]]; }
failed=0
# run NAME COMMAND...: COMMAND with its output in LOG_DIR/NAME.log; its last lines on failure.
run() {
  local name=$1
  shift
  echo "== $name"
  "$@" >"$log_dir/$name.log" 2>&1 || { echo "gpu_bench.sh: $name failed (exit $?):"; tail -5 "$log_dir/$name.log"; failed=1; }
}
mpi() { echo mpirun -np "$1" --oversubscribe --bind-to none; }
# The documents (uniform 64..4095 tokens; ids below 128001 fit every model's vocabulary, 128001
# ends each document), made once per LOG_DIR.
docs="$log_dir/docs_uniform_64_4096.h5"
make_docs() {
  [ -f "$docs" ] || python3 "$anchors/make_uniform_docs.py" "$docs" --eot 128001 --tokens 1048576 >/dev/null ||
    { echo "gpu_bench.sh: could not write $docs with $anchors/make_uniform_docs.py" >&2; exit 1; }
}
hp=("$bin/hotpath")
declare -A cfg=([gptoss]="examples/configs/gptoss-20b.ini --n_layers=4"
                [llama]="examples/configs/llama-3.2-1b.ini" [qwen]="examples/configs/qwen3-0.6b.ini")
declare -A ref=([gptoss]=gptoss20b-4L [llama]=llama1b [qwen]=qwen06b)

if want attention; then
  a=(bench attention --device=cuda --seq_len=4096 --batch_tokens=16384 --bench_warmup=2 --bench_steps=10)
  run attention_gptoss "${hp[@]}" "${a[@]}" --config examples/configs/gptoss-20b.ini \
    --bench_json="$log_dir/attention_gptoss.json"
  run attention_d128 "${hp[@]}" "${a[@]}" --config examples/configs/llama-3.2-1b.ini --head_dim=128 \
    --bench_json="$log_dir/attention_d128.json"
  run attention_vs_torch python3 examples/benchmarks/attention_vs_torch.py \
    "$log_dir/attention_gptoss.json" "$log_dir/attention_d128.json"
fi
if want step; then
  make_docs
  for m in ${MODELS:-gptoss llama qwen}; do
    for p in ${PACKINGS:-stream whole}; do
      for prec in ${PRECISIONS:-bf16}; do
        name="step_${m}_$p"
        [ "$prec" = bf16 ] || name="${name}_$prec"
        prec_flags=(--precision="${prec%%+*}")
        [[ $prec == *+* ]] && prec_flags+=(--fp8_gemms="dense,experts,${prec#*+}")
        # shellcheck disable=SC2086
        run "$name" "${hp[@]}" bench step --config ${cfg[$m]} --data="$docs" --eot_token=128001 \
          --shuffle=false --seq_len=4096 --batch_tokens=16384 --packing="$p" "${prec_flags[@]}" \
          --bench_steps="$step_steps" --bench_warmup=2 --bench_json="$log_dir/$name.json" ${STEP_ARGS:-}
      done
    done
    run "torch_$m" python3 "$anchors/torch_ref.py" --config "${ref[$m]}" --tokens 16384 --seq_len 4096 \
      --compile --steps "$step_steps" --h5 "$docs"
  done
fi
if want experts; then
  make_docs
  declare -A ecfg=([20b]="examples/configs/gptoss-20b.ini --n_layers=4" [120b]="examples/configs/gptoss-120b.ini --n_layers=1")
  for shape in 20b 120b; do
    for impl in serial streams grouped; do
      # shellcheck disable=SC2086
      run "experts_${shape}_$impl" "${hp[@]}" bench step --config ${ecfg[$shape]} --data="$docs" \
        --eot_token=128001 --shuffle=false --batch_tokens=16384 --bench_steps=6 --bench_warmup=2 \
        --expert_gemm=$impl --bench_json="$log_dir/experts_${shape}_$impl.json" ${STEP_ARGS:-}
    done
  done
fi
# Model and data of the multi-GPU sections: GPT-OSS-20b with 4 layers and Llama-3.2-1B on the
# documents; the offload runs a dense 8B-like shape.
read -ra moe <<<"--config examples/configs/gptoss-20b.ini --n_layers=4 --data=$docs --eot_token=128001 --shuffle=false"
read -ra dense <<<"--config examples/configs/llama-3.2-1b.ini --data=$docs --eot_token=128001 --shuffle=false"
big_dense=(--config examples/configs/llama-3.2-1b.ini --d_model=4096 --n_heads=32 --n_kv_heads=8
           --head_dim=128 --ffn_dim=14336 --n_layers=8 --tie_embeddings=false --seq_len=4096)
if want pair; then
  if [ "${gpus:-0}" -lt 2 ]; then
    echo "gpu_bench.sh: pair needs 2 GPUs, this host has ${gpus:-0}; skipped"
  else
    make_docs
    read -ra m2 <<<"$(mpi 2)"
    step2() {
      local name=$1
      shift
      run "$name" "${m2[@]}" "${hp[@]}" bench step "$@" --batch_tokens=$((2 * per_gpu)) --bench_steps=6 \
        --bench_warmup=2 --bench_json="$log_dir/$name.json"
    }
    run pair_step_1gpu "${hp[@]}" bench step "${moe[@]}" --batch_tokens="$per_gpu" --bench_steps=6 \
      --bench_warmup=2 --bench_json="$log_dir/pair_step_1gpu.json"
    for ov in true false; do
      for z in none zero1; do
        step2 "pair_step_ep2_${z}_overlap_$ov" "${moe[@]}" --ep_size=2 --optimizer_sharding=$z --comm_overlap=$ov
      done
      step2 "pair_step_dp2_moe_overlap_$ov" "${moe[@]}" --ep_size=1 --comm_overlap=$ov
      step2 "pair_step_dp2_dense_overlap_$ov" "${dense[@]}" --ep_size=1 --comm_overlap=$ov
    done
    run pair_alltoall "${m2[@]}" "${hp[@]}" bench alltoall --config examples/configs/gptoss-20b.ini \
      --n_layers=4 --bench_json="$log_dir/pair_alltoall.json"
    for g in auto 0,1; do
      run "pair_offload_${g/,/_}" "${m2[@]}" "${hp[@]}" bench offload "${big_dense[@]}" \
        --batch_tokens=$((2 * per_gpu)) --bench_warmup=1 --bench_steps=3 --pcie_groups="$g" \
        --bench_json="$log_dir/pair_offload_${g/,/_}.json"
    done
  fi
fi
if want node; then
  if [ "${gpus:-0}" -lt 4 ]; then
    echo "gpu_bench.sh: node needs 4 GPUs, this host has ${gpus:-0}; skipped"
  else
    n=$((gpus > 8 ? 8 : gpus))
    read -ra mn <<<"$(mpi "$n")"
    big=(--config examples/configs/gptoss-120b.ini --synthetic_doc_len=uniform:64:4096
         --batch_tokens=$((n * per_gpu)) --ep_size="$n" --optimizer_sharding=zero1 --checkpoint_activations=true)
    layers=0  # the most layers of 36 whose memory plan fits an H200 per rank
    for ((l = 36; l >= 1; l--)); do
      if "${hp[@]}" train "${big[@]}" --n_layers=$l --dry-run --plan_world="$n" --device_memory_gib=h200 \
        --plan_json="$log_dir/node_plan_120b.json" >"$log_dir/node_plan_120b.log" 2>&1; then
        layers=$l
        break
      fi
    done
    echo "$layers" >"$log_dir/node_120b_layers"
    if [ "$layers" -eq 0 ]; then
      echo "gpu_bench.sh: not one GPT-OSS-120b layer fits $n GPUs ($log_dir/node_plan_120b.log)"
      failed=1
    else
      run node_step_120b "${mn[@]}" "${hp[@]}" bench step "${big[@]}" --n_layers=$layers --bench_steps=4 \
        --bench_warmup=2 --bench_json="$log_dir/node_step_120b.json"
    fi
    run node_offload "${mn[@]}" "${hp[@]}" bench offload "${big_dense[@]}" --batch_tokens=$((n * per_gpu)) \
      --bench_warmup=1 --bench_steps=3 --pcie_groups=auto --bench_json="$log_dir/node_offload.json"
  fi
fi
if want sweep; then
  run sweep_gpu_1x python3 examples/scaling/sweep.py run examples/scaling/sweeps/gpu-1x.ini \
    --out "$log_dir/scaling" --hotpath "$bin/hotpath"
  run sweep_report python3 examples/scaling/sweep.py report "$log_dir/scaling/results.csv" \
    --md "$log_dir/scaling/scaling.md"
fi
if want gemm; then
  for m in gptoss llama; do
    # shellcheck disable=SC2086
    run "gemm_$m" "${hp[@]}" bench gemm --config ${cfg[$m]} --device=cuda --batch_tokens=16384 \
      --bench_warmup=2 --bench_steps=10 --bench_json="$log_dir/gemm_$m.json"
  done
fi

# ---- the tables, from the --bench_json files -----------------------------------------------------
python3 - "$log_dir" "$sections" "${MODELS:-gptoss llama qwen}" "${PACKINGS:-stream whole}" "${PRECISIONS:-bf16}" <<'PY'
import json, os, sys
d, sections, models, packings, precisions = (sys.argv[1], sys.argv[2].split(), sys.argv[3].split(),
                                          sys.argv[4].split(), sys.argv[5].split())
def load(name):
    try:
        return json.load(open(os.path.join(d, name + ".json")))
    except (OSError, ValueError):
        return None
if "attention" in sections:
    print("\n-- attention forward and backward (hotpath bench attention)")
    print(f"{'shape':14s} {'layout':6s} {'window':>6s} {'path':11s} {'fwd ms':>8s} {'bwd ms':>8s} {'fwd TF/s':>9s} {'bwd TF/s':>9s}")
    for name in ("attention_gptoss", "attention_d128"):
        j = load(name)
        if not j:
            print(f"{name}: no result"); continue
        shape = f"h{j['n_heads']}/{j['n_kv_heads']} d{j['head_dim']}"
        for r in j["rows"]:
            print(f"{shape:14s} {r['layout']:6s} {r['window']:6d} {r['path']:11s} {r['fwd_ms']:8.3f} "
                  f"{r['bwd_ms']:8.3f} {r['fwd_tflops']:9.1f} {r['bwd_tflops']:9.1f}")
        for p in j["paths"]:
            if not p["available"]:
                print(f"{shape:14s} {p['path']}: unavailable ({p['reason']})")
if "step" in sections:
    print("\n-- bench step vs the anchor's torch.compile, same token file")
    print(f"{'model':7s} {'packing':14s} {'doc tok/s':>10s} {'padding':>8s} {'MFU':>6s} {'busy':>6s} {'torch tok/s':>11s} {'ratio':>6s}")
    for m in models:
        t = {}
        try:
            line = open(os.path.join(d, f"torch_{m}.log")).read().strip().splitlines()[-1]
            t = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
        except (OSError, IndexError):
            pass
        tps = float(t["doc_tok_s"]) if "doc_tok_s" in t else None
        for p in packings:
            for prec in precisions:
                name = f"step_{m}_{p}" if prec == "bf16" else f"step_{m}_{p}_{prec}"
                label = p if prec == "bf16" else f"{p} {prec}"
                j = load(name)
                if not j:
                    print(f"{m:7s} {label:14s} (no result)"); continue
                ratio = f"{j['tokens_per_s'] / tps:6.3f}" if tps else f"{'-':>6s}"
                print(f"{m:7s} {label:14s} {j['tokens_per_s']:10.0f} {100 * j['padding']:7.2f}% {100 * j['mfu']:5.1f}% "
                      f"{100 * j['gpu_busy_fraction']:5.1f}% {tps or 0:11.0f} {ratio}")
if "experts" in sections:
    print("\n-- expert GEMMs by expert_gemm (ratio: tok/s over serial's)")
    for shape in ("20b", "120b"):
        base = None
        for impl in ("serial", "streams", "grouped"):
            j = load(f"experts_{shape}_{impl}")
            if not j:
                print(f"{shape:5s} {impl:8s} (no result)"); continue
            base = base or j["tokens_per_s"]
            ex = j["profile"]["by_family_ms"].get("expert_gemm", 0)
            print(f"{shape:5s} {impl:8s} step {j['profile']['wall_ms']:8.1f} ms, expert GEMMs {ex:7.1f} ms, "
                  f"{j['tokens_per_s']:8.0f} tok/s, ratio {j['tokens_per_s'] / base:6.3f}")
if "gemm" in sections:
    print("\n-- bf16 against FP8 GEMMs (hotpath bench gemm; TFLOP/s as 2mnk)")
    print(f"{'model':7s} {'weight':15s} {'product':11s} {'m':>6s} {'n':>6s} {'k':>6s} {'bf16':>7s} {'fp8':>7s} {'matmul':>7s} {'quant ms':>9s}")
    for m in ("gptoss", "llama"):
        j = load(f"gemm_{m}")
        if not j:
            print(f"{m:7s} (no result)"); continue
        for r in j["rows"]:
            f = lambda v: f"{v:7.1f}" if v is not None else f"{'-':>7s}"
            q = f"{r['quant_ms']:9.4f}" if r["quant_ms"] is not None else f"{'-':>9s}"
            print(f"{m:7s} {r['weight']:15s} {r['product']:11s} {r['m']:6d} {r['n']:6d} {r['k']:6d} "
                  f"{f(r['act_tflops'])} {f(r['fp8_tflops'])} {f(r['fp8_matmul_tflops'])} {q}")
        if not j["fp8_available"]:
            print(f"{m:7s} fp8 unavailable: {j['fp8_unavailable_reason']}")
def step_row(label, j, one):
    if not j:
        print(f"{label:34s} (no result)"); return
    per = j["tokens_per_s"] / j["world"]
    eff = f"{100 * per / one['tokens_per_s']:6.1f}%" if one and j["world"] > 1 else ""
    mem = j.get("memory", {}).get("max_bytes", 0) / 2**20
    print(f"{label:34s} {j['ms_per_step']:8.1f} ms {per:9.0f} tok/s/GPU MFU {100 * j['mfu']:5.1f}% "
          f"{mem:8.0f} MiB/rank {eff}")
if "pair" in sections:
    one = load("pair_step_1gpu")
    print("\n-- two GPUs (weak scaling against one GPU)")
    step_row("one GPU", one, one)
    for m in ("ep2_none", "ep2_zero1", "dp2_moe", "dp2_dense"):
        for ov in ("true", "false"):
            step_row(f"{m} comm_overlap={ov}", load(f"pair_step_{m}_overlap_{ov}"), one)
    a2a = load("pair_alltoall")
    for r in (a2a or {}).get("rows", []):
        if r["variant"] == "moe_exchange":
            print(f"MoE exchange {r['tokens']:6d} tokens: {r['ms']:7.3f} ms, busbw {r['busbw_gbs']:6.1f} GB/s, "
                  f"{100 * r.get('vs_nccl', float('nan')):5.1f}% of NCCL's all-to-all")
    for g in ("auto", "0_1"):
        for l in (load(f"pair_offload_{g}") or {}).get("link", []):
            print(f"offload pcie_groups={g} arbiter {l['link_arbiter']:3s}: step max/min "
                  f"{l['step_max_over_min']:.3f}, Jain {l['jain']:.4f}")
if "node" in sections:
    j = load("node_step_120b")
    if j:
        layers = open(os.path.join(d, "node_120b_layers")).read().strip()
        print(f"\n-- GPT-OSS-120b, {layers} layers on {j['world']} GPUs: {j['tokens_per_s'] / j['world']:.0f} "
              f"tok/s/GPU, MFU {100 * j['mfu']:.1f}%")
    for l in (load("node_offload") or {}).get("link", []):
        print(f"offload, every rank, arbiter {l['link_arbiter']:3s}: step max/min {l['step_max_over_min']:.3f}, "
              f"Jain {l['jain']:.4f}")
PY
exit $failed
