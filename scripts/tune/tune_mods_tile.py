"""K/V block of the sm90 forward with a score_mod / mask_mod (developer tool): forward TFLOP/s of
``benchmarks/mods.py``'s problems (ALiBi, relative bias, prefix-LM, documents with their block
masks) with the mods' K/V block forced to each of ``--tile-n``, against the plain causal kernel, in
one process, order rotated over ``--rounds``; each candidate's output checked against the first's.
Usage: python scripts/tune/tune_mods_tile.py [--tile-n 96 128] [--rounds 3]"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

import cute_flash
from cute_flash import launch
from cute_flash.hopper import fwd_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import mods as bench  # noqa: E402  (benchmarks/mods.py: the problems)


def use_tile(tile_n: int | None) -> None:
    """Force the mods' K/V block of the configs planned from now on (None: the shipped table)."""
    fwd_config.SM90_MODS_TILE_N = tile_n or SHIPPED[0]
    fwd_config.SM90_MODS_BOTH_TILE_N = min(tile_n, SHIPPED[1]) if tile_n else SHIPPED[1]
    launch._FWD_KERNELS._data.clear()  # (the forward's memo of planned kernels)


SHIPPED = (fwd_config.SM90_MODS_TILE_N, fwd_config.SM90_MODS_BOTH_TILE_N)


def _call(q, k, v, kw: dict):
    return lambda: cute_flash.flash_attn_func(q, k, v, **kw)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tile-n", type=int, nargs="+", default=[96, 128])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    for name, n, kw, _, pairs, _ in bench.problems():
        q, k, v = (torch.randn(1, n, bench.H, bench.D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        kw = dict(kw)
        block = kw.pop("block", None)
        if block is not None:
            kw["block_mask"] = cute_flash.create_block_mask(kw["mask_mod"], block[0], None, n, n,
                                                            device="cuda", aux=kw["aux"])
        first = None
        cands = [*args.tile_n, "plain causal"]
        times: dict = {c: [] for c in cands}
        for r in range(args.rounds):
            for c in cands[r % len(cands):] + cands[:r % len(cands)]:
                use_tile(c if isinstance(c, int) else None)
                call_kw = dict(causal=True) if c == "plain causal" else kw
                with torch.no_grad():
                    out = cute_flash.flash_attn_func(q, k, v, **call_kw)
                    if c != "plain causal":
                        first = out if first is None else first
                        assert (out.float() - first.float()).abs().max().item() < 2e-2, (name, c)
                    fn = _call(q, k, v, call_kw)
                    times[c].append(bench._bench(fn))
        use_tile(None)
        flops = 4 * bench.H * pairs * bench.D
        print(f"{name}: " + "  ".join(f"{c if isinstance(c, str) else f'tile_n {c}'} "
                                      f"{flops / (statistics.median(t) * 1e-3) / 1e12:.0f}"
                                      for c, t in times.items()) + " TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
