"""The FP8 backward's accuracy study (``cute_flash.reference_fp8_bwd``): gradient RMSE against fp64
of the bf16 backward and of FP8 recipes (rotation of Q / K, of dO, P at its fixed forward scale,
dS or dO in e5m2) on the FA3 paper's normal and outlier inputs, causal and not. PyTorch only: runs
on the CPU (or the GPU with --device cuda); prints a markdown table per problem.

    python benchmarks/fp8_bwd_accuracy.py [--seqlen 1024] [--hdim 64 128 256] [--heads 4]
"""

from __future__ import annotations

import argparse

import torch

from cute_flash.reference_fp8 import outlier_qkv
from cute_flash.reference_fp8_bwd import fp8_bwd_rmse_table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=1024)
    ap.add_argument("--hdim", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    n, h = args.seqlen, args.heads
    for d in args.hdim:
        for inputs in ("normal", "outliers"):
            gen = torch.Generator(device=args.device).manual_seed(d)
            if inputs == "normal":
                q, k, v = (torch.randn(1, n, h, d, generator=gen, device=args.device) for _ in range(3))
            else:
                q, k, v = outlier_qkv(1, n, h, d, seed=d, device=args.device)
            dout = torch.randn(1, n, h, d, generator=gen, device=args.device)
            for causal in (False, True):
                table = fp8_bwd_rmse_table(q, k, v, dout, causal=causal)
                base = table["bf16 backward"]
                print(f"\nd {d}, N {n}, H {h}, {inputs} inputs, {'causal' if causal else 'not causal'}")
                print("| recipe | dq | dk | dv | x bf16 backward (dq / dk / dv) |\n|---|---|---|---|---|")
                for name, row in table.items():
                    ratio = " / ".join(f"{row[g] / base[g]:.1f}" for g in ("dq", "dk", "dv"))
                    print(f"| {name} | {row['dq']:.2e} | {row['dk']:.2e} | {row['dv']:.2e} | {ratio} |",
                          flush=True)


if __name__ == "__main__":
    main()
