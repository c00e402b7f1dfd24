"""Quantize-and-rotate for the FP8 forward (issue 5): ``cute_flash.fp8_ref.quantize_qkv_ref`` as a
CuTe-DSL kernel, in two phases over the same grid.

* ``amax``: per (batch, kv head) the largest |x M| (Q, K rotated) or |x| (V), one float atomic
  max per warp into an fp32 (B, H_kv) buffer.
* ``quant``: x M * 448 / amax rounded to e4m3 with saturation; Q and K rows stay (B, N, H, d),
  V goes out sequence-contiguous -- (B, H_kv, d, N_pad) storage, through a shared-memory transpose,
  because the FP8 P V wgmma reads V as its K-major B operand.

One warp per row of d elements (a (token, head) vector), lane l holding elements l * E .. l * E +
E - 1 (E = d / 32): a row is one coalesced load, and the fast Walsh-Hadamard transform M = D H /
sqrt(d) runs its strides below E inside the thread and its strides E .. d / 2 across lanes (one
butterfly shuffle per element and stride). Each CTA owns ``rows`` tokens of one head, so the
amax phase issues one atomic per warp.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.memory import SmemAllocator

from cute_flash.ampere import common
from cute_flash.fp8_ref import E4M3_MAX, V_PERM16

NUM_WARPS = 4


class QuantizeSm90:
    num_threads = 32 * NUM_WARPS

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.dtype = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[cfg.dtype]
        self.hdim, self.rows = cfg.hdim, cfg.rows
        self.rotate, self.transpose, self.phase = cfg.rotate, cfg.transpose, cfg.phase
        self.v_perm = cfg.v_perm
        self.per_lane = self.hdim // 32
        assert self.rows % (NUM_WARPS * 16) == 0

    def smem_layout(self):
        return cute.make_layout((self.rows, self.hdim), stride=(1, self.rows + 4))

    def smem_bytes(self) -> int:
        return cute.cosize(self.smem_layout()) + 16 if self.transpose and self.phase == "quant" else 0

    @cute.jit
    def __call__(self, mX: cute.Tensor, mSigns: cute.Tensor, mAmax: cute.Tensor, mOut: cute.Tensor,
                 stream):
        """mX (B, N, H, d); mSigns (d,) fp32 (+-1); mAmax (B, H_kv) fp32; mOut e4m3: (B, N, H, d),
        or (B, H_kv, d, N_pad) storage when ``transpose`` (unused in the amax phase)."""
        mX = common.to_seq_dim_head(mX)  # (N, d, H, B)
        if cutlass.const_expr(self.transpose):
            # (B, H, d, N_pad) -> (N_pad, d, H, B): element (n, c, h, b) at the same place.
            mOut = cute.make_tensor(mOut.iterator, cute.select(mOut.layout, mode=[3, 2, 1, 0]))
        else:
            mOut = common.to_seq_dim_head(mOut)
        grid = (cute.ceil_div(mX.shape[0], self.rows), mX.shape[2], mX.shape[3])
        self.kernel(mX, mSigns, mAmax, mOut).launch(grid=grid, block=[self.num_threads, 1, 1],
                                                    smem=self.smem_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mSigns: cute.Tensor, mAmax: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head, batch = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = cute.arch.lane_idx()
        # GQA: the scale of query head h is its kv head's, h // (H / H_kv).
        head_kv = head // (mX.shape[2] // mAmax.shape[1])
        amax_ptr = mAmax.iterator + cute.crd2idx((batch, head_kv), mAmax.layout)
        signs = self.lane_signs(mSigns, lane)
        if cutlass.const_expr(self.phase == "amax"):
            self.amax_rows(mX, signs, amax_ptr, n_block, head, batch, warp, lane)
        elif cutlass.const_expr(self.transpose):
            self.quant_rows_transposed(mX, mOut, amax_ptr, n_block, head, batch, tidx)
        else:
            self.quant_rows(mX, signs, mOut, amax_ptr, n_block, head, batch, warp, lane)

    # ------------------------------------------------------------------------------------------
    # One row: load, rotate
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def lane_signs(self, mSigns: cute.Tensor, lane: Int32):
        s = cute.make_rmem_tensor(self.per_lane, Float32)
        if cutlass.const_expr(self.rotate):
            cute.autovec_copy(cute.local_tile(mSigns, (self.per_lane,), (lane,)), s)
        return s

    @cute.jit
    def load_row(self, mX: cute.Tensor, n: Int32, head: Int32, batch: Int32, lane: Int32, signs):
        """This lane's E elements of row (n, head) in fp32, times D (rotation) -- then
        ``fwht``."""
        raw = cute.make_rmem_tensor(self.per_lane, self.dtype)
        cute.autovec_copy(cute.local_tile(mX[n, None, head, batch], (self.per_lane,), (lane,)), raw)
        y = cute.make_rmem_tensor(self.per_lane, Float32)
        for j in cutlass.range_constexpr(self.per_lane):
            y[j] = raw[j].to(Float32)
            if cutlass.const_expr(self.rotate):
                y[j] = y[j] * signs[j]
        if cutlass.const_expr(self.rotate):
            self.fwht(y, lane)
        return y

    @cute.jit
    def fwht(self, y, lane: Int32):
        """y <- y H / sqrt(d) over the warp's row, in place (``fp8_ref.fwht``'s butterflies:
        a, b -> a + b, a - b for index pairs that differ in one bit, lowest bit first)."""
        e = self.per_lane
        in_thread = [1 << i for i in range(e.bit_length() - 1)]  # index bits below log2(E)
        across = [1 << i for i in range(5)]  # stride E * t: the partner sits in lane ^ t, same slot
        for si in cutlass.range_constexpr(len(in_thread)):
            s = in_thread[si]
            for j in cutlass.range_constexpr(e):
                if cutlass.const_expr((j & s) == 0):
                    a, b = y[j], y[j + s]
                    y[j], y[j + s] = a + b, a - b
        for ti in cutlass.range_constexpr(len(across)):
            t = across[ti]
            low = (lane & t) == 0
            for j in cutlass.range_constexpr(e):
                other = cute.arch.shuffle_sync_bfly(y[j], offset=t)
                y[j] = cutlass.select_(low, y[j] + other, other - y[j])
        inv = Float32(1.0 / math.sqrt(self.hdim))
        for j in cutlass.range_constexpr(e):
            y[j] = y[j] * inv

    # ------------------------------------------------------------------------------------------
    # Phases
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def amax_rows(self, mX, signs, amax_ptr, n_block: Int32, head: Int32, batch: Int32, warp: Int32,
                  lane: Int32):
        seqlen = mX.shape[0]
        m = Float32(0.0)
        for r in cutlass.range(self.rows // NUM_WARPS, unroll=1):
            n = n_block * self.rows + r * NUM_WARPS + warp
            if n < seqlen:
                y = self.load_row(mX, n, head, batch, lane, signs)
                for j in cutlass.range_constexpr(self.per_lane):
                    m = cute.arch.fmax(m, cute.arch.fmax(y[j], -y[j]))
        m = cute.arch.warp_reduction_max(m)
        if lane == 0:
            cute.arch.atomic_fmax(amax_ptr, m, sign_bit=False)

    @cute.jit
    def scale_of(self, amax_ptr) -> Float32:
        amax = cute.make_tensor(amax_ptr, cute.make_layout(1))[0]
        return Float32(E4M3_MAX) / cute.arch.fmax(amax, Float32(1e-30))

    @cute.jit
    def quant_rows(self, mX, signs, mOut, amax_ptr, n_block: Int32, head: Int32, batch: Int32,
                   warp: Int32, lane: Int32):
        seqlen = mX.shape[0]
        scale = self.scale_of(amax_ptr)
        for r in cutlass.range(self.rows // NUM_WARPS, unroll=1):
            n = n_block * self.rows + r * NUM_WARPS + warp
            if n < seqlen:
                y = self.load_row(mX, n, head, batch, lane, signs)
                q8 = cute.make_rmem_tensor(self.per_lane, cutlass.Float8E4M3FN)
                q8.store((y.load() * scale).to(cutlass.Float8E4M3FN))  # cvt.rn.satfinite.e4m3x2
                cute.autovec_copy(q8, cute.local_tile(mOut[n, None, head, batch], (self.per_lane,), (lane,)))

    @cute.jit
    def quant_rows_transposed(self, mX, mOut, amax_ptr, n_block: Int32, head: Int32, batch: Int32,
                              tidx: Int32):
        """V: rows quantized into a (rows x d) smem tile, then written out column by column --
        16 consecutive tokens (16 bytes) per store -- into the (d, N_pad) storage of this head.
        Tokens past N are zeros, so the padding up to N_pad holds no garbage."""
        seqlen = mX.shape[0]
        scale = self.scale_of(amax_ptr)
        # Token-contiguous columns (the 16-token reads below), padded by 4 bytes so the 32 lanes
        # writing one row (lane l at column l * E) fall in different banks.
        sT = SmemAllocator().allocate_tensor(cutlass.Float8E4M3FN, self.smem_layout(), 16)
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = cute.arch.lane_idx()
        for r in cutlass.range(self.rows // NUM_WARPS, unroll=1):
            row = r * NUM_WARPS + warp
            n = n_block * self.rows + row
            y = cute.make_rmem_tensor(self.per_lane, Float32)
            y.fill(0.0)
            if n < seqlen:
                raw = cute.make_rmem_tensor(self.per_lane, self.dtype)
                cute.autovec_copy(cute.local_tile(mX[n, None, head, batch], (self.per_lane,), (lane,)), raw)
                for j in cutlass.range_constexpr(self.per_lane):
                    y[j] = raw[j].to(Float32)
            q8 = cute.make_rmem_tensor(self.per_lane, cutlass.Float8E4M3FN)
            q8.store((y.load() * scale).to(cutlass.Float8E4M3FN))
            cute.autovec_copy(q8, cute.local_tile(sT[row, None], (self.per_lane,), (lane,)))
        cute.arch.barrier()
        n_pad = mOut.shape[0]
        chunks = self.rows // 16
        for i in cutlass.range((self.hdim * chunks) // self.num_threads, unroll=1):
            item = i * self.num_threads + tidx
            col, chunk = item // chunks, item % chunks
            n0 = n_block * self.rows + chunk * 16
            if n0 < n_pad:
                vals = cute.make_rmem_tensor(16, cutlass.Float8E4M3FN)
                for j in cutlass.range_constexpr(16):
                    # Kernel order (``v_perm``): position j of each 16 holds token V_PERM16[j].
                    src = V_PERM16[j] if cutlass.const_expr(self.v_perm) else j
                    vals[j] = sT[chunk * 16 + src, col]
                cute.autovec_copy(vals, cute.local_tile(mOut[None, col, head, batch], (16,), (n0 // 16,)))
