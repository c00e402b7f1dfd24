"""FlashAttention-3 style forward for Hopper (sm90a), the forward of every public entry point there.

A tile is ``tile_m`` query rows of one (batch, head) (of a KV head's whole query group with packed
GQA). A CTA computes one tile, or on the persistent grid (``num_ctas``) loops over tiles, taking a
static stride or claiming them from an atomic counter; its threads are 1 + ``num_mma_wg``
warpgroups. Warpgroup 0 is the producer: it gives registers back (``setmaxnreg.dec``) and one of
its warps issues TMA bulk-tensor loads, Q once and K, V block by block into two ``stages``-deep
mbarrier pipelines (``PipelineTmaAsync``: the TMA's transaction count completes the full
barrier, the consumers' per-warp arrivals complete the empty one). The consumer warpgroups take
the registers (``setmaxnreg.inc``) and own 64 query rows each: S = Q K^T is an SS-wgmma straight
from swizzled smem, the online softmax (exp2, scale folded, deferred normalisation) runs on the
fp32 accumulator, P is converted to 16 bit in registers and O += P V is an RS-wgmma (A from
registers, V^T read from smem as an MN-major operand). K/V blocks are walked last to first as in
the sm80 kernel, so the partial block and the causal/window edge blocks are peeled and masked
while the interior runs unmasked. TMA zero-fills rows past the tensor end (no predicates on the
loads; V runs one block behind K). Each consumer warpgroup issues the next block's Q K^T together
with the current P V and runs the softmax while P V is in flight (intra-warpgroup overlap); with
ping-pong (named barriers) the consumer warpgroups also take turns at the tensor cores, per the
tuned table in ``hopper/fwd_config.py``. Causal tiles are handed out longest first
(``device/tile_scheduler.py``). The epilogue goes registers -> smem (O's own buffer where it
fits, else Q's; stmatrix) -> a TMA store (predicated 16-byte stores for packed varlen outputs).
mbarrier waits spin on try_wait (see ``spin``): the DSL's default wait sleeps.
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
from cute_flash.device.layout import acc_to_mn, pack_heads, transpose_smem, wgmma_smem_tile
from cute_flash.device.mask import AttentionMask
from cute_flash.device.mods import apply_mods, block_range
from cute_flash.device.seqlen import SeqlenInfo
from cute_flash.device.sinks import row_sinks
from cute_flash.device.softmax import OnlineSoftmax, score_scales
from cute_flash.device.tile_scheduler import TileScheduler

# Named barrier ids (0 is __syncthreads): the consumer warpgroups' epilogue barrier, then one
# scheduling barrier per consumer warpgroup (ping-pong).
BAR_EPILOGUE = 1
BAR_SCHED = 2  # 2, 3, 4
# Dynamic persistent grid: the producer warp hands the next tile index to the consumers.
BAR_TILE_FULL = 5
BAR_TILE_EMPTY = 6


def acc_to_frgA_sm90(acc: cute.Tensor) -> cute.Tensor:
    """sm90: the ((2, 2, N/8), MMA_M, MMA_N) wgmma C fragment of S = Q K^T, in 16 bit, is the
    register A fragment of the k16 wgmma P V once every two n8 column groups are paired into one
    k16 slice: ((2, 2, (2, N/16)), M, N) -> ((2, 2, 2), M, (N/16, MMA_N)). Same registers."""
    lay = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    s, d = lay.shape, lay.stride
    new = cute.make_layout(((s[0][0], s[0][1], s[0][2][0]), s[1], (s[0][2][1], s[2])),
                           stride=((d[0][0], d[0][1], d[0][2][0]), d[1], (d[0][2][1], d[2])))
    return cute.make_tensor(acc.iterator, new)


@cute.jit
def wg_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tCrA: cute.Tensor, tCrB: cute.Tensor,
            zero_init: cutlass.Constexpr[bool], wg_wait: cutlass.Constexpr[int] = 0):
    """acc (+)= A B^T on the tensor cores of this warpgroup, issued as one commit group; waits
    until at most ``wg_wait`` groups are in flight (-1: no wait). ``wgmma.fence`` orders earlier
    register writes (acc rescale, P) before the async MMAs."""
    warpgroup.fence()
    # A fresh atom per call: its ACCUMULATE field is mutated along k.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(atom, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if cutlass.const_expr(wg_wait >= 0):
        warpgroup.wait_group(wg_wait)


class FlashFwdSm90:
    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.dtype = jit.DTYPES[cfg.dtype]
        # O's element type (Q, K, V are ``dtype``; they differ in the FP8 subclass).
        self.o_dtype = self.dtype
        self.hdim, self.hdim_v = cfg.hdim, cfg.hdim_v
        self.tile_m, self.tile_n, self.num_stages = cfg.tile_m, cfg.tile_n, cfg.stages
        self.num_mma_wg = cfg.num_mma_wg
        self.num_mma_threads = 128 * self.num_mma_wg
        self.num_threads = self.num_mma_threads + 128
        self.is_causal, self.is_local = cfg.causal, cfg.local
        self.has_softcap, self.varlen = cfg.softcap, cfg.varlen
        self.has_sinks = cfg.sinks
        self.mods = cfg.mods
        # Heaviest query blocks first: the bottom ones of causal / window masks, and of the causal
        # shapes block masks mostly take (prefix-LM, causal documents).
        self.lpt = self.is_causal or self.is_local or (self.mods is not None and self.mods.block_sparse)
        # Packed GQA: the ``pack`` query heads sharing a KV head fill the M tile together
        # (decode: one token x ``pack`` heads per row group instead of 1 useful row in 128).
        self.pack = cfg.pack_gqa
        self.pingpong = cfg.pingpong
        # The O rescale of block n sits between the wait for P V(n+1) and the next GEMMs. For wide
        # O (d_v > 128: 128+ accumulator registers per thread) it is long enough to show: apply it
        # one block late instead, while Q K^T(n) runs and before P V(n+1) is issued (O is not an
        # operand of Q K^T).
        self.rescale_before_pv = cfg.rescale_o_early
        # 64K registers per SM: 24 * 128 + 240 * 256 = 64512 with two consumer warpgroups,
        # 32 * 128 + 160 * 384 = 65536 with three (the 192-row d=64 tile).
        self.producer_regs = 24 if self.num_mma_wg == 2 else 32
        self.mma_regs = 240 if self.num_mma_wg == 2 else 160
        # Persistent grid (``num_ctas`` > 0): a CTA loops over tiles (dense inputs only: a varlen
        # grid's tiles are found from cu_seqlens on the device).
        self.persistent = cfg.num_ctas > 0 and not self.varlen
        # O gets its own smem buffer where it fits, so the next tile's Q can load during the
        # epilogue; otherwise O is staged in Q's buffer.
        self.separate_o = cfg.separate_o
        self.dynamic_tiles = cfg.dynamic_tiles
        # log2 of the factor P is computed with (``OnlineSoftmax.p_log2_offset``; FP8 sets it).
        self.p_log2_offset = 0.0
        self.softmax_sums_rows = True  # (the FP8 kernel's ``sum_mma`` sums P on the tensor cores)
        self.softmax_exp_bytes = False  # (the FP8 kernel's ``exp_bytes``)
        # O leaves through smem and a TMA store (dense) or predicated stores (varlen); the split
        # KV-cache kernel writes fp32 partials from registers instead.
        self.o_via_tma = not self.varlen
        elem = self.dtype.width // 8
        self.tx_Q = self.tile_m * self.hdim * elem
        self.tx_K = self.tile_n * self.hdim * elem
        self.tx_V = self.tile_n * self.hdim_v * elem

    # ------------------------------------------------------------------------------------------
    # Layouts and MMAs (built on the host for the TMA atoms, rebuilt inside the kernel)
    # ------------------------------------------------------------------------------------------
    def _smem(self, rows: int, cols: int, stages: int | None, dtype=None):
        """K-major wgmma-canonical swizzled tile (128/64/32-byte swizzle by row width)."""
        return wgmma_smem_tile(dtype or self.dtype, rows, cols, stages)

    def _setup(self) -> None:
        self.sQ_layout = self._smem(self.tile_m, self.hdim, None)
        self.sK_layout = self._smem(self.tile_n, self.hdim, self.num_stages)
        self.sV_layout = self._smem(self.tile_n, self.hdim_v, self.num_stages)
        self.sO_layout = self._smem(self.tile_m, self.hdim_v, None, self.o_dtype)
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        self.mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1),
            tiler_mn=(64, self.tile_n))
        self.mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, MN, Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1),
            tiler_mn=(64, self.hdim_v), a_source=warpgroup.OperandSource.RMEM)
        self.copy_O = warp_mma.r2g_tiled_copy(self.o_dtype, self.hdim_v, self.num_mma_threads)

    def _storage(self):
        stages = self.num_stages
        sq, sk, sv, so = (cute.cosize(x) for x in (self.sQ_layout, self.sK_layout, self.sV_layout,
                                                    self.sO_layout))
        fields = {
            "mbar_Q": cute.struct.MemRange[cutlass.Int64, 2],
            "mbar_K": cute.struct.MemRange[cutlass.Int64, 2 * stages],
            "mbar_V": cute.struct.MemRange[cutlass.Int64, 2 * stages],
            "next_tile": cute.struct.MemRange[cutlass.Int32, 2],
            # Without a separate O buffer, O leaves through Q's.
            "sQ": cute.struct.Align[cute.struct.MemRange[self.dtype, sq if self.separate_o else max(sq, so)],
                                    1024],
            "sK": cute.struct.Align[cute.struct.MemRange[self.dtype, sk], 1024],
            "sV": cute.struct.Align[cute.struct.MemRange[self.dtype, sv], 1024],
        }
        if self.separate_o:
            fields["sO"] = cute.struct.Align[cute.struct.MemRange[self.o_dtype, so], 1024]
        fields.update(self.extra_smem())
        return cute.struct(type("Storage", (), {"__annotations__": fields}))

    def extra_smem(self) -> dict:
        """More smem fields for a subclass (name -> struct member type)."""
        return {}

    # ------------------------------------------------------------------------------------------
    # Operand hooks (16-bit here; ``hopper/fwd_fp8.py`` overrides them for e4m3)
    # ------------------------------------------------------------------------------------------
    def v_source(self, mV: cute.Tensor) -> cute.Tensor:
        """The (N, d, H, B) V view the TMA atom is built on."""
        return mV

    def k_box(self) -> tuple:
        return (self.tile_n, self.hdim)

    def v_box(self) -> tuple:
        return (self.tile_n, self.hdim_v)

    def kv_box_layout(self, s_layout, cols: int):
        """The smem layout one K / V TMA box fills: a whole stage here (a page of it when paged)."""
        return cute.select(s_layout, mode=[0, 1])

    def v_blocks(self, mV: cute.Tensor, seqlen: SeqlenInfo, head_kv, batch) -> cute.Tensor:
        """V blocks of one KV head, block index last (the TMA partition's)."""
        return cute.local_tile(seqlen.k_rows(mV, head_kv, batch), (self.tile_n, self.hdim_v), (None, 0))

    def v_operand(self, wg_pv, sV: cute.Tensor) -> cute.Tensor:
        """V^T as the P V wgmma's B operand: here an MN-major view of the (keys, d) tiles."""
        return wg_pv.make_fragment_B(wg_pv.partition_B(transpose_smem(sV)))

    @cute.jit
    def convert_p(self, acc_S: cute.Tensor, rP: cute.Tensor) -> None:
        convert_pairs(acc_S, rP)

    def p_operand(self, rP: cute.Tensor) -> cute.Tensor:
        return acc_to_frgA_sm90(rP)

    def init_smem(self, storage) -> None:
        """Constant smem a subclass fills once per CTA, before the CTA-wide barrier."""

    def extra_ctx(self, ctx, smem, wg) -> None:
        """Per-consumer state a subclass adds to ``ctx``."""

    @cute.jit
    def pv_gemm(self, ctx, v_index, wg_wait: cutlass.Constexpr[int]):
        """O += P V for the V stage ``v_index``, one commit group."""
        wg_gemm(self.mma_pv, ctx.acc_O, self.p_operand(ctx.rP), ctx.tOrVt[None, None, None, v_index],
                zero_init=False, wg_wait=wg_wait)

    @cute.jit
    def rescale_o(self, ctx, row_scale) -> None:
        """The running accumulators to the new row maxima."""
        self.fold_row_sums(ctx, row_scale)
        OnlineSoftmax.rescale(ctx.acc_O, row_scale)

    def fold_row_sums(self, ctx, row_scale) -> None:
        """Row sums a subclass takes from the last P V (its wait is done, the next one not yet
        issued), folded into its running sums at the new row maxima; nothing here."""

    @cute.jit
    def finalize_rows(self, ctx):
        """1 / row sum per row (and the LSE into the softmax's state)."""
        return ctx.softmax.finalize(sinks=ctx.sinks)

    def tile_scales(self, ctx, extra: tuple, mQ, mK, head, batch) -> None:
        """Per-tile score scale (the FP8 descales); nothing for 16-bit inputs."""

    def tile_offsets(self, seqlen: SeqlenInfo, extra: tuple, batch) -> None:
        """More per-sequence offsets a subclass reads from ``extra`` (FP8 varlen: V's); none here."""

    def grid_batches(self, num_batch, extra: tuple):
        """The scheduler's batch extent (the KV-cache kernel's splits multiply it)."""
        return num_batch

    def output_scale(self, ctx, row_scale):
        """O's final per-row factor (1 / row sum; times V's descale for FP8)."""
        return row_scale

    # ------------------------------------------------------------------------------------------
    # Host side
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
                 softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                 max_seqlen_q: Int32, mTileCounter: cute.Tensor, mSinks: cute.Tensor | None,
                 mAux0: cute.Tensor | None, mAux1: cute.Tensor | None, mAux2: cute.Tensor | None,
                 mAux3: cute.Tensor | None, mBlocks: cute.Tensor | None, stream):
        """``mSinks``: (H,) fp32 sink logits (``device/sinks.py``), or None; ``mAux*``: the mods'
        aux tensors (``device/mods.py``), None past the last; ``mBlocks``: a block mask's ranges
        (``block_mask.py``), or None."""
        aux = tuple(a for a in (mAux0, mAux1, mAux2, mAux3) if a is not None)
        self._launch(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, softmax_scale, softcap, window_left,
                     window_right, max_seqlen_q, mTileCounter, (), stream, mSinks, aux, mBlocks)

    @cute.jit
    def _launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
                softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                max_seqlen_q: Int32, mTileCounter: cute.Tensor, extra: tuple, stream,
                mSinks: cute.Tensor | None = None, aux: tuple = (), mBlocks: cute.Tensor | None = None):
        """``extra``: tensors a subclass's hooks read in the kernel (the FP8 descales)."""
        self._setup()
        Storage = self._storage()
        mQ, mK, mV, mO, mLSE = warp_mma.forward_views(mQ, mK, mV, mO, mLSE)
        # Packed (varlen) inputs: the TMA boxes start at each batch's first row (cu_seqlens), so a
        # box may run into the next batch's rows; those keys are masked (seqlen mask) and those
        # query rows are never stored.
        num_batch, seqlen_q = warp_mma.grid_rows(mQ, mCuSeqlensQ, max_seqlen_q)
        # TMA descriptors are made on the host and passed to the kernel (grid-constant params).
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        num_head_q = mQ.shape[2]
        if cutlass.const_expr(self.pack > 1):
            tma_Q, mQ_tma = self.packed_tma(g2s, mQ, self.sQ_layout, self.hdim)
            mLSE = pack_heads(mLSE, self.pack, head_mode=1)
        else:
            tma_Q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, mQ, self.sQ_layout, (self.tile_m, self.hdim))
        tma_K, mK_tma = cpasync.make_tiled_tma_atom(g2s, mK, self.kv_box_layout(self.sK_layout, self.hdim),
                                                    self.k_box())
        v_layout = self.kv_box_layout(self.sV_layout, self.hdim_v)
        tma_V, mV_tma = cpasync.make_tiled_tma_atom(g2s, self.v_source(mV), v_layout, self.v_box())
        # O goes out through a TMA store, which clips rows past the tensor's end. Packed (varlen)
        # outputs keep predicated stores: a box would run into the next batch's rows.
        tma_O, mO_out = None, mO
        if cutlass.const_expr(not self.o_via_tma):
            if cutlass.const_expr(self.pack > 1):
                mO_out = pack_heads(mO, self.pack, head_mode=2)
        elif cutlass.const_expr(self.pack > 1):
            tma_O, mO_out = self.packed_tma(cpasync.CopyBulkTensorTileS2GOp(), mO, self.sO_layout,
                                            self.hdim_v)
        else:
            tma_O, mO_out = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO,
                                                        self.sO_layout, (self.tile_m, self.hdim_v))
        score_scale, scale_log2 = score_scales(softmax_scale, softcap, self.has_softcap,
                                               self.mods is not None and self.mods.score_mod is not None)
        # Packed GQA: a grid row per KV head, ``pack`` times as many query rows.
        sched = TileScheduler.create(cute.ceil_div(seqlen_q * self.pack, self.tile_m),
                                     num_head_q // self.pack, self.grid_batches(num_batch, extra),
                                     mK.shape[0], (self.hdim + self.hdim_v) * (self.dtype.width // 8),
                                     lpt=self.lpt, varlen=self.varlen,
                                     l2_sections=self.cfg.l2_sections)
        grid = sched.grid(self.cfg.num_ctas if self.persistent else 0)
        self.kernel(mQ_tma, mK_tma, mV_tma, mO_out, mLSE, mCuSeqlensQ, mCuSeqlensK, tma_Q, tma_K, tma_V,
                    tma_O, score_scale, scale_log2, window_left, window_right, sched.params(), mTileCounter,
                    extra, mSinks, aux, mBlocks, Storage).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=Storage.size_in_bytes(),
            stream=stream)

    def packed_tma(self, op, mT: cute.Tensor, s_layout, cols: int):
        """TMA atom and coordinate tensor for a packed-GQA Q/O: (N, d, H, B) is read as
        ((H, N), d, B), the box covering ``pack`` heads x tile_m/pack tokens (still a 4-D
        descriptor), and the coordinates are handed out as ((pack, N), d, H/pack, B)."""
        heads_first = cute.make_tensor(mT.iterator, cute.select(mT.layout, mode=[2, 0, 1, 3]))
        atom, t = cpasync.make_tiled_tma_atom(op, cute.group_modes(heads_first, 0, 2), s_layout,
                                              ((self.pack, self.tile_m // self.pack), cols))
        shape = ((self.pack, t.shape[0][1]), t.shape[1], t.shape[0][0] // self.pack, t.shape[2])
        stride = ((t.stride[0][0], t.stride[0][1]), t.stride[1], t.stride[0][0] * self.pack, t.stride[2])
        return atom, cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
               tma_Q: cute.CopyAtom, tma_K: cute.CopyAtom, tma_V: cute.CopyAtom,
               tma_O: cute.CopyAtom | None, score_scale: Float32,
               scale_log2: Float32, window_left: Int32, window_right: Int32, sched_params: tuple,
               mTileCounter: cute.Tensor, extra: tuple, mSinks: cute.Tensor | None, aux: tuple,
               mBlocks: cute.Tensor | None, Storage: cutlass.Constexpr):
        self._setup()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_Q)
            cpasync.prefetch_descriptor(tma_K)
            cpasync.prefetch_descriptor(tma_V)

        storage = SmemAllocator().allocate(Storage)
        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # TMA pipelines: one elected lane per consumer warp arrives on the empty barrier.
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads // 32)
        pipe_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_Q.data_ptr(), num_stages=1, producer_group=producer,
            consumer_group=consumers, tx_count=self.tx_Q, defer_sync=True)
        pipes = warp_mma.Ctx(q=pipe_q, **self.kv_pipes(storage, producer, consumers))
        self.init_smem(storage)
        # Barrier inits visible to the async proxy and to every thread before first use.
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()

        sQ = storage.sQ.get_tensor(self.sQ_layout.outer, swizzle=self.sQ_layout.inner)
        sO_buf = storage.sO if cutlass.const_expr(self.separate_o) else storage.sQ
        sO = sO_buf.get_tensor(self.sO_layout.outer, swizzle=self.sO_layout.inner)
        sK = storage.sK.get_tensor(self.sK_layout.outer, swizzle=self.sK_layout.inner)
        sV = storage.sV.get_tensor(self.sV_layout.outer, swizzle=self.sV_layout.inner)
        smem = warp_mma.Ctx(sQ=sQ, sK=sK, sV=sV, sO=sO, storage=storage)
        geo = warp_mma.Ctx(mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=mCuSeqlensK, window_left=window_left,
                           window_right=window_right, sched_params=sched_params, mTileCounter=mTileCounter,
                           next_tile=storage.next_tile.get_tensor(cute.make_layout(2)), extra=extra,
                           mSinks=mSinks, aux=aux, mBlocks=mBlocks)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            self.producer_warps(warp_idx, mQ, mK, mV, tma_Q, tma_K, tma_V, smem, pipes, geo)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            self.consumer(mQ, mK, mO, mLSE, tma_O, smem, pipes, geo, score_scale, scale_log2, extra)

    # ------------------------------------------------------------------------------------------
    # Work: the tiles of this CTA and their K/V block ranges (same code in both roles)
    # ------------------------------------------------------------------------------------------
    def first_tile(self, geo):
        """(first tile index, number of tiles) of this CTA's walk. One tile per CTA unless
        ``persistent``: then a grid of about one CTA per SM walks every tile, so a CTA's producer
        loads the next tile's K/V (and Q) while its consumers finish the current one, and no CTA
        launch / barrier init / register reallocation sits between tiles."""
        bx, _, _ = cute.arch.block_idx()
        if cutlass.const_expr(self.persistent):
            return bx, TileScheduler.num_tiles(geo.sched_params)
        return bx, bx + 1

    @cute.jit
    def claim_next_tile(self, geo, tile_idx):
        """Producer warp: the tile after ``tile_idx`` (>= the tile count when the walk is over).
        Dynamic: claimed from the global counter (lane 0, one atomic), written to smem for the
        consumers, who read it in ``receive_next_tile``; static: a stride of the grid size."""
        if cutlass.const_expr(not self.persistent):
            return tile_idx + 1
        gx, _, _ = cute.arch.grid_dim()
        if cutlass.const_expr(not self.dynamic_tiles):
            return tile_idx + gx
        nxt = Int32(0)
        if cute.arch.lane_idx() == 0:
            nxt = gx + cute.arch.atomic_add(geo.mTileCounter.iterator, Int32(1))
        nxt = cute.arch.shuffle_sync(nxt, 0)
        slot = geo.next_tile
        # The slot is free once every consumer has read the previous value.
        cute.arch.barrier(barrier_id=BAR_TILE_EMPTY, number_of_threads=32 + self.num_mma_threads)
        if cute.arch.lane_idx() == 0:
            slot[0] = nxt
        cute.arch.barrier_arrive(barrier_id=BAR_TILE_FULL, number_of_threads=32 + self.num_mma_threads)
        return nxt

    @cute.jit
    def receive_next_tile(self, geo, tile_idx):
        """Consumers: the tile after ``tile_idx`` (see ``claim_next_tile``)."""
        if cutlass.const_expr(not self.persistent):
            return tile_idx + 1
        if cutlass.const_expr(not self.dynamic_tiles):
            gx, _, _ = cute.arch.grid_dim()
            return tile_idx + gx
        cute.arch.barrier(barrier_id=BAR_TILE_FULL, number_of_threads=32 + self.num_mma_threads)
        nxt = geo.next_tile[0]
        cute.arch.barrier_arrive(barrier_id=BAR_TILE_EMPTY, number_of_threads=32 + self.num_mma_threads)
        return nxt

    @cute.jit
    def tile_work(self, mQ, mK, geo, tile_idx):
        """One tile: (m_block, head, batch, seqlen, block_info, has_rows, n_block_min, n_block_max)."""
        m_block, head, batch = TileScheduler.tile(geo.sched_params, tile_idx, self.lpt, self.varlen)
        seqlen_q = mQ.shape[0][1] if cutlass.const_expr(self.pack > 1) else mQ.shape[0]
        seqlen = SeqlenInfo(batch, seqlen_q, mK.shape[0], geo.mCuSeqlensQ, geo.mCuSeqlensK)
        self.tile_offsets(seqlen, geo.extra, batch)
        block_info = BlockInfo(self.tile_m, self.tile_n, self.is_causal, self.is_local,
                               geo.window_left, geo.window_right, pack=self.pack)
        n_block_min, n_block_max = block_info.n_block_min_max(seqlen, m_block)
        if cutlass.const_expr(geo.mBlocks is not None):
            n_block_min, n_block_max, _, _ = block_range(geo.mBlocks, batch, head, m_block, n_block_min,
                                                         n_block_max)
        # Varlen grids are sized by the longest sequence; shorter ones leave tiles with no rows
        # (skipped by both roles alike: the condition is uniform over the CTA).
        has_rows = m_block * self.tile_m < seqlen.seqlen_q * self.pack
        return m_block, head, batch, seqlen, block_info, has_rows, n_block_min, n_block_max

    # ------------------------------------------------------------------------------------------
    # Producer warp
    # ------------------------------------------------------------------------------------------
    def kv_pipes(self, storage, producer, consumers) -> dict:
        """The K and V pipelines the consumers read (``k``, ``v``), and any a subclass adds: here
        TMA pipelines, completed by the loads' transaction counts."""
        pipe_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_K.data_ptr(), num_stages=self.num_stages,
            producer_group=producer, consumer_group=consumers, tx_count=self.tx_K, defer_sync=True)
        pipe_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_V.data_ptr(), num_stages=self.num_stages,
            producer_group=producer, consumer_group=consumers, tx_count=self.tx_V, defer_sync=True)
        return {"k": pipe_k, "v": pipe_v}

    @cute.jit
    def producer_warps(self, warp_idx, mQ, mK, mV, tma_Q, tma_K, tma_V, smem, pipes, geo):
        """The producer warpgroup's work: warp 0 loads, the other three idle."""
        if warp_idx == 0:
            self.producer(mQ, mK, mV, tma_Q, tma_K, tma_V, smem, pipes, geo)

    @cute.jit
    def producer(self, mQ, mK, mV, tma_Q, tma_K, tma_V, smem, pipes, geo):
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        tile_idx, num_tiles = self.first_tile(geo)
        while tile_idx < num_tiles:
            m_block, head, batch, seqlen, _, has_rows, n_block_min, n_block_max = self.tile_work(
                mQ, mK, geo, tile_idx)
            if has_rows:
                q_state, k_state, v_state = self.load(mQ, mK, mV, tma_Q, tma_K, tma_V, smem, pipes, seqlen,
                                                      m_block, head, batch, n_block_min, n_block_max,
                                                      q_state, k_state, v_state)
            tile_idx = self.claim_next_tile(geo, tile_idx)

    @cute.jit
    def load(self, mQ, mK, mV, tma_Q, tma_K, tma_V, smem, pipes, seqlen: SeqlenInfo, m_block, head, batch,
             n_block_min, n_block_max, q_state, k_state, v_state):
        # GQA/MQA: query head h reads kv head h // (H / H_kv).
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        gQ = cute.local_tile(seqlen.q_rows(mQ, head, batch), (self.tile_m, self.hdim), (m_block, 0))
        tQsQ, tQgQ = cpasync.tma_partition(tma_Q, 0, cute.make_layout(1), cute.group_modes(smem.sQ, 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        k_src, v_src = self.kv_sources(mK, mV, tma_K, tma_V, smem, pipes, seqlen, head_kv, batch)
        # The first K block before Q: a persistent CTA's Q buffer frees only when the previous
        # tile is done with it, while a K stage is usually free already.
        n_block = n_block_max - 1
        if n_block_max > n_block_min:
            self.load_kv(k_src, k_state, n_block)
            k_state.advance()
        # Q always (even with no K/V block to visit: the consumers wait for it, and it may share
        # its buffer with O). Rows past the sequence end are zero-filled by the TMA unit.
        self.acquire_empty(pipes.q, q_state)
        cute.copy(tma_Q, tQgQ, tQsQ, tma_bar_ptr=pipes.q.producer_get_barrier(q_state))
        q_state.advance()
        # V runs one block behind K (K(n-1) is issued before V(n)): the consumers need K(n-1) for
        # the next Q K^T before V(n) for the current P V (intra-warpgroup overlap), and the single
        # producer warp must not sit on a V slot while a K slot is free.
        if n_block_max > n_block_min:
            for _ in cutlass.range(n_block_max - n_block_min - 1, unroll=1):
                self.load_kv(k_src, k_state, n_block - 1)
                k_state.advance()
                self.load_kv(v_src, v_state, n_block)
                v_state.advance()
                n_block -= 1
            self.load_kv(v_src, v_state, n_block)
            v_state.advance()
        return q_state, k_state, v_state

    def kv_sources(self, mK, mV, tma_K, tma_V, smem, pipes, seqlen: SeqlenInfo, head_kv, batch):
        """What ``load_kv`` takes for K and for V: here the TMA atom, the block-indexed source and
        stage-indexed destination partitions, and the pipeline (paged caches: per-page boxes)."""
        gK = cute.local_tile(seqlen.k_rows(mK, head_kv, batch), (self.tile_n, self.hdim), (None, 0))
        gV = self.v_blocks(mV, seqlen, head_kv, batch)
        one = cute.make_layout(1)
        tKsK, tKgK = cpasync.tma_partition(tma_K, 0, one, cute.group_modes(smem.sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_V, 0, one, cute.group_modes(smem.sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        return (tma_K, tKgK, tKsK, pipes.k), (tma_V, tVgV, tVsV, pipes.v)

    @cute.jit
    def load_kv(self, src, state, n_block: Int32):
        """One K or V block into its pipeline stage (waits for the stage to be released)."""
        tma, tXgX, tXsX, pipe = src
        self.acquire_empty(pipe, state)
        cute.copy(tma, tXgX[None, n_block], tXsX[None, state.index],
                  tma_bar_ptr=pipe.producer_get_barrier(state))

    # ------------------------------------------------------------------------------------------
    # Consumer warpgroups
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def consumer(self, mQ, mK, mO, mLSE, tma_O, smem, pipes, geo, score_scale, scale_log2, extra):
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - 128
        thr_qk = self.mma_qk.get_slice(tidx)
        thr_pv = self.mma_pv.get_slice(tidx)
        wg = cute.arch.make_warp_uniform(tidx // 128)
        # The smem operand descriptors depend only on the warpgroup: built from a warp-uniform
        # slice they live in uniform registers, where HGMMA reads them (a per-thread slice puts
        # them in regular registers and costs an R2UR pair before every HGMMA).
        wg_qk, wg_pv = self.mma_qk.get_slice(wg * 128), self.mma_pv.get_slice(wg * 128)
        acc_O = cute.make_rmem_tensor(thr_pv.partition_shape_C((self.tile_m, self.hdim_v)), Float32)
        softmax = OnlineSoftmax(scale_log2, cute.size(acc_to_mn(acc_O), mode=[0]),
                                max_chains=self.cfg.max_chains,
                                seed_sum=self.cfg.seed_row_sum, p_log2_offset=self.p_log2_offset,
                                sum_rows=self.softmax_sums_rows, exp_bytes=self.softmax_exp_bytes)
        # P of the block whose P V is still to be issued (kept across iterations); same compact
        # layout as the S accumulator.
        rP = cute.make_rmem_tensor(thr_qk.partition_shape_C((self.tile_m, self.tile_n)), self.dtype)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(smem.sQ))
        ctx = warp_mma.Ctx(thr_qk=thr_qk, thr_pv=thr_pv, tSrQ=tSrQ,
                           tSrK=wg_qk.make_fragment_B(wg_qk.partition_B(smem.sK)),
                           tOrVt=self.v_operand(wg_pv, smem.sV),
                           acc_O=acc_O, rP=rP, softmax=softmax, pipe_k=pipes.k, pipe_v=pipes.v,
                           score_scale=score_scale, scale_log2=scale_log2, wg=wg, tidx=tidx,
                           row_scale=cute.make_rmem_tensor_like(softmax.row_max, Float32))
        self.extra_ctx(ctx, smem, wg)
        if cutlass.const_expr(self.pingpong):
            # Ping-pong: consumer warpgroup 0 gets the first turn at the tensor cores. Every
            # warpgroup takes as many turns per tile, so the turn is back with it at each tile.
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=BAR_SCHED, number_of_threads=256)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        if cutlass.const_expr(self.persistent and self.dynamic_tiles):
            # The next-tile slot starts free.
            cute.arch.barrier_arrive(barrier_id=BAR_TILE_EMPTY, number_of_threads=32 + self.num_mma_threads)
        tile_idx, num_tiles = self.first_tile(geo)
        while tile_idx < num_tiles:
            m_block, head, batch, seqlen, block_info, has_rows, n_block_min, n_block_max = self.tile_work(
                mQ, mK, geo, tile_idx)
            if has_rows:
                self.tile_scales(ctx, extra, mQ, mK, head, batch)
                q_state, kv_state = self.consume(ctx, mO, mLSE, tma_O, smem, pipes.q, geo, seqlen, block_info,
                                                 m_block, head, batch, n_block_min, n_block_max, q_state,
                                                 kv_state)
            tile_idx = self.receive_next_tile(geo, tile_idx)
        if cutlass.const_expr(self.separate_o):
            if tidx < 32:
                # The last O store must be done reading smem before the CTA's smem goes away.
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def consume(self, ctx, mO, mLSE, tma_O, smem, pipe_q, geo, seqlen: SeqlenInfo, block_info, m_block,
                head, batch, n_block_min, n_block_max, q_state, kv_state):
        """One tile: wait for Q, the K/V blocks, the epilogue, Q's buffer back to the producer."""
        ctx.seqlen, ctx.m_block, ctx.n_block_min = seqlen, m_block, n_block_min
        ctx.head, ctx.batch, ctx.aux, ctx.full = head, batch, geo.aux, None
        if cutlass.const_expr(geo.mBlocks is not None):
            ctx.full = block_range(geo.mBlocks, batch, head, m_block, n_block_min, n_block_max)[2:]
        ctx.mask = AttentionMask(self.tile_m, self.tile_n, seqlen, geo.window_left, geo.window_right,
                                 pack=self.pack)
        ctx.acc_O.fill(0.0)
        ctx.softmax.reset()
        right_start = block_info.n_block_right_mask_start(seqlen, m_block, n_block_min)
        left_end = block_info.n_block_left_mask_end(seqlen, m_block, n_block_min)
        self.wait_full(pipe_q, q_state)
        if n_block_max > n_block_min:
            kv_state = self.mainloop(ctx, kv_state, n_block_max, right_start, left_end)
        if cutlass.const_expr(self.separate_o):
            # Every Q K^T of this tile has completed: the producer may load the next tile's Q
            # while this one's epilogue runs.
            pipe_q.consumer_release(q_state)

        ctx.sinks = None
        if cutlass.const_expr(self.has_sinks):
            ctx.sinks = row_sinks(geo.mSinks, ctx.thr_pv, self.tile_m, self.hdim_v, head, self.pack,
                                  cute.size(ctx.softmax.row_max))
        row_scale = self.output_scale(ctx, self.finalize_rows(ctx))
        OnlineSoftmax.rescale(ctx.acc_O, row_scale)
        self.epilogue(ctx, mO, mLSE, tma_O, smem.sO, ctx.tidx, head, batch)
        if cutlass.const_expr(not self.separate_o):
            # O went out through Q's buffer: hand it back once the store has read it (the
            # storing warp waited for that in the epilogue).
            pipe_q.consumer_release(q_state)
        q_state.advance()
        return q_state, kv_state

    # mbarrier waits (``device/waits.py``): polling try_wait (``spin_waits``) or the DSL's sleeping
    # wait, which on the persistent grid leaves a waiter asleep well past its barrier's completion.
    def wait_full(self, pipe, state) -> None:
        waits.wait_full(pipe, state, self.cfg.spin_waits)

    def acquire_empty(self, pipe, state) -> None:
        waits.acquire_empty(pipe, state, self.cfg.spin_waits)

    # Ping-pong scheduling (``pingpong``): the consumer warpgroups take turns issuing their GEMMs,
    # so one warpgroup's softmax overlaps the other's MMAs. Warpgroup w waits on barrier
    # BAR_SCHED + w (its turn) and, once its GEMMs are issued, arrives on the next warpgroup's.
    def sched_sync(self, ctx) -> None:
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=BAR_SCHED + ctx.wg, number_of_threads=256)

    def sched_arrive(self, ctx) -> None:
        if cutlass.const_expr(self.pingpong):
            nxt = (ctx.wg + 1) % self.num_mma_wg
            cute.arch.barrier_arrive(barrier_id=BAR_SCHED + nxt, number_of_threads=256)

    @cute.jit
    def mainloop(self, ctx, state, n_block_max: Int32, right_start: Int32, left_end: Int32):
        """K/V blocks from last to first: masked edge blocks, then the unmasked interior.
        ``state``: the K/V pipelines' read position (carried from tile to tile); returned."""
        n_block_min = ctx.n_block_min
        edge_right = self.is_causal or self.is_local
        # S and P of the first block; its P V is issued together with the next block's QK^T.
        self.first_half(ctx, state, n_block_max - 1, mask_right=edge_right, mask_left=self.is_local)
        n_block = n_block_max - 2
        if cutlass.const_expr(self.is_causal or self.is_local):
            # Blocks on the diagonal band: masked on the right (and left for narrow windows).
            lo = cutlass.max(right_start, n_block_min)
            for _ in cutlass.range(n_block - lo + 1, unroll=1):
                state = self.one_block(ctx, state, n_block, mask_right=True, mask_left=self.is_local)
                n_block -= 1
        # Interior blocks: no mask at all.
        lo = cutlass.max(left_end, n_block_min)
        for _ in cutlass.range(n_block - lo + 1, unroll=1):
            state = self.one_block(ctx, state, n_block, mask_right=False, mask_left=False)
            n_block -= 1
        if cutlass.const_expr(self.is_local):
            # Left edge of the window.
            for _ in cutlass.range(n_block - n_block_min + 1, unroll=1):
                state = self.one_block(ctx, state, n_block, mask_right=False, mask_left=True)
                n_block -= 1
        return self.last_half(ctx, state)

    @cute.jit
    def scores(self, ctx, acc_S, n_block: Int32, is_first: cutlass.Constexpr[bool],
               partial: cutlass.Constexpr[bool], mask_right: cutlass.Constexpr[bool],
               mask_left: cutlass.Constexpr[bool]):
        """Mods, softcap, mask and online softmax of one S block; returns the O rescale factors."""
        if cutlass.const_expr(self.mods is not None):
            apply_mods(self.mods, acc_S, ctx.thr_qk, self.tile_m, self.tile_n, ctx.m_block, n_block,
                       ctx.batch, ctx.head, self.pack, ctx.seqlen.seqlen_q, ctx.seqlen.seqlen_k, ctx.aux,
                       ctx.score_scale, ctx.full, partial)
        if cutlass.const_expr(self.has_softcap):
            for i in cutlass.range(cute.size(acc_S), unroll_full=True):
                acc_S[i] = cute.math.tanh(acc_S[i] * ctx.score_scale, fastmath=True)
        if cutlass.const_expr(partial or mask_right or mask_left):
            ctx.mask.apply_mask(acc_S, ctx.thr_qk, ctx.m_block, n_block, mask_seqlen=partial,
                                mask_causal=mask_right and self.is_causal,
                                mask_local=(mask_right or mask_left) and self.is_local)
        return ctx.softmax.online_softmax(acc_S, is_first=is_first)

    @cute.jit
    def first_half(self, ctx, state, n_block: Int32, mask_right: cutlass.Constexpr[bool],
                   mask_left: cutlass.Constexpr[bool]):
        """First block: S, softmax and P only (its V stays acquired)."""
        acc_S = cute.make_rmem_tensor(ctx.thr_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        self.wait_full(ctx.pipe_k, state)
        wg_gemm(self.mma_qk, acc_S, ctx.tSrQ, ctx.tSrK[None, None, None, state.index], zero_init=True)
        ctx.pipe_k.consumer_release(state)
        row_scale = self.scores(ctx, acc_S, n_block, True, True, mask_right, mask_left)
        if cutlass.const_expr(self.rescale_before_pv):
            ctx.row_scale.store(row_scale.load())
        self.convert_p(acc_S, ctx.rP)

    @cute.jit
    def one_block(self, ctx, state, n_block: Int32, mask_right: cutlass.Constexpr[bool],
                  mask_left: cutlass.Constexpr[bool]):
        """S(n) = Q K(n)^T and O += P(n+1) V(n+1) are issued back to back; the softmax of S(n)
        runs while P V is still on the tensor cores. ``state`` is block n+1's stage (its V not
        consumed yet). With ping-pong the turn spans both GEMMs."""
        v_state = state.clone()
        state.advance()
        acc_S = cute.make_rmem_tensor(ctx.thr_qk.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        self.wait_full(ctx.pipe_k, state)
        self.sched_sync(ctx)
        wg_gemm(self.mma_qk, acc_S, ctx.tSrQ, ctx.tSrK[None, None, None, state.index], zero_init=True,
                wg_wait=-1)
        if cutlass.const_expr(self.rescale_before_pv):
            self.rescale_o(ctx, ctx.row_scale)
        self.wait_full(ctx.pipe_v, v_state)
        self.pv_gemm(ctx, v_state.index, -1)
        self.sched_arrive(ctx)
        warpgroup.wait_group(1)  # S(n) is ready; P V may still run
        ctx.pipe_k.consumer_release(state)
        row_scale = self.scores(ctx, acc_S, n_block, False, False, mask_right, mask_left)
        warpgroup.wait_group(0)  # P V done: O and P may change
        ctx.pipe_v.consumer_release(v_state)
        if cutlass.const_expr(self.rescale_before_pv):
            ctx.row_scale.store(row_scale.load())
        else:
            self.rescale_o(ctx, row_scale)
        self.convert_p(acc_S, ctx.rP)
        return state

    @cute.jit
    def last_half(self, ctx, state):
        """P V of the last block visited."""
        if cutlass.const_expr(self.rescale_before_pv):
            self.rescale_o(ctx, ctx.row_scale)
        self.wait_full(ctx.pipe_v, state)
        self.pv_gemm(ctx, state.index, 0)
        ctx.pipe_v.consumer_release(state)
        state.advance()
        return state

    @cute.jit
    def epilogue(self, ctx, mO, mLSE, tma_O, sO, tidx, head, batch):
        seqlen = ctx.seqlen
        rows_left = seqlen.seqlen_q * self.pack - ctx.m_block * self.tile_m
        # LSE: the lane holding column 0 of a row writes it (-inf for rows that saw no key).
        gLSE = cute.local_tile(seqlen.q_vec(mLSE, head, batch), (self.tile_m,), (ctx.m_block,))
        ctx.softmax.store_lse(ctx.thr_pv, gLSE, self.tile_m, self.hdim_v, rows_left)

        # O: registers -> smem (its own buffer, or Q's) via stmatrix -> TMA store (predicated
        # 16-byte stores for packed varlen outputs).
        rO = cute.make_rmem_tensor_like(ctx.acc_O, self.o_dtype)
        convert_pairs(ctx.acc_O, rO)
        if cutlass.const_expr(tma_O is not None and self.separate_o):
            # The previous tile's store may still be reading O's buffer (waited for only now, so
            # that it overlapped this tile's main loop).
            if tidx < 32:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # Every consumer warpgroup is done reading Q (its wgmmas were waited for) and the buffer
        # is free.
        cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        store_op = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.o_dtype, Float32)
        r2s = cute.make_tiled_copy_C(store_op, self.mma_pv).get_slice(tidx)
        cute.copy(r2s, r2s.retile(rO), r2s.partition_D(sO))
        if cutlass.const_expr(tma_O is not None):
            # The TMA engine reads smem through the async proxy: make the generic-proxy writes
            # visible to it before the barrier that hands the tile to the storing warp.
            cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_EPILOGUE, number_of_threads=self.num_mma_threads)
        gO = cute.local_tile(seqlen.q_rows(mO, head, batch), (self.tile_m, self.hdim_v), (ctx.m_block, 0))
        if cutlass.const_expr(tma_O is not None):
            if tidx < 32:
                tOsO, tOgO = cpasync.tma_partition(tma_O, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                                                   cute.group_modes(gO, 0, 2))
                cute.copy(tma_O, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                if cutlass.const_expr(not self.separate_o):
                    # Q's buffer goes back to the producer only once the TMA engine has read it.
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            warp_mma.store_rows(self.copy_O, self.copy_O.get_slice(tidx), sO, gO, self.tile_m, self.hdim_v,
                                rows_left)
