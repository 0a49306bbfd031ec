#!/usr/bin/env bash
# gpu.bench.gemm: `hotpath bench gemm` on one GPU with tiny-moe's shapes (and the 8192^3 cube),
# one timed sample each, then its --bench_json record checked: the device's FP8 recipe was
# available, every product of the config is there (the cube, then forward, input and weight
# gradient of attn_qkv, attn_out, expert_gate_up, expert_down, unembedding) with positive times
# for the activation dtype, FP8 and the quantization alone. No timing is compared.
#   bench_gemm_case.sh HOTPATH CONFIG WORKDIR PYTHON
set -euo pipefail
hp=$1 cfg=$2 work=$3 py=$4
mkdir -p "$work"
json="$work/bench_gemm.json"
rm -f "$json"
"$hp" bench gemm --config "$cfg" --device=cuda --bench_steps=1 --bench_warmup=0 \
  --bench_json="$json"
"$py" - "$json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
errors = []
if j.get("scenario") != "gemm":
    errors.append(f"scenario {j.get('scenario')!r}, expected 'gemm'")
if not j.get("fp8_available"):
    errors.append(f"fp8 unavailable: {j.get('fp8_unavailable_reason')}")
weights = ("attn_qkv", "attn_out", "expert_gate_up", "expert_down", "unembedding")
want = [("cube", "forward")] + [(w, p) for w in weights
                               for p in ("forward", "input_grad", "weight_grad")]
got = [(r["weight"], r["product"]) for r in j.get("rows", [])]
if got != want:
    errors.append(f"rows {got}, expected {want}")
for r in j.get("rows", []):
    for key in ("act_ms", "fp8_ms", "quant_ms"):
        if not isinstance(r.get(key), (int, float)) or r[key] <= 0:
            errors.append(f"{r['weight']} {r['product']}: {key} = {r.get(key)!r}, expected > 0")
if errors:
    print("bench gemm record:", *errors, sep="\n  ")
    sys.exit(1)
print(f"bench gemm record: {len(got)} products, recipe {j['fp8_recipe']}")
PY
