"""FP8 (e4m3) backward main kernel for Hopper: the narrow sm90 backward (``bwd.py``) with its five
GEMMs on k32 e4m3 wgmma and fp32 accumulation; dQ / dK / dV in bf16 / fp16.

What differs from 16 bit, and why:

* fp8 wgmma reads K-major operands only, so every GEMM that contracts over tokens needs its B
  operand with the tokens contiguous: dV += P^T dO reads dO^T, dK += dS^T Q reads Q^T and
  dQ = dS K reads K^T. The launcher hands those in as transposed copies ((B, H, d, N_pad)
  storage under a (B, N, H, d) view); K, V, Q and dO keep the head dim contiguous for S^T and dP^T.
* Scales. S^T takes the forward's per-(batch, kv head) Q and K descales in its exp2 scale, so P
  is the forward's. dO comes with one descale per (token, head) row (``sDOs``), which factors
  out of dP^T = V dO^T by columns and out of dV = P^T dO through P: the dV GEMM reads
  P~ = P * s_do. P~ <= max s_do of the block, and dS has no bound, so both quantize against a
  running maximum over this CTA's blocks (of max s_do for P~, of dS's tile amax, exchanged
  between the consumer warpgroups at the dS barrier, for dS): nothing saturates, and e4m3 keeps
  its relative precision over 15 binades below the maximum. When a maximum grows, the dK or dV
  accumulator is rescaled by old / new before its next GEMM (a uniform branch: every thread
  holds the same maxima). dQ of a block carries its own dS scale, applied before the hand-off.
* P^T and dS^T leave the S^T / dP^T accumulators as e4m3 A fragments. Q^T and dO^T come with each
  16 queries in the forward's V order (``formats.V_PERM16``), so a byte merge within each lane
  does it (``fwd_fp8.merge_own_p``) instead of a quad exchange across lanes. dS also goes to smem for dQ,
  keys contiguous (the dQ GEMM's K-major A), one byte per store: the 8-bit stmatrix does not
  transpose.
* dK and dV leave through a 16-bit smem tile of their own (K's and V's tiles are 8 bit).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from cute_flash.device import scratch, waits, warp_mma
from cute_flash.device.layout import acc_to_mn, wgmma_smem_tile
from cute_flash.device.softmax import score_scales
from cute_flash.device.tile_scheduler import section_size, section_walk_plan
from cute_flash.formats import E4M3_MAX
from cute_flash.hopper.bwd import BAR_DS_EMPTY, BAR_DS_FULL, FlashBwdSm90
from cute_flash.hopper.bwd_dq import dq_acc_shape
from cute_flash.hopper.fwd import wg_gemm
from cute_flash.hopper.fwd_fp8 import merge_own_p

# A running maximum's start: above zero, so 448 / max stays finite while every value seen is 0.
RUNNING_MAX_FLOOR = 1e-30
# P~'s bound over max s_do: P may exceed 1 where the forward's row sums (of e4m3-rounded P, or of
# its FFMA codes, up to 6% above exp2) came out low; this keeps those P below saturation.
P_HEADROOM = 1.125


def transposed_view(t: cute.Tensor) -> cute.Tensor:
    """(N, d, H, B) with the tokens contiguous -> (d, N, H, B) (packed: (T, d, H) -> (d, T, H)):
    TMA boxes of (d, tile)."""
    mode = [1, 0, 2, 3] if cutlass.const_expr(cute.rank(t.layout) == 4) else [1, 0, 2]
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=mode))


class FlashBwdSm90Fp8(FlashBwdSm90):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.o_dtype = self.dtype  # dQ / dK / dV (the config's dtype)
        self.dtype = cutlass.Float8E4M3FN
        tm, tn, d = self.tile_m, self.tile_n, self.hdim
        # K, K^T, V once; Q, Q^T, dO, dO^T and the LSE2 / D / dO-descale rows per query block.
        self.tx_kv = 3 * tn * d
        self.tx_qdo = 4 * tm * d + 3 * tm * 4

    # ------------------------------------------------------------------------------------------
    # Layouts and MMAs
    # ------------------------------------------------------------------------------------------
    def _tile(self, rows: int, cols: int, stages: int | None, dtype=None):
        """K-major wgmma-canonical swizzled tile of ``dtype`` (default e4m3)."""
        return wgmma_smem_tile(dtype or self.dtype, rows, cols, stages)

    def _setup(self) -> None:
        d, tm, tn, st = self.hdim, self.tile_m, self.tile_n, self.num_stages
        self.sQ_layout = self._tile(tm, d, st)
        self.sdO_layout = self._tile(tm, d, st)
        self.sQt_layout = self._tile(d, tm, st)
        self.sdOt_layout = self._tile(d, tm, st)
        self.sK_layout = self._tile(tn, d, None)
        self.sKt_layout = self._tile(d, tn, None)
        self.sV_layout = self._tile(tn, d, None)
        self.sdS_layout = self._tile(tm, tn, None)
        self.sE_layout = self._tile(tn, d, None, self.o_dtype)
        K = cute.nvgpu.OperandMajorMode.K
        f8 = self.dtype
        self.mma_sdp = sm90_utils.make_trivial_tiled_mma(
            f8, f8, K, K, Float32, atom_layout_mnk=(2, 1, 1), tiler_mn=(64, tm))
        self.mma_dkv = sm90_utils.make_trivial_tiled_mma(
            f8, f8, K, K, Float32, atom_layout_mnk=(2, 1, 1), tiler_mn=(64, d),
            a_source=warpgroup.OperandSource.RMEM)
        # dQ = dS K: split by columns over the warpgroups (64 query rows) or by rows (128), the
        # fragment order of the 16-bit kernel's dQ MMA (the postprocess reads it).
        if tm == 64:
            self.mma_dq = sm90_utils.make_trivial_tiled_mma(
                f8, f8, K, K, Float32, atom_layout_mnk=(1, 2, 1), tiler_mn=(64, d // 2))
        else:
            self.mma_dq = sm90_utils.make_trivial_tiled_mma(
                f8, f8, K, K, Float32, atom_layout_mnk=(2, 1, 1), tiler_mn=(64, d))

    def smem_layouts(self) -> dict:
        return {"sK": self.sK_layout, "sKt": self.sKt_layout, "sV": self.sV_layout, "sQ": self.sQ_layout,
                "sQt": self.sQt_layout, "sdO": self.sdO_layout, "sdOt": self.sdOt_layout,
                "sdS": self.sdS_layout}

    def fp32_layouts(self) -> dict:
        return {"sLSE2": cute.make_layout((self.tile_m, self.num_stages)),
                "sDsum": cute.make_layout((self.tile_m, self.num_stages)),
                "sDOs": cute.make_layout((self.tile_m, self.num_stages)),
                "sdQ": cute.make_layout(self.tile_m * self.hdim),
                "sAmax": cute.make_layout(self.num_mma_threads // 32)}

    def extra_storage(self) -> dict:
        """The 16-bit dK / dV staging tile (K's and V's tiles hold 8-bit data)."""
        staging = cute.struct.MemRange[self.o_dtype, cute.cosize(self.sE_layout)]
        return {"sE": cute.struct.Align[staging, 1024]}

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mQt: cute.Tensor, mKt: cute.Tensor, mdOt: cute.Tensor, mLSE2: cute.Tensor,
                 mD: cute.Tensor, mDOs: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
                 mSemaphore: cute.Tensor | None, mQd: cute.Tensor, mKd: cute.Tensor, mVd: cute.Tensor,
                 softmax_scale: Float32, window_left: Int32, window_right: Int32, max_seqlen_k: Int32,
                 stream):
        """e4m3 Q, K, V, dO (B, N, H, d) and Q^T, K^T, dO^T (the same shapes over token-contiguous
        storage); the fp32 scratch rows of LSE2, D and dO's row descales (the preprocess's padded
        layout), the dQ accumulator, bf16 / fp16 dK, dV; the forward's (B, H_kv) descales.
        Packed sequences: (T, H, d) tensors with int32 ``cu_seqlens`` (S + 1,), (S, H_kv) descales;
        Q^T and dO^T then hold each sequence from its first padded scratch row on
        (``scratch.padded_offset_q``), K^T likewise by key tiles (``kt_rows``)."""
        self._setup()
        Storage = self._storage()
        mQ, mK, mV, mdO, mdK, mdV = [warp_mma.to_seq_dim_head(t) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mQt, mKt, mdOt = [transposed_view(warp_mma.to_seq_dim_head(t)) for t in (mQt, mKt, mdOt)]
        mLSE2, mD, mDOs, mdQaccum = [warp_mma.lse_to_seq_head(t) for t in (mLSE2, mD, mDOs, mdQaccum)]
        if cutlass.const_expr(mSemaphore is not None):
            mSemaphore = warp_mma.lse_to_seq_head(mSemaphore)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        d, tm, tn = self.hdim, self.tile_m, self.tile_n
        sel = lambda layout: cute.select(layout, mode=[0, 1])  # noqa: E731
        tma_Q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, mQ, sel(self.sQ_layout), (tm, d))
        tma_Qt, mQt_tma = cpasync.make_tiled_tma_atom(g2s, mQt, sel(self.sQt_layout), (d, tm))
        tma_dO, mdO_tma = cpasync.make_tiled_tma_atom(g2s, mdO, sel(self.sdO_layout), (tm, d))
        tma_dOt, mdOt_tma = cpasync.make_tiled_tma_atom(g2s, mdOt, sel(self.sdOt_layout), (d, tm))
        tma_K, mK_tma = cpasync.make_tiled_tma_atom(g2s, mK, self.sK_layout, (tn, d))
        tma_Kt, mKt_tma = cpasync.make_tiled_tma_atom(g2s, mKt, self.sKt_layout, (d, tn))
        tma_V, mV_tma = cpasync.make_tiled_tma_atom(g2s, mV, self.sV_layout, (tn, d))
        num_batch, seqlen_k = warp_mma.grid_rows(mK, mCuSeqlensK, max_seqlen_k)
        # ``split_heads``: one CTA row per partial dK / dV head (the launcher sums the partials).
        heads = mdK.shape[2] if cutlass.const_expr(self.cfg.split_heads) else mK.shape[2]
        grid = (cute.ceil_div(seqlen_k, tn), heads, num_batch)
        score_scale, scale_log2 = score_scales(softmax_scale, Float32(0.0), False, False)
        scales = (softmax_scale, score_scale, scale_log2)
        qhead_per_kv = mQ.shape[2] // heads
        walk = ()
        if cutlass.const_expr(self.lpt):
            group = section_size(Int32(self.cfg.lpt_rows_in_l2()), mQ.shape[0] * qhead_per_kv, heads)
            walk = section_walk_plan(grid[0], heads, group, self.cfg.lpt_balanced,
                                     divisor=cute.fast_divmod_create_divisor_v2)
        tensors = (mQ_tma, mK_tma, mV_tma, mdO_tma, mQt_tma, mKt_tma, mdOt_tma, mLSE2, mD, mDOs, mdQaccum,
                   mdK, mdV, mCuSeqlensQ, mCuSeqlensK, mSemaphore, mQd, mKd, mVd)
        atoms = (tma_Q, tma_K, tma_V, tma_dO, tma_Qt, tma_Kt, tma_dOt)
        self.kernel(tensors, atoms, scales, walk, qhead_per_kv, window_left, window_right, Storage).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=Storage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1, use_pdl=True)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, tensors: tuple, atoms: tuple, scales: tuple, walk: tuple, qhead_per_kv: Int32,
               window_left: Int32, window_right: Int32, Storage: cutlass.Constexpr):
        self._setup()
        (mQ, mK, mV, mdO, mQt, mKt, mdOt, mLSE2, mD, mDOs, mdQaccum, mdK, mdV, mCuSeqlensQ, mCuSeqlensK,
         mSemaphore, mQd, mKd, mVd) = tensors
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(Storage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        pipe_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_kv, defer_sync=True)
        pipe_qdo = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_qdo.data_ptr(), num_stages=self.num_stages,
            producer_group=producer, consumer_group=consumers, tx_count=self.tx_qdo, defer_sync=True)
        pipes = warp_mma.Ctx(kv=pipe_kv, q=pipe_qdo, do=None)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        smem = warp_mma.Ctx(**{name: getattr(storage, name).get_tensor(layout.outer, swizzle=layout.inner)
                             for name, layout in self.smem_layouts().items()},
                          **{name: getattr(storage, name).get_tensor(layout)
                             for name, layout in self.fp32_layouts().items()})
        smem.sE = storage.sE.get_tensor(self.sE_layout.outer, swizzle=self.sE_layout.inner)
        smem.sdS_raw = storage.sdS.data_ptr()
        args = warp_mma.Ctx(mQ=mQ, mK=mK, mdK=mdK, mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=mCuSeqlensK,
                            mSemaphore=mSemaphore,
                            window_left=window_left, window_right=window_right, qhead_per_kv=qhead_per_kv,
                            aux=(), aux_grads=(), mBlocks=None)
        n_block, head_kv, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.lpt):
            n_block, head_kv = self.longest_first(n_block, head_kv, walk)
        seqlen, work = self.make_work(args, n_block, head_kv, batch)
        if work.n_block >= 0 and work.n_block * self.tile_n < seqlen.seqlen_k:
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(24)
                if warp_idx == 0:
                    loads = warp_mma.Ctx(mQ=mQ, mK=mK, mV=mV, mdO=mdO, mQt=mQt, mKt=mKt, mdOt=mdOt,
                                         mLSE2=mLSE2, mD=mD, mDOs=mDOs, atoms=atoms)
                    self.load_fp8(loads, smem, pipe_kv, pipe_qdo, seqlen, work)
                if warp_idx == 1:
                    self.wait_for_preprocess()
                    self.dq_writer(mdQaccum, smem, seqlen, work)
            else:
                cute.arch.setmaxregister_increase(240)
                self.wait_for_preprocess()
                ctx = self.consumer_setup(smem, scales, args)
                kv = work.kv_head
                ctx.descales = (mQd[batch, kv], mKd[batch, kv], mVd[batch, kv])
                ctx.sdS_raw = smem.sdS_raw
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
                self.consumer_tile(ctx, mdK, mdV, pipes, seqlen, work, scales, kv_state, state)

    # ------------------------------------------------------------------------------------------
    # Producer
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_fp8(self, L, smem, pipe_kv, pipe_qdo, seqlen, work):
        """K, K^T, V once; then per (query head, query block) in the consumers' order Q, Q^T, dO,
        dO^T (TMA) and the LSE2 / D / dO-descale rows (bulk copies), one barrier per stage."""
        _, tma_K, tma_V, _, _, tma_Kt, _ = L.atoms
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        waits.acquire_empty(pipe_kv, kv_state, self.spin_waits)
        bar = pipe_kv.producer_get_barrier(kv_state)
        d, tn = self.hdim, self.tile_n
        head_kv, batch = work.kv_head, work.batch
        for mT, tma, sT, box, coord in ((seqlen.k_rows(L.mK, head_kv, batch), tma_K, smem.sK, (tn, d),
                                         (work.n_block, 0)),
                                        (self.kt_rows(L.mKt, seqlen, head_kv, batch), tma_Kt, smem.sKt,
                                         (d, tn), (0, work.n_block)),
                                        (seqlen.k_rows(L.mV, head_kv, batch), tma_V, smem.sV, (tn, d),
                                         (work.n_block, 0))):
            self.tma_tile(tma, mT, sT, box, coord, bar, None)
        self.wait_for_preprocess()
        bulk = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        total = self.num_work_items(work)
        for it in cutlass.range(total, unroll=1):
            head, m_block = self.work_item(work, it)
            waits.acquire_empty(pipe_qdo, state, self.spin_waits)
            self.load_qdo(L, smem, seqlen, head, batch, m_block, pipe_qdo.producer_get_barrier(state),
                          state.index, bulk)
            state.advance()

    def load_qdo(self, L, smem, seqlen, head: Int32, batch: Int32, m_block: Int32, bar, stage: Int32,
                 bulk) -> None:
        """One Q/dO stage: Q, Q^T, dO, dO^T of (head, m_block) by TMA and its LSE2 / D /
        dO-descale rows by bulk copies, all counted on ``bar``. (A plain call: the views it
        builds are not loop-carried values of the producer's loop.)"""
        tma_Q, _, _, tma_dO, tma_Qt, _, tma_dOt = L.atoms
        d, tm = self.hdim, self.tile_m
        for mT, tma, sT, box, coord in (
                (seqlen.q_rows(L.mQ, head, batch), tma_Q, smem.sQ, (tm, d), (m_block, 0)),
                (self.qt_rows(L.mQt, seqlen, head, batch), tma_Qt, smem.sQt, (d, tm), (0, m_block)),
                (seqlen.q_rows(L.mdO, head, batch), tma_dO, smem.sdO, (tm, d), (m_block, 0)),
                (self.qt_rows(L.mdOt, seqlen, head, batch), tma_dOt, smem.sdOt, (d, tm), (0, m_block))):
            self.tma_tile(tma, mT, sT, box, coord, bar, stage)
        with cute.arch.elect_one():
            for mT, sT in ((L.mLSE2, smem.sLSE2), (L.mD, smem.sDsum), (L.mDOs, smem.sDOs)):
                rows = scratch.scratch_rows(mT, seqlen, head, batch, tm)
                cute.copy(bulk, cute.local_tile(rows, (tm,), (m_block,)), sT[None, stage], mbar_ptr=bar)

    def qt_rows(self, mT: cute.Tensor, seqlen, head: Int32, batch: Int32) -> cute.Tensor:
        """(d, tokens) view of Q^T / dO^T for one head: packed, from the sequence's first padded
        scratch row (where the launcher's copy starts it, so each 16 queries of a block keep the
        kernel's order)."""
        if cutlass.const_expr(seqlen.varlen_q):
            return cute.domain_offset((0, scratch.padded_offset_q(seqlen, batch, self.tile_m)),
                                      mT[None, None, head])
        return mT[None, None, head, batch]

    def kt_rows(self, mT: cute.Tensor, seqlen, head: Int32, batch: Int32) -> cute.Tensor:
        """(d, keys) view of K^T for one kv head. Packed: the launcher's copy starts sequence b at
        (cu_k[b] + b tile_n) // tile_n * tile_n, as the scratch rows do queries -- a TMA box's
        first token must sit on 16 bytes, which packed offsets do not."""
        if cutlass.const_expr(seqlen.varlen_k):
            tn = self.tile_n
            start = cute.assume((seqlen.offset_k + batch * tn) // tn * tn, divby=tn)
            return cute.domain_offset((0, start), mT[None, None, head])
        return mT[None, None, head, batch]

    @staticmethod
    def tma_tile(tma, mT: cute.Tensor, sT: cute.Tensor, box: tuple, coord: tuple, bar, stage) -> None:
        """TMA of the ``box`` tile at ``coord`` of the 2D ``mT`` into ``sT`` (its ``stage``, or the
        whole tile for None), counted on ``bar``."""
        gT = cute.local_tile(mT, box, coord)
        s, g = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(sT, 0, 2),
                                     cute.group_modes(gT, 0, 2))
        cute.copy(tma, g, s if stage is None else s[None, stage], tma_bar_ptr=bar)

    # ------------------------------------------------------------------------------------------
    # Consumers
    # ------------------------------------------------------------------------------------------
    def consumer_ctx(self, smem, tidx):
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_sdp = self.mma_sdp.get_slice(tidx)
        thr_dkv = self.mma_dkv.get_slice(tidx)
        thr_dq = self.mma_dq.get_slice(tidx)
        wg_sdp, wg_dkv, wg_dq = (m.get_slice(wg * 128) for m in (self.mma_sdp, self.mma_dkv, self.mma_dq))
        return warp_mma.Ctx(
            thr_sdp=thr_sdp, thr_dq=thr_dq, thr_dkv=thr_dkv,
            tSrK=wg_sdp.make_fragment_A(wg_sdp.partition_A(smem.sK)),
            tSrQ=wg_sdp.make_fragment_B(wg_sdp.partition_B(smem.sQ)),
            tdPrV=wg_sdp.make_fragment_A(wg_sdp.partition_A(smem.sV)),
            tdPrdO=wg_sdp.make_fragment_B(wg_sdp.partition_B(smem.sdO)),
            tdVrdOt=wg_dkv.make_fragment_B(wg_dkv.partition_B(smem.sdOt)),
            tdKrQt=wg_dkv.make_fragment_B(wg_dkv.partition_B(smem.sQt)),
            tdQrdS=wg_dq.make_fragment_A(wg_dq.partition_A(smem.sdS)),
            tdQrKt=wg_dq.make_fragment_B(wg_dq.partition_B(smem.sKt)),
            acc_dK=cute.make_rmem_tensor(thr_dkv.partition_shape_C((self.tile_n, self.hdim)), Float32),
            acc_dV=cute.make_rmem_tensor(thr_dkv.partition_shape_C((self.tile_n, self.hdim)), Float32),
            tScS=acc_to_mn(thr_sdp.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m)))))

    @cute.jit
    def consumer_tile(self, ctx, mdK, mdV, pipes, seqlen, work, scales, kv_state, state, do_state=None):
        """One K/V tile: the descales into the exp2 scale, the running maxima reset, every (query
        head, query block) that sees the tile, then the dK / dV epilogue."""
        q_d, k_d, v_d = ctx.descales
        ctx.scale_log2 = scales[2] * q_d * k_d
        ctx.v_descale, ctx.k_descale, ctx.q_descale = v_d, k_d, q_d
        # [0]: P~'s running maximum (of s_do), [1]: dS's.
        ctx.running = cute.make_rmem_tensor(2, Float32)
        ctx.running.fill(RUNNING_MAX_FLOOR)
        super().consumer_tile(ctx, mdK, mdV, pipes, seqlen, work, scales, kv_state, state)

    @cute.jit
    def one_m_block(self, ctx, pipes, state, head: Int32, m_block: Int32, v_state, do_state=None):
        acc_S = cute.make_rmem_tensor(ctx.thr_sdp.partition_shape_C((self.tile_n, self.tile_m)), Float32)
        acc_dP = cute.make_rmem_tensor(ctx.thr_sdp.partition_shape_C((self.tile_n, self.tile_m)), Float32)
        waits.wait_full(pipes.q, state, self.spin_waits)
        s = state.index
        wg_gemm(self.mma_sdp, acc_S, ctx.tSrK, ctx.tSrQ[None, None, None, s], zero_init=True, wg_wait=-1)
        wg_gemm(self.mma_sdp, acc_dP, ctx.tdPrV, ctx.tdPrdO[None, None, None, s], zero_init=True, wg_wait=1)
        self.probs(ctx, acc_S, ctx.smem.sLSE2[None, s], m_block, None, head)
        warpgroup.wait_group(0)
        sDOs = ctx.smem.sDOs[None, s]
        amax = self.fp8_dscores(ctx, acc_S, acc_dP, sDOs, ctx.smem.sDsum[None, s])
        rP = self.quantize_p(ctx, acc_S, sDOs)
        wg_gemm(self.mma_dkv, ctx.acc_dV, self.a_operand(rP), ctx.tdVrdOt[None, None, None, s],
                zero_init=False, wg_wait=-1)
        rdS, ds_descale = self.quantize_ds(ctx, acc_dP, amax)
        cute.arch.fence_view_async_shared()  # generic-proxy writes before wgmma reads them
        cute.arch.barrier(barrier_id=BAR_DS_FULL, number_of_threads=self.num_mma_threads)
        # dQ before dK: once dV and dQ are done, dQ's tile goes to the writer warp under dK.
        acc_dQ = cute.make_rmem_tensor(ctx.thr_dq.partition_shape_C(dq_acc_shape(self.tile_m, self.hdim)),
                                       Float32)
        wg_gemm(self.mma_dq, acc_dQ, ctx.tdQrdS, ctx.tdQrKt, zero_init=True, wg_wait=-1)
        wg_gemm(self.mma_dkv, ctx.acc_dK, self.a_operand(rdS), ctx.tdKrQt[None, None, None, s],
                zero_init=False, wg_wait=1)
        f = ds_descale * ctx.k_descale
        for i in cutlass.range_constexpr(cute.size(acc_dQ)):
            acc_dQ[i] = acc_dQ[i] * f
        self.store_dq(ctx, acc_dQ, head, m_block)
        warpgroup.wait_group(0)
        pipes.q.consumer_release(state)

    def to_a_fragment(self, r8: cute.Tensor) -> None:
        """e4m3 codes in accumulator order -> the k32 A fragment's: with Q^T / dO^T in the kernel's
        query order (``formats.V_PERM16``) a byte merge within each lane."""
        merge_own_p(r8, self.tile_m // 32)

    def a_operand(self, r8: cute.Tensor) -> cute.Tensor:
        """Exchanged e4m3 registers as the k32 RS wgmma's A: ((4 tokens, 2 rows, 2 halves), M, K / 32)."""
        return cute.make_tensor(r8.iterator, cute.make_layout(((4, 2, 2), 1, self.tile_m // 32)))

    @cute.jit
    def fp8_dscores(self, ctx, acc_S, acc_dP, sDOs, sDsum) -> Float32:
        """dS^T = P^T * (dP^T * v_descale * s_do[query] - D[query]) into ``acc_dP``; returns this
        thread's amax of it."""
        p = acc_to_mn(acc_S)
        dp = acc_to_mn(acc_dP)
        # Four running maxima, not one chain of dependent FMNMX.
        part = [Float32(0.0)] * 4
        for c in cutlass.range_constexpr(cute.size(dp, mode=[1])):
            query = self.stat_query(ctx, c)
            f = ctx.v_descale * sDOs[query]
            dsum = sDsum[query]
            for r in cutlass.range_constexpr(cute.size(dp, mode=[0])):
                x = p[r, c] * (dp[r, c] * f - dsum)
                dp[r, c] = x
                j = (c * cute.size(dp, mode=[0]) + r) % 4
                part[j] = cute.arch.fmax(part[j], cute.arch.fmax(x, -x))
        return cute.arch.fmax(cute.arch.fmax(part[0], part[1]), cute.arch.fmax(part[2], part[3]))

    @cute.jit
    def quantize_p(self, ctx, acc_S, sDOs) -> cute.Tensor:
        """P~ = P * s_do[query] in e4m3 against the running maximum of max s_do (``running[0]``:
        P <= 1, with ``P_HEADROOM``, bounds P~ by it), the dV accumulator rescaled where that
        maximum grows; returns the A fragment registers."""
        p = acc_to_mn(acc_S)
        part = [Float32(0.0)] * 4
        for c in cutlass.range_constexpr(cute.size(p, mode=[1])):
            part[c % 4] = cute.arch.fmax(part[c % 4], sDOs[self.stat_query(ctx, c)])
        top = cute.arch.fmax(cute.arch.fmax(part[0], part[1]), cute.arch.fmax(part[2], part[3]))
        # The quad's lanes hold every query of the block between them (the same in every warp).
        for off in (1, 2):
            top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=off))
        inv = self.grow_running(ctx, 0, top * P_HEADROOM, ctx.acc_dV)
        for c in cutlass.range_constexpr(cute.size(p, mode=[1])):
            f = sDOs[self.stat_query(ctx, c)] * inv
            for r in cutlass.range_constexpr(cute.size(p, mode=[0])):
                p[r, c] = p[r, c] * f
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        self.to_a_fragment(rP)
        return rP

    @cute.jit
    def grow_running(self, ctx, which: int, top: Float32, acc: cute.Tensor) -> Float32:
        """Raise running maximum ``which`` to ``top`` if above it, rescaling ``acc`` (idle: every
        GEMM of the previous block was waited for) into the new units; returns 448 / maximum."""
        running = ctx.running  # (a plain name: a ``Ctx`` cannot be carried through the ``if``)
        old = running[which]
        if top > old:
            f = old / top
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = acc[i] * f
            running[which] = top
        return Float32(E4M3_MAX) / running[which]

    @cute.jit
    def quantize_ds(self, ctx, acc_dS, amax: Float32):
        """dS^T in e4m3 against the running maximum of the CTA's tile amax (``running[1]``: the
        warps' amax meet in smem at the dS EMPTY barrier, where both warpgroups' previous dQ GEMMs
        are done with sdS); the dK accumulator rescaled where it grows. Stores dS (keys contiguous)
        for dQ and returns (the exchanged A registers, the block's dS descale)."""
        for off in (16, 8, 4, 2, 1):
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off))
        warp = ctx.tidx // 32
        sAmax = ctx.smem.sAmax
        if cute.arch.lane_idx() == 0:
            sAmax[warp] = amax
        cute.arch.barrier(barrier_id=BAR_DS_EMPTY, number_of_threads=self.num_mma_threads)
        top = sAmax[0]
        for w in cutlass.range_constexpr(1, self.num_mma_threads // 32):
            top = cute.arch.fmax(top, sAmax[w])
        inv = self.grow_running(ctx, 1, top, ctx.acc_dK)
        for i in cutlass.range_constexpr(cute.size(acc_dS)):
            acc_dS[i] = acc_dS[i] * inv
        rdS = cute.make_rmem_tensor_like(acc_dS, self.dtype)
        rdS.store(acc_dS.load().to(self.dtype))
        self.store_ds_bytes(ctx, acc_to_mn(rdS))
        self.to_a_fragment(rdS)
        return rdS, ctx.running[1] / Float32(E4M3_MAX)

    @cute.jit
    def store_ds_bytes(self, ctx, codes: cute.Tensor) -> None:
        """dS^T's e4m3 codes (accumulator order: rows r = key halves, columns c = 2 j + e, query
        8 j + 2 q + e) into the (queries, keys) tile, one byte each. The tile is 128 keys wide,
        swizzled S<3,4,3> (offset o = query * 128 + key, bits 7-9 XOR-ed into bits 4-6): query
        8 j + x has x's swizzle 1024 j bytes further, so four base addresses per thread and
        immediate offsets serve all of its stores (per-element addresses stay live across the
        loop and spill)."""
        for r in cutlass.range_constexpr(cute.size(codes, mode=[0])):
            for e in cutlass.range_constexpr(2):
                key, query = ctx.tScS[r, e]
                o = query * self.tile_n + key
                base = o ^ ((o >> 3) & 0x70)
                for j in cutlass.range_constexpr(cute.size(codes, mode=[1]) // 2):
                    byte = cute.make_tensor(ctx.sdS_raw + base + 1024 * j, cute.make_layout(1))
                    byte[0] = codes[r, 2 * j + e]

    # ------------------------------------------------------------------------------------------
    # Epilogue
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def epilogue(self, ctx, mdK, mdV, softmax_scale):
        """dK = softmax_scale * q_descale * (dS scale) * acc, dV = (P~ scale) * acc, each through
        the 16-bit smem tile ``sE``, then 16-byte row stores of the keys that exist."""
        coords = ctx.thr_dkv.partition_C(cute.make_identity_tensor((self.tile_n, self.hdim)))
        k_scale = softmax_scale * ctx.q_descale * ctx.running[1] / Float32(E4M3_MAX)
        v_scale = ctx.running[0] / Float32(E4M3_MAX)
        rows_left = ctx.seqlen.seqlen_k - ctx.n_block * self.tile_n
        copy = warp_mma.r2g_tiled_copy(self.o_dtype, self.hdim, self.num_mma_threads)
        nthr = self.num_mma_threads
        for acc, scale, mT in ((ctx.acc_dK, k_scale, mdK), (ctx.acc_dV, v_scale, mdV)):
            cute.arch.barrier(barrier_id=self.epilogue_barrier, number_of_threads=nthr)
            for i in cutlass.range_constexpr(cute.size(acc)):
                a, b = coords[i]
                ctx.smem.sE[a, b] = (acc[i] * scale).to(self.o_dtype)
            cute.arch.barrier(barrier_id=self.epilogue_barrier, number_of_threads=nthr)
            gT = cute.local_tile(ctx.seqlen.k_rows(mT, ctx.head_kv, ctx.batch), (self.tile_n, self.hdim),
                                 (ctx.n_block, 0))
            warp_mma.store_rows(copy, copy.get_slice(ctx.tidx), ctx.smem.sE, gT, self.tile_n, self.hdim,
                                rows_left)
