"""FP8 (e4m3) forward on Hopper (issue 5): the kernel config of ``cute_flash.hopper.fwd_fp8``.

Inputs as ``quant.quantize_qkv`` returns them: e4m3 Q, K in (B, N, H, d), V as a (B, N, H_kv, d)
view of token-contiguous storage, fp32 (B, H_kv) descales; O in bf16 / fp16 (``dtype``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import cutlass

from cute_flash import jit
from cute_flash.fwd_sm90 import SM90_SMEM_LIMIT, FwdSm90Config

# (tile_m, tile_n, stages, consumer warpgroups, ping-pong, intra-warpgroup overlap) per head dim.
# tile_n is a multiple of 32 (the k32 P V wgmma walks the keys 32 at a time). With 1-byte Q / K / V
# the tiles grow past the 16-bit ones; chosen by scripts/tune_fp8.py on the H200 (TFLOP/s, N = 8k /
# 16k, non-causal | causal; docs/notes.md):
# - d = 64: 128 x 192 on two warpgroups with ping-pong, ``sum_mma`` and ``exp_bytes`` (session 16,
#   one tune run, 3 rounds, V in the kernel order, 8k / 16k non-causal | causal: 818 / 838 |
#   696 / 734), against the earlier 192 x 160 on three warpgroups with MUFU exponentials, 639 / 661
#   | 568 / 619 (three warpgroups cannot take ``sum_mma``: ptxas serialises their wgmmas).
# - d = 128: 128 x 192 with ping-pong, 841-847 | 778-828 (128 x 128: 771-787 | 724-766; 224 keys
#   and 160 keys both lower).
# - d = 256: 128 x 128 (smem exactly 227 KiB), 1132-1145 | 1066-1113 (128 x 96: 968-1002 |
#   928-1005); ping-pong on or off within 2%.
SM90_FP8_FWD_TILES: dict[int, tuple[int, int, int, int, bool, bool]] = {
    64: (128, 192, 2, 2, True, True),
    128: (128, 192, 2, 2, True, True),
    256: (128, 128, 2, 2, False, True),
}
# 1 in this many of the softmax exponentials on the FMA pipe (``FwdSm90Config.exp2_emu``). At d = 128
# FP8 the MUFU's 16 exp2 per clock take as long as the QGMMAs of a block: with V in the kernel order,
# 1 in 8 measured +2.6-3.4% (875 -> 898 non-causal, 832 -> 855 causal, N = 16k) and +0.5-2% at
# N = 2k / 4k; at d = 256 (twice the GEMM per exponential) -1 to -4%, and at d = 64 1 in 4 lost 6%.
# With ``sum_mma`` (the d = 128 default since session 8) the FMA pipe is busier: 0 there.
SM90_FP8_EXP2_EMU: dict[int, int] = {128: 8}
# Persistent grid up to this many keys (session 6, N = 2k / 4k, TFLOP/s one CTA per tile ->
# persistent): non-causal with a static stride 749 -> 794, 827 -> 839 (d = 128) and 1063 -> 1115,
# 1102 -> 1142 (d = 256); causal with tiles claimed from the atomic counter 571 -> 636, 697 -> 747
# (d = 128) and 851 -> 917, 1004 -> 1041 (d = 256). At 8k (d = 128): non-causal 880 -> 879 (no
# gain), causal 792 -> 812; at 16k causal 863 -> 859. So causal at d = 128 goes on to 8k; d = 256
# at 8k was not measured (bf16 lost 2% there) and stays at 4k.
# d = 64 (bf16 lost with the persistent grid at N <= 1k there) was not measured and keeps one CTA
# per tile.
SM90_FP8_PERSISTENT_MAX_SEQLEN = 4096
SM90_FP8_PERSISTENT_CAUSAL_D128_MAX_SEQLEN = 8192
# Sliding windows (a mask on both sides, more live registers) keep the first, smaller tiles: the
# tuned ones spill there (stack: 208 bytes at d = 64, 88 at d = 128, 128 at d = 256). Not measured.
SM90_FP8_FWD_TILES_LOCAL: dict[int, tuple[int, int, int, int, bool, bool]] = {
    64: (128, 128, 2, 2, False, True),
    128: (128, 128, 2, 2, False, True),
    256: (128, 96, 2, 2, True, True),
}


@dataclass(frozen=True)
class FwdSm90Fp8Config(FwdSm90Config):
    """``FwdSm90Config`` with e4m3 Q / K / V; ``dtype`` is O's type. No softcap. ``run_fwd_fp8``
    picks packed GQA for short query sequences and the persistent grid (``num_ctas``, per-tile
    descales) for short key sequences (``fp8_launch_fields``)."""

    # V storage in the kernel's token order (``fp8_ref.V_PERM16``, as ``quant.quantize_qkv(...,
    # v_perm=True)`` writes it): P needs no exchange between lanes. Off: natural token order.
    v_perm: bool = False
    # Row sums of P on the tensor cores: P (the e4m3 A registers of P V) times an 8-column block of
    # ones in smem, one m64n8k32 wgmma per 32 keys in P V's commit group, instead of one FADD per
    # score. At d = 128 the softmax's ALU instructions, not the tensor cores, bound the loop (731
    # SASS instructions per warp and block, 96 of them these FADDs: ~95% of the issue slots at
    # the QGMMA rate). The sums are then of the e4m3-rounded P that P V multiplied; each block's
    # sum restarts in the wgmma and is added in fp32 registers (the fp8 accumulator keeps ~14
    # bits: carried across blocks, the sum came out 15% low at 8k keys). None: on at d = 128 for
    # dense and packed inputs (session 8, N = 8k / 16k with V in the kernel order, non-causal |
    # causal: 885-863 | 819-865 -> 912-951 | 853-918 TFLOP/s together with every exponential on
    # the MUFU, the FMA pipe now having fewer free slots). Sliding windows (their own smaller
    # tile, never tuned): compiled and CPU-checked, off. d = 256 since session 16 (its block of
    # ones fits in the last KiB of smem): alone +1-3% (8k / 16k), and it makes ``exp_bytes``
    # possible there; d = 64 since session 17 (with its two-warpgroup tile).
    sum_mma: bool | None = None
    # A row keeps its running max unless a block raises it by more than 2^0.75 (the e4m3 P has
    # that headroom under 448), and a warp skips the O rescale -- 64 FMULs per thread and block
    # at d = 128, ~9% of the loop's instructions -- when none of its rows moved, which after the
    # first blocks is most of them (flash-attn-4's trick on Blackwell, with its larger bf16
    # threshold). Compiled, not yet measured: off.
    lazy_rescale: bool = False
    # P's e4m3 codes from one FFMA per score, a conversion per two and a byte permute per four
    # (``kernels/convert.py``) instead of an exponential on the MUFU: the code round(8 x + 56) of
    # 2^x is read off e4m3's own layout (8 codes per binade), within a binade the chord 1 + j / 8
    # of 2^(j / 8) (at most 6% above it; P V and the row sums see the same codes), flushing below
    # 2^-7 of the scaled P (``fp8_ref.p_log_bytes``, ``EXP_BYTES_LOG2_SCALE``). Needs ``sum_mma``.
    # None: on wherever ``sum_mma`` is. Session 16, V in the kernel order, 5 rounds, TFLOP/s,
    # 8k / 16k non-causal | causal: d = 128 942 / 970 | 835 / 922 -> 1098 / 1125 | 1008 / 1060;
    # d = 256 (with sum_mma) 1212 / 1194 | 1131 / 1179 -> 1323 / 1297 | 1213 / 1242. Outlier-
    # experiment RMSE (rotated, N = 4k) 8.7e-3 -> 8.9e-3 at d = 128, 7.2e-3 -> 7.3e-3 at 256.
    # ``CUTE_FLASH_FP8_P=exact`` turns it off at run time.
    exp_bytes: bool | None = None

    kernel_name = "fwd_sm90_fp8"

    def __post_init__(self) -> None:
        if self.hdim not in SM90_FP8_FWD_TILES or self.hdim_v != self.hdim:
            raise ValueError(f"FP8 forward: head dims {tuple(SM90_FP8_FWD_TILES)} with d_v = d")
        if self.softcap:
            raise ValueError("FP8 forward: no softcap")
        if self.varlen and self.v_perm:
            # The varlen re-layout of V (fp8_ref.v_varlen_aligned) writes the natural order. (The
            # kernel order would work on its 16-aligned sequence starts; not wired up yet.)
            raise ValueError("FP8 forward: varlen takes V in its natural token order")
        # Varlen causal at d = 64 spilled 248 bytes with the three-warpgroup tile (the sequence
        # offsets and both mask bounds stay live); it keeps the smaller tile.
        small = self.local or (self.varlen and self.causal and self.hdim == 64)
        table = SM90_FP8_FWD_TILES_LOCAL if small else SM90_FP8_FWD_TILES
        tile_m, tile_n, stages, wgs, pingpong, overlap = table[self.hdim]
        for name, value in (("tile_m", tile_m), ("tile_n", tile_n), ("stages", stages),
                            ("num_mma_wg", wgs)):
            if not getattr(self, name):
                object.__setattr__(self, name, value)
        if self.sum_mma is None:
            # (d = 64's small varlen-causal tile keeps the exponentials: measured nowhere.)
            object.__setattr__(self, "sum_mma", not self.local and not (small and self.hdim == 64)
                               and self.num_mma_wg != 3)
        if self.exp2_emu is None:
            emu = SM90_FP8_EXP2_EMU.get(self.hdim, 0) if self.v_perm and not self.local else 0
            if self.sum_mma:
                # With the row sums' FADDs gone the FMA pipe is no longer idle beside the MUFU:
                # 1 in 8 on the FMA pipe cost 1-7% (session 8).
                emu = 0
            object.__setattr__(self, "exp2_emu", emu)
        for name, value in (("pingpong", pingpong), ("intra_wg_overlap", overlap)):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.tile_n % 32:
            raise ValueError("FP8 forward: tile_n must be a multiple of 32 (k32 P V)")
        if self.sum_mma and self.hdim == 64 and self.num_mma_wg == 3:
            # d = 64 (three warpgroups, 160 keys): ptxas serialises the wgmmas (a wait after each).
            raise ValueError("FP8 forward: no sum_mma with three consumer warpgroups at d = 64")
        codes_possible = bool(self.sum_mma and not self.lazy_rescale and not self.exp2_emu)
        if self.exp_bytes is None:
            object.__setattr__(self, "exp_bytes", codes_possible)
        if self.exp_bytes and not codes_possible:
            raise ValueError("FP8 forward: exp_bytes needs sum_mma, without lazy_rescale or exp2_emu")
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


# "exact": P by the MUFU's exponential and an e4m3 conversion (round to nearest) wherever the
# default takes its codes from the FFMA (``exp_bytes``, d = 128: ~15% faster, P's rounding up to
# one code off). Read at every call.
FP8_P_ENV = "CUTE_FLASH_FP8_P"


def run_fwd_fp8(q8, k8, v8, q_descale, k_descale, v_descale, out, lse, *, softmax_scale: float,
                causal: bool = False, window_size: tuple[int, int] = (-1, -1), v_perm: bool = False,
                cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q: int | None = None, cu_seqlens_v=None,
                **overrides) -> None:
    """Launch the FP8 forward on validated CUDA tensors. Dense: e4m3 ``q8`` / ``k8`` (B, N, H, d)
    and ``v8`` as ``quant.quantize_qkv`` returns it -- (B, N_k, H_kv, d) over token-contiguous
    storage, or with ``v_perm`` the (B, H_kv, d, N_pad) storage in the kernel's token order;
    ``out`` (B, N, H, d) bf16 / fp16, ``lse`` (B, H, N) fp32, descales (B, H_kv). Varlen
    (``cu_seqlens_q`` / ``_k`` int32 (S + 1,)): q8 (T_q, H, d), k8 (T_k, H_kv, d), v8 and
    ``cu_seqlens_v`` as ``fp8_ref.v_varlen_aligned`` makes them (each sequence's V starting at a
    multiple of 16 tokens), out (T_q, H, d), lse (H, T_q), descales (S, H_kv). ``overrides``:
    config fields (tile sizes, switches) for tuning."""
    import torch

    from cute_flash.fwd import max_seqlen, normalize_window

    if q8.dtype != torch.float8_e4m3fn or k8.dtype != q8.dtype or v8.dtype != q8.dtype:
        raise TypeError("FP8 forward: q, k, v must be torch.float8_e4m3fn")
    varlen = cu_seqlens_q is not None
    if varlen and (cu_seqlens_v is None or cu_seqlens_v.shape != cu_seqlens_k.shape):
        raise ValueError("FP8 forward: varlen needs V's own 16-aligned offsets (fp8_ref.v_varlen_aligned)")
    if v_perm:
        b, nk, hkv, d = k8.shape
        if varlen or tuple(v8.shape) != (b, hkv, d, (nk + 15) // 16 * 16) or not v8.is_contiguous():
            raise ValueError("FP8 forward: v_perm expects the contiguous (B, H_kv, d, N_pad) storage "
                             "quant.quantize_qkv(..., v_perm=True) returns (dense inputs only)")
        # The kernel reads (B, N_pad, H_kv, d) over it: every stored position, since a token below
        # N may sit past N in the kernel order (its P is zero where the token is past N).
        v8 = v8.permute(0, 3, 1, 2)
    elif v8.stride(-3) != 1 or any(st % 16 for st in v8.stride()[:-3] + v8.stride()[-2:]):
        # TMA: the token dim contiguous, every other stride a multiple of 16 bytes.
        raise ValueError("FP8 forward: v must be token-contiguous with 16-byte aligned strides (as "
                         "quant.quantize_qkv writes it)")
    causal, local, left, right = normalize_window(causal, window_size)
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[out.dtype]
    if q8.device.type == "cuda":
        from cute_flash.fwd_sm90 import _dense_bnhd, sm_count

        fields = fp8_launch_fields(k8.shape[-3], causal=causal, local=local, num_sms=sm_count(q8.device),
                                   hdim=q8.shape[-1], varlen=varlen, num_queries=q8.shape[-3],
                                   pack=q8.shape[-2] // k8.shape[-2], dense_q=varlen or _dense_bnhd(q8))
        overrides = {**fields, **overrides}
    if os.environ.get(FP8_P_ENV, "").strip().lower() == "exact":
        overrides = {"exp_bytes": False, **overrides}
    cfg = FwdSm90Fp8Config(target=None, dtype=dtype, hdim=q8.shape[-1], hdim_v=v8.shape[-1],
                           causal=causal, local=local, v_perm=v_perm, varlen=varlen, **overrides)
    fn = jit.compile_kernel(cfg)
    mq = max_seqlen(cu_seqlens_q, max_seqlen_q) if varlen else q8.shape[1]
    # The tile counter: zeroed per launch for a dynamic persistent grid, else a cached placeholder.
    (counter,) = cfg.launch_args(q8.device)
    fn(q8, k8, v8, out, lse, cu_seqlens_q, cu_seqlens_k, float(softmax_scale), 0.0, left, right, mq,
       counter, q_descale, k_descale, v_descale, cu_seqlens_v if varlen else None)
