"""sm90 forward variants on the GPU (developer tool): TFLOP/s of each (ping-pong, intra-warpgroup
overlap, tile) candidate beside cuDNN and flash-attn-4 in the same run, each output checked
against SDPA-flash's (relative L2; a wrong variant is flagged, not timed as if it were right).

    python scripts/tune/tune_sm90.py [--hdim 64 128 256] [--seqlen 8192] [--causal 0 1]
                                     [--tiles d:tm,tn,st ...]
"""

import argparse
import math

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from cute_flash import jit, launch
from cute_flash.hopper.fwd_config import FwdSm90Config

SWITCHES = [False, True]  # ping-pong off / on


def sdpa(backend, q, k, v, causal):
    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", type=int, nargs="+", default=[128])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[8192])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--tiles", nargs="*", default=[], help="extra d:tile_m,tile_n,stages candidates")
    ap.add_argument("--switches", default="all", choices=["all", "best", "default"])
    ap.add_argument("--set", nargs="*", default=[],
                    help="extra FwdSm90Config fields, name=0|1; name=0,1 times both values side by side")
    ap.add_argument("--variant", nargs="*", default=[],
                    help="explicit field sets instead of --set products, e.g. 'seed_row_sum=1,pingpong=0'")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--l2", type=int, nargs="+", default=[-1], help="l2_sections values (-1: default)")
    args = ap.parse_args()
    extra: dict[int, list[tuple[int, int, int]]] = {}
    for t in args.tiles:
        d, rest = t.split(":")
        extra.setdefault(int(d), []).append(tuple(int(x) for x in rest.split(",")))
    # Every combination of the --set values: "a=0,1 b=1" gives {a:0,b:1} and {a:1,b:1}.
    field_sets: list[dict[str, int]] = [{}]
    for a in args.set:
        name, values = a.split("=")
        field_sets = [{**f, name: int(v)} for f in field_sets for v in values.split(",")]
    if args.variant:
        field_sets = [{k: int(v) for k, v in (kv.split("=") for kv in var.split(",") if kv)}
                      for var in args.variant]
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception:  # noqa: BLE001 - absent peer is just skipped
        fa4 = None
    for d in args.hdim:
        for n in args.seqlen:
            b, h = max(1, 16384 // n), 2048 // d
            g = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
                       for _ in range(3))
            for causal in map(bool, args.causal):
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                ref = sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal).float()
                qkv = (q, k, v)
                # (label, fn): peers and checked variants, timed together below.
                cands = [("cudnn", lambda c=causal, t=qkv: sdpa(SDPBackend.CUDNN_ATTENTION, *t, c))]
                if fa4 is not None:
                    cands.append(("fa4", lambda c=causal, t=qkv: fa4(*t, causal=c)))
                tiles = [None] + extra.get(d, [])
                for tile in tiles:
                    # Ping-pong on and off for the default tile, the table's choice for extra tiles.
                    switches = SWITCHES if args.switches == "all" and tile is None else [None]
                    if args.switches == "default":  # the shipped table's choice for this head dim
                        switches = [None]
                    for pp, l2, fields in ((sw, l2, f) for sw in switches for l2 in args.l2
                                           for f in field_sets):
                        kw = dict(tile_m=tile[0], tile_n=tile[1], stages=tile[2]) if tile else {}
                        if l2 >= 0:
                            kw["l2_sections"] = bool(l2)
                        kw.update(fields)
                        tag = (f"tile={tile or 'default'} pp={pp} l2={l2} "
                               f"{' '.join(f'{k}={int(v)}' for k, v in fields.items())}")
                        try:
                            kw.setdefault("pingpong", pp)
                            cfg = FwdSm90Config(target=None, dtype="bf16", hdim=d, hdim_v=d, causal=causal,
                                                **kw)
                            kern = jit.compile_kernel(cfg)
                        except Exception as e:  # noqa: BLE001
                            print(f"  {tag}: compile failed {e!r:.300}", flush=True)
                            continue
                        out = torch.full_like(q, float("nan"))
                        lse = torch.empty(b, h, n, device="cuda", dtype=torch.float32)
                        call = (q, k, v, out, lse, None, None, 1.0 / math.sqrt(d), 0.0, -1, -1, n)
                        kern(*call, launch.tile_counter(cfg, q.device), *[None] * 5)
                        torch.cuda.synchronize()
                        err = float((out.float() - ref).norm() / ref.norm())
                        if not err < 2e-2:
                            print(f"  {tag}: WRONG rel-L2 {err:.3g}", flush=True)
                            continue
                        cands.append((tag, lambda kern=kern, call=call, cfg=cfg, dev=q.device:
                                      kern(*call, launch.tile_counter(cfg, dev), *[None] * 5)))
                # Clocks drift by a few percent within a run (power and heat): time every
                # candidate in ``rounds`` interleaved passes, rotating the order so no candidate
                # always runs first or last, and report each one's best and every pass.
                times: dict[str, list[float]] = {label: [] for label, _ in cands}
                for r in range(args.rounds):
                    shift = r % len(cands)
                    for label, fn in cands[shift:] + cands[:shift]:
                        try:
                            times[label].append(bench(fn))
                        except Exception as e:  # noqa: BLE001
                            print(f"  {label}: error {type(e).__name__}", flush=True)
                print(f"d={d} N={n} causal={int(causal)}", flush=True)
                for label, ts in times.items():
                    if ts:
                        passes = " ".join(f"{flops / t / 1e9:.0f}" for t in ts)
                        best = flops / min(ts) / 1e9
                        print(f"  {label}: {best:.0f} TFLOP/s  (passes: {passes})", flush=True)


if __name__ == "__main__":
    main()
