"""Where a timed backward's GPU time goes (developer tool, issue 4): each provider's backward run
as ``triton.testing.do_bench`` runs it (the L2 flushed by a 256 MB memset before every call)
under the torch profiler, and per call: the span from the first kernel's start to the last one's
end, each kernel's time, and the idle gaps between them -- beside the do_bench median of the same
closure in the same process. Per-kernel sums alone (``profile_bwd.py``, warm L2, calls back to
back) can hide launch gaps and cold-cache starts that do_bench counts.

    python scripts/timeline_bwd.py [--hdim 128] [--seqlen 2048 4096] [--causal 0] [--iters 20]
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics

import torch
import triton.testing
import tune_bwd_sm90  # noqa: E402  (same directory: peer closures)
from torch.profiler import ProfilerActivity, profile

import cute_flash
from cute_flash.bwd_sm90 import run_bwd_sm90


def calls_on_gpu(fn, iters: int) -> list[list[tuple[str, float, float]]]:
    """(kernel, start us, end us) of every kernel of each of ``iters`` flushed calls of ``fn``."""
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    calls, cur = [], None
    for e in evs:
        if "fill" in e.name.lower() and e.time_range.elapsed_us() > 20:  # the flush memset
            cur = []
            calls.append(cur)
        elif cur is not None:
            cur.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return [c for c in calls if c]


def summary(calls) -> str:
    spans = [c[-1][2] - c[0][1] for c in calls]
    gaps = [sum(max(0.0, b[1] - a[2]) for a, b in zip(c[:-1], c[1:], strict=True)) for c in calls]
    per: dict[str, list[float]] = collections.defaultdict(list)
    for c in calls:
        for name, s, e in c:
            per[name[:70]].append(e - s)
    lines = [f"span {statistics.median(spans):8.1f} us, gaps {statistics.median(gaps):6.1f} us, "
             f"{len(calls[0])} kernels"]
    lines += [f"      {statistics.median(t):8.1f} us  {k}" for k, t in per.items()]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--causal", type=int, nargs="+", default=[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--peers", nargs="*", default=["fa4"])
    args = ap.parse_args()
    for d in args.hdim:
        for n in args.seqlen:
            for causal in map(bool, args.causal):
                b, h = max(1, 16384 // n), 2048 // d
                q, k, v, do, out, lse = tune_bwd_sm90.forward_problem(d, d, n, causal)
                grads = [torch.empty_like(t) for t in (q, k, v)]
                qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
                o = cute_flash.flash_attn_func(qq, kk, vv, causal=causal)
                fns = {"ours": functools.partial(run_bwd_sm90, do, q, k, v, out, lse, *grads,
                                                 softmax_scale=d ** -0.5, causal=causal),
                       "ours-api": lambda o=o, qq=qq, kk=kk, vv=vv, do=do: torch.autograd.grad(
                           o, (qq, kk, vv), do, retain_graph=True)}
                for peer in args.peers:
                    fns[peer] = tune_bwd_sm90.peer_bwd(peer, q, k, v, do, causal)
                flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                for name, fn in fns.items():
                    ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
                    print(f"d{d} N{n} causal={int(causal)} {name}: do_bench {ms * 1e3:.1f} us "
                          f"({flops / ms / 1e9:.0f} TFLOP/s)", flush=True)
                    print("    " + summary(calls_on_gpu(fn, args.iters)), flush=True)


if __name__ == "__main__":
    main()
