"""Programmable attention, forward and backward: our kernels with a score_mod / mask_mod compiled in
(through ``flash_attn_func``, with a block mask where there is a mask_mod), against FlexAttention
(``torch.nn.attention.flex_attention``, compiled, with its block mask), flash-attn-4's score_mods
where it has ours, our plain causal kernel and, for documents, our varlen path over the same
documents; every provider in one process,
order rotated over ``--rounds``.

Problems (H 16, d 128, bf16): ALiBi, a relative-position bias table and prefix-LM on causal 8k
(B 1), and causal document masking of a 16k pack of 9 documents. TFLOP/s over the visible pairs
(forward 4 * H * pairs * d, backward 2.5 times that; the backward's time is forward + backward
less the forward).

    python benchmarks/mods.py [--rounds 3] [--out DIR] [--only documents ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

import cute_flash
from cute_flash.device import mods as m

H, D = 16, 128


def _bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def _timed(call, leaves, dout):
    """(forward, forward + backward) closures of ``call()``, which returns the output."""
    def fwd():
        with torch.no_grad():
            call()

    def fwd_bwd():
        for t in leaves:
            t.grad = None
        out = call()
        (out[0] if isinstance(out, tuple) else out).backward(dout)  # (flash-attn-4: (out, lse))
    return fwd, fwd_bwd


def _flex(q, k, v, dout, score_mod, mask_mod, n):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention)
    block = None
    if mask_mod is not None:
        block = create_block_mask(mask_mod, q.shape[0], None, n, n, device="cuda")
    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    dt = dout.transpose(1, 2)
    return _timed(lambda: compiled(qt, kt, vt, score_mod=score_mod, block_mask=block), (qt, kt, vt), dt)


def _fa4_mods():
    """flash-attn-4's form of the ALiBi and relative-bias score_mods (TensorSSA values; aux reads
    through one-element fragments, as its own tests write them), with their derivatives."""
    import cutlass
    import cutlass.cute as cute

    def gather(t, *idx):
        frags = []
        for i in idx:
            f = cute.make_rmem_tensor(1, cutlass.Int32)
            f.store(i)
            frags.append(f[0])
        val = cute.make_rmem_tensor(1, cutlass.Float32)
        val[0] = t[tuple(frags) if len(frags) > 1 else frags[0]]
        return val.load()

    @cute.jit
    def alibi(s, b, h, q_idx, kv_idx, seqlen_info=None, aux_tensors=None):
        return s + gather(aux_tensors[0], h) * (kv_idx - q_idx).to(cutlass.Float32)

    @cute.jit
    def identity_bwd(g, s, b, h, q_idx, kv_idx, seqlen_info=None, aux_tensors=None):
        return g

    @cute.jit
    def rel(s, b, h, q_idx, kv_idx, seqlen_info=None, aux_tensors=None):
        d = kv_idx - q_idx
        d = cute.where(d > cute.full_like(d, 128), cute.full_like(d, 128), d)
        d = cute.where(d < cute.full_like(d, -128), cute.full_like(d, -128), d)
        return s + gather(aux_tensors[0], h, d + cute.full_like(d, 128))

    return {"alibi": (alibi, identity_bwd), "relative bias": (rel, identity_bwd)}


def _fa4(q, k, v, dout, kind: str | None, aux: tuple):
    """flash-attn-4 with its score_mod (causal), where it has our problem's mod; else None."""
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except ImportError:
        return None
    mods = _fa4_mods().get(kind)
    if mods is None:
        return None
    return _timed(lambda: fa4(q, k, v, causal=True, score_mod=mods[0], score_mod_bwd=mods[1],
                              aux_tensors=list(aux)), (q, k, v), dout)


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

    doc = m.document()
    return [
        # name, N, our call's keywords, (flex score_mod, flex mask_mod), pairs, document lengths
        ("alibi causal 8k", n_causal, dict(score_mod=m.alibi(), aux=(slopes,), causal=True),
         (flex_alibi, flex_causal), causal_pairs, None),
        ("relative bias causal 8k", n_causal, dict(score_mod=m.relative_bias(128), aux=(table,), causal=True),
         (flex_rel, flex_causal), causal_pairs, None),
        ("prefix-LM 8k", n_causal, dict(mask_mod=m.prefix_lm(), aux=(prefix,), block=(1, n_causal)),
         (None, flex_prefix), causal_pairs, None),
        ("documents 16k (9, causal)", n_docs, dict(mask_mod=doc, aux=(ids,), causal=True, block=(1, n_docs)),
         (None, flex_doc), doc_pairs, lens),
    ]


def providers(name: str, n: int, kw: dict, f_score, f_mask, lens) -> dict:
    q, k, v = (torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    dout = torch.randn_like(q)
    kw = dict(kw)
    block = kw.pop("block", None)
    if block is not None:
        kw["block_mask"] = cute_flash.create_block_mask(kw["mask_mod"], block[0], None, block[1], block[1],
                                                        device="cuda", aux=kw["aux"])
    fns = {
        "ours": _timed(lambda: cute_flash.flash_attn_func(q, k, v, **kw), (q, k, v), dout),
        "ours plain causal": _timed(lambda: cute_flash.flash_attn_func(q, k, v, causal=True), (q, k, v),
                                    dout),
        "flex": _flex(q, k, v, dout, f_score, f_mask, n),
    }
    kind = next((x for x in ("alibi", "relative bias") if x in name), None)
    fa4 = _fa4(q, k, v, dout, kind, kw.get("aux", ()))
    if fa4 is not None:
        fns["flash-attn-4"] = fa4
    if lens is not None:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        qp, kp, vp = (t.detach()[0].requires_grad_() for t in (q, k, v))
        mx = max(lens)
        fns["ours varlen"] = _timed(
            lambda: cute_flash.flash_attn_varlen_func(qp, kp, vp, cu, cu, mx, mx, causal=True), (qp, kp, vp),
            dout[0])
    return fns


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="mods_out")
    ap.add_argument("--only", nargs="*", default=[], help="problems whose names contain one of these")
    args = ap.parse_args()
    rows = []
    for name, n, kw, (f_score, f_mask), pairs, lens in problems():
        if args.only and not any(o in name for o in args.only):
            continue
        fns = providers(name, n, kw, f_score, f_mask, lens)
        times: dict[str, dict[str, list[float]]] = {p: {"fwd": [], "fwd_bwd": []} for p in fns}
        names = list(fns)
        for r in range(args.rounds):
            for p in names[r % len(names):] + names[:r % len(names)]:
                times[p]["fwd"].append(_bench(fns[p][0]))
                times[p]["fwd_bwd"].append(_bench(fns[p][1]))
        flops = 4 * H * pairs * D
        row = {"problem": name}
        for p, t in times.items():
            f_ms, fb_ms = statistics.median(t["fwd"]), statistics.median(t["fwd_bwd"])
            row[p] = {"fwd": flops / (f_ms * 1e-3) / 1e12,
                      "bwd": 2.5 * flops / (max(fb_ms - f_ms, 1e-6) * 1e-3) / 1e12}
        rows.append(row)
        print(f"{name}: " + "  ".join(f"{p} {row[p]['fwd']:.0f}/{row[p]['bwd']:.0f}" for p in names)
              + " TFLOP/s (fwd/bwd)", flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "mods.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
