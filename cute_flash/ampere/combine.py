"""The split-KV merge: per query row, the splits' fp32 partial O (each normalised by its own row
sum) and LSE become O = sum_s exp(LSE_s - LSE) O_s in the output dtype and LSE = log sum_s
exp(LSE_s). One warp per (batch, token, head) row: the lanes take the split LSEs for the two
reductions, then 32 consecutive columns at a time (coalesced) of every split's O. Splits that saw
no key (LSE -inf) weigh 0; a row with none at all gets O = 0, LSE = -inf. With sinks, each row's
sink joins the merged denominator (LSE = log(sum_s exp(LSE_s) + exp(sink))) and adds no value.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash import jit

WARPS = 4
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


class FwdCombine:
    def __init__(self, cfg) -> None:
        self.dtype = jit.DTYPES[cfg.dtype]
        self.hdim_v = cfg.hdim_v
        self.cols = cfg.hdim_v // 32  # columns per lane
        self.has_sinks = cfg.sinks

    @cute.jit
    def __call__(self, mOacc: cute.Tensor, mLSEacc: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 num_splits: Int32, mSinks: cute.Tensor | None, stream):
        """``mOacc`` (B * S, N, H, d_v) and ``mLSEacc`` (B * S, H, N) fp32, batch-major; ``mO``
        (B, N, H, d_v), ``mLSE`` (B, H, N); ``mSinks`` (H,) fp32 or None."""
        rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        self.kernel(mOacc, mLSEacc, mO, mLSE, num_splits, mSinks).launch(
            grid=[cute.ceil_div(rows, WARPS), 1, 1], block=[32 * WARPS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOacc: cute.Tensor, mLSEacc: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               num_splits: Int32, mSinks: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * WARPS + tidx // 32
        nq, nh = mO.shape[1], mO.shape[2]
        if row < mO.shape[0] * nq * nh:
            h = row % nh
            t = (row // nh) % nq
            b = row // (nh * nq)
            base = b * num_splits
            lse_max = -Float32.inf
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                lse_max = cutlass.max(lse_max, mLSEacc[base + s, h, t])
            lse_max = cute.arch.warp_reduction_max(lse_max)
            if cutlass.const_expr(self.has_sinks):
                lse_max = cutlass.max(lse_max, mSinks[h])
            # (Every split empty: no finite reference, the row stays O = 0, LSE = -inf.)
            ref = lse_max if lse_max != -Float32.inf else Float32(0.0)
            total = Float32(0.0)
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                total += cute.math.exp2((mLSEacc[base + s, h, t] - ref) * LOG2_E, fastmath=True)
            total = cute.arch.warp_reduction_sum(total)
            if cutlass.const_expr(self.has_sinks):
                total += cute.math.exp2((mSinks[h] - ref) * LOG2_E, fastmath=True)
            lse = -Float32.inf
            if total > Float32(0.0):
                lse = ref + cute.math.log2(total, fastmath=True) * LN_2
            acc = cute.make_rmem_tensor(cute.make_layout(self.cols), Float32)
            acc.fill(0.0)
            if total > Float32(0.0):
                for s in cutlass.range(num_splits, unroll=1):
                    w = cute.math.exp2((mLSEacc[base + s, h, t] - lse) * LOG2_E, fastmath=True)
                    for j in cutlass.range_constexpr(self.cols):
                        acc[j] += w * mOacc[base + s, t, h, j * 32 + lane]
            for j in cutlass.range_constexpr(self.cols):
                mO[b, t, h, j * 32 + lane] = acc[j].to(self.dtype)
            if lane == 0:
                mLSE[b, h, t] = lse
