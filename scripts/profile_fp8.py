"""Developer probe (issue 5): where the FP8 paths' time goes, on one set of inputs (8 sequences of
~2k tokens, d = 128; dense 8 x 2k beside them).

    python scripts/profile_fp8.py           per-kernel CUDA time (torch.profiler)
    python scripts/profile_fp8.py --host    host time per call and a cProfile of it (the varlen
                                            benchmarks swung 430 <-> 600 TFLOP/s between runs: a
                                            host-bound loop)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from cute_flash import flash_attn_func, flash_attn_varlen_func


def cases() -> dict:
    d, n, seqs = 128, 2048, 8
    h = 2048 // d
    lens = [n - 7 * i for i in range(seqs)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    qd, kd, vd = (torch.randn(seqs, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qd8, kd8, vd8 = (t.to(torch.float8_e4m3fn) for t in (qd, kd, vd))
    return {"varlen e4m3": lambda: flash_attn_varlen_func(q8, k8, v8, cu, cu, n, n),
            "varlen fp8=True": lambda: flash_attn_varlen_func(q, k, v, cu, cu, n, n, fp8=True),
            "varlen bf16": lambda: flash_attn_varlen_func(q, k, v, cu, cu, n, n),
            "dense fp8=True": lambda: flash_attn_func(qd, kd, vd, fp8=True),
            "dense e4m3": lambda: flash_attn_func(qd8, kd8, vd8)}


def kernel_times(name: str, fn, iters: int = 20) -> None:
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    print(f"== {name} (per call, us)")
    rows = [(e.key, e.device_time_total / iters, e.count // iters) for e in p.key_averages()
            if e.device_time_total > 0]
    for key, us, cnt in sorted(rows, key=lambda r: -r[1])[:12]:
        print(f"  {us:9.1f}  x{cnt}  {key[:110]}")
    print(f"  total {sum(r[1] for r in rows):.1f}")


def host_times(name: str, fn, iters: int = 50) -> None:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / iters
    print(f"== {name}: host {host * 1e6:.0f} us/call, wall {wall * 1e6:.0f} us/call")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(40)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", action="store_true", help="host time and cProfile instead of kernel times")
    args = ap.parse_args()
    for name, fn in cases().items():
        for _ in range(5):  # compile, warm the caches
            fn()
        torch.cuda.synchronize()
        (host_times if args.host else kernel_times)(name, fn)


if __name__ == "__main__":
    main()
