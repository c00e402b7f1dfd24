"""The KV-cache append in one launch (sm80 instructions: every family's host path runs it): the new
keys rotated and, with the values, written into the cache at ``cache_seqlens`` (of cache row
``cache_batch_idx[b]``, or of the pages ``page_table[b]`` lists), quantized with the descales for an
e4m3 cache; the queries rotated into a new tensor. Decoding appends one token of a few heads per
sequence, so the work is small and latency is what counts: one CTA per (token, batch, two heads),
one thread per channel pair (d <= 128: one step). Positions are read on the device, so the launch
captures into a CUDA graph. ``kv_append`` spells out the same math in torch ops (the reference).

Rotary: pair j < r / 2 is (2j, 2j + 1) (interleaved, GPT-J) or (j, j + r / 2) (halves, GPT-NeoX),
rotated in fp32 by the table's row at the token's position; the channels past r are copied.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash import jit

THREADS = 128
HEADS = 2  # per CTA


class AppendKV:
    def __init__(self, cfg) -> None:
        self.dtype = jit.DTYPES[cfg.dtype]
        self.fp8 = cfg.kv_dtype == "e4m3"
        self.rotary = bool(cfg.rotary)
        self.interleaved, self.per_token_q = cfg.interleaved, cfg.per_token_q
        self.paged, self.batch_idx = cfg.paged, cfg.batch_idx

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mQOut: cute.Tensor | None, mK: cute.Tensor, mV: cute.Tensor,
                 mKCache: cute.Tensor, mVCache: cute.Tensor, mSeqlens: cute.Tensor,
                 mBatchIdx: cute.Tensor | None, mPageTable: cute.Tensor | None, mCos: cute.Tensor | None,
                 mSin: cute.Tensor | None, mKDescale: cute.Tensor | None, mVDescale: cute.Tensor | None,
                 stream):
        """q (B, Nq, H, d) -> ``mQOut`` (rotary only); k / v (B, N_new, H_kv, d / dv) into the caches
        (B_cache, N, H_kv, d) or pages (num_pages, page_size, H_kv, d); cos / sin (seqlen_ro, r / 2);
        descales (B, H_kv) float32 with an e4m3 cache."""
        tokens, heads = mK.shape[1], mK.shape[2]
        if cutlass.const_expr(self.rotary):
            tokens, heads = cutlass.max(tokens, mQ.shape[1]), mQ.shape[2]
        self.kernel(mQ, mQOut, mK, mV, mKCache, mVCache, mSeqlens, mBatchIdx, mPageTable, mCos, mSin,
                    mKDescale, mVDescale).launch(grid=[tokens, mK.shape[0], cute.ceil_div(heads, HEADS)],
                                                 block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mQOut: cute.Tensor | None, mK: cute.Tensor, mV: cute.Tensor,
               mKCache: cute.Tensor, mVCache: cute.Tensor, mSeqlens: cute.Tensor,
               mBatchIdx: cute.Tensor | None, mPageTable: cute.Tensor | None, mCos: cute.Tensor | None,
               mSin: cute.Tensor | None, mKDescale: cute.Tensor | None, mVDescale: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        t, b, g = cute.arch.block_idx()
        base = mSeqlens[b]
        if cutlass.const_expr(self.rotary):
            if t < mQ.shape[1]:
                pos = base
                if cutlass.const_expr(self.per_token_q):
                    pos = base + t
                self.rotate_rows(mQ[b, t, None, None], mQOut[b, t, None, None], mCos, mSin, pos, None, g,
                                 tidx)
        if t < mK.shape[1] and g * HEADS < mK.shape[2]:
            slot = base + t
            row, col = b, slot
            if cutlass.const_expr(self.batch_idx):
                row = mBatchIdx[b]
            if cutlass.const_expr(self.paged):
                page_size = mKCache.shape[1]
                row, col = mPageTable[b, slot // page_size], slot % page_size
            k_scale, v_scale = self.inverse_descales(mKDescale, mVDescale, b)
            self.rotate_rows(mK[b, t, None, None], mKCache[row, col, None, None], mCos, mSin, slot, k_scale,
                             g, tidx)
            self.copy_rows(mV[b, t, None, None], mVCache[row, col, None, None], v_scale, g, tidx)

    def inverse_descales(self, mKDescale, mVDescale, b):
        """(H_kv,) descales the new keys / values are divided by before they are rounded to e4m3."""
        if cutlass.const_expr(not self.fp8):
            return None, None
        return mKDescale[b, None], mVDescale[b, None]

    @cute.jit
    def store(self, dst: cute.Tensor, h: Int32, c: Int32, x: Float32, scale: cute.Tensor | None):
        if cutlass.const_expr(scale is None or not self.fp8):
            dst[h, c] = x.to(dst.element_type)
        else:
            # Rounded to the tokens' dtype first (the rotary's output, as the reference), then
            # divided and rounded to e4m3 with saturation at +-448 (NaN stays NaN).
            y = x.to(self.dtype).to(Float32) / scale[h]
            dst[h, c] = y.to(dst.element_type)

    @cute.jit
    def rotate_rows(self, src: cute.Tensor, dst: cute.Tensor, mCos: cute.Tensor | None,
                    mSin: cute.Tensor | None, pos: Int32, scale: cute.Tensor | None, g: Int32, tidx: Int32):
        """Heads [g * HEADS, (g + 1) * HEADS) of one token's (heads, d) rows rotated at ``pos``
        (copied without rotary), one channel pair per thread and step."""
        half = src.shape[1] // 2
        r2 = Int32(0)
        if cutlass.const_expr(self.rotary):
            r2 = mCos.shape[1]
        count = cutlass.min(src.shape[0] - g * HEADS, HEADS) * half
        for i in cutlass.range(tidx, count, THREADS, unroll=1):
            h = g * HEADS + i // half
            j = i - (i // half) * half
            lo, hi = 2 * j, 2 * j + 1
            if cutlass.const_expr(not self.interleaved):
                if j < r2:
                    lo, hi = j, j + r2
            x, y = src[h, lo].to(Float32), src[h, hi].to(Float32)
            if cutlass.const_expr(self.rotary):
                if j < r2:
                    c, s = mCos[pos, j].to(Float32), mSin[pos, j].to(Float32)
                    x, y = x * c - y * s, x * s + y * c
            self.store(dst, h, lo, x, scale)
            self.store(dst, h, hi, y, scale)

    @cute.jit
    def copy_rows(self, src: cute.Tensor, dst: cute.Tensor, scale: cute.Tensor | None, g: Int32,
                  tidx: Int32):
        cols = src.shape[1]
        count = cutlass.min(src.shape[0] - g * HEADS, HEADS) * cols
        for i in cutlass.range(tidx, count, THREADS, unroll=1):
            h = g * HEADS + i // cols
            c = i - (i // cols) * cols
            self.store(dst, h, c, src[h, c].to(Float32), scale)
