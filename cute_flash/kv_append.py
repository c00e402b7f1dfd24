"""What ``flash_attn_with_kvcache`` does to the cache before attending: rotary embedding of the
new keys and the queries, and the new keys / values written into the cache in place at
``cache_seqlens``. Plain torch index ops on whatever device the tensors are on: they read no
device data on the host, so they run inside a captured CUDA graph, and the GPU path and the
reference (``reference_kvcache``) share them.

Positions: a batch's cached keys are ``[leftpad, cache_seqlens)`` of its cache row (or of the
pages ``page_table[b]`` lists, ``page_size`` keys each); new token ``i`` goes to slot
``cache_seqlens + i`` and has rotary position ``cache_seqlens + i`` (the slot, left padding
included, as in flash-attn). On a GPU the launcher runs the same append as one kernel
(``ampere/append_kv.py``).
"""

from __future__ import annotations

import torch

from cute_flash import formats

Tensor = torch.Tensor


def rotary_positions(base: Tensor, count: int, per_token: bool) -> Tensor:
    """(B, count) int64 positions: ``base + i`` per token, or ``base`` for every token."""
    steps = torch.arange(count, device=base.device, dtype=torch.int64) if per_token else \
        torch.zeros(count, device=base.device, dtype=torch.int64)
    return base.to(torch.int64)[:, None] + steps[None, :]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, interleaved: bool) -> Tensor:
    """x (B, N, H, d) rotated on its first ``2 * cos.shape[1]`` channels at ``positions`` (B, N):
    channel pairs (2i, 2i+1) when ``interleaved`` (GPT-J), else (i, i + r/2) (GPT-NeoX). fp32 math
    (fp64 for fp64 x), the result in x's dtype (as flash-attn's rotary kernel)."""
    half = cos.shape[1]
    cdt = torch.promote_types(x.dtype, torch.float32)  # (fp64 inputs keep fp64: the references)
    c = cos.to(cdt)[positions].unsqueeze(2)  # (B, N, 1, r/2)
    s = sin.to(cdt)[positions].unsqueeze(2)
    xr = x[..., :2 * half].to(cdt)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def cache_slots(cache_seqlens: Tensor, count: int) -> Tensor:
    """(B, count) int64 cache slots of the new tokens."""
    return rotary_positions(cache_seqlens, count, per_token=True)


def is_fp8(t: Tensor) -> bool:
    return t.dtype == torch.float8_e4m3fn


def quantize_new(new: Tensor, cache: Tensor, descale: Tensor | None) -> Tensor:
    """New tokens (B, count, H, d) in the cache's dtype: for an e4m3 cache, values in another dtype
    are divided by the (B, H) descale (1 when None) and rounded, saturating at +-448; e4m3 values
    are taken as already scaled."""
    if not is_fp8(cache) or is_fp8(new):
        return new.to(cache.dtype)
    x = new.float()
    if descale is not None:
        x = x / descale.float()[:, None, :, None]
    return x.clamp(-formats.E4M3_MAX, formats.E4M3_MAX).to(cache.dtype)


def write_new(cache: Tensor, new: Tensor, slots: Tensor, rows: Tensor | None,
              page_table: Tensor | None) -> None:
    """``new`` (B, count, H, d) into ``cache`` at ``slots``: of cache rows ``rows`` (B,), or of the
    pages ``page_table`` lists for a paged cache (num_pages, page_size, H, d)."""
    if is_fp8(cache):  # (written as bytes: index_put_ covers every integer dtype)
        cache, new = cache.view(torch.uint8), new.view(torch.uint8)
    if page_table is not None:
        page_size = cache.shape[1]
        pages = page_table.to(torch.int64).gather(1, slots // page_size)
        cache.index_put_((pages, slots % page_size), new)
        return
    cache.index_put_((rows.to(torch.int64)[:, None], slots), new)


def logical_cache(cache: Tensor, page_table: Tensor) -> Tensor:
    """A paged cache (num_pages, page_size, H, d) as (B, max_pages * page_size, H, d) in each
    batch's key order: a gathered copy."""
    b, pages = page_table.shape
    # Entries past a sequence's last page may hold anything: clamped (those keys are never read).
    gathered = cache[page_table.to(torch.int64).clamp(0, cache.shape[0] - 1).reshape(-1)]
    return gathered.reshape(b, pages * cache.shape[1], *cache.shape[2:])


def rotary_per_token(causal: bool, window_size: tuple[int, int], capacity: int) -> bool:
    """Whether query i is rotated at position ``cache_seqlens + i`` (else all at ``cache_seqlens``):
    causal or windowed attention, a window side at least the cache's capacity counting as none
    (flash-attn's rule)."""
    left, right = (w if 0 <= w < capacity else -1 for w in window_size)
    return causal or left >= 0 or right >= 0


def append_and_rotate(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None,
                      rotary_cos: Tensor | None, rotary_sin: Tensor | None, cache_seqlens: Tensor,
                      cache_batch_idx: Tensor | None, cache_leftpad: Tensor | None, page_table: Tensor | None,
                      per_token_q: bool, interleaved: bool, k_descale: Tensor | None = None,
                      v_descale: Tensor | None = None) -> Tensor:
    """The new k / v (rotated when cos / sin are given; quantized with the descales into an e4m3
    cache) written into the caches in place; returns q, rotated at the new tokens' positions when
    ``per_token_q`` (causal / local: query i is token i) or all at the first new position
    (flash-attn's convention otherwise)."""
    if k is None:
        return q
    if rotary_cos is not None:
        # Positions are cache slots, left padding included (flash-attn's convention).
        k = apply_rotary(k, rotary_cos, rotary_sin, rotary_positions(cache_seqlens, k.shape[1], True),
                         interleaved)
        q = apply_rotary(q, rotary_cos, rotary_sin, rotary_positions(cache_seqlens, q.shape[1], per_token_q),
                         interleaved)
    rows = None
    if page_table is None:
        rows = cache_batch_idx if cache_batch_idx is not None else \
            torch.arange(q.shape[0], device=q.device, dtype=torch.int64)
    slots = cache_slots(cache_seqlens, k.shape[1])
    write_new(k_cache, quantize_new(k, k_cache, k_descale), slots, rows, page_table)
    write_new(v_cache, quantize_new(v, v_cache, v_descale), slots, rows, page_table)
    return q
