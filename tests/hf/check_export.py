#!/usr/bin/env python3
"""Loads a checkpoint written by `hotpath export-hf` with transformers and compares its logits
with hotpath's on the same rows (`hotpath eval --dump_logits`).

  python3 tests/hf/check_export.py EXPORTED_DIR DUMP.safetensors TOKENS.h5 --seq_len T \
      [--tol 0.05] [--outliers N] [--device cuda]

TOKENS.h5 holds one document of T + 1 tokens per row (as the fixtures' tokens.h5); DUMP is
hotpath's dump of exactly those rows (eval --shuffle=false, batch_tokens = rows * T). The model
runs in the exported dtype; the check passes when at most --outliers positions have a logit
further than --tol from hotpath's (bf16 rounding accounts for a few 1e-2 on tiny models; in a
MoE it can also flip a near-tie top-k choice, which moves that one position's logits by up to
about 1).
"""
import argparse
import sys

import h5py
import numpy as np
import torch
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("dump")
    ap.add_argument("tokens")
    ap.add_argument("--seq_len", type=int, required=True)
    ap.add_argument("--tol", type=float, default=0.05)
    ap.add_argument("--outliers", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    with h5py.File(a.tokens, "r") as f:
        tokens = f["tokens"][...].astype(np.int64)
    rows = torch.from_numpy(tokens.reshape(-1, a.seq_len + 1)[:, : a.seq_len]).to(a.device)
    model = AutoModelForCausalLM.from_pretrained(a.model, attn_implementation="eager").to(a.device)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=rows).logits.float().cpu().numpy()
    ref = load_file(a.dump)["logits"].reshape(logits.shape)
    diff = np.abs(logits - ref)
    per_pos = diff.max(-1)
    out = int((per_pos > a.tol).sum())
    inside = per_pos[per_pos <= a.tol]
    print(f"{a.model}: dtype={model.dtype} positions={per_pos.size} max|diff|={diff.max():.4g} "
          f"mean|diff|={diff.mean():.4g} max|diff| inside tol={inside.max() if inside.size else 0:.4g} "
          f"positions over tol={out} (allowed {a.outliers}) max|logit|={np.abs(ref).max():.4g} "
          f"tol={a.tol}")
    sys.exit(0 if out <= a.outliers else 1)


if __name__ == "__main__":
    main()
