"""Developer probe (issue 5): per-kernel CUDA times of the FP8 paths (dense / varlen, caller e4m3
and fp8=True) from torch.profiler, to see where the end-to-end time goes."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from cute_flash import flash_attn_func, flash_attn_varlen_func


def prof(name: str, fn, iters: int = 20) -> None:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
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


def main() -> None:
    d, n, seqs = 128, 2048, 8
    h = 2048 // d
    lens = [n - 7 * i for i in range(seqs)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    prof("varlen e4m3", lambda: flash_attn_varlen_func(q8, k8, v8, cu, cu, n, n))
    prof("varlen fp8=True", lambda: flash_attn_varlen_func(q, k, v, cu, cu, n, n, fp8=True))
    qd, kd, vd = (torch.randn(seqs, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    prof("dense fp8=True", lambda: flash_attn_func(qd, kd, vd, fp8=True))
    prof("dense e4m3", lambda: flash_attn_func(*(t.to(torch.float8_e4m3fn) for t in (qd, kd, vd))))


if __name__ == "__main__":
    main()
