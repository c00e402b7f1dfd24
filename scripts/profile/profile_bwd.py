"""Where the backward's time goes: per-kernel GPU time of our sm90
backward (preprocess, main, postprocess) beside flash-attn-4's and cuDNN's kernels, from the
torch profiler, so a gap in the end-to-end TFLOP/s is pinned on one launch.

    python scripts/profile/profile_bwd.py [--hdim 64 128] [--seqlen 2048] [--causal 1] [--iters 20]
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

# The tuning script's problem builder and peer closures (scripts/tune/tune_bwd_sm90.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tune"))
import tune_bwd_sm90  # noqa: E402

from cute_flash.launch import run_bwd


def kernel_times(fn, iters: int) -> tuple[dict[str, float], float]:
    """Mean GPU microseconds per call of every kernel ``fn`` launches, and their sum."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name[:90]] += ev.device_time / iters
    return dict(per), sum(per.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[2048])
    ap.add_argument("--causal", type=int, nargs="+", default=[1])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--peers", nargs="*", default=["fa4", "cudnn"])
    ap.add_argument("--variant", nargs="*", default=[], help="BwdSm90Config fields, e.g. 'lpt=0'")
    args = ap.parse_args()
    for d in args.hdim:
        for n in args.seqlen:
            for causal in map(bool, args.causal):
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v, do, out, lse = tune_bwd_sm90.forward_problem(d, d, n, causal)
                grads = [torch.empty_like(t) for t in (q, k, v)]
                fns = {"ours": functools.partial(run_bwd, do, q, k, v, out, lse, *grads, family="sm90",
                                                 softmax_scale=d ** -0.5, causal=causal)}
                for var in args.variant:
                    pairs = (kv.split("=") for kv in var.split(","))
                    ov = {a: (x if a == "diag" else int(x)) for a, x in pairs}
                    fns[var] = functools.partial(run_bwd, do, q, k, v, out, lse, *grads, family="sm90",
                                                 softmax_scale=d ** -0.5, causal=causal, overrides=ov)
                for peer in args.peers:
                    try:
                        fns[peer] = tune_bwd_sm90.peer_bwd(peer, q, k, v, do, causal)
                    except Exception as e:  # noqa: BLE001 - report and go on
                        print(f"{peer}: {type(e).__name__}: {e}")
                flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                for name, fn in fns.items():
                    per, total = kernel_times(fn, args.iters)
                    print(f"d{d} N{n} causal={int(causal)} {name}: {total:.0f} us of kernels "
                          f"({flops / total / 1e6:.0f} TFLOP/s)", flush=True)
                    for kname, us in sorted(per.items(), key=lambda x: -x[1]):
                        print(f"    {us:8.1f} us  {kname}")


if __name__ == "__main__":
    main()
