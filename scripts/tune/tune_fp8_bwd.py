"""Tune the FP8 backward's main kernel: TFLOP/s of ``BwdSm90Fp8Config`` overrides against the
defaults, in one process, rounds rotated (developer tool; the numbers behind its defaults are in
docs/tuning.md).

    python scripts/tune/tune_fp8_bwd.py [--hdim 128] [--seqlen 16384] [--causal 0 1] [--gqa 1]
        [--variants "spin_waits=0" "head_split=4" ...]
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics

import torch
import triton.testing

from cute_flash.launch import quantize_qkv, run_bwd_fp8, run_fwd_fp8


def parse(spec: str) -> dict:
    out = {}
    for kv in filter(None, spec.split(",")):
        key, val = kv.split("=")
        out[key] = bool(int(val)) if val in ("0", "1") else int(val)
    return out


def one_shape(d: int, n: int, causal: bool, variants: list[str], gqa: int = 1) -> None:
    b, h = max(1, 16384 // n), 2048 // d
    q, dout = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, n, h // gqa, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    scale = 1.0 / math.sqrt(d)
    q8, k8, v8, *ds = quantize_qkv(q, k, v, rotate=True, v_perm=True)
    out, lse = torch.empty_like(q), torch.empty(b, h, n, device="cuda")
    run_fwd_fp8(q8, k8, v8, *ds, out, lse, softmax_scale=scale, causal=causal, v_perm=True)
    flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
    specs = ["", *variants]
    times: dict[str, list[float]] = {x: [] for x in specs}
    for r in range(3):
        for x in specs[r % len(specs):] + specs[:r % len(specs)]:
            fn = functools.partial(run_bwd_fp8, dout, q8, k8, v, *ds, out, lse, softmax_scale=scale,
                                   causal=causal, **parse(x))
            times[x].append(triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="median"))
    print(f"d={d} N={n} H={h}/{h // gqa} causal={int(causal)}: " + "  ".join(
        f"{x or 'default'} {flops / statistics.median(t) / 1e9:.0f}" for x, t in times.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[16384])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--gqa", type=int, default=1, help="query heads per kv head")
    ap.add_argument("--variants", nargs="+", default=["spin_waits=0"])
    args = ap.parse_args()
    for d in args.hdim:
        for n in args.seqlen:
            for causal in map(bool, args.causal):
                one_shape(d, n, causal, args.variants, args.gqa)


if __name__ == "__main__":
    main()
