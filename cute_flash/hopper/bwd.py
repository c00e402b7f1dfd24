"""FlashAttention-3 style backward main kernel for Hopper (sm90a), head dims 64, 96 and 128 (d >= 192:
``bwd_wide.py``).

One CTA owns ``tile_n`` keys of one (batch, head) and walks the query blocks that see them
(``tile_m`` rows each). Warpgroup 0 produces: one warp TMA-loads K and V once, then Q and dO of
each query block into a ``stages``-deep pipeline (one mbarrier per stage for both, or with
``split_loads`` K, V, Q + LSE2 and dO + D each on their own; ``bwd_load.py``). The two consumer
warpgroups own 64 keys each and run, per query block, the five GEMMs of the backward with the key
axis on wgmma's M (the "swapped" S^T form, so dK and dV accumulate in registers and P^T, dS^T feed
their GEMMs straight from registers; the exponentials and dS in ``bwd_scores.py``):

    S^T  = K Q^T           (SS)     P^T  = exp2(S^T * scale*log2e - LSE2)
    dP^T = V dO^T          (SS)     dS^T = P^T * (dP^T - D)
    dV  += P^T dO          (RS)     dK  += dS^T Q            (RS)
    dQ   = dS K            (SS, dS^T through smem: its key axis is split over the warpgroups)

dQ of a query block goes into the fp32 accumulator (one chunk per query block of the sm80
backward's padded scratch, in the dQ MMA's fragment order): the consumers write it to smem and a
writer warp of the producer warpgroup adds the tile with bulk reduce-adds (``bwd_dq.py``; in
deterministic mode in a fixed order of the K/V blocks). The sm80 preprocess fills LSE2 / D / zeroes
the accumulator (this kernel launches early and waits for it: programmatic dependent launch), and
``FlashBwdPostSm90`` (``bwd_postprocess.py``) scales and converts it. dK (scaled) and dV are stored
at the end (``bwd_epilogue.py``). GQA/MQA: the CTA of a KV head walks the query blocks of every
query head of its group, so dK and dV sum over the group in registers. Causal and sliding-window
masks (bottom-right aligned), varlen, deterministic mode and softcap as in the sm80 backward.
d = 64 takes 128 query rows per block (dQ split over the warpgroups by rows), d = 96 / 128 take 64
(dQ split by columns), or 80 at d = 128 (dQ^T, ``dq_swapab``).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from cute_flash import jit
from cute_flash.device import waits, warp_mma
from cute_flash.device.block_info import BlockInfo
from cute_flash.device.convert import convert_pairs
from cute_flash.device.layout import acc_to_mn, transpose_smem
from cute_flash.device.mods import aligned_grads, block_range
from cute_flash.device.seqlen import SeqlenInfo
from cute_flash.device.softmax import score_scales
from cute_flash.device.tile_scheduler import section_size, section_walk_plan
from cute_flash.hopper.bwd_dq import NUM_MMA_THREADS, BwdDq, dq_acc_shape, dq_swapab, dq_tiled_mma
from cute_flash.hopper.bwd_epilogue import BwdEpilogue
from cute_flash.hopper.bwd_load import BwdProducer
from cute_flash.hopper.bwd_scores import BwdScores
from cute_flash.hopper.fwd import acc_to_frgA_sm90, wg_gemm

# Named barrier ids (0 is __syncthreads; 4-7: the dQ hand-off, ``bwd_dq.py``), over the two
# consumer warpgroups: dS in smem is written by both and read by both (the dQ GEMM contracts over
# all tile_n keys), so each block's writes wait for the previous block's dQ GEMMs (EMPTY) and its
# dQ GEMMs for both halves (FULL).
BAR_DS_EMPTY = 1
BAR_DS_FULL = 2
# Wide kernel with ``dq_before_dk``: P in smem from both warpgroups before the dV GEMM reads it
# (P and dS then meet at separate barriers, so dV runs while dS is stored).
BAR_P_FULL = 8


class FlashBwdSm90(BwdProducer, BwdScores, BwdDq, BwdEpilogue):
    epilogue_barrier = BAR_DS_EMPTY

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.dtype = jit.DTYPES[cfg.dtype]
        self.hdim = cfg.hdim
        # V / dO / dV head dim (= hdim but in the wide kernel's (192, 128)).
        self.hdim_v = cfg.hdim_v
        self.tile_m, self.tile_n, self.num_stages = cfg.tile_m, cfg.tile_n, cfg.stages
        # dO + D stages (``do_stages``, split loads in the wide kernel): fewer than Q's, the dO
        # pipeline keeps its own state.
        self.num_do_stages = cfg.do_stages or cfg.stages
        self.separate_do = self.num_do_stages != self.num_stages
        self.is_causal, self.is_local, self.has_softcap = cfg.causal, cfg.local, cfg.softcap
        self.mods = cfg.mods
        self.varlen, self.deterministic = cfg.varlen, cfg.deterministic
        self.dq_before_dk, self.ds_stages = cfg.dq_before_dk, cfg.ds_stages
        self.lpt = cfg.lpt
        self.prefetch_stats = cfg.prefetch_stats
        self.mask_always = cfg.mask_always
        self.ds_before_dv = cfg.ds_before_dv
        self.num_mma_threads = NUM_MMA_THREADS
        self.num_threads = 384
        elem = self.dtype.width // 8
        self.tx_kv = self.tile_n * (self.hdim + self.hdim_v) * elem
        # Q and dO of a query block plus its LSE2 and D rows (fp32), all on one mbarrier.
        self.tx_qdo = self.tile_m * (self.hdim + self.hdim_v) * elem + 2 * self.tile_m * 4
        # ``split_loads``: K, V on a barrier each; Q + LSE2 and dO + D on two pipelines.
        self.split_loads = cfg.split_loads
        self.spin_waits = cfg.spin_waits
        self.tx_k = self.tile_n * self.hdim * elem
        self.tx_q = self.tile_m * (self.hdim * elem + 4)
        self.tx_do = self.tile_m * (self.hdim_v * elem + 4)

    # ------------------------------------------------------------------------------------------
    # Layouts and MMAs
    # ------------------------------------------------------------------------------------------
    def _smem(self, rows: int, cols: int, stages: int | None, atom_cols: int | None = None):
        """K-major wgmma-canonical swizzled tile (read K-major, or MN-major through a transposed
        view, by the different GEMMs). ``atom_cols``: the column count the swizzle atom must divide
        -- a GEMM that splits the columns over the warpgroups reads each half as its own MN-major
        operand, so the atom may not straddle the halves (e.g. 48 of d=96: a 32-byte swizzle)."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, atom_cols or cols), self.dtype)
        if stages is None:
            return cute.tile_to_shape(atom, (rows, cols), (0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))

    def _setup(self) -> None:
        d, tm, tn = self.hdim, self.tile_m, self.tile_n
        self.sQ_layout = self._smem(tm, d, self.num_stages)
        self.sdO_layout = self._smem(tm, d, self.num_stages)
        # With 64 query rows the dQ GEMM splits the head dim over the warpgroups (K^T halves).
        self.sK_layout = self._smem(tn, d, None, atom_cols=d if tm == 128 else d // 2)
        self.sV_layout = self._smem(tn, d, None)
        # dS as (queries, keys), K-major for the dQ GEMM (one buffer, or one per Q/dO stage).
        self.sdS_layout = self._smem(tm, tn, self.ds_stages if self.ds_stages > 1 else None)
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S^T, dP^T: M = keys (64 per consumer warpgroup), N = the query block, K = head dim.
        self.mma_sdp = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, atom_layout_mnk=(2, 1, 1), tiler_mn=(64, tm))
        # dV, dK: M = keys, N = head dim, K = the query block; A (P^T, dS^T) from registers.
        self.mma_dkv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, atom_layout_mnk=(2, 1, 1), tiler_mn=(64, d),
            a_source=warpgroup.OperandSource.RMEM)
        self.mma_dq = dq_tiled_mma(self.dtype, tm, d)

    def smem_layouts(self) -> dict:
        """The shared-memory tiles, by name (the storage struct and the kernel's views follow it):
        16-bit tiles, and the per-stage fp32 LSE2 / D rows of the query block (``fp32_layouts``)."""
        return {"sK": self.sK_layout, "sV": self.sV_layout, "sQ": self.sQ_layout, "sdO": self.sdO_layout,
                "sdS": self.sdS_layout}

    def fp32_layouts(self) -> dict:
        return {"sLSE2": cute.make_layout((self.tile_m, self.num_stages)),
                "sDsum": cute.make_layout((self.tile_m, self.num_do_stages)),
                "sdQ": cute.make_layout(self.tile_m * self.hdim)}  # dQ in fragment order (scratch)

    def _storage(self):
        fields = {"mbar_kv": cute.struct.MemRange[cutlass.Int64, 4 if self.split_loads else 2],
                  "mbar_qdo": cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]}
        if self.split_loads:
            fields["mbar_do"] = cute.struct.MemRange[cutlass.Int64, 2 * self.num_do_stages]
        for name, layout in self.smem_layouts().items():
            fields[name] = cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], 1024]
        fields.update(self.extra_storage())
        for name, layout in self.fp32_layouts().items():
            # 16-byte aligned: the destination of a bulk copy.
            fields[name] = cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(layout)], 128]
        return cute.struct(type("Storage", (), {"__annotations__": fields}))

    def extra_storage(self) -> dict:
        """Storage fields a subclass adds (none here)."""
        return {}

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
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
        """The sm80 main backward's signature (semaphores: deterministic mode only, else None;
        ``mAux*`` / ``mAuxGrad*``: the mods' aux tensors and the gradients asked for, None past the
        last; ``mBlocks``: a block mask's ranges per K/V block, or None). Packed (varlen) inputs: TMA
        boxes start at each batch's first row; rows of the next batch that a box reaches are masked
        (keys) or have P = 0 (queries: LSE2 = +inf padding)."""
        self._setup()
        Storage = self._storage()
        mQ, mK, mV, mdO, mdK, mdV = [warp_mma.to_seq_dim_head(t) for t in (mQ, mK, mV, mdO, mdK, mdV)]
        mLSE2, mD, mdQaccum = [warp_mma.lse_to_seq_head(t) for t in (mLSE2, mD, mdQaccum)]
        if cutlass.const_expr(mSemaphore is not None):
            mSemaphore = warp_mma.lse_to_seq_head(mSemaphore)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_Q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, mQ, cute.select(self.sQ_layout, mode=[0, 1]),
                                                    (self.tile_m, self.hdim))
        tma_dO, mdO_tma = cpasync.make_tiled_tma_atom(g2s, mdO, cute.select(self.sdO_layout, mode=[0, 1]),
                                                      (self.tile_m, self.hdim_v))
        tma_K, mK_tma = cpasync.make_tiled_tma_atom(g2s, mK, self.sK_layout, (self.tile_n, self.hdim))
        tma_V, mV_tma = cpasync.make_tiled_tma_atom(g2s, mV, self.sV_layout, (self.tile_n, self.hdim_v))
        num_batch, seqlen_k = warp_mma.grid_rows(mK, mCuSeqlensK, max_seqlen_k)
        # ``split_heads``: one CTA row per partial dK / dV head (the launcher sums the partials).
        heads = mK.shape[2]
        if cutlass.const_expr(self.cfg.split_heads):
            heads = mdK.shape[2]
        grid = (cute.ceil_div(seqlen_k, self.tile_n), heads, num_batch)
        score_scale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap,
                                               self.mods is not None and self.mods.score_mod is not None)
        scales = (softmax_scale, score_scale, scale_log2)
        aux = tuple(a for a in (mAux0, mAux1, mAux2, mAux3) if a is not None)
        aux_grads = tuple(g for g in (mAuxGrad0, mAuxGrad1, mAuxGrad2, mAuxGrad3) if g is not None)
        # Integer divisions by launch-invariant numbers happen here, once, not at every CTA's start
        # (``section_walk_plan``): the GQA ratio, and the longest-first walk's divisors.
        qhead_per_kv = mQ.shape[2] // heads
        walk = ()
        if cutlass.const_expr(self.lpt):
            num_h = heads
            rows = mQ.shape[0] * qhead_per_kv
            group = section_size(Int32(self.cfg.lpt_rows_in_l2()), rows, num_h)
            walk = section_walk_plan(grid[0], num_h, group, self.cfg.lpt_balanced,
                                     divisor=cute.fast_divmod_create_divisor_v2)
        self.kernel(mQ_tma, mK_tma, mV_tma, mdO_tma, mLSE2, mD, mdQaccum, mdK, mdV, mCuSeqlensQ, mCuSeqlensK,
                    mSemaphore, tma_Q, tma_K, tma_V, tma_dO, scales, walk, qhead_per_kv, window_left,
                    window_right, aux, aux_grads, mBlocks, Storage).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=Storage.size_in_bytes(), stream=stream,
            # .minnctapersm 1 pins the register count at entry; without it ptxas may drop every
            # setmaxnreg (C7508: it did at d = 96 / 192) and then serialise the wgmmas.
            min_blocks_per_mp=1, use_pdl=True)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
               mSemaphore: cute.Tensor | None, tma_Q: cute.CopyAtom, tma_K: cute.CopyAtom,
               tma_V: cute.CopyAtom, tma_dO: cute.CopyAtom, scales: tuple, walk: tuple,
               qhead_per_kv: Int32, window_left: Int32, window_right: Int32, aux: tuple, aux_grads: tuple,
               mBlocks: cute.Tensor | None, Storage: cutlass.Constexpr):
        self._setup()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_Q, tma_K, tma_V, tma_dO):
                cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(Storage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        # ``split_loads``: the first S^T needs only K, Q and LSE2 (33 KB at d = 64 instead of 65 KB
        # with V, dO and D), and each block's S^T waits for Q + LSE2 alone. The K/V pipeline then
        # has two single-use stages (K, V) and dO + D get their own pipeline beside Q + LSE2.
        # It pays with polling waits (``spin_waits``): with twice the waits, a sleeping wait's late
        # wake-up costs more.
        split = self.split_loads
        pipe_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=2 if split else 1, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_k if split else self.tx_kv, defer_sync=True)
        pipe_qdo = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_qdo.data_ptr(), num_stages=self.num_stages,
            producer_group=producer, consumer_group=consumers, tx_count=self.tx_q if split else self.tx_qdo,
            defer_sync=True)
        pipe_do = None
        if cutlass.const_expr(split):
            pipe_do = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.mbar_do.data_ptr(), num_stages=self.num_do_stages,
                producer_group=producer, consumer_group=consumers, tx_count=self.tx_do, defer_sync=True)
        pipes = warp_mma.Ctx(kv=pipe_kv, q=pipe_qdo, do=pipe_do)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        smem = warp_mma.Ctx(**{name: getattr(storage, name).get_tensor(layout.outer, swizzle=layout.inner)
                             for name, layout in self.smem_layouts().items()},
                          **{name: getattr(storage, name).get_tensor(layout)
                             for name, layout in self.fp32_layouts().items()})
        args = warp_mma.Ctx(mQ=mQ, mK=mK, mdK=mdK, mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=mCuSeqlensK,
                            mSemaphore=mSemaphore, window_left=window_left, window_right=window_right,
                            qhead_per_kv=qhead_per_kv, aux=aux, aux_grads=aligned_grads(self.mods, aux_grads),
                            mBlocks=mBlocks)
        loads = warp_mma.Ctx(mQ=mQ, mK=mK, mV=mV, mdO=mdO, mLSE2=mLSE2, mD=mD, tma_Q=tma_Q, tma_K=tma_K,
                             tma_V=tma_V, tma_dO=tma_dO)
        n_block, head_kv, batch = cute.arch.block_idx()
        if cutlass.const_expr(self.lpt):
            n_block, head_kv = self.longest_first(n_block, head_kv, walk)
        seqlen, work = self.make_work(args, n_block, head_kv, batch)
        # Varlen grids are sized by the longest sequence: CTAs past this batch's keys leave at
        # once (the condition is uniform over the CTA).
        if work.n_block >= 0 and work.n_block * self.tile_n < seqlen.seqlen_k:
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(24)
                if warp_idx == 0:
                    if cutlass.const_expr(split):
                        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
                        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                             self.num_stages)
                        self.load_split(loads, smem, pipes, seqlen, work, kv_state, state,
                                        self.new_do_state(pipeline.PipelineUserType.Producer))
                    else:
                        self.load(mQ, mK, mV, mdO, mLSE2, mD, tma_Q, tma_K, tma_V, tma_dO, smem, pipe_kv,
                                  pipe_qdo, seqlen, work)
                if warp_idx == 1:
                    self.wait_for_preprocess()
                    self.dq_writer(mdQaccum, smem, seqlen, work)
            else:
                cute.arch.setmaxregister_increase(240)
                self.wait_for_preprocess()
                ctx = self.consumer_setup(smem, scales, args)
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                        2 if self.split_loads else 1)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
                self.consumer_tile(ctx, mdK, mdV, pipes, seqlen, work, scales, kv_state, state,
                                   self.new_do_state(pipeline.PipelineUserType.Consumer))

    def new_do_state(self, user_type):
        """The dO pipeline's own state where it has fewer stages than Q's, else None (the Q state
        serves both)."""
        if cutlass.const_expr(self.separate_do):
            return pipeline.make_pipeline_state(user_type, self.num_do_stages)
        return None

    @cute.jit
    def make_work(self, args, n_block: Int32, head_kv: Int32, batch: Int32):
        """(SeqlenInfo, work) of the K/V tile (n_block, head_kv, batch): the query blocks that see it
        and deterministic mode's ordering."""
        mQ, mK = args.mQ, args.mK
        seqlen = SeqlenInfo(batch, mQ.shape[0], mK.shape[0], args.mCuSeqlensQ, args.mCuSeqlensK)
        if cutlass.const_expr(self.deterministic and not self.cfg.rotate_m):
            # Descending dQ order: CTA n waits for CTA n + 1, so the last key block must launch
            # first (CTAs start in blockIdx order; a waiter whose predecessor is not resident
            # yet could otherwise fill every SM and never let it in).
            n_block = cute.ceil_div(seqlen.seqlen_k, self.tile_n) - 1 - n_block
        block_info = BlockInfo(self.tile_m, self.tile_n, self.is_causal, self.is_local, args.window_left,
                               args.window_right)
        m_block_min, m_block_max = block_info.m_block_min_max(seqlen, n_block)
        full = None
        if cutlass.const_expr(args.mBlocks is not None):
            # (Ranges per K/V head: the union over its query heads. Deterministic mode refuses them.)
            kv = head_kv // (args.mdK.shape[2] // args.mK.shape[2]) if self.cfg.split_heads else head_kv
            ranges = block_range(args.mBlocks, batch, kv, n_block, m_block_min, m_block_max)
            m_block_min, m_block_max, full = ranges[0], ranges[1], ranges[2:]
        m_block_min = cutlass.min(m_block_min, m_block_max)
        # Deterministic mode: K/V blocks add into each query block in descending order of n -- in
        # causal attention the short late blocks go first and nobody waits. ``order_rank``: this
        # block's place in the chain; ``prev_*``: the query blocks its predecessor adds into.
        order_rank = n_block
        prev_valid = n_block > 0
        prev_min, prev_max = Int32(0), Int32(0)
        if cutlass.const_expr(self.deterministic and not self.cfg.rotate_m):
            num_n = cute.ceil_div(seqlen.seqlen_k, self.tile_n)
            order_rank = num_n - 1 - n_block
            prev_valid = n_block + 1 < num_n
            prev_min, prev_max = block_info.m_block_min_max(seqlen, n_block + 1)
        # GQA/MQA: this CTA's query heads are [head_kv * group, (head_kv + 1) * group) (the
        # launcher's ratio). ``split_heads``: ``head_kv`` indexes the partial dK / dV; K / V are
        # those of its K/V head (one division per CTA).
        group = args.qhead_per_kv
        kv_head = head_kv
        if cutlass.const_expr(self.cfg.split_heads):
            kv_head = head_kv // (args.mdK.shape[2] // args.mK.shape[2])
        # ``rotate_m``: key block n walks its query blocks from the n-th one on (wrapping), so the
        # CTAs of one head are at different query blocks at any moment.
        rot = None
        rank_plan = None
        if cutlass.const_expr(self.cfg.rotate_m):
            num_m = m_block_max - m_block_min
            rot = n_block
            if rot >= num_m:
                rot = rot % cutlass.max(num_m, 1)
            if cutlass.const_expr(self.deterministic):
                # The rotated add order (``scratch.rotated_add_rank``): its per-CTA divisions.
                num_n = cute.ceil_div(seqlen.seqlen_k, self.tile_n)
                m_count = cutlass.max(num_m, 1)
                q_per = num_n // m_count
                rank_plan = (m_count, q_per, num_n - q_per * m_count, n_block // m_count)
        work = warp_mma.Ctx(n_block=n_block, head_kv=head_kv, kv_head=kv_head, batch=batch, group=group,
                            m_block_min=m_block_min, m_block_max=m_block_max, prev_min=prev_min,
                            prev_max=prev_max, prev_valid=prev_valid, order_rank=order_rank,
                            mSemaphore=args.mSemaphore, rot=rot, rank_plan=rank_plan, full=full)
        return seqlen, work

    # ------------------------------------------------------------------------------------------
    # Consumer warpgroups
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consumer_setup(self, smem, scales, args):
        """The consumer context that does not depend on the tile: MMA partitions, accumulators,
        scales."""
        _, score_scale, scale_log2 = scales
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - 128
        ctx = self.consumer_ctx(smem, tidx)
        ctx.smem = smem
        ctx.tidx = tidx
        ctx.score_scale, ctx.scale_log2 = score_scale, scale_log2
        ctx.window_left, ctx.window_right = args.window_left, args.window_right
        ctx.aux, ctx.aux_grads = args.aux, args.aux_grads
        return ctx

    @cute.jit
    def consumer_tile(self, ctx, mdK, mdV, pipes, seqlen: SeqlenInfo, work, scales, kv_state, state,
                      do_state=None):
        """One K/V tile: every (query head, query block) that sees it, then the dK / dV epilogue."""
        ctx.seqlen, ctx.batch = seqlen, work.batch
        ctx.n_block, ctx.head_kv, ctx.full = work.n_block, work.head_kv, work.full
        ctx.acc_dK.fill(0.0)
        ctx.acc_dV.fill(0.0)
        waits.wait_full(pipes.kv, kv_state, self.spin_waits)
        if cutlass.const_expr(self.split_loads):
            kv_state.advance()  # V's stage: waited for before each dP^T (at once after the first)
        total = self.num_work_items(work)
        for it in cutlass.range(total, unroll=1):
            head, m_block = self.work_item(work, it)
            self.one_m_block(ctx, pipes, state, head, m_block, kv_state, do_state)
            state.advance()
            if cutlass.const_expr(self.separate_do):
                do_state.advance()
        self.epilogue(ctx, mdK, mdV, scales[0])

    @staticmethod
    def num_work_items(work) -> Int32:
        """(query head, query block) pairs of this K/V block: every query head of its group
        (GQA), each over the query blocks that see it."""
        return work.group * (work.m_block_max - work.m_block_min)

    @staticmethod
    def work_item(work, it: Int32) -> tuple:
        """(query head, query block) of item ``it``, in the order the consumers and the dQ writer
        warp both walk (the producer's head / block loops give the same order). This division per
        block is in every role's loop: stepping (head, block) instead, or nested loops, make ptxas
        serialise the consumers' wgmmas at d = 128 with 80-row tiles."""
        num_m = work.m_block_max - work.m_block_min
        g = it // num_m
        return work.head_kv * work.group + g, FlashBwdSm90.query_block(work, it - g * num_m, num_m)

    @staticmethod
    def query_block(work, i: Int32, num_m: Int32) -> Int32:
        """The ``i``-th query block this K/V block visits (of ``num_m``): in order, or from
        ``work.rot`` on and wrapping (``rotate_m``). Every role's walk goes through here."""
        if cutlass.const_expr(work.rot is None):
            return work.m_block_min + i
        local = i + work.rot
        return work.m_block_min + cutlass.select_(local >= num_m, local - num_m, local)

    def consumer_ctx(self, smem, tidx):
        """This kernel's MMA partitions, operand fragments and dK / dV accumulators."""
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_sdp = self.mma_sdp.get_slice(tidx)
        thr_dkv = self.mma_dkv.get_slice(tidx)
        thr_dq = self.mma_dq.get_slice(tidx)
        # Operand descriptors from warp-uniform slices (uniform registers, see the forward).
        wg_sdp, wg_dkv, wg_dq = (m.get_slice(wg * 128) for m in (self.mma_sdp, self.mma_dkv, self.mma_dq))
        sQt, sdOt = transpose_smem(smem.sQ), transpose_smem(smem.sdO)
        return warp_mma.Ctx(
            thr_sdp=thr_sdp, thr_dq=thr_dq, thr_dkv=thr_dkv,
            tSrK=wg_sdp.make_fragment_A(wg_sdp.partition_A(smem.sK)),
            tSrQ=wg_sdp.make_fragment_B(wg_sdp.partition_B(smem.sQ)),
            tdPrV=wg_sdp.make_fragment_A(wg_sdp.partition_A(smem.sV)),
            tdPrdO=wg_sdp.make_fragment_B(wg_sdp.partition_B(smem.sdO)),
            tdVrdOt=wg_dkv.make_fragment_B(wg_dkv.partition_B(sdOt)),
            tdKrQt=wg_dkv.make_fragment_B(wg_dkv.partition_B(sQt)),
            **self.dq_operands(wg_dq, smem),
            **self.ds_store_ctx(smem, tidx),
            acc_dK=cute.make_rmem_tensor(thr_dkv.partition_shape_C((self.tile_n, self.hdim)), Float32),
            acc_dV=cute.make_rmem_tensor(thr_dkv.partition_shape_C((self.tile_n, self.hdim)), Float32),
            # (key, query) of each S^T element of this thread, within the tile.
            tScS=acc_to_mn(thr_sdp.partition_C(cute.make_identity_tensor((self.tile_n, self.tile_m)))))

    def dq_operands(self, wg_dq, smem) -> dict:
        """dS and K^T as the dQ MMA's operands: A and B, or B and A under ``dq_swapab``."""
        sKt = transpose_smem(smem.sK)
        if cutlass.const_expr(dq_swapab(self.tile_m)):
            return dict(tdQrdS=wg_dq.make_fragment_B(wg_dq.partition_B(smem.sdS)),
                        tdQrKt=wg_dq.make_fragment_A(wg_dq.partition_A(sKt)))
        return dict(tdQrdS=wg_dq.make_fragment_A(wg_dq.partition_A(smem.sdS)),
                    tdQrKt=wg_dq.make_fragment_B(wg_dq.partition_B(sKt)))

    def dq_gemm(self, acc_dQ, tdQrdS, tdQrKt, wg_wait: int):
        if cutlass.const_expr(dq_swapab(self.tile_m)):
            wg_gemm(self.mma_dq, acc_dQ, tdQrKt, tdQrdS, zero_init=True, wg_wait=wg_wait)
        else:
            wg_gemm(self.mma_dq, acc_dQ, tdQrdS, tdQrKt, zero_init=True, wg_wait=wg_wait)

    def ds_store_ctx(self, smem, tidx) -> dict:
        """dS^T leaves the S^T accumulator layout through transposing ``stmatrix`` (8x8 tiles, 4
        per instruction): the key axis is the contiguous one of the K-major dS tile, across the
        accumulator's register pairs."""
        # A 4-tile store takes the same register quad as one k16 slice of the dK GEMM's A operand
        # (16 keys x 16 queries). At tile_m = 80, issuing it after dK (in flight, its A quads
        # locked) leaves ptxas short of registers and serialises every wgmma, so there one tile per
        # instruction; stored ahead of dV (``ds_before_dv``) the quads are read before any dK / dV
        # GEMM holds them.
        tiles = 4 if self.tile_m % 32 == 0 or (self.tile_m % 16 == 0 and self.ds_before_dv) else 1
        atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=True, num_matrices=tiles),
                                   self.dtype)
        tiled = cute.make_tiled_copy_C(atom, self.mma_sdp)
        thr = tiled.get_slice(tidx)
        return dict(st_dS=tiled, thr_st_dS=thr, tRSsdSt=thr.partition_D(transpose_smem(smem.sdS)))

    @cute.jit
    def one_m_block(self, ctx, pipes, state, head: Int32, m_block: Int32, v_state, do_state=None):
        acc_S = cute.make_rmem_tensor(ctx.thr_sdp.partition_shape_C((self.tile_n, self.tile_m)), Float32)
        acc_dP = cute.make_rmem_tensor(ctx.thr_sdp.partition_shape_C((self.tile_n, self.tile_m)), Float32)
        waits.wait_full(pipes.q, state, self.spin_waits)
        s = state.index
        wg_gemm(self.mma_sdp, acc_S, ctx.tSrK, ctx.tSrQ[None, None, None, s], zero_init=True, wg_wait=-1)
        # This block's LSE2 / D rows came with its Q / dO (same stage). ``prefetch_stats``: read
        # into registers while S^T (then dP^T) is in flight, not after its wait, where each
        # smem load's latency sits between the wait and the first exp2 (flash-attn-4's order).
        lse2 = self.stats_regs(ctx, acc_S, ctx.smem.sLSE2[None, s])
        if cutlass.const_expr(self.split_loads):
            waits.wait_full(pipes.kv, v_state, self.spin_waits)
            waits.wait_full(pipes.do, state, self.spin_waits)
        wg_gemm(self.mma_sdp, acc_dP, ctx.tdPrV, ctx.tdPrdO[None, None, None, s], zero_init=True, wg_wait=1)
        dtanh = self.probs(ctx, acc_S, ctx.smem.sLSE2[None, s], m_block, lse2, head)
        dsum = self.stats_regs(ctx, acc_S, ctx.smem.sDsum[None, s])
        warpgroup.wait_group(0)
        self.dscores(ctx, acc_S, acc_dP, dtanh, ctx.smem.sDsum[None, s], dsum, (head, m_block))
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        convert_pairs(acc_S, rP)
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        convert_pairs(acc_dP, rdS)
        tdQrdS = ctx.tdQrdS
        if cutlass.const_expr(self.ds_before_dv):
            tdQrdS = self.store_ds(ctx, rdS, s)
        # dV += P^T dO and dK += dS^T Q, A straight from registers.
        wg_gemm(self.mma_dkv, ctx.acc_dV, acc_to_frgA_sm90(rP), ctx.tdVrdOt[None, None, None, s],
                zero_init=False, wg_wait=-1)
        if cutlass.const_expr(not self.dq_before_dk):
            wg_gemm(self.mma_dkv, ctx.acc_dK, acc_to_frgA_sm90(rdS), ctx.tdKrQt[None, None, None, s],
                    zero_init=False, wg_wait=-1)
        if cutlass.const_expr(not self.ds_before_dv):
            tdQrdS = self.store_ds(ctx, rdS, s)
        cute.arch.fence_view_async_shared()  # generic-proxy writes before wgmma reads them
        cute.arch.barrier(barrier_id=BAR_DS_FULL, number_of_threads=self.num_mma_threads)
        acc_dQ = cute.make_rmem_tensor(ctx.thr_dq.partition_shape_C(dq_acc_shape(self.tile_m, self.hdim)),
                                       Float32)
        if cutlass.const_expr(self.dq_before_dk):
            # dQ, then dK: once dQ is done (dK may still run) its tile goes out under dK.
            self.dq_gemm(acc_dQ, tdQrdS, ctx.tdQrKt, wg_wait=-1)
            wg_gemm(self.mma_dkv, ctx.acc_dK, acc_to_frgA_sm90(rdS), ctx.tdKrQt[None, None, None, s],
                    zero_init=False, wg_wait=1)
            self.store_dq_under_dk(ctx, pipes, state, state, acc_dQ, head, m_block)
        else:
            self.dq_gemm(acc_dQ, tdQrdS, ctx.tdQrKt, wg_wait=0)
            # Every GEMM of this block is done: Q and dO may be overwritten (dS once both warpgroups
            # pass the next block's EMPTY barrier).
            pipes.q.consumer_release(state)
            if cutlass.const_expr(self.split_loads):
                pipes.do.consumer_release(state)
            self.store_dq(ctx, acc_dQ, head, m_block)

    @cute.jit
    def store_ds(self, ctx, rdS, s):
        """dS^T -> smem for dQ = dS K, whose key axis spans both warpgroups; returns the dQ MMA's
        dS operand view of the buffer written. One buffer: wait until both warpgroups' previous dQ
        GEMMs are done with it. Two (per Q/dO stage): the previous block's FULL barrier already
        implies that for the buffer written now (block i - 2's). The caller fences and signals."""
        tRSsdSt, tdQrdS = ctx.tRSsdSt, ctx.tdQrdS
        if cutlass.const_expr(self.ds_stages > 1):
            tRSsdSt, tdQrdS = tRSsdSt[None, None, None, s], tdQrdS[None, None, None, s]
        else:
            cute.arch.barrier(barrier_id=BAR_DS_EMPTY, number_of_threads=self.num_mma_threads)
        cute.copy(ctx.st_dS, ctx.thr_st_dS.retile(rdS), tRSsdSt)
        return tdQrdS

    @cute.jit
    def store_dq_under_dk(self, ctx, pipes, q_state, do_state, acc_dQ, head: Int32, m_block: Int32):
        """``dq_before_dk``, once dQ has completed and dK (issued last) still runs: dO's stage goes
        back (dV, its last reader, is done), dQ leaves for its accumulator under dK, then Q's
        stage once dK completes."""
        if cutlass.const_expr(self.split_loads):
            pipes.do.consumer_release(do_state)
        self.store_dq(ctx, acc_dQ, head, m_block)
        warpgroup.wait_group(0)
        pipes.q.consumer_release(q_state)
