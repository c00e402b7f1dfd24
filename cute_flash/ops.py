"""``torch.library`` custom ops of the ``cute_flash`` namespace.

Ops: ``fwd``, ``bwd``, ``varlen_fwd``, ``varlen_bwd``. Each has

* a fake (meta) implementation, so ``torch.compile(fullgraph=True)`` traces through it;
* a CUDA implementation that validates, allocates its outputs and calls the launchers
  (``launch.run_fwd`` / ``launch.run_bwd``);
* a CPU implementation computed with ``cute_flash.reference`` (fp32 math, cast back), so
  ``torch.library.opcheck`` and compile tests run for real on a machine without a GPU.

The forward ops are differentiable through ``register_autograd``; the backward ops are not
(no double backward).
"""

from __future__ import annotations

import torch

from cute_flash import launch, reference, validate

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------
# Allocation and kernel-facing helpers (shared by the real and the fake implementations, so
# both give outputs of the same shapes, dtypes and strides)
# ---------------------------------------------------------------------------------------------
def _alloc_bwd(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    # Gradients laid out like their inputs: the kernels take any strides that pass validation,
    # and autograd then accumulates into .grad without a layout change.
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _kernel_view(t: Tensor) -> Tensor:
    """``t`` with stride 0 on every extent-1 dim whose stride is not 16-byte aligned or too large
    for a TMA descriptor. Such strides never address anything (validation ignores them), but the
    compiled kernels declare every stride 16-byte divisible and would refuse the tensor at the
    call boundary, and the sm90 forward encodes every stride into its TMA descriptors."""
    if 1 not in t.shape[:-1]:
        return t  # (the common case, decided without walking the strides)
    elem = t.element_size()
    vec = max(validate.ALIGN_BYTES // elem, 1)
    strides = list(t.stride())
    changed = False
    for dim in range(t.dim() - 1):
        if t.shape[dim] == 1 and (strides[dim] % vec != 0
                                  or strides[dim] * elem >= validate.TMA_MAX_STRIDE_BYTES):
            strides[dim] = 0
            changed = True
    return t.as_strided(t.shape, strides) if changed else t


def kernel_ready(t: Tensor) -> Tensor:
    """``t`` itself if the kernels accept its layout, else an aligned contiguous copy. Used on
    tensors autograd hands us (e.g. ``dout`` of ``out.sum()`` is an all-stride-0 expand)."""
    try:
        validate.check_layout("t", t, check_data=False)
        aligned = t.numel() == 0 or t.data_ptr() % validate.ALIGN_BYTES == 0
    except ValueError:
        aligned = False
    except RuntimeError:
        aligned = True  # a fake tensor while torch.compile traces: no pointer to check yet
    return t if aligned else t.clone(memory_format=torch.contiguous_format)


def _is_empty(q: Tensor, k: Tensor) -> bool:
    """No work for a kernel: no queries, or no keys (then every row sees nothing)."""
    return q.numel() == 0 or k.numel() == 0


# ---------------------------------------------------------------------------------------------
# Forward implementations
# ---------------------------------------------------------------------------------------------
def _fwd_cuda(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, window: tuple[int, int],
              softcap: float, cu_q: Tensor | None = None, cu_k: Tensor | None = None,
              max_q: int | None = None, max_k: int | None = None,
              sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    validate.check_fwd(q, k, v, softmax_scale=scale, window_size=window, softcap=softcap, cu_seqlens_q=cu_q,
                       cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    if sinks is not None:
        validate.check_sinks(sinks, q)
    out, lse = launch.alloc_fwd(q, v, cu_q is not None)
    if _is_empty(q, k):
        launch.fill_empty_fwd(out, lse, sinks, cu_q is not None)
        return out, lse
    with torch.cuda.device(q.device):
        launch.run_fwd(_kernel_view(q), _kernel_view(k), _kernel_view(v), out, lse, softmax_scale=scale,
                       causal=causal, window_size=window, softcap=softcap, cu_seqlens_q=cu_q,
                       cu_seqlens_k=cu_k, max_seqlen_q=max_q, sinks=sinks)
    return out, lse


def _fwd_cpu(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool, window: tuple[int, int],
             softcap: float, cu_q: Tensor | None = None, cu_k: Tensor | None = None,
             max_q: int | None = None, max_k: int | None = None,
             sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    validate.check_fwd(q, k, v, softmax_scale=scale, window_size=window, softcap=softcap, cu_seqlens_q=cu_q,
                       cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)
    if sinks is not None:
        validate.check_sinks(sinks, q)
    out, lse = launch.alloc_fwd(q, v, cu_q is not None)
    ref_out, ref_lse = reference.attention_ref(q, k, v, softmax_scale=scale, causal=causal,
                                               window_size=window, softcap=softcap, cu_seqlens_q=cu_q,
                                               cu_seqlens_k=cu_k, sinks=sinks)
    out.copy_(ref_out)
    lse.copy_(ref_lse)
    return out, lse


def _fwd_fake(q: Tensor, k: Tensor, v: Tensor, scale: float, window: tuple[int, int], softcap: float,
              cu_q: Tensor | None = None, cu_k: Tensor | None = None, max_q: int | None = None,
              max_k: int | None = None, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    # Metadata checks at trace time, so a bad call fails while compiling, not at run time.
    validate.check_fwd(q, k, v, softmax_scale=scale, window_size=window, softcap=softcap, cu_seqlens_q=cu_q,
                       cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, check_data=False)
    if sinks is not None:
        validate.check_sinks(sinks, q)
    return launch.alloc_fwd(q, v, cu_q is not None)


@torch.library.custom_op("cute_flash::fwd", mutates_args=(), device_types="cpu")
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, window_left: int,
        window_right: int, softcap: float, deterministic: bool = False,
        sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention forward on (B, N, H, d) inputs: (out (B, Nq, H, dv), lse (B, H, Nq) float32).
    ``deterministic`` only matters to the backward; it rides along so autograd can see it.
    ``sinks``: (H,) float32 learnable sink logits, or None."""
    return _fwd_cpu(q, k, v, softmax_scale, causal, (window_left, window_right), softcap, sinks=sinks)


@fwd.register_kernel("cuda")
def _fwd_cuda_kernel(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic=False,
                     sinks=None):
    return _fwd_cuda(q, k, v, softmax_scale, causal, (window_left, window_right), softcap, sinks=sinks)


@fwd.register_fake
def _(q, k, v, softmax_scale, causal, window_left, window_right, softcap, deterministic=False, sinks=None):
    return _fwd_fake(q, k, v, softmax_scale, (window_left, window_right), softcap, sinks=sinks)


@torch.library.custom_op("cute_flash::varlen_fwd", mutates_args=(), device_types="cpu")
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float, causal: bool, window_left: int, window_right: int,
               softcap: float, deterministic: bool = False,
               sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Attention forward on packed (total, H, d) inputs: (out (Tq, H, dv), lse (H, Tq) float32)."""
    return _fwd_cpu(q, k, v, softmax_scale, causal, (window_left, window_right), softcap, cu_seqlens_q,
                    cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks)


@varlen_fwd.register_kernel("cuda")
def _varlen_fwd_cuda_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                            causal, window_left, window_right, softcap, deterministic=False, sinks=None):
    return _fwd_cuda(q, k, v, softmax_scale, causal, (window_left, window_right), softcap, cu_seqlens_q,
                     cu_seqlens_k, max_seqlen_q, max_seqlen_k, sinks)


@varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
      window_right, softcap, deterministic=False, sinks=None):
    return _fwd_fake(q, k, v, softmax_scale, (window_left, window_right), softcap, cu_seqlens_q, cu_seqlens_k,
                     max_seqlen_q, max_seqlen_k, sinks)


# ---------------------------------------------------------------------------------------------
# Backward implementations
# ---------------------------------------------------------------------------------------------
def _bwd_cuda(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
              causal: bool, window: tuple[int, int], softcap: float, deterministic: bool,
              cu_q: Tensor | None = None, cu_k: Tensor | None = None, max_q: int | None = None,
              max_k: int | None = None, dlse: Tensor | None = None,
              sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    validate.check_bwd(dout, q, k, v, out, lse, softmax_scale=scale, window_size=window, softcap=softcap,
                       cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                       dlse=dlse)
    dq, dk, dv = _alloc_bwd(q, k, v)
    if _is_empty(q, k):
        for g in (dq, dk, dv):
            g.zero_()
        dsinks = None if sinks is None else launch.sink_grad(sinks, out, lse, dout, dlse, cu_q is not None)
        return dq, dk, dv, _sinks_out(q, dsinks)
    kv = _kernel_view
    with torch.cuda.device(q.device):
        dsinks = launch.run_bwd(kv(dout), kv(q), kv(k), kv(v), kv(out), lse, kv(dq), kv(dk), kv(dv),
                                softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
                                deterministic=deterministic, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                max_seqlen_q=max_q, max_seqlen_k=max_k,
                                dlse=None if dlse is None else dlse.contiguous(), sinks=sinks)
    return dq, dk, dv, _sinks_out(q, dsinks)


def _bwd_cpu(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
             causal: bool, window: tuple[int, int], softcap: float, deterministic: bool,
             cu_q: Tensor | None = None, cu_k: Tensor | None = None, max_q: int | None = None,
             max_k: int | None = None, dlse: Tensor | None = None,
             sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    validate.check_bwd(dout, q, k, v, out, lse, softmax_scale=scale, window_size=window, softcap=softcap,
                       cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                       dlse=dlse)
    dq, dk, dv = _alloc_bwd(q, k, v)
    grads = reference.attention_bwd_ref(dout, q, k, v, out, lse, softmax_scale=scale, causal=causal,
                                        window_size=window, softcap=softcap, cu_seqlens_q=cu_q,
                                        cu_seqlens_k=cu_k, dlse=dlse)
    for dst, src in zip((dq, dk, dv), grads, strict=True):
        dst.copy_(src)
    dsinks = None if sinks is None else launch.sink_grad(sinks, out, lse, dout, dlse, cu_q is not None)
    return dq, dk, dv, _sinks_out(q, dsinks)


def _bwd_fake(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
              window: tuple[int, int], softcap: float, cu_q: Tensor | None = None, cu_k: Tensor | None = None,
              max_q: int | None = None, max_k: int | None = None, dlse: Tensor | None = None,
              sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    validate.check_bwd(dout, q, k, v, out, lse, softmax_scale=scale, window_size=window, softcap=softcap,
                       cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                       dlse=dlse, check_data=False)
    dsinks = None if sinks is None else torch.empty(sinks.shape, dtype=torch.float32, device=sinks.device)
    return (*_alloc_bwd(q, k, v), _sinks_out(q, dsinks))


def _sinks_out(q: Tensor, dsinks: Tensor | None) -> Tensor:
    """The backward ops' fourth output: the sinks' fp32 gradient, or an empty tensor without sinks
    (an op's outputs cannot be None)."""
    return dsinks if dsinks is not None else q.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("cute_flash::bwd", mutates_args=(), device_types="cpu")
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, softmax_scale: float,
        causal: bool, window_left: int, window_right: int, softcap: float,
        deterministic: bool = False, dlse: Tensor | None = None,
        sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Attention backward on (B, N, H, d) inputs: (dq, dk, dv, dsinks), the first three shaped like
    q, k, v. ``dlse``: the gradient of the forward's LSE output (float32, lse's shape), or None;
    ``sinks``: the forward's sink logits, whose fp32 gradient is the fourth output (empty
    without)."""
    return _bwd_cpu(dout, q, k, v, out, lse, softmax_scale, causal, (window_left, window_right), softcap,
                    deterministic, dlse=dlse, sinks=sinks)


@bwd.register_kernel("cuda")
def _(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
      deterministic=False, dlse=None, sinks=None):
    return _bwd_cuda(dout, q, k, v, out, lse, softmax_scale, causal, (window_left, window_right), softcap,
                     deterministic, dlse=dlse, sinks=sinks)


@bwd.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right, softcap,
      deterministic=False, dlse=None, sinks=None):
    return _bwd_fake(dout, q, k, v, out, lse, softmax_scale, (window_left, window_right), softcap, dlse=dlse,
                     sinks=sinks)


@torch.library.custom_op("cute_flash::varlen_bwd", mutates_args=(), device_types="cpu")
def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
               cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float, causal: bool,
               window_left: int, window_right: int, softcap: float,
               deterministic: bool = False, dlse: Tensor | None = None,
               sinks: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Attention backward on packed (total, H, d) inputs: (dq, dk, dv, dsinks) as ``bwd``'s. ``dlse``:
    the gradient of the forward's LSE output (float32, (H, total)), or None."""
    return _bwd_cpu(dout, q, k, v, out, lse, softmax_scale, causal, (window_left, window_right), softcap,
                    deterministic, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dlse, sinks)


@varlen_bwd.register_kernel("cuda")
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      window_left, window_right, softcap, deterministic=False, dlse=None, sinks=None):
    return _bwd_cuda(dout, q, k, v, out, lse, softmax_scale, causal, (window_left, window_right), softcap,
                     deterministic, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dlse, sinks)


@varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      window_left, window_right, softcap, deterministic=False, dlse=None, sinks=None):
    return _bwd_fake(dout, q, k, v, out, lse, softmax_scale, (window_left, window_right), softcap,
                     cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dlse, sinks)


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------
def _setup_fwd(ctx, inputs, output) -> None:
    q, k, v, scale, causal, wl, wr, softcap, deterministic, *sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks[0] if sinks else None)
    ctx.varlen = None
    ctx.params = (scale, causal, wl, wr, softcap, deterministic)
    # Unused outputs (usually lse) then arrive as None instead of zeros, which lets the backward
    # skip the extra work the lse gradient costs.
    ctx.set_materialize_grads(False)


def _setup_varlen_fwd(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, wl, wr, softcap, deterministic, *sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sinks[0] if sinks else None, cu_q, cu_k)
    ctx.varlen = (max_q, max_k)
    ctx.params = (scale, causal, wl, wr, softcap, deterministic)
    ctx.set_materialize_grads(False)


def _attention_grads(ctx, dout: Tensor | None, dlse: Tensor | None,
                     direct: bool = False) -> tuple[Tensor | None, ...]:
    """(dq, dk, dv, dsinks)."""
    q, k, v, out, lse, sinks, *cu = ctx.saved_tensors
    if dout is None and dlse is None:
        return None, None, None, None
    if sinks is not None and not sinks.requires_grad:
        sinks = None
    dq, dk, dv, dsinks = _qkv_grads(ctx, q, k, v, out, lse, cu, dout, dlse, direct, sinks)
    return dq, dk, dv, (dsinks if sinks is not None else None)


def _qkv_grads(ctx, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu: list[Tensor],
               dout: Tensor | None, dlse: Tensor | None, direct: bool,
               sinks: Tensor | None) -> tuple[Tensor | None, ...]:
    """(dq, dk, dv, dsinks) through the backward op (``cu``: the varlen offsets, or empty; the sinks'
    gradient comes from the preprocess's D)."""
    scale, causal, wl, wr, softcap, deterministic = ctx.params
    # Only the LSE used: dO = 0 (its dv is then exactly 0). A used LSE costs no second backward:
    # the preprocess folds dlse into D (d lse_i / d s_ij = P_ij adds P_ij dlse_i to dS_ij).
    dout = torch.zeros_like(out) if dout is None else kernel_ready(dout)
    if dlse is not None:
        dlse = dlse.float().contiguous()
    if direct:
        varlen = () if ctx.varlen is None else (*cu, *ctx.varlen)
        with launch.profiler_name("cute_flash::bwd" if ctx.varlen is None else "cute_flash::varlen_bwd"):
            return _bwd_cuda(dout, q, k, v, out, lse, scale, causal, (wl, wr), softcap, deterministic,
                             *varlen, dlse=dlse, sinks=sinks)
    flags = (scale, causal, wl, wr, softcap, deterministic, dlse, sinks)
    if ctx.varlen is None:
        return torch.ops.cute_flash.bwd(dout, q, k, v, out, lse, *flags)
    return torch.ops.cute_flash.varlen_bwd(dout, q, k, v, out, lse, *cu, *ctx.varlen, *flags)


def _backward(ctx, dout: Tensor | None, dlse: Tensor | None):
    dq, dk, dv, dsinks = _attention_grads(ctx, dout, dlse)
    return dq, dk, dv, None, None, None, None, None, None, dsinks


def _varlen_backward(ctx, dout: Tensor | None, dlse: Tensor | None):
    dq, dk, dv, dsinks = _attention_grads(ctx, dout, dlse)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, dsinks


fwd.register_autograd(_backward, setup_context=_setup_fwd)
varlen_fwd.register_autograd(_varlen_backward, setup_context=_setup_varlen_fwd)


# ---------------------------------------------------------------------------------------------
# Eager calls
# ---------------------------------------------------------------------------------------------
class _EagerForward(torch.autograd.Function):
    """A forward under eager autograd: the op's saved tensors and backward, as its
    ``register_autograd`` registration gives them, at a fraction of that wrapper's host time per
    call (it fills the schema's defaults and flattens the arguments each time: ~40-50 us, which a
    short attention call pays in full). ``run``: the op, or its CUDA implementation
    (``launch.eager_direct``)."""

    @staticmethod
    def forward(ctx, run, setup, direct, q, k, v, rest, sinks):
        # (The op's other arguments travel as one tuple: apply walks every argument per call.
        # The sinks, differentiable, travel on their own.)
        inputs = (q, k, v, *rest) if sinks is None else (q, k, v, *rest, sinks)
        output = run(inputs)
        setup(ctx, inputs, output)
        ctx.direct = direct
        return output

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None):
        # create_graph=True: through the op, whose missing double backward then raises when
        # reached instead of the gradients' graph being silently cut.
        direct = ctx.direct and not torch.is_grad_enabled()
        dq, dk, dv, dsinks = _attention_grads(ctx, dout, dlse, direct=direct)
        return None, None, None, dq, dk, dv, None, dsinks


def _needs_graph(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None = None) -> bool:
    """Eager autograd will record this call (torch.compile traces the op's own registration)."""
    grads = q.requires_grad or k.requires_grad or v.requires_grad
    grads = grads or (sinks is not None and sinks.requires_grad)
    return torch.is_grad_enabled() and grads and launch.eager_autograd()


def _forward(op, cuda_kernel, setup, q: Tensor, k: Tensor, v: Tensor, rest: tuple,
             sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``op`` on (q, k, v, *rest[, sinks]), differentiable: an eager CUDA call runs ``cuda_kernel``
    (the op's own CUDA implementation) without the dispatcher, under the op's name on profiler
    traces."""
    direct = launch.eager_direct(q)

    def run(inputs: tuple) -> tuple[Tensor, Tensor]:
        if not direct:
            return op(*inputs)
        with launch.profiler_name(op._qualified_op_name):
            return cuda_kernel(*inputs)

    if _needs_graph(q, k, v, sinks):
        return _EagerForward.apply(run, setup, direct, q, k, v, rest, sinks)
    return run((q, k, v, *rest) if sinks is None else (q, k, v, *rest, sinks))


def attention_fwd(q: Tensor, k: Tensor, v: Tensor, *flags,
                  sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``torch.ops.cute_flash.fwd``, differentiable, through the cheaper eager paths above."""
    return _forward(torch.ops.cute_flash.fwd, _fwd_cuda_kernel, _setup_fwd, q, k, v, flags, sinks)


def attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, *args,
                         sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``torch.ops.cute_flash.varlen_fwd``, differentiable, through the cheaper eager paths above."""
    op = torch.ops.cute_flash.varlen_fwd
    return _forward(op, _varlen_fwd_cuda_kernel, _setup_varlen_fwd, q, k, v, args, sinks)
