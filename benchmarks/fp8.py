"""FP8 forward on the GPU: the quantize kernels' bandwidth, the FP8
attention's TFLOP/s beside our bf16 forward and flash-attn-4's in the same run, the end-to-end
quantize + FP8 time, and the FA3 paper's accuracy experiment with the kernels. Every part is
guarded: a failure prints its error and the next part runs.

    python benchmarks/fp8.py [--hdim 128 256] [--seqlen 2048 8192 16384] [--causal 0 1]
        [--parts accuracy quant attn bwd bwd-model] [--gqa 1 4]
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import traceback

import torch
import triton.testing

import cute_flash.ops_fp8  # noqa: F401 - registers cute_flash::bwd_fp8
from cute_flash.hopper import fp8_config
from cute_flash.launch import quantize_qkv, run_bwd, run_bwd_fp8, run_fwd, run_fwd_fp8
from cute_flash.reference import attention_ref
from cute_flash.reference_fp8 import attention_fp8_ref, outlier_qkv, quantize_qkv_ref

# Q / K lanes per row tried beside the default (``fp8_config.qk_lanes_per_row``); --qk-lanes.
QK_LANES: list[int] = []


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def tflops_rotated(fns: dict, flops: float, rounds: int = 3) -> dict[str, float]:
    """TFLOP/s of each callable: the median over ``rounds`` rounds, each starting one further
    along the list (no contestant always runs first)."""
    times: dict[str, list[float]] = {x: [] for x in fns}
    names = list(fns)
    for r in range(rounds):
        for x in names[r % len(names):] + names[:r % len(names)]:
            times[x].append(bench(fns[x]))
    return {x: flops / statistics.median(t) / 1e9 for x, t in times.items()}


def guarded(name: str, fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - report and go on
        print(f"{name}: FAILED\n{traceback.format_exc(limit=3)}", flush=True)


def accuracy(d: int) -> None:
    """RMSE vs fp64 of the kernels' output: bf16 forward, FP8 without and with rotation (N = 4k),
    next to the same numbers from the CPU reference path."""
    q, k, v = outlier_qkv(1, 4096, 2, d, seed=1, device="cuda")
    ref, _ = attention_ref(q.double(), k.double(), v.double())
    scale = 1.0 / math.sqrt(d)
    row = {}
    out = torch.empty_like(q, dtype=torch.bfloat16)
    lse = torch.empty(1, 2, 4096, device="cuda")
    run_fwd(q.bfloat16(), k.bfloat16(), v.bfloat16(), out, lse, softmax_scale=scale, causal=False,
            window_size=(-1, -1), softcap=0.0)
    row["bf16"] = (out.double() - ref).pow(2).mean().sqrt().item()
    for name, rot in (("fp8", False), ("fp8_rot", True)):
        t = quantize_qkv(q.bfloat16(), k.bfloat16(), v.bfloat16(), rotate=rot, seed=0, v_perm=True)
        run_fwd_fp8(*t, out, lse, softmax_scale=scale, v_perm=True)
        row[name] = (out.double() - ref).pow(2).mean().sqrt().item()
        o_ref, _ = attention_fp8_ref(*quantize_qkv_ref(q, k, v, rotate_qk=rot, seed=0), softmax_scale=scale)
        row[name + "_ref"] = (o_ref.double() - ref).pow(2).mean().sqrt().item()
    print(f"accuracy d={d} N=4096: " + " ".join(f"{k}={x:.2e}" for k, x in row.items()), flush=True)


def quant_speed(d: int, n: int) -> None:
    b, h = max(1, 16384 // n), 2048 // d
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    moved = 3 * q.numel() * (2 + 2 + 1)  # two bf16 reads (amax, quant) and one e4m3 write each
    ideal = 3 * q.numel() * (2 + 1)
    default = fp8_config.qk_lanes_per_row(d)
    # Q / K with fewer lanes per row (several rows per warp, fewer shuffle rounds), interleaved
    # with the default so both see the same clocks.
    options = [default, *(x for x in QK_LANES if x != default and d // x >= 2)]
    table = fp8_config.QK_LANES_BY_HDIM
    saved = table.get(d)
    times: dict[int, list[float]] = {x: [] for x in options}
    try:
        for r in range(3):
            for x in options[r % len(options):] + options[:r % len(options)]:
                table[d] = x
                times[x].append(bench(lambda: quantize_qkv(q, k, v, rotate=True)))
    finally:
        if saved is None:
            table.pop(d, None)
        else:
            table[d] = saved
    for x in options:
        ms = statistics.median(times[x])
        print(f"quantize d={d} N={n} qk_lanes={x}: {ms * 1e3:.0f} us, {moved / ms / 1e6:.0f} GB/s moved "
              f"({ideal / ms / 1e6:.0f} GB/s of one-pass traffic)", flush=True)


def attn_speed(d: int, n: int, causal: bool) -> None:
    b, h = max(1, 16384 // n), 2048 // d
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, n, device="cuda")
    t8 = quantize_qkv(q, k, v, rotate=True)
    t8p = quantize_qkv(q, k, v, rotate=True, v_perm=True)
    # fp8: V in the kernel's token order (the fp8=True path); fp8-vnat: natural V (caller's e4m3).
    fns = {
        "bf16": lambda: run_fwd(q, k, v, out, lse, softmax_scale=scale, causal=causal, window_size=(-1, -1),
                                softcap=0.0),
        "fp8": lambda: run_fwd_fp8(*t8p, out, lse, softmax_scale=scale, causal=causal, v_perm=True),
        "fp8-vnat": lambda: run_fwd_fp8(*t8, out, lse, softmax_scale=scale, causal=causal),
        "quant+fp8": lambda: run_fwd_fp8(*quantize_qkv(q, k, v, rotate=True, v_perm=True), out, lse,
                                         softmax_scale=scale, causal=causal, v_perm=True),
    }
    try:
        from flash_attn.cute import flash_attn_func

        fns["fa4-bf16"] = lambda: flash_attn_func(q, k, v, causal=causal)
    except Exception:  # noqa: BLE001
        pass
    tf = tflops_rotated(fns, flops)
    print(f"attn d={d} N={n} causal={int(causal)}: " + " ".join(f"{x} {v:.0f}" for x, v in tf.items())
          + f"  fp8/bf16 {tf['fp8'] / tf['bf16']:.2f}", flush=True)


def _peer_bwds(q, k, v, dout, causal: bool, fns: dict, cu=None) -> None:
    """bf16 backward peers of the same problem, each where it runs: flash-attn-4, and for dense
    inputs SDPA's flash and cuDNN backends (the kernel a backward runs is chosen at its forward)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    def grads_of(out, leaves):
        return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)

    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

        leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
        o4 = (flash_attn_func(*leaves, causal=causal) if cu is None else
              flash_attn_varlen_func(*leaves, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=causal))
        fns["fa4"] = grads_of(o4[0] if isinstance(o4, tuple) else o4, leaves)
    except Exception:  # noqa: BLE001 - a peer that does not run this shape is left out
        pass
    if cu is not None:
        return
    for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                          ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            leaves = tuple(t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
            with sdpa_kernel(backend):
                o = sdpa(*leaves, is_causal=causal, enable_gqa=k.shape[2] != q.shape[2]).transpose(1, 2)
            fns[name] = grads_of(o, leaves)
            fns[name]()
        except Exception:  # noqa: BLE001
            fns.pop(name, None)


def bwd_speed(b: int, n: int, h: int, hkv: int, d: int, causal: bool) -> None:
    """FP8 backward TFLOP/s (the launcher: dO's quantization and the token-contiguous copies
    included; ``+unrot``: the ``fp8=True`` op, rotation undone) beside our bf16 backward and the
    bf16 peers on the same shape (FLOPs: 2.5x the forward's)."""
    q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, n, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    scale = 1.0 / math.sqrt(d)
    flops = 2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
    out, lse = torch.empty_like(q), torch.empty(b, h, n, device="cuda")
    run_fwd(q, k, v, out, lse, softmax_scale=scale, causal=causal, window_size=(-1, -1), softcap=0.0)
    q8, k8, v8, *ds = quantize_qkv(q, k, v, rotate=True, v_perm=True)
    out8, lse8 = torch.empty_like(q), torch.empty(b, h, n, device="cuda")
    run_fwd_fp8(q8, k8, v8, *ds, out8, lse8, softmax_scale=scale, causal=causal, v_perm=True)
    saved = (q8, k8, v, *ds, out8, lse8)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    fns = {
        "bf16": lambda: run_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=scale, causal=causal),
        "fp8": lambda: run_bwd_fp8(dout, *saved, softmax_scale=scale, causal=causal),
        "fp8+unrot": lambda: torch.ops.cute_flash.bwd_fp8(dout, *saved, None, scale, causal, 0, False),
    }
    _peer_bwds(q, k, v, dout, causal, fns)
    _report(f"bwd B={b} N={n} H={h}/{hkv} d={d} causal={int(causal)}", tflops_rotated(fns, flops))


def bwd_varlen_speed(lens: list[int], h: int, hkv: int, d: int, causal: bool) -> None:
    """``bwd_speed`` on one pack of sequences (documents of a training batch), the FP8 op with
    its rotation undone against our bf16 varlen backward and flash-attn-4's."""
    from cute_flash import flash_attn_varlen_func

    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    t, mx = sum(lens), max(lens)
    q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(t, hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn_like(q)
    flops = 2.5 * 4 * h * d * sum(n * n / (2 if causal else 1) for n in lens)
    fns = {}
    for name, fp8 in (("bf16", False), ("fp8+unrot", True)):
        o = flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=causal, fp8=fp8)
        fns[name] = (lambda o=o: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True))
    _peer_bwds(q.detach(), k.detach(), v.detach(), dout, causal, fns, cu=cu)
    _report(f"bwd varlen {len(lens)} seqs T={t} H={h}/{hkv} d={d} causal={int(causal)}",
            tflops_rotated(fns, flops))


def _report(label: str, tf: dict[str, float]) -> None:
    fp8 = tf.get("fp8", tf.get("fp8+unrot"))
    print(f"{label}: " + " ".join(f"{x} {v:.0f}" for x, v in tf.items())
          + f"  fp8/bf16 {fp8 / tf['bf16']:.2f}", flush=True)


# Model-shaped backward problems: (B, N, H, H_kv, d, causal) -- LLM training steps with GQA, a
# DiT-style image / video block, short encoder sequences.
MODEL_BWD_SHAPES = [
    (1, 4096, 32, 8, 128, True),    # Llama-3-8B, 4k
    (1, 8192, 32, 8, 128, True),    # Llama-3-8B, 8k
    (2, 2048, 28, 4, 128, True),    # Qwen2-7B, 2k, GQA 7
    (1, 4429, 24, 24, 64, False),   # SD3-style joint DiT block (4096 image + 333 text tokens)
    (16, 512, 16, 16, 64, False),   # BERT-large-style encoder, 512
    (2, 1000, 16, 16, 128, False),  # encoder, off the tile grid
]
# One pack of documents (16k tokens) for the varlen backward.
VARLEN_LENS = [512, 1700, 3000, 900, 6000, 4272]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--seqlen", type=int, nargs="+", default=[2048, 8192, 16384])
    ap.add_argument("--causal", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--parts", nargs="+", default=["accuracy", "quant", "attn"],
                    help="accuracy quant attn bwd bwd-model")
    ap.add_argument("--gqa", type=int, nargs="+", default=[1], help="query heads per kv head (bwd)")
    ap.add_argument("--qk-lanes", type=int, nargs="*", default=[8, 16, 32],
                    help="Q / K lanes per row to time beside the default")
    args = ap.parse_args()
    QK_LANES[:] = args.qk_lanes
    for d in args.hdim:
        if "accuracy" in args.parts:
            guarded(f"accuracy d={d}", lambda d=d: accuracy(d))
        for n in args.seqlen:
            if "quant" in args.parts:
                guarded(f"quantize d={d} N={n}", lambda d=d, n=n: quant_speed(d, n))
            for c in map(bool, args.causal):
                if "attn" in args.parts:
                    guarded(f"attn d={d} N={n} causal={c}", lambda d=d, n=n, c=c: attn_speed(d, n, c))
                if "bwd" in args.parts:
                    for g in args.gqa:
                        b, h = max(1, 16384 // n), 2048 // d
                        guarded(f"bwd d={d} N={n} causal={c} gqa={g}",
                                lambda b=b, n=n, h=h, g=g, d=d, c=c: bwd_speed(b, n, h, h // g, d, c))
    if "bwd-model" in args.parts:
        for shape in MODEL_BWD_SHAPES:
            guarded(f"bwd {shape}", lambda shape=shape: bwd_speed(*shape))
        for d in args.hdim:
            for c in map(bool, args.causal):
                guarded(f"bwd varlen d={d}", lambda d=d, c=c: bwd_varlen_speed(VARLEN_LENS, 16, 4, d, c))


if __name__ == "__main__":
    main()
