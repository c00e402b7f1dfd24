"""SM clock and board power while a kernel runs back to back (developer tool, device call): tells a
power-limited kernel (clock below the 1980 MHz boost while it runs) from one bound by its pipes.

    python scripts/clock_probe.py            fp8 / bf16 attention d = 128 16k, fp8 / bf16 GEMMs
    python scripts/clock_probe.py bwd D N C  our backward beside flash-attn-4's (d, N, causal)
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import time

import torch
import triton.testing


def sampled(fn, seconds: float = 3.0) -> tuple[float, float, float]:
    """(median SM MHz, median W, ms per call) over `seconds` of back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    ms = float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    smi.terminate()
    rows = [r.split(",") for r in smi.communicate()[0].strip().splitlines()]
    rows = [(float(a), float(b)) for a, b in rows[len(rows) // 4:] if a.strip() and b.strip()]
    return statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows), ms


def report(name: str, fn, flops: float) -> None:
    try:
        mhz, watts, ms = sampled(fn)
    except Exception as e:  # noqa: BLE001 - a probe that fails is reported, the rest still run
        print(f"{name}: ERROR {str(e)[:200]}", flush=True)
        return
    tf = flops / ms / 1e9
    print(f"{name}: {tf:.0f} TFLOP/s, SM {mhz:.0f} MHz, {watts:.0f} W, "
          f"{tf * 1e12 / (132 * mhz * 1e6):.0f} FLOP/clk/SM", flush=True)


def backward(d: int, n: int, causal: bool) -> None:
    from flash_attn.cute import flash_attn_func as fa4

    from cute_flash import flash_attn_func

    b, h = max(1, 16384 // n), 2048 // d
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
    for name, f in (("ours", flash_attn_func), ("fa4", fa4)):
        out = f(q, k, v, causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        do = torch.randn_like(out)
        report(f"bwd {name} d{d} N={n} causal={int(causal)}",
               lambda out=out, do=do: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), flops)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "bwd":
        backward(int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4])))
        return
    from cute_flash.fwd import run_fwd
    from cute_flash.fwd_fp8 import run_fwd_fp8
    from cute_flash.quant import quantize_qkv

    d, n = 128, 16384
    b, h = 1, 2048 // d
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(b, h, n, device="cuda")
    t8p = quantize_qkv(q, k, v, rotate=True, v_perm=True)
    scale = 1.0 / math.sqrt(d)
    attn_flops = 4 * b * h * n * n * d
    a8 = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b8 = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    a16, b16 = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cases = {
        "fp8 attn d128 16k": (lambda: run_fwd_fp8(*t8p, out, lse, softmax_scale=scale, causal=False,
                                                  v_perm=True), attn_flops),
        "bf16 attn d128 16k": (lambda: run_fwd(q, k, v, out, lse, softmax_scale=scale, causal=False,
                                               window_size=(-1, -1), softcap=0.0), attn_flops),
        "fp8 gemm 8192^3": (lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16),
                            2 * 8192 ** 3),
        "bf16 gemm 8192^3": (lambda: a16 @ b16, 2 * 8192 ** 3),
    }
    for name, (fn, flops) in cases.items():
        report(name, fn, flops)


if __name__ == "__main__":
    main()
