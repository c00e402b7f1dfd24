"""The dK / dV epilogue of the sm90 backward main kernels (a mixin of ``bwd.FlashBwdSm90``): the
accumulators leave the consumer warpgroups once per K/V block, scaled (dK) and converted to 16 bit.

Both go through K's and V's smem buffers (free by then), with 2-byte stores or stmatrix
(``dkv_stmatrix``), and leave as whole rows, 16 bytes per thread.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32
from cutlass.tensor_utils import LayoutEnum

from cute_flash.device import warp_mma
from cute_flash.device.layout import transpose_smem


class BwdEpilogue:
    """Needs ``self.epilogue_barrier`` (a named barrier over the consumer threads), ``mma_dkv``,
    ``dtype``, ``tile_n``, ``hdim``, ``hdim_v``, ``num_mma_threads`` and ``cfg``."""

    @cute.jit
    def epilogue(self, ctx, mdK, mdV, softmax_scale):
        """dK (scaled by softmax_scale: S was scaled) and dV, 16 bit -> smem (K's and V's buffers,
        free now) -> 16-byte row stores of the rows of this K/V block that exist."""
        if cutlass.const_expr(self.cfg.dkv_stmatrix):
            self.store_dkv_staged(ctx, mdK, mdV, softmax_scale, ctx.smem.sK, ctx.smem.sV)
        else:
            coords = ctx.thr_dkv.partition_C(cute.make_identity_tensor((self.tile_n, self.hdim)))
            self.store_dkv(ctx, mdK, mdV, softmax_scale, ctx.smem.sK, ctx.smem.sV, coords, coords,
                           transposed=False)

    @cute.jit
    def store_dkv_staged(self, ctx, mdK, mdV, softmax_scale, sK, sV,
                         transposed: cutlass.Constexpr[bool] = False):
        """``dkv_stmatrix``: dK / dV leave their accumulators through stmatrix (8x8 tiles, as the
        forward's O) instead of one 2-byte store per element into sK / sV, then the 16-byte row
        stores. ``transposed``: the accumulators hold dK^T / dV^T (the wide kernel's head dim on M),
        so each 8x8 tile is transposed on its way to the (key, head dim) rows."""
        bar, nthr = self.epilogue_barrier, self.num_mma_threads
        # Every consumer warpgroup is done with K and V (its last GEMMs were waited for).
        cute.arch.barrier(barrier_id=bar, number_of_threads=nthr)
        store_op = sm90_utils.get_smem_store_op(LayoutEnum.COL_MAJOR if transposed else LayoutEnum.ROW_MAJOR,
                                                self.dtype, Float32)
        r2s = cute.make_tiled_copy_C(store_op, self.mma_dkv).get_slice(ctx.tidx)
        for acc, scale, sT in ((ctx.acc_dK, softmax_scale, sK), (ctx.acc_dV, Float32(1.0), sV)):
            r = cute.make_rmem_tensor_like(acc, self.dtype)
            for j in cutlass.range_constexpr(cute.size(acc)):
                r[j] = (acc[j] * scale).to(self.dtype)
            cute.copy(r2s, r2s.retile(r), r2s.partition_D(transpose_smem(sT) if transposed else sT))
        cute.arch.barrier(barrier_id=bar, number_of_threads=nthr)
        self.store_dkv_rows(ctx, ((mdK, sK, self.hdim), (mdV, sV, self.hdim_v)))

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
        self.store_dkv_rows(ctx, ((mdK, sK, self.hdim), (mdV, sV, self.hdim_v)))

    @cute.jit
    def store_dkv_rows(self, ctx, parts: tuple):
        """(global tensor, smem tile, width) each: 16-byte row stores of this K/V block's rows that
        exist."""
        rows_left = ctx.seqlen.seqlen_k - ctx.n_block * self.tile_n
        for mT, sT, width in parts:
            copy = warp_mma.r2g_tiled_copy(self.dtype, width, self.num_mma_threads)
            gT = cute.local_tile(ctx.seqlen.k_rows(mT, ctx.head_kv, ctx.batch), (self.tile_n, width),
                                 (ctx.n_block, 0))
            warp_mma.store_rows(copy, copy.get_slice(ctx.tidx), sT, gT, self.tile_n, width, rows_left)
