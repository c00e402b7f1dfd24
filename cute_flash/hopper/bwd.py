"""FlashAttention-3 style backward main kernel for Hopper (sm90a), head dims 64 and 128 (d = 256:
``bwd_wide.py``). Autograd runs it on Hopper (``bwd.bwd_family``).

One CTA owns ``tile_n`` keys of one (batch, head) and walks the query blocks that see them
(``tile_m`` rows each). Warpgroup 0 produces: one warp TMA-loads K and V once, then Q and dO of
each query block into a ``stages``-deep pipeline (one mbarrier per stage for both, or with
``split_loads`` K, V, Q + LSE2 and dO + D each on their own). The two
consumer warpgroups own 64 keys each and run, per query block, the five GEMMs of the backward with
the key axis on wgmma's M (the "swapped" S^T form, so dK and dV accumulate in registers and P^T,
dS^T feed their GEMMs straight from registers):

    S^T  = K Q^T           (SS)     P^T  = exp2(S^T * scale*log2e - LSE2)
    dP^T = V dO^T          (SS)     dS^T = P^T * (dP^T - D)
    dV  += P^T dO          (RS)     dK  += dS^T Q            (RS)
    dQ   = dS K            (SS, dS^T through smem: its key axis is split over the warpgroups)

dQ of a query block goes into the fp32 accumulator (one chunk per query block of the sm80
backward's padded scratch, in the dQ MMA's fragment order): the consumers write it to smem and a
writer warp of the producer warpgroup adds the tile with one bulk reduce-add (``dq_warp``), or the
consumers issue 16-byte ``red.global.add.v4.f32`` themselves (deterministic mode unless the writer
orders the adds there too, d = 192 non-causal). The sm80 preprocess fills LSE2 / D / zeroes the
accumulator, and ``FlashBwdPostSm90`` (``bwd_postprocess.py``) scales and converts it. dK (scaled)
and dV are stored at the end. GQA/MQA: the CTA of a KV head walks the query blocks
of every query head of its group, so dK and dV sum over the group in registers. Causal and
sliding-window masks (bottom-right aligned), varlen, deterministic mode (ordered dQ adds) and
softcap (d = 128) as in the sm80 backward. Head dims 64 (128 query rows per block, dQ split by
rows) and 128 (64 rows, dQ split by columns), d_v = d.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from cute_flash.device import scratch, waits, warp_mma
from cute_flash.device.block_info import BlockInfo
from cute_flash.device.convert import convert_pairs
from cute_flash.device.layout import acc_to_mn, transpose_smem
from cute_flash.device.seqlen import SeqlenInfo
from cute_flash.device.softmax import score_scales
from cute_flash.device.tile_scheduler import section_size, section_walk_plan
from cute_flash.hopper.bwd_epilogue import BwdEpilogue
from cute_flash.hopper.bwd_load import BwdProducer
from cute_flash.hopper.fwd import acc_to_frgA_sm90, wg_gemm

# Named barrier ids (0 is __syncthreads), over the two consumer warpgroups: dS in smem is written
# by both and read by both (the dQ GEMM contracts over all tile_n keys), so each block's writes
# wait for the previous block's dQ GEMMs (EMPTY) and its dQ GEMMs for both halves (FULL).
BAR_DS_EMPTY = 1
BAR_DS_FULL = 2
# Deterministic mode: the consumer threads wait together for the previous K/V block's dQ adds.
BAR_DQ_ORDER = 3
# dQ writer warp (``dq_warp``): each consumer warpgroup (128 threads) and the writer warp (32) hand
# that warpgroup's half of the fp32 dQ tile in smem back and forth: EMPTY + wg once the writer's
# bulk reduce-add has read it, FULL + wg once the warpgroup has written it. Per warpgroup, so the
# two need not meet here (they already do once per block, at the dS barrier).
BAR_DQ_EMPTY = 4  # and 5
BAR_DQ_FULL = 6  # and 7
DQ_HANDOFF_THREADS = 128 + 32
# Wide kernel with ``dq_before_dk``: P in smem from both warpgroups before the dV GEMM reads it
# (P and dS then meet at separate barriers, so dV runs while dS is stored).
BAR_P_FULL = 8
NUM_MMA_THREADS = 256


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


class FlashBwdSm90(BwdProducer, BwdEpilogue):
    epilogue_barrier = BAR_DS_EMPTY

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.dtype = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[cfg.dtype]
        self.hdim = cfg.hdim
        # V / dO / dV head dim (= hdim but in the wide kernel's (192, 128)).
        self.hdim_v = cfg.hdim_v
        self.tile_m, self.tile_n, self.num_stages = cfg.tile_m, cfg.tile_n, cfg.stages
        # dO + D stages (``do_stages``, split loads in the wide kernel): fewer than Q's, the dO
        # pipeline keeps its own state.
        self.num_do_stages = cfg.do_stages or cfg.stages
        self.separate_do = self.num_do_stages != self.num_stages
        self.is_causal, self.is_local, self.has_softcap = cfg.causal, cfg.local, cfg.softcap
        self.varlen, self.deterministic = cfg.varlen, cfg.deterministic
        self.dq_warp = cfg.dq_warp
        self.dq_before_dk, self.ds_stages, self.ds_stmatrix = cfg.dq_before_dk, cfg.ds_stages, cfg.ds_stmatrix
        self.det_descending = cfg.det_descending
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
        # dS as (queries, keys), K-major for the dQ GEMM. (A (keys, queries) tile read MN-major
        # would make the dS^T stores 32-bit and conflict-free, but gave wrong dQ on the H200 --
        # not understood yet, see docs/notes.md.)
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
        out = {"sLSE2": cute.make_layout((self.tile_m, self.num_stages)),
               "sDsum": cute.make_layout((self.tile_m, self.num_do_stages))}
        if cutlass.const_expr(self.dq_warp):
            out["sdQ"] = cute.make_layout(self.tile_m * self.hdim)  # fragment order (scratch)
        return out

    def _storage(self):
        fields = {"mbar_kv": cute.struct.MemRange[cutlass.Int64, 4 if self.split_loads else 2],
                  "mbar_qdo": cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]}
        if self.split_loads:
            fields["mbar_do"] = cute.struct.MemRange[cutlass.Int64, 2 * self.num_do_stages]
        for name, layout in self.smem_layouts().items():
            fields[name] = cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(layout)], 1024]
        for name, layout in self.fp32_layouts().items():
            # 16-byte aligned: the destination of a bulk copy.
            fields[name] = cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(layout)], 128]
        return cute.struct(type("Storage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
                 mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
                 mSemaphore: cute.Tensor | None, softmax_scale: Float32, softcap: Float32,
                 window_left: Int32, window_right: Int32, max_seqlen_k: Int32, stream):
        """The sm80 main backward's signature (semaphores: deterministic mode only, else None).
        Packed (varlen) inputs: TMA boxes start at each batch's first row; rows of the next batch
        that a box reaches are masked (keys) or have P = 0 (queries: LSE2 = +inf padding)."""
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
        grid = (cute.ceil_div(seqlen_k, self.tile_n), mK.shape[2], num_batch)
        if cutlass.const_expr(self.cfg.persistent):
            grid = (cutlass.min(grid[0] * grid[1] * grid[2], self.cfg.num_ctas), 1, 1)
        score_scale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap)
        scales = (softmax_scale, score_scale, scale_log2)
        # Integer divisions by launch-invariant numbers happen here, once, not at every CTA's start
        # (``section_walk_plan``): the GQA ratio, and the longest-first walk's divisors.
        qhead_per_kv = mQ.shape[2] // mK.shape[2]
        walk = ()
        if cutlass.const_expr(self.lpt and self.cfg.lpt_walk_plan and not self.cfg.persistent):
            num_h = mK.shape[2]
            rows = mQ.shape[0] * qhead_per_kv
            group = section_size(Int32(self.cfg.lpt_rows_in_l2()), rows, num_h)
            walk = section_walk_plan(grid[0], num_h, group, self.cfg.lpt_balanced,
                                     divisor=cute.fast_divmod_create_divisor_v2)
        self.kernel(mQ_tma, mK_tma, mV_tma, mdO_tma, mLSE2, mD, mdQaccum, mdK, mdV, mCuSeqlensQ, mCuSeqlensK,
                    mSemaphore, tma_Q, tma_K, tma_V, tma_dO, scales, walk, qhead_per_kv, window_left,
                    window_right, Storage).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=Storage.size_in_bytes(), stream=stream,
            # .minnctapersm 1 pins the register count at entry; without it ptxas may drop every
            # setmaxnreg (C7508: it did at d = 96 / 192) and then serialise the wgmmas.
            min_blocks_per_mp=1, use_pdl=self.cfg.pdl)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE2: cute.Tensor, mD: cute.Tensor, mdQaccum: cute.Tensor, mdK: cute.Tensor,
               mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
               mSemaphore: cute.Tensor | None, tma_Q: cute.CopyAtom, tma_K: cute.CopyAtom,
               tma_V: cute.CopyAtom, tma_dO: cute.CopyAtom, scales: tuple, walk: tuple,
               qhead_per_kv: Int32, window_left: Int32, window_right: Int32, Storage: cutlass.Constexpr):
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
        # Measured: +4-6% at d = 64 together with polling waits (``spin_waits``), nothing without
        # them -- with twice the waits, a sleeping wait's late wake-up costs more.
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
        if cutlass.const_expr(self.cfg.dkv_via_ds):
            # dK / dV staging tiles over the dS buffers (``dkv_stage_offsets``).
            for name, width, off in zip(("sdK_stage", "sdV_stage"), (self.hdim, self.hdim_v),
                                        self.dkv_stage_offsets(), strict=True):
                layout = self._smem(self.tile_n, width, None)
                ptr = cute.recast_ptr(storage.sdS.data_ptr() + off, layout.inner, dtype=self.dtype)
                setattr(smem, name, cute.make_tensor(ptr, layout.outer))
        args = warp_mma.Ctx(mQ=mQ, mK=mK, mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=mCuSeqlensK,
                          mSemaphore=mSemaphore, window_left=window_left, window_right=window_right,
                          qhead_per_kv=qhead_per_kv)
        loads = warp_mma.Ctx(mQ=mQ, mK=mK, mV=mV, mdO=mdO, mLSE2=mLSE2, mD=mD, tma_Q=tma_Q, tma_K=tma_K,
                           tma_V=tma_V, tma_dO=tma_dO)
        if cutlass.const_expr(self.cfg.persistent):
            self.persistent_roles(args, loads, mdQaccum, mdK, mdV, smem, pipes, scales, warp_idx)
        else:
            n_block, head_kv, batch = cute.arch.block_idx()
            if cutlass.const_expr(self.lpt):
                n_block, head_kv = self.longest_first(n_block, head_kv, walk, args)
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
                    if cutlass.const_expr(self.dq_warp):
                        if warp_idx == 1:
                            self.wait_for_preprocess()
                            self.dq_writer(mdQaccum, smem, seqlen, work)
                else:
                    cute.arch.setmaxregister_increase(240)
                    # (Deterministic mode's semaphores and the consumers' own dQ reductions.)
                    self.wait_for_preprocess()
                    ctx = self.consumer_setup(mLSE2, mD, mdQaccum, smem, scales, args)
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
        if cutlass.const_expr(self.deterministic and self.det_descending and not self.cfg.rotate_m):
            # Descending dQ order: CTA n waits for CTA n + 1, so the last key block must launch
            # first (CTAs start in blockIdx order; a waiter whose predecessor is not resident
            # yet could otherwise fill every SM and never let it in).
            n_block = cute.ceil_div(seqlen.seqlen_k, self.tile_n) - 1 - n_block
        block_info = BlockInfo(self.tile_m, self.tile_n, self.is_causal, self.is_local, args.window_left,
                               args.window_right)
        m_block_min, m_block_max = block_info.m_block_min_max(seqlen, n_block)
        m_block_min = cutlass.min(m_block_min, m_block_max)
        # Deterministic mode: K/V blocks add into each query block in a fixed order, ascending n
        # (as the sm80 backward) or, with ``det_descending``, descending -- in causal attention the
        # short late blocks then go first and nobody waits (ascending, each block's CTA idles on its
        # SM until the long early blocks have passed its query blocks). ``order_rank``: this block's
        # place in the chain; ``prev_*``: the query blocks its predecessor adds into (intervals).
        order_rank = n_block
        prev_valid = n_block > 0
        prev_min, prev_max = Int32(0), Int32(0)
        if cutlass.const_expr(self.deterministic and not self.cfg.rotate_m):
            if cutlass.const_expr(self.det_descending):
                num_n = cute.ceil_div(seqlen.seqlen_k, self.tile_n)
                order_rank = num_n - 1 - n_block
                prev_valid = n_block + 1 < num_n
                prev_min, prev_max = block_info.m_block_min_max(seqlen, n_block + 1)
            else:
                prev_min, prev_max = block_info.m_block_min_max(seqlen, n_block - 1)
        # GQA/MQA: this KV head's query heads are [head_kv * group, (head_kv + 1) * group).
        # (The launcher's ratio saves the division at every CTA's start; the persistent grid keeps
        # its own: there the kernel argument cost 24 bytes of stack.)
        group = mQ.shape[2] // mK.shape[2] if cutlass.const_expr(self.cfg.persistent) else args.qhead_per_kv
        # ``rotate_m``: key block n walks its query blocks from the n-th one on (wrapping), so the
        # CTAs of one head are at different query blocks at any moment (measured faster at d = 256
        # without masks, slower in the narrow kernel: ``SM90_BWD_ROTATE_M``).
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
        work = warp_mma.Ctx(n_block=n_block, head_kv=head_kv, batch=batch, group=group,
                          m_block_min=m_block_min, m_block_max=m_block_max, prev_min=prev_min,
                          prev_max=prev_max, prev_valid=prev_valid, order_rank=order_rank,
                          mSemaphore=args.mSemaphore, rot=rot, rank_plan=rank_plan)
        return seqlen, work

    # ------------------------------------------------------------------------------------------
    # Consumer warpgroups
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consumer_setup(self, mLSE2, mD, mdQaccum, smem, scales, args):
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
        ctx.mLSE2, ctx.mD, ctx.mdQaccum = mLSE2, mD, mdQaccum
        return ctx

    @cute.jit
    def consumer_tile(self, ctx, mdK, mdV, pipes, seqlen: SeqlenInfo, work, scales, kv_state, state,
                      do_state=None):
        """One K/V tile: every (query head, query block) that sees it, then the dK / dV epilogue.
        Returns the pipeline states after it. On the persistent grid K and V go back to the
        producer as soon as the last block's GEMMs are done (``dkv_via_ds``: the epilogue does not
        use their smem), so the next tile's loads run under the epilogue."""
        ctx.seqlen, ctx.batch = seqlen, work.batch
        ctx.n_block, ctx.head_kv = work.n_block, work.head_kv
        ctx.mSemaphore = work.mSemaphore
        ctx.prev_min, ctx.prev_max = work.prev_min, work.prev_max
        ctx.prev_valid, ctx.order_rank = work.prev_valid, work.order_rank
        ctx.rank_plan, ctx.rot, ctx.m_block_min = work.rank_plan, work.rot, work.m_block_min
        ctx.acc_dK.fill(0.0)
        ctx.acc_dV.fill(0.0)
        waits.wait_full(pipes.kv, kv_state, self.spin_waits)
        k_state = kv_state.clone()
        if cutlass.const_expr(self.split_loads):
            kv_state.advance()  # V's stage: waited for before each dP^T (at once after the first)
        total = self.num_work_items(work)
        for it in cutlass.range(total, unroll=1):
            head, m_block = self.work_item(work, it)
            self.one_m_block(ctx, pipes, state, head, m_block, kv_state, do_state)
            state.advance()
            if cutlass.const_expr(self.separate_do):
                do_state.advance()
        persistent = self.cfg.persistent
        if cutlass.const_expr(persistent):
            pipe_kv = pipes.kv
            if total == 0:
                waits.wait_full(pipe_kv, kv_state, self.spin_waits)  # (see ``load_split``)
            if cutlass.const_expr(self.cfg.dkv_via_ds):
                pipes.kv.consumer_release(k_state)
                pipes.kv.consumer_release(kv_state)
        self.epilogue(ctx, mdK, mdV, scales[0])
        if cutlass.const_expr(persistent and not self.cfg.dkv_via_ds):
            pipes.kv.consumer_release(k_state)
            pipes.kv.consumer_release(kv_state)
        kv_state.advance()
        return kv_state, state

    @staticmethod
    def num_work_items(work) -> Int32:
        """(query head, query block) pairs of this K/V block: every query head of its group
        (GQA), each over the query blocks that see it."""
        return work.group * (work.m_block_max - work.m_block_min)

    @staticmethod
    def work_item(work, it: Int32) -> tuple:
        """(query head, query block) of item ``it``, in the order the consumers and the dQ writer
        warp both walk (the producer's head / block loops give the same order). This division per
        block is in every role's loop; stepping (head, block) instead, or nested loops, made ptxas
        serialise the consumers' wgmmas at d = 128 with 80-row tiles or spill in the persistent
        grid's 24-register warps (the register budget is the kernel's, not the role's)."""
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
            # dS^T written into smem through the S^T accumulator's (key, query) coordinates.
            tSsdSt=thr_sdp.partition_C(transpose_smem(smem.sdS)),
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
        """``ds_stmatrix``: dS^T leaves the S^T accumulator layout through transposing ``stmatrix``
        (8x8 tiles, 4 per instruction) instead of 2-byte stores: the key axis is the contiguous
        one of the K-major dS tile, across the accumulator's register pairs."""
        if cutlass.const_expr(not self.ds_stmatrix):
            return {}
        # A 4-tile store takes the same register quad as one k16 slice of the dK GEMM's A operand
        # (16 keys x 16 queries). At tile_m = 80, issuing it after dK (in flight, its A quads
        # locked) leaves ptxas short of registers: it serialises every wgmma (4 -> 34 waits), so
        # there one tile per instruction (20 STSM). Stored ahead of dV (``ds_before_dv``, flash-
        # attn-4's order) the quads are read before any dK / dV GEMM holds them: 5 STSM, no waits
        # (a loop of 470 instructions against 488), yet 3-4% slower than the default at 2k-8k.
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
        dtanh = self.probs(ctx, acc_S, ctx.smem.sLSE2[None, s], m_block, lse2)
        dsum = self.stats_regs(ctx, acc_S, ctx.smem.sDsum[None, s])
        warpgroup.wait_group(0)
        self.dscores(ctx, acc_S, acc_dP, dtanh, ctx.smem.sDsum[None, s], dsum)
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
        tSsdSt, tdQrdS = ctx.tSsdSt, ctx.tdQrdS
        if cutlass.const_expr(self.ds_stmatrix):
            tSsdSt = ctx.tRSsdSt
        if cutlass.const_expr(self.ds_stages > 1):
            tSsdSt, tdQrdS = tSsdSt[None, None, None, s], tdQrdS[None, None, None, s]
        else:
            cute.arch.barrier(barrier_id=BAR_DS_EMPTY, number_of_threads=self.num_mma_threads)
        if cutlass.const_expr(self.ds_stmatrix):
            cute.copy(ctx.st_dS, ctx.thr_st_dS.retile(rdS), tSsdSt)
        else:
            for i in cutlass.range_constexpr(cute.size(rdS)):
                tSsdSt[i] = rdS[i]
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

    @cute.jit
    def mask_bounds(self, ctx, m_block: Int32):
        """(last_key, hi, lo) of query block ``m_block`` against this K/V block, in tile-local
        indices (key k, query q): a score is kept iff k <= last_key and, for causal / windows,
        lo <= k - q <= hi (row q sees keys q + offset - left .. q + offset + right, bottom-right
        aligned; unbounded sides never bind). Scalars per block, so no per-column bound stays live
        in registers."""
        offset = ctx.seqlen.seqlen_k - ctx.seqlen.seqlen_q
        key0 = ctx.n_block * self.tile_n
        q0 = m_block * self.tile_m
        # An unbounded side must not bind for any (key, query) pair: key - query spans
        # (-seqlen_q, seqlen_k), so seqlen_q + seqlen_k is out of reach either way. (seqlen_k alone
        # is not: with more queries than keys, offset < 0 and key <= query + offset + seqlen_k cuts.)
        unbounded = ctx.seqlen.seqlen_q + ctx.seqlen.seqlen_k
        right = Int32(0)
        left = unbounded
        if cutlass.const_expr(self.is_local):
            right = unbounded if ctx.window_right < 0 else ctx.window_right
            left = unbounded if ctx.window_left < 0 else ctx.window_left
        return ctx.seqlen.seqlen_k - 1 - key0, q0 + offset + right - key0, q0 + offset - left - key0

    # LSE2 and D come through smem with the block's Q / dO and are read where used: holding them in
    # registers across the GEMMs spills at this register budget (dK, dV, S^T, dP^T are 192 of 240).
    # Here the accumulator's columns are the queries (S^T); the wide kernel's rows are.
    stat_mode = 1

    def stat_query(self, ctx, i: int):
        """Tile-local query of accumulator column (here) / row (wide kernel) ``i``."""
        return ctx.tScS[0, i][1]

    @cute.jit
    def stats_regs(self, ctx, acc_S, sStat):
        """``prefetch_stats``: this thread's per-query statistics (LSE2 or D), one per accumulator
        column (row in the wide kernel), else None (read where used, ``stat_at``)."""
        regs = None
        if cutlass.const_expr(self.prefetch_stats):
            n = cute.size(acc_to_mn(acc_S), mode=[self.stat_mode])
            regs = cute.make_rmem_tensor(n, Float32)
            for i in cutlass.range_constexpr(n):
                regs[i] = sStat[self.stat_query(ctx, i)]
        return regs

    def stat_at(self, ctx, sStat, regs, i: int) -> Float32:
        """The statistic (LSE2 or D) of accumulator column (wide kernel: row) ``i``: from smem, or
        from ``prefetch_stats``' registers."""
        if cutlass.const_expr(regs is None):
            return sStat[self.stat_query(ctx, i)]
        return regs[i]

    @cute.jit
    def probs(self, ctx, acc_S, sLSE2, m_block: Int32, lse2_regs=None):
        """P = exp2(S * c - LSE2[query]) in place (softcap: of tanh(S * score_scale)), after the
        key-range / causal / window mask; S^T here (keys on the accumulator's rows), S in the wide
        kernel (``stat_mode``). Padding query rows have LSE2 = +inf (preprocess), so their P is 0.
        Returns 1 - tanh^2 (softcap's chain-rule factor) or None."""
        dtanh = self.softcap_scores(ctx, acc_S)
        bounds = self.mask_bounds(ctx, m_block)
        # By default only edge blocks (diagonal / window band, the partial last K/V block) pay for
        # the mask. ``mask_always`` masks every block instead: the compare-and-select per score
        # costs less than the branch, whose join keeps ptxas from moving the stores and waits
        # after the exponentials in among them (measured +4-5% at d = 64).
        if cutlass.const_expr(self.mask_always):
            self.exp2_scores(ctx, acc_S, sLSE2, lse2_regs, bounds)
        elif self.block_needs_mask(bounds):
            self.exp2_scores(ctx, acc_S, sLSE2, lse2_regs, bounds)
        else:
            self.exp2_scores(ctx, acc_S, sLSE2, lse2_regs, None)
        return dtanh

    @cute.jit
    def exp2_scores(self, ctx, acc_S, sLSE2, lse2_regs, bounds):
        """``probs``' exponentials over this thread's scores, query by query (the accumulator's
        columns here, its rows in the wide kernel: ``stat_mode``), masked by ``bounds``
        (``mask_bounds``) or, with None, not at all. ``mask_always`` turns the bounds into one key
        interval per query (``key_window``): a score pays one compare-and-select (two with a left
        window) instead of two (three). (The edge blocks' path of the default keeps its
        per-score compares: GPU-tested as it is.)"""
        acc = acc_to_mn(acc_S)
        qm = self.stat_mode  # the query mode of ``acc`` and of a ``tScS`` coordinate
        for i in cutlass.range_constexpr(cute.size(acc, mode=[qm])):
            lse2 = self.stat_at(ctx, sLSE2, lse2_regs, i)
            window = None
            if cutlass.const_expr(bounds is not None and self.mask_always):
                window = self.key_window(self.stat_query(ctx, i), bounds)
            for j in cutlass.range_constexpr(cute.size(acc, mode=[1 - qm])):
                rc = (j, i) if cutlass.const_expr(qm == 1) else (i, j)
                x = acc[rc] * ctx.scale_log2 - lse2
                key, query = ctx.tScS[rc][1 - qm], ctx.tScS[rc][qm]
                if cutlass.const_expr(bounds is not None and not self.mask_always):
                    acc[rc] = self.masked_exp2(x, key, query, bounds)
                else:
                    acc[rc] = self.window_exp2(x, key, window)

    @cute.jit
    def key_window(self, query: Int32, bounds: tuple):
        """(first, last) tile-local key that query ``query`` sees under ``mask_bounds``' bounds
        (first only with a left window, else None)."""
        last_key, hi, lo = bounds
        last = last_key
        if cutlass.const_expr(self.is_causal or self.is_local):
            last = cutlass.min(last, query + hi)
        first = None
        if cutlass.const_expr(self.is_local):
            first = query + lo
        return first, last

    @cute.jit
    def window_exp2(self, x: Float32, key: Int32, window) -> Float32:
        """exp2(x), or exp2(-inf) = 0 for a key outside ``window`` (``key_window``; None: none)."""
        if cutlass.const_expr(window is not None):
            first, last = window
            ok = key <= last
            if cutlass.const_expr(first is not None):
                ok = ok and key >= first
            x = cutlass.select_(ok, x, -Float32.inf)
        return cute.math.exp2(x, fastmath=True)

    @cute.jit
    def block_needs_mask(self, bounds: tuple):
        """Whether any (key, query) pair of the tile is masked (``mask_bounds``; tile-local key in
        [0, tile_n), query in [0, tile_m)): uniform over the CTA, so a branch, not a select."""
        last_key, hi, lo = bounds
        need = last_key < self.tile_n - 1
        if cutlass.const_expr(self.is_causal or self.is_local):
            need = need or hi < self.tile_n - 1
        if cutlass.const_expr(self.is_local):
            need = need or lo > 1 - self.tile_m
        return need

    @cute.jit
    def softcap_scores(self, ctx, acc_S):
        """Softcap: S <- tanh(S * score_scale) in place; returns 1 - tanh^2 for the chain rule (or
        None without softcap), kept as fp16 (11-bit mantissa, values in [0, 1]): half the registers
        of fp32, which the narrow kernel's budget needs."""
        dtanh = None
        if cutlass.const_expr(self.has_softcap):
            dtanh = cute.make_rmem_tensor_like(acc_S, cutlass.Float16)
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                t = cute.math.tanh(acc_S[i] * ctx.score_scale, fastmath=True)
                acc_S[i] = t
                dtanh[i] = (Float32(1.0) - t * t).to(cutlass.Float16)
        return dtanh

    @cute.jit
    def softcap_grad(self, acc_dS, dtanh):
        """dS *= 1 - tanh^2 (softcap only)."""
        if cutlass.const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(cute.size(acc_dS)):
                acc_dS[i] = acc_dS[i] * dtanh[i].to(Float32)

    @cute.jit
    def masked_exp2(self, x: Float32, key: Int32, query: Int32, bounds: tuple) -> Float32:
        """exp2(x) where the query sees the key (``mask_bounds``), else exp2(-inf) = 0."""
        last_key, hi, lo = bounds
        ok = key <= last_key
        if cutlass.const_expr(self.is_causal or self.is_local):
            ok = ok and key - query <= hi
        if cutlass.const_expr(self.is_local):
            ok = ok and key - query >= lo
        return cute.math.exp2(cutlass.select_(ok, x, -Float32.inf), fastmath=True)

    @cute.jit
    def dscores(self, ctx, acc_S, acc_dP, dtanh, sDsum, dsum_regs=None):
        """dS^T = P^T * (dP^T - D[query]) [* (1 - tanh^2)] into ``acc_dP``."""
        p = acc_to_mn(acc_S)
        dp = acc_to_mn(acc_dP)
        for c in cutlass.range_constexpr(cute.size(dp, mode=[1])):
            dsum = self.stat_at(ctx, sDsum, dsum_regs, c)
            for r in cutlass.range_constexpr(cute.size(dp, mode=[0])):
                dp[r, c] = p[r, c] * (dp[r, c] - dsum)
        self.softcap_grad(acc_dP, dtanh)

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
                # Deterministic mode through the writer (flash-attn-4's sm90 scheme): only this
                # lane waits for the predecessor K/V block's adds, while the consumers compute on
                # (they stall only if the smem chunk is not back yet).
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
            # grid boundary. Waiting for their completion held every CTA's exit (and so the next
            # CTA's start on this SM) for a round trip of the last 32 KiB reduce-add.
            cute.arch.cp_async_bulk_wait_group(0, read=cutlass.const_expr(self.cfg.dq_exit_read_only))

    @cute.jit
    def release_dq_chunk(self, wg: int, it: Int32, total: Int32):
        """Hand warpgroup ``wg``'s smem dQ chunk back (it has been read), unless this was the last
        query block."""
        cute.arch.sync_warp()
        if it + 1 < total:
            cute.arch.barrier_arrive(barrier_id=BAR_DQ_EMPTY + wg, number_of_threads=DQ_HANDOFF_THREADS)

    @cute.jit
    def store_dq(self, ctx, acc_dQ, head: Int32, m_block: Int32):
        """Adds this block's dQ partial into its fp32 accumulator chunk (fragment order, see
        ``scratch.frag_chunk_view``): through the writer warp (``dq_warp``), or with vector
        reductions from the consumer threads."""
        sem = None
        # With the writer warp, deterministic mode's ordering is the writer's (``dq_writer``).
        consumers_order = self.deterministic and not self.dq_warp
        if cutlass.const_expr(consumers_order):
            # Bitwise-reproducible dQ: K/V blocks add into a query block in a fixed order; the one
            # of rank r waits until its predecessor (if it saw this query block) has published r.
            sem = self.dq_semaphore(ctx.mSemaphore, ctx.seqlen, ctx.batch, head, m_block)
            rank = ctx.order_rank
            if cutlass.const_expr(self.cfg.rotate_m):
                rank = self.rotated_rank(ctx, m_block)
                if rank > 0:
                    scratch.semaphore_wait(sem, rank, ctx.tidx, BAR_DQ_ORDER, self.num_mma_threads)
            elif ctx.prev_valid and m_block >= ctx.prev_min and m_block < ctx.prev_max:
                scratch.semaphore_wait(sem, ctx.order_rank, ctx.tidx, BAR_DQ_ORDER, self.num_mma_threads)
        if cutlass.const_expr(self.dq_warp):
            # Hand this warpgroup's half to the writer warp: wait until it has read the previous one.
            wg = cute.arch.make_warp_uniform(ctx.tidx // 128)
            cute.arch.barrier(barrier_id=BAR_DQ_EMPTY + wg, number_of_threads=DQ_HANDOFF_THREADS)
            view = scratch.frag_chunk_view(ctx.smem.sdQ, ctx.tidx, self.num_mma_threads)
            for j in cutlass.range_constexpr(cute.size(view, mode=[1])):
                four = cute.make_tensor(acc_dQ.iterator + 4 * j, cute.make_layout(4))
                cute.autovec_copy(four, view[None, j])
            cute.arch.fence_view_async_shared()  # generic-proxy writes before the bulk copy reads them
            cute.arch.barrier_arrive(barrier_id=BAR_DQ_FULL + wg, number_of_threads=DQ_HANDOFF_THREADS)
        else:
            gacc = scratch.dq_accum_block(ctx.mdQaccum, ctx.seqlen, head, ctx.batch, m_block, self.tile_m,
                                           self.hdim)
            scratch.red_add_frag(scratch.frag_chunk_view(gacc, ctx.tidx, self.num_mma_threads), acc_dQ)
        if cutlass.const_expr(consumers_order):
            scratch.semaphore_signal(sem, rank + 1, ctx.tidx, BAR_DQ_ORDER, self.num_mma_threads)

    @cute.jit
    def rotated_rank(self, w, m_block: Int32) -> Int32:
        """Deterministic mode on the rotated walk: this K/V block's place among the adds into
        ``m_block`` (``w``: the work or the consumer context, with ``rank_plan`` and ``rot``)."""
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
