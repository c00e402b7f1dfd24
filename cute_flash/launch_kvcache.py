"""Launcher of attention over a KV cache: the append and rotary (``kv_append``, torch index ops),
then the KV-cache kernel and, when the keys are split, the merge, all on torch's current stream.
Nothing here reads device data or synchronises, so the whole call can be captured in a CUDA graph
and replayed while ``cache_seqlens`` changes: the plan (variant, split count) depends on shapes
only.
"""

from __future__ import annotations

import torch

from cute_flash import dispatch, formats, jit, kv_append, launch
from cute_flash.ampere.kvcache_config import AppendKVConfig
from cute_flash.memo import HostMemo

Tensor = torch.Tensor

_PLANS = HostMemo(256)


def _plan(q: Tensor, k_cache: Tensor, v_cache: Tensor, capacity: int, causal: bool, local: bool,
          softcap: float, batch_idx: bool, leftpad: bool, page_size: int, num_splits: int, sinks: bool):
    """(plan, compiled kernel, compiled merge or None) of one call's shapes."""
    arch = jit.device_arch(q.device)
    # (The family is part of the key: CUTE_FLASH_FWD_KERNEL is read at every call.)
    family = dispatch.fwd_family(arch, q.shape[-1], v_cache.shape[-1])
    key = (q.dtype, tuple(q.shape), q.stride(), k_cache.dtype, tuple(k_cache.shape[2:]), v_cache.shape[-1],
           capacity, q.device, causal, local, softcap > 0.0, batch_idx, leftpad, page_size, num_splits,
           family, sinks)
    hit = _PLANS.get(key)
    if hit is None:
        p = dispatch.kvcache_problem(formats.dtype_name(q.dtype), q.shape[-1], v_cache.shape[-1],
                                     causal=causal, local=local, softcap=softcap > 0.0, batch=q.shape[0],
                                     seqlen_q=q.shape[1], capacity=capacity, heads_q=q.shape[2],
                                     heads_kv=k_cache.shape[2], num_sms=launch.sm_count(q.device),
                                     q_dense=launch.dense_bnhd(q), sinks=sinks)
        kv_dtype = "e4m3" if kv_append.is_fp8(k_cache) else ""
        plan = dispatch.kvcache_plan(arch, p, batch_idx=batch_idx, leftpad=leftpad, page_size=page_size,
                                     num_splits=num_splits, kv_dtype=kv_dtype)
        merge = None if plan.combine is None else jit.compile_kernel(plan.combine)
        hit = (plan, jit.compile_kernel(plan.config), merge)
        _PLANS.put(key, hit)
    return hit


def append_config(dtype: torch.dtype, cache_dtype: torch.dtype, rotary_dtype: torch.dtype | None,
                  interleaved: bool, per_token: bool, *, paged: bool, batch_idx: bool) -> AppendKVConfig:
    """The append kernel of a call: new tokens and q of ``dtype`` into a cache of ``cache_dtype``,
    rotary tables of ``rotary_dtype`` (None: no rotary)."""
    if rotary_dtype is None:  # (the rotary fields are then unused: one compile key)
        interleaved = per_token = True
    return AppendKVConfig(target=None, dtype=formats.dtype_name(dtype),
                          kv_dtype="e4m3" if cache_dtype == torch.float8_e4m3fn else "",
                          rotary="" if rotary_dtype is None else formats.FLOAT_NAMES[rotary_dtype],
                          interleaved=interleaved, per_token_q=per_token, paged=paged,
                          batch_idx=batch_idx and not paged)


def _append(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, cos: Tensor | None,
            sin: Tensor | None, cache_seqlens: Tensor, cache_batch_idx: Tensor | None,
            page_table: Tensor | None, per_token: bool, interleaved: bool, descales: tuple) -> Tensor:
    """``kv_append.append_and_rotate`` as one kernel (``ampere/append_kv.py``); returns q (rotated
    into a new tensor with rotary)."""
    cfg = append_config(q.dtype, k_cache.dtype, None if cos is None else cos.dtype, interleaved, per_token,
                        paged=page_table is not None, batch_idx=cache_batch_idx is not None)
    q_out = None
    if cos is not None:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        cos, sin = cos.contiguous(), sin.contiguous()
    jit.compile_kernel(cfg)(q, q_out, k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, page_table, cos,
                            sin, *descales)
    return q if q_out is None else q_out


def run_fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None,
                    rotary_cos: Tensor | None, rotary_sin: Tensor | None, cache_seqlens: Tensor | None,
                    cache_batch_idx: Tensor | None, cache_leftpad: Tensor | None, page_table: Tensor | None,
                    k_descale: Tensor | None, v_descale: Tensor | None, out: Tensor, lse: Tensor, *,
                    softmax_scale: float, causal: bool,
                    window_size: tuple[int, int], softcap: float, rotary_interleaved: bool,
                    num_splits: int, sinks: Tensor | None = None) -> None:
    """On validated CUDA tensors: appends to the caches in place and writes ``out`` (B, Nq, H, dv)
    and ``lse`` (B, H, Nq). A paged cache is read in place, page by page, by the kernel. ``sinks``:
    (H,) fp32 sink logits (the kernel adds them unsplit, the merge when split), or None."""
    batch = q.shape[0]
    new = 0 if k is None else k.shape[1]
    capacity = page_table.shape[1] * k_cache.shape[1] if page_table is not None else k_cache.shape[1]
    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    per_token = kv_append.rotary_per_token(causal, window_size, capacity)
    causal_k, local, left, right = launch.normalize_window(causal, window_size)
    page_size = 0 if page_table is None else k_cache.shape[1]
    # Planned (and compiled) before the append: a call that cannot run leaves the caches untouched.
    plan, fn, merge = _plan(q, k_cache, v_cache, capacity, causal_k, local, softcap,
                            cache_batch_idx is not None, cache_leftpad is not None, page_size, num_splits,
                            sinks is not None)
    descales = (None, None)
    if kv_append.is_fp8(k_cache):
        ones = torch.ones((batch, k_cache.shape[2]), dtype=torch.float32, device=q.device)
        # (Any strides, broadcast ones included: the kernels read a dense (B, H_kv) copy.)
        descales = tuple(ones if x is None else x.contiguous() for x in (k_descale, v_descale))
    if k is not None and k.dtype == q.dtype:
        q = _append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                    page_table, per_token, rotary_interleaved, descales)
    else:  # (nothing to append, or e4m3 tokens for an e4m3 cache: written as they are)
        q = kv_append.append_and_rotate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                        cache_batch_idx, cache_leftpad, page_table, per_token,
                                        rotary_interleaved, k_descale, v_descale)
    seqused = cache_seqlens + new if new else cache_seqlens
    index = (seqused, cache_batch_idx, cache_leftpad, page_table, *descales)
    scalars = (float(softmax_scale), float(softcap) if softcap > 0 else 0.0, left, right, plan.num_splits)
    if sinks is not None:
        sinks = sinks.contiguous()
    if merge is None:
        fn(q, k_cache, v_cache, out, lse, *index, *scalars, sinks)
        return
    splits = plan.num_splits
    o_acc = torch.empty((batch * splits, *out.shape[1:]), dtype=torch.float32, device=q.device)
    lse_acc = torch.empty((batch * splits, *lse.shape[1:]), dtype=torch.float32, device=q.device)
    fn(q, k_cache, v_cache, o_acc, lse_acc, *index, *scalars, None)
    merge(o_acc, lse_acc, out, lse, splits, sinks)
