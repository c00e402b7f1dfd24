"""Developer probe: where the FP8 backward's time goes (per-kernel CUDA time, torch.profiler),
beside our bf16 backward on the same shape.

    python scripts/profile/profile_fp8_bwd.py [d N causal [B H H_kv]]
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from cute_flash import flash_attn_func


def kernel_times(name: str, fn, iters: int = 10) -> None:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    print(f"== {name} (per call, us)")
    rows = [(e.key, e.device_time_total / iters, e.count // iters) for e in p.key_averages()
            if e.device_time_total > 0]
    for key, us, cnt in sorted(rows, key=lambda r: -r[1])[:16]:
        print(f"  {us:9.1f}  x{cnt}  {key[:100]}")
    print(f"  total {sum(r[1] for r in rows):.1f}", flush=True)


def main() -> None:
    args = sys.argv[1:] or ["128", "16384", "0"]
    d, n, causal = int(args[0]), int(args[1]), bool(int(args[2]))
    b, h = max(1, 16384 // n), 2048 // d
    if len(args) > 3:
        b, h = int(args[3]), int(args[4])
    hkv = int(args[5]) if len(args) > 5 else h
    q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    for fp8 in (False, True):
        out = flash_attn_func(q, k, v, causal=causal, fp8=fp8)
        kernel_times(f"{'fp8' if fp8 else 'bf16'} backward B={b} N={n} H={h}/{hkv} d={d} causal={causal}",
                     lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))


if __name__ == "__main__":
    main()
