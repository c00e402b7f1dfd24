"""The sm90 backward's producer side (a mixin of ``bwd.FlashBwdSm90``): the TMA loads of K / V
and of each query block's Q, dO, LSE2 and D, the wait for the preprocess, and the grid's
longest-first tile order (``longest_first``).
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from cute_flash.device import scratch, waits
from cute_flash.device.seqlen import SeqlenInfo
from cute_flash.device.tile_scheduler import planned_section_order


class BwdProducer:
    """Needs the kernel's tile sizes, pipelines, ``spin_waits``, ``separate_do`` and its walk
    (``num_work_items``, ``work_item``, ``query_block``; ``bwd.FlashBwdSm90``)."""

    def kv_tma_tiles(self, mK, mV, tma_K, tma_V, smem, seqlen: SeqlenInfo, work) -> tuple:
        """(sK, gK, sV, gV) TMA partitions of this CTA's K / V block."""
        one = cute.make_layout(1)
        out = ()
        for mT, tma, sT, width in ((mK, tma_K, smem.sK, self.hdim), (mV, tma_V, smem.sV, self.hdim_v)):
            gT = cute.local_tile(seqlen.k_rows(mT, work.kv_head, work.batch), (self.tile_n, width),
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
        GEMMs read them, and only its statistics wait for the preprocess."""
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
        """This kernel is launched as the preprocess's dependent (programmatic dependent launch:
        its launch, barrier set-up and K / V loads overlap the preprocess's tail): wait for the
        preprocess to finish and its writes (LSE2, D, the zeroed dQ accumulator, semaphores) to be
        visible."""
        cute.arch.griddepcontrol_wait()

    @cute.jit
    def longest_first(self, x: Int32, y: Int32, walk: tuple) -> tuple:
        """(n_block, head_kv) of the CTA with grid coordinates (x, y) under ``lpt``: CTAs start in
        blockIdx order, so walk the K/V heads in groups whose Q, dO and dQ accumulator fit in L2
        together, and within a group all heads' first key blocks, then their second ones, and so
        on. In causal attention key block n sees the most query blocks at n = 0, so the longest
        CTAs start first and the last wave is the shortest (ordered per head, the last head's
        longest CTA would start near the end and run alone). ``walk``: the launcher's
        ``section_walk_plan`` (sections of even size with ``lpt_balanced``, the launcher's choice
        where full sections would leave a short last one)."""
        num_n, _, _ = cute.arch.grid_dim()
        return planned_section_order(x + num_n * y, walk, self.cfg.lpt_balanced)

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
