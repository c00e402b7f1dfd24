"""Programmable attention, forward: our kernels with a score_mod / mask_mod compiled in, against
FlexAttention (``torch.nn.attention.flex_attention``, compiled, with its block mask) and our plain
causal kernel, every provider in one process, order rotated over ``--rounds``.

Problems (H 16, d 128, bf16): ALiBi, a relative-position bias table and prefix-LM on causal 8k
(B 1), and document masking of a 16k pack of 9 documents. TFLOP/s over the visible pairs
(4 * H * pairs * d); the mods' problems count the causal pairs (documents: the pairs within
documents).

    python benchmarks/mods.py [--rounds 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from cute_flash import launch
from cute_flash.device import mods as m

H, D = 16, 128


def _bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def _flex(q, k, v, score_mod, mask_mod, n):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    block = None
    if mask_mod is not None:
        block = create_block_mask(mask_mod, q.shape[0], None, n, n, device="cuda")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    return lambda: compiled(qt, kt, vt, score_mod=score_mod, block_mask=block)


def problems(n_causal: int = 8192, n_docs: int = 16384):
    dev = "cuda"
    slopes = torch.tensor([2 ** (-8 * (i + 1) / H) for i in range(H)], device=dev)
    table = torch.randn(H, 2 * 128 + 1, device=dev) * 0.1
    lens = [1024, 3000, 512, 2048, 4096, 777, 1500, 2000, 1427]
    lens[-1] += n_docs - sum(lens)
    ids = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
    ids = ids.to(torch.int32).view(1, -1)
    prefix = torch.tensor([1024], dtype=torch.int32, device=dev)
    causal_pairs = n_causal * (n_causal + 1) // 2
    doc_pairs = sum(x * (x + 1) // 2 for x in lens)

    def flex_alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    def flex_rel(score, b, h, q_idx, kv_idx):
        return score + table[h, (kv_idx - q_idx).clamp(-128, 128) + 128]

    def flex_causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    def flex_prefix(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) | (kv_idx < prefix[b])

    def flex_doc(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)

    alibi_dsl = m.alibi()[0]
    rel_dsl, prefix_dsl = m.relative_bias(128)[0], m.prefix_lm()[0]
    doc_dsl = _doc_causal()
    return [
        # name, N, (our Mods, aux, plain causal flag), (flex score_mod, flex mask_mod), pairs
        ("alibi causal 8k", n_causal, (m.Mods(score_mod=alibi_dsl, aux=(("fp32", 1),)), (slopes,), True),
         (flex_alibi, flex_causal), causal_pairs),
        ("relative bias causal 8k", n_causal, (m.Mods(score_mod=rel_dsl, aux=(("fp32", 2),)), (table,), True),
         (flex_rel, flex_causal), causal_pairs),
        ("prefix-LM 8k", n_causal, (m.Mods(mask_mod=prefix_dsl, aux=(("int32", 1),)), (prefix,), False),
         (None, flex_prefix), causal_pairs),
        ("documents 16k (9, causal)", n_docs, (m.Mods(mask_mod=doc_dsl, aux=(("int32", 2),)), (ids,), True),
         (None, flex_doc), doc_pairs),
    ]


def _doc_causal():
    import cutlass.cute as cute

    @cute.jit
    def mask_mod(b, h, q_idx, kv_idx, aux):
        return aux[0][b, q_idx] == aux[0][b, kv_idx]
    del cute
    return mask_mod


def providers(n: int, mods, aux: tuple, causal: bool, f_score, f_mask) -> dict:
    q, k, v = (torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(1, H, n, device="cuda")
    scale = 1.0 / math.sqrt(D)
    return {
        "ours": lambda: launch.run_fwd(q, k, v, out, lse, softmax_scale=scale, causal=causal, mods=mods,
                                       aux=aux),
        "ours plain causal": lambda: launch.run_fwd(q, k, v, out, lse, softmax_scale=scale, causal=True),
        "flex": _flex(q, k, v, f_score, f_mask, n),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="mods_out")
    args = ap.parse_args()
    rows = []
    for name, n, (mods, aux, causal), (f_score, f_mask), pairs in problems():
        fns = providers(n, mods, aux, causal, f_score, f_mask)
        times: dict[str, list[float]] = {p: [] for p in fns}
        names = list(fns)
        for r in range(args.rounds):
            for p in names[r % len(names):] + names[:r % len(names)]:
                times[p].append(_bench(fns[p]))
        flops = 4 * H * pairs * D
        row = {"problem": name, **{p: flops / (statistics.median(t) * 1e-3) / 1e12 for p, t in times.items()}}
        rows.append(row)
        print(f"{name}: " + "  ".join(f"{p} {row[p]:.0f}" for p in names) + " TFLOP/s", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "mods.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
