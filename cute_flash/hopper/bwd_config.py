"""sm90a backward configs: the FA3-style main kernels (``hopper/bwd.py`` for d <= 128,
``hopper/bwd_wide.py`` for d >= 192), the dQ postprocess (``hopper/bwd_postprocess.py``), their
tables and the plan of one problem.

The preprocess is the sm80 one (LSE2, D, zeroed dQ accumulator over the same padded scratch rows);
the main kernel's dQ writer warp adds dQ into the accumulator in the dQ MMA's fragment order and the
sm90 postprocess converts it. Each table below holds the choice measured fastest on the H200; the
measurements are in docs/tuning.md ("sm90 backward").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cute_flash import jit, signatures
from cute_flash.ampere.config import BwdPreConfig
from cute_flash.device.mods import Mods, check_bwd_mods
from cute_flash.device.tile_scheduler import section_size
from cute_flash.problem import Problem

# Query-block rows and keys per CTA by head dim (FA3's tiles; d = 96 / 192 launch with .minnctapersm 1).
SM90_BWD_TILE_M = {64: 128, 96: 64, 128: 64, 192: 64, 256: 64}
SM90_BWD_TILE_N = {64: 128, 96: 128, 128: 128, 192: 96, 256: 64}
# Softcap's 1 - tanh^2 registers: smaller tiles where the default ones spill.
SM90_BWD_TILE_N_SOFTCAP = {192: 64}
SM90_BWD_TILE_M_SOFTCAP = {64: 64}
SM90_BWD_HDIMS = tuple(SM90_BWD_TILE_M)
SM90_SMEM_BYTES = 227 * 1024
# d_v != d: (192, 128) (MLA-style heads) in the wide kernel, whose dV^T keeps the head dim on M.
SM90_BWD_NARROW_V = {192: 128}
SM90_BWD_SOFTCAP_HDIMS = (64, 96, 128, 192, 256)
# Every block through the masked exponentials, by (head dim, softcap): measured faster there.
SM90_BWD_MASK_ALWAYS = {(64, False), (96, False), (192, False), (192, True)}
# dS^T stored before dV's GEMM, by (head dim, masked): measured faster at d = 96 causal only.
SM90_BWD_DS_BEFORE_DV = {(96, True)}
# Non-causal d = 128 from 2k query rows: the 80-query tile, measured faster from there on.
SM90_BWD_LONG_ROWS = {128: (2048, dict(tile_m=80, dq_writer_batch=True, dkv_stmatrix=True, mask_always=True))}
# Narrow kernel, by (head dim, masked): LSE2 / D read under the wgmmas where measured faster.
SM90_BWD_PREFETCH_STATS = {(128, False), (128, True)}
# The wide kernel reads them under the wgmmas at every head dim (2 + 2 registers per thread).
SM90_BWD_WIDE_PREFETCH_STATS = True
# By (head dim, masked): the batched dQ writer and stmatrix dK / dV where measured faster.
SM90_BWD_DQ_WRITER_BATCH = {(128, False), (128, True), (64, False)}
SM90_BWD_DKV_STMATRIX = {(128, False), (128, True), (64, False)}
# Split loads with polling waits: faster together (neither alone) in the narrow kernel.
SM90_BWD_SPLIT_LOADS = True
SM90_BWD_SPIN_WAITS = True
# The wide kernel's head dims that take split loads and polling waits (d_v = d).
SM90_BWD_WIDE_SPLIT_HDIMS = (192, 256)
# dO stages below Q's (2 Q + 1 dO stage beside the dQ writer warp), by head dim (d_v = d).
SM90_BWD_DO_STAGES = {192: 1}
# flash-attn-4's order of a block's stores and GEMMs in the wide kernel: faster at d = 192 only.
SM90_BWD_WIDE_FA4_ORDER = (192,)
# Longest-first walk (``lpt``, causal): L2 budget of one section of heads (Q, dO, dQ accumulator).
SM90_BWD_LPT_L2_BYTES = 40 * 1024 * 1024
# ``lpt`` over even sections where full ones leave a short last one: measured faster.
SM90_BWD_LPT_BALANCED = True
# Deterministic mode without masks: the rotated walk where measured faster (not d = 192).
SM90_BWD_DET_ROTATE = (64, 96, 128, 256)
# The rotated query-block walk, by (head dim, masked): measured faster at d = 256 non-causal.
SM90_BWD_ROTATE_M = {(256, False)}
# GQA / MQA: a K/V head's query heads split over the fewest CTA rows (``head_split``, a divisor of
# the group) that give the grid this many waves of CTAs (one CTA per SM), or over the whole group.
SM90_BWD_SPLIT_MIN_WAVES = 7.5
# Preprocess CTA size (256 measured within noise).
SM90_BWD_PRE_THREADS = 128


def sm90_bwd_tile_n(hdim: int, softcap: bool) -> int:
    """Keys per CTA of the sm90 backward at a head dim (the warpgroups' key / head-dim split)."""
    return SM90_BWD_TILE_N_SOFTCAP.get(hdim, SM90_BWD_TILE_N[hdim]) if softcap else SM90_BWD_TILE_N[hdim]


def sm90_bwd_covers(hdim: int, hdim_v: int, softcap: bool, mods: bool = False) -> bool:
    """Whether the sm90 backward runs this problem (every head dim it compiles is GPU-checked;
    mods: the narrow kernel's)."""
    if hdim not in SM90_BWD_HDIMS or hdim_v not in (hdim, SM90_BWD_NARROW_V.get(hdim)):
        return False
    if mods and hdim > 128:
        return False
    return not softcap or hdim in SM90_BWD_SOFTCAP_HDIMS


@dataclass(frozen=True)
class BwdSm90Config(jit.KernelConfig):
    """``tile_n`` keys per CTA (64 per consumer warpgroup), query blocks of ``tile_m`` rows in a
    ``stages``-deep Q/dO pipeline; a writer warp adds each block's dQ into the fp32 accumulator."""

    dtype: str = "bf16"
    hdim: int = 128
    hdim_v: int = 0  # 0 = hdim
    causal: bool = False
    local: bool = False
    softcap: bool = False
    varlen: bool = False
    deterministic: bool = False
    # A score_mod / mask_mod with its derivative and aux gradients (``device/mods.py``): the narrow
    # kernel only, on softcap's tiles (the unmodified scores stay in registers, as softcap's factor).
    mods: Mods | None = None
    # 0 = ``SM90_BWD_TILE_M``; 80 at d = 128 is FA3's non-causal tile (dQ^T computed with the head
    # dim on M, ``hopper.bwd_dq.dq_swapab``).
    tile_m: int = 0
    tile_n: int = 0
    # Q / dO pipeline depth (0 = 2, or 1 where two stages do not fit: d = 256).
    stages: int = 0
    # dO + D depth below Q's (wide kernel with split loads; 0 = ``stages``, or ``SM90_BWD_DO_STAGES``).
    do_stages: int = 0
    # Narrow kernel (None = on): issue dQ before dK and hand the dQ tile over while dK runs. Wide
    # kernel: flash-attn-4's order of a block's smem stores and GEMMs (``SM90_BWD_WIDE_FA4_ORDER``).
    dq_before_dk: bool | None = None
    # dS buffers in the narrow kernel: 1, or one per Q/dO stage (0 = the Q/dO depth), which drops the
    # consumers' EMPTY barrier before each dS store.
    ds_stages: int = 0
    # Grid walked longest CTA first within L2-sized sections of heads (``FlashBwdSm90.longest_first``;
    # None = on for causal without varlen or deterministic mode, whose order it would break).
    lpt: bool | None = None
    # ``lpt`` over head sections of even size (``balanced_section_order``) instead of full ones and
    # a short last one; ``plan`` turns it on where the last section would hold fewer than half a
    # section's heads (``lpt_last_section_short``, ``SM90_BWD_LPT_BALANCED``).
    lpt_balanced: bool = False
    # Key block n starts at its n-th query block and wraps (``FlashBwdSm90.query_block``), so the
    # CTAs of a head are not all at the same query block at once. None = ``SM90_BWD_ROTATE_M``;
    # in deterministic mode (no masks) the add order follows it (``scratch.rotated_add_rank``).
    rotate_m: bool | None = None
    # The switches below: None = the measured defaults (``SM90_BWD_PREFETCH_STATS`` ..).
    # Read LSE2 / D into registers while the S^T / dP^T wgmmas run instead of after their waits
    # (flash-attn-4's order). Narrow kernel: not with softcap (no registers left).
    prefetch_stats: bool | None = None
    # dQ writer warp: issue both warpgroups' reduce-adds, then release each chunk as it is read,
    # instead of waiting for each chunk's read right after its issue (flash-attn-4's writer).
    dq_writer_batch: bool | None = None
    # dK / dV to smem by stmatrix (wide kernel: transposing, from dK^T / dV^T) instead of 2-byte stores.
    dkv_stmatrix: bool | None = None
    # K and V on a barrier each, Q + LSE2 and dO + D on two pipelines, so the first S^T of a CTA
    # waits for K, Q and LSE2 alone (flash-attn-4's split) rather than all six loads. d_v = d only.
    split_loads: bool | None = None
    # mbarrier waits that poll (``device/waits.py``) instead of the DSL's sleeping wait.
    spin_waits: bool | None = None
    # Every block through the masked exponentials (flash-attn-4's loop) instead of a uniform
    # branch to an unmasked copy for interior blocks: one basic block, so ptxas may interleave P's
    # conversion, stores and barrier with the exponentials, at one compare-and-select per score.
    mask_always: bool | None = None
    # Narrow kernel: dS^T to smem before dV's wgmma is issued, its proxy fence and barrier after
    # (flash-attn-4's order), so the stores drain while dV's wgmmas issue.
    ds_before_dv: bool | None = None
    # GQA / MQA: a K/V head's query heads split over several CTAs (dK / dV given with more heads
    # than K / V: one partial sum per CTA row, summed by the launcher), instead of one CTA looping
    # over the whole group. How many: ``head_split``.
    split_heads: bool = False

    kernel_name = "bwd_sm90"

    def __post_init__(self) -> None:
        if self.hdim not in SM90_BWD_HDIMS:
            raise ValueError(f"sm90 backward: head dim {self.hdim} not supported {SM90_BWD_HDIMS}")
        if not self.hdim_v:
            object.__setattr__(self, "hdim_v", self.hdim)
        if self.hdim_v not in (self.hdim, SM90_BWD_NARROW_V.get(self.hdim)):
            raise ValueError(f"sm90 backward: d_v = {self.hdim_v} with d = {self.hdim} (d_v = d, or "
                             f"{SM90_BWD_NARROW_V})")
        if self.mods is not None and self.hdim > 128:
            raise ValueError("sm90 backward: score_mod / mask_mod in the narrow kernel (d <= 128) only")
        check_bwd_mods(self.mods, self.deterministic)
        if not self.tile_m:
            tile_m = SM90_BWD_TILE_M[self.hdim]
            if self.heavy_scores:
                tile_m = SM90_BWD_TILE_M_SOFTCAP.get(self.hdim, tile_m)
            object.__setattr__(self, "tile_m", tile_m)
        tile_n = sm90_bwd_tile_n(self.hdim, self.heavy_scores)
        if not self.tile_n:
            object.__setattr__(self, "tile_n", tile_n)
        if (self.hdim in SM90_BWD_DO_STAGES and self.hdim_v == self.hdim and self.split_loads is not False
                and not self.stages and not self.do_stages):
            object.__setattr__(self, "stages", 2)
            object.__setattr__(self, "do_stages", SM90_BWD_DO_STAGES[self.hdim])
        if not self.stages:
            object.__setattr__(self, "stages", 2)
            if self.smem_bytes() > SM90_SMEM_BYTES:
                object.__setattr__(self, "stages", 1)
        narrow = self.hdim <= 128
        self._resolve_switches(narrow)
        if self.prefetch_stats and self.softcap and narrow:
            # (The wide kernel's rows are queries: 2 LSE2 + 2 D registers per thread, room everywhere.)
            raise ValueError("sm90 backward: prefetch_stats in the narrow kernel refuses softcap")
        if self.mask_always is None:
            # (With mods: one copy of the exponentials, not two around a branch -- the copies spill.)
            always = (self.hdim, self.heavy_scores) in SM90_BWD_MASK_ALWAYS or self.mods is not None
            object.__setattr__(self, "mask_always", always)
        if self.ds_before_dv is None:
            object.__setattr__(self, "ds_before_dv",
                               narrow and (self.hdim, self.causal or self.local) in SM90_BWD_DS_BEFORE_DV)
        if self.ds_before_dv and not narrow:
            raise ValueError("sm90 backward: ds_before_dv is a narrow-kernel (d <= 128) switch")
        if self.lpt is None:
            # (A block mask's key blocks differ in length as causal ones do: heaviest first.)
            sparse = self.mods is not None and self.mods.block_sparse
            lpt = (self.causal or sparse) and not self.varlen and not self.deterministic
            object.__setattr__(self, "lpt", lpt)
        if self.rotate_m is None:
            rotate = (self.hdim, self.causal or self.local) in SM90_BWD_ROTATE_M and not self.deterministic
            object.__setattr__(self, "rotate_m", rotate)
        if self.dq_before_dk is None:
            object.__setattr__(self, "dq_before_dk", narrow or self._wide_fa4_order())
        if not self.ds_stages:
            object.__setattr__(self, "ds_stages", self.stages if narrow else 1)
        self._check(narrow, tile_n)

    def _check(self, narrow: bool, tile_n: int) -> None:
        """Refuse the combinations the kernels do not build (``tile_n``: the head dim's key tile)."""
        if self.rotate_m and self.deterministic and (self.causal or self.local):
            # (Without masks every key block sees every query block, which the rotated add order
            # -- ``scratch.rotated_add_rank`` -- assumes.)
            raise ValueError("sm90 backward: deterministic mode takes the rotated walk only without "
                             "causal / window masks")
        if self.lpt and (self.varlen or self.deterministic):
            raise ValueError("sm90 backward: lpt walks fixed-length grids, not deterministic mode")
        if self.smem_bytes() > SM90_SMEM_BYTES:
            raise ValueError(f"sm90 backward: {self.smem_bytes()} bytes of smem per CTA (at most "
                             f"{SM90_SMEM_BYTES}); fewer stages")
        if self.hdim > 128 and self.ds_stages != 1:
            raise ValueError("sm90 backward: ds_stages is a narrow-kernel (d <= 128) switch")
        if self.do_stages and self.do_stages != self.stages and not (
                not narrow and self.split_loads and 1 <= self.do_stages < self.stages):
            raise ValueError("sm90 backward: do_stages (fewer than stages) is for the wide kernel with "
                             "split loads")
        if self.split_loads and self.hdim_v != self.hdim:
            # (K and V share one pipeline whose stages expect the same byte count.)
            raise ValueError("sm90 backward: split_loads needs d_v = d")
        if self.ds_stages not in (1, self.stages):
            raise ValueError(f"sm90 backward: ds_stages must be 1 or stages ({self.stages})")
        if self.heavy_scores and self.hdim == 64 and self.tile_m == 128:
            raise ValueError("sm90 backward: softcap or mods at head dim 64 take tile_m = 64 (128 query "
                             "rows spill)")
        if self.tile_n != tile_n or self.tile_m not in (64, 80, 128) or self.stages < 1:
            raise ValueError(f"sm90 backward: tile_n = {tile_n} at head dim {self.hdim} "
                             "(the warpgroups' key / head-dim split), tile_m 64, 80 or 128")
        if self.tile_m == 80 and (self.hdim != 128 or self.heavy_scores):
            raise ValueError("sm90 backward: tile_m = 80 (dQ^T with the head dim on M, split over the "
                             "two warpgroups) needs d = 128, no softcap or mods (it spills)")
        if self.tile_m == 80 and (self.causal or self.local or self.deterministic):
            raise ValueError("sm90 backward: tile_m = 80 only without masks or deterministic mode "
                             "(its stmatrix dS^T spills / serialises the wgmmas there)")

    @property
    def heavy_scores(self) -> bool:
        """Per-score state beyond S and dP (softcap's factor, a score_mod's inputs, a mask_mod's
        reads): the smaller tiles, no statistics prefetch."""
        return self.softcap or self.mods is not None

    def _wide_fa4_order(self) -> bool:
        # (Its stmatrix dK^T / dV^T goes with it: without the order, d = 192 causal spills.)
        return (self.hdim in SM90_BWD_WIDE_FA4_ORDER and self.hdim_v == self.hdim
                and self.dq_before_dk is not False)

    def _resolve_switches(self, narrow: bool) -> None:
        # (The 80-row tile takes its own schedule, ``SM90_BWD_LONG_ROWS``: these tables do not apply.)
        key = (self.hdim, self.causal or self.local) if self.tile_m != 80 else None
        wide_split = self.hdim in SM90_BWD_WIDE_SPLIT_HDIMS and self.hdim_v == self.hdim
        auto = dict(prefetch_stats=(key in SM90_BWD_PREFETCH_STATS and not self.heavy_scores) if narrow
                    else SM90_BWD_WIDE_PREFETCH_STATS,
                    dq_writer_batch=key in SM90_BWD_DQ_WRITER_BATCH,
                    dkv_stmatrix=key in SM90_BWD_DKV_STMATRIX or self._wide_fa4_order(),
                    split_loads=SM90_BWD_SPLIT_LOADS and (narrow or wide_split),
                    spin_waits=SM90_BWD_SPIN_WAITS and (narrow or wide_split))
        for name, value in auto.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    def lpt_rows_in_l2(self) -> int:
        """Query rows whose Q + dO (16 bit) and dQ accumulator (fp32), d * 8 bytes each, fit the
        ``lpt`` walk's L2 budget (``SM90_BWD_LPT_L2_BYTES``)."""
        return SM90_BWD_LPT_L2_BYTES // (self.hdim * 8)

    def lpt_last_section_short(self, q_rows_per_kv_head: int, kv_heads: int) -> bool:
        """Whether ``lpt``'s full sections of heads (the kernel's ``longest_first``) leave a last
        one of fewer than half as many heads."""
        group = section_size(self.lpt_rows_in_l2(), max(q_rows_per_kv_head, 1), kv_heads)
        rem = kv_heads % group
        return 0 < 2 * rem < group

    def smem_bytes(self) -> int:
        """Shared memory of the main kernel (tiles 1 KiB aligned, as its storage struct)."""
        elem, d, dv, tm, tn = 2, self.hdim, self.hdim_v or self.hdim, self.tile_m, self.tile_n
        do_stages = self.do_stages or self.stages
        tiles = [self.stages * tm * d * elem, do_stages * tm * dv * elem, tn * d * elem, tn * dv * elem]
        # dS (narrow: per dS stage); the wide kernel also keeps P.
        tiles += [tm * tn * elem] * ((self.ds_stages or self.stages) if self.hdim <= 128 else 2)
        total = sum((t + 1023) // 1024 * 1024 for t in tiles)
        total += (self.stages + do_stages) * tm * 4 + 1024  # LSE2 / D rows, barriers and slack
        return total + tm * d * 4  # the dQ writer warp's fp32 tile

    def build(self):
        if self.hdim > 128:
            from cute_flash.hopper.bwd_wide import FlashBwdSm90Wide

            return FlashBwdSm90Wide(self)
        from cute_flash.hopper.bwd import FlashBwdSm90

        return FlashBwdSm90(self)

    def pre(self, dlse: bool = False) -> BwdPreConfig:
        """The preprocess, which lets this kernel launch early (programmatic dependent launch)."""
        return BwdPreConfig(target=self.target, dtype=self.dtype, hdim=self.hdim, hdim_v=self.hdim_v,
                            tile_m=self.tile_m, varlen=self.varlen, deterministic=self.deterministic,
                            launch_dependents=True, threads=SM90_BWD_PRE_THREADS, dlse=dlse)

    def post(self) -> BwdSm90PostConfig:
        return BwdSm90PostConfig(target=self.target, dtype=self.dtype, hdim=self.hdim, tile_m=self.tile_m,
                                 varlen=self.varlen)

    def fake_args(self) -> tuple:
        """Every main backward kernel's arguments (``signatures.bwd_main_fake_args``)."""
        return signatures.bwd_main_fake_args(self.dtype, self.hdim, self.hdim_v, self.varlen,
                                             self.deterministic, self.split_heads, self.mods)


@dataclass(frozen=True)
class BwdSm90PostConfig(jit.KernelConfig):
    """dQ = softmax_scale * dQaccum from the sm90 main kernel's accumulator chunks (fragment order)."""

    dtype: str = "bf16"
    hdim: int = 128
    tile_m: int = 64
    varlen: bool = False

    kernel_name = "bwd_post_sm90"

    def build(self):
        from cute_flash.hopper.bwd_postprocess import FlashBwdPostSm90

        return FlashBwdPostSm90(self)

    def fake_args(self) -> tuple:
        return signatures.bwd_post_fake_args(self.dtype, self.hdim, self.varlen)


def long_rows_overrides(problem: dict, max_seqlen_q: int) -> dict:
    """``SM90_BWD_LONG_ROWS``' launch rule on a problem's ``BwdSm90Config`` fields (hdim, hdim_v,
    causal, ...; checked before any config is built, so the launch path builds one): the fields
    that take the long-sequence tile -- fixed-length, non-causal, no window / softcap /
    deterministic mode, d_v = d, at least the head dim's threshold of query rows -- else none."""
    hdim = problem["hdim"]
    rule = SM90_BWD_LONG_ROWS.get(hdim)
    special = any(problem.get(f) for f in ("causal", "local", "softcap", "varlen", "deterministic", "mods"))
    if rule is None or problem.get("hdim_v", hdim) not in (0, hdim) or special or max_seqlen_q < rule[0]:
        return {}
    return dict(rule[1])


def det_rotate_applies(cfg: BwdSm90Config, max_seqlen_k: int, num_sms: int) -> bool:
    """``SM90_BWD_DET_ROTATE``'s launch rule: deterministic, no masks, and every key block of a
    head resident at once (one CTA per SM)."""
    return (cfg.hdim in SM90_BWD_DET_ROTATE and cfg.deterministic and not (cfg.causal or cfg.local)
            and (max_seqlen_k + cfg.tile_n - 1) // cfg.tile_n <= num_sms)


def head_split(p: Problem, overrides: tuple = ()) -> int:
    """How many CTA rows share one K/V head's query heads (``split_heads``; 1 = one CTA loops over
    the whole group). ``overrides`` may name it (``head_split``, a divisor of the group)."""
    group = p.heads_q // max(p.heads_kv, 1)
    given = dict(overrides).get("head_split")
    if given is not None:
        if given < 1 or group % given:
            raise ValueError(f"sm90 backward: head_split {given} must divide the group ({group})")
        return int(given)
    if group == 1 or not p.extents_known:
        return 1
    tile_n = sm90_bwd_tile_n(p.hdim, p.softcap or p.mods is not None)
    ctas = -(-p.max_seqlen_k // tile_n) * p.heads_kv * p.batch
    want = SM90_BWD_SPLIT_MIN_WAVES * p.num_sms
    return next((s for s in range(1, group + 1) if group % s == 0 and ctas * s >= want), group)


def plan(p: Problem, overrides: tuple = ()) -> tuple[BwdPreConfig, BwdSm90Config, BwdSm90PostConfig]:
    """(preprocess, main, postprocess) of one backward problem: the long-sequence tile, the rotated
    deterministic order, balanced ``lpt`` sections and split query-head groups (``head_split``)
    where their launch rules hold (extents known); ``overrides``: ``BwdSm90Config`` fields as
    (name, value) pairs (tuning scripts), and ``head_split``."""
    problem = dict(dtype=p.dtype, hdim=p.hdim, hdim_v=p.hdim_v, causal=p.causal, local=p.local,
                   softcap=p.softcap, varlen=p.varlen, deterministic=p.deterministic, mods=p.mods)
    fixed = dict(overrides)
    fixed.pop("head_split", None)
    if "split_heads" not in fixed and head_split(p, overrides) > 1:
        fixed["split_heads"] = True
    if not p.extents_known:
        cfg = BwdSm90Config(target=p.target, **problem, **fixed)
        return cfg.pre(dlse=p.dlse), cfg, cfg.post()
    long_rows = {} if "tile_m" in fixed else long_rows_overrides(problem, p.max_seqlen_q)
    cfg = BwdSm90Config(target=p.target, **problem, **{**long_rows, **fixed})
    if det_rotate_applies(cfg, p.max_seqlen_k, p.num_sms) and "rotate_m" not in fixed:
        cfg = dataclasses.replace(cfg, rotate_m=True)
    split = head_split(p, overrides) if cfg.split_heads else 1  # (the grid's heads, as the kernel walks them)
    rows = p.max_seqlen_q * (p.heads_q // p.heads_kv) // split
    if (cfg.lpt and SM90_BWD_LPT_BALANCED and "lpt_balanced" not in fixed
            and cfg.lpt_last_section_short(rows, p.heads_kv * split)):
        cfg = dataclasses.replace(cfg, lpt_balanced=True)
    return cfg.pre(dlse=p.dlse), cfg, cfg.post()


def compile_variants(p: Problem) -> list[jit.KernelConfig]:
    """Every kernel a compile-only problem may launch: its plan, and where the launcher takes
    another tile at long sequences (``long_rows_overrides``), that tile's kernels too."""
    configs = list(plan(p))
    problem = dict(dtype=p.dtype, hdim=p.hdim, hdim_v=p.hdim_v, causal=p.causal, local=p.local,
                   softcap=p.softcap, varlen=p.varlen, deterministic=p.deterministic, mods=p.mods)
    if p.heads_q > p.heads_kv:
        # (GQA: the split-group kernel whenever the extents ask for it.)
        split = BwdSm90Config(target=p.target, **problem, split_heads=True)
        configs += [split] if split not in configs else []
    long_rows = long_rows_overrides(problem, max_seqlen_q=1 << 30)
    if long_rows:
        main = BwdSm90Config(target=p.target, **problem, **long_rows)
        configs += [c for c in (main.pre(dlse=p.dlse), main, main.post()) if c not in configs]
    return configs
