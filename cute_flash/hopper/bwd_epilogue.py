"""The dK / dV epilogue of the sm90 backward main kernels (a mixin of ``bwd.FlashBwdSm90``): the
accumulators leave the consumer warpgroups once per K/V block, scaled (dK) and converted to 16 bit.

Three ways, by config: through K's and V's smem buffers with 2-byte stores (the default) or
stmatrix (``dkv_stmatrix``), then 16-byte row stores; or (``dkv_direct``) straight from the
registers with 4-byte stores, no smem and no barrier, so K and V may be released before it --
what the persistent grid needs to load the next tile's K / V under the epilogue.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.tensor_utils import LayoutEnum

from cute_flash.ampere import common


class BwdEpilogue:
    """Needs ``self.epilogue_barrier`` (a named barrier over the consumer threads), ``mma_dkv``,
    ``dtype``, ``tile_n``, ``hdim``, ``hdim_v``, ``num_mma_threads`` and ``cfg``."""

    @cute.jit
    def epilogue(self, ctx, mdK, mdV, softmax_scale):
        """dK (scaled by softmax_scale: S was scaled) and dV, 16 bit -> smem (K's and V's buffers,
        free now) -> 16-byte row stores of the rows of this K/V block that exist."""
        if cutlass.const_expr(self.cfg.dkv_direct):
            self.store_dkv_direct(ctx, mdK, mdV, softmax_scale)
        elif cutlass.const_expr(self.cfg.dkv_stmatrix):
            self.store_dkv_stmatrix(ctx, mdK, mdV, softmax_scale)
        else:
            coords = ctx.thr_dkv.partition_C(cute.make_identity_tensor((self.tile_n, self.hdim)))
            self.store_dkv(ctx, mdK, mdV, softmax_scale, ctx.smem.sK, ctx.smem.sV, coords, coords,
                           transposed=False)

    @cute.jit
    def store_dkv_stmatrix(self, ctx, mdK, mdV, softmax_scale):
        """``dkv_stmatrix``: dK / dV leave their accumulators through stmatrix (8x8 tiles, as the
        forward's O) instead of one 2-byte store per element (128 per thread at d = 128), then the
        same 16-byte row stores."""
        cute.arch.barrier(barrier_id=self.epilogue_barrier, number_of_threads=self.num_mma_threads)
        store_op = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32)
        r2s = cute.make_tiled_copy_C(store_op, self.mma_dkv).get_slice(ctx.tidx)
        for sT, acc, scale in ((ctx.smem.sK, ctx.acc_dK, softmax_scale),
                               (ctx.smem.sV, ctx.acc_dV, Float32(1.0))):
            r = cute.make_rmem_tensor_like(acc, self.dtype)
            for i in cutlass.range_constexpr(cute.size(acc)):
                r[i] = (acc[i] * scale).to(self.dtype)
            cute.copy(r2s, r2s.retile(r), r2s.partition_D(sT))
        cute.arch.barrier(barrier_id=self.epilogue_barrier, number_of_threads=self.num_mma_threads)
        rows_left = ctx.seqlen.seqlen_k - ctx.n_block * self.tile_n
        for mT, sT, width in ((mdK, ctx.smem.sK, self.hdim), (mdV, ctx.smem.sV, self.hdim_v)):
            copy = common.r2g_tiled_copy(self.dtype, width, self.num_mma_threads)
            gT = cute.local_tile(ctx.seqlen.k_rows(mT, ctx.head_kv, ctx.batch), (self.tile_n, width),
                                 (ctx.n_block, 0))
            common.store_rows(copy, copy.get_slice(ctx.tidx), sT, gT, self.tile_n, width, rows_left)

    @cute.jit
    def store_dkv(self, ctx, mdK, mdV, softmax_scale, sK, sV, coords_k, coords_v,
                  transposed: cutlass.Constexpr[bool]):
        """Write the dK / dV accumulators (element i at ``coords_*[i]``: (key, col), or (col, key)
        when ``transposed``) into sK / sV, then store whole rows."""
        # Every consumer warpgroup is done with K and V (its last GEMMs were waited for).
        cute.arch.barrier(barrier_id=self.epilogue_barrier, number_of_threads=self.num_mma_threads)
        for sT, acc, scale, coords in ((sK, ctx.acc_dK, softmax_scale, coords_k),
                                       (sV, ctx.acc_dV, Float32(1.0), coords_v)):
            for i in cutlass.range_constexpr(cute.size(acc)):
                a, b = coords[i]
                if cutlass.const_expr(transposed):
                    sT[b, a] = (acc[i] * scale).to(self.dtype)
                else:
                    sT[a, b] = (acc[i] * scale).to(self.dtype)
        cute.arch.barrier(barrier_id=self.epilogue_barrier, number_of_threads=self.num_mma_threads)
        rows_left = ctx.seqlen.seqlen_k - ctx.n_block * self.tile_n
        for mT, sT, width in ((mdK, sK, self.hdim), (mdV, sV, self.hdim_v)):
            copy = common.r2g_tiled_copy(self.dtype, width, self.num_mma_threads)
            gT = cute.local_tile(ctx.seqlen.k_rows(mT, ctx.head_kv, ctx.batch), (self.tile_n, width),
                                 (ctx.n_block, 0))
            common.store_rows(copy, copy.get_slice(ctx.tidx), sT, gT, self.tile_n, width, rows_left)

    @cute.jit
    def store_dkv_direct(self, ctx, mdK, mdV, softmax_scale):
        """``dkv_direct``: each thread stores its accumulator pairs (two adjacent columns of one
        row, 4 bytes) straight to global memory. The four threads of a row quad fill 16 contiguous
        bytes, so the L2 merges the partial sectors before DRAM; nothing waits on smem, so the
        epilogue costs the conversions and 2 x d / 8 stores per thread at d = 64 and no barrier."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32)
        copy = cute.make_tiled_copy_C(atom, self.mma_dkv)
        thr = copy.get_slice(ctx.tidx)
        rows_left = ctx.seqlen.seqlen_k - ctx.n_block * self.tile_n
        for mT, acc, scale, width in ((mdK, ctx.acc_dK, softmax_scale, self.hdim),
                                      (mdV, ctx.acc_dV, Float32(1.0), self.hdim_v)):
            r = cute.make_rmem_tensor_like(acc, self.dtype)
            for i in cutlass.range_constexpr(cute.size(acc)):
                r[i] = (acc[i] * scale).to(self.dtype)
            gT = cute.local_tile(ctx.seqlen.k_rows(mT, ctx.head_kv, ctx.batch), (self.tile_n, width),
                                 (ctx.n_block, 0))
            tg = thr.partition_D(gT)
            tr = thr.retile(r)
            tc = thr.partition_D(cute.make_identity_tensor((self.tile_n, width)))
            for m in cutlass.range_constexpr(cute.size(tr, mode=[1])):
                for n in cutlass.range_constexpr(cute.size(tr, mode=[2])):
                    if tc[0, m, n][0] < rows_left:
                        cute.copy(copy, tr[None, m, n], tg[None, m, n])
