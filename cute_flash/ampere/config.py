"""sm80 kernel configs: the FlashAttention-2 forward (``fwd.py``) and the three backward kernels
(``bwd_preprocess.py``, ``bwd.py``, ``bwd_postprocess.py``), their tile tables and their plans.

The backward's three kernels share the query tile (``tile_m``) and the dQ MMA layout (the
accumulator is stored in that MMA's fragment order), so the pre/post configs derive from the main one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import cutlass

from cute_flash import jit, signatures
from cute_flash.device.mods import Mods, check_bwd_mods
from cute_flash.problem import Problem

# (tile_m, tile_n, num_threads, num_stages) of the forward per max(hdim, hdim_v): the fastest
# spill-free candidate of the H200 tile sweep (docs/tuning.md).
SM80_FWD_TILES: dict[int, tuple[int, int, int, int]] = {
    32: (64, 128, 128, 2),
    64: (64, 128, 128, 1),
    96: (128, 32, 128, 1),
    128: (128, 128, 256, 1),
    160: (64, 64, 128, 1),
    192: (64, 64, 128, 1),
    256: (64, 64, 128, 1),
}
SM80_MODS_TILE_N = 64  # K / V block with a score_mod / mask_mod
# Sliding windows and softcap add ~20 live registers (two row limits, tanh scale); where that tips
# the default tile into spilling, these variants take a narrower K/V block.
SM80_FWD_TILES_MASKED: dict[int, tuple[int, int, int, int]] = {
    256: (64, 32, 128, 1),
}


@dataclass(frozen=True)
class FwdConfig(jit.KernelConfig):
    """One sm80 forward variant. Sequence lengths, batch, heads and the GQA ratio are run-time
    values; everything here is baked into the compiled code. ``target=None`` compiles for the
    current device (what launches use); an explicit target cross-compiles for inspection."""

    dtype: str = "bf16"
    hdim: int = 128
    hdim_v: int = 128
    causal: bool = False
    local: bool = False
    softcap: bool = False
    varlen: bool = False
    # Learnable sinks: an (H,) fp32 logit per query head joins each row's softmax denominator.
    sinks: bool = False
    # A user's score_mod / mask_mod and its aux tensors' types (``device/mods.py``).
    mods: Mods | None = None
    tiles: tuple[int, int, int, int] = field(default=(0, 0, 0, 0))

    kernel_name = "fwd_sm80"

    def __post_init__(self) -> None:
        if self.tiles == (0, 0, 0, 0):
            tiles = self.plain_tiles()
            if self.mods is not None:
                # A mod's per-key values need registers the widest S blocks use (tests/cpu/test_mods.py).
                tiles = (tiles[0], min(tiles[1], SM80_MODS_TILE_N), *tiles[2:])
            object.__setattr__(self, "tiles", tiles)

    def plain_tiles(self) -> tuple[int, int, int, int]:
        """The tuned tiles of this head dim and masking, before any narrowing for mods."""
        d = max(self.hdim, self.hdim_v)
        table = SM80_FWD_TILES_MASKED if (self.local or self.softcap) else SM80_FWD_TILES
        return table.get(d, SM80_FWD_TILES[d])

    def build(self):
        from cute_flash.ampere.fwd import FlashFwdSm80

        return FlashFwdSm80(self)

    def fake_args(self) -> tuple:
        *args, stream = signatures.fwd_fake_args(self.dtype, self.hdim, self.hdim_v, self.varlen)
        return (*args, signatures.sinks_arg(self.sinks), *signatures.aux_args(self.mods),
                signatures.blocks_arg(self.mods), stream)


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


# Backward tiles per max(hdim, hdim_v), 8 warps each: the largest that compile spill-free for
# every variant (dK, dV live in fp32 registers; docs/tuning.md). hdim 256 splits the dQ GEMM.
SM80_BWD_TILES: dict[int, BwdTiles] = {
    32: BwdTiles(64, 128, 256, 2, 2, 4, 4),
    64: BwdTiles(64, 128, 256, 2, 2, 4, 4),
    96: BwdTiles(64, 128, 256, 2, 4, 4, 4),
    128: BwdTiles(64, 96, 256, 2, 4, 2, 2),
    160: BwdTiles(64, 64, 256, 2, 4, 4, 4),
    192: BwdTiles(64, 64, 256, 2, 4, 2, 2),
    256: BwdTiles(64, 64, 256, 1, 4, 2, 2, dq_splits=2),
}


# Softcap keeps 1 - tanh^2 of every score live from S to dS: a narrower K/V tile where it spills.
SM80_BWD_TILES_SOFTCAP: dict[int, BwdTiles] = {
    96: BwdTiles(64, 64, 256, 2, 4, 4, 4),
}


SM80_SMEM_BYTES = 166912  # cudaDevAttrMaxSharedMemoryPerBlockOptin on A100


def bwd_tiles(hdim: int, hdim_v: int, softcap: bool = False) -> BwdTiles:
    key = max(hdim, hdim_v)
    if softcap and key in SM80_BWD_TILES_SOFTCAP:
        return SM80_BWD_TILES_SOFTCAP[key]
    return SM80_BWD_TILES[key]


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
    # sm90 only (griddepcontrol): let the main kernel, launched with PDL, start its prologue while
    # this one still runs.
    launch_dependents: bool = False
    # Threads per CTA (each loads 16 bytes per copy; rows of threads must tile ``tile_m``).
    threads: int = 128
    # FP8 backward: dO also written in e4m3 with one scale per row (sm89+ conversions).
    quantize_do: bool = False

    kernel_name = "bwd_pre_sm80"

    def __post_init__(self) -> None:
        if self.quantize_do and self.target == "sm_80":
            raise ValueError("backward preprocess: quantize_do needs e4m3 conversions (sm89+)")

    def build(self):
        from cute_flash.ampere.bwd_preprocess import FlashBwdPreSm80

        return FlashBwdPreSm80(self)

    def fake_args(self) -> tuple:
        dt = jit.DTYPES[self.dtype]
        div = jit.vec_div(dt)
        h = jit.sym()
        if self.varlen:
            tq, b1 = jit.sym(), jit.sym()
            rows_shape = (tq, h, self.hdim_v)
            lse = jit.fake_tensor(cutlass.Float32, (h, tq), divisibility=1)
            cu_q = jit.fake_tensor(cutlass.Int32, (b1,), leading_dim=0)
            b = None
        else:
            b, nq = jit.sym(), jit.sym()
            rows_shape = (b, nq, h, self.hdim_v)
            lse = jit.fake_tensor(cutlass.Float32, (b, h, nq), divisibility=1)
            cu_q = None
        o, do = (jit.fake_tensor(dt, rows_shape, divisibility=div) for _ in range(2))
        dlse = None
        if self.dlse:
            dlse = jit.fake_tensor(cutlass.Float32, (h, tq) if self.varlen else (b, h, nq), divisibility=1)
        lse2, d, dq_acc, sem = signatures.scratch_fakes(self.varlen, h, b, self.deterministic)
        do8 = descale = None
        if self.quantize_do:
            do8 = jit.fake_tensor(cutlass.Float8E4M3FN, rows_shape, divisibility=16)
            descale = signatures.scratch_fakes(self.varlen, h, b, False)[1]
        return (o, do, lse, dlse, lse2, d, dq_acc, sem, do8, descale, cu_q, cutlass.Int32(0),
                jit.fake_stream())


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
    # A score_mod / mask_mod with its derivative and aux gradients (``device/mods.py``), on
    # softcap's tiles (the unmodified scores stay in registers, as softcap's factor does).
    mods: Mods | None = None
    tiles: BwdTiles | None = field(default=None)

    kernel_name = "bwd_sm80"

    def __post_init__(self) -> None:
        if self.tiles is None:
            tiles = bwd_tiles(self.hdim, self.hdim_v, self.softcap or self.mods is not None)
            if self.mods is not None and self.mods.score_mod is not None and self.mods.mask_mod is not None:
                # Both mods' per-key values: 96-key blocks spill at d 128, 64 do not.
                tiles = dataclasses.replace(tiles, tile_n=min(tiles.tile_n, SM80_MODS_TILE_N))
            object.__setattr__(self, "tiles", tiles)
        check_bwd_mods(self.mods, self.deterministic)

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
        return signatures.bwd_main_fake_args(self.dtype, self.hdim, self.hdim_v, self.varlen,
                                             self.deterministic, mods=self.mods)


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
        return signatures.bwd_post_fake_args(self.dtype, self.hdim, self.varlen)


# ---------------------------------------------------------------------------------------------
# Plans: the configs one problem launches
# ---------------------------------------------------------------------------------------------
def fwd_plan(p: Problem) -> FwdConfig:
    """The forward of one problem; with mods, the plain K/V block where it compiles spill-free (a
    mod's cost in registers is known only once compiled: ALiBi fits at d 128, a table gather does
    not)."""
    cfg = FwdConfig(target=p.target, dtype=p.dtype, hdim=p.hdim, hdim_v=p.hdim_v, causal=p.causal,
                    local=p.local, softcap=p.softcap, varlen=p.varlen, sinks=p.sinks, mods=p.mods)
    if p.mods is None:
        return cfg
    plain = cfg.plain_tiles()
    if plain[1] <= cfg.tiles[1]:
        return cfg
    wide = dataclasses.replace(cfg, tiles=(cfg.tiles[0], plain[1], *cfg.tiles[2:]))
    return jit.first_spill_free([wide]) or cfg


def bwd_plan(p: Problem) -> tuple[BwdPreConfig, BwdConfig, BwdPostConfig]:
    """(preprocess, main, postprocess) of one backward problem."""
    main = BwdConfig(target=p.target, dtype=p.dtype, hdim=p.hdim, hdim_v=p.hdim_v, causal=p.causal,
                     local=p.local, softcap=p.softcap, varlen=p.varlen, deterministic=p.deterministic,
                     mods=p.mods)
    return main.pre(dlse=p.dlse), main, main.post()
