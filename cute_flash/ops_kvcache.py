"""The ``cute_flash::fwd_kvcache`` custom op: attention over a KV cache with the new tokens
appended in place (``k_cache`` / ``v_cache`` are declared mutated, so ``torch.compile`` orders
the writes). A fake implementation for tracing, the CUDA one (``launch_kvcache``) and a CPU one
computed with ``reference_kvcache``. Inference only: no autograd.
"""

from __future__ import annotations

import torch

from cute_flash import launch_kvcache, reference_kvcache, validate, validate_kvcache

Tensor = torch.Tensor


def _alloc(q: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor]:
    b, nq, h, _ = q.shape
    out = torch.empty((b, nq, h, v_cache.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty((b, h, nq), dtype=torch.float32, device=q.device)
    return out, lse


def _check(args: tuple, scale: float, window: tuple[int, int], softcap: float, num_splits: int,
           sinks: Tensor | None, check_data: bool = True) -> None:
    validate_kvcache.check_kvcache(*args, softmax_scale=scale, window_size=window, softcap=softcap,
                                   num_splits=num_splits, check_data=check_data)
    if sinks is not None:
        validate.check_sinks(sinks, args[0])


@torch.library.custom_op("cute_flash::fwd_kvcache", mutates_args=("k_cache", "v_cache"), device_types="cpu")
def fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None, v: Tensor | None,
                rotary_cos: Tensor | None, rotary_sin: Tensor | None, cache_seqlens: Tensor | None,
                cache_batch_idx: Tensor | None, cache_leftpad: Tensor | None, page_table: Tensor | None,
                k_descale: Tensor | None, v_descale: Tensor | None, softmax_scale: float, causal: bool,
                window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
                num_splits: int, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(out (B, Nq, H, dv), lse (B, H, Nq) float32); k / v appended to the caches in place."""
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            page_table, k_descale, v_descale)
    _check(args, softmax_scale, (window_left, window_right), softcap, num_splits, sinks)
    out, lse = _alloc(q, v_cache)
    ref_out, ref_lse = reference_kvcache.kvcache_attention_ref(
        *args[:-2], softmax_scale=softmax_scale, causal=causal, window_size=(window_left, window_right),
        softcap=softcap, rotary_interleaved=rotary_interleaved, k_descale=k_descale, v_descale=v_descale,
        sinks=sinks)
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


@fwd_kvcache.register_kernel("cuda")
def _fwd_kvcache_cuda(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                      cache_leftpad, page_table, k_descale, v_descale, softmax_scale, causal, window_left,
                      window_right, softcap, rotary_interleaved, num_splits, sinks=None):
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            page_table, k_descale, v_descale)
    _check(args, softmax_scale, (window_left, window_right), softcap, num_splits, sinks)
    out, lse = _alloc(q, v_cache)
    if q.shape[0] == 0:  # no sequence: nothing to append or attend
        return out, lse
    with torch.cuda.device(q.device):
        launch_kvcache.run_fwd_kvcache(*args, out, lse, softmax_scale=softmax_scale, causal=causal,
                                       window_size=(window_left, window_right), softcap=softcap,
                                       rotary_interleaved=rotary_interleaved, num_splits=num_splits,
                                       sinks=sinks)
    return out, lse


@fwd_kvcache.register_fake
def _(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
      page_table, k_descale, v_descale, softmax_scale, causal, window_left, window_right, softcap,
      rotary_interleaved, num_splits, sinks=None):
    args = (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
            page_table, k_descale, v_descale)
    _check(args, softmax_scale, (window_left, window_right), softcap, num_splits, sinks, check_data=False)
    return _alloc(q, v_cache)
