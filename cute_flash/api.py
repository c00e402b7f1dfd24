"""Public attention functions. All are differentiable (autograd runs through the ``cute_flash``
custom ops) and traceable by ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cute_flash import ops as _ops  # (also registers torch.ops.cute_flash.*)
from cute_flash import ops_fp8, ops_kvcache, ops_mods, validate
from cute_flash.block_mask import BlockMask
from cute_flash.formats import FP8


def _op_args(q: torch.Tensor, softmax_scale: float | None, window_size: Sequence[int],
             softcap: float) -> tuple[float, int, int, float]:
    """Scalars checked here, before anything is traced or launched, and normalised to the
    op schema's types."""
    scale = ops_fp8.default_scale(softmax_scale, q.shape[-1])
    validate.check_scalars(softmax_scale=scale, window_size=window_size, softcap=softcap)
    return float(scale), int(window_size[0]), int(window_size[1]), float(softcap)


def flash_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float | None = None,
                    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                    deterministic: bool = False, return_lse: bool = False, *,
                    q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
                    v_descale: torch.Tensor | None = None, fp8: bool = False,
                    sinks: torch.Tensor | None = None, score_mod: object = None, mask_mod: object = None,
                    aux: Sequence[torch.Tensor] = (), block_mask: BlockMask | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention on (B, N, H, d) tensors.

    q (B, Nq, H, d), k (B, Nk, Hkv, d), v (B, Nk, Hkv, dv), fp16 or bf16; H a multiple of Hkv
    (GQA/MQA). Causal and window masks are bottom-right aligned when Nq != Nk; ``window_size`` is
    (left, right) with -1 unbounded. ``softcap > 0`` caps the scaled scores with
    ``softcap * tanh(s / softcap)``. ``deterministic`` makes the backward bitwise reproducible.

    Returns out (B, Nq, H, dv), or (out, lse) with lse (B, H, Nq) float32 (natural log; -inf for
    a query that sees no key, whose output is 0).

    ``sinks`` (H,) float32: learnable attention sinks (gpt-oss), one logit per query head that
    joins every row's softmax denominator (beside the scaled, capped scores) and contributes no
    value; the LSE includes it. Differentiable (its gradient is returned like q's).

    ``score_mod(score, b, h, q_idx, kv_idx, aux)`` / ``mask_mod(b, h, q_idx, kv_idx, aux)``:
    CuTe-DSL functions (FlexAttention's signatures plus ``aux``, the tuple of up to four tensors
    passed here) compiled into the forward and backward kernels, applied to the scaled scores
    before the masks (``cute_flash.device.mods``: what they may use, and built-ins such as
    ``alibi()``). A mod is a DSL function, a (DSL function, torch function[, score_mod_bwd])
    tuple or a ``Mod``; CPU tensors need the torch form, gradients through a score_mod its
    derivative ``score_mod_bwd(grad, score, b, h, q_idx, kv_idx, aux, aux_grads)``, which also
    gives the gradients of the floating-point aux tensors that require grad. ``block_mask``: the
    mask_mod's ``create_block_mask(mask_mod, B, H, Nq, Nk)``, made once and reused: the kernels
    skip the blocks it leaves empty and run the full ones without the mask_mod.

    FP8 (d in 64 / 128 / 256, d_v = d; no softcap): e4m3 q, k, v with fp32 ``q_descale`` /
    ``k_descale`` / ``v_descale`` of shape (B, H_kv) (FA3's convention; 1 if omitted) give a bf16
    output (no gradient); ``fp8=True`` on bf16 / fp16 inputs quantizes them first
    (``quantize_qkv``: Hadamard rotation of Q and K, per-(batch, kv head) scales) and returns
    their dtype, differentiable at d = 64 / 128 without a sliding window (the e4m3 backward,
    ``ops_fp8.Fp8Attention``). Hopper kernels on sm90 tensors, the references (``reference_fp8``,
    ``reference_fp8_bwd``) on CPU tensors.
    """
    flags = {"causal": causal, "deterministic": deterministic, "return_lse": return_lse, "fp8": fp8}
    validate.check_call({"q": q, "k": k, "v": v}, flags)
    if sinks is not None:
        validate.check_sinks(sinks, q)
    if block_mask is not None and mask_mod is None:
        raise ValueError("block_mask goes with the mask_mod it was made from")
    if score_mod is not None or mask_mod is not None:
        out, lse = _mods_call(q, k, v, fp8, softmax_scale, causal, window_size, softcap, deterministic, sinks,
                              score_mod, mask_mod, aux, block_mask=block_mask)
        return (out, lse) if return_lse else out
    if fp8 or q.dtype == FP8:
        _fp8_checks(softcap, sinks)
        _op_args(q, softmax_scale, window_size, 0.0)  # the scalars' checks
        out, lse = ops_fp8.fp8_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size,
                                         descales=(q_descale, k_descale, v_descale), quantize=fp8,
                                         deterministic=deterministic)
        return (out, lse) if return_lse else out
    if any(x is not None for x in (q_descale, k_descale, v_descale)):
        raise ValueError("q_descale / k_descale / v_descale go with e4m3 inputs")
    scale, wl, wr, cap = _op_args(q, softmax_scale, window_size, softcap)
    out, lse = _ops.attention_fwd(q, k, v, scale, bool(causal), wl, wr, cap, bool(deterministic), sinks=sinks)
    return (out, lse) if return_lse else out


def _mods_call(q, k, v, fp8: bool, softmax_scale, causal, window_size, softcap, deterministic, sinks,
               score_mod, mask_mod, aux, **varlen) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a call with a score_mod / mask_mod (``ops_mods``)."""
    if fp8 or q.dtype == FP8:
        raise NotImplementedError("FP8 attention does not take score_mod / mask_mod yet")
    scale, wl, wr, _ = _op_args(q, softmax_scale, window_size, 0.0)
    return ops_mods.mods_attention(q, k, v, scale=scale, causal=bool(causal), window=(wl, wr),
                                   softcap=float(softcap), deterministic=bool(deterministic), sinks=sinks,
                                   score_mod=score_mod, mask_mod=mask_mod, aux=aux, **varlen)


def _fp8_checks(softcap: float, sinks: torch.Tensor | None) -> None:
    if softcap != 0.0:
        raise ValueError("FP8 attention has no softcap")
    if sinks is not None:
        raise NotImplementedError("FP8 attention does not take sinks yet")


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotate: bool = True, seed: int = 0
                 ) -> tuple[torch.Tensor, ...]:
    """(q8, k8, v8, q_descale, k_descale, v_descale) for the FP8 forward: Q and K multiplied by the
    same random-sign Hadamard matrix D H / sqrt(d) along the head dim (``rotate``; Q K^T is
    unchanged, outliers are spread), e4m3 with saturation and per-(batch, kv head) scales,
    descales fp32 (B, H_kv); v8 is (B, N, H_kv, d) over token-contiguous storage. Inputs bf16 /
    fp16 (B, N, H, d) / (B, N, H_kv, d), d in 64 / 128 / 256."""
    validate.check_call({"q": q, "k": k, "v": v}, {"rotate": rotate})
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError("quantize_qkv: q, k, v must all be bf16 or all fp16")
    validate.check_fp8_heads(q, k, v)
    return tuple(torch.ops.cute_flash.quantize_qkv(q, k, v, bool(rotate), int(seed)))


def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                           cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           deterministic: bool = False, return_lse: bool = False, *,
                           q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
                           v_descale: torch.Tensor | None = None, fp8: bool = False,
                           sinks: torch.Tensor | None = None, score_mod: object = None,
                           mask_mod: object = None, aux: Sequence[torch.Tensor] = (),
                           block_mask: BlockMask | None = None
                           ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention on packed variable-length sequences.

    q (Tq, H, d), k (Tk, Hkv, d), v (Tk, Hkv, dv); sequence b is rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k/v
    (int32, length B+1, starting at 0). ``max_seqlen_q``/``max_seqlen_k`` must be at least the
    longest sequence. Masks are aligned per sequence. Returns out (Tq, H, dv), or (out, lse) with
    lse (H, Tq) float32.

    FP8 as in ``flash_attn_func``, with descales per (sequence, kv head): (B, H_kv) for the B
    sequences. ``fp8=True`` quantizes with one scale per sequence and kv head, differentiable as
    in ``flash_attn_func`` (``ops_fp8.Fp8AttentionVarlen``). ``sinks``,
    ``score_mod``, ``mask_mod``, ``aux`` and ``block_mask`` as in ``flash_attn_func`` (a mod's ``b``
    is the sequence, its positions count from the sequence's start).
    """
    flags = {"causal": causal, "deterministic": deterministic, "return_lse": return_lse, "fp8": fp8}
    tensors = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    validate.check_call(tensors, flags)
    if sinks is not None:
        validate.check_sinks(sinks, q)
    if block_mask is not None and mask_mod is None:
        raise ValueError("block_mask goes with the mask_mod it was made from")
    if score_mod is not None or mask_mod is not None:
        out, lse = _mods_call(q, k, v, fp8, softmax_scale, causal, window_size, softcap, deterministic, sinks,
                              score_mod, mask_mod, aux, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k,
                              max_q=int(max_seqlen_q), max_k=int(max_seqlen_k), block_mask=block_mask)
        return (out, lse) if return_lse else out
    if fp8 or q.dtype == FP8:
        _fp8_checks(softcap, sinks)
        _op_args(q, softmax_scale, window_size, 0.0)  # the scalars' checks
        out, lse = ops_fp8.fp8_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                                window_size=window_size,
                                                descales=(q_descale, k_descale, v_descale), quantize=fp8,
                                                deterministic=deterministic)
        return (out, lse) if return_lse else out
    if any(x is not None for x in (q_descale, k_descale, v_descale)):
        raise ValueError("q_descale / k_descale / v_descale go with e4m3 inputs")
    scale, wl, wr, cap = _op_args(q, softmax_scale, window_size, softcap)
    out, lse = _ops.attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                         int(max_seqlen_k), scale, bool(causal), wl, wr, cap,
                                         bool(deterministic), sinks=sinks)
    return (out, lse) if return_lse else out


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
              dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
              enable_gqa: bool = False, *, score_mod: object = None, mask_mod: object = None,
              aux: Sequence[torch.Tensor] = (), block_mask: BlockMask | None = None) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``'s signature and semantics on (B, H, N, d)
    tensors, so it drops in at SDPA call sites. An ``attn_mask`` tensor or ``dropout_p`` > 0 raise
    ``ValueError`` (use ``is_causal``, ``mask_mod`` or ``flash_attn_func``'s ``window_size`` for
    masks). ``score_mod`` / ``mask_mod`` / ``aux`` / ``block_mask`` as in ``flash_attn_func``.

    The inputs are passed to the kernel as transposed views, without copies. As in SDPA,
    ``is_causal`` is aligned top-left when Nq != Nk (query i sees keys 0..i), unlike
    ``flash_attn_func``'s bottom-right causal. Returns (B, H, Nq, dv).
    """
    validate.check_call({"q": q, "k": k, "v": v}, {"is_causal": is_causal, "enable_gqa": enable_gqa})
    if attn_mask is not None:
        raise ValueError("attention: attn_mask tensors are not supported; use is_causal, or "
                         "flash_attn_func's window_size for sliding windows")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0.0:
        raise ValueError(f"attention: dropout is not supported (dropout_p must be 0.0, got {dropout_p!r})")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, N, d), got shape {tuple(t.shape)}")
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"q has {q.shape[1]} heads and k/v have {k.shape[1]}: pass enable_gqa=True for "
                         f"grouped-query attention")
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    nq, nk = q.shape[2], k.shape[2]
    causal, window = False, (-1, -1)
    if is_causal and nq <= nk:
        # Keys past Nq are invisible to every query under a top-left mask: drop them (their
        # gradients come back as zeros through the slice) and the rest is a square causal mask.
        kt, vt, causal = kt[:, :nq], vt[:, :nq], True
    elif is_causal:
        # Nq > Nk: bottom-right window (-1, Nq - Nk) puts the diagonal at j = i.
        window = (-1, nq - nk)
    out = flash_attn_func(qt, kt, vt, softmax_scale=scale, causal=causal, window_size=window,
                          score_mod=score_mod, mask_mod=mask_mod, aux=aux, block_mask=block_mask)
    return out.transpose(1, 2)


def flash_attn_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                            rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
                            cache_seqlens: torch.Tensor | int | None = None,
                            cache_batch_idx: torch.Tensor | None = None,
                            cache_leftpad: torch.Tensor | None = None, page_table: torch.Tensor | None = None,
                            softmax_scale: float | None = None, causal: bool = False,
                            window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                            rotary_interleaved: bool = True, num_splits: int = 0, return_lse: bool = False,
                            k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None,
                            sinks: torch.Tensor | None = None
                            ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of new queries over a KV cache, with flash-attn's semantics (inference: no autograd).

    q (B, Nq, H, d) (Nq >= 1: decoding, speculative decoding, chunked prefill); k_cache / v_cache
    (B_cache, N_cache, H_kv, d / dv), or with ``page_table`` (B, max_pages) int32 paged caches
    (num_pages, page_size, H_kv, d / dv) where sequence b's key j lives in page
    ``page_table[b, j // page_size]``. ``cache_seqlens`` (B,) int32 (or an int for every sequence):
    the keys already cached; None = every cache row full. ``k`` / ``v`` (B, N_new, H_kv, d / dv):
    new tokens written into the caches in place at ``cache_seqlens`` (after the call, the caller
    adds N_new to its lengths); with ``rotary_cos`` / ``rotary_sin`` (seqlen_ro, rotary_dim / 2)
    the new keys are rotated at positions ``cache_seqlens + i`` and q at the same positions when
    causal or local (else all at ``cache_seqlens``), pairs interleaved (GPT-J) or halves
    (``rotary_interleaved=False``, GPT-NeoX). ``cache_batch_idx`` (B,) int32: the cache row of each
    sequence; ``cache_leftpad`` (B,) int32: keys before it are not part of the sequence (rotary
    positions still count cache slots from 0, as in flash-attn). Attention runs over each
    sequence's keys ``[leftpad, cache_seqlens + N_new)`` with causal / window masks bottom-right
    aligned to them, GQA, softcap.

    ``num_splits``: 0 chooses how many CTAs share one sequence's keys from the shapes and the SM
    count (never from the lengths on the device, so a captured CUDA graph replays correctly while
    ``cache_seqlens`` changes); 1 never splits. Returns out (B, Nq, H, dv), or (out, lse) with lse
    (B, H, Nq) float32.

    FP8 cache (Hopper): ``k_cache`` / ``v_cache`` torch.float8_e4m3fn with 16-bit q, holding
    values / descale for float32 ``k_descale`` / ``v_descale`` (B, H_kv) (None: 1; the FP8
    forward's convention, per sequence b, not per cache row). New ``k`` / ``v`` in q's dtype are
    divided by them and rounded into the cache (saturating at +-448); e4m3 ones are written as
    given. Out is in q's dtype.

    ``sinks`` (H,) float32: learnable sink logits as in ``flash_attn_func`` (split, the merge adds
    them).
    """
    flags = {"causal": causal, "rotary_interleaved": rotary_interleaved, "return_lse": return_lse}
    validate.check_call({"q": q, "k_cache": k_cache, "v_cache": v_cache}, flags)
    if sinks is not None:
        validate.check_sinks(sinks, q)
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    scale, wl, wr, cap = _op_args(q, softmax_scale, window_size, softcap)
    out, lse = ops_kvcache.fwd_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                       cache_batch_idx, cache_leftpad, page_table, k_descale, v_descale,
                                       scale, bool(causal), wl, wr, cap, bool(rotary_interleaved), num_splits,
                                       sinks)
    return (out, lse) if return_lse else out
