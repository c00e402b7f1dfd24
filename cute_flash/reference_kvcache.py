"""Reference of attention over a KV cache (``flash_attn_with_kvcache``): the append and rotary of
``kv_append``, then each batch's dense attention (``reference.attention_ref``) over its keys
``[leftpad, cache_seqlens + new)``, masks bottom-right aligned to that range. The CPU
implementation of the ``cute_flash::fwd_kvcache`` op and the GPU tests' ground truth.
"""

from __future__ import annotations

import torch

from cute_flash import kv_append, reference

Tensor = torch.Tensor


def kvcache_attention_ref(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None,
                          v: Tensor | None = None, rotary_cos: Tensor | None = None,
                          rotary_sin: Tensor | None = None, cache_seqlens: Tensor | None = None,
                          cache_batch_idx: Tensor | None = None, cache_leftpad: Tensor | None = None,
                          page_table: Tensor | None = None, *, softmax_scale: float | None = None,
                          causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                          rotary_interleaved: bool = True, upcast: bool = True,
                          k_descale: Tensor | None = None, v_descale: Tensor | None = None,
                          sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out (B, Nq, H, dv) in the compute dtype, lse (B, H, Nq)); the caches are updated in place.
    ``upcast=False``: the same math in the input dtype (the 2x rule's comparison). ``cache_seqlens``
    None: every cache row is full (no append). An e4m3 cache holds values / descale: sequence b's
    keys are read as code x ``k_descale[b, h]`` (values likewise; None: 1). ``sinks``: (H,) logits
    that join each row's softmax (``reference.attention_ref``)."""
    batch = q.shape[0]
    capacity = (page_table.shape[1] * k_cache.shape[1]) if page_table is not None else k_cache.shape[1]
    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    per_token = kv_append.rotary_per_token(causal, window_size, capacity)
    q = kv_append.append_and_rotate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                    cache_batch_idx, cache_leftpad, page_table, per_token,
                                    rotary_interleaved, k_descale, v_descale)
    keys, values = k_cache, v_cache
    if page_table is not None:
        keys = kv_append.logical_cache(k_cache, page_table)
        values = kv_append.logical_cache(v_cache, page_table)
    new = 0 if k is None else k.shape[1]
    ends = (cache_seqlens.to(torch.int64) + new).tolist()
    starts = [0] * batch if cache_leftpad is None else cache_leftpad.tolist()
    rows = list(range(batch)) if cache_batch_idx is None else cache_batch_idx.tolist()
    outs, lses = [], []
    for b in range(batch):
        kb = _dequantize(keys[rows[b], starts[b]:ends[b]], k_descale, b, q.dtype, upcast).unsqueeze(0)
        vb = _dequantize(values[rows[b], starts[b]:ends[b]], v_descale, b, q.dtype, upcast).unsqueeze(0)
        ob, lb = reference.attention_ref(q[b:b + 1], kb, vb, softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size, softcap=softcap, upcast=upcast, sinks=sinks)
        outs.append(ob)
        lses.append(lb)
    if not outs:  # no batch
        return reference.attention_ref(q, keys[:0].to(q.dtype), values[:0].to(q.dtype),
                                       softmax_scale=softmax_scale, upcast=upcast)
    return torch.cat(outs), torch.cat(lses)


def _dequantize(x: Tensor, descale: Tensor | None, b: int, dtype: torch.dtype, upcast: bool) -> Tensor:
    """One sequence's keys or values (N, H, d) in the queries' compute dtype; e4m3 codes times the
    sequence's (H,) descales."""
    if not kv_append.is_fp8(x):
        return x
    dt = torch.float64 if dtype == torch.float64 else (torch.float32 if upcast else dtype)
    x = x.to(dt)
    return x if descale is None else x * descale[b].to(dt)[None, :, None]


def merge_splits_ref(o_parts: Tensor, lse_parts: Tensor) -> tuple[Tensor, Tensor]:
    """The split-KV merge (``ampere/combine.py``) spelled out: partials (S, ..., d_v) each normalised
    by its own row sum, and their LSEs (S, ...), give O = sum_s exp(LSE_s - LSE) O_s and LSE =
    log sum_s exp(LSE_s); splits with LSE -inf weigh 0, and a row with none left is O = 0,
    LSE = -inf."""
    lse = torch.logsumexp(lse_parts, dim=0)
    weights = torch.exp(lse_parts - lse.masked_fill(torch.isneginf(lse), 0.0)).nan_to_num(0.0)
    return (weights.unsqueeze(-1) * o_parts).sum(dim=0), lse


def split_kv_ref(q: Tensor, keys: Tensor, values: Tensor, *, tile_n: int, num_splits: int,
                 softmax_scale: float, causal: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One sequence's attention split as the KV-cache kernels split it: the key blocks of
    ``tile_n`` keys, ceil(blocks / num_splits) per split, each split's (O, LSE) over its keys alone.
    q (Nq, H, d), keys / values (Nk, H, d). Returns (O partials (S, Nq, H, d_v), LSE partials
    (S, H, Nq), merged O, merged LSE), in the inputs' dtype."""
    nk = keys.shape[0]
    blocks = -(-nk // tile_n)
    share = -(-blocks // num_splits)
    o_parts, lse_parts = [], []
    for s in range(num_splits):
        lo, hi = min(s * share * tile_n, nk), min((s + 1) * share * tile_n, nk)
        # Keys lo..hi - 1 of the sequence: the causal diagonal stays where the whole sequence puts it.
        mask = reference.visible_mask(q.shape[0], nk, causal=causal, device=q.device)[:, lo:hi]
        scores = torch.einsum("qhd,khd->hqk", q, keys[lo:hi]) * softmax_scale
        scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # (H, Nq); -inf where the split sees no key
        p = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1))
        o_parts.append(torch.einsum("hqk,khd->qhd", p, values[lo:hi]))
        lse_parts.append(lse)
    o_parts, lse_parts = torch.stack(o_parts), torch.stack(lse_parts)
    out, lse = merge_splits_ref(o_parts, lse_parts.transpose(1, 2))  # (LSE by (token, head), as O)
    return o_parts, lse_parts, out, lse.transpose(0, 1)
