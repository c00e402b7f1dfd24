"""sm90 backward postprocess: dQ = softmax_scale * dQaccum, converted to the input dtype.

The main kernels' dQ writer warp (``hopper/bwd_dq.py``) adds dQ into fp32 accumulator chunks in the
dQ MMA's fragment order (16-byte vectors per thread, whole 128-byte lines per warp); this kernel
reads a chunk back through the same MMA partition and writes dQ through a swizzled smem tile
(stmatrix in, 16-byte row stores out).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from cute_flash import jit
from cute_flash.device import scratch, warp_mma
from cute_flash.device.layout import transpose_smem
from cute_flash.device.seqlen import SeqlenInfo
from cute_flash.hopper.bwd_dq import NUM_MMA_THREADS, dq_acc_shape, dq_swapab, dq_tiled_mma


class FlashBwdPostSm90:
    """dQ = softmax_scale * dQaccum in the input dtype, from the accumulator chunks the sm90 main
    kernel writes in its dQ MMA's fragment order (one CTA per query block, 256 threads: thread t
    reads the elements of the main kernel's consumer thread t, 16 bytes at a time)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.dtype = jit.DTYPES[cfg.dtype]
        self.hdim, self.tile_m = cfg.hdim, cfg.tile_m

    def smem_layout(self):
        # The dQ MMA splits the head dim over the warpgroups: at d = 96 / 192 a 128-byte swizzle
        # atom (64 columns) would straddle the halves the stmatrix copy partitions.
        cols = self.hdim if self.hdim % 128 == 0 else self.hdim // 2
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, cols), self.dtype)
        return cute.tile_to_shape(atom, (self.tile_m, self.hdim), (0, 1))

    def smem_bytes(self) -> int:
        return self.tile_m * self.hdim * self.dtype.width // 8 + 1024

    @cute.jit
    def __call__(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor | None,
                 softmax_scale: Float32, max_seqlen_q: Int32, stream):
        """The sm80 postprocess's signature."""
        mdQaccum = warp_mma.lse_to_seq_head(mdQaccum)
        mdQ = warp_mma.to_seq_dim_head(mdQ)
        num_batch, seqlen_q = warp_mma.grid_rows(mdQ, mCuSeqlensQ, max_seqlen_q)
        grid = (cute.ceil_div(seqlen_q, self.tile_m), mdQ.shape[2], num_batch)
        self.kernel(mdQaccum, mdQ, mCuSeqlensQ, softmax_scale).launch(
            grid=grid, block=[NUM_MMA_THREADS, 1, 1], smem=self.smem_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor | None,
               softmax_scale: Float32):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen = SeqlenInfo(batch, mdQ.shape[0], mdQ.shape[0], mCuSeqlensQ, None)
        # Varlen grids are sized by the longest sequence: a shorter one's padded scratch holds
        # only its own tiles, so blocks past its end must not read (the last one's lie past the
        # accumulator's end).
        if m_block * self.tile_m < seqlen.seqlen_q:
            self.convert_tile(mdQaccum, mdQ, seqlen, softmax_scale, tidx, m_block, head, batch)

    @cute.jit
    def convert_tile(self, mdQaccum: cute.Tensor, mdQ: cute.Tensor, seqlen: SeqlenInfo,
                     softmax_scale: Float32, tidx: Int32, m_block: Int32, head: Int32, batch: Int32):
        gacc = scratch.dq_accum_block(mdQaccum, seqlen, head, batch, m_block, self.tile_m, self.hdim)
        gdQ = cute.local_tile(seqlen.q_rows(mdQ, head, batch), (self.tile_m, self.hdim), (m_block, 0))
        rows_left = seqlen.seqlen_q - m_block * self.tile_m
        view = scratch.frag_chunk_view(gacc, tidx, NUM_MMA_THREADS)
        acc = cute.make_rmem_tensor(cute.size(view), Float32)
        for j in cutlass.range_constexpr(cute.size(view, mode=[1])):
            cute.autovec_copy(view[None, j], cute.make_tensor(acc.iterator + 4 * j, cute.make_layout(4)))
        self.store_staged(acc, gdQ, rows_left, softmax_scale, tidx)

    @cute.jit
    def store_staged(self, acc, gdQ, rows_left: Int32, softmax_scale: Float32, tidx: Int32):
        layout = self.smem_layout()
        sdQ = SmemAllocator().allocate_tensor(self.dtype, layout.outer, 1024, swizzle=layout.inner)
        mma = dq_tiled_mma(self.dtype, self.tile_m, self.hdim)
        # ``acc`` is this thread's dQ fragment in the MMA's register order (flat index i = the
        # main kernel's acc_dQ[i]): refill it as a C fragment of that MMA, in 16 bits.
        shape = dq_acc_shape(self.tile_m, self.hdim)
        frag = cute.make_rmem_tensor(mma.get_slice(tidx).partition_shape_C(shape), self.dtype)
        for i in cutlass.range_constexpr(cute.size(acc)):
            frag[i] = (acc[i] * softmax_scale).to(self.dtype)
        if cutlass.const_expr(dq_swapab(self.tile_m)):
            # (head dim, query) fragment into the (query, head dim) tile: transposing 8x8 tiles,
            # two per instruction (80 queries are not a multiple of the four-tile 32).
            store_op = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=2),
                                           self.dtype)
            sdst = transpose_smem(sdQ)
        else:
            store_op = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32)
            sdst = sdQ
        r2s = cute.make_tiled_copy_C(store_op, mma).get_slice(tidx)
        cute.copy(r2s, r2s.retile(frag), r2s.partition_D(sdst))
        cute.arch.barrier()
        # 256 threads over 64 columns make 32-row passes, and an 80-row tile's last one would
        # read and store past the tile; whole rows per row of threads (16-row passes at d = 128).
        chunk = 0 if self.tile_m % 32 == 0 else self.hdim
        assert not chunk or self.tile_m % (NUM_MMA_THREADS * (128 // self.dtype.width) // chunk) == 0
        copy = warp_mma.r2g_tiled_copy(self.dtype, self.hdim, NUM_MMA_THREADS, chunk)
        warp_mma.store_rows(copy, copy.get_slice(tidx), sdQ, gdQ, self.tile_m, self.hdim, rows_left)
