"""The FP8 backward's config on Hopper (``hopper/bwd_fp8.py``): the narrow sm90 backward's fields
with the schedule the e4m3 kernel builds, its tiles and its compile arguments; the preprocess and
the dQ postprocess are the 16-bit backward's (``bwd_config``), on bf16 / fp16 O and dO.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cutlass

from cute_flash import jit, signatures
from cute_flash.ampere.config import BwdPreConfig
from cute_flash.formats import FP8_BWD_HDIMS
from cute_flash.hopper.bwd_config import SM90_BWD_LPT_BALANCED, BwdSm90Config, head_split
from cute_flash.problem import Problem

# Query-block rows by head dim: k32 GEMMs over the query block (dV, dK) need a multiple of 32,
# and the dQ MMA's fragment order a multiple of 64.
SM90_FP8_BWD_TILE_M = {64: 64, 128: 64}

# The schedule the FP8 kernel implements: one Q/dO pipeline (no split loads), dQ before dK, one dS
# buffer (its barrier also carries the dS amax exchange), masks only on edge blocks.
_FIXED = dict(split_loads=False, dq_before_dk=True, ds_stages=1, ds_before_dv=False, prefetch_stats=False,
              dkv_stmatrix=False, mask_always=False, rotate_m=False)


@dataclass(frozen=True)
class BwdSm90Fp8Config(BwdSm90Config):
    """``BwdSm90Config`` with e4m3 GEMM operands; ``dtype`` is that of O, dO and the gradients."""

    kernel_name = "bwd_sm90_fp8"

    def __post_init__(self) -> None:
        if self.hdim not in FP8_BWD_HDIMS or self.hdim_v not in (0, self.hdim):
            raise ValueError(f"FP8 backward: head dims {FP8_BWD_HDIMS} with d_v = d")
        if self.softcap or self.mods is not None or self.local:
            raise ValueError("FP8 backward: no softcap, mods or sliding window")
        for name, value in _FIXED.items():
            if getattr(self, name) not in (None, 0, value):
                raise ValueError(f"FP8 backward: {name} must be {value}")
            object.__setattr__(self, name, value)
        if not self.tile_m:
            object.__setattr__(self, "tile_m", SM90_FP8_BWD_TILE_M[self.hdim])
        super().__post_init__()
        if self.tile_m % 64:
            raise ValueError("FP8 backward: tile_m a multiple of 64")

    def smem_bytes(self) -> int:
        """1-byte Q, Q^T, dO, dO^T per stage, K, K^T, V, dS; the 16-bit dK / dV staging tile;
        fp32 LSE2 / D / dO-descale rows, the dQ tile and the warps' amax."""
        d, tm, tn, st = self.hdim, self.tile_m, self.tile_n, self.stages

        def r(n: int) -> int:
            return (n + 1023) // 1024 * 1024

        tiles = 4 * r(st * tm * d) + 3 * r(tn * d) + r(tm * tn) + r(2 * tn * d)
        return 1024 + tiles + 3 * st * tm * 4 + tm * d * 4 + 256

    def pre(self, dlse: bool = False) -> BwdPreConfig:
        """The 16-bit preprocess, which also writes dO in e4m3 with its per-row descales."""
        return dataclasses.replace(super().pre(dlse), quantize_do=True)

    def build(self):
        from cute_flash.hopper.bwd_fp8 import FlashBwdSm90Fp8

        return FlashBwdSm90Fp8(self)

    def fake_args(self) -> tuple:
        """(q8, k8, v8, do8, q8t, k8t, do8t, lse2, d, do_descale, dq_accum, dk, dv, cu_q, cu_k,
        semaphores, q_descale, k_descale, v_descale, softmax_scale, window_left, window_right,
        max_seqlen_k, stream)."""
        f8, out = cutlass.Float8E4M3FN, jit.DTYPES[self.dtype]
        h, hkv, d = jit.sym(), jit.sym(), self.hdim
        if self.varlen:
            tq, tk, s1 = jit.sym(), jit.sym(), jit.sym()
            b = None
            q_shape, k_shape = (tq, h, d), (tk, hkv, d)
            # Q^T / dO^T over (H, d, T_pad) storage in padded scratch rows.
            qt_shape, lead = (jit.sym(), h, d), 0
            cu = [jit.fake_tensor(cutlass.Int32, (s1,), leading_dim=0) for _ in range(2)]
            descale_shape = (jit.sym(), hkv)
            rows_shape = (h, jit.sym())
        else:
            b, nq, nk = jit.sym(), jit.sym(), jit.sym()
            q_shape, k_shape = (b, nq, h, d), (b, nk, hkv, d)
            # Token-contiguous copies ((B, H, d, N_pad) storage, N_pad a multiple of 16 for TMA).
            # (Q^T and dO^T in the kernel's query order: the whole N_pad storage, its own extent.)
            qt_shape, lead = (b, jit.sym(), h, d), 1
            cu = [None, None]
            descale_shape = (b, hkv)
            rows_shape = (b, h, jit.sym())
        q, do = (jit.fake_tensor(f8, q_shape, divisibility=16) for _ in range(2))
        k, v = (jit.fake_tensor(f8, k_shape, divisibility=16) for _ in range(2))
        qt, dot = (jit.fake_tensor(f8, qt_shape, leading_dim=lead, divisibility=16) for _ in range(2))
        # (K^T packed: each sequence from a key-tile start, its own extent.)
        kt = jit.fake_tensor(f8, (jit.sym(), hkv, d) if self.varlen else k_shape, leading_dim=lead,
                             divisibility=16)
        lse2, dsum, dq_acc, sem = signatures.scratch_fakes(self.varlen, h, b, self.deterministic)
        do_descale = jit.fake_tensor(cutlass.Float32, rows_shape, divisibility=4)
        # (``split_heads``: dK / dV partial sums with their own head count.)
        dk_shape = (*k_shape[:-2], jit.sym(), d) if self.split_heads else k_shape
        dk, dv = (jit.fake_tensor(out, dk_shape, divisibility=jit.vec_div(out)) for _ in range(2))
        descales = [jit.fake_tensor(cutlass.Float32, descale_shape) for _ in range(3)]
        scalars = (cutlass.Float32(1.0), cutlass.Int32(-1), cutlass.Int32(-1), cutlass.Int32(0))
        return (q, k, v, do, qt, kt, dot, lse2, dsum, do_descale, dq_acc, dk, dv, *cu, sem, *descales,
                *scalars, jit.fake_stream())


def fp8_bwd_covers(hdim: int, hdim_v: int, *, local: bool) -> bool:
    """Whether the FP8 backward runs this problem."""
    return hdim in FP8_BWD_HDIMS and hdim_v == hdim and not local


def plan(p: Problem, overrides: tuple = ()) -> tuple[jit.KernelConfig, ...]:
    """(preprocess, main, postprocess) of one FP8 backward problem: the longest-first walk over
    even sections where full ones leave a short last one, and GQA groups split over CTA rows, as
    the 16-bit backward's plan (``bwd_config.head_split``)."""
    fixed = dict(overrides)
    fixed.pop("head_split", None)
    split = head_split(p, overrides)
    if "split_heads" not in fixed and split > 1:
        fixed["split_heads"] = True
    cfg = BwdSm90Fp8Config(target=p.target, dtype=p.dtype, hdim=p.hdim, causal=p.causal, varlen=p.varlen,
                           deterministic=p.deterministic, **fixed)
    split = split if cfg.split_heads else 1
    rows = p.max_seqlen_q * (p.heads_q // p.heads_kv) // split
    if (p.extents_known and cfg.lpt and SM90_BWD_LPT_BALANCED and "lpt_balanced" not in fixed
            and cfg.lpt_last_section_short(rows, p.heads_kv * split)):
        cfg = dataclasses.replace(cfg, lpt_balanced=True)
    return cfg.pre(dlse=p.dlse), cfg, cfg.post()
