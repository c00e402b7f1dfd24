"""RMSE vs fp64 on the FA3 paper's outlier inputs (N = 4k, rotation on) for FP8 forward config
overrides, next to the default:

    python scripts/tune/fp8_accuracy.py --hdim 128 --variant "exp_bytes=1"
"""

from __future__ import annotations

import argparse
import math

import torch
from tune_fp8 import parse

from cute_flash.launch import quantize_qkv, run_fwd_fp8
from cute_flash.reference import attention_ref
from cute_flash.reference_fp8 import outlier_qkv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", type=int, nargs="+", default=[128])
    ap.add_argument("--variant", nargs="*", default=[])
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    for d in args.hdim:
        for seed in range(1, args.seeds + 1):
            q, k, v = outlier_qkv(1, 4096, 2, d, seed=seed, device="cuda")
            ref, _ = attention_ref(q.double(), k.double(), v.double())
            out = torch.empty_like(q, dtype=torch.bfloat16)
            lse = torch.empty(1, 2, 4096, device="cuda")
            row = {}
            for rot in (False, True):
                t = quantize_qkv(q.bfloat16(), k.bfloat16(), v.bfloat16(), rotate=rot, seed=0, v_perm=True)
                for var in [""] + args.variant:
                    out.fill_(float("nan"))
                    run_fwd_fp8(*t, out, lse, softmax_scale=1.0 / math.sqrt(d), v_perm=True, **parse(var))
                    row[("rot " if rot else "plain ") + (var or "default")] = (
                        (out.double() - ref).pow(2).mean().sqrt().item())
            print(f"d={d} seed={seed}: " + "  ".join(f"{n}={x:.3e}" for n, x in row.items()), flush=True)


if __name__ == "__main__":
    main()
