"""Attention speed, side by side in one run: cute_flash vs SDPA (flash = FA2, cuDNN) vs flash-attn-4.

    python benchmarks/bench.py [--quick] [--hdim 64 128] [--seqlen 1024 4096] [--causal 0 1]
                               [--dir fwd bwd] [--providers ours sdpa-flash ...] [--out DIR]

Providers: ``ours`` is the public API as it runs on this GPU (on Hopper: the sm90 FA3 forward);
``ours-det`` (not in the default set) is ours with ``deterministic=True`` (bwd: ordered dQ adds);
``fa4-det`` the same for flash-attn-4 (its table column ``ours-det/fa4-det`` compares the two).
``ours-sm80`` (not in the default set) forces our sm80 FA2 forward with ``CUTE_FLASH_FWD_KERNEL=sm80``
around each forward call, for comparison on Hopper; its backward is our usual (sm80) backward.

Grid (default): tokens B*N = 16384, hidden H*d = 2048, N in {512 .. 16k}, d in {64, 128, 256}, causal and
not, fwd and bwd; bf16, (B, N, H, d) layout (SDPA gets transposed views, no copies).

- FLOPs = 4*B*H*Nq*Nk*d, halved for causal; bwd FLOPs = 2.5x fwd (the flash-attention convention).
- Times are medians of ``triton.testing.do_bench`` (CUDA events if triton is missing), taken in
  ``--rounds`` passes over the providers with the order rotated each pass; the reported time is the
  median over the passes (the H200's clock drifts with power and heat within seconds).
- bwd is the backward alone: ``torch.autograd.grad`` on one saved forward graph (retain_graph=True),
  so it includes each provider's backward pre/post-processing kernels but not its forward.
- Peak memory: ``torch.cuda.max_memory_allocated`` during one call (fwd) or one fwd+bwd (bwd), minus
  what was allocated before it (inputs), i.e. outputs + saved tensors + workspace.
- Our kernels are compiled in a warm-up pass before anything is timed; the first-call time of each
  (d, causal, dir) is reported as our compile time.
- A provider that errors (unsupported head dim, OOM, missing package) leaves a blank cell.
- Every cell draws fresh random inputs; our outputs (and dQ) are compared with SDPA-flash's as a
  sanity check (rel. L2 difference in the JSON; a warning above 2e-2).

The last thing printed is a markdown table (the device reply carries the tail of the output).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script from anywhere, without installing the package
    sys.path.insert(0, str(REPO))

PROVIDERS = ("ours", "sdpa-flash", "sdpa-cudnn", "fa4")  # the default set
ALL_PROVIDERS = (*PROVIDERS, "ours-sm80", "ours-det", "fa4-det")
OURS = ("ours", "ours-sm80", "ours-det")
PEERS = ("sdpa-flash", "sdpa-cudnn", "fa4", "fa4-det")
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HDIMS = (64, 128, 256)
SANITY_REL_L2 = 2e-2  # two correct bf16 attentions differ by ~3e-3 relative L2

Fwd = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


# ---------------------------------------------------------------------------------------------
# Providers: (q, k, v, causal) -> out, all on (B, N, H, d) tensors
# ---------------------------------------------------------------------------------------------
def _ours() -> Fwd:
    from cute_flash import flash_attn_func

    return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal)


@contextlib.contextmanager
def _fwd_kernel(family: str):
    """``CUTE_FLASH_FWD_KERNEL=family`` for the duration (the launcher reads it at each call)."""
    from cute_flash.dispatch import FWD_KERNEL_ENV

    old = os.environ.get(FWD_KERNEL_ENV)
    os.environ[FWD_KERNEL_ENV] = family
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(FWD_KERNEL_ENV, None)
        else:
            os.environ[FWD_KERNEL_ENV] = old


def _ours_sm80() -> Fwd:
    from cute_flash import flash_attn_func

    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        with _fwd_kernel("sm80"):  # ~1 us of host time per call, inside the timed region
            return flash_attn_func(q, k, v, causal=causal)

    return fwd


def _sdpa(backend_name: str) -> Fwd:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        # Restricting SDPA to one backend makes it raise instead of silently falling back to another.
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=causal)
        return o.transpose(1, 2)

    return fwd


def _fa4(deterministic: bool = False) -> Fwd:
    from flash_attn.cute import flash_attn_func  # flash-attn-4 (CuTe DSL); absent -> skipped

    kw = dict(deterministic=True) if deterministic else {}

    def fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        r = flash_attn_func(q, k, v, causal=causal, **kw)
        return r[0] if isinstance(r, tuple) else r  # some versions return (out, lse)

    return fwd


def _ours_det() -> Fwd:
    from cute_flash import flash_attn_func

    # deterministic=True changes only the backward (ordered dQ accumulation).
    return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal, deterministic=True)


FACTORIES: dict[str, Callable[[], Fwd]] = {
    "ours": _ours,
    "ours-sm80": _ours_sm80,
    "ours-det": _ours_det,
    "sdpa-flash": lambda: _sdpa("FLASH_ATTENTION"),
    "sdpa-cudnn": lambda: _sdpa("CUDNN_ATTENTION"),
    "fa4": _fa4,
    "fa4-det": lambda: _fa4(deterministic=True),
}


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def bench_ms(fn: Callable[[], Any], warmup: int, rep: int) -> float:
    """Median ms of ``fn``; ``warmup``/``rep`` are milliseconds of device time, as in do_bench."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        try:
            return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
        except TypeError:  # older triton: no return_mode
            return float(do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5])[0])
    # CUDA-event fallback: estimate the per-call time, then time single calls for ~rep ms.
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    est = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup / est))):
        fn()
    times = []
    for _ in range(max(5, int(rep / est))):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_mib(fn: Callable[[], Any]) -> float:
    """Extra device memory (MiB) at the peak of one call of ``fn``, over what was allocated before."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    r = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del r
    return peak / 2**20


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fwd_flops(b: int, h: int, n: int, d: int, causal: bool) -> float:
    return 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0][:200] if msg else ''}"


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------
def make_inputs(b: int, n: int, h: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    # Fresh random data per cell: zeros would hide unwritten outputs and time unrealistically fast.
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=dtype, generator=g) for _ in range(4))
    return q, k, v, do


def warm_up_ours(name: str, fwd: Fwd, hdims: list[int], causals: list[bool], dirs: list[str], tokens: int,
                 hidden: int, n: int, dtype: torch.dtype) -> list[dict[str, Any]]:
    """First call of each of our variants (= JIT compile + one run), before anything is timed."""
    out = []
    for d in hdims:
        for causal in causals:
            h, b = hidden // d, max(tokens // n, 1)
            q, k, v, do = make_inputs(b, n, h, d, dtype, seed=7)
            q.requires_grad_(True)
            k.requires_grad_(True)
            v.requires_grad_(True)
            rec: dict[str, Any] = {"provider": name, "hdim": d, "causal": causal}
            try:
                t0 = time.perf_counter()
                o = fwd(q, k, v, causal)
                torch.cuda.synchronize()
                rec["fwd_first_call_s"] = time.perf_counter() - t0
                if "bwd" in dirs:
                    t0 = time.perf_counter()
                    torch.autograd.grad(o, (q, k, v), do)
                    torch.cuda.synchronize()
                    rec["bwd_first_call_s"] = time.perf_counter() - t0
            except Exception as e:
                rec["error"] = _short(e)
            times = f"fwd {rec.get('fwd_first_call_s', 0):.1f} s" + (
                f", bwd {rec['bwd_first_call_s']:.1f} s" if "bwd_first_call_s" in rec else "")
            print(f"  {name} d={d} causal={int(causal)}: {rec.get('error') or times}", flush=True)
            out.append(rec)
    return out


def run_cell(providers: dict[str, Fwd], failed: dict[tuple, str], d: int, n: int, causal: bool,
             dirs: list[str], args: argparse.Namespace, dtype: torch.dtype) -> list[dict[str, Any]]:
    """Time every provider on one (d, N, causal) problem, both directions."""
    h, b = args.hidden // d, max(args.tokens // n, 1)
    q, k, v, do = make_inputs(b, n, h, d, dtype, seed=hash((d, n, causal)) & 0xFFFF)
    for t in (q, k, v):
        t.requires_grad_(True)
    fl = fwd_flops(b, h, n, d, causal)
    recs: list[dict[str, Any]] = []
    ref: dict[str, torch.Tensor] = {}  # SDPA-flash's out/dq, for the sanity check of ours
    order = ["sdpa-flash"] + [p for p in providers if p != "sdpa-flash"]  # reference first
    timed_calls: list[tuple[dict[str, Any], Callable[[], Any], float]] = []
    for name in [p for p in order if p in providers]:
        fwd = providers[name]
        for direction in dirs:
            rec: dict[str, Any] = {"provider": name, "hdim": d, "seqlen": n, "batch": b, "heads": h,
                                   "causal": causal, "dir": direction, "ms": None, "tflops": None,
                                   "peak_mib": None}
            key = (name, d, causal, direction)
            if key in failed:  # same error for every seqlen; don't pay for it again
                rec["error"] = failed[key]
                recs.append(rec)
                continue
            try:
                with torch.no_grad() if direction == "fwd" else torch.enable_grad():
                    if direction == "fwd":
                        call = (lambda f=fwd: f(q, k, v, causal))
                        o = call()
                        if name == "sdpa-flash":
                            ref["out"] = o.detach()
                        elif name in OURS and "out" in ref:
                            rec["rel_l2_vs_sdpa"] = rel_l2(o, ref["out"])
                        del o
                        rec["peak_mib"] = peak_mib(call)
                        timed, flops = call, fl
                    else:
                        o = fwd(q, k, v, causal)
                        dq = torch.autograd.grad(o, (q,), do, retain_graph=True)[0]
                        if name == "sdpa-flash":
                            ref["dq"] = dq
                        elif name in OURS and "dq" in ref:
                            rec["rel_l2_vs_sdpa"] = rel_l2(dq, ref["dq"])
                        del dq

                        def fwd_bwd(f: Fwd = fwd) -> Any:
                            return torch.autograd.grad(f(q, k, v, causal), (q, k, v), do)

                        rec["peak_mib"] = peak_mib(fwd_bwd)
                        timed = (lambda o=o: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
                        flops = 2.5 * fl
                timed_calls.append((rec, timed, flops))
            except Exception as e:
                rec["error"] = _short(e)
                if isinstance(e, (AssertionError, NotImplementedError, ValueError, TypeError)):
                    # "this head dim / mode is not supported": the same at every seqlen, and a
                    # failing JIT compile is slow to repeat. Run-time errors (OOM, launch limits)
                    # may depend on the seqlen, so those are retried.
                    failed[key] = rec["error"]
                if args.verbose:
                    traceback.print_exc()
            if not rec.get("rel_l2_vs_sdpa", 0.0) <= SANITY_REL_L2:  # NaN fails this too
                print(f"WARNING: {name} d={d} N={n} causal={int(causal)} {direction}: rel L2 vs SDPA-flash "
                      f"{rec['rel_l2_vs_sdpa']:.2e} (> {SANITY_REL_L2})", flush=True)
            recs.append(rec)
            torch.cuda.empty_cache()
    time_rotated(timed_calls, args)
    return recs


def time_rotated(timed_calls: list[tuple[dict[str, Any], Callable[[], Any], float]],
                 args: argparse.Namespace) -> None:
    """Times every checked call of one problem in ``args.rounds`` passes, each pass starting one
    provider later, and records the median over the passes. The H200's clock drifts with power
    and heat by several percent within seconds (the first kernel after a pause runs fastest), so
    timing the providers one after the other would favour whichever comes first."""
    times: list[list[float]] = [[] for _ in timed_calls]
    n = len(timed_calls)
    for r in range(args.rounds):
        for i in [(r + j) % n for j in range(n)]:
            rec, fn, _ = timed_calls[i]
            try:
                times[i].append(bench_ms(fn, args.warmup, args.rep))
            except Exception as e:  # noqa: BLE001 - recorded, the others still run
                rec["error"] = _short(e)
    for (rec, _, flops), ts in zip(timed_calls, times, strict=True):
        if ts and "error" not in rec:
            ms = sorted(ts)[len(ts) // 2]
            rec["ms"], rec["tflops"] = ms, flops / ms * 1e-9
            rec["passes_tflops"] = [round(flops / t * 1e-9, 1) for t in ts]


def markdown_table(results: list[dict[str, Any]], providers: list[str]) -> str:
    cells: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in results:
        cells.setdefault((r["hdim"], r["causal"], r["dir"], r["seqlen"]), {})[r["provider"]] = r
    peers = [p for p in providers if p != "ours"]
    short = {p: p.removeprefix("sdpa-") for p in providers}  # keep rows short: the reply shows ~12k chars
    head = ["d", "causal", "N", "dir", *[short[p] for p in providers]]
    if "ours" in providers:
        head += [f"ours/{short[p]}" for p in peers] + ["ours MiB", "ours ΔL2"]
    both_det = "ours-det" in providers and "fa4-det" in providers  # deterministic modes side by side
    if both_det:
        head.append("ours-det/fa4-det")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    dir_rank = {"fwd": 0, "bwd": 1}
    order = sorted(cells, key=lambda c: (c[0], c[1], dir_rank[c[2]], c[3]))  # as in peers-h200.md
    for d, causal, direction, n in order:
        row = cells[(d, causal, direction, n)]
        tf = {p: (row.get(p) or {}).get("tflops") for p in providers}
        vals = [str(d), str(int(causal)), str(n), direction]
        vals += [f"{tf[p]:.0f}" if tf[p] else "" for p in providers]
        if "ours" in providers:
            vals += [f"{tf['ours'] / tf[p]:.2f}" if tf["ours"] and tf[p] else "" for p in peers]
            ours = row.get("ours") or {}
            vals.append(f"{ours['peak_mib']:.0f}" if ours.get("peak_mib") is not None else "")
            dl2 = ours.get("rel_l2_vs_sdpa")
            vals.append("" if dl2 is None else f"{dl2:.1e}" + ("" if dl2 <= SANITY_REL_L2 else " (!)"))
        if both_det:
            det, fdet = tf.get("ours-det"), tf.get("fa4-det")
            vals.append(f"{det / fdet:.2f}" if det and fdet else "")
        lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], providers: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hdims = sorted({r["hdim"] for r in results})
    dirs = [x for x in ("fwd", "bwd") if any(r["dir"] == x for r in results)]
    fig, axes = plt.subplots(len(dirs), len(hdims), figsize=(5 * len(hdims), 3.8 * len(dirs)), squeeze=False)
    palette = ("tab:red", "tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown")
    colors = dict(zip(ALL_PROVIDERS, palette, strict=True))
    for i, direction in enumerate(dirs):
        for j, d in enumerate(hdims):
            ax = axes[i][j]
            for p in providers:
                for causal, style in ((False, "-"), (True, "--")):
                    pts = sorted((r["seqlen"], r["tflops"]) for r in results if r["provider"] == p
                                 and r["hdim"] == d and r["dir"] == direction and r["causal"] == causal
                                 and r["tflops"])
                    if pts:
                        ax.plot(*zip(*pts, strict=True), style, marker="o", ms=3, color=colors.get(p),
                                label=f"{p}{' causal' if causal else ''}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{direction} d={d}")
            ax.set_xlabel("seqlen")
            ax.set_ylabel("TFLOP/s")
            ax.grid(alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hdim", type=int, nargs="+", default=None, help=f"default {HDIMS}")
    p.add_argument("--seqlen", type=int, nargs="+", default=None, help=f"default {SEQLENS}")
    p.add_argument("--causal", type=int, nargs="+", choices=(0, 1), default=None, help="default 0 1")
    p.add_argument("--dir", nargs="+", choices=("fwd", "bwd"), default=None, help="default fwd bwd")
    p.add_argument("--providers", nargs="+", choices=ALL_PROVIDERS, default=list(PROVIDERS),
                   help=f"default {' '.join(PROVIDERS)}; ours-sm80: our sm80 forward forced (Hopper)")
    p.add_argument("--quick", action="store_true", help="d=128, N in {1k, 4k} (defaults only)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--tokens", type=int, default=16384, help="B*N")
    p.add_argument("--hidden", type=int, default=2048, help="H*d")
    p.add_argument("--warmup", type=int, default=10, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=30, help="do_bench repetition time, ms")
    p.add_argument("--rounds", type=int, default=5,
                   help="timing passes per problem, rotated over the providers (median reported)")
    p.add_argument("--out", type=Path, default=None, help="write bench.json and bench.png here")
    p.add_argument("--verbose", action="store_true", help="tracebacks of provider errors")
    args = p.parse_args(argv)
    if args.hdim is None:
        args.hdim = [128] if args.quick else list(HDIMS)
    if args.seqlen is None:
        args.seqlen = [1024, 4096] if args.quick else list(SEQLENS)
    args.causal = [bool(c) for c in (args.causal if args.causal is not None else (0, 1))]
    args.dir = args.dir or ["fwd", "bwd"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/bench.py needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        timer = (f"triton {triton.__version__} do_bench median (warmup {args.warmup} ms, rep {args.rep} ms), "
                 f"median of {args.rounds} rotated passes")
    except ImportError:
        timer = f"CUDA events median (triton not importable), median of {args.rounds} rotated passes"
    meta = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(), "dtype": args.dtype,
            "tokens": args.tokens, "hidden": args.hidden, "timer": timer,
            "bwd": "backward alone: autograd.grad on a retained forward graph; FLOPs 2.5x fwd",
            "flops": "4*B*H*N^2*d, halved for causal",
            "peak_mib": "extra over inputs, one call (bwd: fwd+bwd)"}
    print(f"# {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}; {timer}", flush=True)

    # Providers: ours first, and compiled before flash-attn-4 is imported (importing flash_attn.cute
    # patches cute.compile process-wide; keep our compile times and code free of that).
    providers: dict[str, Fwd] = {}
    setup_errors: dict[str, str] = {}
    compile_recs: list[dict[str, Any]] = []
    for name in [p for p in args.providers if p in OURS]:
        try:
            providers[name] = FACTORIES[name]()
            print(f"warm-up (compile) of {name}:", flush=True)
            compile_recs += warm_up_ours(name, providers[name], args.hdim, args.causal, args.dir, args.tokens,
                                         args.hidden, min(args.seqlen), dtype)
        except Exception as e:
            setup_errors[name] = _short(e)
    for name in args.providers:
        if name in OURS:
            continue
        try:
            providers[name] = FACTORIES[name]()
        except Exception as e:
            setup_errors[name] = _short(e)
    for name, err in setup_errors.items():
        print(f"provider {name} unavailable: {err}", flush=True)

    failed: dict[tuple, str] = {}
    for rec in compile_recs:  # a variant that did not compile fails every cell the same way
        if "error" in rec:
            for direction in args.dir:
                failed[(rec["provider"], rec["hdim"], rec["causal"], direction)] = rec["error"]
    results: list[dict[str, Any]] = []
    for d in args.hdim:
        for causal in args.causal:
            for n in args.seqlen:
                t0 = time.perf_counter()
                recs = run_cell(providers, failed, d, n, causal, args.dir, args, dtype)
                results += recs
                summary = "  ".join(f"{r['provider']}/{r['dir']}="
                                    + (f"{r['tflops']:.0f}" if r["tflops"] else "-") for r in recs)
                print(f"d={d} N={n} causal={int(causal)} ({time.perf_counter() - t0:.1f} s): {summary}",
                      flush=True)
    for name, err in setup_errors.items():
        results += [{"provider": name, "hdim": d, "seqlen": n, "causal": c, "dir": x, "ms": None,
                     "tflops": None, "peak_mib": None, "error": err}
                    for d in args.hdim for n in args.seqlen for c in args.causal for x in args.dir]

    total = time.perf_counter() - t_start
    meta["total_s"] = total
    shown = list(args.providers)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / "bench.json", "w") as f:
            json.dump({"meta": meta, "compile": compile_recs, "errors": sorted({r["error"] for r in results
                                                                                if r.get("error")}),
                       "results": results}, f, indent=1)
        try:
            plot(results, shown, args.out / "bench.png",
                 f"{props.name}, {args.dtype}, B*N={args.tokens}, H*d={args.hidden} (dashed: causal)")
        except Exception as e:  # a missing matplotlib must not lose the numbers
            print(f"plot failed: {_short(e)}")

    errs = sorted({f"{r['provider']} d={r['hdim']} causal={int(r['causal'])} {r['dir']}: {r['error']}"
                   for r in results if r.get("error")})
    if errs:
        print(f"\n{len(errs)} provider/variant errors (blank cells):")
        for e in errs[:40]:
            print("  " + e)
    if compile_recs:
        print("\nours, first call (compile + run), s: " + ", ".join(
            ("" if r["provider"] == "ours" else f"{r['provider']} ")
            + f"d{r['hdim']}{'c' if r['causal'] else ''} "
            f"fwd {r.get('fwd_first_call_s', math.nan):.1f}"
            + (f" bwd {r['bwd_first_call_s']:.1f}" if "bwd_first_call_s" in r else "") for r in compile_recs))
    print(f"\ntotal {total:.0f} s" + (f"; JSON and plot in {args.out}" if args.out else ""))
    print(f"\nTFLOP/s, {props.name}, {args.dtype}, B*N={args.tokens}, H*d={args.hidden}; "
          "bwd = backward alone (2.5x fwd FLOPs); ours/X = speed ratio\n")
    print(markdown_table(results, shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
