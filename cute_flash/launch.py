"""Launchers: validated CUDA tensors in, kernels launched on torch's current stream, outputs written
in place. One launcher per direction whatever the family (``dispatch`` picks it): every forward
kernel shares one call signature, every backward its pre / main / post signatures
(``signatures.py``). The FP8 forward and its quantize kernels go through here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import torch

from cute_flash import dispatch, formats, jit, reference_fp8, validate
from cute_flash.block_mask import BlockMask
from cute_flash.formats import E4M3_MAX, FP8
from cute_flash.memo import HostMemo
from cute_flash.problem import Problem

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------
# Problem extents and devices
# ---------------------------------------------------------------------------------------------
def max_seqlen(cu: Tensor, given: int | None) -> int:
    """The longest sequence of packed inputs: ``given``, or read from cu_seqlens (a host sync)."""
    if given is not None:
        return int(given)
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


def normalize_window(causal: bool, window_size: tuple[int, int]) -> tuple[bool, bool, int, int]:
    """(causal, local, left, right) as the kernels want them: -1 means unbounded on that side;
    a causal mask is the window (left, 0); a window unbounded on both sides is no window."""
    left, right = (int(window_size[0]), int(window_size[1]))
    if causal:
        right = 0
    left = -1 if left < 0 else left
    right = -1 if right < 0 else right
    local = (left >= 0 or right >= 0) and not (causal and left < 0)
    if local:
        causal = False
    return causal, local, left, right


def problem_extents(q: Tensor, k: Tensor, cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None,
                    max_seqlen_q: int | None, max_seqlen_k: int | None) -> tuple[int, int, int, int]:
    """(batches, query rows of the tensors, longest query sequence, longest key sequence)."""
    if cu_seqlens_q is not None:
        return (cu_seqlens_q.shape[0] - 1, q.shape[0], max_seqlen(cu_seqlens_q, max_seqlen_q),
                max_seqlen(cu_seqlens_k, max_seqlen_k))
    return q.shape[0], q.shape[1], q.shape[1], k.shape[1]


_SM_COUNT: dict[int, int] = {}
_PLACEHOLDER: dict[torch.device, Tensor] = {}


def sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


@functools.cache
def _smem_optin(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def dense_bnhd(t: Tensor) -> bool:
    _, n, h, d = t.shape
    return tuple(t.stride()) == (n * h * d, h * d, d, 1)


def tile_counter(cfg: jit.KernelConfig, device: torch.device) -> Tensor:
    """The sm90 forward's tile counter: zeroed for this launch when tiles are claimed dynamically
    (one int32 memset), else a placeholder never read."""
    if cfg.dynamic_tiles and cfg.num_ctas > 0 and not cfg.varlen:
        return torch.zeros(1, dtype=torch.int32, device=device)
    if device not in _PLACEHOLDER:
        _PLACEHOLDER[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _PLACEHOLDER[device]


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------
# Config and compiled kernel by everything they depend on: building a config (a frozen dataclass
# with its checks) costs ~25-35 us of host time, once per training step per attention call otherwise.
_FWD_KERNELS = HostMemo(512)


def _fwd_kernel(q: Tensor, v: Tensor, family: str, causal: bool, local: bool, softcap: float,
                varlen: bool, sinks: bool = False, mods: object = None) -> tuple[jit.KernelConfig, object]:
    key = (family, q.dtype, tuple(q.shape), q.stride(), tuple(v.shape), v.stride(), q.device,
           causal, local, softcap > 0.0, varlen, sinks, mods)
    hit = _FWD_KERNELS.get(key)
    if hit is None:
        # (CPU tensors faking a launch in tests: planned without extents.)
        dense_cuda = not varlen and q.device.type == "cuda"
        p = dispatch.fwd_problem(formats.dtype_name(q.dtype), q.shape[-1], v.shape[-1], causal=causal,
                                 local=local, softcap=softcap > 0.0, varlen=varlen,
                                 seqlen_q=q.shape[1] if dense_cuda else None,
                                 seqlen_k=v.shape[1] if dense_cuda else None,
                                 heads_q=q.shape[-2], heads_kv=v.shape[-2],
                                 num_sms=sm_count(q.device) if dense_cuda else 132,
                                 q_dense=dense_cuda and dense_bnhd(q), sinks=sinks, mods=mods)
        cfg = dispatch.fwd_config(p, family)
        hit = (cfg, jit.compile_kernel(cfg))
        _FWD_KERNELS.put(key, hit)
    return hit


def _num_seqs(q: Tensor, cu_seqlens_q: Tensor | None) -> int:
    return q.shape[0] if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1


def check_block_mask(blocks: BlockMask, q: Tensor, k: Tensor, cu_seqlens_q: Tensor | None,
                     max_seqlen_q: int | None, max_seqlen_k: int | None) -> None:
    """A block mask must cover the call: its lengths at least the call's (per sequence with
    cu_seqlens), its batch and head counts 1 (broadcast) or the call's, on q's device."""
    varlen = cu_seqlens_q is not None
    nq = max_seqlen_q if varlen else q.shape[1]
    nk = max_seqlen_k if varlen else k.shape[1]
    b, h = _num_seqs(q, cu_seqlens_q), q.shape[-2]
    mb, mh = blocks.shape[:2]
    if blocks.seqlen_q < nq or blocks.seqlen_k < nk:
        raise ValueError(f"block_mask: made for {blocks.seqlen_q} x {blocks.seqlen_k} positions, the call "
                         f"has {nq} x {nk}")
    if mb not in (1, b) or mh not in (1, h):
        raise ValueError(f"block_mask: batch / heads {mb} / {mh} must be 1 or the call's {b} / {h}")
    if blocks.any_visible.device != q.device:
        raise ValueError(f"block_mask is on {blocks.any_visible.device}, q on {q.device}")


def alloc_fwd(q: Tensor, v: Tensor, varlen: bool) -> tuple[Tensor, Tensor]:
    """The forward's (out, lse), shaped and typed as the kernels write them."""
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    lse = torch.empty(validate.expected_lse_shape(q, varlen), dtype=torch.float32, device=q.device)
    return out, lse


def fill_empty_fwd(out: Tensor, lse: Tensor, sinks: Tensor | None, varlen: bool) -> None:
    """The outputs of a problem with no queries or no keys: O = 0, LSE = -inf, or with sinks the
    sink (a row that sees no key still has it)."""
    out.zero_()
    if sinks is None:
        lse.fill_(float("-inf"))
    else:
        lse.copy_((sinks.view(-1, 1) if varlen else sinks.view(1, -1, 1)).expand(lse.shape))


def run_fwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, softmax_scale: float,
            causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
            cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
            max_seqlen_q: int | None = None, family: str | None = None, sinks: Tensor | None = None,
            mods: object = None, aux: tuple[Tensor, ...] = (), blocks: BlockMask | None = None) -> None:
    """Launch the forward on validated CUDA tensors; writes ``out`` and ``lse`` in place. ``sinks``:
    (H,) fp32 sink logits (validated), or None; ``mods``: a score_mod / mask_mod (``device/mods.py``:
    Mods, whose ``aux`` types ``aux`` has); ``blocks``: the mask_mod's block mask (``block_mask.py``;
    ``mods.block_sparse``), checked against the call by ``check_block_mask``.

    q (B, Nq, H, d) | (Tq, H, d); k, v (B, Nk, Hkv, d/dv) | (Tk, Hkv, d/dv); out like q with dv;
    lse (B, H, Nq) | (H, Tq) float32. ``family``: ``sm80`` / ``sm90``, None = ``dispatch.fwd_family``.
    """
    if family is None:
        family = dispatch.fwd_family(jit.device_arch(q.device), q.shape[-1], v.shape[-1])
    if family == "sm90":
        # Broadcast inputs (stride 0 on a dim of extent > 1, e.g. K/V expanded over heads) are not
        # a layout the TMA descriptors were checked with: materialise them rather than risk it.
        q, k, v = (t.contiguous() if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True))
                   else t for t in (q, k, v))
    causal, local, left, right = normalize_window(causal, window_size)
    varlen = cu_seqlens_q is not None
    cfg, fn = _fwd_kernel(q, v, family, causal, local, softcap, varlen, sinks is not None, mods)
    mq = max_seqlen(cu_seqlens_q, max_seqlen_q) if varlen else q.shape[1]
    extra = (tile_counter(cfg, q.device),) if family == "sm90" else ()
    if sinks is not None:
        sinks = sinks.contiguous()
    ranges = None
    if blocks is not None:
        tm, tn = (cfg.tile_m, cfg.tile_n) if family == "sm90" else cfg.tiles[:2]
        ranges = blocks.kernel_ranges(tm, tn, batch=_num_seqs(q, cu_seqlens_q), heads=q.shape[-2])
    fn(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, float(softmax_scale),
       float(softcap) if softcap > 0 else 0.0, left, right, mq, *extra, sinks, *aux,
       *([None] * (jit.MAX_AUX - len(aux))), ranges)


def profiler_name(name: str):
    """The op's name on a profiler trace around a direct call (a no-op context unless a profiler
    runs)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


def eager_autograd() -> bool:
    """Eager autograd records a call (no torch.compile trace, no torch.func transform: both take
    an op's own ``register_autograd``)."""
    return not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is None


def eager_direct(q: torch.Tensor) -> bool:
    """An eager call on plain CUDA tensors with no dispatch mode or torch.func transform active:
    an op's CUDA implementation runs without the dispatcher round trip (~30 us of host time, all of
    it on a short call's critical path). torch.compile, fake or subclassed tensors, dispatch modes
    (flop counters, selective checkpointing), vmap / functionalize and CPU tensors see the op."""
    return (not torch.compiler.is_compiling() and type(q) is torch.Tensor and q.is_cuda
            and torch._C._len_torch_dispatch_stack() == 0
            and torch._C._functorch.peek_interpreter_stack() is None)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=512)
def _bwd_kernels(p: Problem, family: str, overrides: tuple) -> tuple:
    """The main config, the compiled (pre, main, post) kernels and the head split of one backward
    problem, cached: a backward at N = 2k runs in ~0.5 ms, and building the configs and their
    launch rules on every call (~0.1-0.2 ms of Python) can leave the GPU waiting for the host."""
    pre, main, post = dispatch.bwd_configs(p, family, overrides)
    split = dispatch.bwd_head_split(p, family, overrides) if getattr(main, "split_heads", False) else 1
    return (main, *(jit.compile_kernel(c) for c in (pre, main, post)), split)


def _partial_grads(dk: Tensor, dv: Tensor, split: int) -> tuple[Tensor, Tensor]:
    """dK / dV partial sums of a split query-head group: ``split`` heads per K/V head, adjacent."""
    lead, hkv = dk.shape[:-2], dk.shape[-2]
    return (torch.empty(*lead, hkv * split, dk.shape[-1], dtype=dk.dtype, device=dk.device),
            torch.empty(*lead, hkv * split, dv.shape[-1], dtype=dv.dtype, device=dv.device))


def _sum_partials(parts: tuple[Tensor, ...], grads: tuple[Tensor, ...], split: int) -> None:
    """dK / dV from their partials (in the gradients' dtype), summed in fp32 in a fixed order
    (deterministic mode holds)."""
    for part, grad in zip(parts, grads, strict=True):
        torch.sum(part.unflatten(-2, (grad.shape[-2], split)), dim=-2, out=grad)


def mod_args(aux: tuple[Tensor, ...], aux_grads: tuple[Tensor | None, ...] = ()) -> list:
    """The main backward's ``MAX_AUX`` aux and ``MAX_AUX`` aux-gradient arguments: each gradient at
    its aux tensor's position, None where none was asked for and past the last (as the kernel was
    compiled: ``signatures.aux_args`` / ``aux_grad_args``)."""
    pad = jit.MAX_AUX
    return [*aux, *([None] * (pad - len(aux))), *aux_grads, *([None] * (pad - len(aux_grads)))]


def alloc_scratch(q: Tensor, tile_m: int, hdim: int, deterministic: bool, num_batch: int, rows: int,
                  varlen: bool) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """fp32 LSE*log2e, D, dQ accumulator and (deterministic) int32 semaphores, per padded row
    (``device/scratch.py``). Contents are written by the preprocess: no memset."""
    tm, h, d = tile_m, q.shape[-2], hdim
    dev = q.device
    if varlen:
        npad = packed_padded_total(rows, num_batch, tm)
        lead = (h,)
    else:
        npad = (rows + tm - 1) // tm * tm
        lead = (num_batch, h)
    lse2 = torch.empty(*lead, npad, dtype=torch.float32, device=dev)
    dsum = torch.empty(*lead, npad, dtype=torch.float32, device=dev)
    dq_acc = torch.empty(*lead, npad * d, dtype=torch.float32, device=dev)
    sem = torch.empty(*lead, npad // tm, dtype=torch.int32, device=dev) if deterministic else None
    return lse2, dsum, dq_acc, sem


def run_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dq: Tensor, dk: Tensor,
            dv: Tensor, *, softmax_scale: float, causal: bool, window_size: tuple[int, int] = (-1, -1),
            softcap: float = 0.0, deterministic: bool = False, cu_seqlens_q: Tensor | None = None,
            cu_seqlens_k: Tensor | None = None, max_seqlen_q: int | None = None,
            max_seqlen_k: int | None = None, dlse: Tensor | None = None, family: str | None = None,
            overrides: dict | None = None, mods: object = None, aux: tuple[Tensor, ...] = (),
            aux_grads: tuple[Tensor | None, ...] = (), blocks: BlockMask | None = None,
            sinks: Tensor | None = None) -> Tensor | None:
    """Launch the backward (pre, main, post) on validated CUDA tensors; writes ``dq``, ``dk``, ``dv``.

    q/dq/out/dout (B, Nq, H, d) | (Tq, H, d); k/v/dk/dv (B, Nk, Hkv, d) | (Tk, Hkv, d); lse float32
    (B, H, Nq) | (H, Tq), natural log, -inf on rows that saw no key; ``dlse``: the LSE output's
    gradient (float32, lse's shape, contiguous), or None. ``family``: None = ``dispatch.bwd_family``;
    ``overrides``: sm90 main config fields (tuning scripts). ``mods``: a score_mod / mask_mod with
    its derivative (``device/mods.py``: Mods) over ``aux``; ``aux_grads``: per aux tensor a zeroed
    fp64 gradient of its shape where ``mods.aux_grads`` asks for one (added into), else None;
    ``blocks``: the mask_mod's block mask (as ``run_fwd``'s). ``sinks``: the forward's sink logits;
    their gradient is returned (from the preprocess's D: ``sink_grad_from_d``), else None.
    """
    if v.shape[-1] > q.shape[-1]:
        # dK/dV MMA tiles are sized by the qk head dim; a wider V does not fit them.
        raise ValueError(f"the backward needs v's head dim <= q's head dim, got v {v.shape[-1]} > "
                         f"q {q.shape[-1]} (the forward supports it)")
    causal, local, left, right = normalize_window(causal, window_size)
    varlen = cu_seqlens_q is not None
    num_batch, rows_q, mq, mk = problem_extents(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if num_batch == 0 or q.shape[-2] == 0 or mq == 0 or mk == 0:
        # Nothing to attend: every gradient is zero (and a zero-sized grid cannot launch).
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return None if sinks is None else sink_grad(sinks, out, lse, dout, dlse, varlen)
    if family is None:
        family = dispatch.bwd_family(jit.device_arch(q.device), q.shape[-1], v.shape[-1], softcap > 0.0,
                                     mods is not None)
    target = jit.resolve_arch(q.device) if family != "sm90" else None
    p = dispatch.bwd_problem(family, target, formats.dtype_name(q.dtype), q.shape[-1], v.shape[-1],
                             causal=causal, local=local, softcap=softcap > 0.0, varlen=varlen,
                             deterministic=deterministic, dlse=dlse is not None, seqlen_q=mq, seqlen_k=mk,
                             heads_q=q.shape[-2], heads_kv=k.shape[-2], batch=num_batch,
                             num_sms=sm_count(q.device) if family == "sm90" else 132, mods=mods)
    cfg, pre, main, post, split = _bwd_kernels(p, family, tuple(sorted((overrides or {}).items())))
    if family == "sm80":
        need = cfg.tiles.smem_bytes(cfg.hdim, cfg.hdim_v)
        index = q.device.index if q.device.index is not None else torch.cuda.current_device()
        if need > _smem_optin(index):
            raise NotImplementedError(f"sm80 backward tiles for hdim {cfg.hdim}/{cfg.hdim_v} need {need} B "
                                      "of shared memory per block, more than this GPU offers")
    tile_m = cfg.tiles.tile_m if family == "sm80" else cfg.tile_m
    lse2, dsum, dq_acc, sem = alloc_scratch(q, tile_m, cfg.hdim, deterministic, num_batch, rows_q, varlen)
    scale = float(softmax_scale)
    ranges = None
    if blocks is not None:
        tm, tn = (cfg.tile_m, cfg.tile_n) if family == "sm90" else (cfg.tiles.tile_m, cfg.tiles.tile_n)
        group = q.shape[-2] // k.shape[-2]
        ranges = blocks.kernel_ranges(tm, tn, backward=True, group=group, batch=num_batch, heads=k.shape[-2])
    # (Nothing host-side between the preprocess and the main kernel: the sm90 main kernel launches
    # while the preprocess still runs.)
    pre(out, dout, lse, dlse, lse2, dsum, dq_acc, sem, None, None, cu_seqlens_q, mq)
    dk_main, dv_main = _partial_grads(dk, dv, split) if split > 1 else (dk, dv)
    main(q, k, v, dout, lse2, dsum, dq_acc, dk_main, dv_main, cu_seqlens_q, cu_seqlens_k, sem, scale,
         float(softcap) if softcap > 0 else 0.0, left, right, mk, *mod_args(aux, aux_grads), ranges)
    post(dq_acc, dq, cu_seqlens_q, scale, mq)
    # (D is read, not written, by the main kernel: still the preprocess's.)
    dsinks = None if sinks is None else sink_grad_from_d(sinks, lse, dsum, cu_seqlens_q, tile_m)
    if split > 1:
        _sum_partials((dk_main, dv_main), (dk, dv), split)
    return dsinks


def sink_grad(sinks: Tensor, out: Tensor, lse: Tensor, dout: Tensor | None, dlse: Tensor | None,
               varlen: bool) -> Tensor:
    """d loss / d sink_h = sum over rows of p_sink (dlse - rowsum(dO * O)), p_sink = exp(sink - LSE):
    the sink's score gets dS = P (dP - D) with dP = 0 (it carries no value), plus the LSE's own
    gradient. (dq / dk / dv need nothing new: the LSE already includes the sink.)"""
    lse = lse.float()
    p_sink = torch.exp((sinks.view(-1, 1) if varlen else sinks.view(1, -1, 1)) - lse)
    g = torch.zeros_like(lse)
    if dout is not None:
        d = (dout.float() * out.float()).sum(-1)  # (B, Nq, H) | (Tq, H)
        g = g - (d.t() if varlen else d.transpose(1, 2))
    if dlse is not None:
        g = g + dlse.float()
    dims = (1,) if varlen else (0, 2)
    return (p_sink * g).sum(dims)


def sink_grad_from_d(sinks: Tensor, lse: Tensor, dsum: Tensor, cu_seqlens_q: Tensor | None,
                     tile_m: int) -> Tensor:
    """``sink_grad`` from the backward preprocess's D = rowsum(dO O) - dLSE (fp32, per padded row
    of its scratch, ``alloc_scratch``): -sum over rows of exp(sink - LSE) D, with no pass over dO
    and O of its own. Packed rows: sequence b starts at padded row (cu_q[b] + b tile_m) // tile_m
    * tile_m."""
    if cu_seqlens_q is None:
        d = dsum[..., :lse.shape[-1]]
        return -(torch.exp(sinks.float().view(1, -1, 1) - lse) * d).sum((0, 2))
    total = lse.shape[-1]
    rows = torch.arange(total, device=lse.device)
    cu = cu_seqlens_q.long()
    seq = (torch.searchsorted(cu, rows, right=True) - 1).clamp(max=cu.shape[0] - 2)
    start = (cu[seq] + seq * tile_m) // tile_m * tile_m
    valid = rows < cu[-1]  # (rows past the last sequence: no LSE, no D)
    idx = torch.where(valid, start + rows - cu[seq], 0)
    p = torch.exp(sinks.float().view(-1, 1) - lse)
    return -torch.where(valid, p * dsum[:, idx], 0.0).sum(1)


# ---------------------------------------------------------------------------------------------
# FP8 forward
# ---------------------------------------------------------------------------------------------
# "exact": P by the MUFU's exponential and an e4m3 conversion (round to nearest) wherever the
# default takes its codes from the FFMA (``exp_bytes``: ~15% faster at d = 128, P's rounding up to
# one code off). Read at every call.
FP8_P_ENV = "CUTE_FLASH_FP8_P"


def run_fwd_fp8(q8: Tensor, k8: Tensor, v8: Tensor, q_descale: Tensor, k_descale: Tensor, v_descale: Tensor,
                out: Tensor, lse: Tensor, *, softmax_scale: float, causal: bool = False,
                window_size: tuple[int, int] = (-1, -1), v_perm: bool = False,
                cu_seqlens_q: Tensor | None = None, cu_seqlens_k: Tensor | None = None,
                max_seqlen_q: int | None = None, cu_seqlens_v: Tensor | None = None, **overrides) -> None:
    """Launch the FP8 forward on validated CUDA tensors. Dense: e4m3 ``q8`` / ``k8`` (B, N, H, d)
    and ``v8`` as ``quantize_qkv`` returns it -- (B, N_k, H_kv, d) over token-contiguous storage,
    or with ``v_perm`` the (B, H_kv, d, N_pad) storage in the kernel's token order; ``out``
    (B, N, H, d) bf16 / fp16, ``lse`` (B, H, N) fp32, descales (B, H_kv). Varlen (``cu_seqlens_q``
    / ``_k`` int32 (S + 1,)): q8 (T_q, H, d), k8 (T_k, H_kv, d), v8 and ``cu_seqlens_v`` as
    ``formats.v_varlen_aligned`` makes them (each sequence's V starting at a multiple of 16 tokens),
    out (T_q, H, d), lse (H, T_q), descales (S, H_kv). ``overrides``: config fields (tuning)."""
    varlen = cu_seqlens_q is not None
    v8 = validate.check_fp8_kernel_v(q8, k8, v8, v_perm=v_perm, varlen=varlen, cu_seqlens_k=cu_seqlens_k,
                                     cu_seqlens_v=cu_seqlens_v)
    causal, local, left, right = normalize_window(causal, window_size)
    on_gpu = q8.device.type == "cuda"
    p = dispatch.fp8_problem(formats.dtype_name(out.dtype), q8.shape[-1], v8.shape[-1], causal=causal,
                             local=local, varlen=varlen, seqlen_q=q8.shape[-3] if on_gpu else None,
                             seqlen_k=k8.shape[-3] if on_gpu else None, heads_q=q8.shape[-2],
                             heads_kv=k8.shape[-2], num_sms=sm_count(q8.device) if on_gpu else 132,
                             q_dense=varlen or dense_bnhd(q8))
    if os.environ.get(FP8_P_ENV, "").strip().lower() == "exact":
        overrides = {"exp_bytes": False, **overrides}
    cfg = dispatch.fp8_fwd_config(p, v_perm=v_perm, overrides=tuple(sorted(overrides.items())))
    fn = jit.compile_kernel(cfg)
    mq = max_seqlen(cu_seqlens_q, max_seqlen_q) if varlen else q8.shape[1]
    fn(q8, k8, v8, out, lse, cu_seqlens_q, cu_seqlens_k, float(softmax_scale), 0.0, left, right, mq,
       tile_counter(cfg, q8.device), q_descale, k_descale, v_descale, cu_seqlens_v if varlen else None)


def run_bwd_fp8(dout: Tensor, q8: Tensor, k8: Tensor, v: Tensor, q_descale: Tensor, k_descale: Tensor,
                v_descale: Tensor, out: Tensor, lse: Tensor, *, softmax_scale: float, causal: bool,
                deterministic: bool = False, dlse: Tensor | None = None, cu_seqlens_q: Tensor | None = None,
                cu_seqlens_k: Tensor | None = None, max_seqlen_q: int | None = None,
                max_seqlen_k: int | None = None, rotation_seed: int | None = None,
                **overrides) -> tuple[Tensor, Tensor, Tensor]:
    """The FP8 backward on what the FP8 forward saved (e4m3 ``q8`` / ``k8`` (B, N, H, d), the
    16-bit ``v`` (B, N, H_kv, d) it quantized, the (B, H_kv) descales, ``out`` and ``lse``), with
    ``dout`` in O's dtype: returns (dq, dk, dv) in that dtype, in the units of q8 / k8, or with
    ``rotation_seed`` (q8 / k8 rotated with it) in the input's (``unrotate``). V goes to e4m3 again
    at its descale, in natural layout.
    dO is quantized per (token, head) row; Q, K and dO also go token-contiguous for the GEMMs that
    contract over tokens (fp8 wgmma reads K-major operands only). Packed sequences: (T, H, d)
    tensors, ``lse`` (H, T_q), (S, H_kv) descales and ``cu_seqlens_q`` / ``_k`` (checked: their
    last entries T_q / T_k, since the rows past the last sequence are not written)."""
    varlen = cu_seqlens_q is not None
    h, d, hkv = q8.shape[-2], q8.shape[-1], k8.shape[-2]
    num_batch, rows_q, mq, mk = problem_extents(q8, k8, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                max_seqlen_k)
    dq = torch.empty(q8.shape, dtype=out.dtype, device=q8.device)
    dk, dv = (torch.empty(k8.shape, dtype=out.dtype, device=q8.device) for _ in range(2))
    if num_batch == 0 or mq == 0 or mk == 0 or h == 0 or rows_q == 0 or k8.shape[-3] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    p = dispatch.fp8_problem(formats.dtype_name(out.dtype), d, d, causal=causal, local=False, varlen=varlen,
                             seqlen_q=mq, seqlen_k=mk, heads_q=h, heads_kv=hkv, num_sms=sm_count(q8.device),
                             q_dense=True)
    p = dataclasses.replace(p, deterministic=deterministic, dlse=dlse is not None, batch=num_batch)
    cfg, pre, main, post, split = _fp8_bwd_kernels(p, tuple(sorted(overrides.items())))
    v8 = quantize_like(v, v_descale, cu_seqlens_k, mk)
    # (Autograd may hand in broadcast views, e.g. dlse of lse.sum(): all strides 0.)
    dout = _dense(dout)
    dlse = None if dlse is None else _dense(dlse.float())
    lse2, dsum, dq_acc, sem = alloc_scratch(q8, cfg.tile_m, d, deterministic, num_batch, rows_q, varlen)
    # The preprocess writes dO in e4m3, one scale per (token, head) row, its descales beside D.
    do8, rows_descale = torch.empty(dout.shape, dtype=FP8, device=dout.device), torch.empty_like(dsum)
    pre(out, dout, lse, dlse, lse2, dsum, dq_acc, sem, do8, rows_descale, cu_seqlens_q, mq)
    if varlen:
        starts = padded_starts(cu_seqlens_q, cfg.tile_m)
        # Q^T and dO^T each sequence from its first padded scratch row, in the kernel's query order
        # (whole 16-token chunks: the P~ / dS A fragments need no lane exchange); K^T each sequence
        # from a key-tile start (TMA boxes start on 16 bytes), natural order.
        q8t, do8t = (token_contiguous_copy_varlen(t, cu_seqlens_q, mq, starts, dsum.shape[-1])
                     for t in (q8, do8))
        tn = cfg.tile_n
        k8t = token_contiguous_copy_varlen(k8, cu_seqlens_k, mk, padded_starts(cu_seqlens_k, tn),
                                           packed_padded_total(k8.shape[0], num_batch, tn), perm=False)
    else:
        # Q^T and dO^T in the kernel's query order (the P~ / dS A fragments need no lane exchange).
        q8t, do8t = (token_contiguous_copy(t, True) for t in (q8, do8))
        k8t = token_contiguous_copy(k8, False)
    scale = float(softmax_scale)
    dk_main, dv_main = _partial_grads(dk, dv, split) if split > 1 else (dk, dv)
    main(q8.contiguous(), k8.contiguous(), v8, do8, q8t, k8t, do8t, lse2, dsum, rows_descale, dq_acc, dk_main,
         dv_main, cu_seqlens_q, cu_seqlens_k, sem, q_descale, k_descale, v_descale, scale, -1, -1, mk)
    post(dq_acc, dq, cu_seqlens_q, scale, mq)
    if split > 1:
        _sum_partials((dv_main,), (dv,), split)
        if rotation_seed is None:
            _sum_partials((dk_main,), (dk,), split)
    if rotation_seed is not None:
        # (Split groups: dK's partials summed by the unrotation GEMM itself, in fp32.)
        dq, dk = unrotate(dq, rotation_seed), unrotate(dk_main, rotation_seed, split)
    return dq, dk, dv


def packed_padded_total(rows: int, num_batch: int, tile: int) -> int:
    """Rows of a packed buffer whose sequence b starts at (cu[b] + b tile) // tile * tile: the last
    one ends before (total + B tile) // tile * tile; one spare tile keeps the bound obvious."""
    return (rows // tile + num_batch + 1) * tile


def padded_starts(cu_seqlens: Tensor, tile_m: int) -> Tensor:
    """int32 (S + 1,): sequence s's first padded scratch row (``device.scratch.padded_offset_q``:
    (cu[s] + s tile_m) // tile_m * tile_m), the last entry one past the pack's."""
    cu = cu_seqlens.long()
    seq = torch.arange(cu.shape[0], device=cu.device)
    return ((cu + seq * tile_m) // tile_m * tile_m).to(torch.int32)


@functools.lru_cache(maxsize=512)
def _fp8_bwd_kernels(p: Problem, overrides: tuple) -> tuple:
    """The main config, the compiled (pre, main, post) kernels and the head split of one FP8
    backward problem, cached as ``_bwd_kernels``: the plan's Python costs more than the host can
    spare per call."""
    configs = dispatch.fp8_bwd_configs(p, overrides)
    split = dispatch.fp8_bwd_head_split(p, overrides) if configs[1].split_heads else 1
    return (configs[1], *(jit.compile_kernel(c) for c in configs), split)


def _dense(t: Tensor) -> Tensor:
    """``t`` if contiguous and 16-byte aligned (the kernels' vector loads), else such a copy."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def quantize_like(x: Tensor, descale: Tensor, cu_seqlens: Tensor | None = None,
                  max_seqlen: int = 0) -> Tensor:
    """x (B, N, H_kv, d) in e4m3 at the forward's (B, H_kv) descales, natural layout (the dP GEMM
    reads V with the head dim contiguous); packed x (T, H_kv, d) with ``cu_seqlens`` at (S, H_kv)
    descales. The quantize kernel on sm90, elsewhere PyTorch."""
    varlen = cu_seqlens is not None
    if x.is_cuda and jit.device_arch(x.device) == "sm_90a":
        x8 = torch.empty_like(x, dtype=FP8, memory_format=torch.contiguous_format)
        quant = dispatch.fp8_bwd_quant_config(formats.dtype_name(x.dtype), x.shape[-1], varlen)
        amax = (descale * E4M3_MAX).contiguous()
        if x.shape[0] and (not varlen or max_seqlen):
            jit.compile_kernel(quant)(x, _signs(x.shape[-1], 0, x.device), amax, x8, cu_seqlens, max_seqlen,
                                      None)
        return x8
    inv = 1.0 / descale.clamp_min(torch.finfo(torch.float32).tiny)
    if varlen:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        inv = inv.repeat_interleave(lengths, dim=0, output_size=x.shape[0])[:, :, None]
    else:
        inv = inv[:, None, :, None]
    codes = torch.mul(x, inv)
    return codes.clamp_(-E4M3_MAX, E4M3_MAX).to(FP8)


_UNIT_AMAX: dict[tuple, Tensor] = {}


def _unit_amax(rows: int, heads: int, device: torch.device) -> Tensor:
    """A (rows, heads) fp32 amax of 448 (the quantize kernel's scale 1, a re-layout): the leading
    rows of one kept tensor per (heads, device, power of two), not a fill on every call (read only;
    never freed, so no stream can still be reading freed memory)."""
    key = (heads, device, max(rows - 1, 0).bit_length())
    if key not in _UNIT_AMAX:
        unit = torch.full((1 << key[2], heads), E4M3_MAX, device=device, dtype=torch.float32)
        if device.type != "cuda":
            return unit[:rows]
        if torch.cuda.is_current_stream_capturing():
            return unit[:rows]  # (a graph's fill runs only on replay: not one to keep)
        torch.cuda.current_stream(device).synchronize()  # (filled before any stream reads it)
        _UNIT_AMAX[key] = unit
    return _UNIT_AMAX[key][:rows]


def token_contiguous_copy(x8: Tensor, perm: bool) -> Tensor:
    """An e4m3 (B, N, H, d) tensor as a (B, N, H, d) view over (B, H, d, N_pad) storage, the tokens
    contiguous (N_pad a multiple of 16: TMA strides; the view's extent N, so boxes past it read
    zeros), or with ``perm`` each 16 tokens in ``formats.V_PERM16`` order and the whole N_pad
    storage (padding zeros) as the view: ``relayout_v``'s kernel."""
    store = _relayout_v(x8, v_perm=perm)
    return (store if perm else store[..., :x8.shape[1]]).permute(0, 3, 1, 2)


def token_contiguous_copy_varlen(x8: Tensor, cu_seqlens: Tensor, max_seqlen: int, starts: Tensor,
                                 total: int, perm: bool = True) -> Tensor:
    """A packed e4m3 (T, H, d) tensor token-contiguous, as a (``total``, H, d) view over (H, d,
    ``total``) storage: sequence s from ``starts[s]`` on (int32, 16-aligned; ``padded_starts``),
    the gaps zeros, with ``perm`` each 16 tokens in ``formats.V_PERM16`` order. ``relayout_v``'s
    kernel on packed input."""
    t, h, d = x8.shape
    store = torch.zeros(h, d, total, device=x8.device, dtype=x8.dtype)
    num_seqs = cu_seqlens.shape[0] - 1
    if num_seqs and max_seqlen and t:
        unit = _unit_amax(num_seqs, h, x8.device)
        cfg = dispatch.relayout_v_config(d, v_perm=perm, varlen=True)
        jit.compile_kernel(cfg)(x8.contiguous(), _signs(d, 0, x8.device), unit, store, cu_seqlens, max_seqlen,
                                starts)
    return store.permute(2, 0, 1)


_UNROTATE: dict[tuple, tuple[Tensor, Tensor]] = {}


def unrotate(x: Tensor, seed: int, split: int = 1) -> Tensor:
    """x M^T for the forward's rotation M = D H / sqrt(d) (``reference_fp8.rotate``): one GEMM in
    x's dtype with fp32 accumulation against the +-1 matrix H D (exact in 16 bit, made once per
    (d, seed, device)), 1 / sqrt(d) applied as the GEMM's alpha: in fp32 before the one rounding
    (a 16-bit 1 / sqrt(d) in the matrix would scale every gradient by its rounding error).
    ``split``: x (..., H * split, d) holds ``split`` adjacent partial sums per head, which the same
    GEMM adds (its K dimension spans them: (rows, split d) @ (split d, d))."""
    d = x.shape[-1]
    key = (d, int(seed), x.device, x.dtype, split)
    if key not in _UNROTATE:
        signed = reference_fp8.hadamard_matrix(d) * formats.hadamard_signs(d, seed).double()
        _UNROTATE[key] = (signed.repeat(split, 1).to(device=x.device, dtype=x.dtype),
                          torch.zeros((), device=x.device, dtype=x.dtype))
    matrix, zero = _UNROTATE[key]
    rows = x.reshape(-1, split * d)
    out = torch.addmm(zero, rows, matrix, beta=0, alpha=d ** -0.5)
    return out.view(*x.shape[:-2], x.shape[-2] // split, d)


# ---------------------------------------------------------------------------------------------
# FP8 quantize (Q, K rotated; V token-contiguous) and V re-layout
# ---------------------------------------------------------------------------------------------
_SIGNS: dict[tuple, Tensor] = {}


def _signs(d: int, seed: int, device: torch.device) -> Tensor:
    """The rotation's +-1 diagonal on the device, made once per (d, seed, device) rather than
    drawn and copied on every call."""
    key = (d, int(seed), device)
    if key not in _SIGNS:
        _SIGNS[key] = formats.hadamard_signs(d, seed).to(device)
    return _SIGNS[key]


def quantize_qkv(q: Tensor, k: Tensor, v: Tensor, rotate: bool = True, seed: int = 0,
                 v_perm: bool = False) -> tuple[Tensor, ...]:
    """(q8, k8, v8, q_descale, k_descale, v_descale), as ``reference_fp8.quantize_qkv_ref``: Q and K
    rotated by D H / sqrt(d) (``rotate``), e4m3 with per-(batch, kv head) scales, v8 of shape
    (B, N, H_kv, d) over sequence-contiguous (B, H_kv, d, N_pad) storage (padding zeroed), or
    with ``v_perm`` that storage itself, tokens in the FP8 kernel's order."""
    validate.check_quantize_inputs(q, k, v, varlen=False)
    b, _, _, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    # Three separate buffers, not one (3, B, H_kv): the descales are returned, and outputs of a
    # custom op must not alias one another.
    amax = [torch.zeros(b, hkv, device=q.device, dtype=torch.float32) for _ in range(3)]
    signs = _signs(d, seed, q.device)
    q8, k8 = torch.empty_like(q, dtype=FP8), torch.empty_like(k, dtype=FP8)
    v_store = torch.empty(b, hkv, d, (nk + 15) // 16 * 16, device=q.device, dtype=FP8)
    cfgs = dispatch.quant_configs(formats.dtype_name(q.dtype), d, rotate, v_perm)
    qk_amax, qk_quant, v_amax, v_quant = (jit.compile_kernel(c) for c in cfgs)
    for i, (x, out) in enumerate(((q, q8), (k, k8))):
        qk_amax(x, signs, amax[i], out, None, 0, None)
    v_amax(v, signs, amax[2], v_store, None, 0, None)
    for i, (x, out) in enumerate(((q, q8), (k, k8))):
        qk_quant(x, signs, amax[i], out, None, 0, None)
    v_quant(v, signs, amax[2], v_store, None, 0, None)
    v8 = v_store if v_perm else v_store[..., :nk].permute(0, 3, 1, 2)
    return q8, k8, v8, *(a.div_(E4M3_MAX) for a in amax)


def quantize_qkv_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                        max_seqlen_q: int, max_seqlen_k: int, rotate: bool = True, seed: int = 0,
                        v_aligned: bool = False) -> tuple[Tensor, ...]:
    """``quantize_qkv`` on packed sequences, as ``reference_fp8.quantize_qkv_varlen_ref``: q (T_q, H,
    d), k, v (T_k, H_kv, d); sequence s is rows cu[s]:cu[s + 1] (cu_seqlens checked by the op).
    Returns q8 (T_q, H, d), k8 (T_k, H_kv, d) contiguous e4m3, v8 a (T_k, H_kv, d) view over
    token-contiguous (H_kv, d, T_k_pad) storage (natural order, padding zeroed), and fp32
    (S, H_kv) descales, one scale per (sequence, kv head). ``v_aligned``: v8 is instead
    ``formats.v_varlen_aligned``'s (T_v, H_kv, d) view, every sequence from a 16-aligned start --
    the varlen FP8 kernel's V, written once instead of re-laid after."""
    num_seqs = validate.check_quantize_inputs(q, k, v, varlen=True, cu_seqlens_q=cu_seqlens_q,
                                              cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                              max_seqlen_k=max_seqlen_k)
    d = q.shape[2]
    tk, hkv = k.shape[0], k.shape[1]
    amax = [torch.zeros(num_seqs, hkv, device=q.device, dtype=torch.float32) for _ in range(3)]
    signs = _signs(d, seed, q.device)
    q8 = torch.empty(q.shape, device=q.device, dtype=FP8)
    k8 = torch.empty(k.shape, device=q.device, dtype=FP8)
    cu_v = None
    if v_aligned:
        cu_v, t_v = formats.varlen_v_offsets(cu_seqlens_k, tk)
        # Zeroed: the slack past the last sequence's chunks (T_v is a bound) is not written.
        v_store = torch.zeros(hkv, d, t_v, device=q.device, dtype=FP8)
    else:
        # Not zeroed: every byte, the padding tokens T_k .. T_k_pad - 1 included, is written by
        # the kernel (the CTA holding the last token writes the padding).
        v_store = torch.empty(hkv, d, (tk + 15) // 16 * 16, device=q.device, dtype=FP8)
    cfgs = dispatch.quant_configs(formats.dtype_name(q.dtype), d, rotate, varlen=True, v_aligned=v_aligned)
    qk_amax, qk_quant, v_amax, v_quant = (jit.compile_kernel(c) for c in cfgs)
    q_args = (q, q8, amax[0], cu_seqlens_q, max_seqlen_q, None)
    k_args = (k, k8, amax[1], cu_seqlens_k, max_seqlen_k, None)
    v_args = (v, v_store, amax[2], cu_seqlens_k, max_seqlen_k, None)
    runs = ((qk_amax, q_args), (qk_amax, k_args), (v_amax, v_args),
            (qk_quant, q_args), (qk_quant, k_args), (v_quant, v_args[:-1] + (cu_v,)))
    for fn, (x, out, a, cu, max_len, cu_out) in runs:
        # A grid with no CTAs is no launch: with no (non-empty) sequence, nothing runs and the
        # descales stay 0.
        if num_seqs and max_len:
            fn(x, signs, a, out, cu, max_len, cu_out)
    v8 = (v_store if v_aligned else v_store[..., :tk]).permute(2, 0, 1)
    return q8, k8, v8, *(a.div_(E4M3_MAX) for a in amax)


def relayout_v(v8: Tensor, v_perm: bool = True) -> Tensor:
    """A caller's e4m3 V (B, N, H_kv, d) -> the (B, H_kv, d, N_pad) token-contiguous storage the
    FP8 P V product reads (``v_perm``: in the kernel's token order; else natural), bit for bit,
    padding zeros: the V quantize kernel with scale 1 (e4m3 -> fp32 -> e4m3 is exact), whose smem
    transpose writes 16 tokens per store (a torch byte permute runs at ~90 GB/s)."""
    validate.check_relayout_v(v8, varlen=False)
    return _relayout_v(v8, v_perm)


def _relayout_v(v8: Tensor, v_perm: bool) -> Tensor:
    """``relayout_v`` on a checked e4m3 tensor."""
    b, nk, hkv, d = v8.shape
    if v8.stride(-1) != 1 or any(st % 16 for st in v8.stride()[:-1]):
        v8 = v8.contiguous()  # 16-byte rows for the kernel's vector loads
    store = torch.empty(b, hkv, d, (nk + 15) // 16 * 16, device=v8.device, dtype=v8.dtype)
    unit = _unit_amax(b, hkv, v8.device)
    cfg = dispatch.relayout_v_config(d, v_perm=v_perm, varlen=False)
    jit.compile_kernel(cfg)(v8, _signs(d, 0, v8.device), unit, store, None, 0, None)
    return store


def relayout_v_varlen(v8: Tensor, cu_seqlens_k: Tensor, max_seqlen_k: int) -> tuple[Tensor, Tensor]:
    """``formats.v_varlen_aligned`` by the V quantize kernel at scale 1 (e4m3 in, 16-byte stores):
    a caller's packed e4m3 V (T, H_kv, d) -> (a (T_v, H_kv, d) view over token-contiguous
    (H_kv, d, T_v) storage with every sequence 16-aligned, cu_seqlens_v). cu_seqlens_k must have
    been checked."""
    validate.check_relayout_v(v8, varlen=True)
    t, hkv, d = v8.shape
    if v8.stride(-1) != 1 or any(st % 16 for st in v8.stride()[:-1]):
        v8 = v8.contiguous()
    cu_v, t_v = formats.varlen_v_offsets(cu_seqlens_k, t)
    # Zeroed: the kernel writes every sequence's chunks whole, but not the slack past the last one
    # (T_v is a bound, no host sync), which the attention kernel's last V box may read.
    store = torch.zeros(hkv, d, t_v, device=v8.device, dtype=v8.dtype)
    num_seqs = cu_seqlens_k.shape[0] - 1
    if num_seqs and max_seqlen_k and t:
        unit = _unit_amax(num_seqs, hkv, v8.device)
        cfg = dispatch.relayout_v_config(d, v_perm=False, varlen=True)
        jit.compile_kernel(cfg)(v8, _signs(d, 0, v8.device), unit, store, cu_seqlens_k, max_seqlen_k, cu_v)
    return store.permute(2, 0, 1), cu_v
