"""Call signatures shared by the kernel families, as compile arguments (fake tensors with symbolic
extents and strides): every forward kernel takes the same arguments, every main backward kernel
and every backward postprocess too, so the launchers call any family the same way.
"""

from __future__ import annotations

import cutlass

from cute_flash import jit


def scalar_args() -> tuple:
    """(softmax_scale, softcap, window_left, window_right, max_seqlen): run-time scalars."""
    f32, i32 = cutlass.Float32, cutlass.Int32
    return f32(1.0), f32(0.0), i32(-1), i32(-1), i32(0)


def aux_args(mods) -> tuple:
    """The forward's ``MAX_AUX`` aux tensor arguments of ``mods`` (``device/mods.py``): a fake
    tensor of each declared (dtype, rank), None for the rest."""
    specs = () if mods is None else mods.aux
    fakes = [jit.fake_tensor(jit.AUX_DTYPES[dt], tuple(jit.sym() for _ in range(rank)), leading_dim=rank - 1)
             for dt, rank in specs]
    return (*fakes, *([None] * (jit.MAX_AUX - len(fakes))))


def aux_grad_args(mods) -> tuple:
    """The main backward's ``MAX_AUX`` aux gradient arguments: an fp64 fake tensor of the aux
    tensor's rank where ``mods.aux_grads`` asks for one, None elsewhere."""
    specs = () if mods is None else mods.aux
    flags = () if mods is None else (mods.aux_grads or (False,) * len(specs))
    fakes = [jit.fake_tensor(cutlass.Float64, tuple(jit.sym() for _ in range(rank)), leading_dim=rank - 1)
             if flag else None for flag, (_, rank) in zip(flags, specs, strict=True)]
    return (*fakes, *([None] * (jit.MAX_AUX - len(fakes))))


def blocks_arg(mods):
    """A forward's / main backward's block mask ranges (int32 (B, H, blocks, 4)), or None without
    ``mods.block_sparse``."""
    if mods is None or not mods.block_sparse:
        return None
    return jit.fake_tensor(cutlass.Int32, (jit.sym(), jit.sym(), jit.sym(), 4), leading_dim=3)


def sinks_arg(sinks: bool):
    """The forward's (H,) fp32 sink logits, or None (the kernels then compile without them)."""
    return jit.fake_tensor(cutlass.Float32, (jit.sym(),), leading_dim=0) if sinks else None


def fwd_fake_args(dtype: str, hdim: int, hdim_v: int, varlen: bool) -> tuple:
    """Compile arguments of every forward kernel (sm80 and sm90 share the call signature):
    (q, k, v, o, lse, cu_q, cu_k, softmax_scale, softcap, window_left, window_right, max_seqlen_q,
    stream), flash-attn layouts, extents and strides symbolic."""
    dt = jit.DTYPES[dtype]
    div = jit.vec_div(dt)
    h, hkv, d, dv = jit.sym(), jit.sym(), hdim, hdim_v
    if varlen:
        tq, tk, b1 = jit.sym(), jit.sym(), jit.sym()
        q = jit.fake_tensor(dt, (tq, h, d), divisibility=div)
        k = jit.fake_tensor(dt, (tk, hkv, d), divisibility=div)
        v = jit.fake_tensor(dt, (tk, hkv, dv), divisibility=div)
        o = jit.fake_tensor(dt, (tq, h, dv), divisibility=div)
        lse = jit.fake_tensor(cutlass.Float32, (h, tq), divisibility=1)
        cu_q = jit.fake_tensor(cutlass.Int32, (b1,), leading_dim=0)
        cu_k = jit.fake_tensor(cutlass.Int32, (b1,), leading_dim=0)
    else:
        b, nq, nk = jit.sym(), jit.sym(), jit.sym()
        q = jit.fake_tensor(dt, (b, nq, h, d), divisibility=div)
        k = jit.fake_tensor(dt, (b, nk, hkv, d), divisibility=div)
        v = jit.fake_tensor(dt, (b, nk, hkv, dv), divisibility=div)
        o = jit.fake_tensor(dt, (b, nq, h, dv), divisibility=div)
        lse = jit.fake_tensor(cutlass.Float32, (b, h, nq), divisibility=1)
        cu_q = cu_k = None
    scalars = scalar_args()
    return (q, k, v, o, lse, cu_q, cu_k, *scalars, jit.fake_stream())


def scratch_fakes(varlen: bool, h, b, with_sem: bool):
    """Fake fp32 scratch tensors (LSE2, D, dQaccum, semaphores); see ``launch.alloc_scratch``."""
    f32 = cutlass.Float32
    if varlen:
        tpad, tpad_d, nblk = jit.sym(), jit.sym(), jit.sym()
        lse2 = jit.fake_tensor(f32, (h, tpad), divisibility=4)
        d = jit.fake_tensor(f32, (h, tpad), divisibility=4)
        dq_acc = jit.fake_tensor(f32, (h, tpad_d), divisibility=4)
        sem = jit.fake_tensor(cutlass.Int32, (h, nblk), divisibility=1) if with_sem else None
    else:
        npad, npad_d, nblk = jit.sym(), jit.sym(), jit.sym()
        lse2 = jit.fake_tensor(f32, (b, h, npad), divisibility=4)
        d = jit.fake_tensor(f32, (b, h, npad), divisibility=4)
        dq_acc = jit.fake_tensor(f32, (b, h, npad_d), divisibility=4)
        sem = jit.fake_tensor(cutlass.Int32, (b, h, nblk), divisibility=1) if with_sem else None
    return lse2, d, dq_acc, sem


def bwd_main_fake_args(dtype: str, hdim: int, hdim_v: int, varlen: bool, deterministic: bool,
                       split_heads: bool = False, mods=None) -> tuple:
    """Compile arguments of every main backward kernel (sm80 and sm90 share the call signature):
    (q, k, v, do, lse2, d, dq_accum, dk, dv, cu_q, cu_k, semaphores, softmax_scale, softcap,
    window_left, window_right, max_seqlen_k, aux0..3, aux_grad0..3, blocks, stream). ``split_heads``: dk /
    dv have their own head count (partial sums, a multiple of k's heads); ``mods``: the aux
    tensors' and their gradients' types (None past the last)."""
    dt = jit.DTYPES[dtype]
    div = jit.vec_div(dt)
    h, hkv, d, dv = jit.sym(), jit.sym(), hdim, hdim_v
    if varlen:
        tq, tk, b1 = jit.sym(), jit.sym(), jit.sym()
        q_shape, k_shape = (lambda x: (tq, h, x)), (lambda x: (tk, hkv, x))
        cu_q = jit.fake_tensor(cutlass.Int32, (b1,), leading_dim=0)
        cu_k = jit.fake_tensor(cutlass.Int32, (b1,), leading_dim=0)
        b = None
    else:
        b, nq, nk = jit.sym(), jit.sym(), jit.sym()
        q_shape, k_shape = (lambda x: (b, nq, h, x)), (lambda x: (b, nk, hkv, x))
        cu_q = cu_k = None
    q = jit.fake_tensor(dt, q_shape(d), divisibility=div)
    k = jit.fake_tensor(dt, k_shape(d), divisibility=div)
    v = jit.fake_tensor(dt, k_shape(dv), divisibility=div)
    do = jit.fake_tensor(dt, q_shape(dv), divisibility=div)
    dk_shape = k_shape
    if split_heads:
        hdk = jit.sym()
        dk_shape = (lambda x: (tk, hdk, x)) if varlen else (lambda x: (b, nk, hdk, x))
    dk = jit.fake_tensor(dt, dk_shape(d), divisibility=div)
    dvv = jit.fake_tensor(dt, dk_shape(dv), divisibility=div)
    lse2, dsum, dq_acc, sem = scratch_fakes(varlen, h, b, deterministic)
    scalars = scalar_args()
    return (q, k, v, do, lse2, dsum, dq_acc, dk, dvv, cu_q, cu_k, sem, *scalars, *aux_args(mods),
            *aux_grad_args(mods), blocks_arg(mods), jit.fake_stream())


def bwd_post_fake_args(dtype: str, hdim: int, varlen: bool) -> tuple:
    """Compile arguments of every backward postprocess: (dq_accum, dq, cu_q, softmax_scale,
    max_seqlen_q, stream)."""
    dt = jit.DTYPES[dtype]
    div = jit.vec_div(dt)
    h = jit.sym()
    if varlen:
        tq, b1 = jit.sym(), jit.sym()
        dq = jit.fake_tensor(dt, (tq, h, hdim), divisibility=div)
        cu_q = jit.fake_tensor(cutlass.Int32, (b1,), leading_dim=0)
        b = None
    else:
        b, nq = jit.sym(), jit.sym()
        dq = jit.fake_tensor(dt, (b, nq, h, hdim), divisibility=div)
        cu_q = None
    _, _, dq_acc, _ = scratch_fakes(varlen, h, b, False)
    return (dq_acc, dq, cu_q, cutlass.Float32(1.0), cutlass.Int32(0), jit.fake_stream())
