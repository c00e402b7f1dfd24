"""The dQ stage of the sm90 backward main kernels (a mixin of ``bwd.FlashBwdSm90``): the dQ MMA
(shared with the postprocess, which reads the accumulator in its fragment order), the consumers'
hand-off of each query block's fp32 dQ tile through smem, and the writer warp that adds it into the
accumulator with bulk reduce-adds, in deterministic mode in a fixed order of the K/V blocks.
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32

from cute_flash.device import scratch
from cute_flash.device.seqlen import SeqlenInfo

NUM_MMA_THREADS = 256
# Named barriers of the hand-off: each consumer warpgroup (128 threads) and the writer warp (32)
# pass that warpgroup's half of the fp32 dQ tile in smem back and forth: EMPTY + wg once the
# writer's bulk reduce-add has read it, FULL + wg once the warpgroup has written it. Per
# warpgroup, so the two need not meet here (they already do once per block, at the dS barrier).
BAR_DQ_EMPTY = 4  # and 5
BAR_DQ_FULL = 6  # and 7
DQ_HANDOFF_THREADS = 128 + 32


def dq_tiled_mma(dtype, tile_m: int, hdim: int):
    """dQ = dS K: M = the query block, N = head dim, K = keys (dS K-major, K^T MN-major); the two
    consumer warpgroups split it by columns (64 query rows) or by rows (128). A query block that is
    not a multiple of 64 rows (80: FA3's non-causal d = 128 tile) cannot be wgmma's M, so there the
    MMA computes dQ^T = K^T dS^T instead (``dq_swapab``): M = head dim (64 rows per warpgroup),
    N = the query block, A = K^T (MN-major), B = dS (K-major). The postprocess reads the accumulator
    chunks in this MMA's fragment order, so it builds the same one."""
    K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
    if dq_swapab(tile_m):
        return sm90_utils.make_trivial_tiled_mma(dtype, dtype, MN, K, Float32,
                                                 atom_layout_mnk=(2, 1, 1), tiler_mn=(64, tile_m))
    if tile_m == 64:
        return sm90_utils.make_trivial_tiled_mma(dtype, dtype, K, MN, Float32,
                                                 atom_layout_mnk=(1, 2, 1), tiler_mn=(64, hdim // 2))
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, K, MN, Float32,
                                             atom_layout_mnk=(2, 1, 1), tiler_mn=(64, hdim))


def dq_swapab(tile_m: int) -> bool:
    return tile_m % 64 != 0


def dq_acc_shape(tile_m: int, hdim: int) -> tuple:
    """(M, N) of the dQ MMA's accumulator: (queries, head dim), or transposed under ``dq_swapab``."""
    return (hdim, tile_m) if dq_swapab(tile_m) else (tile_m, hdim)


class BwdDq:
    """Needs the kernel's ``tile_m``, ``hdim``, ``num_mma_threads``, ``deterministic``, ``varlen``,
    ``cfg`` and its walk (``num_work_items``, ``work_item``)."""

    @cute.jit
    def dq_writer(self, mdQaccum, smem, seqlen: SeqlenInfo, work):
        """The dQ writer warp: for each query block the consumers finish (same order as theirs), one
        bulk reduce-add of the fp32 smem tile into the accumulator chunk, performed at L2 by the
        copy engine, so the consumer warps neither issue tile_m * d / 4 vector reductions nor wait
        for them."""
        lane = cute.arch.lane_idx()
        total = self.num_work_items(work)
        num_wg = self.num_mma_threads // 128
        half = self.tile_m * self.hdim // num_wg  # fp32 elements per warpgroup (``frag_chunk_view``)
        if total > 0:
            for wg in cutlass.range_constexpr(num_wg):
                cute.arch.barrier_arrive(barrier_id=BAR_DQ_EMPTY + wg, number_of_threads=DQ_HANDOFF_THREADS)
        for it in cutlass.range(total, unroll=1):
            head, m_block = self.work_item(work, it)
            gacc = scratch.dq_accum_block(mdQaccum, seqlen, head, work.batch, m_block, self.tile_m,
                                           self.hdim)
            sem = None
            if cutlass.const_expr(self.deterministic):
                # Deterministic mode (flash-attn-4's sm90 scheme): only this lane waits for the
                # predecessor K/V block's adds, while the consumers compute on (they stall only if
                # the smem chunk is not back yet).
                sem = self.dq_semaphore(work.mSemaphore, seqlen, work.batch, head, m_block)
                rank = work.order_rank
                if cutlass.const_expr(self.cfg.rotate_m):
                    rank = self.rotated_rank(work, m_block)
                if lane == 0:
                    if cutlass.const_expr(self.cfg.rotate_m):
                        if rank > 0:
                            scratch.semaphore_spin(sem, rank)
                    elif work.prev_valid and m_block >= work.prev_min and m_block < work.prev_max:
                        scratch.semaphore_spin(sem, rank)
                    # The acquire was a generic-proxy load; the reduce-adds are async-proxy ops.
                    cute.arch.fence_proxy("async.global")
                cute.arch.sync_warp()  # the warp reconverged before the (aligned) FULL barrier
            # The smem half may be rewritten once the copy engine has read it. ``dq_writer_batch``:
            # every warpgroup's chunk is issued as soon as it is handed over and each released as
            # it is read (oldest first), so the second does not wait for the first one's read
            # (flash-attn-4's writer); else each is waited for right after its issue.
            batch = self.cfg.dq_writer_batch
            for wg in cutlass.range_constexpr(num_wg):
                cute.arch.barrier(barrier_id=BAR_DQ_FULL + wg, number_of_threads=DQ_HANDOFF_THREADS)
                if lane == 0:
                    scratch.bulk_reduce_add_f32(gacc.iterator + wg * half, smem.sdQ.iterator + wg * half,
                                                 half * 4)
                    cute.arch.cp_async_bulk_commit_group()
                    if cutlass.const_expr(not batch):
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                if cutlass.const_expr(not batch):
                    self.release_dq_chunk(wg, it, total)
            if cutlass.const_expr(batch):
                for wg in cutlass.range_constexpr(num_wg):
                    if lane == 0:
                        cute.arch.cp_async_bulk_wait_group(num_wg - 1 - wg, read=True)
                    self.release_dq_chunk(wg, it, total)
            if cutlass.const_expr(self.deterministic):
                if lane == 0:
                    # The successor may add only once these adds are complete in L2, not just read
                    # from smem (which is all the release of the chunks above waited for).
                    cute.arch.cp_async_bulk_wait_group(0, read=False)
                    cute.arch.fence_proxy("async.global")
                    cute.arch.store(sem, rank + 1, sem="release", scope="gpu")
        if lane == 0:
            # Only the smem reads must be done before the CTA leaves (its smem goes to the next
            # CTA); the adds themselves complete in L2 and are visible to the postprocess at the
            # grid boundary.
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def release_dq_chunk(self, wg: int, it: Int32, total: Int32):
        """Hand warpgroup ``wg``'s smem dQ chunk back (it has been read), unless this was the last
        query block."""
        cute.arch.sync_warp()
        if it + 1 < total:
            cute.arch.barrier_arrive(barrier_id=BAR_DQ_EMPTY + wg, number_of_threads=DQ_HANDOFF_THREADS)

    @cute.jit
    def store_dq(self, ctx, acc_dQ, head: Int32, m_block: Int32):
        """Hands this block's dQ partial to the writer warp: this warpgroup's half of the fp32 smem
        tile, in fragment order (``scratch.frag_chunk_view``), once the writer has read the previous
        one."""
        wg = cute.arch.make_warp_uniform(ctx.tidx // 128)
        cute.arch.barrier(barrier_id=BAR_DQ_EMPTY + wg, number_of_threads=DQ_HANDOFF_THREADS)
        view = scratch.frag_chunk_view(ctx.smem.sdQ, ctx.tidx, self.num_mma_threads)
        for j in cutlass.range_constexpr(cute.size(view, mode=[1])):
            four = cute.make_tensor(acc_dQ.iterator + 4 * j, cute.make_layout(4))
            cute.autovec_copy(four, view[None, j])
        cute.arch.fence_view_async_shared()  # generic-proxy writes before the bulk copy reads them
        cute.arch.barrier_arrive(barrier_id=BAR_DQ_FULL + wg, number_of_threads=DQ_HANDOFF_THREADS)

    @cute.jit
    def rotated_rank(self, w, m_block: Int32) -> Int32:
        """Deterministic mode on the rotated walk: this K/V block's place among the adds into
        ``m_block`` (``w``: the work, with ``rank_plan`` and ``rot``)."""
        m_count, q_per, rem, n_div = w.rank_plan
        local = m_block - w.m_block_min
        step = local - w.rot
        step = cutlass.select_(step < 0, step + m_count, step)
        return scratch.rotated_add_rank(step, local, m_count, q_per, rem, n_div)

    @cute.jit
    def dq_semaphore(self, mSemaphore, seqlen: SeqlenInfo, batch: Int32, head: Int32, m_block: Int32):
        """Deterministic mode: the ordering flag of (query block, head, batch)."""
        idx = scratch.semaphore_index(seqlen, batch, m_block, self.tile_m)
        coord = (idx, head) if cutlass.const_expr(self.varlen) else (idx, head, batch)
        return mSemaphore.iterator + cute.crd2idx(coord, mSemaphore.layout)
