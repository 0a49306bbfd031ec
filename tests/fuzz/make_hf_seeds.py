#!/usr/bin/env python3
"""Writes the seed corpora of the Hugging Face harnesses (run by hand; the output is checked in):

  python3 tests/fuzz/make_hf_seeds.py tests/fuzz/corpus

corpus/safetensors: small valid files of every dtype the reader converts and damaged variants
(offsets that wrap, overlap or leave gaps, a tensor named twice, a shape whose size overflows,
NaN and infinity, bad header lengths). corpus/hf_config: the fixtures' config.json files and
damaged variants (types, ranges, duplicate keys, RoPE, layer types).
"""
import json
import math
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "hf", "fixtures")


def st(header, data, pad=True):
    h = header if isinstance(header, str) else json.dumps(header)
    h = h.encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def safetensors_seeds():
    f32 = struct.pack("<6f", 1.5, -2.0, 0.25, 3.0, 0.0, -0.5)
    bf16 = bytes.fromhex("c03f0040803e00c0")  # 4 values
    f16 = bytes.fromhex("003c00c0")  # 1.0, -2.0
    u8 = bytes(range(8))
    data = f32 + bf16 + f16 + u8
    good = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
        "c": {"dtype": "F16", "shape": [2], "data_offsets": [32, 36]},
        "d": {"dtype": "U8", "shape": [2, 4], "data_offsets": [36, 44]},
    }
    seeds = {"valid": st(good, data), "empty": st({}, b""), "scalar":
             st({"s": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}}, f32[:4])}

    def variant(name, edit, blob=data, text=None):
        h = json.loads(json.dumps(good))
        edit(h)
        seeds[name] = st(text(h) if text else h, blob)

    variant("wrap", lambda h: h["a"].update(data_offsets=[2**64 - 8, 2**64 + 16]))
    variant("huge_end", lambda h: h["a"].update(data_offsets=[0, 2**63 + 24]))
    variant("negative", lambda h: h["a"].update(data_offsets=[-8, 16]))
    variant("overlap", lambda h: h["b"].update(data_offsets=[20, 28]))
    variant("gap", lambda h: h["d"].update(data_offsets=[37, 45]), blob=data + b"\0")
    variant("trailing", lambda h: None, blob=data + b"\0" * 8)
    variant("shape_overflow", lambda h: h["a"].update(shape=[2**62, 2**62]))
    variant("shape_negative", lambda h: h["a"].update(shape=[-2, -3]))
    variant("bad_dtype", lambda h: h["b"].update(dtype="Q4"))
    variant("extra_key", lambda h: h["b"].update(extra=1))
    variant("duplicate", lambda h: None,
            text=lambda h: json.dumps(h)[:-1] + ', "a": ' + json.dumps(h["a"]) + "}")
    variant("nan", lambda h: None, blob=struct.pack("<f", math.nan) + data[4:])
    variant("inf_bf16", lambda h: None, blob=data[:24] + bytes.fromhex("807f") + data[26:])
    seeds["not_object"] = st("[1, 2]", b"")
    seeds["bad_json"] = st('{"a": {"dtype": "F32", ', b"")
    seeds["header_too_long"] = struct.pack("<Q", 2**40) + b"{}"
    seeds["short"] = b"\x02\x00\x00"
    return seeds


def config_seeds():
    seeds = {}
    for m in ("llama", "qwen3", "gptoss", "gptoss-mxfp4"):
        with open(os.path.join(FIXTURES, m, "config.json"), "rb") as f:
            seeds[m] = f.read()
    llama = json.loads(seeds["llama"])
    gptoss = json.loads(seeds["gptoss"])

    def variant(name, base, **fields):
        c = json.loads(json.dumps(base))
        c.update(fields)
        seeds[name] = json.dumps(c, indent=1).encode()

    legacy = json.loads(json.dumps(gptoss))
    rope = legacy.pop("rope_parameters")
    legacy["rope_theta"] = rope.pop("rope_theta")
    legacy["rope_scaling"] = rope
    legacy["experts_per_token"] = legacy["num_experts_per_tok"]
    seeds["gptoss_legacy"] = json.dumps(legacy).encode()
    variant("hidden_huge", llama, hidden_size=2**40)
    variant("layers_string", llama, num_hidden_layers="2")
    variant("vocab_negative", llama, vocab_size=-5)
    variant("eos_list", llama, eos_token_id=[1, 2])
    variant("eos_huge", llama, eos_token_id=2**40)
    variant("rope_type_number", llama, rope_parameters={"rope_type": 3, "rope_theta": 10.0})
    variant("rope_llama3", llama, rope_parameters={"rope_type": "llama3", "factor": 8.0})
    variant("truncate_string", gptoss,
            rope_parameters=dict(gptoss["rope_parameters"], truncate="no"))
    variant("layer_types_number", gptoss, layer_types=5)
    variant("layer_types_mixed", gptoss, layer_types=[1, "full_attention"])
    variant("window_huge", gptoss, sliding_window=2**40)
    variant("unknown_field", llama, frobnication_level=3)
    seeds["duplicate"] = seeds["llama"].rstrip()[:-1] + b', "hidden_size": 64}'
    seeds["not_object"] = b"[1, 2, 3]"
    seeds["deep"] = b"[" * 200 + b"]" * 200
    return seeds


def main():
    out = sys.argv[1]
    for name, seeds in (("safetensors", safetensors_seeds()), ("hf_config", config_seeds())):
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        for k, v in seeds.items():
            with open(os.path.join(d, k + (".safetensors" if name == "safetensors" else ".json")),
                      "wb") as f:
                f.write(v)
        print(f"{d}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
