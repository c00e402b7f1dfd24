"""Host against device time per call of ``benchmarks/mods.py``'s problems (developer tool): how long
Python takes to issue one forward (and forward + backward) through ``flash_attn_func`` against how
long the GPU takes to run it. A call whose issue time reaches its GPU time is host-bound: timings
then measure Python, not kernels.
Usage: python scripts/tune/host_time.py [--only documents] [--calls 50]"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import mods as bench  # noqa: E402  (benchmarks/mods.py: the problems)


def measure(fn, calls: int) -> tuple[float, float]:
    """(median host ms to issue one call, GPU ms per call) over ``calls`` calls."""
    fn()
    torch.cuda.synchronize()
    issue = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        issue.append((time.perf_counter() - t0) * 1e3)
    end.record()
    torch.cuda.synchronize()
    return statistics.median(issue), start.elapsed_time(end) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    for name, n, kw, (f_score, f_mask), _, lens in bench.problems():
        if args.only and not any(o in name for o in args.only):
            continue
        for who, fns in bench.providers(name, n, kw, f_score, f_mask, lens).items():
            if who not in ("ours", "ours varlen", "ours plain causal"):
                continue
            (f_issue, f_gpu), (b_issue, b_gpu) = (measure(fn, args.calls) for fn in fns)
            print(f"{name}: {who}: fwd issue {f_issue:.3f} ms, {f_gpu:.3f} ms per call; fwd+bwd issue "
                  f"{b_issue:.3f} ms, {b_gpu:.3f} ms per call", flush=True)


if __name__ == "__main__":
    main()
