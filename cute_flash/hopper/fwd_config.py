"""sm90a forward config (the FlashAttention-3 style kernel in ``hopper/fwd.py``), its tile tables
and its plan. The compiled function takes the sm80 forward's arguments
(``signatures.fwd_fake_args``) plus a tile counter for the persistent grid.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import cutlass

from cute_flash import jit, signatures
from cute_flash.device.mods import Mods
from cute_flash.problem import Problem

# Per head dim: (tile_m, tile_n, stages, consumer warpgroups, ping-pong). tile_m is 64 rows per
# consumer warpgroup; K and V each sit in a ``stages``-deep TMA pipeline. Shared memory: Q
# tile_m*d + (K + V) stages*tile_n*d, 16-bit, within the 227 KiB an sm90 block may use.
# Measured fastest on the H200 (scripts/tune/tune_sm90.py, docs/tuning.md).
SM90_FWD_TILES: dict[int, tuple[int, int, int, int, bool]] = {
    32: (128, 128, 2, 2, False),
    64: (192, 128, 2, 3, True),  # three consumer warpgroups (160 registers each) on 192 rows
    96: (128, 128, 2, 2, False),
    128: (128, 128, 2, 2, False),
    160: (128, 96, 2, 2, True),
    192: (128, 96, 2, 2, True),
    256: (128, 80, 2, 2, True),
}
# K / V block of the variants with a score_mod / mask_mod before ``plan`` widens it: the widest that
# compiles every built-in spill-free at d 128 (tests/cpu/test_mods.py).
SM90_MODS_TILE_N = 96
# A score_mod and a mask_mod together (each with its per-key reads; a block mask's per-block branch):
# 96 keys spill there, 64 do not.
SM90_MODS_BOTH_TILE_N = 64
# Causal / sliding-window variants where they differ: ping-pong measured no faster there.
SM90_FWD_TILES_MASKED: dict[int, tuple[int, int, int, int, bool]] = {
    160: (128, 96, 2, 2, False),
    192: (128, 96, 2, 2, False),
    256: (128, 80, 2, 2, False),
}

SM90_SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)

# Persistent grid (one CTA per SM looping over tiles) where it measured faster than one CTA per
# tile on the H200 (docs/tuning.md): causal tiles claimed from an atomic counter, unmasked ones
# by a static stride.
SM90_PERSISTENT_UNMASKED_MAX_SEQLEN = 2048  # d <= 128
SM90_PERSISTENT_CAUSAL_WIDE_MAX_SEQLEN = 4096  # causal, d > 128
SM90_PERSISTENT_CAUSAL_NARROW_MIN_SEQLEN = 2048  # causal, d <= 64
# d = 64 below this many query rows: the 128-row tile (two warpgroups, ping-pong) on the persistent
# grid instead of the 192-row one -- causal always, unmasked where it pads fewer rows (N = 197:
# 256 rows, not 384).
SM90_SHORT_D64_MAX_SEQLEN = 2048


def sm90_tile(d: int, masked: bool) -> tuple[int, int, int, int, bool]:
    """The tuned (tile_m, tile_n, stages, warpgroups, ping-pong) for a head dim."""
    if masked and d in SM90_FWD_TILES_MASKED:
        return SM90_FWD_TILES_MASKED[d]
    return SM90_FWD_TILES[d]


@dataclass(frozen=True)
class FwdSm90Config(jit.KernelConfig):
    """One sm90a forward variant (see ``ampere.config.FwdConfig`` for the shared fields).

    ``num_mma_wg`` consumer warpgroups own ``tile_m / num_mma_wg`` query rows each; one more
    warpgroup produces (TMA). Within a consumer warpgroup, QK^T of the next block is issued
    together with P V of the current one, and the softmax runs while P V is in flight.
    ``pingpong``: the consumer warpgroups also take turns at the tensor cores (named barriers), so
    one's softmax overlaps the other's GEMMs. ``rescale_o_early``: O is rescaled one block late,
    before the next P V is issued (wide O). ``l2_sections``: tile order by sections of heads whose
    K/V fit in L2 (default for causal/local, with longest-first m-blocks) instead of head by head
    (``device/tile_scheduler.py``). Zero / None fields take the head dim's entry in
    ``SM90_FWD_TILES``. ``pack_gqa`` > 1: the query heads of one KV head share the M tile (short
    Nq); it must equal H / H_kv of the inputs (the kernel reads head groups of that size) and
    divide ``tile_m``. ``varlen``: packed (T, H, d) inputs with cu_seqlens, TMA boxes starting at
    each batch's first row.
    """

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
    tile_m: int = 0
    tile_n: int = 0
    num_mma_wg: int = 0
    stages: int = 0
    pingpong: bool | None = None
    l2_sections: bool | None = None
    rescale_o_early: bool | None = None
    pack_gqa: int = 1
    # Seed each row's sum chain with row_sum * scale (flash-attn-4's order): in SASS the O rescale
    # then interleaves with the exponentials instead of trailing them.
    seed_row_sum: bool | None = None
    # mbarrier waits that poll try_wait instead of sleeping (``device/waits.py``).
    spin_waits: bool | None = None
    # Persistent grid of ``num_ctas`` CTAs (the SM count) looping over the tiles; 0: one CTA per
    # tile. Dense inputs only (ignored for varlen).
    num_ctas: int = 0
    # With ``num_ctas``: tiles after each CTA's first are claimed from an atomic counter (the
    # ``tile_counter`` argument, zeroed before the launch) instead of a fixed stride, so CTAs
    # whose tiles were short take more of them (causal).
    dynamic_tiles: bool = False
    # O staged in its own smem buffer (where it fits) instead of Q's: derived, not set.
    separate_o: bool = False
    # Independent FMNMX chains per row for the row maximum (the max must finish before the row's
    # first exponential, so its latency sits on the softmax's critical path).
    max_chains: int = 4

    kernel_name = "fwd_sm90"

    def __post_init__(self) -> None:
        d = max(self.hdim, self.hdim_v)
        if d not in SM90_FWD_TILES:
            raise ValueError(f"sm90 forward: unsupported head dim {d}")
        defaults = dict(zip(("tile_m", "tile_n", "stages", "num_mma_wg", "pingpong"),
                            sm90_tile(d, self.causal or self.local), strict=True))
        if self.mods is not None:
            # A mod's per-key values (positions, aux reads) need registers the 128-key S block uses:
            # a narrower block here, widened by ``plan`` as far as it compiles spill-free.
            defaults["tile_n"] = min(defaults["tile_n"], mods_tile_n(self.mods))
            # The mod's work lengthens the softmax: the two warpgroups' GEMMs take turns around it
            # (1.04-1.12x at d 128, docs/tuning.md).
            defaults["pingpong"] = defaults["pingpong"] or defaults["num_mma_wg"] == 2
        if self.tile_m and not self.num_mma_wg:  # an explicit tile_m implies its warpgroup count
            defaults["num_mma_wg"] = self.tile_m // 64
        for name, value in defaults.items():
            # 0 means "unset" for the sizes only: False is a real choice for the switches.
            if getattr(self, name) is None or (not isinstance(value, bool) and getattr(self, name) == 0):
                object.__setattr__(self, name, value)
        if self.rescale_o_early is None:
            object.__setattr__(self, "rescale_o_early", max(self.hdim, self.hdim_v) > 128)
        if self.l2_sections is None:
            sparse = self.mods is not None and self.mods.block_sparse
            object.__setattr__(self, "l2_sections", self.causal or self.local or sparse)
        if self.spin_waits is None:
            # Sleeping waits measured faster only for the masked 3-warpgroup d=64 tile.
            object.__setattr__(self, "spin_waits", not ((self.causal or self.local) and self.num_mma_wg == 3))
        if self.seed_row_sum is None:
            # Measured faster at d=128 only (docs/tuning.md).
            object.__setattr__(self, "seed_row_sum", self.hdim == self.hdim_v == 128)
        if self.num_mma_wg not in (2, 3):
            raise ValueError("sm90 forward: 2 or 3 consumer warpgroups")
        if self.tile_m != 64 * self.num_mma_wg:
            raise ValueError("sm90 forward: tile_m must be 64 rows per consumer warpgroup")
        if self.pack_gqa < 1 or self.tile_m % self.pack_gqa != 0 or (self.pack_gqa > 1 and self.varlen):
            raise ValueError("sm90 forward: pack_gqa must divide tile_m, and packed inputs are dense")
        if self.pack_gqa > 1 and self.mods is not None and self.mods.block_sparse:
            raise ValueError("sm90 forward: a block mask's ranges are per query head (no pack_gqa)")
        if self.tile_n % 16 != 0 or self.stages < 2:
            raise ValueError("sm90 forward: tile_n must be a multiple of 16 and stages >= 2")
        object.__setattr__(self, "separate_o", self.smem_bytes(separate_o=True) <= SM90_SMEM_LIMIT)

    def smem_bytes(self, separate_o: bool) -> int:
        """Shared memory of the tiles (16-bit elements, 1 KiB aligned) plus the mbarriers."""
        q, o = self.tile_m * self.hdim * 2, self.tile_m * self.hdim_v * 2
        kv = self.stages * self.tile_n * (self.hdim + self.hdim_v) * 2
        return 1024 + kv + (q + o if separate_o else max(q, o)) + 2 * 1024

    def build(self):
        from cute_flash.hopper.fwd import FlashFwdSm90

        return FlashFwdSm90(self)

    def fake_args(self) -> tuple:
        """The shared forward arguments plus ``tile_counter`` (int32, 1 element) before the stream."""
        *args, stream = signatures.fwd_fake_args(self.dtype, self.hdim, self.hdim_v, self.varlen)
        return (*args, jit.fake_tensor(cutlass.Int32, (1,), leading_dim=0), signatures.sinks_arg(self.sinks),
                *signatures.aux_args(self.mods), signatures.blocks_arg(self.mods), stream)


def mods_tile_n(mods: Mods) -> int:
    """The K/V block a variant with ``mods`` compiles at unless ``plan`` widens it."""
    both = mods.score_mod is not None and mods.mask_mod is not None
    return SM90_MODS_BOTH_TILE_N if both else SM90_MODS_TILE_N


def widest_spill_free(cfg: FwdSm90Config) -> FwdSm90Config:
    """``cfg`` (a variant with mods) at the widest K/V block, up to the plain kernel's, that compiles
    without register spills: what a mod needs per score is known only once it is compiled (ALiBi
    fits the 128-key block at d 128, 1.1x faster than 96 on the H100; a relative-bias gather does
    not). Each block tried is compiled once (the answer is kept beside the disk cache)."""
    plain = sm90_tile(max(cfg.hdim, cfg.hdim_v), cfg.causal or cfg.local)[1]
    wider = (replace(cfg, tile_n=tile_n) for tile_n in range(plain, cfg.tile_n, -32))
    return jit.first_spill_free(wider) or cfg


def plan(p: Problem) -> FwdSm90Config:
    """The forward variant of one problem: packed GQA for short query sequences, and the persistent
    grid where it measured faster (``SM90_PERSISTENT_*``). Sliding windows and varlen keep one CTA
    per tile; with mods, the widest K/V block that compiles spill-free."""
    base = dict(target=p.target, dtype=p.dtype, hdim=p.hdim, hdim_v=p.hdim_v, causal=p.causal, local=p.local,
                softcap=p.softcap, varlen=p.varlen, sinks=p.sinks, mods=p.mods)
    fields = {} if p.varlen or not p.extents_known else launch_fields(p)
    cfg = FwdSm90Config(**base, **fields)
    return cfg if p.mods is None else widest_spill_free(cfg)


def launch_fields(p: Problem) -> dict:
    d, n = max(p.hdim, p.hdim_v), p.max_seqlen_k
    fields: dict = {}
    pack = p.heads_q // p.heads_kv
    tile_m = sm90_tile(d, p.masked)[0]
    # Packed-GQA TMA boxes were checked with Q in the dense (B, N, H, d) order only.
    sparse = p.mods is not None and p.mods.block_sparse
    if pack > 1 and tile_m % pack == 0 and p.max_seqlen_q * pack <= tile_m and p.q_dense and not sparse:
        # Decode / short prefill with GQA: the query heads of a KV head share one M tile, so each
        # K/V block is read once per KV head, and the tile is not mostly empty rows.
        fields["pack_gqa"] = pack
    elif tile_m == 192 and not p.local and p.max_seqlen_q < SM90_SHORT_D64_MAX_SEQLEN and (
            p.causal or -(-p.max_seqlen_q // 128) * 128 < -(-p.max_seqlen_q // 192) * 192):
        return dict(tile_m=128, num_mma_wg=2, pingpong=True, num_ctas=p.num_sms, dynamic_tiles=p.causal)
    if p.local or (p.causal and d <= 64 and n < SM90_PERSISTENT_CAUSAL_NARROW_MIN_SEQLEN):
        return fields
    if (p.causal or sparse) and (d <= 128 or n <= SM90_PERSISTENT_CAUSAL_WIDE_MAX_SEQLEN):
        # (A block mask's tiles differ in length as causal ones do: claimed heaviest first.)
        fields.update(num_ctas=p.num_sms, dynamic_tiles=True)
    elif not p.causal and d <= 128 and n <= SM90_PERSISTENT_UNMASKED_MAX_SEQLEN:
        fields.update(num_ctas=p.num_sms)
    return fields
