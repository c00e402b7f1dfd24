"""FP8 forward tile / schedule candidates on the GPU: TFLOP/s of each
``FwdSm90Fp8Config`` override set beside the shipped default and our bf16 forward, rounds
rotated so clock drift does not favour one candidate. Each candidate's output is checked against
a bf16 SDPA of the dequantized inputs; one whose error exceeds 1.5x the default's is
flagged WRONG and not timed.

    python scripts/tune/tune_fp8.py --hdim 128 --seqlen 8192 16384 --causal 0 1 \\
        --variant "tile_n=192" "tile_n=224" "pingpong=1"
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
import triton.testing

from cute_flash.launch import quantize_qkv, run_fwd, run_fwd_fp8

BOOL_FIELDS = ("pingpong", "rescale_o_early", "seed_row_sum", "spin_waits", "v_perm", "sum_mma",
               "dynamic_tiles", "exp_bytes")


def parse(var: str) -> dict:
    out = {}
    for kv in filter(None, var.split(",")):
        k, v = kv.split("=")
        out[k] = bool(int(v)) if k in BOOL_FIELDS else int(v)
    return out


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def reference(t8, causal: bool) -> torch.Tensor:
    """Attention of the dequantized e4m3 inputs (rotation leaves Q K^T unchanged) by SDPA in bf16:
    its error (~4e-3) is well below FP8's, and an fp32 SDPA at 16k keys takes minutes."""
    q8, k8, v8, qd, kd, vd = t8
    b, hkv = qd.shape
    deq = [(x.float() * s.view(b, 1, hkv, 1).repeat_interleave(x.shape[2] // hkv, 2)).bfloat16()
           for x, s in ((q8, qd), (k8, kd), (v8, vd))]
    deq = [x.transpose(1, 2) for x in deq]
    return torch.nn.functional.scaled_dot_product_attention(*deq, is_causal=causal).transpose(1, 2).float()


def measure(d: int, n: int, causal: bool, variants: list[str], rounds: int) -> None:
    b, h = max(1, 16384 // n), 2048 // d
    g = torch.Generator(device="cuda").manual_seed(n + d)
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    t8 = quantize_qkv(q, k, v, rotate=True)
    t8p = quantize_qkv(q, k, v, rotate=True, v_perm=True)  # for candidates with v_perm=1
    scale = 1.0 / math.sqrt(d)
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    ref = reference(t8, causal)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, n, device="cuda")
    tag = f"d{d} N={n} causal={int(causal)}"
    fns = {"bf16": lambda: run_fwd(q, k, v, out, lse, softmax_scale=scale, causal=causal,
                                   window_size=(-1, -1), softcap=0.0)}
    errs: dict[str, float] = {}
    for var in ["", *variants]:
        kw = parse(var)

        def fn(kw=kw):
            inputs = t8p if kw.get("v_perm") else t8
            run_fwd_fp8(*inputs, out, lse, softmax_scale=scale, causal=causal, **kw)

        try:
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            errs[var] = ((out.float() - ref).norm() / ref.norm()).item()
        except Exception as e:  # noqa: BLE001 - a candidate that does not build is reported
            print(f"{tag} [{var or 'default'}]: ERROR {str(e)[:200]}", flush=True)
            continue
        if not math.isfinite(errs[var]) or errs[var] > 1.5 * errs.get("", errs[var]) + 1e-4:
            print(f"{tag} [{var}]: WRONG rel err {errs[var]:.3e} (default {errs.get('', 0):.3e})", flush=True)
            continue
        fns[var or "default"] = fn
    times: dict[str, list[float]] = {x: [] for x in fns}
    names = list(fns)
    for r in range(rounds):
        for x in names[r % len(names):] + names[:r % len(names)]:
            times[x].append(bench(fns[x]))
    tf = {x: flops / statistics.median(t) / 1e9 for x, t in times.items()}
    line = "  ".join(f"[{x}] {v:.0f}" for x, v in tf.items())
    print(f"{tag} err {errs.get('', float('nan')):.2e}: {line}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[8192])
    ap.add_argument("--causal", type=int, nargs="+", default=[0])
    ap.add_argument("--variant", nargs="*", default=[])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for d in args.hdim:
        for n in args.seqlen:
            for causal in map(bool, args.causal):
                measure(d, n, causal, args.variant, args.rounds)


if __name__ == "__main__":
    main()
