"""FP8 (e4m3) forward ops: ``cute_flash::quantize_qkv`` and ``cute_flash::fwd_fp8``, their
packed-sequence twins ``quantize_qkv_varlen`` and ``varlen_fwd_fp8``, and ``fp8_attention`` /
``fp8_attention_varlen`` behind the e4m3 inputs and ``fp8=True`` of ``flash_attn_func`` /
``flash_attn_varlen_func``.

As the other ``cute_flash`` ops: a fake implementation (``torch.compile(fullgraph=True)``), a CPU
implementation from the reference (``reference_fp8``), a CUDA implementation that launches the
kernels (``launch``). ``v_perm``: V travels between the two in the attention kernel's own token
order (``formats.V_PERM16``), as (B, H_kv, d, N_pad) storage -- the ``fp8=True`` path; e4m3 V
from the caller keeps its natural order.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from cute_flash import formats, launch, reference_fp8, reference_fp8_bwd, validate
from cute_flash.formats import FP8

Tensor = torch.Tensor


def default_scale(softmax_scale: float | None, head_dim: int) -> float:
    """The softmax scale: the caller's, or 1 / sqrt(head dim)."""
    return 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale


def _check_cu_data(q: Tensor, k: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int) -> None:
    """The cu_seqlens values (a host sync), in the ops' real implementations before any launch:
    a bad offset would send the kernels' loads out of bounds."""
    validate.check_cu_seqlens(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)


# ---------------------------------------------------------------------------------------------
# cute_flash::quantize_qkv
# ---------------------------------------------------------------------------------------------
def _quant_fake(q: Tensor, k: Tensor, v: Tensor, v_perm: bool) -> tuple[Tensor, ...]:
    b, nk, hkv, d = k.shape
    if v_perm:
        v8 = v.new_empty((b, hkv, d, (nk + 15) // 16 * 16), dtype=FP8)
    else:
        strides = formats.v_storage_strides(b, nk, hkv, d)
        v8 = torch.empty_strided(v.shape, strides, dtype=FP8, device=v.device)
    ds = [q.new_empty((b, hkv), dtype=torch.float32) for _ in range(3)]
    return (torch.empty_like(q, dtype=FP8, memory_format=torch.contiguous_format),
            torch.empty_like(k, dtype=FP8, memory_format=torch.contiguous_format), v8, *ds)


@torch.library.custom_op("cute_flash::quantize_qkv", mutates_args=(), device_types="cpu")
def quantize_qkv_op(q: Tensor, k: Tensor, v: Tensor, rotate: bool, seed: int, v_perm: bool = False
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    q8, k8, v8, *ds = reference_fp8.quantize_qkv_ref(q, k, v, rotate_qk=rotate, seed=seed, v_perm=v_perm)
    return q8.contiguous(), k8.contiguous(), v8, *ds


@quantize_qkv_op.register_kernel("cuda")
def _(q, k, v, rotate, seed, v_perm=False):
    return launch.quantize_qkv(q, k, v, rotate=rotate, seed=seed, v_perm=v_perm)


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
    out, lse = reference_fp8.attention_fp8_ref(q8, k8, v8, q_descale, k_descale, v_descale,
                                               softmax_scale=softmax_scale, causal=causal,
                                               window_size=(window_left, window_right), v_perm=v_perm)
    return out.to(out_dtype).contiguous(), lse.contiguous()


@fwd_fp8.register_kernel("cuda")
def _(q8, k8, v8, q_descale, k_descale, v_descale, softmax_scale, causal, window_left, window_right,
      out_dtype, v_perm=False):
    out, lse = _fwd_fp8_fake(q8, out_dtype)
    b, nk, hkv, d = k8.shape
    if not v_perm and v8.stride() != formats.v_storage_strides(b, nk, hkv, d):
        # A caller's V that must be re-laid out anyway goes into the kernel's token order (same
        # copy): P then needs no exchange between lanes. quantize_qkv's V is used as it is.
        v8 = launch.relayout_v(v8, v_perm=True)
        v_perm = True
    launch.run_fwd_fp8(q8.contiguous(), k8.contiguous(), v8, q_descale, k_descale, v_descale, out, lse,
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
    # v_aligned: formats.varlen_v_offsets's bound, round16(T) + 16 S tokens.
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
    _check_cu_data(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q8, k8, v8, *ds = reference_fp8.quantize_qkv_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                            rotate_qk=rotate, seed=seed)
    v8 = formats.v_varlen_aligned(v8, cu_seqlens_k)[0] if v_aligned else formats.token_contiguous_varlen(v8)
    return q8.contiguous(), k8.contiguous(), v8, *ds


@quantize_qkv_varlen_op.register_kernel("cuda")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, rotate, seed, v_aligned=False):
    _check_cu_data(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return launch.quantize_qkv_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
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
    _check_cu_data(q8, k8, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if v_aligned:
        v8 = formats.v_varlen_packed(v8, cu_seqlens_k, k8.shape[0])
    out, lse = reference_fp8.attention_fp8_varlen_ref(q8, k8, v8, cu_seqlens_q, cu_seqlens_k, q_descale,
                                                      k_descale, v_descale, softmax_scale=softmax_scale,
                                                      causal=causal, window_size=(window_left, window_right))
    return out.to(out_dtype).contiguous(), lse.contiguous()


@varlen_fwd_fp8.register_kernel("cuda")
def _(q8, k8, v8, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_descale, k_descale, v_descale,
      softmax_scale, causal, window_left, window_right, out_dtype, v_aligned=False):
    _check_cu_data(q8, k8, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
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
        v_store, cu_v = v8, formats.varlen_v_offsets(cu_seqlens_k, k8.shape[0])[0]
    else:
        v_store, cu_v = launch.relayout_v_varlen(v8, cu_seqlens_k, max_seqlen_k)
    launch.run_fwd_fp8(q8.contiguous(), k8.contiguous(), v_store, q_descale, k_descale, v_descale, out, lse,
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
def _descales_or_ones(descales: tuple[Tensor | None, ...], shape: tuple[int, int],
                      device: torch.device) -> list[Tensor]:
    """The caller's descales, a missing one meaning 1 (FA3's convention)."""
    return [x if x is not None else torch.ones(shape, dtype=torch.float32, device=device) for x in descales]


def fp8_attention(q: Tensor, k: Tensor, v: Tensor, *, softmax_scale: float | None, causal: bool,
                  window_size: tuple[int, int], descales: tuple[Tensor | None, ...], quantize: bool,
                  seed: int = 0, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """(out, lse) of FP8 attention: e4m3 inputs with their descales (missing ones = 1), or, with
    ``quantize``, bf16 / fp16 inputs quantized with the Hadamard rotation first (output in their
    dtype; e4m3 inputs give bf16), differentiable (``Fp8Attention``: the FP8 backward)."""
    if quantize:
        validate.check_fp8_quantize_request(q, k, v, descales)
        validate.check_fp8_heads(q, k, v)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            scale = default_scale(softmax_scale, q.shape[-1])
            validate.check_fp8_bwd(q, k, v, window_size)
            return Fp8Attention.apply(q, k, v, float(scale), bool(causal), int(window_size[0]),
                                      int(window_size[1]), int(seed), bool(deterministic))
        out_dtype = q.dtype
        # V straight into the kernel's token order: P then needs no exchange between lanes.
        q, k, v, *ds = torch.ops.cute_flash.quantize_qkv(q, k, v, True, int(seed), True)
    else:
        shape = (q.shape[0], k.shape[2]) if q.dim() == 4 and k.dim() == 4 else (1, 1)
        ds, out_dtype = _descales_or_ones(descales, shape, q.device), torch.bfloat16
        validate.check_fp8_inputs(q, k, v, tuple(ds))
    scale = default_scale(softmax_scale, q.shape[-1])
    return torch.ops.cute_flash.fwd_fp8(q, k, v, *ds, float(scale), bool(causal), int(window_size[0]),
                                        int(window_size[1]), out_dtype, quantize)


class Fp8Attention(torch.autograd.Function):
    """``fp8=True`` attention with its FP8 backward: the forward keeps what the e4m3 kernels read
    (Q8, K8 rotated, the descales, O, the LSE; V as given, which the backward needs in natural
    layout, not the forward's); the backward runs ``cute_flash::bwd_fp8`` and
    hands back the gradients of the unquantized inputs (straight through the rounding, the
    rotation undone)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, window_left: int,
                window_right: int, seed: int, deterministic: bool) -> tuple[Tensor, Tensor]:
        q8, k8, v8, *ds = torch.ops.cute_flash.quantize_qkv(q, k, v, True, seed, True)
        out, lse = torch.ops.cute_flash.fwd_fp8(q8, k8, v8, *ds, scale, causal, window_left, window_right,
                                                q.dtype, True)
        ctx.save_for_backward(q8, k8, v, *ds, out, lse)
        ctx.args = (scale, causal, seed, deterministic)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q8, k8, v, qd, kd, vd, out, lse = ctx.saved_tensors
        scale, causal, seed, deterministic = ctx.args
        if dout is None and dlse is None:
            return (None,) * 9
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = torch.ops.cute_flash.bwd_fp8(dout, q8, k8, v, qd, kd, vd, out, lse, dlse, scale, causal,
                                                  seed, deterministic)
        return dq, dk, dv, None, None, None, None, None, None


def _bwd_fp8_fake(dout: Tensor, k8: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    b, nk, hkv, d = k8.shape
    return (torch.empty_like(dout), *(dout.new_empty((b, nk, hkv, d)) for _ in range(2)))


@torch.library.custom_op("cute_flash::bwd_fp8", mutates_args=(), device_types="cpu")
def bwd_fp8(dout: Tensor, q8: Tensor, k8: Tensor, v: Tensor, q_descale: Tensor, k_descale: Tensor,
            v_descale: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None, softmax_scale: float,
            causal: bool, seed: int, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) in dout's dtype of the ``fp8=True`` forward (Q8 / K8 rotated with ``seed``, ``v``
    the 16-bit V it quantized at ``v_descale``): the e4m3 backward on sm90, its recipe in PyTorch on
    the CPU (``reference_fp8_bwd.fp8_bwd_from_saved``)."""
    v8 = launch.quantize_like(v, v_descale)
    grads = reference_fp8_bwd.fp8_bwd_from_saved(dout, q8, k8, v8, q_descale, k_descale, v_descale, out,
                                                 lse, dlse, softmax_scale=softmax_scale, causal=causal,
                                                 seed=seed)
    return tuple(g.to(dout.dtype).contiguous() for g in grads)


@bwd_fp8.register_kernel("cuda")
def _(dout, q8, k8, v, q_descale, k_descale, v_descale, out, lse, dlse, softmax_scale, causal, seed,
      deterministic):
    return launch.run_bwd_fp8(dout, q8, k8, v, q_descale, k_descale, v_descale, out, lse,
                              softmax_scale=softmax_scale, causal=causal, deterministic=deterministic,
                              dlse=dlse, rotation_seed=seed)


@bwd_fp8.register_fake
def _(dout, q8, k8, v, q_descale, k_descale, v_descale, out, lse, dlse, softmax_scale, causal, seed,
      deterministic):
    return _bwd_fp8_fake(dout, k8)


def fp8_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                         max_seqlen_q: int, max_seqlen_k: int, *, softmax_scale: float | None, causal: bool,
                         window_size: tuple[int, int], descales: tuple[Tensor | None, ...], quantize: bool,
                         seed: int = 0, deterministic: bool = False) -> tuple[Tensor, Tensor]:
    """``fp8_attention`` on packed sequences (``flash_attn_varlen_func``): descales per (sequence,
    kv head), (num_seqs, H_kv); differentiable with ``quantize`` (``Fp8AttentionVarlen``)."""
    if quantize:
        validate.check_fp8_quantize_request(q, k, v, descales)
        validate.check_fp8_heads_varlen(q, k, v)
        validate.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                                  max_seqlen_k, check_data=False)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            validate.check_fp8_bwd(q, k, v, window_size)
            scale = default_scale(softmax_scale, q.shape[-1])
            return Fp8AttentionVarlen.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                            int(max_seqlen_k), float(scale), bool(causal),
                                            int(window_size[0]), int(window_size[1]), int(seed),
                                            bool(deterministic))
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
        validate.check_fp8_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                         int(max_seqlen_k), tuple(ds))
    scale = default_scale(softmax_scale, q.shape[-1])
    return torch.ops.cute_flash.varlen_fwd_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                               int(max_seqlen_k), *ds, float(scale), bool(causal),
                                               int(window_size[0]), int(window_size[1]), out_dtype,
                                               bool(quantize))


class Fp8AttentionVarlen(torch.autograd.Function):
    """``Fp8Attention`` on packed sequences: the descales per (sequence, kv head), the backward
    ``cute_flash::varlen_bwd_fp8``."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool, window_left: int,
                window_right: int, seed: int, deterministic: bool) -> tuple[Tensor, Tensor]:
        q8, k8, v8, *ds = torch.ops.cute_flash.quantize_qkv_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                                    max_seqlen_q, max_seqlen_k, True, seed,
                                                                    True)
        out, lse = torch.ops.cute_flash.varlen_fwd_fp8(q8, k8, v8, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                       max_seqlen_k, *ds, scale, causal, window_left,
                                                       window_right, q.dtype, True)
        ctx.save_for_backward(q8, k8, v, cu_seqlens_q, cu_seqlens_k, *ds, out, lse)
        ctx.args = (max_seqlen_q, max_seqlen_k, scale, causal, seed, deterministic)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q8, k8, v, cu_q, cu_k, qd, kd, vd, out, lse = ctx.saved_tensors
        max_q, max_k, scale, causal, seed, deterministic = ctx.args
        if dout is None and dlse is None:
            return (None,) * 13
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = torch.ops.cute_flash.varlen_bwd_fp8(dout, q8, k8, v, cu_q, cu_k, max_q, max_k, qd, kd,
                                                         vd, out, lse, dlse, scale, causal, seed,
                                                         deterministic)
        return (dq, dk, dv) + (None,) * 10


@torch.library.custom_op("cute_flash::varlen_bwd_fp8", mutates_args=(), device_types="cpu")
def varlen_bwd_fp8(dout: Tensor, q8: Tensor, k8: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                   cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, q_descale: Tensor,
                   k_descale: Tensor, v_descale: Tensor, out: Tensor, lse: Tensor, dlse: Tensor | None,
                   softmax_scale: float, causal: bool, seed: int, deterministic: bool
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """``bwd_fp8`` on packed sequences: (T, H, d) tensors, (S, H_kv) descales, lse / dlse (H, T_q)."""
    _check_cu_data(q8, k8, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    v8 = launch.quantize_like(v, v_descale, cu_seqlens_k, max_seqlen_k)
    grads = reference_fp8_bwd.fp8_bwd_from_saved_varlen(dout, q8, k8, v8, cu_seqlens_q, cu_seqlens_k,
                                                        q_descale, k_descale, v_descale, out, lse, dlse,
                                                        softmax_scale=softmax_scale, causal=causal, seed=seed)
    return tuple(g.to(dout.dtype).contiguous() for g in grads)


@varlen_bwd_fp8.register_kernel("cuda")
def _(dout, q8, k8, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_descale, k_descale,
      v_descale, out, lse, dlse, softmax_scale, causal, seed, deterministic):
    _check_cu_data(q8, k8, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return launch.run_bwd_fp8(dout, q8, k8, v, q_descale, k_descale, v_descale, out, lse,
                              softmax_scale=softmax_scale, causal=causal, deterministic=deterministic,
                              dlse=dlse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                              max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, rotation_seed=seed)


@varlen_bwd_fp8.register_fake
def _(dout, q8, k8, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, q_descale, k_descale,
      v_descale, out, lse, dlse, softmax_scale, causal, seed, deterministic):
    return torch.empty_like(dout), *(dout.new_empty(k8.shape) for _ in range(2))
