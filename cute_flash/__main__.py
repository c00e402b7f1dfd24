"""``python -m cute_flash``: check and time the kernels on this machine's GPU beside SDPA-cuDNN and
flash-attn-4, or, without one, compile them for sm_80 and sm_90a and print what the compiler made.

``python -m cute_flash inspect ...``: compile one variant without a GPU and report its PTX/SASS
(see ``cute_flash/tools/inspect.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cute_flash",
        description="With a CUDA GPU: check our attention against the fp32 reference (2x rule) and time it "
                    "against SDPA-cuDNN and flash-attn-4 (when installed), fwd and bwd. Without one: compile "
                    "the forward and backward for sm_80 and sm_90a and print registers, spills, smem and "
                    "the key instructions. "
                    "Subcommands: 'inspect' (one variant's PTX / SASS), 'warmup' (compile a model's variants "
                    "into the disk cache ahead of time), 'cache' (where it is, --clear); each takes -h.")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--no-bwd", action="store_true", help="forward only")
    p.add_argument("--no-bench", action="store_true", help="check correctness only (GPU mode)")
    p.add_argument("--compile-only", action="store_true", help="the no-GPU mode even when a GPU is present")
    p.add_argument("--arch", action="append", choices=("sm_80", "sm_90a"),
                   help="compile-only mode: targets (default both; repeat the flag for several)")
    p.add_argument("--workers", type=int, default=None,
                   help="compile-only mode: parallel compile processes (default: CPU count)")
    # Lets the check logic run on the CPU in tests (with a stand-in kernel); not a user option.
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    return p


# ---------------------------------------------------------------------------------------------
# No GPU: compile and show the instruction mix
# ---------------------------------------------------------------------------------------------
def _compile_main(args: argparse.Namespace) -> int:
    from cute_flash.tools import inspect as ins

    archs = args.arch or ["sm_80", "sm_90a"]
    kernels = ["fwd"] if args.no_bwd else ["fwd", "bwd"]
    variants = [ins.Variant(arch=a, kernel=k, dtype=args.dtype, hdim=args.hdim, causal=c)
                for a in archs for k in kernels for c in (False, True)]
    print(f"no CUDA GPU (or --compile-only): compiling {len(variants)} variants "
          f"({', '.join(archs)}; {'/'.join(kernels)}; {args.dtype} d={args.hdim}; causal and not)...",
          flush=True)
    t0 = time.perf_counter()
    reports = ins.inspect_many(variants, workers=args.workers)
    wall = time.perf_counter() - t0
    print("\nPer kernel (static counts; spills in bytes per thread; smem = static + dynamic):\n")
    print(ins.summary_table(reports))
    disassembled = any(k["sass"] for r in reports if "error" not in r for k in r["kernels"])
    if not disassembled:
        print("\n* PTX counts: the SASS ones need nvdisasm / cuobjdump (pip install -e '.[dev]').")
    print("\nEvery instruction count of one variant: python -m cute_flash inspect --arch sm_90a --kernel bwd "
          f"--hdim {args.hdim} [--causal] [--json]")
    failed = [r for r in reports if "error" in r]
    spilled = [r for r in reports if "error" not in r and (r["spill_bytes"] or r["local_bytes"])]
    print(f"\n{len(reports) - len(failed)}/{len(reports)} variants compiled in {wall:.1f} s wall "
          f"(sum of compile times {sum(r.get('compile_s', 0.0) for r in reports):.1f} s)")
    for r in spilled:
        v = ins.Variant(**{k: r[k] for k in ("arch", "kernel", "dtype", "hdim", "causal")})
        print(f"WARNING: {v.label()} spills {r['spill_bytes']} B / uses {r['local_bytes']} B of local memory")
    for r in failed:
        print(f"FAILED: {ins.Variant(**r['variant']).label()}: {r['error']}")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# GPU: correctness (2x rule) and speed against the peers
# ---------------------------------------------------------------------------------------------
def _bench_ms(fn: Callable[[], Any]) -> float:
    """Median milliseconds of ``fn`` (triton's do_bench, else CUDA events around single calls)."""
    import torch

    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        try:
            return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
        except TypeError:  # older triton: no return_mode
            return float(do_bench(fn, warmup=25, rep=100, quantiles=[0.5])[0])
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _floor(ref: Any) -> float:
    # Only a guard against a torch error that happens to be ~0; kept far below bf16/fp16 rounding
    # (1e-4 of the largest reference value) so that it never hides a real error. (flash-attention's
    # tests use 2 ulp at 0.3 in the low-precision dtype, ~4e-3 for bf16: that lets a 1% error through.)
    return 1e-4 * float(ref.abs().max()) + 1e-6


def _check_one(name: str, ours: Any, pt: Any, ref: Any) -> tuple[bool, str]:
    ours_f, pt_f, ref_f = ours.detach().float(), pt.detach().float(), ref.detach().float()
    err = float((ours_f - ref_f).abs().max())
    err_pt = float((pt_f - ref_f).abs().max())
    bound = 2.0 * err_pt + _floor(ref_f)
    rel = float((ours_f - ref_f).norm() / ref_f.norm().clamp_min(1e-30))
    ok = math.isfinite(err) and err <= bound
    return ok, (f"| {name} | {err:.3e} | {err_pt:.3e} | {bound:.3e} | {rel:.2e} | "
                f"{'ok' if ok else 'FAIL'} |")


def _gpu_case(args: argparse.Namespace, causal: bool, flash_attn_func: Callable[..., Any],
              attention_ref: Callable[..., Any]) -> tuple[bool, list[str], list[str]]:
    """Check and time one mask mode; returns (all checks passed, check rows, perf rows)."""
    import torch

    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    B, N, H, D = args.batch, args.seqlen, args.heads, args.hdim
    torch.manual_seed(1234 + causal)
    # Fresh random inputs (never zeros: they hide unwritten outputs and run unrealistically fast).
    q, k, v = (torch.randn(B, N, H, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    dout = torch.randn(B, N, H, D, device=dev, dtype=dtype)
    tag = "causal" if causal else "full"

    t0 = time.perf_counter()
    out = flash_attn_func(q, k, v, causal=causal)
    sync()
    t_fwd_first = time.perf_counter() - t0
    grads: tuple[Any, ...] = ()
    t_bwd_first = float("nan")
    if not args.no_bwd:
        t0 = time.perf_counter()
        grads = torch.autograd.grad(out, (q, k, v), dout)
        sync()
        t_bwd_first = time.perf_counter() - t0
    print(f"[{tag}] first call (compile + run): fwd {t_fwd_first:.1f} s, bwd {t_bwd_first:.1f} s",
          flush=True)

    # References per batch element: the fp32 reference materialises B*H*N*N scores, and a slice
    # keeps the peak memory at 1/B of that.
    names = ("out",) if args.no_bwd else ("out", "dq", "dk", "dv")
    refs: dict[str, list[Any]] = {n + sfx: [] for n in names for sfx in ("", "_pt")}
    for b in range(B):
        sl = [t[b:b + 1].detach().clone().requires_grad_() for t in (q, k, v)]
        for upcast, sfx in ((True, ""), (False, "_pt")):
            o, _ = attention_ref(*sl, causal=causal, upcast=upcast)
            refs["out" + sfx].append(o.detach())
            if not args.no_bwd:
                g = torch.autograd.grad(o, sl, dout[b:b + 1])
                for name, t in zip(("dq", "dk", "dv"), g, strict=True):
                    refs[name + sfx].append(t)
    cat = {kk: torch.cat(vv) for kk, vv in refs.items()}
    del refs
    ok_all = True
    check_rows = []
    for name, ours_t in zip(names, (out, *grads), strict=True):
        ok, row = _check_one(f"{tag} {name}", ours_t, cat[name + "_pt"], cat[name])
        ok_all &= ok
        check_rows.append(row)
    del cat

    perf_rows: list[str] = []
    if args.no_bench:
        return ok_all, check_rows, perf_rows
    flops = 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)
    peers = _peers(q, k, v, causal)

    def row(direction: str, fl: float, ms_ours: float, ms_peers: dict[str, float]) -> str:
        cells = [f"{fl / ms * 1e-9:.0f}" if ms == ms else "-" for ms in ms_peers.values()]
        best = min((ms for ms in ms_peers.values() if ms == ms), default=float("nan"))
        return (f"| {int(causal)} | {direction} | {fl / ms_ours * 1e-9:.0f} | " + " | ".join(cells)
                + f" | {best / ms_ours:.2f} |")

    ms_ours = _bench_ms(lambda: flash_attn_func(q, k, v, causal=causal))
    perf_rows.append(row("fwd", flops, ms_ours, {n: _time_or_nan(f) for n, f in peers.items()}))
    if not args.no_bwd:
        # Backward alone: autograd.grad on one saved graph, retained between repetitions.
        o_ours = flash_attn_func(q, k, v, causal=causal)
        ms_ours = _bench_ms(lambda: torch.autograd.grad(o_ours, (q, k, v), dout, retain_graph=True))
        ms_peers = {}
        for name, fn in peers.items():
            try:
                o_peer = fn()  # every peer's output in (B, N, H, d), like ours
            except Exception:
                ms_peers[name] = float("nan")
                continue
            ms_peers[name] = _time_or_nan(lambda o=o_peer: torch.autograd.grad(o, (q, k, v), dout,
                                                                              retain_graph=True))
        perf_rows.append(row("bwd", 2.5 * flops, ms_ours, ms_peers))
    return ok_all, check_rows, perf_rows


PEER_NAMES = ("SDPA-cuDNN", "flash-attn-4")


def _peers(q: Any, k: Any, v: Any, causal: bool) -> dict[str, Callable[[], Any]]:
    """The peers timed beside us on the same inputs: SDPA's cuDNN backend (ships with torch) and
    flash-attn-4 (``flash_attn.cute``) when it is installed; a missing one times as NaN ('-')."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants (B, H, N, d): a view, no copy

    def cudnn() -> Any:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)

    peers: dict[str, Callable[[], Any]] = {"SDPA-cuDNN": cudnn}
    try:
        from flash_attn.cute import flash_attn_func as fa4

        def flash4() -> Any:
            out = fa4(q, k, v, causal=causal)
            return out[0] if isinstance(out, tuple) else out

        peers["flash-attn-4"] = flash4
    except Exception:
        peers["flash-attn-4"] = _missing
    return peers


def _time_or_nan(fn: Callable[[], Any]) -> float:
    """``_bench_ms``, or NaN (shown as '-') for a peer that is missing or refuses the problem."""
    try:
        return _bench_ms(fn)
    except Exception:
        return float("nan")


def _missing() -> Any:
    raise RuntimeError("not installed")


def _gpu_main(args: argparse.Namespace) -> int:
    import torch

    try:
        from cute_flash import flash_attn_func
    except ImportError as e:
        print(f"error: cute_flash.flash_attn_func is not available: {e}", file=sys.stderr)
        return 2
    try:
        from cute_flash.reference import attention_ref
    except ImportError as e:
        print(f"error: cute_flash.reference.attention_ref is not available: {e}", file=sys.stderr)
        return 2

    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    from cute_flash import dispatch, jit

    try:
        arch = jit.device_arch()
        family = dispatch.fwd_family(arch, args.hdim, args.hdim)
        bfamily = dispatch.bwd_family(arch, args.hdim, args.hdim, False)
    except ValueError as e:  # e.g. CUTE_FLASH_FWD_KERNEL=sm90 on an Ampere GPU: the checks will say so
        family = bfamily = f"? ({e})"
    choice = os.environ.get(dispatch.FWD_KERNEL_ENV, "auto")
    bchoice = os.environ.get("CUTE_FLASH_BWD_KERNEL", "auto")
    print(f"kernels: forward {family} (CUTE_FLASH_FWD_KERNEL={choice}), backward {bfamily} "
          f"(CUTE_FLASH_BWD_KERNEL={bchoice})")
    print(f"problem: B={args.batch} N={args.seqlen} H={args.heads} d={args.hdim} {args.dtype}; "
          "layout (B, N, H, d)\n")
    ok_all = True
    check_rows = [f"| check | max abs err ours | max abs err torch-{args.dtype} | bound (2x + floor) "
                  "| rel L2 ours | result |", "|---|---|---|---|---|---|"]
    perf_rows = ["| causal | dir | ours TFLOP/s | " + " | ".join(f"{p} TFLOP/s" for p in PEER_NAMES)
                 + " | ours / best peer |", "|---|---|---|" + "---|" * len(PEER_NAMES) + "---|"]
    for causal in (False, True):
        try:
            ok, checks, perfs = _gpu_case(args, causal, flash_attn_func, attention_ref)
        except Exception as e:  # one mode failing must not hide the other's results
            ok, checks, perfs = False, [f"| {'causal' if causal else 'full'} | ERROR {type(e).__name__}: "
                                        f"{str(e)[:300]} | | | | FAIL |"], []
        ok_all &= ok
        check_rows += checks
        perf_rows += perfs
        torch.cuda.empty_cache()

    print(f"\nCorrectness (ours vs fp32 reference; pass: err <= 2 x torch-{args.dtype} err + floor):")
    print("\n".join(check_rows))
    if not args.no_bench:
        print("\nSpeed (median; FLOPs = 4*B*H*N^2*d, halved for causal; bwd = 2.5x fwd, timed alone):")
        print("\n".join(perf_rows))
    print("\nRESULT:", "PASS" if ok_all else "FAIL")
    return 0 if ok_all else 1


def _cache_main(argv: list[str]) -> int:
    from cute_flash import disk_cache

    p = argparse.ArgumentParser(prog="python -m cute_flash cache",
                                description="The compile cache: where, how much (--clear: empty it).")
    p.add_argument("--clear", action="store_true")
    args = p.parse_args(argv)
    if args.clear:
        print(f"removed {disk_cache.clear()} entries from {disk_cache.cache_root()}")
        return 0
    entries = disk_cache.entries()
    size = 0
    for e in entries:
        with contextlib.suppress(OSError):  # (another process may be clearing it)
            size += e.stat().st_size
    state = "on" if disk_cache.enabled() else f"off ({disk_cache.CACHE_ENV}=0)"
    print(f"{disk_cache.cache_root()}: {len(entries)} compiled kernels, {size / 2**20:.1f} MiB; "
          f"cache {state}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "inspect":
        from cute_flash.tools import inspect as ins

        p = argparse.ArgumentParser(prog="python -m cute_flash inspect",
                                    description="Compile one kernel variant without a GPU and report its "
                                                "PTX/SASS instruction mix, registers, spills and smem.")
        ins.add_arguments(p)
        return ins.main(p.parse_args(argv[1:]))
    if argv and argv[0] == "warmup":
        from cute_flash.tools import warmup

        p = argparse.ArgumentParser(prog="python -m cute_flash warmup",
                                    description="Compile the kernel variants a model will launch into the "
                                                "on-disk compile cache, ahead of time (no GPU needed with "
                                                "--arch).")
        warmup.add_arguments(p)
        return warmup.main(p.parse_args(argv[1:]))
    if argv and argv[0] == "cache":
        return _cache_main(argv[1:])
    args = _build_parser().parse_args(argv)
    import torch

    if torch.cuda.is_available() and not args.compile_only:
        return _gpu_main(args)
    return _compile_main(args)


if __name__ == "__main__":
    sys.exit(main())
