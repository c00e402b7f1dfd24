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
                          rotary_interleaved: bool = True, upcast: bool = True) -> tuple[Tensor, Tensor]:
    """(out (B, Nq, H, dv) in the compute dtype, lse (B, H, Nq)); the caches are updated in place.
    ``upcast=False``: the same math in the input dtype (the 2x rule's comparison). ``cache_seqlens``
    None: every cache row is full (no append)."""
    batch = q.shape[0]
    capacity = (page_table.shape[1] * k_cache.shape[1]) if page_table is not None else k_cache.shape[1]
    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), capacity, dtype=torch.int32, device=q.device)
    per_token = kv_append.rotary_per_token(causal, window_size, capacity)
    q = kv_append.append_and_rotate(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                    cache_batch_idx, cache_leftpad, page_table, per_token,
                                    rotary_interleaved)
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
        kb = keys[rows[b], starts[b]:ends[b]].unsqueeze(0)
        vb = values[rows[b], starts[b]:ends[b]].unsqueeze(0)
        ob, lb = reference.attention_ref(q[b:b + 1], kb, vb, softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size, softcap=softcap, upcast=upcast)
        outs.append(ob)
        lses.append(lb)
    if not outs:  # no batch
        return reference.attention_ref(q, keys[:0], values[:0], softmax_scale=softmax_scale, upcast=upcast)
    return torch.cat(outs), torch.cat(lses)
