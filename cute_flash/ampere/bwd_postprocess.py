"""Backward postprocess (sm80 instructions, any sm80+ GPU): dQ = softmax_scale * dQaccum in the
input dtype.

The accumulator chunk of a query block is stored in the main kernel's dQ MMA fragment order
(element ``i`` of thread ``t`` at ``i * num_threads + t``), so this kernel runs the same number of
threads and rebuilds the same tiled MMA: thread ``t`` reads its elements with coalesced loads,
and the MMA's C layout says which (row, col) each one is. The tile then goes registers -> swizzled
smem -> 16-byte row stores, like the forward's O epilogue.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.memory import SmemAllocator

from cute_flash import jit
from cute_flash.device import scratch, warp_mma
from cute_flash.device.seqlen import SeqlenInfo

from .bwd import make_tiled_mmas


class FlashBwdPostSm80:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.dtype = jit.DTYPES[cfg.dtype]
        self.hdim = cfg.hdim
        self.tiles = cfg.tiles
        self.tile_m, self.num_threads = cfg.tiles.tile_m, cfg.tiles.num_threads
        self.varlen = cfg.varlen

    def _storage(self, sdQ_layout):
        @cute.struct
        class Storage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdQ_layout)], 1024]

        return Storage

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor | None,
                 softmax_scale: Float32, max_seqlen_q: Int32, stream):
        mdQaccum = warp_mma.lse_to_seq_head(mdQaccum)
        mdQ = warp_mma.to_seq_dim_head(mdQ)
        if cutlass.const_expr(self.varlen):
            num_batch = mCuSeqlensQ.shape[0] - 1
            seqlen_q = max_seqlen_q
        else:
            num_batch = mdQ.shape[3]
            seqlen_q = mdQ.shape[0]
        Storage = self._storage(warp_mma.smem_tile(self.dtype, self.tile_m, self.hdim))
        grid = (cute.ceil_div(seqlen_q, self.tile_m), mdQ.shape[2], num_batch)
        self.kernel(mdQaccum, mdQ, mCuSeqlensQ, softmax_scale, Storage).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor | None,
               softmax_scale: Float32, Storage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen = SeqlenInfo(batch, mdQ.shape[0], mdQ.shape[0], mCuSeqlensQ, None)
        if m_block * self.tile_m < seqlen.seqlen_q:
            self.convert_tile(mdQaccum, mdQ, seqlen, softmax_scale, Storage, tidx, m_block, head, batch)

    @cute.jit
    def convert_tile(self, mdQaccum, mdQ, seqlen: SeqlenInfo, softmax_scale, Storage: cutlass.Constexpr,
                     tidx, m_block, head, batch):
        _, _, mma_dq = make_tiled_mmas(self.dtype, self.tiles)
        thr_mma = mma_dq.get_slice(tidx)
        splits = self.tiles.dq_splits
        cols = self.hdim // splits
        gacc = scratch.dq_accum_block(mdQaccum, seqlen, head, batch, m_block, self.tile_m, self.hdim)
        sdQ_layout = warp_mma.smem_tile(self.dtype, self.tile_m, self.hdim)
        sdQ = SmemAllocator().allocate(Storage).sdQ.get_tensor(sdQ_layout)
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype),
                                     mma_dq).get_slice(tidx)
        for c in cutlass.range_constexpr(splits):
            # Split c of the main kernel's dQ GEMM: columns [c * cols, (c+1) * cols), stored at
            # c * tile_m * cols + i * num_threads + tidx (coalesced: a warp reads 128 B per load).
            acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, cols)), Float32)
            src = cute.make_tensor(gacc.iterator + (c * self.tile_m * cols + tidx),
                                   cute.make_layout(cute.size(acc), stride=self.num_threads))
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = src[i]
            rdQ = cute.make_rmem_tensor_like(acc, self.dtype)
            rdQ.store((acc.load() * softmax_scale).to(self.dtype))
            sdQ_c = sdQ
            if cutlass.const_expr(splits > 1):
                sdQ_c = cute.local_tile(sdQ, (self.tile_m, cols), (0, c))
            cute.copy(r2s, r2s.retile(rdQ), r2s.partition_D(sdQ_c))
        cute.arch.barrier()
        gdQ = cute.local_tile(seqlen.q_rows(mdQ, head, batch), (self.tile_m, self.hdim), (m_block, 0))
        copy_dQ = warp_mma.r2g_tiled_copy(self.dtype, self.hdim, self.num_threads)
        warp_mma.store_rows(copy_dQ, copy_dQ.get_slice(tidx), sdQ, gdQ, self.tile_m, self.hdim,
                            seqlen.seqlen_q - m_block * self.tile_m)
