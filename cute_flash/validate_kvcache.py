"""Checks of a ``flash_attn_with_kvcache`` call, before anything is written or launched.

Metadata (shapes, dtypes, devices, layouts) is checked always, on fake tensors too. The checks
that read the index tensors (``cache_seqlens`` within the cache, ``page_table`` /
``cache_batch_idx`` entries in range, the rotary table long enough) copy them to the host, all in
one copy (one wait for the device per eager call); they run on every eager call and are skipped
while a CUDA graph is being captured (a capture cannot read device data; the call being captured
was checked by the eager warm-up a capture needs anyway). An index out of range would otherwise
make the kernel read or the append write another sequence's cache.
"""

from __future__ import annotations

import torch

from cute_flash import kv_append, validate

Tensor = torch.Tensor


def _check_index(name: str, t: Tensor | None, batch: int, device: torch.device, rank: int = 1) -> None:
    if t is None:
        return
    validate._require_tensor(name, t)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {validate._fmt_dtype(t.dtype)}")
    if t.dim() != rank or t.shape[0] != batch:
        want = "(B,)" if rank == 1 else "(B, max_pages)"
        raise ValueError(f"{name} must be {want} with B = {batch}, got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device} with q, got {t.device}")
    if t.shape[0] > 1 and t.stride(0) != 1 and rank == 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")


def _check_cache(q: Tensor, k_cache: Tensor, v_cache: Tensor, paged: bool) -> None:
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        validate._require_tensor(name, t)
        if t.dim() != 4:
            layout = "(num_pages, page_size, H_kv, d)" if paged else "(B_cache, N_cache, H_kv, d)"
            raise ValueError(f"{name} must be 4-D {layout}, got shape {tuple(t.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache and v_cache must agree but in the head dim, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    h, hkv = q.shape[2], k_cache.shape[2]
    if h < 1 or hkv < 1 or h % hkv != 0:
        raise ValueError(f"q heads must be a positive multiple of the cache's heads, got {h} and {hkv}")
    if k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k_cache must have the same head dim, got {q.shape[-1]} and "
                         f"{k_cache.shape[-1]}")
    for name, d in (("q/k", q.shape[-1]), ("v", v_cache.shape[-1])):
        if d not in validate.SUPPORTED_HEAD_DIMS:
            raise ValueError(f"unsupported {name} head dim {d}; supported: {validate.SUPPORTED_HEAD_DIMS}")


def _check_new(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None) -> None:
    if (k is None) != (v is None):
        raise ValueError("k and v are appended together: pass both or neither")
    if k is None:
        return
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        validate._require_tensor(name, t)
        if t.dim() != 4 or t.shape[0] != q.shape[0] or t.shape[2:] != cache.shape[2:]:
            raise ValueError(f"{name} must be (B, N_new, H_kv, d) = ({q.shape[0]}, N_new, {cache.shape[2]}, "
                             f"{cache.shape[3]}), got shape {tuple(t.shape)}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must have the same number of new tokens, got {k.shape[1]} and "
                         f"{v.shape[1]}")


def _check_rotary(q: Tensor, k: Tensor | None, cos: Tensor | None, sin: Tensor | None) -> None:
    if cos is None and sin is None:
        return
    if cos is None or sin is None:
        raise ValueError("rotary_cos and rotary_sin go together: pass both or neither")
    if k is None:
        raise ValueError("rotary_cos / rotary_sin rotate the appended k and q: pass k and v with them")
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        validate._require_tensor(name, t)
        if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"{name} must be a float tensor, got {validate._fmt_dtype(t.dtype)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device} with q, got {t.device}")
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[1] < 1 or 2 * cos.shape[1] > q.shape[-1]:
        raise ValueError(f"rotary_cos / rotary_sin must both be (seqlen_ro, rotary_dim / 2) with "
                         f"rotary_dim <= the head dim {q.shape[-1]}, got {tuple(cos.shape)} and "
                         f"{tuple(sin.shape)}")


def _check_dtypes(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None,
                  k_descale: Tensor | None, v_descale: Tensor | None) -> None:
    """16-bit q; caches of q's dtype, or both e4m3 (new k / v then in q's dtype, quantized with
    the descales, or e4m3 already); (B, H_kv) float32 descales with an e4m3 cache only."""
    fp8 = kv_append.is_fp8(k_cache)
    if not fp8:
        tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
        if k is not None:
            tensors.update(k=k, v=v)
        validate.check_dtypes(tensors)
        if k_descale is not None or v_descale is not None:
            raise ValueError("k_descale / v_descale go with an e4m3 (torch.float8_e4m3fn) cache")
        return
    validate.check_dtypes({"q": q})
    if not kv_append.is_fp8(v_cache):
        raise TypeError(f"k_cache is float8_e4m3fn: v_cache must be too, got "
                        f"{validate._fmt_dtype(v_cache.dtype)}")
    for name, t in (("k", k), ("v", v)):
        if t is not None and t.dtype not in (q.dtype, torch.float8_e4m3fn):
            raise TypeError(f"{name} for an e4m3 cache must be in q's dtype ({validate._fmt_dtype(q.dtype)}) "
                            f"or float8_e4m3fn, got {validate._fmt_dtype(t.dtype)}")
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if t is None:
            continue
        validate._require_tensor(name, t)
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {validate._fmt_dtype(t.dtype)}")
        if tuple(t.shape) != (q.shape[0], k_cache.shape[2]):
            raise ValueError(f"{name} must be (B, H_kv) = ({q.shape[0]}, {k_cache.shape[2]}), got shape "
                             f"{tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device} with q, got {t.device}")


def check_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None,
                  rotary_cos: Tensor | None, rotary_sin: Tensor | None, cache_seqlens: Tensor | None,
                  cache_batch_idx: Tensor | None, cache_leftpad: Tensor | None, page_table: Tensor | None,
                  k_descale: Tensor | None = None, v_descale: Tensor | None = None, *, softmax_scale: float,
                  window_size: tuple[int, int], softcap: float, num_splits: int,
                  check_data: bool = True) -> None:
    validate._require_tensor("q", q)
    if q.dim() != 4 or q.shape[1] < 1:
        raise ValueError(f"q must be 4-D (B, N_q, H, d) with N_q >= 1, got shape {tuple(q.shape)}")
    paged = page_table is not None
    _check_cache(q, k_cache, v_cache, paged)
    _check_new(q, k_cache, v_cache, k, v)
    tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache}
    if k is not None:
        tensors.update(k=k, v=v)
    _check_dtypes(q, k_cache, v_cache, k, v, k_descale, v_descale)
    validate.check_same_device(tensors)
    for name, t in tensors.items():
        validate.check_layout(name, t, check_data=check_data)
    _check_rotary(q, k, rotary_cos, rotary_sin)
    batch = q.shape[0]
    for name, t in (("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                    ("cache_leftpad", cache_leftpad)):
        _check_index(name, t, batch, q.device)
    _check_index("page_table", page_table, batch, q.device, rank=2)
    if paged and k_cache.shape[1] < 1:
        raise ValueError(f"page_size (k_cache.shape[1]) must be >= 1, got shape {tuple(k_cache.shape)}")
    if paged and page_table.shape[1] > 1 and page_table.stride(1) != 1:
        raise ValueError(f"page_table must be contiguous in its last dim, got strides "
                         f"{tuple(page_table.stride())}")
    if paged and (cache_batch_idx is not None or cache_leftpad is not None):
        raise ValueError("page_table already maps each sequence to its pages: cache_batch_idx and "
                         "cache_leftpad go with a contiguous cache")
    if cache_seqlens is None and k is not None:
        raise ValueError("appending k / v needs cache_seqlens (where each sequence's new tokens go)")
    if cache_batch_idx is None and not paged and k_cache.shape[0] != batch:
        raise ValueError(f"k_cache has {k_cache.shape[0]} rows for a batch of {batch}: pass cache_batch_idx "
                         f"to pick rows")
    validate.check_scalars(softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0 = chosen from the shapes), got {num_splits!r}")
    capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
    if check_data and q.device.type != "meta" and not capturing:
        _check_index_data(q, k_cache, k, rotary_cos, cache_seqlens, cache_batch_idx, cache_leftpad,
                          page_table)


def _host_values(tensors: list[Tensor | None]) -> list[list | None]:
    """The given int32 index tensors as host lists, with one device-to-host copy for all of them."""
    present = [t for t in tensors if t is not None]
    if not present:
        return [None] * len(tensors)
    flat = torch.cat([t.reshape(-1) for t in present]).tolist()
    out, at = [], 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        out.append(flat[at:at + t.numel()])
        at += t.numel()
    return out


def _check_index_data(q: Tensor, k_cache: Tensor, k: Tensor | None, rotary_cos: Tensor | None,
                      cache_seqlens: Tensor | None, cache_batch_idx: Tensor | None,
                      cache_leftpad: Tensor | None, page_table: Tensor | None) -> None:
    """Index values in range: one copy of the small index tensors to the host."""
    new = 0 if k is None else k.shape[1]
    paged = page_table is not None
    capacity = page_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    lens, pads, rows, pages = _host_values([cache_seqlens, cache_leftpad, cache_batch_idx, page_table])
    if lens is None:  # every cache row full
        lens = [capacity] * q.shape[0]
    for b, n in enumerate(lens):
        if n < 0 or n + new > capacity:
            raise ValueError(f"cache_seqlens[{b}] = {n}: with {new} new tokens it must lie in "
                             f"[0, {capacity - new}] (the cache holds {capacity} keys per sequence)")
    pads = pads or [0] * len(lens)
    for b, (pad, n) in enumerate(zip(pads, lens, strict=True)):
        if not 0 <= pad <= n:
            raise ValueError(f"cache_leftpad[{b}] = {pad} must lie in [0, cache_seqlens[{b}] = {n}]")
    bad = [r for r in rows or [] if not 0 <= r < k_cache.shape[0]]
    if bad:
        raise ValueError(f"cache_batch_idx holds {bad[0]}, outside the cache's {k_cache.shape[0]} rows")
    if paged:
        per_seq = page_table.shape[1]
        for b, n in enumerate(lens):
            used = pages[b * per_seq:b * per_seq + -(-(n + new) // k_cache.shape[1])]
            bad = [p for p in used if not 0 <= p < k_cache.shape[0]]
            if bad:
                raise ValueError(f"page_table[{b}] holds page {bad[0]}, outside the cache's "
                                 f"{k_cache.shape[0]} pages")
    if rotary_cos is not None:
        need = max((n + max(new, q.shape[1]) for n in lens), default=0)
        if need > rotary_cos.shape[0]:
            raise ValueError(f"rotary_cos / rotary_sin have {rotary_cos.shape[0]} positions; this call needs "
                             f"{need}")
