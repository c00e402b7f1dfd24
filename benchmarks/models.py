"""Attention on the shapes models run, every provider in one process: ours, flash-attn-4, SDPA's
cuDNN and flash backends (where they take the problem), forward and backward timed separately.

Classes: GQA / MQA training and prefill (groups 4 and 8, d 64 / 128 / 256, B 1-4, N 2k-32k,
causal), DiT (non-causal, head counts that are not powers of two), encoders (N 197-1024, large
batches), chunked prefill (Nq << Nk), sliding windows, softcap, packed documents of mixed lengths,
and lengths that are no multiple of any tile.

TFLOP/s over the visible (q, k) pairs: 4 * H * pairs * d forward, x 2.5 backward (the backward
timed alone, on one saved graph). Each cell is the median over ``--rounds`` passes, the providers'
order rotated each pass, of ``triton.testing.do_bench`` medians. A provider that refuses a problem
leaves a blank cell.

    python benchmarks/models.py [--rounds 3] [--only gqa dit ...] [--out DIR]

Writes ``models.json`` (rows of problem / provider / direction / tflops, the format
``benchmarks/plot.py`` reads) and ``models.md`` under ``--out``, and prints the table.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import cute_flash

PROVIDERS = ("ours", "fa4", "sdpa-cudnn", "sdpa-flash")


@dataclass(frozen=True)
class Shape:
    """One problem: dense (B, Nq / Nk) or packed (``lens``: one (q, k) length pair per document)."""

    label: str
    group: str
    heads: int
    kv_heads: int
    d: int
    causal: bool = False
    batch: int = 1
    nq: int = 0
    nk: int = 0
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    lens: tuple[tuple[int, int], ...] = field(default=())

    @property
    def varlen(self) -> bool:
        return bool(self.lens)

    def visible_pairs(self) -> int:
        docs = self.lens or ((self.nq, self.nk),) * self.batch
        return sum(_pairs(nq, nk, self.causal, self.window) for nq, nk in docs)


def _pairs(nq: int, nk: int, causal: bool, window: tuple[int, int]) -> int:
    """Visible (q, k) pairs under bottom-right aligned masks (flash-attn's convention)."""
    left, right = window
    if causal:
        right = 0
    total = 0
    for i in range(nq):
        diag = i + nk - nq
        lo = 0 if left < 0 else max(0, diag - left)
        hi = nk - 1 if right < 0 else min(nk - 1, diag + right)
        total += max(0, hi - lo + 1)
    return total


def _docs(rng: random.Random, n: int, lo: int, hi: int) -> tuple[tuple[int, int], ...]:
    return tuple((x, x) for x in (rng.randint(lo, hi) for _ in range(n)))


def shapes() -> list[Shape]:
    rng = random.Random(0)
    return [
        Shape("Llama-8B prefill/train: 32/8, d128, 1 x 8k causal", "gqa", 32, 8, 128, True, 1, 8192, 8192),
        Shape("70B-like train: 64/8, d128, 2 x 4k causal", "gqa", 64, 8, 128, True, 2, 4096, 4096),
        Shape("GQA 16/4, d128, 2 x 8k causal", "gqa", 16, 4, 128, True, 2, 8192, 8192),
        Shape("GQA 32/8, d128, 4 x 2k causal", "gqa", 32, 8, 128, True, 4, 2048, 2048),
        Shape("GQA 40/8, d128, 1 x 32k causal (prefill)", "gqa", 40, 8, 128, True, 1, 32768, 32768),
        Shape("GQA 32/4, d64, 2 x 8k causal", "gqa", 32, 4, 64, True, 2, 8192, 8192),
        Shape("GQA 16/8, d256, softcap 50, 1 x 8k causal", "softcap", 16, 8, 256, True, 1, 8192, 8192,
              softcap=50.0),
        Shape("MQA 32/1, d64, 2 x 8k causal", "mqa", 32, 1, 64, True, 2, 8192, 8192),
        Shape("MQA 16/1, d128, 1 x 16k causal", "mqa", 16, 1, 128, True, 1, 16384, 16384),
        Shape("MQA 8/1, d256, 2 x 4k causal", "mqa", 8, 1, 256, True, 2, 4096, 4096),
        Shape("GQA 32/8, d256, 1 x 4k causal", "gqa", 32, 8, 256, True, 1, 4096, 4096),
        Shape("DiT 24 heads, d128, 2 x 4608", "dit", 24, 24, 128, False, 2, 4608, 4608),
        Shape("DiT 20 heads, d64, 2 x 4096", "dit", 20, 20, 64, False, 2, 4096, 4096),
        Shape("DiT 12 heads, d64, 4 x 1101 (1024 image + 77 text)", "dit", 12, 12, 64, False, 4, 1101, 1101),
        Shape("DiT 24 heads, d64, 2 x 4429 (4096 image + 333 text)", "dit", 24, 24, 64, False, 2, 4429, 4429),
        Shape("encoder ViT 16 heads, d64, 128 x 197", "encoder", 16, 16, 64, False, 128, 197, 197),
        Shape("encoder 16 heads, d64, 128 x 257", "encoder", 16, 16, 64, False, 128, 257, 257),
        Shape("encoder 12 heads, d64, 64 x 512", "encoder", 12, 12, 64, False, 64, 512, 512),
        Shape("encoder 16 heads, d64, 32 x 1024", "encoder", 16, 16, 64, False, 32, 1024, 1024),
        Shape("encoder 12 heads, d128, 96 x 384", "encoder", 12, 12, 128, False, 96, 384, 384),
        Shape("chunked prefill: 512 new over 8k, 32/8, d128, causal", "chunked", 32, 8, 128, True, 1, 512,
              8192),
        Shape("chunked prefill: 2k new over 16k, 32/8, d128, causal", "chunked", 32, 8, 128, True, 1, 2048,
              16384),
        Shape("chunked prefill: 1k new over 32k, 16/4, d128, causal, B 2", "chunked", 16, 4, 128, True, 2,
              1024, 32768),
        Shape("sliding window 4096, 32/8, d128, 1 x 16k", "window", 32, 8, 128, True, 1, 16384, 16384,
              window=(4096, 0)),
        Shape("pack 9 docs 64-4096, 32/8, d128, causal", "varlen", 32, 8, 128, True,
              lens=tuple((x, x) for x in (2048, 64, 4096, 517, 1500, 3000, 900, 3100, 1160))),
        Shape("pack 16 docs 1-2048, 16/16, d64, causal", "varlen", 16, 16, 64, True,
              lens=_docs(rng, 16, 1, 2048)),
        Shape("odd lengths: 3 x 1000 causal, 16/4, d128", "odd", 16, 4, 128, True, 3, 1000, 1000),
        Shape("odd lengths: 2 x 3001, 12/12, d96", "odd", 12, 12, 96, False, 2, 3001, 3001),
    ]


# ---------------------------------------------------------------------------------------------
# Providers
# ---------------------------------------------------------------------------------------------
def _inputs(s: Shape) -> tuple:
    dev, dt = "cuda", torch.bfloat16
    if s.varlen:
        tq, tk = sum(a for a, _ in s.lens), sum(b for _, b in s.lens)
        q = torch.randn(tq, s.heads, s.d, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(tk, s.kv_heads, s.d, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(tk, s.kv_heads, s.d, device=dev, dtype=dt, requires_grad=True)
    else:
        q = torch.randn(s.batch, s.nq, s.heads, s.d, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(s.batch, s.nk, s.kv_heads, s.d, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(s.batch, s.nk, s.kv_heads, s.d, device=dev, dtype=dt, requires_grad=True)
    return q, k, v


def providers(s: Shape, q, k, v) -> dict[str, Callable[[], torch.Tensor]]:
    """Forward callables returning out in q's layout; missing or refusing peers are left out
    (a refusal at call time blanks the cell)."""
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    if s.varlen:
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                      for n in zip(*s.lens, strict=True))
        mq, mk = max(a for a, _ in s.lens), max(b for _, b in s.lens)
        fns["ours"] = lambda: cute_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=s.causal,
                                                                window_size=s.window, softcap=s.softcap)
    else:
        fns["ours"] = lambda: cute_flash.flash_attn_func(q, k, v, causal=s.causal, window_size=s.window,
                                                         softcap=s.softcap)
    try:
        from flash_attn.cute import flash_attn_func as fa4
        from flash_attn.cute import flash_attn_varlen_func as fa4_varlen

        def run_fa4():
            kw = dict(causal=s.causal, softcap=s.softcap)
            if s.window != (-1, -1):
                kw["window_size"] = (None if s.window[0] < 0 else s.window[0],
                                     None if s.window[1] < 0 else s.window[1])
            if s.varlen:
                r = fa4_varlen(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq,
                               max_seqlen_k=mk, **kw)
            else:
                r = fa4(q, k, v, **kw)
            return r[0] if isinstance(r, tuple) else r

        fns["fa4"] = run_fa4
    except ImportError:
        pass
    # SDPA: dense, no window or softcap; its causal mask is top-left, ours bottom-right, so only
    # Nq == Nk causal problems are the same problem.
    if not s.varlen and s.window == (-1, -1) and not s.softcap and (s.nq == s.nk or not s.causal):
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa-flash", SDPBackend.FLASH_ATTENTION))
        for name, backend in backends:
            def run_sdpa(backend=backend):
                with sdpa_kernel(backend):
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=s.causal,
                                                       enable_gqa=s.heads != s.kv_heads)
                return o.transpose(1, 2)

            fns[name] = run_sdpa
    return fns


def _bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def measure(s: Shape, rounds: int) -> dict[tuple[str, str], float]:
    """(provider, direction) -> TFLOP/s for one shape. One process at a time: a compile running
    beside the timing starves the launching thread, and short problems then time the host."""
    torch.manual_seed(0)
    q, k, v = _inputs(s)
    fns = providers(s, q, k, v)
    fl = 4.0 * s.heads * s.visible_pairs() * s.d
    dout = None
    graphs: dict[str, torch.Tensor] = {}
    live = []
    for name, fn in fns.items():  # compile and warm up; drop a provider that refuses the problem
        try:
            out = fn()
            dout = torch.randn_like(out) if dout is None else dout
            torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
            graphs[name] = out
            live.append(name)
        except Exception as e:
            print(f"  {s.label}: {name} refused: {type(e).__name__}: {str(e)[:100]}", flush=True)
    times: dict[tuple[str, str], list[float]] = {}
    if not live:
        return {}
    _time_rounds(fns, graphs, live, (q, k, v), dout, rounds, times)
    return {key: (fl if key[1] == "fwd" else 2.5 * fl) / statistics.median(t) / 1e9
            for key, t in times.items()}


def _time_rounds(fns, graphs, live, leaves, dout, rounds, times) -> None:
    for r in range(rounds):
        for name in live[r % len(live):] + live[:r % len(live)]:
            times.setdefault((name, "fwd"), []).append(_bench(fns[name]))
            out = graphs[name]

            def bwd(out=out):
                return torch.autograd.grad(out, leaves, dout, retain_graph=True)

            times.setdefault((name, "bwd"), []).append(_bench(bwd))


def _cell(res: dict, provider: str, direction: str) -> str:
    return f"{res[(provider, direction)]:.0f}" if (provider, direction) in res else "-"


def _ratio(res: dict, direction: str, peers: tuple[str, ...] = ("fa4",)) -> str:
    """ours / the fastest of ``peers`` that ran the problem."""
    a = res.get(("ours", direction))
    b = max((res[(p, direction)] for p in peers if (p, direction) in res), default=None)
    return f"{a / b:.2f}" if a and b else "-"


def table(results: list[tuple[Shape, dict]]) -> str:
    head = ("| problem | fwd ours | fa4 | cuDNN | SDPA-flash | ours/fa4 | ours/best | bwd ours | fa4 | cuDNN "
            "| ours/fa4 | ours/best |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [head]
    best = ("fa4", "sdpa-cudnn", "sdpa-flash")
    for s, res in results:
        cells = [_cell(res, "ours", "fwd"), _cell(res, "fa4", "fwd"), _cell(res, "sdpa-cudnn", "fwd"),
                 _cell(res, "sdpa-flash", "fwd"), _ratio(res, "fwd"), _ratio(res, "fwd", best),
                 _cell(res, "ours", "bwd"), _cell(res, "fa4", "bwd"), _cell(res, "sdpa-cudnn", "bwd"),
                 _ratio(res, "bwd"), _ratio(res, "bwd", best)]
        rows.append(f"| {s.label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", nargs="*", default=[],
                   help="shape groups (gqa, mqa, softcap, dit, encoder, chunked, window, varlen, odd)")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--tag", default="models", help="output file stem")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results, rows = [], []
    for s in shapes():
        if args.only and s.group not in args.only:
            continue
        res = measure(s, args.rounds)
        results.append((s, res))
        rows += [dict(problem=s.label, provider=pr, direction=dr, tflops=round(tf, 1))
                 for (pr, dr), tf in res.items()]
        # Written after every shape: a run cut short keeps what it measured.
        (args.out / f"{args.tag}.json").write_text(json.dumps(rows, indent=1))
        print(f"{s.label}: " + ", ".join(f"{pr} {dr} {tf:.0f}" for (pr, dr), tf in sorted(res.items())),
              flush=True)
        torch.cuda.empty_cache()
    md = (f"TFLOP/s on {torch.cuda.get_device_name()}, bf16, median of {args.rounds} rotated rounds\n\n"
          + table(results))
    (args.out / f"{args.tag}.md").write_text(md + "\n")
    print("\n" + md)


if __name__ == "__main__":
    main()
