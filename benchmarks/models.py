"""Forward + backward of document packs and model-shaped problems: ours against flash-attn-4 and
SDPA (cuDNN; dense shapes only), in one process, the providers' order rotated over the rounds.

TFLOP/s over the visible (q, k) pairs, 4 * H * pairs * d forward, x 2.5 backward; each cell the
median over rounds of ``triton.testing.do_bench`` medians.

    python benchmarks/models.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import cute_flash

# (label, lens, heads, kv heads, d, causal): packs of documents, then dense batches as packs of
# equal lengths (SDPA runs those dense).
PACKS = [
    ("pack 9 docs 64-4096, 32/8, d128, causal", [2048, 64, 4096, 517, 1500, 3000, 900, 3100, 1160],
     32, 8, 128, True),
    ("pack [869, 1131, 460], 32/8, d128, causal", [869, 1131, 460], 32, 8, 128, True),
    ("pack 16 docs 1-2048, 16/16, d64, causal", None, 16, 16, 64, True),
    ("Llama-8B-like 1 x 8k, 32/8, d128, causal", [8192], 32, 8, 128, True),
    ("DiT 2 x 4608, 24/24, d128", [4608, 4608], 24, 24, 128, False),
    ("encoder 32 x 257, 16/16, d64", [257] * 32, 16, 16, 64, False),
]


def visible_pairs(lens: list[int], causal: bool) -> int:
    return sum(n * (n + 1) // 2 if causal else n * n for n in lens)


def providers(lens, h, hkv, d, causal):
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    total, mx = sum(lens), max(lens)
    q = torch.randn(total, h, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k = torch.randn(total, hkv, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    v = torch.randn(total, hkv, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dout = torch.randn_like(q)
    fns = {"ours": lambda: cute_flash.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal)}
    try:
        from flash_attn.cute import flash_attn_varlen_func as fa4

        def run_fa4():
            r = fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=mx, max_seqlen_k=mx,
                    causal=causal)
            return r[0] if isinstance(r, tuple) else r

        fns["fa4"] = run_fa4
    except ImportError:
        pass
    if len(set(lens)) == 1:  # equal lengths: SDPA on the dense (B, H, N, d) view
        b, n = len(lens), lens[0]
        qs, ks, vs = (t.view(b, n, t.shape[1], d).transpose(1, 2) for t in (q, k, v))

        def run_cudnn():
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=h != hkv)
            return o.transpose(1, 2).reshape(total, h, d)

        fns["sdpa-cudnn"] = run_cudnn
    return fns, (q, k, v), dout


def time_fwd_bwd(fn, leaves, dout):
    def step():
        out = fn()
        torch.autograd.grad(out, leaves, dout)
    return do_bench(step, warmup=50, rep=200, return_mode="median")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    rng = random.Random(0)
    rows = []
    for label, lens, h, hkv, d, causal in PACKS:
        if lens is None:
            lens = [rng.randint(1, 2048) for _ in range(16)]
        fns, leaves, dout = providers(lens, h, hkv, d, causal)
        flops = 4 * h * visible_pairs(lens, causal) * d * 3.5  # forward + backward (x 2.5)
        times: dict[str, list[float]] = {name: [] for name in fns}
        names = list(fns)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                try:
                    times[name].append(time_fwd_bwd(fns[name], leaves, dout))
                except Exception as e:  # a peer that does not take the problem
                    print(f"{label}: {name} failed: {type(e).__name__}: {str(e)[:120]}")
                    times[name] = []
                    names.remove(name)
                    break
        tf = {n: flops / statistics.median(t) / 1e9 for n, t in times.items() if t}
        rows.append((label, tf))
        print(label, {n: round(v) for n, v in tf.items()}, flush=True)
    print("\nfwd+bwd TFLOP/s (H200, bf16; median of rounds)")
    print("| problem | ours | flash-attn-4 | SDPA-cuDNN | ours/FA4 |\n|---|---|---|---|---|")
    for label, tf in rows:
        cells = [f"{tf[n]:.0f}" if n in tf else "-" for n in ("ours", "fa4", "sdpa-cudnn")]
        ratio = f"{tf['ours'] / tf['fa4']:.2f}" if "fa4" in tf and "ours" in tf else "-"
        print(f"| {label} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    main()
