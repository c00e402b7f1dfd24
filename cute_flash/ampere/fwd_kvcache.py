"""Attention over a KV cache with the sm80 forward (``ampere/fwd.py``; any sm80+ GPU): each batch's
keys are ``[leftpad, seqused)`` of its cache row, and the key blocks are optionally split over
CTAs (split-KV), as in ``hopper/fwd_kvcache.py``: every split writes its fp32 O (normalised by
its own row sums) and LSE, and ``ampere/combine.py`` merges them. The grid is (query tiles,
heads, batches x splits); the split count comes from the host, each split's share of blocks from
the lengths on the device, so a captured CUDA graph stays valid while ``cache_seqlens`` changes.
With packed GQA (``pack_gqa``) a tile holds a KV head's whole query group, as on Hopper.

A paged cache (num_pages, page_size, H_kv, d) is read in place with cp.async, each thread looking
up the page of every row it copies (``device/paged_rows.py``): any page size works, one key per
page included. This is also the paged path on Hopper for page sizes its TMA boxes do not take.

Cache slots past a sequence's end may hold anything: cp.async skips those rows, K's are masked
and V's zero-filled (the sm80 forward's partial-block handling), so neither stale nor NaN data
reaches O.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash.ampere.fwd import FlashFwdSm80
from cute_flash.device import warp_mma
from cute_flash.device.layout import pack_heads
from cute_flash.device.paged_rows import load_paged_block
from cute_flash.device.seqlen import CacheSeqlenInfo
from cute_flash.device.softmax import score_scales
from cute_flash.device.split_kv import split_block_range, store_partial_o


class FlashFwdSm80KVCache(FlashFwdSm80):
    """``cfg.split``: the split-KV variant (fp32 partials out; otherwise O and LSE directly)."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.split = cfg.split
        self.page_size = cfg.page_size
        self.pack = cfg.pack_gqa

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mSeqUsedK: cute.Tensor, mCacheBatchIdx: cute.Tensor | None,
                 mLeftPad: cute.Tensor | None, mPageTable: cute.Tensor | None, mKDescale: cute.Tensor | None,
                 mVDescale: cute.Tensor | None, softmax_scale: Float32, softcap: Float32, window_left: Int32,
                 window_right: Int32, num_splits: Int32, mSinks: cute.Tensor | None, stream):
        """The KV-cache signature of every family; paged: ``mK`` / ``mV`` (num_pages, page_size, H_kv,
        d) and ``mPageTable`` (B, max_pages). The descales are None (16-bit caches only here);
        ``mSinks`` (H,) sink logits with an unsplit config, else None."""
        self._setup()
        Storage = self._storage()
        mQ, mK, mV, mO, mLSE = warp_mma.forward_views(mQ, mK, mV, mO, mLSE)
        score_scale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap)
        rows = mQ.shape[0]
        if cutlass.const_expr(self.pack > 1):
            # Packed GQA: a KV head's query group shares the M tile, so a decoding tile holds
            # pack useful rows instead of one and reads each K / V block once for the group.
            mQ, mO = pack_heads(mQ, self.pack, head_mode=2), pack_heads(mO, self.pack, head_mode=2)
            mLSE = pack_heads(mLSE, self.pack, head_mode=1)
            rows = rows * self.pack
        grid = (cute.ceil_div(rows, self.tile_m), mQ.shape[2], mQ.shape[3] * num_splits)
        self.kv_kernel(mQ, mK, mV, mO, mLSE, mSeqUsedK, mCacheBatchIdx, mLeftPad, mPageTable, score_scale,
                       scale_log2, window_left, window_right, num_splits, mSinks, Storage).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kv_kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                  mSeqUsedK: cute.Tensor, mCacheBatchIdx: cute.Tensor | None, mLeftPad: cute.Tensor | None,
                  mPageTable: cute.Tensor | None, score_scale: Float32, scale_log2: Float32,
                  window_left: Int32, window_right: Int32, num_splits: Int32, mSinks: cute.Tensor | None,
                  Storage: cutlass.Constexpr):
        self._setup()
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch_split = cute.arch.block_idx()
        batch, split = batch_split, Int32(0)
        if cutlass.const_expr(self.split):
            batch = batch_split // num_splits
            split = batch_split - batch * num_splits
        seqlen_q = mQ.shape[0][1] if cutlass.const_expr(self.pack > 1) else mQ.shape[0]
        seqlen = CacheSeqlenInfo(batch, seqlen_q, mSeqUsedK, mCacheBatchIdx, mLeftPad)
        seqlen.out_batch, seqlen.split, seqlen.num_splits = batch_split, split, num_splits
        if cutlass.const_expr(self.page_size):
            # One KV head of the page pools, (page_size, d, num_pages), and this sequence's pages.
            head_kv = head // (mQ.shape[2] // mK.shape[2])
            seqlen.k_pool, seqlen.v_pool = mK[None, None, head_kv, None], mV[None, None, head_kv, None]
            seqlen.pages = mPageTable[batch, None]
        self.attend_tile(mQ, mK, mV, mO, mLSE, seqlen, score_scale, scale_log2, window_left, window_right,
                         Storage, tidx, m_block, head, batch, mSinks, ())

    def block_range(self, block_info, seqlen, m_block):
        n_block_min, n_block_max = block_info.n_block_min_max(seqlen, m_block)
        if cutlass.const_expr(self.split):
            return split_block_range(n_block_min, n_block_max, seqlen.split, seqlen.num_splits)
        return n_block_min, n_block_max

    @cute.jit
    def load_K(self, ctx, n_block: Int32, stage: Int32, partial: cutlass.Constexpr[bool]):
        if cutlass.const_expr(not self.page_size):
            FlashFwdSm80.load_K(self, ctx, n_block, stage, partial)
        else:
            seqlen = ctx.seqlen
            load_paged_block(self.copy_QK, seqlen.k_pool, seqlen.pages, ctx.tKsK[None, None, None, stage],
                             ctx.tKcK, n_block, self.tile_n, self.page_size,
                             seqlen.seqlen_k - n_block * self.tile_n, partial, zero_fill=False)

    @cute.jit
    def load_V(self, ctx, n_block: Int32, stage: Int32, partial: cutlass.Constexpr[bool]):
        if cutlass.const_expr(not self.page_size):
            FlashFwdSm80.load_V(self, ctx, n_block, stage, partial)
        else:
            seqlen = ctx.seqlen
            load_paged_block(self.copy_V, seqlen.v_pool, seqlen.pages, ctx.tVsV[None, None, None, stage],
                             ctx.tVcV, n_block, self.tile_n, self.page_size,
                             seqlen.seqlen_k - n_block * self.tile_n, partial, zero_fill=True)

    @cute.jit
    def epilogue(self, ctx, mO, mLSE, sQ, tidx, head, batch):
        if cutlass.const_expr(not self.split):
            FlashFwdSm80.epilogue(self, ctx, mO, mLSE, sQ, tidx, head, batch)
        else:
            # fp32 partials straight from the accumulator (a few rows per tile when decoding).
            seqlen = ctx.seqlen
            rows_left = seqlen.seqlen_q * self.pack - ctx.m_block * self.tile_m
            out = seqlen.out_batch
            gLSE = cute.local_tile(seqlen.q_vec(mLSE, head, out), (self.tile_m,), (ctx.m_block,))
            ctx.softmax.store_lse(ctx.thr_mma, gLSE, self.tile_m, self.hdim_v, rows_left)
            gO = cute.local_tile(seqlen.q_rows(mO, head, out), (self.tile_m, self.hdim_v), (ctx.m_block, 0))
            store_partial_o(ctx.thr_mma, ctx.acc_O, gO, self.tile_m, self.hdim_v, rows_left)
            # A split that visited no block never waited for its Q load: drain it before exiting.
            cute.arch.cp_async_wait_group(0)
