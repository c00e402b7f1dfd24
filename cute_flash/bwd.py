"""Backward pass: variant configs of the three sm80 backward kernels and the torch-side launcher.

    preprocess   D = rowsum(dO * O), LSE*log2(e), zero the fp32 dQ accumulator (+ semaphores)
    main         one CTA per (K/V block, kv head, batch): dK, dV in registers, dQ += dS K
                 reduced into the fp32 accumulator in global memory
    postprocess  dQ = softmax_scale * dQaccum, converted to fp16/bf16

The three kernels share the query tile (``tile_m``) and the dQ MMA layout (the accumulator is
stored in that MMA's fragment order), so the pre/post configs are derived from the main one.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import cutlass
import torch

from cute_flash import jit
from cute_flash.fwd import SUPPORTED_HDIMS, max_seqlen, normalize_window


@dataclass(frozen=True)
class BwdTiles:
    """Tiling of the sm80 main backward kernel.

    ``stages``: smem buffers of Q (+LSE2) and dO (+D); 2 lets the next query block's loads
    overlap all of this block's math, 1 (large head dims, for smem) overlaps them with part of it.
    ``atom_sdp``: warps along the query rows of S/dP (the rest go along keys); ``atom_dkv``: warps
    along the key rows of dK/dV; ``atom_dq``: warps along the query rows of dQ. ``dq_splits``:
    the dQ GEMM runs over hdim / dq_splits columns at a time (fewer live fp32 registers).
    """

    tile_m: int
    tile_n: int
    num_threads: int
    stages: int
    atom_sdp: int
    atom_dkv: int
    atom_dq: int
    dq_splits: int = 1

    def smem_bytes(self, hdim: int, hdim_v: int) -> int:
        el = 2  # fp16/bf16
        tiles = (self.tile_n * (hdim + hdim_v) + self.stages * self.tile_m * (hdim + hdim_v)
                 + 2 * self.tile_m * self.tile_n)
        return el * tiles + 2 * 4 * self.tile_m * self.stages


# sm80 (A100: 163 KB of smem per CTA) tiles per max(hdim, hdim_v), 8 warps each. The register
# file is the binding constraint: dK and dV live in fp32 registers for the whole CTA
# (2 * tile_n * hdim / 256 per thread) next to S, dP (tile_m * tile_n / 256 each), so every row was
# compiled for all mask/softcap/varlen/deterministic variants and kept only if it does not spill
# even with 16 extra registers held live across the main loop (tests/test_compile_sm80_bwd.py
# checks the real kernels spill-free). tile_n = 96 at hdim 128: 128 spills, 64 wastes K/V reuse.
# hdim 256 runs the dQ GEMM in two column halves (its fp32 accumulator is 64 registers).
SM80_BWD_TILES: dict[int, BwdTiles] = {
    32: BwdTiles(64, 128, 256, 2, 2, 4, 4),
    64: BwdTiles(64, 128, 256, 2, 2, 4, 4),
    96: BwdTiles(64, 128, 256, 2, 4, 4, 4),
    128: BwdTiles(64, 96, 256, 2, 4, 2, 2),
    160: BwdTiles(64, 64, 256, 2, 4, 4, 4),
    192: BwdTiles(64, 64, 256, 2, 4, 2, 2),
    256: BwdTiles(64, 64, 256, 1, 4, 2, 2, dq_splits=2),
}

# Softcap keeps 1 - tanh^2 of every score in registers from S to dS (tile_m * tile_n / 256 more
# fp32 registers per thread): where that leaves too little headroom, a narrower K/V tile.
SM80_BWD_TILES_SOFTCAP: dict[int, BwdTiles] = {
    96: BwdTiles(64, 64, 256, 2, 4, 4, 4),
}

SM80_SMEM_BYTES = 166912  # cudaDevAttrMaxSharedMemoryPerBlockOptin on A100


def bwd_tiles(hdim: int, hdim_v: int, softcap: bool = False) -> BwdTiles:
    key = max(hdim, hdim_v)
    if softcap and key in SM80_BWD_TILES_SOFTCAP:
        return SM80_BWD_TILES_SOFTCAP[key]
    return SM80_BWD_TILES[key]


def _scratch_fakes(varlen: bool, h, b, with_sem: bool):
    """Fake fp32 scratch tensors (LSE2, D, dQaccum, semaphores); see ``alloc_scratch``."""
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


def bwd_main_fake_args(dtype: str, hdim: int, hdim_v: int, varlen: bool, deterministic: bool) -> tuple:
    """Compile arguments of every main backward kernel (sm80 and sm90 share the call signature):
    (q, k, v, do, lse2, d, dq_accum, dk, dv, cu_q, cu_k, semaphores, softmax_scale, softcap,
    window_left, window_right, max_seqlen_k, stream)."""
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
    dk = jit.fake_tensor(dt, k_shape(d), divisibility=div)
    dvv = jit.fake_tensor(dt, k_shape(dv), divisibility=div)
    lse2, dsum, dq_acc, sem = _scratch_fakes(varlen, h, b, deterministic)
    scalars = (cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(-1), cutlass.Int32(-1),
               cutlass.Int32(0))
    return (q, k, v, do, lse2, dsum, dq_acc, dk, dvv, cu_q, cu_k, sem, *scalars, jit.fake_stream())


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
    _, _, dq_acc, _ = _scratch_fakes(varlen, h, b, False)
    return (dq_acc, dq, cu_q, cutlass.Float32(1.0), cutlass.Int32(0), jit.fake_stream())


def pre_threads_per_row(hdim_v: int) -> int:
    """Preprocess threads sharing one O / dO row: 16-byte loads, 8 threads per 64 columns (4 per
    32); a CTA of ``threads`` covers ``threads // this`` rows per pass, which must tile tile_m."""
    return (64 if hdim_v % 64 == 0 else 32) // 8


@dataclass(frozen=True)
class BwdPreConfig(jit.KernelConfig):
    """D = rowsum(dO*O) (- dLSE), LSE*log2e, zeroed dQ accumulator (+ semaphores when deterministic)."""

    dtype: str = "bf16"
    hdim: int = 128
    hdim_v: int = 128
    tile_m: int = 64
    varlen: bool = False
    deterministic: bool = False
    # The LSE output has a gradient (``dlse``), folded into D (see ampere/bwd_preprocess.py).
    dlse: bool = False
    # sm90 only (griddepcontrol): let a main kernel launched with PDL start its prologue while
    # this one still runs (``BwdSm90Config.pdl``).
    launch_dependents: bool = False
    # Threads per CTA (each loads 16 bytes per copy; rows of threads must tile ``tile_m``).
    threads: int = 128

    kernel_name = "bwd_pre_sm80"

    def build(self):
        from cute_flash.ampere.bwd_preprocess import FlashBwdPreSm80

        return FlashBwdPreSm80(self)

    def fake_args(self) -> tuple:
        dt = jit.DTYPES[self.dtype]
        div = jit.vec_div(dt)
        h = jit.sym()
        if self.varlen:
            tq, b1 = jit.sym(), jit.sym()
            o = jit.fake_tensor(dt, (tq, h, self.hdim_v), divisibility=div)
            do = jit.fake_tensor(dt, (tq, h, self.hdim_v), divisibility=div)
            lse = jit.fake_tensor(cutlass.Float32, (h, tq), divisibility=1)
            cu_q = jit.fake_tensor(cutlass.Int32, (b1,), leading_dim=0)
            b = None
        else:
            b, nq = jit.sym(), jit.sym()
            o = jit.fake_tensor(dt, (b, nq, h, self.hdim_v), divisibility=div)
            do = jit.fake_tensor(dt, (b, nq, h, self.hdim_v), divisibility=div)
            lse = jit.fake_tensor(cutlass.Float32, (b, h, nq), divisibility=1)
            cu_q = None
        dlse = None
        if self.dlse:
            dlse = jit.fake_tensor(cutlass.Float32, (h, tq) if self.varlen else (b, h, nq), divisibility=1)
        lse2, d, dq_acc, sem = _scratch_fakes(self.varlen, h, b, self.deterministic)
        return (o, do, lse, dlse, lse2, d, dq_acc, sem, cu_q, cutlass.Int32(0), jit.fake_stream())


@dataclass(frozen=True)
class BwdConfig(jit.KernelConfig):
    """One sm80 main-backward variant. Sequence lengths, batch, heads and the GQA ratio are run-time
    values; everything here is baked into the compiled code."""

    dtype: str = "bf16"
    hdim: int = 128
    hdim_v: int = 128
    causal: bool = False
    local: bool = False
    softcap: bool = False
    varlen: bool = False
    deterministic: bool = False
    tiles: BwdTiles | None = field(default=None)

    kernel_name = "bwd_sm80"

    def __post_init__(self) -> None:
        if self.tiles is None:
            object.__setattr__(self, "tiles", bwd_tiles(self.hdim, self.hdim_v, self.softcap))

    def build(self):
        from cute_flash.ampere.bwd import FlashBwdSm80

        return FlashBwdSm80(self)

    def pre(self, dlse: bool = False) -> BwdPreConfig:
        return BwdPreConfig(target=self.target, dtype=self.dtype, hdim=self.hdim, hdim_v=self.hdim_v,
                            tile_m=self.tiles.tile_m, varlen=self.varlen, deterministic=self.deterministic,
                            dlse=dlse)

    def post(self) -> BwdPostConfig:
        return BwdPostConfig(target=self.target, dtype=self.dtype, hdim=self.hdim, varlen=self.varlen,
                             tiles=self.tiles)

    def fake_args(self) -> tuple:
        return bwd_main_fake_args(self.dtype, self.hdim, self.hdim_v, self.varlen, self.deterministic)


@dataclass(frozen=True)
class BwdPostConfig(jit.KernelConfig):
    """dQ = scale * dQaccum -> fp16/bf16. Shares ``tiles`` with its main kernel (fragment order)."""

    dtype: str = "bf16"
    hdim: int = 128
    varlen: bool = False
    tiles: BwdTiles | None = field(default=None)

    kernel_name = "bwd_post_sm80"

    def __post_init__(self) -> None:
        if self.tiles is None:
            object.__setattr__(self, "tiles", bwd_tiles(self.hdim, self.hdim))

    def build(self):
        from cute_flash.ampere.bwd_postprocess import FlashBwdPostSm80

        return FlashBwdPostSm80(self)

    def fake_args(self) -> tuple:
        return bwd_post_fake_args(self.dtype, self.hdim, self.varlen)


# ---------------------------------------------------------------------------------------------
# Variant enumeration and the launcher
# ---------------------------------------------------------------------------------------------
def bwd_config(q: torch.Tensor, v: torch.Tensor, *, causal: bool, local: bool, softcap: float, varlen: bool,
               deterministic: bool, target: str | None = None) -> BwdConfig:
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[q.dtype]
    if target is None:
        target = jit.resolve_arch(q.device)
    return BwdConfig(target=target, dtype=dtype, hdim=q.shape[-1], hdim_v=v.shape[-1], causal=causal,
                     local=local, softcap=softcap > 0.0, varlen=varlen, deterministic=deterministic)


def bwd_configs(target: str | None, dtype: str, hdim: int, hdim_v: int, causal: bool, local: bool,
                softcap: bool, varlen: bool, deterministic: bool) -> list[jit.KernelConfig]:
    """The three kernels one backward variant launches: preprocess, main, postprocess."""
    if hdim not in SUPPORTED_HDIMS or hdim_v not in SUPPORTED_HDIMS:
        raise ValueError(f"head dims must be in {SUPPORTED_HDIMS}, got {hdim}/{hdim_v}")
    main = BwdConfig(target=target, dtype=dtype, hdim=hdim, hdim_v=hdim_v, causal=causal, local=local,
                     softcap=softcap, varlen=varlen, deterministic=deterministic)
    return [main.pre(), main, main.post()]


@functools.cache
def _compiled(target: str, dtype: str, hdim: int, hdim_v: int, causal: bool, local: bool, softcap: bool,
              varlen: bool, deterministic: bool, dlse: bool = False):
    """Main config and the compiled (pre, main, post) executors of one variant (``dlse``: the
    preprocess that folds the LSE's gradient into D): after the first call a launch costs one dict
    lookup here instead of three config hashes."""
    configs = bwd_configs(target, dtype, hdim, hdim_v, causal, local, softcap, varlen, deterministic)
    if dlse:
        configs[0] = configs[1].pre(dlse=True)
    return configs[1], tuple(jit.compile_kernel(c) for c in configs)


@functools.cache
def _smem_optin(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def alloc_scratch(q: torch.Tensor, tile_m: int, hdim: int, deterministic: bool, num_batch: int, rows: int,
                  varlen: bool):
    """fp32 LSE*log2e, D, dQ accumulator and (deterministic) int32 semaphores, per padded row
    (see cute_flash/kernels/bwd_math.py). Contents are written by the preprocess: no memset."""
    tm, h, d = tile_m, q.shape[-2], hdim
    dev = q.device
    if varlen:
        # Batch b starts at padded row (cu_q[b] + b*tm) // tm * tm; the last one ends before
        # (total + B*tm) // tm * tm. One spare tile keeps the bound obvious.
        npad = (rows // tm + num_batch + 1) * tm
        lead = (h,)
    else:
        npad = (rows + tm - 1) // tm * tm
        lead = (num_batch, h)
    lse2 = torch.empty(*lead, npad, dtype=torch.float32, device=dev)
    dsum = torch.empty(*lead, npad, dtype=torch.float32, device=dev)
    dq_acc = torch.empty(*lead, npad * d, dtype=torch.float32, device=dev)
    sem = torch.empty(*lead, npad // tm, dtype=torch.int32, device=dev) if deterministic else None
    return lse2, dsum, dq_acc, sem


def problem_extents(q: torch.Tensor, k: torch.Tensor, cu_seqlens_q: torch.Tensor | None,
                    cu_seqlens_k: torch.Tensor | None, max_seqlen_q: int | None,
                    max_seqlen_k: int | None) -> tuple[int, int, int, int]:
    """(batches, query rows of the tensors, longest query sequence, longest key sequence)."""
    if cu_seqlens_q is not None:
        return (cu_seqlens_q.shape[0] - 1, q.shape[0], max_seqlen(cu_seqlens_q, max_seqlen_q),
                max_seqlen(cu_seqlens_k, max_seqlen_k))
    return q.shape[0], q.shape[1], q.shape[1], k.shape[1]


BWD_KERNEL_ENV = "CUTE_FLASH_BWD_KERNEL"


def bwd_family(device: torch.device, hdim: int, hdim_v: int, softcap: float) -> str:
    """``sm80`` or ``sm90``: the backward kernels to launch. ``CUTE_FLASH_BWD_KERNEL`` (read at each
    call): ``auto`` (default) takes the FA3 backward (``cute_flash.hopper.bwd``) on a Hopper GPU
    where it covers the problem and has been GPU-checked (``bwd_sm90.sm90_bwd_covers``: head dims
    64 / 96 / 128 / 192 / 256 with d_v = d, and (192, 128)) and the FA2 backward elsewhere;
    ``sm80`` forces the FA2 backward (any sm80+ GPU, e.g. for comparisons); ``sm90`` forces the FA3
    one (also what is compiled but not yet GPU-checked), raising ``ValueError`` where it does
    not apply."""
    choice = os.environ.get(BWD_KERNEL_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "sm80", "sm90"):
        raise ValueError(f"{BWD_KERNEL_ENV} must be one of auto, sm80, sm90, got {choice!r}")
    if choice == "sm80":
        return "sm80"
    from cute_flash.bwd_sm90 import SM90_BWD_HDIMS, SM90_BWD_SOFTCAP_HDIMS, sm90_bwd_covers

    major, _ = torch.cuda.get_device_capability(device)
    if major == 9 and sm90_bwd_covers(hdim, hdim_v, softcap > 0.0, forced=choice == "sm90"):
        return "sm90"
    if choice == "sm90":
        raise ValueError(f"{BWD_KERNEL_ENV}=sm90: the sm90 backward needs a Hopper GPU, a head dim in "
                         f"{SM90_BWD_HDIMS} with d_v = d, softcap at d in {SM90_BWD_SOFTCAP_HDIMS} only "
                         f"(got sm{major}x, d={hdim}, d_v={hdim_v}, softcap={softcap})")
    return "sm80"


def run_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *, softmax_scale: float,
            causal: bool, window_size: tuple[int, int], softcap: float, deterministic: bool,
            cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
            max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
            dlse: torch.Tensor | None = None) -> None:
    """Launch the backward (sm90 or sm80 family, ``bwd_family``) on validated CUDA tensors; writes
    ``dq``, ``dk``, ``dv`` in place.

    q/dq/out/dout (B, Nq, H, d) | (Tq, H, d); k/v/dk/dv (B, Nk, Hkv, d) | (Tk, Hkv, d); lse float32
    (B, H, Nq) | (H, Tq), natural log, -inf on rows that saw no key; ``dlse``: the LSE output's
    gradient (float32, lse's shape, contiguous), or None.
    """
    if v.shape[-1] > q.shape[-1]:
        # dK/dV MMA tiles are sized by the qk head dim; a wider V does not fit them.
        raise ValueError(f"the sm80 backward needs v's head dim <= q's head dim, got v {v.shape[-1]} > "
                         f"q {q.shape[-1]} (the forward supports it)")
    causal, local, left, right = normalize_window(causal, window_size)
    varlen = cu_seqlens_q is not None
    num_batch, rows_q, mq, mk = problem_extents(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    if num_batch == 0 or q.shape[-2] == 0 or mq == 0 or mk == 0:
        # Nothing to attend: every gradient is zero (and a zero-sized grid cannot launch).
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return
    if bwd_family(q.device, q.shape[-1], v.shape[-1], softcap) == "sm90":
        from cute_flash.bwd_sm90 import run_bwd_sm90

        # The normalised (causal, window) pair: a causal window (left, -1) is (left, 0) by now, and
        # handing back the raw window_size with the normalised causal=False would unbound its right.
        run_bwd_sm90(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=softmax_scale, causal=causal,
                     window_size=(left, right), softcap=softcap, cu_seqlens_q=cu_seqlens_q,
                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=mq, max_seqlen_k=mk, deterministic=deterministic,
                     dlse=dlse)
        return
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[q.dtype]
    cfg, (pre, main, post) = _compiled(jit.resolve_arch(q.device), dtype, q.shape[-1], v.shape[-1], causal,
                                       local, softcap > 0.0, varlen, deterministic, dlse is not None)
    need = cfg.tiles.smem_bytes(cfg.hdim, cfg.hdim_v)
    if need > _smem_optin(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        raise NotImplementedError(f"sm80 backward tiles for hdim {cfg.hdim}/{cfg.hdim_v} need {need} B of "
                                  "shared memory per block, more than this GPU offers")
    lse2, dsum, dq_acc, sem = alloc_scratch(q, cfg.tiles.tile_m, cfg.hdim, cfg.deterministic, num_batch,
                                            rows_q, varlen)
    scale = float(softmax_scale)
    pre(out, dout, lse, dlse, lse2, dsum, dq_acc, sem, cu_seqlens_q, mq)
    main(q, k, v, dout, lse2, dsum, dq_acc, dk, dv, cu_seqlens_q, cu_seqlens_k, sem, scale,
         float(softcap) if softcap > 0 else 0.0, left, right, mk)
    post(dq_acc, dq, cu_seqlens_q, scale, mq)
