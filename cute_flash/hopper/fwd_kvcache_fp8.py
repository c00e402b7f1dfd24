"""Attention over an FP8 (e4m3) KV cache with 16-bit queries on Hopper: the KV-cache forward of
``hopper/fwd_kvcache.py`` with the cache's blocks turned into the queries' dtype in shared memory
by the producer warpgroup, so the consumers run the 16-bit kernel unchanged.

Why convert instead of FP8 tensor cores: an e4m3 wgmma needs both operands K-major, and V^T as
P V's operand is keys-contiguous, which a (tokens, d) cache is not; the queries would also have to
be quantized. Decoding is bound by the cache's bytes, which e4m3 halves either way.

Warp roles in the producer warpgroup: warp 0 issues the TMA loads of e4m3 blocks into staging
buffers (``k8`` / ``v8`` pipelines, completed by transaction counts), in the 16-bit kernel's
order; warps 1-3 wait for each staged block, convert it 16 bytes per thread into the swizzled
16-bit stage, fence the generic-proxy stores for wgmma, and arrive on the ``k`` / ``v`` pipelines
the consumers wait on (every converter thread arrives; every consumer thread releases). The
per-(batch, KV head) descales fold into the score scale (K) and O's final factor (V), as in the
FP8 forward.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32

from cute_flash.device import warp_mma
from cute_flash.device.convert import e4m3x2_to_16bit
from cute_flash.hopper.fwd_kvcache import FlashFwdSm90KVCache

CONVERTER_WARPS = 3
CONVERTER_THREADS = 32 * CONVERTER_WARPS
# Elements one converter thread takes per step: 16 e4m3 bytes in, 32 bytes out.
CHUNK = 16


class FlashFwdSm90KVCacheFp8(FlashFwdSm90KVCache):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        # The converters walk tiles as the consumers do, but join no next-tile barrier: one CTA per tile.
        assert not self.persistent, "the e4m3 KV-cache kernel runs one CTA per tile"
        self.kv_dtype = cutlass.Float8E4M3FN
        self.tx_K = self.tile_n * self.hdim
        self.tx_V = self.tile_n * self.hdim_v
        if self.num_mma_wg == 2:
            # The converters need registers the 24-register producer does not have:
            # 40 * 128 + 232 * 256 = 64512.
            self.producer_regs, self.mma_regs = 40, 232

    def _setup(self) -> None:
        super()._setup()
        # Staging: plain row-major e4m3 (no swizzle): a converter thread reads 16 consecutive bytes.
        self.sK8_layout = self._staging_layout(self.hdim)
        self.sV8_layout = self._staging_layout(self.hdim_v)

    def _staging_layout(self, cols: int):
        return cute.make_ordered_layout((self.tile_n, cols, self.num_stages), order=(1, 0, 2))

    def extra_smem(self) -> dict:
        f8, stages = self.kv_dtype, self.num_stages
        return {
            "mbar_K8": cute.struct.MemRange[cutlass.Int64, 2 * stages],
            "mbar_V8": cute.struct.MemRange[cutlass.Int64, 2 * stages],
            "sK8": cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(self.sK8_layout)], 1024],
            "sV8": cute.struct.Align[cute.struct.MemRange[f8, cute.cosize(self.sV8_layout)], 1024],
        }

    def kv_box_layout(self, s_layout, cols: int):
        """A TMA box lands in the staging buffer: ``page_box`` rows (the whole block when contiguous)."""
        return cute.make_ordered_layout((self.page_box, cols), order=(1, 0))

    def staging(self, smem):
        """``smem`` with the e4m3 staging buffers in place of the 16-bit K / V stages."""
        storage = smem.storage
        return warp_mma.Ctx(sK=storage.sK8.get_tensor(self.sK8_layout),
                            sV=storage.sV8.get_tensor(self.sV8_layout))

    def kv_pipes(self, storage, producer, consumers) -> dict:
        # TMA -> staging: the transaction count completes a stage, lane 0 of each converter warp
        # frees it.
        converter_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, CONVERTER_WARPS)
        k8 = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_K8.data_ptr(), num_stages=self.num_stages, producer_group=producer,
            consumer_group=converter_warps, tx_count=self.tx_K, defer_sync=True)
        v8 = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_V8.data_ptr(), num_stages=self.num_stages, producer_group=producer,
            consumer_group=converter_warps, tx_count=self.tx_V, defer_sync=True)
        # Converters -> consumers: thread arrivals on both sides.
        converters = pipeline.CooperativeGroup(pipeline.Agent.Thread, CONVERTER_THREADS)
        mma_threads = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads)
        k = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_K.data_ptr(), num_stages=self.num_stages, producer_group=converters,
            consumer_group=mma_threads, defer_sync=True)
        v = pipeline.PipelineAsync.create(
            barrier_storage=storage.mbar_V.data_ptr(), num_stages=self.num_stages, producer_group=converters,
            consumer_group=mma_threads, defer_sync=True)
        return {"k": k, "v": v, "k8": k8, "v8": v8}

    def kv_sources(self, mK, mV, tma_K, tma_V, smem, pipes, seqlen, head_kv, batch):
        staged = warp_mma.Ctx(k=pipes.k8, v=pipes.v8)
        return FlashFwdSm90KVCache.kv_sources(self, mK, mV, tma_K, tma_V, self.staging(smem), staged, seqlen,
                                              head_kv, batch)

    @cute.jit
    def producer_warps(self, warp_idx, mQ, mK, mV, tma_Q, tma_K, tma_V, smem, pipes, geo):
        if warp_idx == 0:
            self.producer(mQ, mK, mV, tma_Q, tma_K, tma_V, smem, pipes, geo)
        else:
            self.converter(mQ, mK, smem, pipes, geo)

    # ------------------------------------------------------------------------------------------
    # Converter warps: staged e4m3 blocks -> 16-bit stages, in the producer's block order
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def converter(self, mQ, mK, smem, pipes, geo):
        tidx, _, _ = cute.arch.thread_idx()
        tidx = tidx - 32
        staged = self.staging(smem)
        src_k = (staged.sK, pipes.k8, smem.sK, pipes.k)
        src_v = (staged.sV, pipes.v8, smem.sV, pipes.v)
        read_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        read_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        write_k = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        write_v = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        tile_idx, num_tiles = self.first_tile(geo)
        while tile_idx < num_tiles:
            _, _, _, _, _, has_rows, n_block_min, n_block_max = self.tile_work(mQ, mK, geo, tile_idx)
            if has_rows and n_block_max > n_block_min:
                # The producer's order: K(last), then K(n - 1) before V(n), then V(first).
                self.convert_block(src_k, read_k, write_k, tidx, False)
                read_k.advance()
                write_k.advance()
                for _ in cutlass.range(n_block_max - n_block_min - 1, unroll=1):
                    self.convert_block(src_k, read_k, write_k, tidx, False)
                    read_k.advance()
                    write_k.advance()
                    self.convert_block(src_v, read_v, write_v, tidx, True)
                    read_v.advance()
                    write_v.advance()
                self.convert_block(src_v, read_v, write_v, tidx, True)
                read_v.advance()
                write_v.advance()
            tile_idx = self.receive_next_tile(geo, tile_idx)

    @cute.jit
    def convert_block(self, src, read, write, tidx: Int32, is_v: cutlass.Constexpr[bool]):
        """One staged block into its 16-bit stage: wait for both, convert, publish, free the staging.
        The chunks per thread are unrolled so their shared-memory loads overlap."""
        s8, pipe8, s16, pipe16 = src
        cols = self.hdim
        if cutlass.const_expr(is_v):
            cols = self.hdim_v
        self.wait_full(pipe8, read)
        self.acquire_empty(pipe16, write)
        s8_stage = s8[None, None, read.index]
        s16_stage = s16[None, None, write.index]
        per_row = cols // CHUNK
        chunks = self.tile_n * per_row
        row_shift = per_row.bit_length() - 1  # (a power of two)
        bf16 = cutlass.const_expr(self.dtype is cutlass.BFloat16)
        for k in cutlass.range_constexpr(-(-chunks // CONVERTER_THREADS)):
            i = tidx + k * CONVERTER_THREADS
            if i < chunks:
                r = i >> row_shift
                c = i & (per_row - 1)
                codes = cute.make_rmem_tensor((1, CHUNK // 4), Int32)
                cute.autovec_copy(cute.recast_tensor(cute.local_tile(s8_stage, (1, CHUNK), (r, c)), Int32),
                                  codes)
                vals = cute.make_rmem_tensor((1, CHUNK), self.dtype)
                words = cute.recast_tensor(vals, Int32)
                for j in cutlass.range_constexpr(CHUNK // 4):
                    words[2 * j] = e4m3x2_to_16bit(codes[j], False, bf16)
                    words[2 * j + 1] = e4m3x2_to_16bit(codes[j], True, bf16)
                cute.autovec_copy(vals, cute.local_tile(s16_stage, (1, CHUNK), (r, c)))
        # Generic-proxy stores, read next by wgmma (async proxy).
        cute.arch.fence_view_async_shared()
        pipe16.producer_commit(write)
        pipe8.consumer_release(read)

    # ------------------------------------------------------------------------------------------
    # Descales: K's into the score scale, V's into O's final factor
    # ------------------------------------------------------------------------------------------
    def extra_ctx(self, ctx, smem, wg) -> None:
        FlashFwdSm90KVCache.extra_ctx(self, ctx, smem, wg)
        ctx.score_scale_base = ctx.score_scale

    def tile_scales(self, ctx, extra: tuple, mQ, mK, head, batch) -> None:
        mKd, mVd = extra[5], extra[6]
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        k_descale = mKd[batch, head_kv]
        if cutlass.const_expr(self.has_softcap):
            # The descale belongs inside the tanh: it scales the raw scores.
            ctx.score_scale = ctx.score_scale_base * k_descale
        else:
            ctx.softmax.scale_log2 = ctx.scale_log2 * k_descale
        ctx.v_descale = mVd[batch, head_kv]

    def output_scale(self, ctx, row_scale):
        for r in range(cute.size(row_scale)):
            row_scale[r] = row_scale[r] * ctx.v_descale
        return row_scale

