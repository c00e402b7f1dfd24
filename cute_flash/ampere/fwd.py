"""FlashAttention-2 forward for sm80 (runs on sm80+ with sm80 instructions only).

One CTA owns ``tile_m`` query rows of one (batch, head) and walks the K/V blocks from the last
to the first (the last one is the only partial one, so it is peeled and masked first). Each
warp owns whole query rows (split-Q): the row max/sum need only quad shuffles, never shared
memory. Loads are cp.async into swizzled shared memory (no bank conflicts for ldmatrix): V(j)
streams in while S = Q K(j)^T and the softmax run, K(j-1) while O += P V(j) runs. P stays in
registers: the fp32 C fragment of QK^T converted to 16 bit is exactly the A fragment of PV.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp
from cutlass.memory import SmemAllocator

from cute_flash import jit
from cute_flash.device import warp_mma
from cute_flash.device.block_info import BlockInfo
from cute_flash.device.layout import acc_to_frgA, transpose_smem
from cute_flash.device.mask import AttentionMask
from cute_flash.device.mods import apply_mods, block_range
from cute_flash.device.seqlen import SeqlenInfo
from cute_flash.device.sinks import row_sinks
from cute_flash.device.softmax import OnlineSoftmax, score_scales


class FlashFwdSm80:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.dtype = jit.DTYPES[cfg.dtype]
        self.hdim, self.hdim_v = cfg.hdim, cfg.hdim_v
        self.tile_m, self.tile_n, self.num_threads, self.num_stages = cfg.tiles
        self.is_causal, self.is_local = cfg.causal, cfg.local
        self.has_softcap, self.varlen = cfg.softcap, cfg.varlen
        self.has_sinks = cfg.sinks
        self.mods = cfg.mods
        self.prefetch = True
        # Packed GQA (the KV-cache kernel): tile row r is token r // pack of query head r % pack.
        self.pack = 1

    # ------------------------------------------------------------------------------------------
    # Host side: layouts, copies, MMAs, launch
    # ------------------------------------------------------------------------------------------
    def _setup(self) -> None:
        self.sQ_layout = warp_mma.smem_tile(self.dtype, self.tile_m, self.hdim)
        self.sK_layout = warp_mma.smem_tile(self.dtype, self.tile_n, self.hdim, self.num_stages)
        self.sV_layout = warp_mma.smem_tile(self.dtype, self.tile_n, self.hdim_v, self.num_stages)
        self.sO_layout = warp_mma.smem_tile(self.dtype, self.tile_m, self.hdim_v)
        self.copy_QK = warp_mma.g2s_tiled_copy(self.dtype, self.hdim, self.num_threads)
        self.copy_V = warp_mma.g2s_tiled_copy(self.dtype, self.hdim_v, self.num_threads)
        self.copy_O = warp_mma.r2g_tiled_copy(self.dtype, self.hdim_v, self.num_threads)
        self.mma = warp_mma.warp_tiled_mma(self.dtype, self.num_threads // 32)

    def _storage(self):
        sq = max(cute.cosize(self.sQ_layout), cute.cosize(self.sO_layout))

        @cute.struct
        class Storage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, sq], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sV_layout)], 1024]

        return Storage

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
                 softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                 max_seqlen_q: Int32, mSinks: cute.Tensor | None, mAux0: cute.Tensor | None,
                 mAux1: cute.Tensor | None, mAux2: cute.Tensor | None, mAux3: cute.Tensor | None,
                 mBlocks: cute.Tensor | None, stream):
        """``mSinks``: (H,) fp32 sink logits (``device/sinks.py``), or None; ``mAux*``: the mods'
        aux tensors (``device/mods.py``), None past the last; ``mBlocks``: a block mask's ranges
        (``block_mask.py``), or None."""
        aux = tuple(a for a in (mAux0, mAux1, mAux2, mAux3) if a is not None)
        self._setup()
        Storage = self._storage()
        mQ, mK, mV, mO, mLSE = warp_mma.forward_views(mQ, mK, mV, mO, mLSE)
        num_batch, seqlen_q = warp_mma.grid_rows(mQ, mCuSeqlensQ, max_seqlen_q)
        score_scale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap,
                                               self.mods is not None and self.mods.score_mod is not None)
        grid = (cute.ceil_div(seqlen_q, self.tile_m), mQ.shape[2], num_batch)
        self.kernel(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, score_scale, scale_log2,
                    window_left, window_right, mSinks, aux, mBlocks, Storage).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
               score_scale: Float32, scale_log2: Float32, window_left: Int32, window_right: Int32,
               mSinks: cute.Tensor | None, aux: tuple, mBlocks: cute.Tensor | None,
               Storage: cutlass.Constexpr):
        # Layouts, copies and MMAs are rebuilt here: values made on the host side would live
        # outside the kernel's IR region.
        self._setup()
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen = SeqlenInfo(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK)
        # Varlen grids are sized by the longest sequence; shorter ones leave CTAs with no rows.
        if m_block * self.tile_m < seqlen.seqlen_q:
            self.attend_tile(mQ, mK, mV, mO, mLSE, seqlen, score_scale, scale_log2, window_left,
                             window_right, Storage, tidx, m_block, head, batch, mSinks, aux, mBlocks)

    @cute.jit
    def attend_tile(self, mQ, mK, mV, mO, mLSE, seqlen: SeqlenInfo, score_scale, scale_log2,
                    window_left, window_right, Storage: cutlass.Constexpr, tidx, m_block, head, batch,
                    mSinks: cute.Tensor | None, aux: tuple, mBlocks: cute.Tensor | None = None):
        # GQA/MQA: query head h reads kv head h // (H / H_kv); no K/V copies.
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        gQ = cute.local_tile(seqlen.q_rows(mQ, head, batch), (self.tile_m, self.hdim), (m_block, 0))
        gK = cute.local_tile(seqlen.k_rows(mK, head_kv, batch), (self.tile_n, self.hdim), (None, 0))
        gV = cute.local_tile(seqlen.k_rows(mV, head_kv, batch), (self.tile_n, self.hdim_v), (None, 0))

        storage = SmemAllocator().allocate(Storage)
        sQ = storage.sQ.get_tensor(self.sQ_layout)
        sK = storage.sK.get_tensor(self.sK_layout)
        sV = storage.sV.get_tensor(self.sV_layout)
        sVt = transpose_smem(sV)

        thr_copy_QK = self.copy_QK.get_slice(tidx)
        thr_copy_V = self.copy_V.get_slice(tidx)
        tKgK, tKsK = thr_copy_QK.partition_S(gK), thr_copy_QK.partition_D(sK)
        tVgV, tVsV = thr_copy_V.partition_S(gV), thr_copy_V.partition_D(sV)
        tKcK = thr_copy_QK.partition_S(cute.make_identity_tensor((self.tile_n, self.hdim)))
        tVcV = thr_copy_V.partition_S(cute.make_identity_tensor((self.tile_n, self.hdim_v)))

        thr_mma = self.mma.get_slice(tidx)
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0]))
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0]))
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.hdim_v)), Float32)
        acc_O.fill(0.0)

        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        s2r_Q = cute.make_tiled_copy_A(ldsm, self.mma).get_slice(tidx)
        s2r_K = cute.make_tiled_copy_B(ldsm, self.mma).get_slice(tidx)
        s2r_V = cute.make_tiled_copy_B(ldsm_t, self.mma).get_slice(tidx)
        tSsQ, tSsK, tOsVt = s2r_Q.partition_S(sQ), s2r_K.partition_S(sK), s2r_V.partition_S(sVt)

        block_info = BlockInfo(self.tile_m, self.tile_n, self.is_causal, self.is_local,
                               window_left, window_right, pack=self.pack)
        n_block_min, n_block_max = self.block_range(block_info, seqlen, m_block)
        full = None
        if cutlass.const_expr(mBlocks is not None):
            ranges = block_range(mBlocks, batch, head, m_block, n_block_min, n_block_max)
            n_block_min, n_block_max, full = ranges[0], ranges[1], ranges[2:]
        mask = AttentionMask(self.tile_m, self.tile_n, seqlen, window_left, window_right, pack=self.pack)
        softmax = OnlineSoftmax(scale_log2, cute.size(acc_O, mode=[0, 0]) * cute.size(acc_O, mode=[1]))
        softmax.reset()

        ctx = warp_mma.Ctx(
            thr_mma=thr_mma, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, acc_O=acc_O, s2r_Q=s2r_Q, s2r_K=s2r_K,
            s2r_V=s2r_V, tSsQ=tSsQ, tSsK=tSsK, tOsVt=tOsVt, tKgK=tKgK, tKsK=tKsK, tVgV=tVgV, tVsV=tVsV,
            tKcK=tKcK, tVcV=tVcV, softmax=softmax, mask=mask, seqlen=seqlen, m_block=m_block,
            n_block_min=n_block_min, n_block_last=n_block_max - 1, score_scale=score_scale, head=head,
            batch=batch, aux=aux, full=full)

        # Prologue: Q and the last (possibly partial) K block in flight together.
        warp_mma.load_rows(self.copy_QK, thr_copy_QK, gQ, sQ, self.tile_m, self.hdim,
                           seqlen.seqlen_q * self.pack - m_block * self.tile_m, tidx)
        if n_block_max > n_block_min:
            self.load_K(ctx, n_block_max - 1, 0, partial=True)
        cute.arch.cp_async_commit_group()

        right_start = block_info.n_block_right_mask_start(seqlen, m_block, n_block_min)
        left_end = block_info.n_block_left_mask_end(seqlen, m_block, n_block_min)
        if n_block_max > n_block_min:
            self.mainloop(ctx, n_block_max, right_start, left_end)

        sinks = None
        if cutlass.const_expr(self.has_sinks):
            sinks = row_sinks(mSinks, thr_mma, self.tile_m, self.hdim_v, head, self.pack,
                              cute.size(softmax.row_max))
        row_scale = softmax.finalize(sinks=sinks)
        OnlineSoftmax.rescale(acc_O, row_scale)
        self.epilogue(ctx, mO, mLSE, sQ, tidx, head, batch)

    def block_range(self, block_info: BlockInfo, seqlen: SeqlenInfo, m_block):
        """(first, last + 1) K/V block of this tile (the KV-cache kernel's splits take a share)."""
        return block_info.n_block_min_max(seqlen, m_block)

    @cute.jit
    def mainloop(self, ctx, n_block_max: Int32, right_start: Int32, left_end: Int32):
        """K/V blocks from last to first: masked edge blocks, then the unmasked interior."""
        n_block_min = ctx.n_block_min
        # The first block visited: always masked (sequence end, and the causal/window edge).
        self.one_block(ctx, n_block_max - 1, is_first=True, partial=True,
                       mask_right=self.is_causal or self.is_local, mask_left=self.is_local)
        n_block = n_block_max - 2
        if cutlass.const_expr(self.is_causal or self.is_local):
            # Blocks on the diagonal band: masked on the right (and left for narrow windows).
            lo = cutlass.max(right_start, n_block_min)
            for _ in cutlass.range(n_block - lo + 1, unroll=1):
                self.one_block(ctx, n_block, is_first=False, partial=False, mask_right=True,
                               mask_left=self.is_local)
                n_block -= 1
        # Interior blocks: no mask at all.
        lo = cutlass.max(left_end, n_block_min)
        for _ in cutlass.range(n_block - lo + 1, unroll=1):
            self.one_block(ctx, n_block, is_first=False, partial=False, mask_right=False,
                           mask_left=False)
            n_block -= 1
        if cutlass.const_expr(self.is_local):
            # Left edge of the window.
            for _ in cutlass.range(n_block - n_block_min + 1, unroll=1):
                self.one_block(ctx, n_block, is_first=False, partial=False, mask_right=False,
                               mask_left=True)
                n_block -= 1

    @cute.jit
    def load_K(self, ctx, n_block: Int32, stage: Int32, partial: cutlass.Constexpr[bool]):
        warp_mma.load_block(self.copy_QK, ctx.tKgK[None, None, None, n_block],
                            ctx.tKsK[None, None, None, stage], ctx.tKcK,
                            ctx.seqlen.seqlen_k - n_block * self.tile_n, partial, zero_fill=False)

    @cute.jit
    def load_V(self, ctx, n_block: Int32, stage: Int32, partial: cutlass.Constexpr[bool]):
        # V rows past the sequence end must be zeros, not stale smem: P is 0 there but 0 * NaN
        # would still poison O.
        warp_mma.load_block(self.copy_V, ctx.tVgV[None, None, None, n_block],
                            ctx.tVsV[None, None, None, stage], ctx.tVcV,
                            ctx.seqlen.seqlen_k - n_block * self.tile_n, partial, zero_fill=True)

    @cute.jit
    def one_block(self, ctx, n_block: Int32, is_first: cutlass.Constexpr[bool],
                  partial: cutlass.Constexpr[bool], mask_right: cutlass.Constexpr[bool],
                  mask_left: cutlass.Constexpr[bool]):
        two_stage = cutlass.const_expr(self.num_stages == 2)
        stage = Int32(0)
        if cutlass.const_expr(two_stage):
            stage = (ctx.n_block_last - n_block) & 1
        acc_S = cute.make_rmem_tensor(ctx.thr_mma.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_S.fill(0.0)
        # K(n) has landed and every warp is done with block n+1: V(n) may overwrite V's buffer.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        self.load_V(ctx, n_block, stage, partial)
        cute.arch.cp_async_commit_group()
        if cutlass.const_expr(two_stage):
            # Two K buffers: K(n-1) streams in during this whole block, not just during PV.
            if n_block > ctx.n_block_min:
                self.load_K(ctx, n_block - 1, stage ^ 1, partial=False)
            cute.arch.cp_async_commit_group()

        warp_mma.gemm_ss(self.mma, acc_S, ctx.tSrQ, ctx.tSrK, ctx.tSsQ, ctx.tSsK[None, None, None, stage],
                         ctx.s2r_Q, ctx.s2r_K, prefetch=self.prefetch)
        if cutlass.const_expr(self.mods is not None):
            apply_mods(self.mods, acc_S, ctx.thr_mma, self.tile_m, self.tile_n, ctx.m_block, n_block,
                       ctx.batch, ctx.head, self.pack, ctx.seqlen.seqlen_q, ctx.seqlen.seqlen_k, ctx.aux,
                       ctx.score_scale, ctx.full)
        if cutlass.const_expr(self.has_softcap):
            for i in cutlass.range(cute.size(acc_S), unroll_full=True):
                acc_S[i] = cute.math.tanh(acc_S[i] * ctx.score_scale, fastmath=True)
        if cutlass.const_expr(partial or mask_right or mask_left):
            ctx.mask.apply_mask(acc_S, ctx.thr_mma, ctx.m_block, n_block, mask_seqlen=partial,
                                mask_causal=mask_right and self.is_causal,
                                mask_local=(mask_right or mask_left) and self.is_local)
        row_scale = ctx.softmax.online_softmax(acc_S, is_first=is_first)
        if cutlass.const_expr(not is_first):
            OnlineSoftmax.rescale(ctx.acc_O, row_scale)
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))

        # V(n) has landed (K(n-1) may still be in flight with two stages) and every warp is done
        # with K(n): with one stage, K(n-1) may now overwrite it.
        cute.arch.cp_async_wait_group(1 if two_stage else 0)
        cute.arch.barrier()
        if cutlass.const_expr(not two_stage):
            if n_block > ctx.n_block_min:
                self.load_K(ctx, n_block - 1, 0, partial=False)
            cute.arch.cp_async_commit_group()
        warp_mma.gemm_rs(self.mma, ctx.acc_O, acc_to_frgA(rP), ctx.tOrVt, ctx.tOsVt[None, None, None, stage],
                         ctx.s2r_V, prefetch=self.prefetch)

    @cute.jit
    def epilogue(self, ctx, mO, mLSE, sQ, tidx, head, batch):
        seqlen = ctx.seqlen
        rows_left = seqlen.seqlen_q * self.pack - ctx.m_block * self.tile_m
        # LSE: the lane holding column 0 of a row writes it.
        gLSE = cute.local_tile(seqlen.q_vec(mLSE, head, batch), (self.tile_m,), (ctx.m_block,))
        ctx.softmax.store_lse(ctx.thr_mma, gLSE, self.tile_m, self.hdim_v, rows_left)

        # O: registers -> smem (reusing Q's buffer) -> 16-byte coalesced global stores.
        rO = cute.make_rmem_tensor_like(ctx.acc_O, self.dtype)
        rO.store(ctx.acc_O.load().to(self.dtype))
        sO = cute.make_tensor(sQ.iterator, self.sO_layout)
        # Every warp is done reading Q, and no cp.async into sQ is still in flight: a CTA whose
        # rows see no key at all ran no block, so its Q load was never waited on.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype),
                                     self.mma).get_slice(tidx)
        cute.copy(r2s, r2s.retile(rO), r2s.partition_D(sO))
        cute.arch.barrier()
        gO = cute.local_tile(seqlen.q_rows(mO, head, batch), (self.tile_m, self.hdim_v), (ctx.m_block, 0))
        warp_mma.store_rows(self.copy_O, self.copy_O.get_slice(tidx), sO, gO, self.tile_m, self.hdim_v,
                            rows_left)


