"""Host time per sm90 backward launch (developer tool): ``run_bwd_sm90`` on a tiny problem, where
the GPU finishes before the host issues the next call, with the launch plan cached (the default)
and rebuilt on every call (as before ``bwd_sm90.launch_plan``), and the public API's backward.

    python scripts/host_overhead_bwd.py [--calls 300]
"""

from __future__ import annotations

import argparse
import time

import torch

import cute_flash
from cute_flash import bwd_sm90
from cute_flash.fwd import run_fwd


def per_call_us(fn, calls: int, before=None) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        if before is not None:
            before()
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    for d, causal in ((64, True), (128, False), (128, True)):
        q, k, v, do = (torch.randn(1, 128, 2, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out, lse = torch.empty_like(q), torch.empty(1, 2, 128, device="cuda", dtype=torch.float32)
        run_fwd(q, k, v, out, lse, softmax_scale=d ** -0.5, causal=causal, window_size=(-1, -1), softcap=0.0)
        grads = [torch.empty_like(t) for t in (q, k, v)]

        def launch(q=q, k=k, v=v, do=do, out=out, lse=lse, grads=grads, d=d, causal=causal):
            bwd_sm90.run_bwd_sm90(do, q, k, v, out, lse, *grads, softmax_scale=d ** -0.5, causal=causal)

        cached = per_call_us(launch, args.calls)
        rebuilt = per_call_us(launch, args.calls, before=bwd_sm90.launch_plan.cache_clear)
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o = cute_flash.flash_attn_func(qq, kk, vv, causal=causal)
        api = per_call_us(lambda o=o, qq=qq, kk=kk, vv=vv, do=do: torch.autograd.grad(
            o, (qq, kk, vv), do, retain_graph=True), args.calls)
        print(f"d={d} causal={int(causal)}: run_bwd_sm90 {cached:.0f} us per call with the plan cached, "
              f"{rebuilt:.0f} us rebuilt; autograd backward through the public API {api:.0f} us", flush=True)


if __name__ == "__main__":
    main()
