#!/usr/bin/env python3
"""Loads a checkpoint written by `hotpath export-hf` with transformers and compares its logits
with hotpath's on the same rows (`hotpath eval --dump_logits`).

  python3 tests/hf/check_export.py EXPORTED_DIR DUMP.safetensors TOKENS.h5 --seq_len T \
      [--tol 0.05] [--device cuda]

TOKENS.h5 holds one document of T + 1 tokens per row (as the fixtures' tokens.h5); DUMP is
hotpath's dump of exactly those rows (eval --shuffle=false, batch_tokens = rows * T). The model
runs in the exported dtype; the check passes when the largest |logit difference| is within --tol
(bf16 rounding of weights and activations accounts for a few 1e-2 on tiny models).
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
    print(f"{a.model}: dtype={model.dtype} rows={rows.shape[0]} max|diff|={diff.max():.4g} "
          f"mean|diff|={diff.mean():.4g} max|logit|={np.abs(ref).max():.4g} tol={a.tol}")
    sys.exit(0 if diff.max() <= a.tol else 1)


if __name__ == "__main__":
    main()
