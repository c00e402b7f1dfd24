"""Attention over a KV cache for Hopper (``flash_attn_with_kvcache``): the forward of
``hopper/fwd.py`` with each batch's keys ``[leftpad, cache_seqlens)`` of its cache row, and the
keys optionally split over CTAs (split-KV).

Decoding reads the whole cache for one or a few query rows per head: with packed GQA a tile is one
KV head, so a batch of one has as many tiles as KV heads and most SMs would idle. Split-KV gives
each (tile, split) pair an equal share of the tile's key blocks; every split writes its O (fp32,
normalised by its own row sums) and LSE, and ``ampere/combine.py`` merges them with LSE weights.
The split count is a kernel argument chosen on the host from the shapes (never from the lengths
on the device), and each split's share is computed in the kernel from the actual length, so a
captured CUDA graph stays valid while ``cache_seqlens`` changes.

A paged cache (num_pages, page_size, H_kv, d) is read in place: the TMA descriptors are built on
the page pool, and each K / V block is ``tile_n / page_box`` boxes (whole pages, or the part of a
page the block covers), each box at the page the page table gives for its first key.

A cache slot past a sequence's end holds whatever the caller left there (stale keys, or never
written memory that may not even be a finite number): its scores are masked, and the V rows of
the one block that straddles the end are zeroed in shared memory before P V reads them (0 x NaN
would otherwise reach O).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from cute_flash.device.block_info import BlockInfo
from cute_flash.device.seqlen import CacheSeqlenInfo
from cute_flash.device.split_kv import split_block_range, store_partial_o
from cute_flash.device.tile_scheduler import TileScheduler
from cute_flash.hopper.fwd import BAR_EPILOGUE, FlashFwdSm90


class FlashFwdSm90KVCache(FlashFwdSm90):
    """``cfg.split``: the split-KV variant (fp32 partials out; otherwise O and LSE directly)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.split = cfg.split
        self.o_via_tma = not self.split
        self.page_size, self.page_box = cfg.page_size, cfg.page_box

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mSeqUsedK: cute.Tensor, mCacheBatchIdx: cute.Tensor | None,
                 mLeftPad: cute.Tensor | None, mPageTable: cute.Tensor | None, mKDescale: cute.Tensor | None,
                 mVDescale: cute.Tensor | None, softmax_scale: Float32, softcap: Float32, window_left: Int32,
                 window_right: Int32, num_splits: Int32, mSinks: cute.Tensor | None, stream):
        """``mO`` / ``mLSE``: (B, N, H, d_v) / (B, H, N) in the output dtype, or with ``split`` the
        fp32 partials (B * num_splits, N, H, d_v) / (B * num_splits, H, N), batch-major. Paged:
        ``mK`` / ``mV`` (num_pages, page_size, H_kv, d) and ``mPageTable`` (B, max_pages). An e4m3
        cache comes with fp32 (B, H_kv) descales (else None). ``mSinks``: (H,) sink logits (unsplit
        only; split, the merge adds them), or None."""
        extra = (mSeqUsedK, mCacheBatchIdx, mLeftPad, num_splits, mPageTable, mKDescale, mVDescale)
        # (The tile counter is never read: the grid is one CTA per tile.)
        self._launch(mQ, mK, mV, mO, mLSE, None, None, softmax_scale, softcap, window_left, window_right,
                     Int32(0), mSeqUsedK, extra, stream, mSinks)

    def k_box(self) -> tuple:
        return (self.page_box, self.hdim)

    def v_box(self) -> tuple:
        return (self.page_box, self.hdim_v)

    def kv_box_layout(self, s_layout, cols: int):
        if cutlass.const_expr(self.page_size == 0):
            return FlashFwdSm90.kv_box_layout(self, s_layout, cols)
        return self._smem(self.page_box, cols, None)

    def grid_batches(self, num_batch, extra: tuple):
        if cutlass.const_expr(self.split):
            return num_batch * extra[3]
        return num_batch

    @cute.jit
    def tile_work(self, mQ, mK, geo, tile_idx):
        masked = self.is_causal or self.is_local
        m_block, head, batch_split = TileScheduler.tile(geo.sched_params, tile_idx, masked, False)
        mSeqUsedK, mCacheBatchIdx, mLeftPad, num_splits, mPageTable = geo.extra[:5]
        batch, split = batch_split, Int32(0)
        if cutlass.const_expr(self.split):
            batch = batch_split // num_splits
            split = batch_split - batch * num_splits
        seqlen_q = mQ.shape[0][1] if cutlass.const_expr(self.pack > 1) else mQ.shape[0]
        seqlen = CacheSeqlenInfo(batch, seqlen_q, mSeqUsedK, mCacheBatchIdx, mLeftPad)
        seqlen.out_batch = batch_split
        seqlen.page_table = mPageTable
        block_info = BlockInfo(self.tile_m, self.tile_n, self.is_causal, self.is_local,
                               geo.window_left, geo.window_right, pack=self.pack)
        n_block_min, n_block_max = block_info.n_block_min_max(seqlen, m_block)
        if cutlass.const_expr(self.split):
            n_block_min, n_block_max = split_block_range(n_block_min, n_block_max, split, num_splits)
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
            store_partial_o(ctx.thr_pv, ctx.acc_O, gO, self.tile_m, self.hdim_v, rows_left)

    # ------------------------------------------------------------------------------------------
    # Paged cache: every K / V block is whole pages or part of one, each box at its page
    # ------------------------------------------------------------------------------------------
    def kv_sources(self, mK, mV, tma_K, tma_V, smem, pipes, seqlen, head_kv, batch):
        if cutlass.const_expr(self.page_size == 0):
            return FlashFwdSm90.kv_sources(self, mK, mV, tma_K, tma_V, smem, pipes, seqlen, head_kv, batch)
        return ((tma_K, mK, smem.sK, self.hdim, pipes.k, head_kv, batch, seqlen),
                (tma_V, mV, smem.sV, self.hdim_v, pipes.v, head_kv, batch, seqlen))

    @cute.jit
    def load_kv(self, src, state, n_block: Int32):
        if cutlass.const_expr(self.page_size == 0):
            FlashFwdSm90.load_kv(self, src, state, n_block)
        else:
            self.load_pages(src, state, n_block)

    @cute.jit
    def load_pages(self, src, state, n_block: Int32):
        """Block ``n_block`` of K or V into its stage: ``tile_n / page_box`` boxes, each from the page
        the page table gives for its first key. Boxes past the sequence end read its last page
        again (table entries past it may hold anything; those keys are masked, their V rows
        zeroed in ``first_half``), so the stage's transaction count always completes."""
        tma, mX, sX, cols, pipe, head_kv, batch, seqlen = src
        n_boxes = self.tile_n // self.page_box
        # Lane j looks up box j's page (one load latency for the block, one register per lane);
        # the copies below take it with a shuffle.
        lane_key = n_block * self.tile_n + (cute.arch.lane_idx() % n_boxes) * self.page_box
        lane_key = cutlass.min(lane_key, cutlass.max(seqlen.seqlen_k - 1, 0))
        last_page = seqlen.page_table.shape[1] - 1
        lane_page = seqlen.page_table[batch, cutlass.min(lane_key // self.page_size, last_page)]
        self.acquire_empty(pipe, state)
        boxes = cute.flat_divide(sX, (self.page_box, cols))  # (box, cols, tile_n / box, 1, stages)
        for j in cutlass.range_constexpr(n_boxes):
            key = n_block * self.tile_n + j * self.page_box
            page = cute.arch.shuffle_sync(lane_page, j)
            gX = cute.local_tile(mX[None, None, head_kv, page], (self.page_box, cols), (None, 0))
            tXsX, tXgX = cpasync.tma_partition(tma, 0, cute.make_layout(1),
                                               cute.group_modes(boxes[None, None, j, 0, None], 0, 2),
                                               cute.group_modes(gX, 0, 2))
            cute.copy(tma, tXgX[None, (key % self.page_size) // self.page_box], tXsX[None, state.index],
                      tma_bar_ptr=pipe.producer_get_barrier(state))
