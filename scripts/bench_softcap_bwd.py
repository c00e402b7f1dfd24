"""Softcap backward on Hopper (developer tool): our public backward with the sm90 (FA3) kernels
against our sm80 (FA2) backward -- what autograd took before the sm90 kernel covered the head dim
-- and flash-attn-4 where it takes softcap, in one run, passes rotated over the providers.

    python scripts/bench_softcap_bwd.py [--hdim 64 128] [--seqlen 4096 8192] [--softcap 30]

(Timing and the flash-attn-4 closure come from ``tune_bwd_sm90.py``, next to this file: Python
puts a script's own folder first on the import path.)

B*N = 16k tokens, H*d = 2048, bf16; TFLOP/s = 2.5 x the forward's (halved for causal). Our two
backwards' gradients are compared with each other (relative L2), so a wrong one is flagged.
"""

import argparse
import os

import torch
from tune_bwd_sm90 import peer_bwd, tflops_rotated

from cute_flash import flash_attn_func

ENV = "CUTE_FLASH_BWD_KERNEL"


def ours(family: str, q, k, v, do, causal: bool, softcap: float):
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = flash_attn_func(qq, kk, vv, causal=causal, softcap=softcap)

    def run():
        old = os.environ.get(ENV)
        os.environ[ENV] = family
        try:
            return torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True)
        finally:
            if old is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = old
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--softcap", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for d in args.hdim:
        for n in args.seqlen:
            for causal in map(bool, args.causal):
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
                flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                fns = {"sm90": ours("sm90", q, k, v, do, causal, args.softcap),
                       "sm80": ours("sm80", q, k, v, do, causal, args.softcap)}
                g90, g80 = fns["sm90"](), fns["sm80"]()
                rel = max(((a.float() - c.float()).norm() / c.float().norm()).item()
                          for a, c in zip(g90, g80, strict=True))
                try:
                    fns["fa4"] = peer_bwd("fa4", q, k, v, do, causal, softcap=args.softcap)
                    fns["fa4"]()
                except Exception as e:  # noqa: BLE001 - a peer without softcap leaves a blank
                    print(f"fa4: {type(e).__name__}: {str(e)[:120]}")
                    fns.pop("fa4", None)
                line = tflops_rotated(fns, flops, args.rounds)
                print(f"d{d} N{n} causal={int(causal)} softcap={args.softcap:g}: {line} "
                      f"(sm90 vs sm80 grads rel {rel:.1e})", flush=True)


if __name__ == "__main__":
    main()
