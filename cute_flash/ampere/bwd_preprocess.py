"""Backward preprocess (sm80 instructions, any sm80+ GPU).

One CTA per (query block, head, batch), ``tile_m`` = the main kernel's query tile:

* ``D[i] = sum_d dO[i, d] * O[i, d]`` in fp32 (the softmax-Jacobian term of dS = P (dP - D)),
  minus ``dLSE[i]`` when the LSE output has a gradient: d LSE_i / d S_ij = P_ij, so that gradient
  adds P_ij dLSE_i to dS_ij, which is the same as lowering D_i by dLSE_i -- the main kernel then
  needs no change and no second pass (softcap and masks included, since they act on dS as a whole);
* ``LSE2[i] = LSE[i] * log2(e)`` so the main kernel recomputes P with one FFMA + ``ex2`` per
  score; a row that saw no key (LSE = -inf) gets +inf, which makes its P exactly 0 instead of
  exp2(-inf + inf) = NaN;
* the padding rows of the tile (past the sequence end) get D = 0 and LSE2 = +inf, so the main
  kernel loads whole tiles unpredicated and those rows contribute exact zeros;
* the tile's fp32 dQ accumulator chunk is zeroed (and, in deterministic mode, its semaphore),
  which saves a separate memset launch: the bytes written are the same;
* FP8 backward (``quantize_do``, sm89+): dO also goes out in e4m3, each (token, head) row at 448 /
  its amax, its descale amax / 448 beside D (0 on padding rows): dO is read once for both.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash import jit
from cute_flash.device import scratch, warp_mma
from cute_flash.device.seqlen import SeqlenInfo
from cute_flash.device.softmax import LOG2_E
from cute_flash.formats import E4M3_MAX


def pre_threads_per_row(hdim_v: int) -> int:
    """Threads sharing one O / dO row: 16-byte loads, 8 threads per 64 columns (4 per 32); a CTA
    of ``threads`` covers ``threads // this`` rows per pass, which must tile tile_m."""
    return (64 if hdim_v % 64 == 0 else 32) // 8


class FlashBwdPreSm80:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.num_threads = cfg.threads
        self.dtype = jit.DTYPES[cfg.dtype]
        self.hdim, self.hdim_v, self.tile_m = cfg.hdim, cfg.hdim_v, cfg.tile_m
        self.varlen, self.deterministic = cfg.varlen, cfg.deterministic
        # O/dO rows are read with 16-byte loads, 8 (or 4) threads per 64 (32) columns; a row's
        # partial dot products are then combined with shuffles inside those lanes.
        self.threads_per_row = pre_threads_per_row(self.hdim_v)
        assert self.tile_m * self.hdim % (4 * self.num_threads) == 0
        assert self.tile_m % (self.num_threads // self.threads_per_row) == 0

    @cute.jit
    def __call__(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor | None,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mSemaphore: cute.Tensor | None,
                 mdO8: cute.Tensor | None, mdODescale: cute.Tensor | None, mCuSeqlensQ: cute.Tensor | None,
                 max_seqlen_q: Int32, stream):
        """``mdO8`` (dO's shape, e4m3) and ``mdODescale`` (D's) with ``quantize_do``, else None."""
        mO, mdO = [warp_mma.to_seq_dim_head(t) for t in (mO, mdO)]
        mLSE, mLSE2, mD, mdQaccum = [warp_mma.lse_to_seq_head(t) for t in (mLSE, mLSE2, mD, mdQaccum)]
        if cutlass.const_expr(self.cfg.quantize_do):
            mdO8, mdODescale = warp_mma.to_seq_dim_head(mdO8), warp_mma.lse_to_seq_head(mdODescale)
        if cutlass.const_expr(mdLSE is not None):
            mdLSE = warp_mma.lse_to_seq_head(mdLSE)
        if cutlass.const_expr(mSemaphore is not None):
            mSemaphore = warp_mma.lse_to_seq_head(mSemaphore)
        if cutlass.const_expr(self.varlen):
            num_batch = mCuSeqlensQ.shape[0] - 1
            seqlen_q = max_seqlen_q
        else:
            num_batch = mO.shape[3]
            seqlen_q = mO.shape[0]
        grid = (cute.ceil_div(seqlen_q, self.tile_m), mO.shape[2], num_batch)
        self.kernel(mO, mdO, mLSE, mdLSE, mLSE2, mD, mdQaccum, mSemaphore, mdO8, mdODescale,
                    mCuSeqlensQ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO: cute.Tensor, mdO: cute.Tensor, mLSE: cute.Tensor, mdLSE: cute.Tensor | None,
               mLSE2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mSemaphore: cute.Tensor | None,
               mdO8: cute.Tensor | None, mdODescale: cute.Tensor | None, mCuSeqlensQ: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.cfg.launch_dependents):
            # The main kernel waits (griddepcontrol.wait) before it reads anything written here.
            cute.arch.griddepcontrol_launch_dependents()
        seqlen = SeqlenInfo(batch, mO.shape[0], mO.shape[0], mCuSeqlensQ, None)
        # Varlen grids are sized by the longest sequence; blocks past this one's end own no rows.
        if m_block * self.tile_m < seqlen.seqlen_q:
            rdO = self.rowsum_dO_O(mO, mdO, mLSE, mdLSE, mLSE2, mD, seqlen, tidx, m_block, head, batch)
            if cutlass.const_expr(self.cfg.quantize_do):
                self.quantize_dO(rdO, mdO8, mdODescale, seqlen, tidx, m_block, head, batch)
            self.clear_accumulators(mdQaccum, mSemaphore, seqlen, tidx, m_block, head, batch)

    @cute.jit
    def rowsum_dO_O(self, mO, mdO, mLSE, mdLSE, mLSE2, mD, seqlen: SeqlenInfo, tidx, m_block, head, batch):
        tile = (self.tile_m, self.hdim_v)
        # Built inside the kernel: copy atoms are compile-time objects and cost nothing.
        self.copy_O = warp_mma.r2g_tiled_copy(self.dtype, self.hdim_v, self.num_threads)
        gO = cute.local_tile(seqlen.q_rows(mO, head, batch), tile, (m_block, 0))
        gdO = cute.local_tile(seqlen.q_rows(mdO, head, batch), tile, (m_block, 0))
        thr = self.copy_O.get_slice(tidx)
        tOgO, tOgdO = thr.partition_S(gO), thr.partition_S(gdO)
        tOcO = thr.partition_S(cute.make_identity_tensor(tile))
        rO = cute.make_rmem_tensor_like(tOgO, self.dtype)
        rdO = cute.make_rmem_tensor_like(tOgdO, self.dtype)
        rO.fill(0.0)
        rdO.fill(0.0)
        rows_left = seqlen.seqlen_q - m_block * self.tile_m
        # (CPY, rows, col chunks): load only rows inside the sequence; padding rows stay 0.
        for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            if tOcO[0, m, 0][0] < rows_left:
                cute.copy(self.copy_O, tOgO[None, m, None], rO[None, m, None])
                cute.copy(self.copy_O, tOgdO[None, m, None], rdO[None, m, None])

        gLSE = cute.local_tile(seqlen.q_vec(mLSE, head, batch), (self.tile_m,), (m_block,))
        gLSE2 = cute.local_tile(scratch.scratch_rows(mLSE2, seqlen, head, batch, self.tile_m),
                                (self.tile_m,), (m_block,))
        gD = cute.local_tile(scratch.scratch_rows(mD, seqlen, head, batch, self.tile_m),
                             (self.tile_m,), (m_block,))
        # LSE2: one row per thread, issued beside the O / dO loads -- coalesced, and one memory
        # round trip instead of one per row of the row owners (their load -> store pairs could not
        # be reordered: LSE2 might alias LSE as far as the compiler knows).
        for r in cutlass.range_constexpr(cute.ceil_div(self.tile_m, self.num_threads)):
            row = tidx + r * self.num_threads
            if row < self.tile_m:
                lse2 = Float32.inf
                if row < rows_left:
                    lse = gLSE[row]
                    if lse != -Float32.inf:
                        lse2 = lse * Float32(LOG2_E)
                gLSE2[row] = lse2
        # All row sums first (the shuffles need the whole warp), then the writes, which only the
        # first lane of each row's group does: keeping the divergent stores out of the
        # reduction keeps ptxas from carrying partial sums across branches.
        num_rows = cute.size(tOgO, mode=[1])
        dots = cute.make_rmem_tensor(num_rows, Float32)
        for m in cutlass.range_constexpr(num_rows):
            prod = rO[None, m, None].load().to(Float32) * rdO[None, m, None].load().to(Float32)
            dot = prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
            dots[m] = cute.arch.warp_reduction(dot, lambda a, b: a + b, threads_in_group=self.threads_per_row)
        gdLSE = None
        if cutlass.const_expr(mdLSE is not None):
            gdLSE = cute.local_tile(seqlen.q_vec(mdLSE, head, batch), (self.tile_m,), (m_block,))
        if tOcO[0, 0, 0][1] == 0:
            for m in cutlass.range_constexpr(num_rows):
                row = tOcO[0, m, 0][0]
                d = dots[m]  # 0 on padding rows (their O/dO were never loaded)
                if cutlass.const_expr(gdLSE is not None):
                    if row < rows_left:
                        d = d - gdLSE[row]
                gD[row] = d
        return rdO

    @cute.jit
    def quantize_dO(self, rdO, mdO8, mDescale, seqlen: SeqlenInfo, tidx, m_block, head, batch):
        """The loaded dO rows (zeros past the sequence) in e4m3 at 448 / each row's amax, as
        ``reference_fp8_bwd.quantize_rows``: a floor of 1e-30; all-zero rows get codes and
        descale 0."""
        tile = (self.tile_m, self.hdim_v)
        copy8 = warp_mma.r2g_narrow_tiled_copy(cutlass.Float8E4M3FN, self.dtype, self.hdim_v,
                                               self.num_threads)
        thr = copy8.get_slice(tidx)
        tgdO8 = thr.partition_D(cute.local_tile(seqlen.q_rows(mdO8, head, batch), tile, (m_block, 0)))
        tc = thr.partition_D(cute.make_identity_tensor(tile))
        gDescale = cute.local_tile(scratch.scratch_rows(mDescale, seqlen, head, batch, self.tile_m),
                                   (self.tile_m,), (m_block,))
        rows_left = seqlen.seqlen_q - m_block * self.tile_m
        num_rows = cute.size(tgdO8, mode=[1])
        tops = cute.make_rmem_tensor(num_rows, Float32)
        for m in cutlass.range_constexpr(num_rows):
            x = cute.make_rmem_tensor_like(rdO[None, m, None], Float32)
            x.store(rdO[None, m, None].load().to(Float32))
            amax = Float32(0.0)
            for j in cutlass.range_constexpr(cute.size(x)):
                amax = cute.arch.fmax(amax, cute.arch.fmax(x[j], -x[j]))
            amax = cute.arch.warp_reduction(amax, lambda a, b: cute.arch.fmax(a, b),
                                            threads_in_group=self.threads_per_row)
            tops[m] = amax
            top = cute.arch.fmax(amax, Float32(1e-30))
            q8 = cute.make_rmem_tensor_like(tgdO8[None, m, None], cutlass.Float8E4M3FN)
            q8.store((x.load() * (Float32(E4M3_MAX) / top)).to(cutlass.Float8E4M3FN))
            if tc[0, m, 0][0] < rows_left:
                cute.copy(copy8, q8, tgdO8[None, m, None])
        if tc[0, 0, 0][1] == 0:
            for m in cutlass.range_constexpr(num_rows):
                kept = cutlass.select_(tops[m] > Float32(0.0), cute.arch.fmax(tops[m], Float32(1e-30)),
                                       Float32(0.0))
                gDescale[tc[0, m, 0][0]] = kept / Float32(E4M3_MAX)

    @cute.jit
    def clear_accumulators(self, mdQaccum, mSemaphore, seqlen: SeqlenInfo, tidx, m_block, head, batch):
        gdQ = scratch.dq_accum_block(mdQaccum, seqlen, head, batch, m_block, self.tile_m, self.hdim)
        copy = scratch.tiled_copy_1d(Float32, self.num_threads, 4)
        # (4 floats per 16-byte store, stores per thread)
        tdQ = copy.get_slice(tidx).partition_D(gdQ)
        zero = cute.make_rmem_tensor_like(tdQ, Float32)
        zero.fill(0.0)
        cute.copy(copy, zero, tdQ)
        if cutlass.const_expr(self.deterministic):
            if tidx == 0:
                idx = scratch.semaphore_index(seqlen, batch, m_block, self.tile_m)
                if cutlass.const_expr(seqlen.varlen_q):
                    mSemaphore[idx, head] = Int32(0)
                else:
                    mSemaphore[idx, head, batch] = Int32(0)
