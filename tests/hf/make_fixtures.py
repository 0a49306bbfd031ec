#!/usr/bin/env python3
"""Writes the tiny Hugging Face checkpoints the import tests read (tests/hf/fixtures/<name>/).

Each fixture is a random-weight model made by `transformers` (fp32 safetensors + config.json) and
the reference its tests compare hotpath against, computed by `transformers` on the CPU in fp32
with eager attention:

  reference.json         {"rows": [[token ids]...], "eot": id, "loss": mean CE over every
                          next-token target of every row, "seq_len": T}
  logits.safetensors     "logits" F32 [rows, T, vocab]: the logits of the first T positions
  tokens.h5              the rows as a hotpath token file (/tokens, /doc_offsets), one
                         document per row

Every row is T random ids below eot followed by eot, so hotpath, packing each row as one
document of T + 1 tokens, predicts exactly the T targets `transformers` does.

gptoss-mxfp4 is gptoss with its expert weights quantized to MXFP4 (blocks + E8M0 scales, the
layout of released GPT-OSS checkpoints); its reference is computed from the weights that
transformers' own dequantizer (transformers.integrations.mxfp4) recovers from them.

Needs torch, transformers and safetensors (not needed by the tests):
  python3 tests/hf/make_fixtures.py [--out tests/hf/fixtures]
"""
import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, LlamaConfig, Qwen3Config

ROWS, T = 4, 16


def configs():
    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=32,
                  rms_norm_eps=1e-5)
    return {
        "llama": LlamaConfig(**common, intermediate_size=96, tie_word_embeddings=False,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        # Tied embeddings, q/k norm, YaRN with HF's default truncate (true). theta, the original
        # context and beta_fast put the ramp's ends between whole pairs (0.42 and 4.03), so
        # truncating them changes the frequencies of pairs 1..4.
        "qwen3": Qwen3Config(**{**common, "max_position_embeddings": 256}, intermediate_size=80,
                             tie_word_embeddings=True,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 100.0,
                                              "factor": 4.0, "original_max_position_embeddings": 64,
                                              "beta_fast": 8.0, "beta_slow": 1.0}),
        # Sinks, biases, a window of 4 on even layers, clamped SwiGLU, YaRN with truncate=false.
        "gptoss": GptOssConfig(**{**common, "max_position_embeddings": 256}, intermediate_size=32,
                               num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                               tie_word_embeddings=False, swiglu_limit=7.0,
                               rope_parameters={"rope_type": "yarn", "rope_theta": 100.0,
                                                "factor": 4.0, "beta_fast": 8.0,
                                                "beta_slow": 1.0, "truncate": False,
                                                "original_max_position_embeddings": 64}),
    }


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=g))


FP4 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def quantize_mxfp4(w):
    """[E, in, out] fp32 -> blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32]."""
    x = w.transpose(1, 2).contiguous()  # [E, out, in]
    e, o, i = x.shape
    x = x.reshape(e, o, i // 32, 32)
    amax = x.abs().amax(-1).clamp(min=1e-12)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # scale 2^exp puts |x| <= 6
    scaled = x / torch.pow(2.0, exp)[..., None]
    lut = torch.tensor(FP4)
    idx = (scaled[..., None] - lut).abs().argmin(-1)  # nearest E2M1 code (sign included)
    lo, hi = idx[..., 0::2], idx[..., 1::2]
    blocks = (lo | (hi << 4)).to(torch.uint8)
    scales = (exp + 127).to(torch.uint8)
    return blocks, scales


def write_reference(model, cfg, out, seed):
    g = torch.Generator().manual_seed(seed + 1)
    eot = cfg.vocab_size - 1
    rows = torch.randint(0, eot, (ROWS, T + 1), generator=g)
    rows[:, T] = eot
    with torch.no_grad():
        res = model(input_ids=rows, labels=rows)
    logits = res.logits[:, :T, :].contiguous().float()
    save_file({"logits": logits}, os.path.join(out, "logits.safetensors"))
    # The rows as an HDF5 token file, one document per row (docs: framework/data/token_files.h).
    import h5py
    import numpy as np
    with h5py.File(os.path.join(out, "tokens.h5"), "w") as f:
        f["tokens"] = rows.reshape(-1).numpy().astype(np.uint32)
        f["doc_offsets"] = np.arange(0, ROWS * (T + 1) + 1, T + 1, dtype=np.int64)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"rows": rows.tolist(), "eot": eot, "loss": float(res.loss), "seq_len": T}, f)
    return float(res.loss)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "fixtures"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    for seed, (name, cfg) in enumerate(configs().items()):
        out = os.path.join(args.out, name)
        shutil.rmtree(out, ignore_errors=True)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
        randomize(model, 100 + seed)
        model.save_pretrained(out, safe_serialization=True)
        loss = write_reference(model, cfg, out, seed)
        print(f"{name}: loss={loss:.6f}")
        if name != "gptoss":
            continue
        # The MXFP4 variant: quantize the experts, dequantize them with transformers' own code,
        # and compute the reference from the model holding the dequantized weights.
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
        qout = os.path.join(args.out, "gptoss-mxfp4")
        shutil.rmtree(qout, ignore_errors=True)
        os.makedirs(qout)
        tensors = load_file(os.path.join(out, "model.safetensors"))
        qtensors = {}
        with torch.no_grad():
            for k, v in tensors.items():
                if k.endswith("experts.gate_up_proj") or k.endswith("experts.down_proj"):
                    blocks, scales = quantize_mxfp4(v)
                    qtensors[k + "_blocks"] = blocks
                    qtensors[k + "_scales"] = scales
                    deq = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                    assert deq.shape == v.shape, (deq.shape, v.shape)
                    model.get_parameter(k).copy_(deq)
                else:
                    qtensors[k] = v
        save_file(qtensors, os.path.join(qout, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out, "config.json")) as f:
            c = json.load(f)
        c["quantization_config"] = {"quant_method": "mxfp4",
                                    "modules_to_not_convert": ["model.layers.*.self_attn",
                                                               "model.layers.*.mlp.router",
                                                               "model.embed_tokens", "lm_head"]}
        with open(os.path.join(qout, "config.json"), "w") as f:
            json.dump(c, f, indent=2)
        loss = write_reference(model, cfg, qout, seed)
        print(f"gptoss-mxfp4: loss={loss:.6f}")


if __name__ == "__main__":
    main()
