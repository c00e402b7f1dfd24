"""FA3-style backward for wide heads (d = 192, 256) on Hopper.

dK and dV of 64 keys x 256 would need 256 fp32 registers per consumer thread in the swapped form of
``bwd.FlashBwdSm90``. Here the head dim sits on wgmma's M instead (FA3's "dKV swapAB"): the CTA owns
``tile_n`` keys (64 at d = 256, 96 at d = 192), dK^T and dV^T are split over the two consumer
warpgroups by rows of the head dim (d = 256: 64 registers each per thread) or by keys (d = 192),
and S, dP keep the queries on M:

    S  = Q K^T, dP = dO V^T   (SS; M = 64 queries, the keys split over the warpgroups)
    P  = exp2(S c - LSE2), dS = P (dP - D)      (per query row: 2 LSE2 / D values per thread)
    P, dS -> smem by stmatrix (both halves are needed by every warpgroup below)
    dV^T += dO^T P            dK^T += Q^T dS     (SS, both operands MN-major views of smem)
    dQ    = dS K              (SS, head dim split over the warpgroups), into fp32 by the writer warp

Producer, pipelines, GQA / varlen / window / deterministic handling and the dQ accumulation are
the narrow kernel's (this class derives from it).
"""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from cute_flash.device import waits, warp_mma
from cute_flash.device.convert import convert_pairs
from cute_flash.device.layout import acc_to_mn, transpose_smem
from cute_flash.hopper.bwd import BAR_DS_EMPTY, BAR_DS_FULL, BAR_P_FULL, FlashBwdSm90
from cute_flash.hopper.bwd_dq import dq_tiled_mma
from cute_flash.hopper.fwd import wg_gemm


class FlashBwdSm90Wide(FlashBwdSm90):
    """(The narrow kernel's ``ds_stages`` does not apply here; ``dq_before_dk`` is flash-attn-4's
    order of the block's stores and GEMMs, see ``one_m_block``.)"""

    def _setup(self) -> None:
        d, dv, tm, tn = self.hdim, self.hdim_v, self.tile_m, self.tile_n
        self.sQ_layout = self._smem(tm, d, self.num_stages)
        self.sdO_layout = self._smem(tm, dv, self.num_do_stages)
        # dK^T / dV^T split over the warpgroups by head-dim rows where d is a multiple of 128 (two
        # 64-row slices each), else by keys (d = 192: every warpgroup all 192 rows, half the keys,
        # reading its key half of P^T / dS^T as its own MN-major operand).
        self.dkv_by_keys = d % 128 != 0
        kv_half = tn // 2 if self.dkv_by_keys else tn
        self.sK_layout = self._smem(tn, d, None, atom_cols=d // 2)
        self.sV_layout = self._smem(tn, dv, None)
        self.sP_layout = self._smem(tm, tn, None, atom_cols=kv_half)
        self.sdS_layout = self._smem(tm, tn, None, atom_cols=kv_half)
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S, dP: M = the query block, N = keys (tile_n / 2 per warpgroup), K = head dim.
        self.mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, atom_layout_mnk=(1, 2, 1), tiler_mn=(64, tn // 2))
        # dV^T, dK^T: M = head dim (64-row slices alternating over the warpgroups), N = keys,
        # K = the query block; A = dO^T / Q^T, B = P^T / dS^T, all MN-major views of smem.
        self.mma_dkv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN, MN, Float32,
            atom_layout_mnk=(1, 2, 1) if self.dkv_by_keys else (2, 1, 1), tiler_mn=(64, kv_half))
        # dQ: M = the query block, N = head dim (half per warpgroup), K = keys.
        self.mma_dq = dq_tiled_mma(self.dtype, tm, d)

    def smem_layouts(self) -> dict:
        return {**super().smem_layouts(), "sP": self.sP_layout}

    def consumer_ctx(self, smem, tidx):
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_sdp = self.mma_sdp.get_slice(tidx)
        thr_dkv = self.mma_dkv.get_slice(tidx)
        thr_dq = self.mma_dq.get_slice(tidx)
        wg_sdp, wg_dkv, wg_dq = (m.get_slice(wg * 128) for m in (self.mma_sdp, self.mma_dkv, self.mma_dq))
        sQt, sdOt = transpose_smem(smem.sQ), transpose_smem(smem.sdO)
        shape_dk = thr_dkv.partition_shape_C((self.hdim, self.tile_n))
        shape_dv = thr_dkv.partition_shape_C((self.hdim_v, self.tile_n))
        return warp_mma.Ctx(
            thr_sdp=thr_sdp, thr_dq=thr_dq, thr_dkv=thr_dkv,
            tSrQ=wg_sdp.make_fragment_A(wg_sdp.partition_A(smem.sQ)),
            tSrK=wg_sdp.make_fragment_B(wg_sdp.partition_B(smem.sK)),
            tdPrdO=wg_sdp.make_fragment_A(wg_sdp.partition_A(smem.sdO)),
            tdPrV=wg_sdp.make_fragment_B(wg_sdp.partition_B(smem.sV)),
            tdVrdOt=wg_dkv.make_fragment_A(wg_dkv.partition_A(sdOt)),
            tdVrPt=wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(smem.sP))),
            tdKrQt=wg_dkv.make_fragment_A(wg_dkv.partition_A(sQt)),
            tdKrdSt=wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_smem(smem.sdS))),
            tdQrdS=wg_dq.make_fragment_A(wg_dq.partition_A(smem.sdS)),
            tdQrKt=wg_dq.make_fragment_B(wg_dq.partition_B(transpose_smem(smem.sK))),
            **self.pds_store_ctx(smem, tidx),
            acc_dK=cute.make_rmem_tensor(shape_dk, Float32),
            acc_dV=cute.make_rmem_tensor(shape_dv, Float32),
            # (query, key) of each S element of this thread, within the tile.
            tScS=acc_to_mn(thr_sdp.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))))

    @cute.jit
    def one_m_block(self, ctx, pipes, state, head: Int32, m_block: Int32, v_state, do_state=None):
        acc_S = cute.make_rmem_tensor(ctx.thr_sdp.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_dP = cute.make_rmem_tensor(ctx.thr_sdp.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        waits.wait_full(pipes.q, state, self.spin_waits)
        s = state.index
        # dO + D's stage: the Q stage, or its own with ``do_stages`` (``separate_do``).
        dos = do_state if cutlass.const_expr(self.separate_do) else state
        sd = dos.index
        wg_gemm(self.mma_sdp, acc_S, ctx.tSrQ[None, None, None, s], ctx.tSrK, zero_init=True, wg_wait=-1)
        # ``prefetch_stats``: this thread's rows' LSE2 read while S is in flight, D while dP is (just
        # before its wait: any earlier, d = 192 causal spills 8 bytes).
        lse2 = self.stats_regs(ctx, acc_S, ctx.smem.sLSE2[None, s])
        if cutlass.const_expr(self.split_loads):
            waits.wait_full(pipes.kv, v_state, self.spin_waits)
            waits.wait_full(pipes.do, dos, self.spin_waits)
        wg_gemm(self.mma_sdp, acc_dP, ctx.tdPrdO[None, None, None, sd], ctx.tdPrV, zero_init=True, wg_wait=1)
        dtanh = self.probs(ctx, acc_S, ctx.smem.sLSE2[None, s], m_block, lse2)
        # P and dS -> smem: the dK / dV / dQ GEMMs contract over every key of the tile. The
        # previous block's GEMMs (both warpgroups) must be done reading the buffers first.
        if cutlass.const_expr(self.dq_before_dk):
            # flash-attn-4's order: P leaves while dP is still in flight, dV starts while dS is
            # stored, and dQ is handed over while dK runs.
            cute.arch.barrier(barrier_id=BAR_DS_EMPTY, number_of_threads=self.num_mma_threads)
            self.store_pds(ctx, acc_S, ctx.tRSsP)
            dsum = self.stats_regs(ctx, acc_S, ctx.smem.sDsum[None, sd])
            warpgroup.wait_group(0)
            self.dscores_rows(ctx, acc_S, acc_dP, dtanh, ctx.smem.sDsum[None, sd], dsum)
            cute.arch.fence_view_async_shared()  # generic-proxy writes before wgmma reads them
            cute.arch.barrier(barrier_id=BAR_P_FULL, number_of_threads=self.num_mma_threads)
            self.store_pds(ctx, acc_dP, ctx.tRSsdS)
            wg_gemm(self.mma_dkv, ctx.acc_dV, ctx.tdVrdOt[None, None, None, sd], ctx.tdVrPt, zero_init=False,
                    wg_wait=-1)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier(barrier_id=BAR_DS_FULL, number_of_threads=self.num_mma_threads)
            acc_dQ = cute.make_rmem_tensor(ctx.thr_dq.partition_shape_C((self.tile_m, self.hdim)), Float32)
            wg_gemm(self.mma_dq, acc_dQ, ctx.tdQrdS, ctx.tdQrKt, zero_init=True, wg_wait=-1)
            wg_gemm(self.mma_dkv, ctx.acc_dK, ctx.tdKrQt[None, None, None, s], ctx.tdKrdSt, zero_init=False,
                    wg_wait=1)
            self.store_dq_under_dk(ctx, pipes, state, dos, acc_dQ, head, m_block)
        else:
            dsum = self.stats_regs(ctx, acc_S, ctx.smem.sDsum[None, sd])
            warpgroup.wait_group(0)
            self.dscores_rows(ctx, acc_S, acc_dP, dtanh, ctx.smem.sDsum[None, sd], dsum)
            cute.arch.barrier(barrier_id=BAR_DS_EMPTY, number_of_threads=self.num_mma_threads)
            self.store_pds(ctx, acc_S, ctx.tRSsP)
            self.store_pds(ctx, acc_dP, ctx.tRSsdS)
            cute.arch.fence_view_async_shared()  # generic-proxy writes before wgmma reads them
            cute.arch.barrier(barrier_id=BAR_DS_FULL, number_of_threads=self.num_mma_threads)
            wg_gemm(self.mma_dkv, ctx.acc_dV, ctx.tdVrdOt[None, None, None, sd], ctx.tdVrPt, zero_init=False,
                    wg_wait=-1)
            wg_gemm(self.mma_dkv, ctx.acc_dK, ctx.tdKrQt[None, None, None, s], ctx.tdKrdSt, zero_init=False,
                    wg_wait=-1)
            acc_dQ = cute.make_rmem_tensor(ctx.thr_dq.partition_shape_C((self.tile_m, self.hdim)), Float32)
            wg_gemm(self.mma_dq, acc_dQ, ctx.tdQrdS, ctx.tdQrKt, zero_init=True, wg_wait=0)
            pipes.q.consumer_release(state)
            if cutlass.const_expr(self.split_loads):
                pipes.do.consumer_release(dos)
            self.store_dq(ctx, acc_dQ, head, m_block)

    def store_pds(self, ctx, acc, tRSs) -> None:
        """P or dS (an S-shaped accumulator) -> its smem tile (``pds_store_ctx``'s partition), 16 bit."""
        r = cute.make_rmem_tensor_like(acc, self.dtype)
        convert_pairs(acc, r)
        cute.copy(ctx.st_PdS, ctx.thr_st_PdS.retile(r), tRSs)

    def pds_store_ctx(self, smem, tidx) -> dict:
        """P and dS leave the S / dP accumulators by stmatrix (8x8 tiles; the keys are the
        contiguous axis of both smem tiles)."""
        atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                   self.dtype)
        tiled = cute.make_tiled_copy_C(atom, self.mma_sdp)
        thr = tiled.get_slice(tidx)
        return dict(st_PdS=tiled, thr_st_PdS=thr, tRSsP=thr.partition_D(smem.sP),
                    tRSsdS=thr.partition_D(smem.sdS))

    stat_mode = 0  # (the rows are the queries here: 2 statistics per thread)

    def stat_query(self, ctx, i: int):
        return ctx.tScS[i, 0][0]

    @cute.jit
    def dscores_rows(self, ctx, acc_S, acc_dP, dtanh, sDsum, dsum_regs=None):
        """dS = P (dP - D[query]) [* (1 - tanh^2)] into ``acc_dP``."""
        p, dp = acc_to_mn(acc_S), acc_to_mn(acc_dP)
        for r in cutlass.range_constexpr(cute.size(dp, mode=[0])):
            dsum = self.stat_at(ctx, sDsum, dsum_regs, r)
            for c in cutlass.range_constexpr(cute.size(dp, mode=[1])):
                dp[r, c] = p[r, c] * (dp[r, c] - dsum)
        self.softcap_grad(acc_dP, dtanh)

    @cute.jit
    def epilogue(self, ctx, mdK, mdV, softmax_scale):
        """dK^T (scaled) and dV^T back to (key, head dim) rows through K's and V's smem buffers:
        transposing stmatrix (``dkv_stmatrix``) or one 2-byte store per element (144 per thread at
        d = 192)."""
        if cutlass.const_expr(self.cfg.dkv_stmatrix):
            self.store_dkv_staged(ctx, mdK, mdV, softmax_scale, ctx.smem.sK, ctx.smem.sV, transposed=True)
        else:
            coords_k = ctx.thr_dkv.partition_C(cute.make_identity_tensor((self.hdim, self.tile_n)))
            coords_v = ctx.thr_dkv.partition_C(cute.make_identity_tensor((self.hdim_v, self.tile_n)))
            self.store_dkv(ctx, mdK, mdV, softmax_scale, ctx.smem.sK, ctx.smem.sV, coords_k, coords_v,
                           transposed=True)
