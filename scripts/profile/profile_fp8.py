"""Developer probe: where the FP8 paths' time goes, on one set of inputs (8 sequences of
~2k tokens, d = 128; dense 8 x 2k beside them).

    python scripts/profile/profile_fp8.py           per-kernel CUDA time (torch.profiler)
    python scripts/profile/profile_fp8.py --host    host time per call and a cProfile of it (the varlen
                                            benchmarks swung 430 <-> 600 TFLOP/s between runs: a
                                            host-bound loop)
    python scripts/profile/profile_fp8.py --steps   host time of the steps inside varlen fp8=True: the two
                                            ops, the quantize function without the op, one kernel
                                            executor call, a small allocation, a cache lookup
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


def host_and_wall(fn, iters: int) -> tuple[float, float]:
    """Microseconds per call: returned to the host (no sync inside the loop), and until the GPU is
    done (after one sync)."""
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    return host * 1e6, (time.perf_counter() - t0) / iters * 1e6


def host_times(name: str, fn, iters: int = 50) -> None:
    host, wall = host_and_wall(fn, iters)
    print(f"== {name}: host {host:.0f} us/call, wall {wall:.0f} us/call")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(40)


def step_host_times(n: int = 256, iters: int = 100) -> None:
    """Host microseconds per call of each step of varlen ``fp8=True`` (no sync inside the loop;
    small enough that the GPU keeps up and the launch queue never blocks)."""
    from cute_flash import jit
    from cute_flash.dispatch import quant_configs
    from cute_flash.formats import varlen_v_offsets
    from cute_flash.launch import _signs, quantize_qkv_varlen

    d, h, seqs = 128, 16, 8
    cu = torch.tensor([0, *range(n, n * seqs + 1, n)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(n * seqs, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ops = torch.ops.cute_flash
    q8, k8, v8, *ds = ops.quantize_qkv_varlen(q, k, v, cu, cu, n, n, True, 0, True)
    cfg = quant_configs("bf16", d, True, varlen=True, v_aligned=True)[0]
    amax_fn = jit.compile_kernel(cfg)
    amax = torch.zeros(seqs, h, device="cuda")
    signs = _signs(d, 0, q.device)
    steps = {
        "flash_attn_varlen_func fp8=True": lambda: flash_attn_varlen_func(q, k, v, cu, cu, n, n, fp8=True),
        "flash_attn_varlen_func e4m3": lambda: flash_attn_varlen_func(q8, k8, k8, cu, cu, n, n),
        "op quantize_qkv_varlen": lambda: ops.quantize_qkv_varlen(q, k, v, cu, cu, n, n, True, 0, True),
        "launch.quantize_qkv_varlen (no op)": lambda: quantize_qkv_varlen(q, k, v, cu, cu, n, n, True, 0,
                                                                         True),
        "op varlen_fwd_fp8": lambda: ops.varlen_fwd_fp8(q8, k8, v8, cu, cu, n, n, *ds, 0.088, False, -1, -1,
                                                        torch.bfloat16, True),
        "one quantize kernel call": lambda: amax_fn(q, signs, amax, q8, cu, n, None),
        "torch.zeros(8, 16)": lambda: torch.zeros(seqs, h, device="cuda"),
        "jit.compile_kernel lookup": lambda: jit.compile_kernel(cfg),
        "varlen_v_offsets (cached)": lambda: varlen_v_offsets(cu, n * seqs),
    }
    for name, fn in steps.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        host, wall = host_and_wall(fn, iters)
        print(f"step n={n} {name}: host {host:.1f} us/call, wall {wall:.1f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", action="store_true", help="host time and cProfile instead of kernel times")
    ap.add_argument("--steps", type=int, nargs="*", help="host time of the steps of varlen fp8=True, "
                    "at these sequence lengths (8 sequences)")
    args = ap.parse_args()
    if args.steps is not None:
        for n in args.steps or [256]:
            step_host_times(n)
        return
    for name, fn in cases().items():
        for _ in range(5):  # compile, warm the caches
            fn()
        torch.cuda.synchronize()
        (host_times if args.host else kernel_times)(name, fn)


if __name__ == "__main__":
    main()
