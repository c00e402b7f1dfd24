"""How much the last, partial wave of CTAs costs the sm90 backward (developer tool): main-kernel
GPU time of shapes whose grids fill a whole number of waves against ones that leave a partial
last wave, per CTA-iteration, from the torch profiler.

    python scripts/wave_tail.py --hdim 128 --shape 4,16,4096 4,15,4224 ...
"""

from __future__ import annotations

import argparse
import functools
import math

import profile_bwd
import torch

from cute_flash.bwd_sm90 import run_bwd_sm90
from cute_flash.fwd import run_fwd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--tile", type=int, nargs=2, default=[64, 128], help="tile_m tile_n of the kernel")
    ap.add_argument("--shape", nargs="+", default=["4,16,4096", "4,15,4224"], help="B,H,N")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    d = args.hdim
    for spec in args.shape:
        b, h, n = (int(x) for x in spec.split(","))
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out = torch.empty_like(do)
        lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)
        run_fwd(q, k, v, out, lse, softmax_scale=d ** -0.5, causal=False, window_size=(-1, -1), softcap=0.0)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        fn = functools.partial(run_bwd_sm90, do, q, k, v, out, lse, *grads, softmax_scale=d ** -0.5,
                               causal=False)
        per, _ = profile_bwd.kernel_times(fn, args.iters)
        main_us = max(per.values())
        ctas = b * h * math.ceil(n / args.tile[1])
        waves = ctas / args.sms
        blocks = math.ceil(n / args.tile[0])
        print(f"B{b} H{h} N{n}: {ctas} CTAs = {waves:.2f} waves x {blocks} blocks; main {main_us:.0f} us; "
              f"per ceil-wave-block {main_us / (math.ceil(waves) * blocks) * 1e3:.1f} ns, "
              f"per exact-wave-block {main_us / (waves * blocks) * 1e3:.1f} ns", flush=True)


if __name__ == "__main__":
    main()
