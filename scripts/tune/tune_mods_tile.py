"""Tiles and switches of the sm90 kernels with a score_mod / mask_mod (developer tool): forward and
backward TFLOP/s of ``benchmarks/mods.py``'s problems (ALiBi, relative bias, prefix-LM, documents
with their block masks) with the planned variants' fields overridden by each ``--variant``
(``field=value`` pairs, comma-separated, ``bwd.`` before a backward field; ``shipped``: the plans
as they are), against the plain causal kernels, in one process, order rotated over ``--rounds``;
each variant's output checked against the first's.
Usage: python scripts/tune/tune_mods_tile.py [--variant shipped tile_n=96 bwd.mask_always=0]"""

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

import cute_flash
from cute_flash import launch
from cute_flash.hopper import bwd_config, fwd_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import mods as bench  # noqa: E402  (benchmarks/mods.py: the problems)

_PLAN, _BWD_PLAN = fwd_config.plan, bwd_config.plan
_SWITCHES = ("pingpong", "mask_always", "prefetch_stats")


def parse(variant: str) -> dict:
    if variant == "shipped":
        return {}
    pairs = (f.split("=") for f in variant.split(","))
    return {k: bool(int(v)) if k.split(".")[-1] in _SWITCHES else int(v) for k, v in pairs}


def use(fields: dict) -> None:
    """Plan the kernels from now on with ``fields`` overridden (for calls with mods only)."""
    fwd = {k: v for k, v in fields.items() if not k.startswith("bwd.")}
    bwd = tuple(sorted((k[4:], v) for k, v in fields.items() if k.startswith("bwd.")))

    def plan(p):
        cfg = _PLAN(p)
        return replace(cfg, **fwd) if fwd and p.mods is not None else cfg

    def bwd_plan(p, overrides=()):
        return _BWD_PLAN(p, tuple(sorted({**dict(overrides), **dict(bwd)}.items())) if p.mods else overrides)
    fwd_config.plan, bwd_config.plan = plan, bwd_plan
    launch._FWD_KERNELS._data.clear()  # (the planned kernels' memos)
    launch._bwd_kernels.cache_clear()


def _call(q, k, v, kw: dict):
    return lambda: cute_flash.flash_attn_func(q, k, v, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", nargs="+", default=["shipped", "tile_n=96", "tile_n=128"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=[], help="problems whose names contain one of these")
    args = ap.parse_args()
    for name, n, kw, _, pairs, _ in bench.problems():
        if args.only and not any(o in name for o in args.only):
            continue
        q, k, v = (torch.randn(1, n, bench.H, bench.D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn_like(q)
        kw = dict(kw)
        block = kw.pop("block", None)
        if block is not None:
            kw["block_mask"] = cute_flash.create_block_mask(kw["mask_mod"], block[0], None, n, n,
                                                            device="cuda", aux=kw["aux"])
        first = None
        cands = [*args.variant, "plain causal"]
        times: dict = {c: ([], []) for c in cands}
        for r in range(args.rounds):
            for c in cands[r % len(cands):] + cands[:r % len(cands)]:
                use(parse(c) if c != "plain causal" else {})
                call_kw = dict(causal=True) if c == "plain causal" else kw
                with torch.no_grad():
                    out = cute_flash.flash_attn_func(q, k, v, **call_kw)
                    if c != "plain causal":
                        first = out if first is None else first
                        assert (out.float() - first.float()).abs().max().item() < 2e-2, (name, c)
                fwd, fwd_bwd = bench._timed(_call(q, k, v, call_kw), (q, k, v), dout)
                times[c][0].append(bench._bench(fwd))
                times[c][1].append(bench._bench(fwd_bwd))
        use({})
        flops = 4 * bench.H * pairs * bench.D
        for c, (f, fb) in times.items():
            f_ms, fb_ms = statistics.median(f), statistics.median(fb)
            print(f"{name}: {c}: fwd {flops / f_ms / 1e9:.0f} bwd {2.5 * flops / (fb_ms - f_ms) / 1e9:.0f} "
                  "TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
