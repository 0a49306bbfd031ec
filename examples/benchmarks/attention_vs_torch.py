#!/usr/bin/env python3
"""Attention forward+backward throughput of PyTorch's varlen_attn (FlashAttention-2 kernels) on
the shapes of `hotpath bench attention` runs, side by side with hotpath's numbers.

    python3 examples/benchmarks/attention_vs_torch.py BENCH_JSON...

Each BENCH_JSON is the --bench_json of one `hotpath bench attention` run: its heads, head_dim and
every row's sequence lengths and window are run through PyTorch (bf16, the same causal pairs), and
each hotpath path's forward+backward ms is printed next to PyTorch's. FLOPs are counted as hotpath
counts them: 4 * causal pairs * D * Hq forward, 2.5x that backward. Times are CUDA-event medians
after warm-up.
"""
import inspect
import json
import sys

try:
    import torch
    from torch.nn.attention.varlen import varlen_attn
except Exception as e:  # noqa: BLE001 - any import failure means there is nothing to compare
    print(f"attention_vs_torch: PyTorch varlen attention unavailable ({e}); skipped")
    sys.exit(0)


def causal_pairs(lengths, window):
    total = 0
    for n in lengths:
        if window <= 0 or window >= n:
            total += n * (n + 1) // 2
        else:
            total += window * (window + 1) // 2 + (n - window) * window
    return total


def call(q, k, v, cu, max_len, window):
    params = inspect.signature(varlen_attn).parameters
    kwargs = {}
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(hq // hkv, dim=1)
            v = v.repeat_interleave(hq // hkv, dim=1)
    if "window_size" in params:
        kwargs["window_size"] = (window - 1 if window > 0 else -1, 0)
    elif window > 0:
        raise RuntimeError("this PyTorch's varlen_attn has no sliding window")
    else:
        kwargs["is_causal"] = True
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **kwargs)


def median_ms(fn, reps=10, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def bench_rows(paths):
    """[(label, hq, hkv, d, lengths, window, {path: (fwd ms, bwd ms)})] from bench JSON files."""
    out = []
    for p in paths:
        with open(p) as f:
            j = json.load(f)
        if j.get("scenario") != "attention":
            raise SystemExit(f"attention_vs_torch: {p} is not a `hotpath bench attention` result "
                             f"(scenario {j.get('scenario')!r})")
        shapes = {}
        for r in j["rows"]:
            key = (r["layout"], r["window"])
            if key not in shapes:
                label = f"h{j['n_heads']}/{j['n_kv_heads']} d{j['head_dim']} {r['layout']}"
                label += f" w{r['window']}" if r["window"] else " full"
                shapes[key] = (label, j["n_heads"], j["n_kv_heads"], j["head_dim"], r["lengths"],
                               r["window"], {})
            shapes[key][6][r["path"]] = (r["fwd_ms"], r["bwd_ms"])
        out.extend(shapes.values())
    return out


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    shapes = bench_rows(sys.argv[1:])
    if not torch.cuda.is_available():
        print("attention_vs_torch: no CUDA device; skipped")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'shape':30s} {'torch f+b ms':>12s} {'torch TF/s':>10s} {'hotpath path':>12s} "
          f"{'f+b ms':>8s} {'TF/s':>7s} {'ratio':>6s}")
    for name, hq, hkv, d, lengths, window, ours in shapes:
        n = sum(lengths)
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda",
                          dtype=torch.int32)
        q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        q.requires_grad_(True)
        k.requires_grad_(True)
        v.requires_grad_(True)
        dout = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        try:
            def step():
                out = call(q, k, v, cu, max(lengths), window)
                out = out[0] if isinstance(out, tuple) else out
                torch.autograd.grad(out, (q, k, v), dout)
            ms = median_ms(step)
        except Exception as e:  # noqa: BLE001 - report the shape PyTorch cannot run
            print(f"{name:30s} torch failed: {e}")
            continue
        flops = 4.0 * causal_pairs(lengths, window) * d * hq * 3.5
        tflops = flops / (ms * 1e9)
        for attn_path, (f, b) in sorted(ours.items()):
            hp_ms = f + b
            hp_tf = flops / (hp_ms * 1e9)
            print(f"{name:30s} {ms:12.3f} {tflops:10.1f} {attn_path:>12s} {hp_ms:8.3f} "
                  f"{hp_tf:7.1f} {hp_tf / tflops:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
