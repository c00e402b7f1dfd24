"""Decoding over a KV cache, every provider in one process: TB/s of KV read for ours
(``flash_attn_with_kvcache``) and flash-attn-4's KV-cache path (``seqused_k`` / ``page_table``
of its forward, where it takes the problem on this GPU), beside the device's copy ceiling.

Shapes: GQA 32 / 8, d 128, one query token per sequence; B in {1, 8, 64} and 1k-128k cached keys
per sequence; a contiguous cache and paged ones (``--page-sizes``). KV bytes read =
B * keys * H_kv * (d + d_v) * 2. Every call is captured in a CUDA graph and the graph replays are
timed (``triton.testing.do_bench`` medians; the providers' order rotated over ``--rounds``), so
host overhead does not count for either side. ``ours+append`` also appends one new token with
rotary at each step (what a serving loop runs); the other columns attend over the cache only.
``ours-e4m3`` reads the same cache stored as e4m3 with descales (its TB/s counts e4m3 bytes; page
sizes the TMA boxes take only).

    python benchmarks/decode.py [--rounds 3] [--page-sizes 1 64 256] [--splits 1 4 16 32] [--out DIR]

Writes ``decode.json`` and ``decode.md`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

import cute_flash

H, HKV, D = 32, 8, 128
BATCHES = (1, 8, 64)
KEYS = (1024, 4096, 16384, 32768, 131072)
MAX_CACHE_BYTES = 40 * 2**30  # per K and V together: B = 64 stops at 32k keys


def _bench(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=80, return_mode="median")


def copy_ceiling_tbps() -> float:
    """Device-to-device copy of 4 GiB: bytes read + written per second."""
    src = torch.empty(2**30, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e12


def _graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (after an eager warm-up), or ``fn`` where capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception:  # noqa: BLE001 (a provider that cannot be captured is timed eagerly)
        torch.cuda.synchronize()
        return fn
    return graph.replay


def _cache(batch: int, keys: int, page_size: int):
    """k / v caches (contiguous, or pages in shuffled order with a page table) and lengths."""
    dt, dev = torch.bfloat16, "cuda"
    capacity = keys + 256  # room for the appended tokens
    if page_size:
        per_seq = -(-capacity // page_size)
        k = torch.randn(batch * per_seq, page_size, HKV, D, dtype=dt, device=dev)
        table = torch.randperm(batch * per_seq, device=dev).reshape(batch, per_seq).to(torch.int32)
    else:
        k = torch.randn(batch, capacity, HKV, D, dtype=dt, device=dev)
        table = None
    lens = torch.full((batch,), keys, dtype=torch.int32, device=dev)
    return k, torch.randn_like(k), table, lens


def providers(batch: int, keys: int, page_size: int,
              splits: list[int]) -> tuple[dict[str, Callable[[], object]], str]:
    """The timed calls by name, and how flash-attn-4 ran ("own splits", "unsplit" or "")."""
    k_cache, v_cache, table, lens = _cache(batch, keys, page_size)
    q = torch.randn(batch, 1, H, D, dtype=torch.bfloat16, device="cuda")
    new_k = torch.randn(batch, 1, HKV, D, dtype=torch.bfloat16, device="cuda")
    new_v = torch.randn_like(new_k)
    angle = torch.rand(keys + 512, D // 2, device="cuda")
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    fns: dict[str, Callable[[], object]] = {
        "ours": lambda: cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                                           page_table=table, causal=True),
        "ours+append": lambda: cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, new_k, new_v, cos, sin,
                                                                  cache_seqlens=lens, page_table=table,
                                                                  causal=True),
    }
    if page_size % 16 == 0:
        k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        ones = torch.ones(batch, HKV, device="cuda")
        fns["ours-e4m3"] = lambda: cute_flash.flash_attn_with_kvcache(
            q, k8, v8, cache_seqlens=lens, page_table=table, causal=True, k_descale=ones, v_descale=ones)
    for n in splits:  # forced split counts (the plan's rule is ``ours``)
        fns[f"ours-s{n}"] = (lambda n=n: cute_flash.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens, page_table=table, causal=True, num_splits=n))
    fa4_mode = ""
    try:
        from flash_attn.cute import interface as fa4

        def fa4_call(splits: int) -> Callable[[], object]:
            return lambda: fa4._flash_attn_fwd(q, k_cache, v_cache, seqused_k=lens, page_table=table,
                                               causal=True, num_splits=splits)

        # Its own split choice; where it refuses to split on this GPU, one split.
        for splits in (0, 1):
            try:
                fa4_call(splits)()
                fns["fa4"] = fa4_call(splits)
                fa4_mode = "unsplit" if splits else "own splits"
                break
            except AssertionError as e:
                print(f"  fa4 num_splits={splits} refused B={batch} keys={keys} page={page_size}: "
                      f"{str(e)[:100]}")
    except Exception as e:  # noqa: BLE001 (a provider that refuses the problem leaves a blank cell)
        print(f"  fa4 refused B={batch} keys={keys} page={page_size}: {type(e).__name__}: {str(e)[:120]}")
    return {name: _graphed(fn) for name, fn in fns.items()}, fa4_mode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--page-sizes", type=int, nargs="*", default=[1, 64, 256])
    ap.add_argument("--keys", type=int, nargs="*", default=list(KEYS))
    ap.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    ap.add_argument("--splits", type=int, nargs="*", default=[],
                    help="also time these forced split counts (the split rule's measurement)")
    ap.add_argument("--out", default="decode_out")
    args = ap.parse_args()
    ceiling = copy_ceiling_tbps()
    print(f"copy ceiling: {ceiling:.2f} TB/s")
    rows = []
    for page_size in [0, *args.page_sizes]:
        for batch in args.batches:
            for keys in args.keys:
                if batch * keys * HKV * D * 2 * 2 > MAX_CACHE_BYTES:
                    continue
                fns, fa4_mode = providers(batch, keys, page_size, args.splits)
                names = list(fns)
                times: dict[str, list[float]] = {n: [] for n in names}
                for r in range(args.rounds):
                    for n in names[r % len(names):] + names[:r % len(names)]:
                        times[n].append(_bench(fns[n]))
                kv_bytes = batch * keys * HKV * 2 * D * 2
                row = {"batch": batch, "keys": keys, "page_size": page_size, "fa4_mode": fa4_mode}
                for n in names:
                    ms = statistics.median(times[n])
                    read = kv_bytes // 2 if n == "ours-e4m3" else kv_bytes
                    row[n] = {"ms": ms, "tbps": read / (ms * 1e-3) / 1e12}
                rows.append(row)
                cells = "  ".join(f"{n} {row[n]['tbps']:.2f}" for n in names)
                print(f"B={batch:3d} keys={keys:6d} page={page_size:3d}: {cells} TB/s")
                del fns
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps({"copy_ceiling_tbps": ceiling, "rows": rows}, indent=1))
    lines = [f"Copy ceiling {ceiling:.2f} TB/s. KV read, TB/s (ours / flash-attn-4 ratio).", "",
             "| B | keys | page | ours | ours+append | fa4 | fa4 ran | ours / fa4 | e4m3 cache "
             "| e4m3 time / ours |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fa4 = r.get("fa4", {}).get("tbps")
        ratio = f"{r['ours']['tbps'] / fa4:.2f}" if fa4 else ""
        f8 = r.get("ours-e4m3")
        f8_cells = f"{f8['tbps']:.2f} | {f8['ms'] / r['ours']['ms']:.2f}" if f8 else " | "
        fa4_cell = f"{fa4:.2f}" if fa4 else ""
        lines.append(f"| {r['batch']} | {r['keys']} | {r['page_size'] or '-'} | {r['ours']['tbps']:.2f} | "
                     f"{r['ours+append']['tbps']:.2f} | {fa4_cell} | {r['fa4_mode']} | {ratio} | "
                     f"{f8_cells} |")
    (out / "decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
