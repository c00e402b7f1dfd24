"""Attention over a KV cache for Hopper (``flash_attn_with_kvcache``): the forward of
``hopper/fwd.py`` with each batch's keys ``[leftpad, cache_seqlens)`` of its cache row, and the
keys optionally split over CTAs (split-KV).

Decoding reads the whole cache for one or a few query rows per head: with packed GQA a tile is one
KV head, so a batch of one has as many tiles as KV heads and most SMs would idle. Split-KV gives
each (tile, split) pair an equal share of the tile's key blocks; every split writes its O (fp32,
normalised by its own row sums) and LSE, and ``hopper/combine.py`` merges them with LSE weights.
The split count is a kernel argument chosen on the host from the shapes (never from the lengths
on the device), and each split's share is computed in the kernel from the actual length, so a
captured CUDA graph stays valid while ``cache_seqlens`` changes.

A cache slot past a sequence's end holds whatever the caller left there (stale keys, or never
written memory that may not even be a finite number): its scores are masked, and the V rows of
the one block that straddles the end are zeroed in shared memory before P V reads them (0 x NaN
would otherwise reach O).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash.device.block_info import BlockInfo
from cute_flash.device.seqlen import CacheSeqlenInfo
from cute_flash.device.tile_scheduler import TileScheduler
from cute_flash.hopper.fwd import BAR_EPILOGUE, FlashFwdSm90


class FlashFwdSm90KVCache(FlashFwdSm90):
    """``cfg.split``: the split-KV variant (fp32 partials out; otherwise O and LSE directly)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.split = cfg.split
        self.o_via_tma = not self.split

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mSeqUsedK: cute.Tensor, mCacheBatchIdx: cute.Tensor | None,
                 mLeftPad: cute.Tensor | None, softmax_scale: Float32, softcap: Float32, window_left: Int32,
                 window_right: Int32, num_splits: Int32, stream):
        """``mO`` / ``mLSE``: (B, N, H, d_v) / (B, H, N) in the output dtype, or with ``split`` the
        fp32 partials (B * num_splits, N, H, d_v) / (B * num_splits, H, N), batch-major."""
        extra = (mSeqUsedK, mCacheBatchIdx, mLeftPad, num_splits)
        # (The tile counter is never read: the grid is one CTA per tile.)
        self._launch(mQ, mK, mV, mO, mLSE, None, None, softmax_scale, softcap, window_left, window_right,
                     Int32(0), mSeqUsedK, extra, stream)

    def grid_batches(self, num_batch, extra: tuple):
        if cutlass.const_expr(self.split):
            return num_batch * extra[3]
        return num_batch

    @cute.jit
    def tile_work(self, mQ, mK, geo, tile_idx):
        masked = self.is_causal or self.is_local
        m_block, head, batch_split = TileScheduler.tile(geo.sched_params, tile_idx, masked, False)
        mSeqUsedK, mCacheBatchIdx, mLeftPad, num_splits = geo.extra
        batch, split = batch_split, Int32(0)
        if cutlass.const_expr(self.split):
            batch = batch_split // num_splits
            split = batch_split - batch * num_splits
        seqlen_q = mQ.shape[0][1] if cutlass.const_expr(self.pack > 1) else mQ.shape[0]
        seqlen = CacheSeqlenInfo(batch, seqlen_q, mSeqUsedK, mCacheBatchIdx, mLeftPad)
        seqlen.out_batch = batch_split
        block_info = BlockInfo(self.tile_m, self.tile_n, self.is_causal, self.is_local,
                               geo.window_left, geo.window_right, pack=self.pack)
        n_block_min, n_block_max = block_info.n_block_min_max(seqlen, m_block)
        if cutlass.const_expr(self.split):
            # An equal share of the visible blocks per split (none for the last ones when there are
            # fewer blocks than splits: they write O = 0, LSE = -inf, which the merge ignores).
            share = cute.ceil_div(cutlass.max(n_block_max - n_block_min, 0), num_splits)
            n_block_min = n_block_min + split * share
            n_block_max = cutlass.min(n_block_max, n_block_min + share)
        has_rows = m_block * self.tile_m < seqlen.seqlen_q * self.pack
        return m_block, head, batch, seqlen, block_info, has_rows, n_block_min, n_block_max

    @cute.jit
    def first_half(self, ctx, state, n_block: Int32, mask_right: cutlass.Constexpr[bool],
                   mask_left: cutlass.Constexpr[bool]):
        FlashFwdSm90.first_half(self, ctx, state, n_block, mask_right, mask_left)
        # The first block visited is the one that may straddle the sequence end.
        valid = ctx.seqlen.seqlen_k - n_block * self.tile_n
        if valid < self.tile_n:
            self.wait_full(ctx.pipe_v, state)
            sV = ctx.sV_stages[None, None, state.index]
            tail = (self.tile_n - valid) * self.hdim_v
            for i in cutlass.range(ctx.tidx, tail, self.num_mma_threads, unroll=1):
                sV[valid + i // self.hdim_v, i % self.hdim_v] = self.dtype(0.0)
            # Generic-proxy stores, read next by wgmma (async proxy): fence, then every consumer.
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_mma_threads)

    def extra_ctx(self, ctx, smem, wg) -> None:
        ctx.sV_stages = smem.sV

    @cute.jit
    def epilogue(self, ctx, mO, mLSE, tma_O, sO, tidx, head, batch):
        if cutlass.const_expr(not self.split):
            FlashFwdSm90.epilogue(self, ctx, mO, mLSE, tma_O, sO, tidx, head, batch)
        else:
            # fp32 partials straight from the accumulator (a few rows per tile when decoding).
            seqlen = ctx.seqlen
            rows_left = seqlen.seqlen_q * self.pack - ctx.m_block * self.tile_m
            out = seqlen.out_batch
            gLSE = cute.local_tile(seqlen.q_vec(mLSE, head, out), (self.tile_m,), (ctx.m_block,))
            ctx.softmax.store_lse(ctx.thr_pv, gLSE, self.tile_m, self.hdim_v, rows_left)
            gO = cute.local_tile(seqlen.q_rows(mO, head, out), (self.tile_m, self.hdim_v), (ctx.m_block, 0))
            # By (row, column) coordinate: a packed tile's rows ((pack, tokens)) need not split
            # along the MMA's row partition (6 heads x 32 tokens of a 192-row tile do not).
            coords = ctx.thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.hdim_v)))
            for i in cutlass.range_constexpr(cute.size(ctx.acc_O)):
                if coords[i][0] < rows_left:
                    gO[coords[i]] = ctx.acc_O[i]
