"""FlashAttention-2 backward for sm80 (runs on sm80+ with sm80 instructions only).

One CTA owns ``tile_n`` keys of one (batch, kv head) and keeps dK, dV for them in fp32 registers.
It walks the query blocks that can see those keys, for every q head of the kv head's group, and
per query block (rows i, keys j; LSE2 = LSE*log2e and D = rowsum(dO*O) come from the preprocess):

    S   = Q K^T                     (softcap: S <- tanh(S * scale / softcap))
    P   = exp2(S * c - LSE2)        c = scale*log2e (softcap: softcap*log2e); masked S = -inf
    dP  = dO V^T
    dS  = P * (dP - D)              (softcap: * (1 - tanh^2))
    dV += P^T dO,   dK += dS^T Q,   dQaccum += dS K   (fp32 reductions into global memory)

dK is scaled by ``softmax_scale`` in the epilogue, dQ in the postprocess (d s / d(q.k) = scale,
times 1 - tanh^2 with softcap).

Data movement: K, V are loaded once (rows past the sequence end zero-filled). Q (+LSE2) and dO
(+D) stream through cp.async buffers in swizzled smem. Double-buffered (``stages`` = 2): the next
block's Q and dO are issued right after P and dS are in smem -- the point of the iteration with
the fewest live registers -- into the other buffer, and land while dV, dQ, dK (and the next S)
run. Single-buffered (largest head dims, for smem): dO(next) once dV is done, Q(next) once dK is
done, hidden behind the dQ GEMM. P and dS go registers -> smem once (16 bit) and are read back
transposed with ``ldmatrix.trans`` as the A operand of dV/dK, and straight for dQ; K is read
transposed for dQ, Q and dO transposed for dK and dV. P stays fp32 in registers until dS is
formed (as in FA2): only its 16-bit copy feeds the dV GEMM.

Masking: per K/V block, only the query blocks on the causal diagonal / window edges (and all of
them when the K/V block is the partial one at the sequence end) apply the element-wise mask; the
choice is a uniform run-time branch, so the block body is compiled once. Rows past the query
sequence end need no mask: their LSE2 is +inf (P = 0) and their Q/dO rows are zero.

GQA/MQA: the CTA loops over the q heads of its group itself, accumulating their dK/dV in the
same registers. That is deterministic with no dK/dV atomics and no fp32 dK/dV buffers or extra
postprocess; the price is g times fewer, g times longer CTAs, which only hurts when
(K/V blocks x kv heads x batch) is below about two waves of SMs (short-sequence MQA).

dQ: each query block's dQ partial (tile_m x hdim) is added with ``red.global.add.f32`` into an
fp32 chunk stored in this MMA's fragment order (element i of thread t at i * num_threads + t), so
each warp-wide reduction instruction covers 128 contiguous bytes (4 sectors instead of 8 for a
row-major tile). ``dq_splits`` > 1 computes it in column slices to cap its registers.
Deterministic mode orders those reductions: a per-(query block, head, batch) semaphore lets K/V
block n add only after block n-1 (the previous block that sees this query block) has, so the fp32
sum is always formed in the same order. Cost: one acquire spin + 2 extra CTA barriers + a gpu
fence per block, and a skew between neighbouring K/V blocks (block n trails block n-1 by about
one query block), i.e. a pipeline fill of ~(number of K/V blocks per head) iterations.
"""


import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warp
from cutlass.memory import SmemAllocator

from cute_flash import jit
from cute_flash.device import scratch, warp_mma
from cute_flash.device.block_info import BlockInfo
from cute_flash.device.layout import acc_to_mn, transpose_smem
from cute_flash.device.mask import AttentionMask
from cute_flash.device.mods import aligned_grads, block_range, mod_grads, mod_scores_in_block
from cute_flash.device.seqlen import SeqlenInfo
from cute_flash.device.softmax import score_scales


def make_tiled_mmas(dtype, tiles):
    """(S/dP, dK/dV, dQ) tiled MMAs. The postprocess rebuilds the dQ one to read the accumulator
    back in the same fragment order, so it must only ever be built here."""
    warps = tiles.num_threads // 32

    def mma(rows_atoms: int):
        return warp_mma.warp_tiled_mma(dtype, warps, atom_layout=(rows_atoms, warps // rows_atoms, 1))

    return mma(tiles.atom_sdp), mma(tiles.atom_dkv), mma(tiles.atom_dq)


@cute.jit
def _apply_mask(mask, acc_S, thr_mma, m_block, n_block, causal: cutlass.Constexpr[bool],
                local: cutlass.Constexpr[bool]):
    # Causal/window masks include the sequence end; without them only the sequence end applies.
    mask.apply_mask(acc_S, thr_mma, m_block, n_block, mask_seqlen=True, mask_causal=causal,
                    mask_local=local)


class FlashBwdSm80:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.dtype = jit.DTYPES[cfg.dtype]
        self.hdim, self.hdim_v = cfg.hdim, cfg.hdim_v
        t = cfg.tiles
        self.tiles = t
        self.tile_m, self.tile_n, self.num_threads = t.tile_m, t.tile_n, t.num_threads
        # Q (+LSE2) and dO (+D) are both double-buffered or both single-buffered.
        assert t.stages in (1, 2)
        self.double_buffer = t.stages == 2
        self.stages = t.stages
        self.dq_splits = t.dq_splits
        assert self.hdim % self.dq_splits == 0
        self.is_causal, self.is_local = cfg.causal, cfg.local
        self.has_softcap, self.varlen, self.deterministic = cfg.softcap, cfg.varlen, cfg.deterministic
        self.mods = cfg.mods

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    def _layouts(self):
        d, dv, tm, tn = self.hdim, self.hdim_v, self.tile_m, self.tile_n
        return dict(
            sQ=warp_mma.smem_tile(self.dtype, tm, d, self.stages),
            sdO=warp_mma.smem_tile(self.dtype, tm, dv, self.stages),
            sK=warp_mma.smem_tile(self.dtype, tn, d),
            sV=warp_mma.smem_tile(self.dtype, tn, dv),
            sP=warp_mma.smem_tile(self.dtype, tm, tn),
            sLSE=cute.make_layout((tm, self.stages)),
            sD=cute.make_layout((tm, self.stages)),
        )

    def _storage(self):
        lay = self._layouts()

        def buf(name, dtype, align):
            return cute.struct.Align[cute.struct.MemRange[dtype, cute.cosize(lay[name])], align]

        @cute.struct
        class Storage:
            sK: buf("sK", self.dtype, 1024)
            sV: buf("sV", self.dtype, 1024)
            sQ: buf("sQ", self.dtype, 1024)
            sdO: buf("sdO", self.dtype, 1024)
            sP: buf("sP", self.dtype, 1024)
            sdS: buf("sP", self.dtype, 1024)
            sLSE: buf("sLSE", Float32, 16)
            sD: buf("sD", Float32, 16)

        return Storage

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
                 mSemaphore: cute.Tensor | None, softmax_scale: Float32, softcap: Float32,
                 window_left: Int32, window_right: Int32, max_seqlen_k: Int32,
                 mAux0: cute.Tensor | None, mAux1: cute.Tensor | None, mAux2: cute.Tensor | None,
                 mAux3: cute.Tensor | None, mAuxGrad0: cute.Tensor | None, mAuxGrad1: cute.Tensor | None,
                 mAuxGrad2: cute.Tensor | None, mAuxGrad3: cute.Tensor | None, mBlocks: cute.Tensor | None,
                 stream):
        """``mAux*`` / ``mAuxGrad*``: the mods' aux tensors and the gradients asked for (None past
        the last); ``mBlocks``: a block mask's ranges per K/V block (``block_mask.py``), or None."""
        Storage = self._storage()
        mQ, mK, mV, mdO, mdK, mdV = [warp_mma.to_seq_dim_head(t) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mLSE2, mD, mdQaccum = [warp_mma.lse_to_seq_head(t) for t in (mLSE2, mD, mdQaccum)]
        if cutlass.const_expr(mSemaphore is not None):
            mSemaphore = warp_mma.lse_to_seq_head(mSemaphore)
        if cutlass.const_expr(self.varlen):
            num_batch = mCuSeqlensK.shape[0] - 1
            seqlen_k = max_seqlen_k
        else:
            num_batch = mK.shape[3]
            seqlen_k = mK.shape[0]
        score_scale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap,
                                               self.mods is not None and self.mods.score_mod is not None)
        aux = tuple(a for a in (mAux0, mAux1, mAux2, mAux3) if a is not None)
        aux_grads = tuple(g for g in (mAuxGrad0, mAuxGrad1, mAuxGrad2, mAuxGrad3) if g is not None)
        # K/V block fastest: in deterministic mode block n waits on block n-1 of the same
        # (kv head, batch), which the in-order block dispatch has always started before it.
        grid = (cute.ceil_div(seqlen_k, self.tile_n), mK.shape[2], num_batch)
        self.kernel(mQ, mK, mV, mdO, mLSE2, mD, mdQaccum, mdK, mdV, mCuSeqlensQ, mCuSeqlensK,
                    mSemaphore, softmax_scale, score_scale, scale_log2, window_left, window_right, aux,
                    aux_grads, mBlocks, Storage).launch(grid=grid, block=[self.num_threads, 1, 1],
                                                        stream=stream)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
               mSemaphore: cute.Tensor | None, softmax_scale: Float32, score_scale: Float32,
               scale_log2: Float32, window_left: Int32, window_right: Int32, aux: tuple, aux_grads: tuple,
               mBlocks: cute.Tensor | None, Storage: cutlass.Constexpr):
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_kv, batch = cute.arch.block_idx()
        seqlen = SeqlenInfo(batch, mQ.shape[0], mK.shape[0], mCuSeqlensQ, mCuSeqlensK)
        # Varlen grids are sized by the longest sequence; shorter ones leave CTAs with no keys.
        if n_block * self.tile_n < seqlen.seqlen_k:
            ctx = self.make_ctx(mQ, mK, mV, mdO, mLSE2, mD, mdQaccum, mSemaphore, seqlen, Storage,
                                score_scale, scale_log2, window_left, window_right, tidx, n_block,
                                head_kv, batch, mBlocks)
            ctx.aux, ctx.aux_grads = aux, aligned_grads(self.mods, aux_grads)
            self.mainloop(ctx)
            self.epilogue(ctx, mdK, mdV, softmax_scale)

    @cute.jit
    def make_ctx(self, mQ, mK, mV, mdO, mLSE2, mD, mdQaccum, mSemaphore, seqlen: SeqlenInfo,
                 Storage: cutlass.Constexpr, score_scale, scale_log2, window_left, window_right, tidx,
                 n_block, head_kv, batch, mBlocks=None):
        """Smem views, copy/MMA partitions and accumulators of this CTA (all compile-time
        layouts plus a few addresses)."""
        lay = self._layouts()
        storage = SmemAllocator().allocate(Storage)
        sQ, sdO = storage.sQ.get_tensor(lay["sQ"]), storage.sdO.get_tensor(lay["sdO"])
        sK, sV = storage.sK.get_tensor(lay["sK"]), storage.sV.get_tensor(lay["sV"])
        sP, sdS = storage.sP.get_tensor(lay["sP"]), storage.sdS.get_tensor(lay["sP"])
        sLSE, sD = storage.sLSE.get_tensor(lay["sLSE"]), storage.sD.get_tensor(lay["sD"])
        sQt, sdOt, sKt, sPt, sdSt = [transpose_smem(t) for t in (sQ, sdO, sK, sP, sdS)]

        mma_sdp, mma_dkv, mma_dq = make_tiled_mmas(self.dtype, self.tiles)
        thr_sdp, thr_dkv, thr_dq = (m.get_slice(tidx) for m in (mma_sdp, mma_dkv, mma_dq))
        ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        ldsm_t = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype)
        s2r_sdp_A = cute.make_tiled_copy_A(ldsm, mma_sdp).get_slice(tidx)
        s2r_sdp_B = cute.make_tiled_copy_B(ldsm, mma_sdp).get_slice(tidx)
        s2r_dkv_A = cute.make_tiled_copy_A(ldsm_t, mma_dkv).get_slice(tidx)
        s2r_dkv_B = cute.make_tiled_copy_B(ldsm_t, mma_dkv).get_slice(tidx)
        s2r_dq_A = cute.make_tiled_copy_A(ldsm, mma_dq).get_slice(tidx)
        s2r_dq_B = cute.make_tiled_copy_B(ldsm_t, mma_dq).get_slice(tidx)
        # 32-bit stores of adjacent (col pair) 16-bit values of P / dS into smem.
        r2s_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                       num_bits_per_copy=2 * self.dtype.width)
        r2s_PdS = cute.make_tiled_copy_C(r2s_atom, mma_sdp).get_slice(tidx)

        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((self.tile_n, self.hdim)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((self.tile_n, self.hdim_v)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        block_info = BlockInfo(self.tile_m, self.tile_n, self.is_causal, self.is_local,
                               window_left, window_right)
        m_block_min, m_block_max = block_info.m_block_min_max(seqlen, n_block)
        full = None
        if cutlass.const_expr(mBlocks is not None):
            # (Per K/V head: the union over its query heads. Deterministic mode refuses block masks.)
            ranges = block_range(mBlocks, batch, head_kv, n_block, m_block_min, m_block_max)
            m_block_min, m_block_max, full = ranges[0], ranges[1], ranges[2:]
        # Previous K/V block's query range: in deterministic mode it says whether block n-1 added
        # into a query block before us (the ranges of consecutive K/V blocks overlap in one
        # interval because both bounds are non-decreasing in n).
        prev_min, prev_max = block_info.m_block_min_max(seqlen, n_block - 1)
        bounds = scratch.BwdMaskBounds(self.tile_m, self.tile_n, self.is_causal, self.is_local,
                                        window_left, window_right)
        right_end = bounds.right_mask_end(seqlen, n_block, m_block_min)
        left_start = bounds.left_mask_start(seqlen, n_block, m_block_max)

        return warp_mma.Ctx(
            seqlen=seqlen, tidx=tidx, n_block=n_block, head_kv=head_kv, batch=batch,
            mQ=mQ, mK=mK, mV=mV, mdO=mdO, mLSE2=mLSE2, mD=mD, mdQaccum=mdQaccum, mSemaphore=mSemaphore,
            sQ=sQ, sdO=sdO, sK=sK, sV=sV, sP=sP, sdS=sdS, sLSE=sLSE, sD=sD,
            mma_sdp=mma_sdp, mma_dkv=mma_dkv, mma_dq=mma_dq, thr_sdp=thr_sdp, thr_dq=thr_dq,
            r2s_PdS=r2s_PdS, s2r_sdp_A=s2r_sdp_A, s2r_sdp_B=s2r_sdp_B, s2r_dkv_A=s2r_dkv_A,
            s2r_dkv_B=s2r_dkv_B, s2r_dq_A=s2r_dq_A, s2r_dq_B=s2r_dq_B,
            # MMA operand fragments and their ldmatrix sources (per smem stage where staged)
            tSrQ=thr_sdp.make_fragment_A(thr_sdp.partition_A(sQ[None, None, 0])),
            tSrK=thr_sdp.make_fragment_B(thr_sdp.partition_B(sK)),
            tdPrdO=thr_sdp.make_fragment_A(thr_sdp.partition_A(sdO[None, None, 0])),
            tdPrV=thr_sdp.make_fragment_B(thr_sdp.partition_B(sV)),
            tdVrPt=thr_dkv.make_fragment_A(thr_dkv.partition_A(sPt)),
            tdVrdOt=thr_dkv.make_fragment_B(thr_dkv.partition_B(sdOt[None, None, 0])),
            tdKrdSt=thr_dkv.make_fragment_A(thr_dkv.partition_A(sdSt)),
            tdKrQt=thr_dkv.make_fragment_B(thr_dkv.partition_B(sQt[None, None, 0])),
            tdQrdS=thr_dq.make_fragment_A(thr_dq.partition_A(sdS)),
            tSsQ=s2r_sdp_A.partition_S(sQ), tSsK=s2r_sdp_B.partition_S(sK),
            tdPsdO=s2r_sdp_A.partition_S(sdO), tdPsV=s2r_sdp_B.partition_S(sV),
            tdVsPt=s2r_dkv_A.partition_S(sPt), tdVsdOt=s2r_dkv_B.partition_S(sdOt),
            tdKsdSt=s2r_dkv_A.partition_S(sdSt), tdKsQt=s2r_dkv_B.partition_S(sQt),
            tdQsdS=s2r_dq_A.partition_S(sdS), sKt=sKt,
            tPsP=r2s_PdS.partition_D(sP), tdSsdS=r2s_PdS.partition_D(sdS),
            # (row, col) of every S/dP accumulator element, as (rows, cols) of this thread
            tScS_mn=acc_to_mn(thr_sdp.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))),
            acc_dK=acc_dK, acc_dV=acc_dV,
            score_scale=score_scale, scale_log2=scale_log2,
            mask=AttentionMask(self.tile_m, self.tile_n, seqlen, window_left, window_right),
            m_block_min=m_block_min, m_block_max=m_block_max, prev_min=prev_min, prev_max=prev_max,
            right_end=right_end, left_start=left_start, full=full,
            # q heads of this kv head's group: [head_begin, head_begin + group)
            group=mQ.shape[2] // mK.shape[2],
        )

    # ------------------------------------------------------------------------------------------
    # Loads
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_KV(self, ctx):
        """K and V of this CTA, once; rows past the sequence end are zero-filled: their dP columns
        then stay finite and their dQ terms (dS * K) exactly zero."""
        seqlen = ctx.seqlen
        rows_left = seqlen.seqlen_k - ctx.n_block * self.tile_n
        for mT, sT, d in ((ctx.mK, ctx.sK, self.hdim), (ctx.mV, ctx.sV, self.hdim_v)):
            copy = warp_mma.g2s_tiled_copy(self.dtype, d, self.num_threads)
            thr = copy.get_slice(ctx.tidx)
            gT = cute.local_tile(seqlen.k_rows(mT, ctx.head_kv, ctx.batch), (self.tile_n, d),
                                 (ctx.n_block, 0))
            tc = thr.partition_S(cute.make_identity_tensor((self.tile_n, d)))
            warp_mma.load_block(copy, thr.partition_S(gT), thr.partition_D(sT), tc, rows_left,
                                partial=True, zero_fill=True)

    @cute.jit
    def load_rows_and_vec(self, ctx, mT, mVec, sT, sVec, d: int, head, m_block, slot):
        """One query block of Q (with LSE2) or dO (with D) into smem buffer ``slot``. Rows past the
        sequence end are zero-filled (their stale/uninitialised smem could hold NaN, and 0 * NaN
        would leak into dV/dK); the fp32 row vector is a full tile (padded scratch)."""
        seqlen = ctx.seqlen
        copy = warp_mma.g2s_tiled_copy(self.dtype, d, self.num_threads)
        thr = copy.get_slice(ctx.tidx)
        gT = cute.local_tile(seqlen.q_rows(mT, head, ctx.batch), (self.tile_m, d), (m_block, 0))
        tc = thr.partition_S(cute.make_identity_tensor((self.tile_m, d)))
        warp_mma.load_block(copy, thr.partition_S(gT), thr.partition_D(sT[None, None, slot]), tc,
                            seqlen.seqlen_q - m_block * self.tile_m, partial=True, zero_fill=True)
        vec_threads = self.tile_m // 4
        if ctx.tidx < vec_threads:
            vcopy = scratch.tiled_copy_1d(Float32, vec_threads, 4, async_copy=True)
            vthr = vcopy.get_slice(ctx.tidx)
            gv = cute.local_tile(scratch.scratch_rows(mVec, seqlen, head, ctx.batch, self.tile_m),
                                 (self.tile_m,), (m_block,))
            cute.copy(vcopy, vthr.partition_S(gv), vthr.partition_D(sVec[None, slot]))

    @cute.jit
    def load_Q(self, ctx, head, m_block, slot):
        self.load_rows_and_vec(ctx, ctx.mQ, ctx.mLSE2, ctx.sQ, ctx.sLSE, self.hdim, head, m_block, slot)

    @cute.jit
    def load_dO(self, ctx, head, m_block, slot):
        self.load_rows_and_vec(ctx, ctx.mdO, ctx.mD, ctx.sdO, ctx.sD, self.hdim_v, head, m_block, slot)

    @cute.jit
    def advance(self, ctx, head, m_block):
        """The block after (head, m_block) in visiting order: query blocks of a head, then the
        next head of the group. Past the end when head reaches head_end."""
        m_next = m_block + 1
        h_next = head
        if m_next >= ctx.m_block_max:
            m_next = ctx.m_block_min
            h_next = head + 1
        return h_next, m_next

    # ------------------------------------------------------------------------------------------
    # Main loop
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def mainloop(self, ctx):
        self.load_KV(ctx)
        cute.arch.cp_async_commit_group()
        head_begin = ctx.head_kv * ctx.group
        head_end = head_begin + ctx.group
        if ctx.m_block_min < ctx.m_block_max:
            # Prologue: the first block's Q and dO, one cp.async group.
            self.load_Q(ctx, head_begin, ctx.m_block_min, 0)
            self.load_dO(ctx, head_begin, ctx.m_block_min, 0)
            cute.arch.cp_async_commit_group()
            # Only blocks on the causal diagonal / window edges, or against the sequence end of
            # a partial K/V block, pay for the element-wise mask.
            partial_n = (ctx.n_block + 1) * self.tile_n > ctx.seqlen.seqlen_k
            a = cutlass.min(cutlass.max(ctx.right_end, ctx.m_block_min), ctx.m_block_max)
            b = cutlass.max(a, cutlass.min(ctx.left_start, ctx.m_block_max))
            # One flat loop over (q head of the group, query block) pairs: the next pair is
            # needed anyway for the prefetch, and one loop keeps fewer counters live.
            head = head_begin
            m_block = ctx.m_block_min
            num_iters = ctx.group * (ctx.m_block_max - ctx.m_block_min)
            for it in cutlass.range(num_iters, unroll=1):
                need_mask = partial_n or m_block < a or m_block >= b
                head, m_block = self.one_block(ctx, head, m_block, it, head_end, need_mask)

    @cute.jit
    def one_block(self, ctx, head, m_block, it, head_end, need_mask):
        # Double-buffered: block ``it`` reads buffer it % 2 while block it+1 streams into the other.
        slot = it % 2 if cutlass.const_expr(self.double_buffer) else Int32(0)
        h1, m1 = self.advance(ctx, head, m_block)
        has_next = h1 < head_end

        # Everything this block reads has landed (the only cp.async group in flight is its own)
        # and every warp is done with the previous block's smem.
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()

        # ---- S = Q K^T, P = exp2(S c - LSE2) ----
        acc_shape = ctx.thr_sdp.partition_shape_C((self.tile_m, self.tile_n))
        acc_S = cute.make_rmem_tensor(acc_shape, Float32)
        acc_S.fill(0.0)
        warp_mma.gemm_ss(ctx.mma_sdp, acc_S, ctx.tSrQ, ctx.tSrK, ctx.tSsQ[None, None, None, slot], ctx.tSsK,
                         ctx.s2r_sdp_A, ctx.s2r_sdp_B)
        dtanh = self.scores_to_probs(ctx, acc_S, m_block, slot, need_mask, head)

        # ---- dP = dO V^T, dS = P (dP - D) ----
        acc_dP = cute.make_rmem_tensor(acc_shape, Float32)
        acc_dP.fill(0.0)
        warp_mma.gemm_ss(ctx.mma_sdp, acc_dP, ctx.tdPrdO, ctx.tdPrV, ctx.tdPsdO[None, None, None, slot],
                         ctx.tdPsV, ctx.s2r_sdp_A, ctx.s2r_sdp_B)
        self.probs_to_dS(ctx, acc_S, acc_dP, dtanh, slot, head, m_block)

        # ---- P, dS -> smem (16 bit); every later GEMM reads them from there ----
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        cute.copy(ctx.r2s_PdS, ctx.r2s_PdS.retile(rP), ctx.tPsP)
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        cute.copy(ctx.r2s_PdS, ctx.r2s_PdS.retile(rdS), ctx.tdSsdS)
        cute.arch.barrier()

        if cutlass.const_expr(self.double_buffer):
            # Issue the next block's loads here, where only dK/dV are live in registers (issuing
            # them inside the S/dP GEMMs would add their address math to the register peak);
            # dV + dQ + dK and the next S GEMM's start hide their latency.
            if has_next:
                self.load_Q(ctx, h1, m1, 1 - slot)
                self.load_dO(ctx, h1, m1, 1 - slot)
            cute.arch.cp_async_commit_group()
            warp_mma.gemm_ss(ctx.mma_dkv, ctx.acc_dV, ctx.tdVrPt, ctx.tdVrdOt, ctx.tdVsPt,
                             ctx.tdVsdOt[None, None, None, slot], ctx.s2r_dkv_A, ctx.s2r_dkv_B)
            self.dQ_step(ctx, head, m_block)
            warp_mma.gemm_ss(ctx.mma_dkv, ctx.acc_dK, ctx.tdKrdSt, ctx.tdKrQt, ctx.tdKsdSt,
                             ctx.tdKsQt[None, None, None, slot], ctx.s2r_dkv_A, ctx.s2r_dkv_B)
        else:
            # Single buffers (large head dims): dO(next) may land once every warp is done with dV,
            # Q(next) once every warp is done with dK; the dQ GEMM then hides the Q load.
            warp_mma.gemm_ss(ctx.mma_dkv, ctx.acc_dV, ctx.tdVrPt, ctx.tdVrdOt, ctx.tdVsPt,
                             ctx.tdVsdOt[None, None, None, slot], ctx.s2r_dkv_A, ctx.s2r_dkv_B)
            cute.arch.barrier()
            if has_next:
                self.load_dO(ctx, h1, m1, slot)
            cute.arch.cp_async_commit_group()
            warp_mma.gemm_ss(ctx.mma_dkv, ctx.acc_dK, ctx.tdKrdSt, ctx.tdKrQt, ctx.tdKsdSt,
                             ctx.tdKsQt[None, None, None, slot], ctx.s2r_dkv_A, ctx.s2r_dkv_B)
            cute.arch.barrier()
            if has_next:
                self.load_Q(ctx, h1, m1, slot)
            cute.arch.cp_async_commit_group()
            self.dQ_step(ctx, head, m_block)
        return h1, m1

    @cute.jit
    def scores_to_probs(self, ctx, acc_S, m_block, slot, need_mask, head):
        """S -> P in place (the mods of query head ``head`` first). Returns what the chain rule
        needs: 1 - tanh^2 with softcap, the unmodified scores with a score_mod's derivative, else
        None."""
        dtanh = None
        if cutlass.const_expr(self.mods is not None):
            if cutlass.const_expr(self.mods.grads_score):
                dtanh = cute.make_rmem_tensor_like(acc_S, Float32)
            where = (ctx.tScS_mn, 0, m_block * self.tile_m, ctx.n_block * self.tile_n, ctx.batch, head, 1,
                     ctx.seqlen.seqlen_q, ctx.seqlen.seqlen_k, ctx.aux, ctx.score_scale)
            mod_scores_in_block(self.mods, acc_S, where, dtanh, m_block, ctx.full)
        if cutlass.const_expr(self.has_softcap):
            dtanh = cute.make_rmem_tensor_like(acc_S, Float32)
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                t = cute.math.tanh(acc_S[i] * ctx.score_scale, fastmath=True)
                acc_S[i] = t
                dtanh[i] = Float32(1.0) - t * t
        if need_mask:
            # (a plain function call: the DSL must not see ``ctx`` as state carried by the branch)
            _apply_mask(ctx.mask, acc_S, ctx.thr_sdp, m_block, ctx.n_block, self.is_causal, self.is_local)
        acc_mn = acc_to_mn(acc_S)
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            # LSE2 = +inf on padding rows and rows that saw no key: P = exp2(-inf) = 0 there.
            lse2 = ctx.sLSE[ctx.tScS_mn[r, 0][0], slot]
            acc_mn[r, None].store(cute.math.exp2(acc_mn[r, None].load() * ctx.scale_log2 - lse2,
                                                 fastmath=True))
        return dtanh

    @cute.jit
    def probs_to_dS(self, ctx, acc_S, acc_dP, dtanh, slot, head, m_block):
        """dP -> dS = P (dP - D) [* (1 - tanh^2)] in place; with a score_mod's derivative, through
        it (``dtanh``: the unmodified scores)."""
        p_mn, dp_mn = acc_to_mn(acc_S), acc_to_mn(acc_dP)
        for r in cutlass.range_constexpr(cute.size(p_mn, mode=[0])):
            d_row = ctx.sD[ctx.tScS_mn[r, 0][0], slot]
            dp_mn[r, None].store(p_mn[r, None].load() * (dp_mn[r, None].load() - d_row))
        if cutlass.const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(cute.size(acc_dP)):
                acc_dP[i] = acc_dP[i] * dtanh[i]
        if cutlass.const_expr(self.mods is not None and self.mods.grads_score):
            mod_grads(self.mods, acc_dP, dtanh, ctx.tScS_mn, 0, m_block * self.tile_m,
                      ctx.n_block * self.tile_n, ctx.batch, head, ctx.seqlen.seqlen_q, ctx.seqlen.seqlen_k,
                      ctx.aux, ctx.aux_grads)

    @cute.jit
    def dQ_step(self, ctx, head, m_block):
        """dQ partial = dS K, reduced into the fp32 accumulator chunk of (m_block, head).

        With ``dq_splits`` > 1 the hdim columns are done in that many GEMMs, each followed by its
        reductions: the fp32 accumulator (tile_m * hdim / 256 registers per thread) would otherwise
        sit on top of dK and dV at the register peak of large head dims; dS is re-read from smem
        per split, which is cheap (tile_m x tile_n)."""
        cols = self.hdim // self.dq_splits
        gacc = scratch.dq_accum_block(ctx.mdQaccum, ctx.seqlen, head, ctx.batch, m_block, self.tile_m,
                                       self.hdim)
        if cutlass.const_expr(self.deterministic):
            sem = self.semaphore_ptr(ctx, head, m_block)
            # Wait for the previous K/V block that sees this query block (if any) to finish.
            if ctx.n_block > 0 and m_block >= ctx.prev_min and m_block < ctx.prev_max:
                scratch.semaphore_wait(sem, ctx.n_block, ctx.tidx)
        for c in cutlass.range_constexpr(self.dq_splits):
            acc_dQ = cute.make_rmem_tensor(ctx.thr_dq.partition_shape_C((self.tile_m, cols)), Float32)
            acc_dQ.fill(0.0)
            sKt = ctx.sKt if cutlass.const_expr(self.dq_splits == 1) else cute.local_tile(
                ctx.sKt, (cols, self.tile_n), (c, 0))
            tdQrKt = ctx.thr_dq.make_fragment_B(ctx.thr_dq.partition_B(sKt))
            warp_mma.gemm_ss(ctx.mma_dq, acc_dQ, ctx.tdQrdS, tdQrKt, ctx.tdQsdS,
                             ctx.s2r_dq_B.partition_S(sKt), ctx.s2r_dq_A, ctx.s2r_dq_B)
            # Split c owns elements [c * tile_m * cols, (c+1) * tile_m * cols) of the chunk, in
            # fragment order: element i of this thread at i * num_threads + tidx.
            base = gacc.iterator + (c * self.tile_m * cols + ctx.tidx)
            for i in cutlass.range_constexpr(cute.size(acc_dQ)):
                scratch.red_add_f32(base + i * self.num_threads, acc_dQ[i])
            if cutlass.const_expr(c + 1 < self.dq_splits):
                # Keeps ptxas from hoisting the next split's GEMM above these reductions, which
                # would put both accumulators back in registers at once.
                cute.arch.sync_warp()
        if cutlass.const_expr(self.deterministic):
            scratch.semaphore_signal(sem, ctx.n_block + 1, ctx.tidx)

    @cute.jit
    def semaphore_ptr(self, ctx, head, m_block):
        idx = scratch.semaphore_index(ctx.seqlen, ctx.batch, m_block, self.tile_m)
        coord = (idx, head) if cutlass.const_expr(self.varlen) else (idx, head, ctx.batch)
        return ctx.mSemaphore.iterator + cute.crd2idx(coord, ctx.mSemaphore.layout)

    # ------------------------------------------------------------------------------------------
    # Epilogue
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def epilogue(self, ctx, mdK, mdV, softmax_scale):
        """dK (scaled), dV -> 16 bit -> smem (reusing the K/V buffers) -> 16-byte row stores. Runs
        for K/V blocks no query sees too: their dK, dV are zeros."""
        seqlen = ctx.seqlen
        rdK = cute.make_rmem_tensor_like(ctx.acc_dK, self.dtype)
        rdK.store((ctx.acc_dK.load() * softmax_scale).to(self.dtype))
        rdV = cute.make_rmem_tensor_like(ctx.acc_dV, self.dtype)
        rdV.store(ctx.acc_dV.load().to(self.dtype))
        # Every warp is done with K and V (and any cp.async into smem has landed).
        cute.arch.cp_async_wait_group(0)
        cute.arch.barrier()
        r2s = cute.make_tiled_copy_C(cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype),
                                     ctx.mma_dkv).get_slice(ctx.tidx)
        cute.copy(r2s, r2s.retile(rdK), r2s.partition_D(ctx.sK))
        cute.copy(r2s, r2s.retile(rdV), r2s.partition_D(ctx.sV))
        cute.arch.barrier()
        rows_left = seqlen.seqlen_k - ctx.n_block * self.tile_n
        for mT, sT, d in ((mdK, ctx.sK, self.hdim), (mdV, ctx.sV, self.hdim_v)):
            gT = cute.local_tile(seqlen.k_rows(mT, ctx.head_kv, ctx.batch), (self.tile_n, d),
                                 (ctx.n_block, 0))
            copy = warp_mma.r2g_tiled_copy(self.dtype, d, self.num_threads)
            warp_mma.store_rows(copy, copy.get_slice(ctx.tidx), sT, gT, self.tile_n, d, rows_left)
