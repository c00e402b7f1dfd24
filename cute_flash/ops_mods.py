"""Attention with a ``score_mod`` / ``mask_mod`` (``device/mods.py``) as ``torch.library`` custom
ops: ``mods_fwd`` and ``mods_bwd``, differentiable in q, k, v, the sinks and the floating-point aux
tensors, traceable by ``torch.compile(fullgraph=True)``.

A mod is Python code, which an op's schema cannot carry: ``register_mods`` files the mods under
their compile key (``Mods.key``: code, constants and captured values) and the ops take that key.
Under ``torch.compile`` the registration runs once while tracing (``assume_constant_result``),
so the key is a constant of the graph. CUDA tensors run the kernels with the mods compiled in; CPU
tensors run ``attention_ref`` with the mods' torch forms (forward) and torch autograd through it
(backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch

from cute_flash import launch, reference, validate
from cute_flash.block_mask import BLOCK, BlockMask, block_mask_of
from cute_flash.device.mods import Mod, Mods
from cute_flash.jit import MAX_AUX
from cute_flash.memo import HostMemo

Tensor = torch.Tensor

AUX_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "int32",
             torch.int64: "int64", torch.bool: "bool"}
GRAD_TYPES = (torch.float32, torch.bfloat16, torch.float16)

# Mods by key: (score Mod or None, mask Mod or None).
_REGISTRY: dict[str, tuple[Mod | None, Mod | None]] = {}


def as_mod(name: str, mod: object) -> Mod | None:
    """``mod`` as a ``Mod``: a DSL function alone, a (DSL function, torch function[, derivative])
    tuple, or a ``Mod`` (the built-ins)."""
    if mod is None:
        return None
    if isinstance(mod, Mod):
        return mod
    if isinstance(mod, tuple) and len(mod) in (2, 3) and all(f is None or callable(f) for f in mod) \
            and callable(mod[0]):
        return Mod(*mod)
    if callable(mod):
        return Mod(mod)
    raise TypeError(f"{name} must be a CuTe-DSL function, a (DSL function, torch function[, score_mod_bwd]) "
                    f"tuple or a cute_flash.device.mods.Mod, got {type(mod).__name__}")


def _key(score: Mod | None, mask: Mod | None) -> str:
    from cute_flash.device.mods import callable_key

    parts = [callable_key(f) if f is not None else "-" for f in (
        score.dsl if score else None, score.torch if score else None, score.bwd if score else None,
        mask.dsl if mask else None, mask.torch if mask else None)]
    return "|".join(parts)


@torch._dynamo.assume_constant_result
def register_mods(score_mod: object, mask_mod: object) -> str:
    """The registry key of these mods (filed on first use); a constant while torch.compile traces."""
    score, mask = as_mod("score_mod", score_mod), as_mod("mask_mod", mask_mod)
    key = _key(score, mask)
    _REGISTRY.setdefault(key, (score, mask))
    return key


def registered(key: str) -> tuple[Mod | None, Mod | None]:
    if key not in _REGISTRY:
        raise ValueError(f"no mods registered under {key!r} (register_mods files them)")
    return _REGISTRY[key]


def kernel_mods(key: str, aux: Sequence[Tensor], grads: Sequence[bool] | None = None,
                sparse: bool = False) -> Mods:
    """What the kernels compile for registered mods ``key`` over ``aux``: the forward's, or with
    ``grads`` (the aux gradient flags) the backward's; ``sparse``: with a block mask."""
    types = tuple((AUX_TYPES[t.dtype], t.dim()) for t in aux)
    memo = (key, types, None if grads is None else tuple(grads), sparse)
    got = _KERNEL_MODS.get(memo)
    if got is None:
        score, mask = registered(key)
        backward = grads is not None
        got = Mods(score_mod=score.dsl if score else None, mask_mod=mask.dsl if mask else None, aux=types,
                   score_mod_bwd=score.bwd if score and backward else None, aux_grads=tuple(grads or ()),
                   block_sparse=sparse)
        _KERNEL_MODS.put(memo, got)
    return got


_KERNEL_MODS = HostMemo(256)


def _blocks(block_any: Tensor | None, block_all: Tensor | None) -> BlockMask | None:
    """The block mask the ops carry as its two grids (its lengths were checked against the call
    before the op: ``mods_attention``)."""
    if block_any is None:
        return None
    known = block_mask_of(block_any, block_all)  # (its ranges cached per tiling)
    if known is not None:
        return known
    return BlockMask(block_any, block_all, block_any.shape[2] * BLOCK, block_any.shape[3] * BLOCK)


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
    return tuple(aux)


def _check(q: Tensor, k: Tensor, v: Tensor, scale: float, window: tuple[int, int], cu_q: Tensor | None,
           cu_k: Tensor | None, max_q: int | None, max_k: int | None, sinks: Tensor | None,
           check_data: bool = True) -> None:
    validate.check_fwd(q, k, v, softmax_scale=scale, window_size=window, softcap=0.0, cu_seqlens_q=cu_q,
                       cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, check_data=check_data)
    if sinks is not None:
        validate.check_sinks(sinks, q)


def _torch_forms(key: str) -> tuple[Callable | None, Callable | None]:
    score, mask = registered(key)
    if (score is not None and score.torch is None) or (mask is not None and mask.torch is None):
        raise ValueError("on CPU tensors the mods run in torch: pass (DSL function, torch function) pairs")
    return (score.torch if score else None), (mask.torch if mask else None)


def _varlen(cu_q: Tensor | None, max_q: int, max_k: int) -> tuple[int | None, int | None]:
    return (max_q, max_k) if cu_q is not None else (None, None)


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------
@torch.library.custom_op("cute_flash::mods_fwd", mutates_args=(), device_types="cpu")
def mods_fwd(q: Tensor, k: Tensor, v: Tensor, aux: list[Tensor], cu_seqlens_q: Tensor | None,
             cu_seqlens_k: Tensor | None, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
             causal: bool, window_left: int, window_right: int, deterministic: bool, sinks: Tensor | None,
             block_any: Tensor | None, block_all: Tensor | None, mods_key: str) -> tuple[Tensor, Tensor]:
    """(out, lse) of attention with the registered mods ``mods_key`` applied to the scaled scores
    before the masks; dense (B, N, H, d) or packed (cu_seqlens_*) inputs. ``deterministic`` only
    matters to the backward; ``block_any`` / ``block_all``: the mask's block mask grids, or None
    (the kernels skip by them; the CPU form needs no skipping)."""
    max_q, max_k = _varlen(cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    window = (window_left, window_right)
    _check(q, k, v, softmax_scale, window, cu_seqlens_q, cu_seqlens_k, max_q, max_k, sinks)
    torch_s, torch_m = _torch_forms(mods_key)
    ref = reference.attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, window_size=window,
                                  cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, sinks=sinks,
                                  score_mod=torch_s, mask_mod=torch_m, aux=tuple(aux))
    out, lse = launch.alloc_fwd(q, v, cu_seqlens_q is not None)  # (the fake's layout)
    out.copy_(ref[0])
    lse.copy_(ref[1])
    return out, lse


@mods_fwd.register_kernel("cuda")
def _fwd_cuda(q, k, v, aux, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
              window_left, window_right, deterministic, sinks, block_any, block_all, mods_key):
    max_q, max_k = _varlen(cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    window = (window_left, window_right)
    _check(q, k, v, softmax_scale, window, cu_seqlens_q, cu_seqlens_k, max_q, max_k, sinks)
    varlen = cu_seqlens_q is not None
    out, lse = launch.alloc_fwd(q, v, varlen)
    if q.numel() == 0 or k.numel() == 0:
        launch.fill_empty_fwd(out, lse, sinks, varlen)
        return out, lse
    aux = tuple(t.contiguous() for t in aux)
    with torch.cuda.device(q.device):
        launch.run_fwd(q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                       window_size=(window_left, window_right), cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_q, sinks=sinks,
                       mods=kernel_mods(mods_key, aux, sparse=block_any is not None), aux=aux,
                       blocks=_blocks(block_any, block_all))
    return out, lse


@mods_fwd.register_fake
def _(q, k, v, aux, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      window_left, window_right, deterministic, sinks, block_any, block_all, mods_key):
    max_q, max_k = _varlen(cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    _check(q, k, v, softmax_scale, (window_left, window_right), cu_seqlens_q, cu_seqlens_k, max_q, max_k,
           sinks, check_data=False)
    return launch.alloc_fwd(q, v, cu_seqlens_q is not None)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------
def _grad_shapes(aux: Sequence[Tensor], aux_grad: Sequence[bool]) -> list[Tensor]:
    """Zeroed fp64 gradients of the flagged aux tensors (the kernels add into them: ``grad_add``)."""
    return [torch.zeros(t.shape, dtype=torch.float64, device=t.device)
            for t, g in zip(aux, aux_grad, strict=True) if g]


@torch.library.custom_op("cute_flash::mods_bwd", mutates_args=(), device_types="cpu")
def mods_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, aux: list[Tensor],
             aux_grad: list[bool], cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
             max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int,
             window_right: int, deterministic: bool, dlse: Tensor | None, sinks: Tensor | None,
             block_any: Tensor | None, block_all: Tensor | None,
             mods_key: str) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor]]:
    """(dq, dk, dv, dsinks, fp64 gradients of the aux tensors flagged in ``aux_grad``) of
    ``mods_fwd``; dsinks: the sinks' fp32 gradient, empty without sinks. On CPU: torch.func
    through ``attention_ref`` with the mods' torch forms (it recomputes the forward instead of
    reading ``out`` / ``lse``)."""
    torch_s, torch_m = _torch_forms(mods_key)
    # (torch.func, not autograd: autograd is off below a custom op's dispatch, grad mode or not.)
    leaves = [t.detach().to(torch.float64) for t in (q, k, v)]
    wrt = leaves + [t.detach().to(torch.float64) for t, g in zip(aux, aux_grad, strict=True) if g]
    sinks64 = None if sinks is None else sinks.detach().double()

    def forward(*xs):
        it = iter(xs[3:])
        aux_in = tuple(next(it) if g else t for t, g in zip(aux, aux_grad, strict=True))
        o, l_ = reference.attention_ref(*xs[:3], softmax_scale=softmax_scale, causal=causal,
                                        window_size=(window_left, window_right), cu_seqlens_q=cu_seqlens_q,
                                        cu_seqlens_k=cu_seqlens_k, sinks=sinks64, score_mod=torch_s,
                                        mask_mod=torch_m, aux=aux_in)
        return o, l_

    (o, l_), vjp = torch.func.vjp(forward, *wrt)
    got = vjp((dout.double(), torch.zeros_like(l_) if dlse is None else dlse.to(l_.dtype)))
    got = [torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt, strict=True)]
    dq, dk, dv = (torch.empty_like(t).copy_(g) for g, t in zip(got[:3], (q, k, v), strict=True))
    varlen = cu_seqlens_q is not None
    dsinks = None if sinks is None else launch.sink_grad(sinks, out, lse, dout, dlse, varlen)
    return dq, dk, dv, _sinks_out(q, dsinks), [g.double() for g in got[3:]]


def _sinks_out(q: Tensor, dsinks: Tensor | None) -> Tensor:
    """The sinks' gradient as an op output (an empty tensor without sinks)."""
    return dsinks.float() if dsinks is not None else q.new_empty((0,), dtype=torch.float32)


@mods_bwd.register_kernel("cuda")
def _bwd_cuda(dout, q, k, v, out, lse, aux, aux_grad, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
              max_seqlen_k, softmax_scale, causal, window_left, window_right, deterministic, dlse, sinks,
              block_any, block_all, mods_key):
    max_q, max_k = _varlen(cu_seqlens_q, max_seqlen_q, max_seqlen_k)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    grads = _grad_shapes(aux, aux_grad)
    if q.numel() == 0 or k.numel() == 0:
        for g in (dq, dk, dv):
            g.zero_()
        dsinks = None if sinks is None else launch.sink_grad(sinks, out, lse, dout, dlse,
                                                             cu_seqlens_q is not None)
        return dq, dk, dv, _sinks_out(q, dsinks), grads
    aux = tuple(t.contiguous() for t in aux)
    it = iter(grads)
    aligned = tuple(next(it) if g else None for g in aux_grad)
    with torch.cuda.device(q.device):
        dsinks = launch.run_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=softmax_scale,
                                causal=causal, window_size=(window_left, window_right),
                                deterministic=deterministic, cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_q, max_seqlen_k=max_k, dlse=dlse,
                                aux=aux, aux_grads=aligned, sinks=sinks, blocks=_blocks(block_any, block_all),
                                mods=kernel_mods(mods_key, aux, aux_grad, sparse=block_any is not None))
    return dq, dk, dv, _sinks_out(q, dsinks), grads


@mods_bwd.register_fake
def _(dout, q, k, v, out, lse, aux, aux_grad, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, window_left, window_right, deterministic, dlse, sinks, block_any, block_all,
      mods_key):
    dsinks = None if sinks is None else torch.empty(sinks.shape, dtype=torch.float32, device=sinks.device)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), _sinks_out(q, dsinks),
            _grad_shapes(aux, aux_grad))


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------
def _setup(ctx, inputs, output) -> None:
    q, k, v, aux, cu_q, cu_k, max_q, max_k, scale, causal, wl, wr, deterministic, sinks, *blocks, key = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, cu_q, cu_k, *blocks, *aux)
    ctx.params = (max_q, max_k, scale, causal, wl, wr, deterministic, key)
    score, _ = registered(key)
    # (Only a score_mod's derivative gives aux gradients: a mask does not depend on its tensors.)
    learns = score is not None and score.bwd is not None
    ctx.aux_grad = [learns and t.requires_grad and t.dtype in GRAD_TYPES for t in aux]
    ctx.set_materialize_grads(False)


def _grads(ctx, dout: Tensor | None, dlse: Tensor | None, bwd) -> tuple:
    """(dq, dk, dv, aux gradients, dsinks) of a ``mods_fwd`` call saved by ``_setup``; ``bwd``:
    the backward op or its CUDA implementation."""
    q, k, v, out, lse, sinks, cu_q, cu_k, b_any, b_all, *aux = ctx.saved_tensors
    if dout is None and dlse is None:
        return None, None, None, [None] * len(aux), None
    max_q, max_k, scale, causal, wl, wr, deterministic, key = ctx.params
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    dlse = None if dlse is None else dlse.float().contiguous()
    dq, dk, dv, dsinks, grads = bwd(dout, q, k, v, out, lse, aux, ctx.aux_grad, cu_q, cu_k, max_q, max_k,
                                    scale, causal, wl, wr, deterministic, dlse, sinks, b_any, b_all, key)
    it = iter(grads)
    daux = [next(it).to(t.dtype) if g else None for t, g in zip(aux, ctx.aux_grad, strict=True)]
    dsinks = dsinks if sinks is not None and sinks.requires_grad else None
    return dq, dk, dv, daux, dsinks


def _backward(ctx, dout: Tensor | None, dlse: Tensor | None):
    dq, dk, dv, daux, dsinks = _grads(ctx, dout, dlse, torch.ops.cute_flash.mods_bwd)
    return dq, dk, dv, daux, *(None,) * 9, dsinks, None, None, None


mods_fwd.register_autograd(_backward, setup_context=_setup)


def mods_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, window: tuple[int, int],
                   softcap: float, deterministic: bool, sinks: Tensor | None, score_mod: object,
                   mask_mod: object, aux: Sequence[Tensor], cu_q: Tensor | None = None,
                   cu_k: Tensor | None = None, max_q: int | None = None, max_k: int | None = None,
                   block_mask: BlockMask | None = None) -> tuple[Tensor, Tensor]:
    """(out, lse) of attention with the mods applied to the scaled scores before the masks,
    differentiable through ``mods_fwd``; ``block_mask``: the mask_mod's (``create_block_mask``)."""
    aux = check_aux(aux, q)
    if softcap != 0.0:
        raise ValueError("softcap and score_mod / mask_mod: use the softcap score_mod (device/mods.py)")
    score, mask = as_mod("score_mod", score_mod), as_mod("mask_mod", mask_mod)
    learnable = (q, k, v, *aux) + (() if sinks is None else (sinks,))
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in learnable)
    if grads and score is not None and score.bwd is None:
        raise ValueError("gradients through a score_mod need its derivative: pass (DSL function, torch "
                         "function, score_mod_bwd), or call under torch.no_grad()")
    if deterministic and grads and any(t.requires_grad for t in aux) and score is not None:
        raise ValueError("deterministic mode does not take aux gradients yet (they are added atomically)")
    for i, t in enumerate(aux):
        if t.requires_grad and t.dtype not in GRAD_TYPES:
            raise TypeError(f"aux[{i}] requires grad but is {t.dtype}: gradients reach float aux tensors "
                            "only")
    key = register_mods(score, mask)
    if cu_q is not None:
        max_q = int(launch.max_seqlen(cu_q, max_q)) if max_q is None else int(max_q)
        max_k = int(launch.max_seqlen(cu_k, max_k)) if max_k is None else int(max_k)
    grids = [None, None]
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError("block_mask must be a BlockMask (create_block_mask), got "
                            f"{type(block_mask).__name__}")
        if mask is None:
            raise ValueError("block_mask goes with the mask_mod it was made from")
        if deterministic and grads:
            raise ValueError("deterministic mode does not take a block mask yet")
        launch.check_block_mask(block_mask, q, k, cu_q, max_q, max_k)
        grids = [block_mask.any_visible, block_mask.all_visible]
    rest = (cu_q, cu_k, max_q or 0, max_k or 0, float(scale), bool(causal), int(window[0]), int(window[1]),
            bool(deterministic), *grids, key)
    direct = launch.eager_direct(q)
    if grads and launch.eager_autograd():
        return _EagerModsForward.apply(direct, rest, q, k, v, sinks, *aux)
    return _run_fwd(direct, rest, q, k, v, sinks, aux)


def _run_fwd(direct: bool, rest: tuple, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None,
             aux: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    inputs = _fwd_inputs(rest, q, k, v, sinks, aux)
    if not direct:
        return torch.ops.cute_flash.mods_fwd(*inputs)
    with launch.profiler_name("cute_flash::mods_fwd"):
        return _fwd_cuda(*inputs)


def _fwd_inputs(rest: tuple, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, aux: Sequence[Tensor]):
    """``mods_fwd``'s arguments from ``mods_attention``'s ``rest`` (all but the tensors autograd
    sees)."""
    return (q, k, v, list(aux), *rest[:9], sinks, *rest[9:])


class _EagerModsForward(torch.autograd.Function):
    """``mods_fwd`` under eager autograd, its saved tensors and backward as ``register_autograd``
    gives them, without that wrapper's host time per call (schema defaults, argument flattening,
    the dispatcher: ~0.3 ms of a short call's critical path); ``direct``: the CUDA implementations
    are called directly (``launch.eager_direct``)."""

    @staticmethod
    def forward(ctx, direct, rest, q, k, v, sinks, *aux):
        output = _run_fwd(direct, rest, q, k, v, sinks, aux)
        _setup(ctx, _fwd_inputs(rest, q, k, v, sinks, aux), output)
        ctx.direct = direct
        return output

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        # (create_graph=True goes through the op, whose missing double backward then raises.)
        direct = ctx.direct and not torch.is_grad_enabled()
        bwd = _bwd_cuda if direct else torch.ops.cute_flash.mods_bwd
        with launch.profiler_name("cute_flash::mods_bwd") if direct else contextlib.nullcontext():
            dq, dk, dv, daux, dsinks = _grads(ctx, dout, dlse, bwd)
        return None, None, dq, dk, dv, dsinks, *daux
