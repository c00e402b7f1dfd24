"""FP8 (e4m3) configs on Hopper: the attention kernel (``hopper/fwd_fp8.py``, the sm90 forward with
1-byte Q / K / V) and the quantize-and-rotate kernels (``hopper/quant.py``), their tables and plans.

Inputs as ``launch.quantize_qkv`` returns them: e4m3 Q, K in (B, N, H, d), V as a (B, N, H_kv, d)
view of token-contiguous storage, fp32 (B, H_kv) descales; O in bf16 / fp16 (``dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass

from cute_flash import jit
from cute_flash.formats import FP8_HDIMS as QUANT_HDIMS  # powers of two (Walsh-Hadamard), d / 32 lanes
from cute_flash.hopper.fwd_config import SM90_SMEM_LIMIT, FwdSm90Config
from cute_flash.problem import Problem

# (tile_m, tile_n, stages, consumer warpgroups, ping-pong) per head dim. tile_n is a multiple of 32
# (the k32 P V wgmma walks the keys 32 at a time). Measured fastest on the H200
# (scripts/tune/tune_fp8.py, docs/tuning.md).
SM90_FP8_FWD_TILES: dict[int, tuple[int, int, int, int, bool]] = {
    64: (128, 192, 2, 2, True),
    128: (128, 192, 2, 2, True),
    256: (128, 128, 2, 2, False),
}


# Persistent grid up to this many keys, where it measured faster than one CTA per tile (H200,
# docs/tuning.md); d = 64 keeps one CTA per tile.
SM90_FP8_PERSISTENT_MAX_SEQLEN = 4096
SM90_FP8_PERSISTENT_CAUSAL_D128_MAX_SEQLEN = 8192


# Sliding windows (a mask on both sides, more live registers) keep smaller tiles: the tuned ones
# spill there.
SM90_FP8_FWD_TILES_LOCAL: dict[int, tuple[int, int, int, int, bool]] = {
    64: (128, 128, 2, 2, False),
    128: (128, 128, 2, 2, False),
    256: (128, 96, 2, 2, True),
}


@dataclass(frozen=True)
class FwdSm90Fp8Config(FwdSm90Config):
    """``FwdSm90Config`` with e4m3 Q / K / V; ``dtype`` is O's type. No softcap. ``launch.run_fwd_fp8``
    picks packed GQA for short query sequences and the persistent grid (``num_ctas``, per-tile
    descales) for short key sequences (``fp8_launch_fields``, from ``plan``)."""

    # V storage in the kernel's token order (``formats.V_PERM16``, as ``launch.quantize_qkv(...,
    # v_perm=True)`` writes it): P needs no exchange between lanes. Off: natural token order.
    v_perm: bool = False
    # Row sums of P on the tensor cores: P (the e4m3 A registers of P V) times an 8-column block of
    # ones in smem, one m64n8k32 wgmma per 32 keys in P V's commit group, instead of one FADD per
    # score (those FADDs take a large share of the softmax's issue slots at d = 128). The sums are
    # of the e4m3-rounded P that P V multiplied; each block's sum restarts in the wgmma and is
    # added in fp32 registers (the fp8 accumulator keeps ~14 bits, too few to carry across
    # blocks). None: on for the tuned tiles (measured faster, docs/tuning.md), off for sliding
    # windows and for the small varlen causal d = 64 tile.
    sum_mma: bool | None = None
    # P's e4m3 codes from one FFMA per score, a conversion per two and a byte permute per four
    # (``device/convert.py``) instead of an exponential on the MUFU: the code round(8 x + 56) of
    # 2^x is read off e4m3's own layout (8 codes per binade), within a binade the chord 1 + j / 8
    # of 2^(j / 8) (at most 6% above it; P V and the row sums see the same codes), flushing below
    # 2^-7 of the scaled P (``reference_fp8.p_log_bytes``, ``EXP_BYTES_LOG2_SCALE``). Needs ``sum_mma``.
    # None: on wherever ``sum_mma`` is (measured faster, docs/tuning.md).
    # ``CUTE_FLASH_FP8_P=exact`` turns it off at run time.
    exp_bytes: bool | None = None

    kernel_name = "fwd_sm90_fp8"

    def __post_init__(self) -> None:
        if self.hdim not in SM90_FP8_FWD_TILES or self.hdim_v != self.hdim:
            raise ValueError(f"FP8 forward: head dims {tuple(SM90_FP8_FWD_TILES)} with d_v = d")
        if self.softcap:
            raise ValueError("FP8 forward: no softcap")
        if self.varlen and self.v_perm:
            # The varlen re-layout of V (formats.v_varlen_aligned) writes the natural order.
            raise ValueError("FP8 forward: varlen takes V in its natural token order")
        # Varlen causal at d = 64 (the sequence offsets and both mask bounds stay live) keeps the
        # smaller tile.
        small = self.local or (self.varlen and self.causal and self.hdim == 64)
        table = SM90_FP8_FWD_TILES_LOCAL if small else SM90_FP8_FWD_TILES
        tile_m, tile_n, stages, wgs, pingpong = table[self.hdim]
        for name, value in (("tile_m", tile_m), ("tile_n", tile_n), ("stages", stages),
                            ("num_mma_wg", wgs)):
            if not getattr(self, name):
                object.__setattr__(self, name, value)
        if self.sum_mma is None:
            object.__setattr__(self, "sum_mma", not self.local and not (small and self.hdim == 64)
                               and self.num_mma_wg != 3)
        if self.pingpong is None:
            object.__setattr__(self, "pingpong", pingpong)
        if self.tile_n % 32:
            raise ValueError("FP8 forward: tile_n must be a multiple of 32 (k32 P V)")
        if self.sum_mma and self.hdim == 64 and self.num_mma_wg == 3:
            # d = 64 (three warpgroups, 160 keys): ptxas serialises the wgmmas (a wait after each).
            raise ValueError("FP8 forward: no sum_mma with three consumer warpgroups at d = 64")
        if self.exp_bytes is None:
            object.__setattr__(self, "exp_bytes", bool(self.sum_mma))
        if self.exp_bytes and not self.sum_mma:
            raise ValueError("FP8 forward: exp_bytes needs sum_mma")
        super().__post_init__()
        if not self.separate_o:
            raise ValueError("FP8 forward: O (16 bit) needs its own smem buffer beside 1-byte Q")

    def smem_bytes(self, separate_o: bool) -> int:
        """1-byte Q / K / V tiles, 16-bit O (and ``sum_mma``'s block of ones): the Storage struct's
        size -- the mbarriers, then every buffer 1024-aligned (the swizzle atoms' period). Exact,
        not padded: d = 256 with ``sum_mma`` leaves 1 KiB of the 227."""
        def r(n: int) -> int:
            return (n + 1023) // 1024 * 1024

        q, o = self.tile_m * self.hdim, self.tile_m * self.hdim_v * 2
        k, v = self.stages * self.tile_n * self.hdim, self.stages * self.tile_n * self.hdim_v
        ones = r(8 * self.tile_n) if self.sum_mma else 0
        return 1024 + r(k) + r(v) + (r(q) + r(o) if separate_o else r(max(q, o))) + ones

    def build(self):
        from cute_flash.hopper.fwd_fp8 import FlashFwdSm90Fp8

        return FlashFwdSm90Fp8(self)

    def fake_args(self) -> tuple:
        f8, out = cutlass.Float8E4M3FN, jit.DTYPES[self.dtype]
        if self.varlen:
            return self._fake_args_varlen(f8, out)
        b, nq, nk, h, hkv, d = jit.sym(), jit.sym(), jit.sym(), jit.sym(), jit.sym(), self.hdim
        q = jit.fake_tensor(f8, (b, nq, h, d), divisibility=16)
        k = jit.fake_tensor(f8, (b, nk, hkv, d), divisibility=16)
        # Token-contiguous V (N_pad a multiple of 16: the TMA's 16-byte strides).
        # (v_perm: N_pad tokens, the whole storage, so its own extent.)
        v = jit.fake_tensor(f8, (b, jit.sym() if self.v_perm else nk, hkv, d), leading_dim=1, divisibility=16)
        o = jit.fake_tensor(out, (b, nq, h, d), divisibility=jit.vec_div(out))
        lse = jit.fake_tensor(cutlass.Float32, (b, h, nq), divisibility=1)
        scalars = (cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(-1), cutlass.Int32(-1),
                   cutlass.Int32(0))
        counter = jit.fake_tensor(cutlass.Int32, (1,), leading_dim=0)
        descales = [jit.fake_tensor(cutlass.Float32, (b, hkv)) for _ in range(3)]
        return (q, k, v, o, lse, None, None, *scalars, counter, *descales, None, jit.fake_stream())

    def _fake_args_varlen(self, f8, out) -> tuple:
        """Packed sequences: Q, O (T_q, H, d), K (T_k, H_kv, d), V (T_v, H_kv, d) over
        token-contiguous storage with V's offsets cu_seqlens_v, LSE (H, T_q), cu_seqlens (S + 1,),
        descales (S, H_kv)."""
        tq, tk, h, hkv, s1, s = (jit.sym() for _ in range(6))
        d = self.hdim
        q = jit.fake_tensor(f8, (tq, h, d), divisibility=16)
        k = jit.fake_tensor(f8, (tk, hkv, d), divisibility=16)
        # V over its own (H_kv, d, T_v) storage, every sequence starting at a multiple of 16.
        v = jit.fake_tensor(f8, (jit.sym(), hkv, d), leading_dim=0, divisibility=16)
        o = jit.fake_tensor(out, (tq, h, d), divisibility=jit.vec_div(out))
        lse = jit.fake_tensor(cutlass.Float32, (h, tq), divisibility=1)
        cu_q = jit.fake_tensor(cutlass.Int32, (s1,), leading_dim=0)
        cu_k = jit.fake_tensor(cutlass.Int32, (s1,), leading_dim=0)
        scalars = (cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(-1), cutlass.Int32(-1),
                   cutlass.Int32(0))
        counter = jit.fake_tensor(cutlass.Int32, (1,), leading_dim=0)
        descales = [jit.fake_tensor(cutlass.Float32, (s, hkv)) for _ in range(3)]
        cu_v = jit.fake_tensor(cutlass.Int32, (s1,), leading_dim=0)
        return (q, k, v, o, lse, cu_q, cu_k, *scalars, counter, *descales, cu_v, jit.fake_stream())


def fp8_launch_fields(num_keys: int, *, causal: bool, local: bool, num_sms: int, hdim: int = 128,
                      varlen: bool = False, num_queries: int = 0, pack: int = 1,
                      dense_q: bool = True) -> dict:
    """Fields chosen at launch: packed GQA for short query sequences, the persistent grid where it
    measured faster (above); sliding windows (unmeasured) and varlen keep one CTA per tile."""
    fields: dict = {}
    tile_m = (SM90_FP8_FWD_TILES_LOCAL if local else SM90_FP8_FWD_TILES).get(hdim, (128,))[0]
    if not varlen and pack > 1 and tile_m % pack == 0 and dense_q and num_queries * pack <= tile_m:
        # Decode / short prefill with GQA: the query heads of a KV head share one M tile, so each
        # K/V block is read once per KV head, and the tile is not mostly empty rows.
        fields["pack_gqa"] = pack
    limit = SM90_FP8_PERSISTENT_MAX_SEQLEN
    if causal and hdim == 128:
        limit = SM90_FP8_PERSISTENT_CAUSAL_D128_MAX_SEQLEN
    if local or varlen or hdim == 64 or num_keys > limit:
        return fields
    # Causal tiles are unequal: claiming them longest first from a counter balances the SMs, a
    # static stride does not.
    return {**fields, "num_ctas": num_sms, "dynamic_tiles": causal}


assert SM90_SMEM_LIMIT >= FwdSm90Fp8Config(target="sm_90a", hdim=256, hdim_v=256).smem_bytes(True)


@dataclass(frozen=True)
class QuantizeConfig(jit.KernelConfig):
    """One phase (``amax`` or ``quant``) of quantizing one of Q, K (``rotate``) or V
    (``transpose``: sequence-contiguous output), ``rows`` tokens of one head per CTA."""

    dtype: str = "bf16"
    hdim: int = 128
    rotate: bool = True
    transpose: bool = False
    phase: str = "quant"
    rows: int = 64
    # With ``transpose``: tokens stored in the FP8 kernel's order (``formats.V_PERM16``).
    v_perm: bool = False
    # Packed (T, H, d) input with cu_seqlens; scales per (sequence, kv head).
    varlen: bool = False
    # Varlen V: each sequence written from its own 16-aligned start (``formats.varlen_v_offsets``,
    # the varlen FP8 kernel's V layout, or the FP8 backward's padded Q^T / dO^T rows) instead of at
    # its cu_seqlens offset.
    v_aligned: bool = False
    # Lanes per row (``hopper.quant``): 32, or 4 / 8 / 16 for Q and K -- a warp then rotates 32 / L
    # rows at once with fewer shuffle rounds. Needs ``rows`` a multiple of 16 * 32 / L.
    lanes_per_row: int = 32

    kernel_name = "quantize"

    def __post_init__(self) -> None:
        if self.hdim not in QUANT_HDIMS:
            raise ValueError(f"quantize: head dim {self.hdim} not in {QUANT_HDIMS}")
        if self.phase not in ("amax", "quant"):
            raise ValueError(f"quantize: phase must be amax or quant, got {self.phase!r}")
        if self.rotate and self.transpose:
            raise ValueError("quantize: V (the transposed output) is not rotated")
        if self.v_perm and not (self.transpose and self.phase == "quant"):
            raise ValueError("quantize: v_perm orders the transposed V output")
        relayout_only = self.transpose and self.phase == "quant" and not self.rotate
        if self.v_aligned and not (self.varlen and self.transpose and self.phase == "quant"):
            raise ValueError("quantize: v_aligned places packed V (varlen, transposed quant phase)")
        if self.dtype == "e4m3" and not relayout_only:
            raise ValueError("quantize: e4m3 input only re-lays V out (transpose, quant phase)")
        if self.lanes_per_row not in (4, 8, 16, 32) or self.hdim // self.lanes_per_row < 2:
            raise ValueError(f"quantize: lanes_per_row must be 4, 8, 16 or 32 (at most d / 2), got "
                             f"{self.lanes_per_row}")
        if self.lanes_per_row != 32 and self.transpose:
            raise ValueError("quantize: V (transposed through smem) takes a whole warp per row")
        if self.rows % (16 * 32 // self.lanes_per_row):
            raise ValueError(f"quantize: rows must be a multiple of {16 * 32 // self.lanes_per_row} "
                             f"with {self.lanes_per_row} lanes per row")
        if self.v_perm and self.varlen and not self.v_aligned:
            # The kernel order permutes each 16-token chunk, and packed chunks straddle sequences.
            raise ValueError("quantize: v_perm with varlen (packed) inputs needs v_aligned")

    def build(self):
        from cute_flash.hopper.quant import QuantizeSm90

        return QuantizeSm90(self)

    def fake_args(self) -> tuple:
        """(x, signs, amax, out, cu_seqlens, max_seqlen, cu_seqlens_out, stream); dense: both
        cu_seqlens None; cu_seqlens_out only with ``v_aligned``."""
        dt = cutlass.Float8E4M3FN if self.dtype == "e4m3" else jit.DTYPES[self.dtype]
        h, hkv, d = jit.sym(), jit.sym(), self.hdim
        signs = jit.fake_tensor(cutlass.Float32, (d,))
        if self.varlen:
            t, s1 = jit.sym(), jit.sym()
            x = jit.fake_tensor(dt, (t, h, d), divisibility=jit.vec_div(dt))
            amax = jit.fake_tensor(cutlass.Float32, (jit.sym(), hkv))
            cu = jit.fake_tensor(cutlass.Int32, (s1,), leading_dim=0)
            if self.transpose:
                # (H_kv, d, T_pad) storage, T_pad a multiple of 16 (as the dense N_pad).
                out = jit.fake_tensor(cutlass.Float8E4M3FN, (h, d, jit.sym()), leading_dim=2, divisibility=16)
            else:
                out = jit.fake_tensor(cutlass.Float8E4M3FN, (t, h, d), divisibility=16)
            cu_out = jit.fake_tensor(cutlass.Int32, (s1,), leading_dim=0) if self.v_aligned else None
            return x, signs, amax, out, cu, cutlass.Int32(0), cu_out, jit.fake_stream()
        b, n = jit.sym(), jit.sym()
        x = jit.fake_tensor(dt, (b, n, h, d), divisibility=jit.vec_div(dt))
        amax = jit.fake_tensor(cutlass.Float32, (b, hkv))
        if self.transpose:
            # (B, H_kv, d, N_pad) storage, N_pad a multiple of 16 (16-byte rows for the stores
            # here and for the attention kernel's TMA).
            out = jit.fake_tensor(cutlass.Float8E4M3FN, (b, h, d, jit.sym()), leading_dim=3, divisibility=16)
        else:
            out = jit.fake_tensor(cutlass.Float8E4M3FN, (b, n, h, d), divisibility=16)
        return x, signs, amax, out, None, cutlass.Int32(0), None, jit.fake_stream()


# Q / K lanes per row (``QuantizeConfig.lanes_per_row``) by head dim, measured faster on the H200
# (docs/tuning.md); other head dims take the whole warp per row.
QK_LANES_BY_HDIM = {64: 8, 128: 8}


def qk_lanes_per_row(hdim: int) -> int:
    """Q / K lanes per row the quantize launches use at this head dim."""
    return QK_LANES_BY_HDIM.get(hdim, 32)


def quant_configs(dtype: str, hdim: int, rotate: bool, v_perm: bool = False,
                  varlen: bool = False, v_aligned: bool = False,
                  qk_lanes: int | None = None) -> list[QuantizeConfig]:
    """Every kernel ``quantize_qkv`` (``varlen``: ``quantize_qkv_varlen``) launches: amax and quant
    phases for Q / K and for V (``qk_lanes``: Q / K's lanes per row, None = ``qk_lanes_per_row``)."""
    lanes = qk_lanes_per_row(hdim) if qk_lanes is None else qk_lanes
    rows = max(64, 16 * 32 // lanes)
    return [QuantizeConfig(target=None, dtype=dtype, hdim=hdim, rotate=rot, transpose=tr, phase=ph,
                           v_perm=v_perm and tr and ph == "quant", varlen=varlen,
                           v_aligned=v_aligned and tr and ph == "quant",
                           **({} if tr or lanes == 32 else dict(lanes_per_row=lanes, rows=rows)))
            for rot, tr in ((rotate, False), (False, True)) for ph in ("amax", "quant")]


def bwd_quant_config(dtype: str, hdim: int, varlen: bool = False) -> QuantizeConfig:
    """The FP8 backward's quantize kernel: V again at the forward's descales in natural layout
    (the quant phase, unrotated; ``varlen``: packed V, per-sequence descales). (dO goes to e4m3 in
    the backward's preprocess.)"""
    lanes = qk_lanes_per_row(hdim)
    fields = {} if lanes == 32 else dict(lanes_per_row=lanes, rows=max(64, 16 * 32 // lanes))
    return QuantizeConfig(target=None, dtype=dtype, hdim=hdim, rotate=False, phase="quant", varlen=varlen,
                          **fields)


def plan(p: Problem, v_perm: bool = False, overrides: tuple = ()) -> FwdSm90Fp8Config:
    """The FP8 attention variant of one problem (``v_perm``: V in the kernel's token order, as the
    ``fp8=True`` path's quantize writes it); ``overrides``: config fields (tuning scripts)."""
    fields: dict = {}
    if p.extents_known:
        fields = fp8_launch_fields(p.max_seqlen_k, causal=p.causal, local=p.local, num_sms=p.num_sms,
                                   hdim=p.hdim, varlen=p.varlen, num_queries=p.max_seqlen_q,
                                   pack=p.heads_q // p.heads_kv, dense_q=p.varlen or p.q_dense)
    return FwdSm90Fp8Config(target=p.target, dtype=p.dtype, hdim=p.hdim, hdim_v=p.hdim_v, causal=p.causal,
                            local=p.local, varlen=p.varlen, v_perm=v_perm, **{**fields, **dict(overrides)})
