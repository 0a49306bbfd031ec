#!/usr/bin/env bash
# The whole training step against the PyTorch anchor, on one GPU, in one run: `hotpath bench step`
# (each packing of PACKINGS) and the anchor's torch_ref.py --compile on the same HDF5 token file
# of documents uniform in 64..4095 tokens, 16,384 tokens a step. Both sides count document
# tokens; hotpath's padding, MFU on document FLOPs and GPU busy time come from its --bench_json.
#
#   source .gpu/env.sh && bash examples/benchmarks/step_vs_anchor.sh
#
# Environment: GPU_BIN (default .gpu/bin: hotpath), ANCHOR_DIR (default .gpu/anchors: torch_ref.py
# and make_uniform_docs.py), LOG_DIR (default gpu_logs/step: logs, JSON and summary.txt),
# MODELS (default "gptoss llama qwen"), PACKINGS (default "stream whole"), STEP_ARGS (extra hotpath
# flags), TORCH=0 (hotpath only). The summary table prints last.
set -uo pipefail

bin=${GPU_BIN:-.gpu/bin}
anchors=${ANCHOR_DIR:-.gpu/anchors}
log_dir=${LOG_DIR:-gpu_logs/step}
mkdir -p "$log_dir"
docs="$log_dir/docs_uniform_64_4096.h5"
[ -f "$docs" ] ||
  python3 "$anchors/make_uniform_docs.py" "$docs" --eot 128001 --tokens 1048576 >/dev/null ||
  { echo "step_vs_anchor: could not write $docs" >&2; exit 1; }

# cuDNN: the host's PyTorch carries a libcudnn.so.9 that hotpath can load.
cudnn_lib=$(python3 -c 'import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], "lib"))' 2>/dev/null || true)
[ -n "$cudnn_lib" ] && [ -d "$cudnn_lib" ] && export LD_LIBRARY_PATH="$cudnn_lib:${LD_LIBRARY_PATH:-}"

declare -A cfg=([gptoss]="examples/configs/gptoss-20b.ini --n_layers=4"
                [llama]="examples/configs/llama-3.2-1b.ini" [qwen]="examples/configs/qwen3-0.6b.ini")
declare -A ref=([gptoss]=gptoss20b-4L [llama]=llama1b [qwen]=qwen06b)
models=${MODELS:-gptoss llama qwen}
failed=0
for m in $models; do
  for p in ${PACKINGS:-stream whole}; do
    echo "== hotpath $m packing=$p"
    # shellcheck disable=SC2086
    "$bin/hotpath" bench step --config ${cfg[$m]} --data="$docs" --eot_token=128001 --shuffle=false \
      --seq_len=4096 --batch_tokens=16384 --packing="$p" --bench_steps=6 --bench_warmup=2 \
      --bench_json="$log_dir/hotpath_${m}_$p.json" ${STEP_ARGS:-} >"$log_dir/hotpath_${m}_$p.log" 2>&1 ||
      { failed=1; tail -5 "$log_dir/hotpath_${m}_$p.log"; }
    head -4 "$log_dir/hotpath_${m}_$p.log" | tail -2
  done
  if [ "${TORCH:-1}" != 0 ]; then
    echo "== torch $m"
    python3 "$anchors/torch_ref.py" --config "${ref[$m]}" --tokens 16384 --seq_len 4096 --compile \
      --steps 6 --h5 "$docs" >"$log_dir/torch_$m.log" 2>&1 || { failed=1; tail -5 "$log_dir/torch_$m.log"; }
    tail -1 "$log_dir/torch_$m.log"
  fi
done

# The table: document tokens/s of both sides and their ratio, hotpath's padding, MFU and busy.
python3 - "$log_dir" "$models" "${PACKINGS:-stream whole}" <<'PY' | tee "$log_dir/summary.txt"
import json, os, re, sys
log_dir, models, packings = sys.argv[1], sys.argv[2].split(), sys.argv[3].split()
print(f"{'model':7s} {'packing':8s} {'hotpath doc tok/s':>17s} {'padding':>8s} {'MFU':>6s} "
      f"{'busy':>6s} {'torch doc tok/s':>15s} {'torch MFU':>9s} {'ratio':>7s}")
for m in models:
    torch = {}
    try:
        line = open(os.path.join(log_dir, f"torch_{m}.log")).read().strip().splitlines()[-1]
        torch = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
    except (OSError, IndexError):
        pass
    t_tps = float(torch["doc_tok_s"]) if "doc_tok_s" in torch else None
    for p in packings:
        try:
            j = json.load(open(os.path.join(log_dir, f"hotpath_{m}_{p}.json")))
        except (OSError, ValueError):
            print(f"{m:7s} {p:8s} {'(no result)':>17s}")
            continue
        ratio = f"{j['tokens_per_s'] / t_tps:7.3f}" if t_tps else f"{'-':>7s}"
        print(f"{m:7s} {p:8s} {j['tokens_per_s']:17.0f} {100 * j['padding']:7.2f}% "
              f"{100 * j['mfu']:5.1f}% {100 * j['gpu_busy_fraction']:5.1f}% "
              f"{t_tps or 0:15.0f} {torch.get('mfu', '-'):>9s} {ratio}")
PY
exit $failed
