"""Attention with a ``score_mod`` / ``mask_mod`` (``device/mods.py``), forward only: validation,
then the forward kernels with the mods compiled in (CUDA tensors) or ``attention_ref`` with the
mods' torch forms (CPU tensors). Not a custom op yet: no autograd and no ``torch.compile`` (both
raise ``NotImplementedError``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cute_flash import launch, reference, validate
from cute_flash.device.mods import Mods
from cute_flash.jit import MAX_AUX

Tensor = torch.Tensor

AUX_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "int32",
             torch.int64: "int64", torch.bool: "bool"}


def split_mod(name: str, mod: object) -> tuple[Callable | None, Callable | None]:
    """(DSL function, torch form or None) of a mod given as a DSL function or as the pair the
    built-ins return."""
    if mod is None:
        return None, None
    if isinstance(mod, tuple) and len(mod) == 2 and all(callable(f) for f in mod):
        return mod
    if callable(mod):
        return mod, None
    raise TypeError(f"{name} must be a CuTe-DSL function or a (DSL function, torch function) pair, got "
                    f"{type(mod).__name__}")


def check_aux(aux: Sequence[Tensor], q: Tensor) -> tuple[Tensor, ...]:
    if not isinstance(aux, (tuple, list)):
        raise TypeError(f"aux must be a tuple of tensors, got {type(aux).__name__}")
    if len(aux) > MAX_AUX:
        raise ValueError(f"at most {MAX_AUX} aux tensors, got {len(aux)}")
    for i, t in enumerate(aux):
        if not isinstance(t, Tensor):
            raise TypeError(f"aux[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in AUX_TYPES:
            raise TypeError(f"aux[{i}]: dtype {t.dtype} is not one of {sorted(str(d) for d in AUX_TYPES)}")
        if t.device != q.device or t.dim() == 0:
            raise ValueError(f"aux[{i}] must be a tensor of rank >= 1 on q's device {q.device}")
    return tuple(t.contiguous() for t in aux)


def mods_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, window: tuple[int, int],
                   softcap: float, sinks: Tensor | None, score_mod: object, mask_mod: object,
                   aux: Sequence[Tensor], cu_q: Tensor | None = None, cu_k: Tensor | None = None,
                   max_q: int | None = None, max_k: int | None = None) -> tuple[Tensor, Tensor]:
    """(out, lse) of attention with the mods applied to the scaled scores before the masks."""
    if torch.compiler.is_compiling():
        raise NotImplementedError("score_mod / mask_mod do not run under torch.compile yet")
    aux = check_aux(aux, q)
    tensors = [q, k, v, *aux] + ([] if sinks is None else [sinks])
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise NotImplementedError("score_mod / mask_mod are forward only for now: call under torch.no_grad() "
                                  "or with inputs that do not require grad")
    if softcap != 0.0:
        raise ValueError("softcap and score_mod / mask_mod: use the softcap score_mod (device/mods.py)")
    validate.check_fwd(q, k, v, softmax_scale=scale, window_size=window, softcap=0.0, cu_seqlens_q=cu_q,
                       cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    if sinks is not None:
        validate.check_sinks(sinks, q)
    dsl_s, torch_s = split_mod("score_mod", score_mod)
    dsl_m, torch_m = split_mod("mask_mod", mask_mod)
    if not q.is_cuda:
        if (dsl_s is not None and torch_s is None) or (dsl_m is not None and torch_m is None):
            raise ValueError("on CPU tensors the mods run in torch: pass (DSL function, torch function) "
                             "pairs")
        out, lse = reference.attention_ref(q, k, v, softmax_scale=scale, causal=causal, window_size=window,
                                           cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, sinks=sinks,
                                           score_mod=torch_s, mask_mod=torch_m, aux=aux)
        return out.to(q.dtype), lse.float()
    mods = Mods(score_mod=dsl_s, mask_mod=dsl_m, aux=tuple((AUX_TYPES[t.dtype], t.dim()) for t in aux))
    out, lse = launch.alloc_fwd(q, v, cu_q is not None)
    if q.numel() == 0 or k.numel() == 0:
        launch.fill_empty_fwd(out, lse, sinks, cu_q is not None)
        return out, lse
    with torch.cuda.device(q.device):
        launch.run_fwd(q, k, v, out, lse, softmax_scale=scale, causal=causal, window_size=window,
                       cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, sinks=sinks, mods=mods,
                       aux=aux)
    return out, lse
