"""Developer probe (issue 5): host-side (Python) time per call of the varlen FP8 paths, by
cProfile over back-to-back calls -- the varlen benchmarks swung 430 <-> 600 TFLOP/s between runs,
a sign of a host-bound loop."""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from cute_flash import flash_attn_func, flash_attn_varlen_func


def main() -> None:
    d, n, seqs = 128, 2048, 8
    h = 2048 // d
    lens = [n - 7 * i for i in range(seqs)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    qd, kd, vd = (torch.randn(seqs, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cases = {"e4m3": lambda: flash_attn_varlen_func(q8, k8, v8, cu, cu, n, n),
             "dense fp8=True": lambda: flash_attn_func(qd, kd, vd, fp8=True),
             "fp8=True": lambda: flash_attn_varlen_func(q, k, v, cu, cu, n, n, fp8=True),
             "bf16": lambda: flash_attn_varlen_func(q, k, v, cu, cu, n, n)}
    for name, fn in cases.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            fn()
        host = (time.perf_counter() - t0) / 50
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 50
        print(f"== {name}: host {host * 1e6:.0f} us/call, wall {wall * 1e6:.0f} us/call")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(50):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        st = pstats.Stats(pr)
        st.sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main()
