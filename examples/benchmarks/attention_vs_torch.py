#!/usr/bin/env python3
"""Attention forward+backward throughput of PyTorch's varlen_attn (FlashAttention-2 kernels) on
the packed shapes of hotpath's attention benchmark, side by side with hotpath's numbers.

    python3 examples/benchmarks/attention_vs_torch.py [GPU_PERF_LOG]

GPU_PERF_LOG is the output of `gpu_tests --gtest_also_run_disabled_tests
--gtest_filter='CudaPerf.*'` (launch/gpu_suite.sh keeps it as gpu_perf.log); without it only
PyTorch's numbers print. FLOPs are counted as hotpath counts them: 4 * causal pairs * D * Hq
forward, 2.5x that backward. Times are CUDA-event medians after warm-up.
"""
import inspect
import sys

try:
    import torch
    from torch.nn.attention.varlen import varlen_attn
except Exception as e:  # noqa: BLE001 - any import failure means there is nothing to compare
    print(f"attention_vs_torch: PyTorch varlen attention unavailable ({e}); skipped")
    sys.exit(0)

DOCS = [3100, 517, 2048, 4000, 1290, 3777, 1652]
# name, query heads, kv heads, head dim, sequence lengths, window (0: full causal)
SHAPES = [
    ("gpt-oss d64 full", 64, 8, 64, [4096] * 4, 0),
    ("gpt-oss d64 window128", 64, 8, 64, [4096] * 4, 128),
    ("d128 full", 32, 8, 128, [4096] * 4, 0),
    ("d128 full 16k", 32, 8, 128, [16384], 0),
    # Packed documents of realistic lengths (64..4096), 16,384 tokens, as the GPU test packs them.
    ("gpt-oss d64 docs", 64, 8, 64, DOCS, 0),
    ("gpt-oss d64 docs window128", 64, 8, 64, DOCS, 128),
    ("d128 docs", 32, 8, 128, DOCS, 0),
]


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


def hotpath_numbers(path):
    """{(shape name, path): (fwd ms, bwd ms)} from lines "NAME [PATH] fwd bwd ..." of the log."""
    out = {}
    if not path:
        return out
    names = {shape[0] for shape in SHAPES}
    with open(path) as f:
        for line in f:
            if " [" not in line or "]" not in line:
                continue
            name, rest = line.split(" [", 1)
            attn_path, cols = rest.split("]", 1)
            cols = cols.split()
            if name in names and len(cols) >= 4:
                out[(name, attn_path)] = (float(cols[0]), float(cols[1]))
    return out


def main():
    if not torch.cuda.is_available():
        print("attention_vs_torch: no CUDA device; skipped")
        return 0
    ours = hotpath_numbers(sys.argv[1] if len(sys.argv) > 1 else None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'shape':28s} {'torch f+b ms':>12s} {'torch TF/s':>10s} {'hotpath path':>12s} "
          f"{'f+b ms':>8s} {'TF/s':>7s} {'ratio':>6s}")
    for name, hq, hkv, d, lengths, window in SHAPES:
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
            print(f"{name:28s} torch failed: {e}")
            continue
        flops = 4.0 * causal_pairs(lengths, window) * d * hq * 3.5
        tflops = flops / (ms * 1e9)
        paths = sorted(p for (n, p) in ours if n == name)
        if not paths:
            print(f"{name:28s} {ms:12.3f} {tflops:10.1f} {'-':>12s} {'-':>8s} {'-':>7s} {'-':>6s}")
        for attn_path in paths:
            f, b = ours[(name, attn_path)]
            hp_ms = f + b
            hp_tf = flops / (hp_ms * 1e9)
            print(f"{name:28s} {ms:12.3f} {tflops:10.1f} {attn_path:>12s} {hp_ms:8.3f} "
                  f"{hp_tf:7.1f} {hp_tf / tflops:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
