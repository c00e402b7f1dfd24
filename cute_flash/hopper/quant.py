"""Quantize-and-rotate for the FP8 forward: ``cute_flash.reference_fp8.quantize_qkv_ref`` as a
CuTe-DSL kernel, in two phases over the same grid.

* ``amax``: per (batch, kv head) the largest |x M| (Q, K rotated) or |x| (V), one float atomic
  max per warp into an fp32 (B, H_kv) buffer.
* ``quant``: x M * 448 / amax rounded to e4m3 with saturation; Q and K rows stay (B, N, H, d),
  V goes out sequence-contiguous -- (B, H_kv, d, N_pad) storage, through a shared-memory transpose,
  because the FP8 P V wgmma reads V as its K-major B operand.

One warp per row of d elements (a (token, head) vector), lane l holding elements l * E .. l * E +
E - 1 (E = d / 32): a row is one coalesced load, and the fast Walsh-Hadamard transform M = D H /
sqrt(d) runs its strides below E inside the thread and its strides E .. d / 2 across lanes (one
butterfly shuffle per element and stride: 20 per row at d = 128). With ``lanes_per_row`` L < 32
(Q / K only) a warp holds 32 / L rows at once, L lanes each with E = d / L elements: more of the
strides stay inside the thread, log2(L) shuffle rounds instead of 5 (12 per row at d = 128 and
L = 8) -- for when the shuffle pipe (one warp-wide shuffle per clock per SM), not DRAM, bounds
the Q / K passes. Each CTA owns ``rows`` tokens of one head, so the amax phase issues one atomic
per warp.

Varlen (``cfg.varlen``): x is packed (T, H, d) with int32 ``cu_seqlens`` (S + 1,), the grid is
(ceil(max_seqlen / rows), H, S) and a CTA owns rows [cu[s] + n_block * rows, ...) of sequence s,
clipped to cu[s + 1]; scales are per (sequence, kv head), V goes to (H_kv, d, T_pad) storage.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.memory import SmemAllocator

from cute_flash.device import warp_mma
from cute_flash.device.seqlen import SeqlenInfo
from cute_flash.formats import E4M3_MAX, V_PERM16

NUM_WARPS = 4
# Rows each warp loads before using any (``load_rows``).
ROWS_IN_FLIGHT = 4


class QuantizeSm90:
    num_threads = 32 * NUM_WARPS

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        # e4m3 input: the V re-layout of a caller's e4m3 tensor (scale exactly 1: amax = 448).
        self.dtype = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16,
                      "e4m3": cutlass.Float8E4M3FN}[cfg.dtype]
        self.hdim, self.rows = cfg.hdim, cfg.rows
        self.rotate, self.transpose, self.phase = cfg.rotate, cfg.transpose, cfg.phase
        self.v_perm, self.varlen = cfg.v_perm, cfg.varlen
        self.lanes = cfg.lanes_per_row
        self.rows_per_warp = 32 // self.lanes
        self.per_lane = self.hdim // self.lanes
        # Rows between a lane's consecutive rows in flight (all warps' rows at one step).
        self.row_step = NUM_WARPS * self.rows_per_warp
        assert self.rows % (NUM_WARPS * 16) == 0 and 16 % ROWS_IN_FLIGHT == 0
        assert self.rows % (self.row_step * ROWS_IN_FLIGHT) == 0
        # Packed V: a CTA's tokens start anywhere, not on a 16-token chunk, so its smem tile spans
        # the 16-aligned chunks around them -- one chunk more than its rows.
        self.tile_rows = self.rows + 16 if self.varlen else self.rows

    def smem_layout(self):
        return cute.make_layout((self.tile_rows, self.hdim), stride=(1, self.tile_rows + 4))

    def smem_bytes(self) -> int:
        return cute.cosize(self.smem_layout()) + 16 if self.transpose and self.phase == "quant" else 0

    @cute.jit
    def __call__(self, mX: cute.Tensor, mSigns: cute.Tensor, mAmax: cute.Tensor, mOut: cute.Tensor,
                 mCuSeqlens: cute.Tensor | None, max_seqlen: Int32, mCuSeqlensOut: cute.Tensor | None,
                 stream):
        """mX (B, N, H, d); mSigns (d,) fp32 (+-1); mAmax (B, H_kv) fp32; mOut e4m3: (B, N, H, d),
        or (B, H_kv, d, N_pad) storage when ``transpose`` (unused in the amax phase). Varlen: mX and
        mOut (T, H, d), V storage (H_kv, d, T_pad), mAmax (S, H_kv), mCuSeqlens int32 (S + 1,) and
        ``max_seqlen`` (at least the longest sequence) sizes the grid; dense: None and unused.
        ``mCuSeqlensOut`` (``v_aligned``): where each sequence's V starts in the storage, 16-aligned
        (``formats.varlen_v_offsets``); else None."""
        mX = warp_mma.to_seq_dim_head(mX)  # (N, d, H, B); packed (T, d, H)
        if cutlass.const_expr(self.transpose):
            # (B, H, d, N_pad) -> (N_pad, d, H, B): element (n, c, h, b) at the same place.
            modes = [2, 1, 0] if cutlass.const_expr(self.varlen) else [3, 2, 1, 0]
            mOut = cute.make_tensor(mOut.iterator, cute.select(mOut.layout, mode=modes))
        else:
            mOut = warp_mma.to_seq_dim_head(mOut)
        if cutlass.const_expr(self.varlen):
            grid = (cute.ceil_div(max_seqlen, self.rows), mX.shape[2], mCuSeqlens.shape[0] - 1)
        else:
            grid = (cute.ceil_div(mX.shape[0], self.rows), mX.shape[2], mX.shape[3])
        self.kernel(mX, mSigns, mAmax, mOut, mCuSeqlens, mCuSeqlensOut).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=self.smem_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mSigns: cute.Tensor, mAmax: cute.Tensor, mOut: cute.Tensor,
               mCuSeqlens: cute.Tensor | None, mCuSeqlensOut: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head, batch = cute.arch.block_idx()  # batch: the sequence, when varlen
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = cute.arch.lane_idx()
        # GQA: the scale of query head h is its kv head's, h // (H / H_kv).
        head_kv = head // (mX.shape[2] // mAmax.shape[1])
        amax_ptr = mAmax.iterator + cute.crd2idx((batch, head_kv), mAmax.layout)
        signs = self.lane_signs(mSigns, self.sub_lane(lane))
        if cutlass.const_expr(self.varlen):
            seq = SeqlenInfo(batch, mX.shape[0], mX.shape[0], mCuSeqlens)
            at = (head, batch, seq.offset_q)
            if cutlass.const_expr(self.cfg.v_aligned):
                # (head, batch, input offset, output offset)
                at = (head, batch, seq.offset_q, mCuSeqlensOut[batch])
            # The grid is sized by the longest sequence: shorter ones leave CTAs with no rows.
            if n_block * self.rows < seq.seqlen_q:
                self.run_phase(mX, mOut, signs, amax_ptr, at, seq.seqlen_q, n_block, tidx, warp, lane)
        else:
            at = (head, batch, None)
            self.run_phase(mX, mOut, signs, amax_ptr, at, mX.shape[0], n_block, tidx, warp, lane)

    @cute.jit
    def run_phase(self, mX: cute.Tensor, mOut: cute.Tensor, signs, amax_ptr, at: tuple, seqlen: Int32,
                  n_block: Int32, tidx: Int32, warp: Int32, lane: Int32):
        """``at``: (head, batch, offset[, output offset]) -- where this CTA's sequence lies
        (``row``)."""
        if cutlass.const_expr(self.phase == "amax"):
            self.amax_rows(mX, signs, amax_ptr, at, seqlen, n_block, warp, lane)
        elif cutlass.const_expr(self.transpose and self.varlen):
            self.quant_rows_transposed_packed(mX, mOut, amax_ptr, at, seqlen, n_block, tidx)
        elif cutlass.const_expr(self.transpose):
            self.quant_rows_transposed(mX, mOut, amax_ptr, at, seqlen, n_block, tidx)
        else:
            self.quant_rows(mX, signs, mOut, amax_ptr, at, seqlen, n_block, warp, lane)

    # ------------------------------------------------------------------------------------------
    # One row: load, rotate
    # ------------------------------------------------------------------------------------------
    def sub_lane(self, lane: Int32):
        """The lane's place within its row (its slice of the d elements)."""
        if cutlass.const_expr(self.lanes == 32):
            return lane
        return lane % self.lanes

    def first_row(self, n_block: Int32, r: Int32, warp: Int32, lane: Int32):
        """This lane's first row of loop step r (its others follow ``row_step`` apart)."""
        n0 = n_block * self.rows + r * self.row_step * ROWS_IN_FLIGHT + warp * self.rows_per_warp
        if cutlass.const_expr(self.lanes != 32):
            n0 = n0 + lane // self.lanes
        return n0

    @cute.jit
    def lane_signs(self, mSigns: cute.Tensor, lane: Int32):
        s = cute.make_rmem_tensor(self.per_lane, Float32)
        if cutlass.const_expr(self.rotate):
            cute.autovec_copy(cute.local_tile(mSigns, (self.per_lane,), (lane,)), s)
        return s

    @cute.jit
    def row(self, mT: cute.Tensor, n: Int32, at: tuple) -> cute.Tensor:
        """Token n of this CTA's sequence and head: of (N, d, H, B), or of packed (T, d, H) at
        the sequence's offset."""
        head, batch, offset = at[:3]
        if cutlass.const_expr(self.varlen):
            return mT[offset + n, None, head]
        return mT[n, None, head, batch]

    @cute.jit
    def load_raw(self, mX: cute.Tensor, n: Int32, valid, at: tuple, lane: Int32):
        """This lane's E elements of row n as stored (zeros unless ``valid``)."""
        raw = cute.make_rmem_tensor(self.per_lane, self.dtype)
        raw.fill(0.0)
        if valid:
            cute.autovec_copy(cute.local_tile(self.row(mX, n, at), (self.per_lane,), (lane,)), raw)
        return raw

    @cute.jit
    def load_rows(self, mX: cute.Tensor, n0: Int32, seqlen: Int32, at: tuple, lane: Int32):
        """Rows n0, n0 + row_step, ... (ROWS_IN_FLIGHT of them), every load issued before any
        is used: one 2..16-byte load per lane and row leaves the memory system idle while the
        warp waits on it (Little's law: ~26 KiB in flight per SM to reach 4.8 TB/s)."""
        return [self.load_raw(mX, n0 + i * self.row_step, n0 + i * self.row_step < seqlen, at, lane)
                for i in range(ROWS_IN_FLIGHT)]

    @cute.jit
    def rotate_row(self, raw, lane: Int32, signs):
        """fp32 of a row's lane elements, times D (rotation) -- then ``fwht``."""
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
        """y <- y H / sqrt(d) over the warp's row, in place (``reference_fp8.fwht``'s butterflies:
        a, b -> a + b, a - b for index pairs that differ in one bit, lowest bit first)."""
        e = self.per_lane
        in_thread = [1 << i for i in range(e.bit_length() - 1)]  # index bits below log2(E)
        # Stride E * t: the partner sits in lane ^ t, same slot (t < L: within the row's lanes).
        across = [1 << i for i in range(self.lanes.bit_length() - 1)]
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
    def amax_rows(self, mX, signs, amax_ptr, at: tuple, seqlen: Int32, n_block: Int32, warp: Int32,
                  lane: Int32):
        m = Float32(0.0)
        sub = self.sub_lane(lane)
        for r in cutlass.range(self.rows // (self.row_step * ROWS_IN_FLIGHT), unroll=1):
            n0 = self.first_row(n_block, r, warp, lane)
            raws = self.load_rows(mX, n0, seqlen, at, sub)
            for i in cutlass.range_constexpr(ROWS_IN_FLIGHT):
                # Rows past the end are zeros: no effect on the max.
                y = self.rotate_row(raws[i], sub, signs)
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
    def quant_rows(self, mX, signs, mOut, amax_ptr, at: tuple, seqlen: Int32, n_block: Int32,
                   warp: Int32, lane: Int32):
        scale = self.scale_of(amax_ptr)
        sub = self.sub_lane(lane)
        for r in cutlass.range(self.rows // (self.row_step * ROWS_IN_FLIGHT), unroll=1):
            n0 = self.first_row(n_block, r, warp, lane)
            raws = self.load_rows(mX, n0, seqlen, at, sub)
            for i in cutlass.range_constexpr(ROWS_IN_FLIGHT):
                n = n0 + i * self.row_step
                y = self.rotate_row(raws[i], sub, signs)  # the whole warp: its shuffles
                if n < seqlen:
                    q8 = cute.make_rmem_tensor(self.per_lane, cutlass.Float8E4M3FN)
                    q8.store((y.load() * scale).to(cutlass.Float8E4M3FN))  # cvt.rn.satfinite.e4m3x2
                    cute.autovec_copy(q8, cute.local_tile(self.row(mOut, n, at), (self.per_lane,), (sub,)))

    @cute.jit
    def stage_row(self, raw, sT, row: Int32, scale: Float32, lane: Int32):
        """A loaded row (``load_raw``: zeros where invalid) quantized into smem row ``row``."""
        y = cute.make_rmem_tensor(self.per_lane, Float32)
        for j in cutlass.range_constexpr(self.per_lane):
            y[j] = raw[j].to(Float32)
        q8 = cute.make_rmem_tensor(self.per_lane, cutlass.Float8E4M3FN)
        q8.store((y.load() * scale).to(cutlass.Float8E4M3FN))
        cute.autovec_copy(q8, cute.local_tile(sT[row, None], (self.per_lane,), (lane,)))

    def v_tile(self):
        # Token-contiguous columns (the 16-token reads below), padded by 4 bytes. (Lane l writes
        # columns l * E .. l * E + E - 1 of a row, (rows + 4) bytes apart: at E = 2 / 4 / 8 the
        # 32 lanes share 16 / 8 / 4 banks -- 2- to 8-way conflicts on these byte stores.)
        return SmemAllocator().allocate_tensor(cutlass.Float8E4M3FN, self.smem_layout(), 16)

    @cute.jit
    def quant_rows_transposed(self, mX, mOut, amax_ptr, at: tuple, seqlen: Int32, n_block: Int32,
                              tidx: Int32):
        """V: rows quantized into a (rows x d) smem tile, then written out column by column --
        16 consecutive tokens (16 bytes) per store -- into the (d, N_pad) storage of this head.
        Tokens past N are zeros, so the padding up to N_pad holds no garbage."""
        head, batch, _ = at
        scale = self.scale_of(amax_ptr)
        sT = self.v_tile()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = cute.arch.lane_idx()
        for r in cutlass.range(self.rows // (NUM_WARPS * ROWS_IN_FLIGHT), unroll=1):
            row0 = r * NUM_WARPS * ROWS_IN_FLIGHT + warp
            raws = self.load_rows(mX, n_block * self.rows + row0, seqlen, at, lane)
            for i in cutlass.range_constexpr(ROWS_IN_FLIGHT):
                self.stage_row(raws[i], sT, row0 + i * NUM_WARPS, scale, lane)
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

    @cute.jit
    def quant_rows_transposed_packed(self, mX, mOut, amax_ptr, at: tuple, seqlen: Int32,
                                     n_block: Int32, tidx: Int32):
        """Packed V into mOut (T_pad, d, H_kv), natural token order (``v_perm``, which needs
        ``v_aligned``: the kernel's order within each sequence). This CTA owns the tokens
        [lo, hi) of the pack; its smem tile holds the 16-aligned chunks around them (row i =
        token base + i, zeros outside [lo, hi)). Sequences start anywhere, so a chunk may be
        shared with a neighbouring CTA -- of this sequence, or of the next with another scale:
        only a chunk wholly this CTA's goes out as one 16-byte store, any other byte by byte,
        this CTA's tokens only, so no two CTAs ever write the same byte."""
        head, _, offset = at[:3]
        # Output positions: the input's (natural packed order), or with ``v_aligned`` the
        # sequence's own 16-aligned start -- then every chunk of [lo, end) is this CTA's alone and
        # goes out whole, the tail of the last one as zeros.
        out_offset = at[3] if cutlass.const_expr(self.cfg.v_aligned) else offset
        scale = self.scale_of(amax_ptr)
        sT = self.v_tile()
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = cute.arch.lane_idx()
        lo = out_offset + n_block * self.rows
        hi = out_offset + cutlass.min(n_block * self.rows + self.rows, seqlen)
        base = lo // 16 * 16
        for r in cutlass.range(self.tile_rows // (NUM_WARPS * ROWS_IN_FLIGHT), unroll=1):
            row0 = r * NUM_WARPS * ROWS_IN_FLIGHT + warp
            raws = [self.load_raw(mX, base + row0 + i * NUM_WARPS - out_offset,
                                  base + row0 + i * NUM_WARPS >= lo and base + row0 + i * NUM_WARPS < hi,
                                  at, lane) for i in range(ROWS_IN_FLIGHT)]
            for i in cutlass.range_constexpr(ROWS_IN_FLIGHT):
                self.stage_row(raws[i], sT, row0 + i * NUM_WARPS, scale, lane)
        cute.arch.barrier()
        # The padding T .. T_pad - 1 (zeros) is written by the CTA holding token T - 1 rather
        # than filled by the launcher: no extra launch for a strided sliver, and the last chunk
        # stays one 16-byte store. One CTA per head holds it (the CTAs' ranges are disjoint);
        # T = cu[S], which the op checks (``ops_fp8._check_cu_data``) before any launch.
        end = cutlass.select_(hi == mX.shape[0], mOut.shape[0], hi)
        if cutlass.const_expr(self.cfg.v_aligned):
            end = (hi + 15) // 16 * 16
        chunks = self.tile_rows // 16
        items = self.hdim * chunks
        for i in cutlass.range((items + self.num_threads - 1) // self.num_threads, unroll=1):
            item = i * self.num_threads + tidx
            col, chunk = item // chunks, item % chunks
            t0 = base + chunk * 16
            if item < items and t0 < end and t0 + 16 > lo:
                if t0 >= lo and t0 + 16 <= end:
                    vals = cute.make_rmem_tensor(16, cutlass.Float8E4M3FN)
                    for j in cutlass.range_constexpr(16):
                        # (``v_perm`` needs ``v_aligned``: then chunks count from the sequence's start.)
                        src = V_PERM16[j] if cutlass.const_expr(self.v_perm) else j
                        vals[j] = sT[chunk * 16 + src, col]
                    cute.autovec_copy(vals, cute.local_tile(mOut[None, col, head], (16,), (t0 // 16,)))
                else:
                    for j in cutlass.range_constexpr(16):
                        if t0 + j >= lo and t0 + j < end:
                            mOut[t0 + j, col, head] = sT[chunk * 16 + j, col]
