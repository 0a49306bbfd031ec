#!/usr/bin/env bash
# From text to a trained model, on the license texts every Debian system has:
#   text -> BPE tokenizer -> token files (train + held-out) -> training with held-out loss
#   -> Hugging Face export, loaded back by import-hf.
#
#   examples/text_demo/run_demo.sh [WORKDIR]      (default: build/text_demo)
#
# Environment: HOTPATH (the hotpath program; default build/cpu/bin/hotpath), PYTHON (a python3
# with tokenizers, h5py and numpy; default python3), TEXT_DIR (default /usr/share/common-licenses:
# every file in it is read, documents split at blank lines). WORKDIR receives tokenizer.json,
# tokens/, run/ (checkpoints), metrics.jsonl, hf/ (the export, with tokenizer.json), hf.h5 and
# hf.ini (the export imported back) and hf_eval.json (its held-out loss); the demo replaces what
# an earlier run of it wrote there and nothing else.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HP=${HOTPATH:-$ROOT/build/cpu/bin/hotpath}
PY=${PYTHON:-python3}
TEXT_DIR=${TEXT_DIR:-/usr/share/common-licenses}
W=${1:-$ROOT/build/text_demo}
INI=$ROOT/examples/text_demo/text-tiny.ini
CORPUS=$ROOT/launch/tools/corpus.py

say() { echo "[text_demo] $*"; }
die() { echo "[text_demo] error: $*" >&2; exit 2; }

[ -x "$HP" ] || die "no hotpath program at $HP: build it (cmake --build --preset cpu --target hotpath) or set HOTPATH"
"$PY" -c 'import tokenizers, h5py, numpy' 2>/dev/null ||
  die "$PY lacks tokenizers, h5py or numpy (pip install tokenizers h5py numpy), or set PYTHON"
[ -d "$TEXT_DIR" ] && [ -n "$(ls -A "$TEXT_DIR")" ] || die "TEXT_DIR $TEXT_DIR: no such directory, or empty"
grep -q -- '--eval_data' <<< "$("$HP" train --help 2>&1)" ||
  die "$HP has no eval_data key (held-out evaluation during training): rebuild it"

mkdir -p "$W"
rm -rf "$W/tokenizer.json" "$W/tokens" "$W/run" "$W/metrics.jsonl" "$W/hf" \
  "$W/hf.h5" "$W/hf.ini" "$W/hf_eval.json"

say "1/5 a byte-level BPE tokenizer of 512 entries from $TEXT_DIR"
"$PY" "$CORPUS" bpe --in "$TEXT_DIR/*" --delimiter '\n\n' --vocab_size 512 \
    --out "$W/tokenizer.json"

say "2/5 token files: 100 held-out paragraphs (seed 0), the rest for training"
"$PY" "$CORPUS" tokenize --in "$TEXT_DIR/*" --delimiter '\n\n' --tokenizer "$W/tokenizer.json" \
    --out "$W/tokens" --val_docs 100 --seed 0 --workers 2 --progress_every 0

say "3/5 training $(basename "$INI") (200 steps of 1024 tokens on the CPU)"
"$HP" train --config "$INI" --data="$W/tokens/train-*.h5" --eval_data="$W/tokens/val-*.h5" \
    --eval_every=25 --eval_batches=8 --device=cpu --metrics_path="$W/metrics.jsonl" \
    --checkpoint_dir="$W/run"

say "4/5 held-out loss (eval_loss of the metrics)"
"$PY" - "$W/metrics.jsonl" <<'PY'
import json, sys
evals = [(r["step"], r["eval_loss"]) for r in map(json.loads, open(sys.argv[1])) if "eval_loss" in r]
print("[text_demo] held-out loss by step: " + ", ".join(f"{s}: {l:.3f}" for s, l in evals))
PY

say "5/5 Hugging Face export, loaded back"
"$HP" export-hf "$W/run" --out "$W/hf" --dtype fp32
cp "$W/tokenizer.json" "$W/hf/tokenizer.json"
"$HP" import-hf "$W/hf" --out "$W/hf.h5" >/dev/null
# The exported weights (fp32: exact) give the final held-out loss again.
"$HP" eval --config "$INI" --checkpoint "$W/hf.h5" --data="$W/tokens/val-*.h5" --batches=8 \
    --device=cpu --eval_json="$W/hf_eval.json" | sed 's/^/[text_demo] the export imported back: /'
say "done: $W/hf holds the model (safetensors, config.json) and its tokenizer.json"
