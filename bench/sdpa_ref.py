#!/usr/bin/env python3
"""sdpa_ref: PyTorch scaled_dot_product_attention on the shapes of `tandem bench kernels`.

Run it on the GPU machine in the same session as the tandem benchmark, so the two are
compared on one device under one set of clocks:

    python3 bench/sdpa_ref.py [--json] [--iters 20]

prefill: batch 1, 32 heads, 4096 tokens, head dim 128, causal, bf16, flash backend only;
         TFLOP/s counted as 2*2*N^2*d*heads/2 (the same count as bench_kernels.c).
decode:  batch 64, 32 query heads over 8 KV heads (GQA), context 4096, one query token,
         bf16 (each fused backend that takes it, the fastest reported; contiguous KV, so it
         reads no block table); GB/s of K and V read.
Timing: CUDA events around `iters` back-to-back calls after warm-up, median of 5 rounds,
random inputs (never zeros).
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def time_ms(fn, iters):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) / iters)
    return statistics.median(rounds)


def rand(*shape):
    x = torch.rand(*shape, device="cuda", dtype=torch.float32) * 1.9 - 0.95
    x = torch.where(x.abs() < 0.05, torch.full_like(x, 0.5), x)
    return x.to(torch.bfloat16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    out = {"bench": "sdpa_ref", "torch": torch.__version__, "device": torch.cuda.get_device_name()}

    n, d, h = 4096, 128, 32
    q, k, v = rand(1, h, n, d), rand(1, h, n, d), rand(1, h, n, d)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ms = time_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), args.iters)
    out["prefill_ms"] = ms
    out["prefill_tflops"] = 2 * 2 * n * n * d * h / 2 / (ms * 1e-3) / 1e12

    b, ctx, hq, hkv = 64, 4096, 32, 8
    qd = rand(b, hq, 1, d)
    kd, vd = rand(b, hkv, ctx, d), rand(b, hkv, ctx, d)
    # each fused backend that takes the shape, by name, and the fastest reported: left to
    # itself SDPA may pick the math backend, which expands the KV heads, and not say so
    gqa = lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
    by_backend = {}
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        if not hasattr(SDPBackend, name):
            continue
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                gqa()
                by_backend[name] = time_ms(gqa, args.iters)
        except (RuntimeError, TypeError) as e:  # no kernel for the shape; torch < 2.5: no enable_gqa
            out.setdefault("decode_unavailable", {})[name] = (str(e).splitlines() or [type(e).__name__])[0][:160]
    if not by_backend:  # expand the KV heads (reads them 4 times)
        ke = kd.repeat_interleave(hq // hkv, dim=1)
        ve = vd.repeat_interleave(hq // hkv, dim=1)
        by_backend["DEFAULT_KV_EXPANDED"] = time_ms(lambda: F.scaled_dot_product_attention(qd, ke, ve), args.iters)
        out["decode_note"] = "no fused GQA kernel: KV expanded to 32 heads"
    out["decode_backend"], ms = min(by_backend.items(), key=lambda kv: kv[1])
    out["decode_ms_by_backend"] = by_backend
    kv_bytes = b * ctx * hkv * d * 2 * 2
    out["decode_ms"] = ms
    out["decode_gbps"] = kv_bytes / (ms * 1e-3) / 1e9

    if args.json:
        print(json.dumps(out))
    else:
        print(f"device {out['device']}, torch {out['torch']}")
        print(f"sdpa flash prefill 4k hd128 causal {out['prefill_ms']:8.3f} ms {out['prefill_tflops']:6.1f} TFLOP/s")
        print(f"sdpa decode b64 ctx4k 32/8        {out['decode_ms']:8.3f} ms {out['decode_gbps']:6.1f} GB/s "
              f"({out['decode_backend']}; {', '.join(f'{k} {v:.3f} ms' for k, v in out['decode_ms_by_backend'].items())})")


if __name__ == "__main__":
    main()
