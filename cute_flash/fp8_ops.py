"""FP8 (e4m3) forward ops (issue 5): ``cute_flash::quantize_qkv`` and ``cute_flash::fwd_fp8``,
their packed-sequence twins ``quantize_qkv_varlen`` and ``varlen_fwd_fp8``, and
``fp8_attention`` / ``fp8_attention_varlen`` behind the e4m3 inputs and ``fp8=True`` of
``flash_attn_func`` / ``flash_attn_varlen_func``.

As the other ``cute_flash`` ops: a fake implementation (``torch.compile(fullgraph=True)``), a CPU
implementation from the reference (``fp8_ref``), a CUDA implementation that launches the kernels
(``quant.quantize_qkv``, ``fwd_fp8.run_fwd_fp8``). ``v_perm``: V travels between the two in the
attention kernel's own token order (``fp8_ref.V_PERM16``), as (B, H_kv, d, N_pad) storage -- the
``fp8=True`` path; e4m3 V from the caller keeps its natural order.
"""

from __future__ import annotations

import math

import torch

from cute_flash import fp8_ref

Tensor = torch.Tensor
FP8 = torch.float8_e4m3fn
FP8_HDIMS = (64, 128, 256)
# Re-lay V for the FP8 kernels with the V quantize kernel at scale 1 (``quant.relayout_v`` for a
# caller's dense e4m3 V, ``quant.relayout_v_varlen`` for every packed V; 16-byte stores) instead of
# torch byte gathers, which measured ~90 GB/s: at B = 8, N = 2k, d = 128 the caller-V FP8 forward
# ran at 363 TFLOP/s against 735-756 with quantize_qkv's V, and varlen at 265. Bit-exact vs
# fp8_ref on the H200 (tests/test_quant.py, session 7); False falls back to the torch gathers.
RELAYOUT_V_KERNEL = True


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------
def check_heads(q: Tensor, k: Tensor, v: Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, N, H, d), got shape {tuple(t.shape)}")
    b, _, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k and v must be (B, N_k, H_kv, d) with q's B and d: {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if d not in FP8_HDIMS:
        raise ValueError(f"FP8 attention: head dim {d} not supported {FP8_HDIMS}")
    if k.shape[2] == 0 or h % k.shape[2]:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k.shape[2]})")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v must be on one device")


def _check_e4m3(q8: Tensor, k8: Tensor, v8: Tensor) -> None:
    for name, t in (("q", q8), ("k", k8), ("v", v8)):
        if t.dtype != FP8:
            raise TypeError(f"FP8 attention: {name} must be torch.float8_e4m3fn, got {t.dtype}")
        if t.requires_grad:
            raise ValueError("FP8 attention is forward-only: the e4m3 inputs must not require grad")


def _check_descales(descales: tuple[Tensor, ...], shape: tuple[int, int], rows: str, device) -> None:
    for name, t in zip(("q_descale", "k_descale", "v_descale"), descales, strict=True):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or t.device != device:
            raise ValueError(f"{name} must be float32 of shape ({rows}, H_kv) = {shape} on {device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")


def check_fp8_inputs(q8: Tensor, k8: Tensor, v8: Tensor, descales: tuple[Tensor, ...]) -> None:
    _check_e4m3(q8, k8, v8)
    check_heads(q8, k8, v8)
    _check_descales(descales, (q8.shape[0], k8.shape[2]), "B", q8.device)


def check_heads_varlen(q: Tensor, k: Tensor, v: Tensor) -> None:
    """Packed q (T_q, H, d), k / v (T_k, H_kv, d): the shape rules of ``check_heads``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be packed (T, H, d), got shape {tuple(t.shape)}")
    check_heads(q[None], k[None], v[None])


def check_cu_data(q: Tensor, k: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int) -> None:
    """The cu_seqlens values (a host sync), in the ops' real implementations before any launch:
    a bad offset would send the kernels' loads out of bounds."""
    from cute_flash import validate

    validate.check_cu_seqlens(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)


def check_fp8_varlen_inputs(q8: Tensor, k8: Tensor, v8: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
                            max_k: int, descales: tuple[Tensor, ...]) -> None:
    """Everything but the cu_seqlens values (``check_cu_data``): also runs while tracing."""
    from cute_flash import validate

    _check_e4m3(q8, k8, v8)
    check_heads_varlen(q8, k8, v8)
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, Tensor) or cu.device != q8.device:
            raise ValueError(f"{name} must be a tensor on {q8.device}")
    validate.check_cu_seqlens(cu_q, cu_k, q8.shape[0], k8.shape[0], max_q, max_k, check_data=False)
    _check_descales(descales, (cu_q.shape[0] - 1, k8.shape[1]), "num_seqs", q8.device)


# ---------------------------------------------------------------------------------------------
# cute_flash::quantize_qkv
# ---------------------------------------------------------------------------------------------
def _quant_fake(q: Tensor, k: Tensor, v: Tensor, v_perm: bool) -> tuple[Tensor, ...]:
    b, nk, hkv, d = k.shape
    if v_perm:
        v8 = v.new_empty((b, hkv, d, (nk + 15) // 16 * 16), dtype=FP8)
    else:
        strides = fp8_ref.v_storage_strides(b, nk, hkv, d)
        v8 = torch.empty_strided(v.shape, strides, dtype=FP8, device=v.device)
    ds = [q.new_empty((b, hkv), dtype=torch.float32) for _ in range(3)]
    return (torch.empty_like(q, dtype=FP8, memory_format=torch.contiguous_format),
            torch.empty_like(k, dtype=FP8, memory_format=torch.contiguous_format), v8, *ds)


@torch.library.custom_op("cute_flash::quantize_qkv", mutates_args=(), device_types="cpu")
def quantize_qkv_op(q: Tensor, k: Tensor, v: Tensor, rotate: bool, seed: int, v_perm: bool = False
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    q8, k8, v8, *ds = fp8_ref.quantize_qkv_ref(q, k, v, rotate_qk=rotate, seed=seed, v_perm=v_perm)
    return q8.contiguous(), k8.contiguous(), v8, *ds


@quantize_qkv_op.register_kernel("cuda")
def _(q, k, v, rotate, seed, v_perm=False):
    from cute_flash.quant import quantize_qkv

    return quantize_qkv(q, k, v, rotate=rotate, seed=seed, v_perm=v_perm)


@quantize_qkv_op.register_fake
def _(q, k, v, rotate, seed, v_perm=False):
    return _quant_fake(q, k, v, v_perm)


# ---------------------------------------------------------------------------------------------
# cute_flash::fwd_fp8
# ---------------------------------------------------------------------------------------------
def _fwd_fp8_fake(q8: Tensor, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    b, nq, h, d = q8.shape
    return (q8.new_empty((b, nq, h, d), dtype=out_dtype), q8.new_empty((b, h, nq), dtype=torch.float32))


@torch.library.custom_op("cute_flash::fwd_fp8", mutates_args=(), device_types="cpu")
def fwd_fp8(q8: Tensor, k8: Tensor, v8: Tensor, q_descale: Tensor, k_descale: Tensor, v_descale: Tensor,
            softmax_scale: float, causal: bool, window_left: int, window_right: int,
            out_dtype: torch.dtype, v_perm: bool = False) -> tuple[Tensor, Tensor]:
    out, lse = fp8_ref.attention_fp8_ref(q8, k8, v8, q_descale, k_descale, v_descale,
                                         softmax_scale=softmax_scale, causal=causal,
                                         window_size=(window_left, window_right), v_perm=v_perm)
    return out.to(out_dtype).contiguous(), lse.contiguous()


@fwd_fp8.register_kernel("cuda")
def _(q8, k8, v8, q_descale, k_descale, v_descale, softmax_scale, causal, window_left, window_right,
      out_dtype, v_perm=False):
    from cute_flash.fwd_fp8 import run_fwd_fp8

    out, lse = _fwd_fp8_fake(q8, out_dtype)
    b, nk, hkv, d = k8.shape
    if not v_perm and v8.stride() != fp8_ref.v_storage_strides(b, nk, hkv, d):
        # A caller's V that must be re-laid out anyway goes into the kernel's token order (same
        # copy): P then needs no exchange between lanes. quantize_qkv's V is used as it is.
        if RELAYOUT_V_KERNEL:
            from cute_flash.quant import relayout_v

            v8 = relayout_v(v8, v_perm=True)
        else:
            v8 = fp8_ref.v_kernel_order(v8)
        v_perm = True
    run_fwd_fp8(q8.contiguous(), k8.contiguous(), v8, q_descale, k_descale, v_descale, out, lse,
                softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                v_perm=v_perm)
    return out, lse


@fwd_fp8.register_fake
def _(q8, k8, v8, q_descale, k_descale, v_descale, softmax_scale, causal, window_left, window_right,
      out_dtype, v_perm=False):
    return _fwd_fp8_fake(q8, out_dtype)


# ---------------------------------------------------------------------------------------------
# Packed sequences: cute_flash::quantize_qkv_varlen and cute_flash::varlen_fwd_fp8
# ---------------------------------------------------------------------------------------------
def _quant_varlen_fake(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, v_aligned: bool = False
                       ) -> tuple[Tensor, ...]:
    t, hkv, d = k.shape
    # v_aligned: fp8_ref.varlen_v_offsets's bound, round16(T) + 16 S tokens.
    t_pad = (t + 15) // 16 * 16 + (16 * (cu_q.shape[0] - 1) if v_aligned else 0)
    shape = (t_pad, hkv, d) if v_aligned else tuple(v.shape)
    v8 = torch.empty_strided(shape, (1, d * t_pad, t_pad), dtype=FP8, device=v.device)
    ds = [q.new_empty((cu_q.shape[0] - 1, hkv), dtype=torch.float32) for _ in range(3)]
    return (torch.empty_like(q, dtype=FP8, memory_format=torch.contiguous_format),
            torch.empty_like(k, dtype=FP8, memory_format=torch.contiguous_format), v8, *ds)


@torch.library.custom_op("cute_flash::quantize_qkv_varlen", mutates_args=(), device_types="cpu")
def quantize_qkv_varlen_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, rotate: bool, seed: int,
                           v_aligned: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    check_cu_data(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q8, k8, v8, *ds = fp8_ref.quantize_qkv_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, rotate_qk=rotate,
                                                      seed=seed)
    v8 = fp8_ref.v_varlen_aligned(v8, cu_seqlens_k)[0] if v_aligned else fp8_ref.token_contiguous_varlen(v8)
    return q8.contiguous(), k8.contiguous(), v8, *ds


@quantize_qkv_varlen_op.register_kernel("cuda")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, rotate, seed, v_aligned=False):
    from cute_flash.quant import quantize_qkv_varlen

    check_cu_data(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return quantize_qkv_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               rotate=rotate, seed=seed, v_aligned=v_aligned)


@quantize_qkv_varlen_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, rotate, seed, v_aligned=False):
    return _quant_varlen_fake(q, k, v, cu_seqlens_q, v_aligned)


def _varlen_fwd_fp8_fake(q8: Tensor, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    t, h, d = q8.shape
    return q8.new_empty((t, h, d), dtype=out_dtype), q8.new_empty((h, t), dtype=torch.float32)


@torch.library.custom_op("cute_flash::varlen_fwd_fp8", mutates_args=(), device_types="cpu")
def varlen_fwd_fp8(q8: Tensor, k8: Tensor, v8: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                   max_seqlen_q: int, max_seqlen_k: int, q_descale: Tensor, k_descale: Tensor,
                   v_descale: Tensor, softmax_scale: float, causal: bool, window_left: int,
                   window_right: int, out_dtype: torch.dtype, v_aligned: bool = False
                   ) -> tuple[Tensor, Tensor]:
    """``v_aligned``: v8 is ``quantize_qkv_varlen(..., v_aligned=True)``'s V, already in the
    kernel's layout."""
    check_cu_data(q8, k8, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if v_aligned:
        v8 = fp8_ref.v_varlen_packed(v8, cu_seqlens_k, k8.shape[0])
    out, lse = fp8_ref.attention_fp8_varlen_ref(q8, k8, v8, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale,
                                                v_descale, softmax_scale=softmax_scale, causal=causal,
                                                window_size=(window_left, window_right))
    return out.to(out_dtype).contiguous(), lse.contiguous()


@varlen_fwd_fp8.register_kernel("cuda")
def _(q8, k8, v8, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_descale, k_descale, v_descale,
      softmax_scale, causal, window_left, window_right, out_dtype, v_aligned=False):
    from cute_flash.fwd_fp8 import run_fwd_fp8

    check_cu_data(q8, k8, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    out, lse = _varlen_fwd_fp8_fake(q8, out_dtype)
    if q8.shape[0] == 0:
        return out, lse
    if k8.shape[0] == 0:
        # No keys in any sequence: the kernel's TMA needs a non-empty tensor; attention over
        # nothing is 0 with LSE -inf.
        return out.zero_(), lse.fill_(float("-inf"))
    # P V reads V with the tokens contiguous (K-major B operand), each sequence's from a 16-aligned
    # start (TMA): one byte copy of V into that layout (natural token order), unless quantize
    # wrote it there.
    if v_aligned:
        v_store, cu_v = v8, fp8_ref.varlen_v_offsets(cu_seqlens_k, k8.shape[0])[0]
    elif RELAYOUT_V_KERNEL:
        from cute_flash.quant import relayout_v_varlen

        v_store, cu_v = relayout_v_varlen(v8, cu_seqlens_k, max_seqlen_k)
    else:
        v_store, cu_v = fp8_ref.v_varlen_aligned(v8, cu_seqlens_k)
    run_fwd_fp8(q8.contiguous(), k8.contiguous(), v_store, q_descale, k_descale, v_descale, out, lse,
                softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                cu_seqlens_v=cu_v)
    return out, lse


@varlen_fwd_fp8.register_fake
def _(q8, k8, v8, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_descale, k_descale, v_descale,
      softmax_scale, causal, window_left, window_right, out_dtype, v_aligned=False):
    return _varlen_fwd_fp8_fake(q8, out_dtype)


# ---------------------------------------------------------------------------------------------
# The flash_attn_func path
# ---------------------------------------------------------------------------------------------
def _check_quantize_inputs(q: Tensor, k: Tensor, v: Tensor, descales: tuple[Tensor | None, ...]) -> None:
    """``fp8=True``: what quantizing needs of the 16-bit inputs (shapes are checked per layout)."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"fp8=True quantizes bf16 / fp16 inputs, got {q.dtype}")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise TypeError("q, k, v must share a dtype")
    if any(t.requires_grad for t in (q, k, v)):
        raise ValueError("fp8=True is forward-only: the inputs must not require grad")
    if any(x is not None for x in descales):
        raise ValueError("fp8=True computes the descales itself; pass e4m3 inputs to give your own")


def _descales_or_ones(descales: tuple[Tensor | None, ...], shape: tuple[int, int],
                      device: torch.device) -> list[Tensor]:
    """The caller's descales, a missing one meaning 1 (FA3's convention)."""
    return [x if x is not None else torch.ones(shape, dtype=torch.float32, device=device) for x in descales]


def fp8_attention(q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: float | None, causal: bool,
                  window_size: tuple[int, int], descales: tuple[Tensor | None, ...], quantize: bool,
                  seed: int = 0) -> tuple[Tensor, Tensor]:
    """(out, lse) of FP8 attention: e4m3 inputs with their descales (missing ones = 1), or, with
    ``quantize``, bf16 / fp16 inputs quantized with the Hadamard rotation first (output in their
    dtype; e4m3 inputs give bf16)."""
    if quantize:
        _check_quantize_inputs(q, k, v, descales)
        check_heads(q, k, v)
        out_dtype = q.dtype
        # V straight into the kernel's token order: P then needs no exchange between lanes.
        q, k, v, *ds = torch.ops.cute_flash.quantize_qkv(q, k, v, True, int(seed), True)
    else:
        shape = (q.shape[0], k.shape[2]) if q.dim() == 4 and k.dim() == 4 else (1, 1)
        ds, out_dtype = _descales_or_ones(descales, shape, q.device), torch.bfloat16
        check_fp8_inputs(q, k, v, tuple(ds))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.cute_flash.fwd_fp8(q, k, v, *ds, float(scale), bool(causal), int(window_size[0]),
                                        int(window_size[1]), out_dtype, quantize)


def fp8_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, *, softmax_scale: float | None, causal: bool,
                         window_size: tuple[int, int], descales: tuple[Tensor | None, ...], quantize: bool,
                         seed: int = 0) -> tuple[Tensor, Tensor]:
    """``fp8_attention`` on packed sequences (``flash_attn_varlen_func``): descales per (sequence,
    kv head), (num_seqs, H_kv)."""
    if quantize:
        _check_quantize_inputs(q, k, v, descales)
        check_heads_varlen(q, k, v)
        from cute_flash import validate

        validate.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                                  max_seqlen_k, check_data=False)
        out_dtype = q.dtype
        # V straight into the kernel's layout (each sequence 16-aligned): no re-layout after.
        # (The e4m3 tensors are ours, built from inputs checked above.)
        q, k, v, *ds = torch.ops.cute_flash.quantize_qkv_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                                 int(max_seqlen_q), int(max_seqlen_k), True,
                                                                 int(seed), True)
    else:
        cu = cu_seqlens_q
        num_seqs = cu.shape[0] - 1 if isinstance(cu, Tensor) and cu.dim() == 1 else 1
        shape = (num_seqs, k.shape[1]) if k.dim() == 3 else (1, 1)
        ds, out_dtype = _descales_or_ones(descales, shape, q.device), torch.bfloat16
        check_fp8_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                tuple(ds))
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.cute_flash.varlen_fwd_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                               int(max_seqlen_k), *ds, float(scale), bool(causal),
                                               int(window_size[0]), int(window_size[1]), out_dtype,
                                               bool(quantize))
