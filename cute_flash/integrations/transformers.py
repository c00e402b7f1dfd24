"""Hugging Face transformers: ``attn_implementation="cute_flash"``.

    import cute_flash.integrations.transformers  # registers "cute_flash"
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cute_flash", dtype=torch.bfloat16)

Works for the models that call transformers' attention interface (Llama, Qwen, Mistral, Gemma 2,
...). K / V go in with their own heads (GQA is never repeated); padded batches are unpadded into
the packed (varlen) kernels and padded back, as transformers' own flash integration does; packed
sequences come from ``cu_seq_lens_*`` kwargs (``DataCollatorWithFlattening``) or restarting
``position_ids``; sliding windows and softcap map onto the kernels' own. Attention dropout,
attention sinks and returned attention weights are refused with a ``ValueError``. The backward
is deterministic when ``torch.use_deterministic_algorithms(True)`` is on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cute_flash.api import flash_attn_func, flash_attn_varlen_func

NAME = "cute_flash"


def register(name: str = NAME) -> None:
    """Register ``name`` with transformers' attention and attention-mask interfaces."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, padding_mask)
    _known_to_the_flash_loader(name)


def _known_to_the_flash_loader(name: str) -> None:
    """transformers takes any implementation named "*flash*" for a flash-attn build and imports its
    functions (from a package or the kernel hub) when a model is set to it; its loader is taught
    that ``name`` is this package (the attention itself is ``attention_forward``, registered above)."""
    try:
        from transformers import modeling_flash_attention_utils as fa_utils
    except ImportError:
        return
    loader = getattr(fa_utils, "_lazy_imports", None)
    if loader is None or name in getattr(loader, "cute_flash_names", ()):
        return

    def lazy_imports(implementation: str | None, *args: Any, **kwargs: Any) -> tuple:
        if implementation == name:
            pad, unpad = getattr(fa_utils, "_pad_input", None), getattr(fa_utils, "_unpad_input", None)
            return flash_attn_func, flash_attn_varlen_func, None, pad, unpad
        return loader(implementation, *args, **kwargs)

    lazy_imports.cute_flash_names = (*getattr(loader, "cute_flash_names", ()), name)
    fa_utils._lazy_imports = lazy_imports


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                 mask_function: Any = None, attention_mask: Tensor | None = None,
                 **kwargs: Any) -> Tensor | None:
    """The mask transformers hands the attention: the 2D (batch, keys) padding mask where a key is
    padding, else None (causal and window masks are the kernels' own)."""
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      is_causal: bool | None = None, s_aux: Tensor | None = None,
                      **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention call: q (B, H, Nq, d), k / v (B, Hkv, Nk, d) -> (B, Nq, H, d_v), None."""
    if dropout:
        raise ValueError(f"cute_flash has no attention dropout (got p = {dropout}): set the config's "
                         "attention_dropout to 0, or evaluate in eval() mode")
    if s_aux is not None:
        raise ValueError("cute_flash does not take attention sinks (s_aux)")
    if kwargs.get("output_attentions"):
        raise ValueError("cute_flash does not return attention weights (output_attentions=True): use "
                         "attn_implementation='eager' for them")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("cute_flash takes a 2D (batch, keys) padding mask, got shape "
                         f"{tuple(attention_mask.shape)} (register() installs the mask function that "
                         "makes one)")
    dtype = _kernel_dtype(query, module)
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (query, key, value))
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = (-1, -1)
    if sliding_window is not None and k.shape[1] > sliding_window:
        # transformers' window counts the query's own token: sliding_window - 1 keys to each side.
        window = (sliding_window - 1, sliding_window - 1)
    deterministic = kwargs.get("deterministic")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    flags = dict(softmax_scale=scaling, causal=causal, window_size=window, softcap=float(softcap or 0.0),
                 deterministic=bool(deterministic))
    packed = _packed_lengths(q, attention_mask, kwargs)
    if attention_mask is not None:
        out = _padded(q, k, v, attention_mask, flags)
    elif packed is not None:
        (cu_q, cu_k), (max_q, max_k) = packed
        b, n = q.shape[:2]
        out = flash_attn_varlen_func(q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]),
                                     v.reshape(-1, *v.shape[2:]), cu_q, cu_k, max_q, max_k, **flags)
        out = out.reshape(b, n, *out.shape[1:])
    else:
        out = flash_attn_func(q, k, v, **flags)
    return out.to(query.dtype), None


def _kernel_dtype(query: Tensor, module: torch.nn.Module) -> torch.dtype:
    """bf16 / fp16 for the kernels: fp32 activations (norms kept in fp32, autocast) go in at the
    autocast dtype or the dtype of the module's weights, as transformers' flash integration does."""
    if query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    half = (torch.bfloat16, torch.float16)
    weights = next((p.dtype for p in module.parameters() if p.dtype in half), None)
    if weights is None:  # (quantized weights: the dtype the model was loaded in)
        weights = getattr(getattr(module, "config", None), "dtype", None)
    if weights not in half:
        raise TypeError(f"cute_flash runs bf16 / fp16 attention; this model computes in {query.dtype}: load "
                        "it with dtype=torch.bfloat16 (or run under torch.autocast)")
    return weights


def _packed_lengths(q: Tensor, attention_mask: Tensor | None, kwargs: dict) -> tuple | None:
    """((cu_q, cu_k), (max_q, max_k)) of sequences packed into one row: from the ``cu_seq_lens_*`` /
    ``max_length_*`` kwargs, or from ``position_ids`` that restart (batch 1, no padding mask)."""
    given = [kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")]
    if all(g is not None for g in given):
        cu_q, cu_k, max_q, max_k = given
        return (cu_q.to(torch.int32), cu_k.to(torch.int32)), (int(max_q), int(max_k))
    pos = kwargs.get("position_ids")
    if attention_mask is not None or pos is None or q.shape[0] != 1 or q.shape[1] == 1:
        return None
    if pos.numel() != q.shape[1]:
        return None
    pos = pos.reshape(-1)
    starts = (pos == pos.min()).nonzero().flatten()
    if starts.numel() <= 1:
        return None
    cu = torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)
    longest = int(cu.diff().max())
    return (cu, cu), (longest, longest)


def _padded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, flags: dict) -> Tensor:
    """Attention over a padded batch: the real tokens of each row packed, attended, scattered back
    (padded query rows are zero). ``mask``: (B, Nk) bool, True on real keys; queries are the last
    Nq positions of it (left padding and a KV cache included)."""
    b, nq, h = q.shape[:3]
    mask = mask.to(torch.bool)
    if k.shape[1] > mask.shape[1]:  # a static cache: its slots past the mask are not filled yet
        k, v = k[:, :mask.shape[1]], v[:, :mask.shape[1]]
    mask_q = mask[:, -nq:]
    lens_k = mask.sum(1, dtype=torch.int32)
    lens_q = mask_q.sum(1, dtype=torch.int32)
    idx_q = mask_q.flatten().nonzero().flatten()
    idx_k = mask.flatten().nonzero().flatten()
    zero = lens_k.new_zeros(1)
    cu_q = torch.cat([zero, lens_q.cumsum(0, dtype=torch.int32)])
    cu_k = torch.cat([zero, lens_k.cumsum(0, dtype=torch.int32)])
    q_u = q.reshape(b * nq, h, -1).index_select(0, idx_q)
    k_u, v_u = (t.reshape(-1, *t.shape[2:]).index_select(0, idx_k) for t in (k, v))
    out_u = flash_attn_varlen_func(q_u, k_u, v_u, cu_q, cu_k, int(lens_q.max()), int(lens_k.max()), **flags)
    out = out_u.new_zeros(b * nq, h, out_u.shape[-1])
    return out.index_copy(0, idx_q, out_u).reshape(b, nq, h, -1)


try:  # registering needs transformers; importing this module for its functions does not
    register()
except ImportError:
    pass
