"""The sm90 backward's producer side (a mixin of ``bwd.FlashBwdSm90``): the TMA loads of K / V
and of each query block's Q, dO, LSE2 and D, the tile order of the one-CTA-per-tile grid
(``longest_first``), and the persistent grid's tile walk (``persistent``), whose roles carry their
pipeline states from tile to tile.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from cute_flash.device import scratch, waits
from cute_flash.device.seqlen import SeqlenInfo
from cute_flash.device.tile_scheduler import (
    balanced_section_order,
    planned_section_order,
    section_order,
    section_size,
)


class BwdProducer:
    """Needs the kernel's tile sizes, pipelines and ``make_work`` / ``consumer_tile`` /
    ``dq_writer`` (``bwd.FlashBwdSm90``)."""

    # ------------------------------------------------------------------------------------------
    # Persistent grid
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def persistent_roles(self, args, loads, mdQaccum, mdK, mdV, smem, pipes, scales, warp_idx):
        """``persistent``: every role walks this CTA's tiles (tile t = blockIdx.x + i * gridDim.x of
        ``tile_of``'s order) with its pipeline states carried from tile to tile, so the producer
        runs ahead into the next tile while the consumers finish the last one."""
        bidx, _, _ = cute.arch.block_idx()
        num_tiles = self.num_kv_tiles(args)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(24)
            if warp_idx == 0:
                kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
                for tile in cutlass.range(bidx, num_tiles, self.cfg.num_ctas, unroll=1):
                    kv_state, state = self.load_tile(args, loads, smem, pipes, tile, kv_state, state)
            if cutlass.const_expr(self.dq_warp):
                if warp_idx == 1:
                    self.wait_for_preprocess()
                    for tile in cutlass.range(bidx, num_tiles, self.cfg.num_ctas, unroll=1):
                        self.dq_writer_tile(args, mdQaccum, smem, tile)
        else:
            cute.arch.setmaxregister_increase(240)
            self.wait_for_preprocess()
            ctx = self.consumer_setup(loads.mLSE2, loads.mD, mdQaccum, smem, scales, args)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            for tile in cutlass.range(bidx, num_tiles, self.cfg.num_ctas, unroll=1):
                kv_state, state = self.consumer_persistent_tile(args, ctx, mdK, mdV, pipes, scales, tile,
                                                                kv_state, state)

    def num_kv_tiles(self, args):
        mK = args.mK
        return cute.ceil_div(mK.shape[0], self.tile_n) * mK.shape[2] * mK.shape[3]

    @cute.jit
    def tile_of(self, args, tile: Int32):
        """(n_block, head_kv, batch) of linear tile ``tile``: sections of K/V heads whose queries'
        Q, dO and dQ accumulator fit in L2 together, within a section every head's first key block,
        then every head's second, ... (causal: longest first, as ``longest_first``)."""
        mQ, mK = args.mQ, args.mK
        num_n = cute.ceil_div(mK.shape[0], self.tile_n)
        num_head = mK.shape[2]
        num_hb = num_head * mK.shape[3]
        rows = mQ.shape[0] * (mQ.shape[2] // mK.shape[2])
        group = section_size(Int32(self.cfg.lpt_rows_in_l2()), rows, num_hb)
        return section_order(tile, num_n, num_head, num_hb, group)

    @cute.jit
    def load_tile(self, args, loads, smem, pipes, tile: Int32, kv_state, state):
        n_block, head_kv, batch = self.tile_of(args, tile)
        seqlen, work = self.make_work(args, n_block, head_kv, batch)
        return self.load_split(loads, smem, pipes, seqlen, work, kv_state, state)

    @cute.jit
    def dq_writer_tile(self, args, mdQaccum, smem, tile: Int32):
        n_block, head_kv, batch = self.tile_of(args, tile)
        seqlen, work = self.make_work(args, n_block, head_kv, batch)
        self.dq_writer(mdQaccum, smem, seqlen, work)

    @cute.jit
    def consumer_persistent_tile(self, args, ctx, mdK, mdV, pipes, scales, tile: Int32, kv_state, state):
        n_block, head_kv, batch = self.tile_of(args, tile)
        seqlen, work = self.make_work(args, n_block, head_kv, batch)
        return self.consumer_tile(ctx, mdK, mdV, pipes, seqlen, work, scales, kv_state, state)

    # ------------------------------------------------------------------------------------------
    # Producer warp
    # ------------------------------------------------------------------------------------------
    def kv_tma_tiles(self, mK, mV, tma_K, tma_V, smem, seqlen: SeqlenInfo, work) -> tuple:
        """(sK, gK, sV, gV) TMA partitions of this CTA's K / V block."""
        one = cute.make_layout(1)
        out = ()
        for mT, tma, sT, width in ((mK, tma_K, smem.sK, self.hdim), (mV, tma_V, smem.sV, self.hdim_v)):
            gT = cute.local_tile(seqlen.k_rows(mT, work.head_kv, work.batch), (self.tile_n, width),
                                 (work.n_block, 0))
            out += tuple(cpasync.tma_partition(tma, 0, one, cute.group_modes(sT, 0, 2),
                                               cute.group_modes(gT, 0, 2)))
        return out

    def qdo_tma_tiles(self, mQ, mdO, tma_Q, tma_dO, smem, seqlen: SeqlenInfo, work, head) -> tuple:
        """(sQ, gQ, sdO, gdO) TMA partitions of query head ``head``: smem by stage, global by query
        block."""
        one = cute.make_layout(1)
        out = ()
        for mT, tma, sT, width in ((mQ, tma_Q, smem.sQ, self.hdim), (mdO, tma_dO, smem.sdO, self.hdim_v)):
            gT = cute.local_tile(seqlen.q_rows(mT, head, work.batch), (self.tile_m, width), (None, 0))
            out += tuple(cpasync.tma_partition(tma, 0, one, cute.group_modes(sT, 0, 2),
                                               cute.group_modes(gT, 0, 2)))
        return out

    @cute.jit
    def load(self, mQ, mK, mV, mdO, mLSE2, mD, tma_Q, tma_K, tma_V, tma_dO, smem, pipe_kv, pipe_qdo,
             seqlen: SeqlenInfo, work):
        tKsK, tKgK, tVsV, tVgV = self.kv_tma_tiles(mK, mV, tma_K, tma_V, smem, seqlen, work)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        waits.acquire_empty(pipe_kv, kv_state, self.spin_waits)
        cute.copy(tma_K, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_V, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        # K and V are inputs; LSE2 and D (with Q / dO, below) come from the preprocess.
        self.wait_for_preprocess()

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for g in cutlass.range(work.group, unroll=1):
            # (a plain call: the DSL must not see ``seqlen`` as state carried by the loop)
            state = self.load_head(mQ, mdO, mLSE2, mD, tma_Q, tma_dO, smem, pipe_qdo, seqlen, work,
                                   work.head_kv * work.group + g, state)

    @cute.jit
    def load_split(self, loads, smem, pipes, seqlen: SeqlenInfo, work, kv_state, state, do_state=None):
        """``split_loads``: K, then per (query head, query block) in the consumers' order Q + LSE2
        and dO + D on their own barriers; the first block issues K, Q, V, dO in the order the
        GEMMs read them, and only its statistics wait for the preprocess (PDL). Returns the
        pipeline states after this tile (the persistent grid carries them on)."""
        L = loads
        tKsK, tKgK, tVsV, tVgV = self.kv_tma_tiles(L.mK, L.mV, L.tma_K, L.tma_V, smem, seqlen, work)
        waits.acquire_empty(pipes.kv, kv_state, self.spin_waits)
        cute.copy(L.tma_K, tKgK, tKsK, tma_bar_ptr=pipes.kv.producer_get_barrier(kv_state))
        kv_state.advance()
        total = self.num_work_items(work)
        # (plain calls: the DSL must not see ``seqlen`` as state carried by the loop)
        if cutlass.const_expr(self.separate_do):
            for it in cutlass.range(total, unroll=1):
                state, do_state = self.load_block(L.mQ, L.mdO, L.mLSE2, L.mD, L.tma_Q, L.tma_V, L.tma_dO,
                                                  tVgV, tVsV, smem, pipes, seqlen, work, it, state, kv_state,
                                                  do_state)
        else:
            for it in cutlass.range(total, unroll=1):
                state = self.load_block(L.mQ, L.mdO, L.mLSE2, L.mD, L.tma_Q, L.tma_V, L.tma_dO, tVgV, tVsV,
                                        smem, pipes, seqlen, work, it, state, kv_state)
        if cutlass.const_expr(self.cfg.persistent):
            # A tile no query block sees still fills V's stage, so that every tile moves the K/V
            # pipeline by one phase on both sides.
            pipe_kv, tma_V = pipes.kv, L.tma_V  # (plain names: a ``Ctx`` cannot cross a run-time ``if``)
            if total == 0:
                waits.acquire_empty(pipe_kv, kv_state, self.spin_waits)
                cute.copy(tma_V, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        kv_state.advance()
        return kv_state, state

    @cute.jit
    def load_block(self, mQ, mdO, mLSE2, mD, tma_Q, tma_V, tma_dO, tVgV, tVsV, smem, pipes,
                   seqlen: SeqlenInfo, work, it: Int32, state, kv_state, do_state=None):
        """``load_split``'s item ``it``: Q + LSE2, then dO + D (and V, and the preprocess wait, before
        the first block's dO and statistics). With ``separate_do`` dO + D walk their own stages and
        both states come back."""
        # (Plain names: a ``Ctx`` cannot be carried through the run-time ``if`` below.)
        pipe_kv, pipe_q, pipe_do = pipes.kv, pipes.q, pipes.do
        bulk = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32)
        head, m_block = self.work_item(work, it)
        tQsQ, tQgQ, tdOsdO, tdOgdO = self.qdo_tma_tiles(mQ, mdO, tma_Q, tma_dO, smem, seqlen, work, head)
        waits.acquire_empty(pipe_q, state, self.spin_waits)
        bar_q = pipe_q.producer_get_barrier(state)
        cute.copy(tma_Q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=bar_q)
        if it == 0:
            waits.acquire_empty(pipe_kv, kv_state, self.spin_waits)
            cute.copy(tma_V, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        dos = do_state if cutlass.const_expr(self.separate_do) else state
        waits.acquire_empty(pipe_do, dos, self.spin_waits)
        bar_do = pipe_do.producer_get_barrier(dos)
        cute.copy(tma_dO, tdOgdO[None, m_block], tdOsdO[None, dos.index], tma_bar_ptr=bar_do)
        if it == 0:
            # K, V, Q and dO are inputs; LSE2 and D come from the preprocess.
            self.wait_for_preprocess()
        gLSE2 = scratch.scratch_rows(mLSE2, seqlen, head, work.batch, self.tile_m)
        gD = scratch.scratch_rows(mD, seqlen, head, work.batch, self.tile_m)
        with cute.arch.elect_one():
            cute.copy(bulk, cute.local_tile(gLSE2, (self.tile_m,), (m_block,)), smem.sLSE2[None, state.index],
                      mbar_ptr=bar_q)
            cute.copy(bulk, cute.local_tile(gD, (self.tile_m,), (m_block,)), smem.sDsum[None, dos.index],
                      mbar_ptr=bar_do)
        state.advance()
        if cutlass.const_expr(self.separate_do):
            do_state.advance()
            return state, do_state
        return state

    def wait_for_preprocess(self) -> None:
        """With ``pdl`` (this kernel may start before the preprocess ends): wait for it to finish
        and its writes (LSE2, D, the zeroed dQ accumulator, semaphores) to be visible."""
        if cutlass.const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()

    @cute.jit
    def longest_first(self, x: Int32, y: Int32, walk: tuple, args) -> tuple:
        """(n_block, head_kv) of the CTA with grid coordinates (x, y) under ``lpt``: CTAs start in
        blockIdx order, so walk the K/V heads in groups whose Q, dO and dQ accumulator fit in L2
        together, and within a group all heads' first key blocks, then their second ones, and so
        on. In causal attention key block n sees the most query blocks at n = 0, so the longest
        CTAs start first and the last wave is the shortest (with blocks ordered per head, the last
        head's longest CTA started near the end and ran alone). ``walk``: the launcher's
        ``section_walk_plan`` (sections of even size with ``lpt_balanced``, the launcher's choice
        where full sections would leave a short last one)."""
        num_n, num_h, _ = cute.arch.grid_dim()
        lin = x + num_n * y
        if cutlass.const_expr(not self.cfg.lpt_walk_plan):
            rows = args.mQ.shape[0] * args.qhead_per_kv
            group = section_size(Int32(self.cfg.lpt_rows_in_l2()), rows, num_h)
            order = balanced_section_order if cutlass.const_expr(self.cfg.lpt_balanced) else section_order
            n_block, head, _ = order(lin, num_n, num_h, num_h, group)
            return n_block, head
        return planned_section_order(lin, walk, self.cfg.lpt_balanced)

    @cute.jit
    def load_head(self, mQ, mdO, mLSE2, mD, tma_Q, tma_dO, smem, pipe_qdo, seqlen: SeqlenInfo, work, head,
                  state):
        """Q and dO (TMA) and the LSE2 and D rows (bulk copies) of every query block of one query
        head that sees this K/V block, one pipeline stage per block."""
        gLSE2 = scratch.scratch_rows(mLSE2, seqlen, head, work.batch, self.tile_m)
        gD = scratch.scratch_rows(mD, seqlen, head, work.batch, self.tile_m)
        bulk = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32)
        tQsQ, tQgQ, tdOsdO, tdOgdO = self.qdo_tma_tiles(mQ, mdO, tma_Q, tma_dO, smem, seqlen, work, head)
        num_m = work.m_block_max - work.m_block_min
        for i in cutlass.range(num_m, unroll=1):
            m_block = self.query_block(work, i, num_m)  # the consumers' order (``rotate_m``)
            waits.acquire_empty(pipe_qdo, state, self.spin_waits)
            bar = pipe_qdo.producer_get_barrier(state)
            cute.copy(tma_Q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=bar)
            cute.copy(tma_dO, tdOgdO[None, m_block], tdOsdO[None, state.index], tma_bar_ptr=bar)
            with cute.arch.elect_one():
                cute.copy(bulk, cute.local_tile(gLSE2, (self.tile_m,), (m_block,)),
                          smem.sLSE2[None, state.index], mbar_ptr=bar)
                cute.copy(bulk, cute.local_tile(gD, (self.tile_m,), (m_block,)),
                          smem.sDsum[None, state.index], mbar_ptr=bar)
            state.advance()
        return state
