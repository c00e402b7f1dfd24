"""sm90 backward variants on the GPU (developer tool): backward TFLOP/s (2.5x forward FLOPs) of
each BwdSm90Config variant (pre + main + post, the launches autograd makes) beside flash-attn-4's
and cuDNN's backward in the same run, passes rotated over the providers; dq, dk and dv of each
variant checked against the default one (relative L2), so a broken variant is flagged rather than
timed as right.

    python scripts/tune/tune_bwd_sm90.py [--hdim 64 128 256] [--seqlen 8192] [--causal 0 1]
        [--variant "deterministic=1" "dq_before_dk=1,ds_stages=2" ...] [--heads 32 8 --batch 1]

``--heads H H_KV`` / ``--batch B`` leave the grid (B.N = 16k, H.d = 2048, H_KV = H) for a GQA / MQA
problem, e.g. the query-head split of a group: ``--variant head_split=1 head_split=2``.
"""

import argparse
import functools
import math
import statistics

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from cute_flash.launch import run_bwd, run_fwd


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def peer_bwd(name, q, k, v, do, causal, softcap: float = 0.0):
    """A closure running one peer's backward alone (autograd.grad on a retained graph)."""
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if name in ("fa4", "fa4-det"):
        from flash_attn.cute import flash_attn_func

        det = dict(deterministic=True) if name == "fa4-det" else {}
        o = flash_attn_func(qq, kk, vv, causal=causal, softcap=softcap, **det)
        o = o[0] if isinstance(o, tuple) else o
    else:
        assert not softcap, "SDPA has no softcap"
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(
                qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), is_causal=causal,
                enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)
    return lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True)


def forward_problem(d: int, dv: int, n: int, causal: bool, b: int, h: int, hkv: int) -> tuple:
    """(q, k, v, do, out, lse) at head dims (d, dv), N = n, B = b, H = h query and hkv K/V heads
    (bf16, flash-attn layout), out and lse from our forward."""
    q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, n, hkv, dv, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(b, n, h, dv, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(do)
    lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)
    run_fwd(q, k, v, out, lse, softmax_scale=d ** -0.5, causal=causal, window_size=(-1, -1), softcap=0.0)
    return q, k, v, do, out, lse


def tflops_rotated(fns: dict, flops: float, rounds: int) -> str:
    """``name TFLOP/s`` of each closure: median of ``rounds`` passes, the order rotated each pass
    (the H200's clock drifts within seconds, so no provider always runs first)."""
    times: dict[str, list[float]] = {x: [] for x in fns}
    names = list(fns)
    for r in range(rounds):
        for x in names[r % len(names):] + names[:r % len(names)]:
            times[x].append(bench(fns[x]))
    return " ".join(f"{x} {flops / statistics.median(t) / 1e9:.0f}" for x, t in times.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", nargs="+", default=["128"], help="d, or DxDV (e.g. 192x128)")
    ap.add_argument("--seqlen", type=int, nargs="+", default=[8192])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--variant", nargs="*", default=[], help="BwdSm90Config fields, e.g. 'mask_always=1'")
    ap.add_argument("--peers", nargs="*", default=["fa4", "cudnn"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", type=int, nargs=2, default=None, metavar=("H", "H_KV"),
                    help="query and K/V heads (default: the grid's 2048 / d, no GQA)")
    ap.add_argument("--batch", type=int, default=0, help="batch (default: the grid's 16k / N)")
    args = ap.parse_args()
    variants = [{}] + [{k: int(x) for k, x in (kv.split("=") for kv in var.split(",") if kv)}
                       for var in args.variant]
    for spec in args.hdim:
        d, dv = (int(x) for x in spec.split("x")) if "x" in spec else (int(spec), int(spec))
        for n in args.seqlen:
            for causal in map(bool, args.causal):
                b = args.batch or max(1, 16384 // n)
                h, hkv = args.heads or (2048 // d, 2048 // d)
                q, k, v, do, out, lse = forward_problem(d, dv, n, causal, b, h, hkv)
                scale = d ** -0.5
                flops = 2.5 * 2 * b * h * n * n * (d + dv) / (2 if causal else 1)
                tag = f"d{spec} N{n} causal={int(causal)}"
                fns, ref = {}, None
                for var in variants:
                    name = ",".join(f"{a}={x}" for a, x in var.items()) or "default"
                    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
                    det = bool(var.get("deterministic", 0))
                    ov = {a: x for a, x in var.items() if a != "deterministic"}
                    fn = functools.partial(run_bwd, do, q, k, v, out, lse, *grads, family="sm90",
                                           softmax_scale=scale, causal=causal, deterministic=det,
                                           overrides=ov)

                    try:
                        fn()
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001 - report and go on
                        print(f"{tag} {name}: {type(e).__name__}: {e}", flush=True)
                        continue
                    # Every gradient (a variant may change only dK / dV's path) against the default's.
                    if ref is None:
                        ref = [g.float() for g in grads]
                    rels = [((g.float() - r).norm() / r.norm()).item()
                            for g, r in zip(grads, ref, strict=True)]
                    bad = [f"{x} {e:.2e}" for x, e in zip(("dq", "dk", "dv"), rels, strict=True)
                           if not math.isfinite(e) or e > 1e-2]
                    if bad:
                        print(f"{tag} {name}: WRONG ({', '.join(bad)} rel L2)")
                        continue
                    fns[name] = fn
                for peer in args.peers:
                    try:
                        fns[peer] = peer_bwd(peer, q, k, v, do, causal)
                        fns[peer]()
                    except Exception as e:  # noqa: BLE001
                        print(f"{peer}: {type(e).__name__}: {e}")
                        fns.pop(peer, None)
                print(f"{tag}: {tflops_rotated(fns, flops, args.rounds)}", flush=True)


if __name__ == "__main__":
    main()
