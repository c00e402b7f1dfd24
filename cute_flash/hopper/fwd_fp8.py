"""FP8 (e4m3) FlashAttention-3 forward for Hopper: the bf16 kernel of ``hopper/fwd.py``
with e4m3 Q, K, V and k32 wgmma for both GEMMs, bf16 O.

What differs from 16 bit, and why:

* V^T is the P V wgmma's B operand, and fp8 wgmma takes K-major operands only: V must arrive with
  the keys contiguous. ``launch.quantize_qkv`` writes it that way ((B, H_kv, d, N_pad) storage
  under the (B, N, H_kv, d) view), so TMA loads (d, tile_n) tiles of it directly.
* P goes from the fp32 S accumulator to e4m3 registers as the RS wgmma's A operand. The k32 A
  fragment holds 4 consecutive keys per 32-bit register (k = 4q .. 4q + 3 and 16 + 4q .., q =
  lane % 4), the accumulator 2 per 8-column group (columns 8j + 2q, 8j + 2q + 1): each thread
  swaps 16-bit pairs with the other three lanes of its quad (``quad_exchange_p``, 4 shuffles
  and 4 byte merges per 32 keys and row pair). With V stored in the kernel's token order
  (``v_perm``, ``formats.V_PERM16``: the ``fp8=True`` path) the lane already holds its bytes and
  only the merges remain (``merge_own_p``).
* The per-(batch, kv head) descales fold into the scores' exp2 scale (q_descale * k_descale) and
  into O's final 1 / row-sum factor (v_descale); LSE comes out in the descaled units.
* P is computed as ``formats.P_SCALE`` * p by the exp2 itself (an offset on its argument), which
  keeps small probabilities out of e4m3's subnormals; the row sums carry the same factor, so the
  normalisation cancels it.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import warpgroup

from cute_flash.device import warp_mma
from cute_flash.device.convert import pack_codes
from cute_flash.device.layout import acc_to_mn
from cute_flash.formats import EXP_BYTES_LOG2_SCALE, P_SCALE
from cute_flash.hopper.fwd import FlashFwdSm90

# Columns of the ones block (the narrowest wgmma N).
SUM_COLS = 8


@cute.jit
def quad_exchange_p(rP: cute.Tensor, num_kblocks: cutlass.Constexpr[int]) -> None:
    """In place: the e4m3 P of one thread, in the S accumulator's register order (32-bit word j =
    column group j: [row r pair, row r + 8 pair]), into the k32 A fragment's (word 4 kb + 2 h + i =
    keys 32 kb + 16 h + 4q .. + 3 of row r + 8 i). Thread q needs the pairs of lanes
    s0 = 2 (q % 2) and s0 + 1 from column group 4 kb + 2 h + q // 2; two shuffle rounds per half
    in which every lane of the quad is read by exactly one other, the sender choosing the word
    its reader needs by its own lane parity."""
    words = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=Int32), cute.make_layout(4 * num_kblocks))
    lane = cute.arch.lane_idx()
    q = lane & 3
    base = lane & ~3
    odd = (lane & 1) == 1
    upper = q >= 2
    src_a = base | ((q >> 1) | ((q & 1) << 1))
    src_b = base | (((q >> 1) ^ 1) | ((q & 1) << 1))
    for kb in cutlass.range_constexpr(num_kblocks):
        out = []
        for h in cutlass.range_constexpr(2):
            w0, w1 = words[4 * kb + 2 * h], words[4 * kb + 2 * h + 1]
            ra = cute.arch.shuffle_sync(cutlass.select_(odd, w1, w0), offset=src_a)
            rb = cute.arch.shuffle_sync(cutlass.select_(odd, w0, w1), offset=src_b)
            x0 = cutlass.select_(upper, rb, ra)  # from lane s0
            x1 = cutlass.select_(upper, ra, rb)  # from lane s0 + 1
            out.append((x0 & 0xFFFF) | (x1 << 16))
            out.append(((x0 >> 16) & 0xFFFF) | (x1 & -65536))
        for i in cutlass.range_constexpr(4):
            words[4 * kb + i] = out[i]


@cute.jit
def merge_own_p(rP: cute.Tensor, num_kblocks: cutlass.Constexpr[int]) -> None:
    """In place, for V in the kernel order (``formats.V_PERM16``): A-fragment word 4 kb + 2 h + i
    = the row r + 8 i halves of accumulator words 4 kb + 2 h and 4 kb + 2 h + 1 -- the lane's own
    key pairs 2q, 2q + 1 and 2q + 8, 2q + 9, which that V order puts at positions 4q .. 4q + 3."""
    words = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=Int32), cute.make_layout(4 * num_kblocks))
    for kb in cutlass.range_constexpr(num_kblocks):
        for h in cutlass.range_constexpr(2):
            w0, w1 = words[4 * kb + 2 * h], words[4 * kb + 2 * h + 1]
            words[4 * kb + 2 * h] = (w0 & 0xFFFF) | (w1 << 16)
            words[4 * kb + 2 * h + 1] = ((w0 >> 16) & 0xFFFF) | (w1 & -65536)


def p_code_sources(tile_n: int, v_perm: bool) -> list[tuple[int, int, int, int]]:
    """For each 32-bit word of a thread's e4m3 P, the S accumulator registers whose codes it holds
    (byte 0 first). Accumulator word w is [row r pair, row r + 8 pair] of column group w; with V in
    the kernel order the words are those ``merge_own_p`` builds (row r + 8 i halves of words w, w +
    1, w even), else the accumulator's own order (the quad exchange follows)."""
    out = []
    for w in range(0, tile_n // 8, 2):
        for i in range(2):
            if v_perm:
                out.append((4 * w + 2 * i, 4 * w + 2 * i + 1, 4 * w + 4 + 2 * i, 4 * w + 5 + 2 * i))
            else:
                u = w + i
                out.append((4 * u, 4 * u + 1, 4 * u + 2, 4 * u + 3))
    return out


class FlashFwdSm90Fp8(FlashFwdSm90):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.o_dtype = self.dtype  # bf16 / fp16 (the config's dtype names the output)
        self.dtype = cutlass.Float8E4M3FN
        self.tx_Q = self.tile_m * self.hdim
        self.tx_K = self.tile_n * self.hdim
        self.tx_V = self.tile_n * self.hdim_v
        self.p_log2_offset = EXP_BYTES_LOG2_SCALE if cfg.exp_bytes else math.log2(P_SCALE)
        self.softmax_exp_bytes = cfg.exp_bytes
        self.softmax_sums_rows = not cfg.sum_mma

    def _setup(self) -> None:
        self.sQ_layout = self._smem(self.tile_m, self.hdim, None)
        self.sK_layout = self._smem(self.tile_n, self.hdim, self.num_stages)
        # V^T tiles: (d, keys), keys contiguous (K-major B operand of P V).
        self.sV_layout = self._smem(self.hdim_v, self.tile_n, self.num_stages)
        self.sO_layout = self._smem(self.tile_m, self.hdim_v, None, self.o_dtype)
        K = cute.nvgpu.OperandMajorMode.K
        f8 = self.dtype
        self.mma_qk = sm90_utils.make_trivial_tiled_mma(
            f8, f8, K, K, Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, self.tile_n))
        self.mma_pv = sm90_utils.make_trivial_tiled_mma(
            f8, f8, K, K, Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, self.hdim_v),
            a_source=warpgroup.OperandSource.RMEM)
        self.copy_O = warp_mma.r2g_tiled_copy(self.o_dtype, self.hdim_v, self.num_mma_threads)
        if cutlass.const_expr(self.cfg.sum_mma):
            # P times a (keys x 8) block of ones: every column of the m64n8 result is P's row sum.
            self.sOnes_layout = self._smem(SUM_COLS, self.tile_n, None)
            self.mma_sum = sm90_utils.make_trivial_tiled_mma(
                f8, f8, K, K, Float32, atom_layout_mnk=(self.num_mma_wg, 1, 1), tiler_mn=(64, SUM_COLS),
                a_source=warpgroup.OperandSource.RMEM)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
                 softmax_scale: Float32, softcap: Float32, window_left: Int32, window_right: Int32,
                 max_seqlen_q: Int32, mTileCounter: cute.Tensor, mQdescale: cute.Tensor,
                 mKdescale: cute.Tensor, mVdescale: cute.Tensor, mCuSeqlensV: cute.Tensor | None, stream):
        """The bf16 forward's arguments plus the (B, H_kv) fp32 descales of Q, K and V and, for
        packed sequences, V's own (S + 1,) token offsets (``formats.v_varlen_aligned``)."""
        self._launch(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, softmax_scale, softcap, window_left,
                     window_right, max_seqlen_q, mTileCounter, (mQdescale, mKdescale, mVdescale, mCuSeqlensV),
                     stream)

    # Row sums on the tensor cores (``sum_mma``) ---------------------------------------------------
    def extra_smem(self) -> dict:
        if not self.cfg.sum_mma:
            return {}
        return {"sOnes": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(self.sOnes_layout)],
                                           1024]}

    @cute.jit
    def init_smem(self, storage) -> None:
        if cutlass.const_expr(self.cfg.sum_mma):
            # Every byte is a one, so the swizzle does not matter: a flat fill, then visible to
            # the wgmma's async proxy (the CTA barrier that follows orders it for every warp).
            ones = storage.sOnes.get_tensor(cute.make_layout(cute.cosize(self.sOnes_layout)))
            tidx, _, _ = cute.arch.thread_idx()
            for i in cutlass.range(tidx, cute.cosize(self.sOnes_layout), self.num_threads, unroll=1):
                ones[i] = self.dtype(1.0)
            cute.arch.fence_view_async_shared()

    def extra_ctx(self, ctx, smem, wg) -> None:
        if cutlass.const_expr(self.cfg.sum_mma):
            sOnes = smem.storage.sOnes.get_tensor(self.sOnes_layout.outer, swizzle=self.sOnes_layout.inner)
            wg_sum = self.mma_sum.get_slice(wg * 128)
            ctx.tLrOnes = wg_sum.make_fragment_B(wg_sum.partition_B(sOnes))
            ctx.acc_L = cute.make_rmem_tensor(
                self.mma_sum.get_slice(ctx.tidx).partition_shape_C((self.tile_m, SUM_COLS)), Float32)
            ctx.acc_L.fill(0.0)
            ctx.sum_L = cute.make_rmem_tensor_like(ctx.softmax.row_max, Float32)
            ctx.sum_L.fill(0.0)

    @cute.jit
    def pv_gemm(self, ctx, v_index, wg_wait: cutlass.Constexpr[int]):
        if cutlass.const_expr(not self.cfg.sum_mma):
            super().pv_gemm(ctx, v_index, wg_wait)
        else:
            # P V and P 1 in one commit group (the callers' wait_group counts stay as they are).
            # The sums restart at every block: an fp8 wgmma adds into its fp32 accumulator with
            # only ~14 bits kept below the largest term, so a sum carried across blocks stops
            # growing once it is ~2^13 times a block's P. ``fold_row_sums`` adds each block's sum
            # in fp32 registers instead.
            warpgroup.fence()
            rP = self.p_operand(ctx.rP)
            num_k = cute.size(rP, mode=[2])
            atom = cute.make_mma_atom(self.mma_pv.op)
            atom.set(warpgroup.Field.ACCUMULATE, True)
            tVrB = ctx.tOrVt[None, None, None, v_index]
            for k in cutlass.range_constexpr(num_k):
                cute.gemm(atom, ctx.acc_O, rP[None, None, k], tVrB[None, None, k], ctx.acc_O)
            atom_l = cute.make_mma_atom(self.mma_sum.op)
            for k in cutlass.range_constexpr(num_k):
                atom_l.set(warpgroup.Field.ACCUMULATE, k > 0)
                cute.gemm(atom_l, ctx.acc_L, rP[None, None, k], ctx.tLrOnes[None, None, k], ctx.acc_L)
            warpgroup.commit_group()
            if cutlass.const_expr(wg_wait >= 0):
                warpgroup.wait_group(wg_wait)

    @cute.jit
    def fold_row_sums(self, ctx, row_scale) -> None:
        if cutlass.const_expr(self.cfg.sum_mma):
            # Every column of the m64n8 result is the row's sum: column 0 of each held row.
            sums = acc_to_mn(ctx.acc_L)
            for r in cutlass.range_constexpr(cute.size(ctx.sum_L)):
                ctx.sum_L[r] = (ctx.sum_L[r] + sums[r, 0]) * row_scale[r]

    @cute.jit
    def finalize_rows(self, ctx):
        if cutlass.const_expr(not self.cfg.sum_mma):
            return ctx.softmax.finalize(sinks=ctx.sinks)
        # The last block's sum (its P V has completed); each thread holds whole row sums (the
        # MMA summed over every key): no quad reduction.
        sums = acc_to_mn(ctx.acc_L)
        row_sum = cute.make_rmem_tensor_like(ctx.softmax.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(row_sum)):
            row_sum[r] = ctx.sum_L[r] + sums[r, 0]
        # For the next tile (the early rescale folds acc_L before its first P V).
        ctx.acc_L.fill(0.0)
        ctx.sum_L.fill(0.0)
        return ctx.softmax.finalize(row_sum, sinks=ctx.sinks)

    # Operand hooks -------------------------------------------------------------------------------
    def v_source(self, mV: cute.Tensor) -> cute.Tensor:
        """(N, d, H, B) with the tokens contiguous -> (d, N, H, B): TMA boxes of (d, tile_n)
        (packed: (T, d, H) -> (d, T, H))."""
        modes = [1, 0, 2] if cutlass.const_expr(self.varlen) else [1, 0, 2, 3]
        return cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=modes))

    def v_box(self) -> tuple:
        return (self.hdim_v, self.tile_n)

    def v_blocks(self, mV: cute.Tensor, seqlen, head_kv, batch) -> cute.Tensor:
        if cutlass.const_expr(self.varlen):
            # The sequence's keys start at its own offset of the packed token dim (``tile_offsets``;
            # a multiple of 16 -- a TMA box must start 16-byte aligned in the contiguous dim, an
            # unaligned start faults with an illegal instruction); a box running into the next
            # sequence's keys meets P = 0 there (seqlen mask).
            keys = cute.domain_offset((0, seqlen.offset_v), mV[None, None, head_kv])
        else:
            keys = mV[None, None, head_kv, batch]
        return cute.local_tile(keys, (self.hdim_v, self.tile_n), (0, None))

    def v_operand(self, wg_pv, sV: cute.Tensor) -> cute.Tensor:
        return wg_pv.make_fragment_B(wg_pv.partition_B(sV))

    @cute.jit
    def convert_p(self, acc_S: cute.Tensor, rP: cute.Tensor) -> None:
        if cutlass.const_expr(self.cfg.exp_bytes):
            self.pack_p_codes(acc_S, rP)
            return
        # P arrives as P_SCALE * p (``p_log2_offset``): small probabilities stay out of e4m3's
        # subnormals (formats.P_SCALE) without a multiply per score.
        rP.store(acc_S.load().to(self.dtype))
        if cutlass.const_expr(self.cfg.v_perm):
            merge_own_p(rP, self.tile_n // 32)
        else:
            quad_exchange_p(rP, self.tile_n // 32)

    @cute.jit
    def pack_p_codes(self, acc_S: cute.Tensor, rP: cute.Tensor) -> None:
        """``exp_bytes``: the S registers hold e4m3 codes times 2^-24; four to a word
        (``p_code_sources``, ``device.convert.pack_codes``), then the quad exchange unless V is
        in the kernel order."""
        words = cute.make_tensor(cute.recast_ptr(rP.iterator, dtype=Int32),
                                 cute.make_layout(self.tile_n // 8))
        for u, (a, b, c, d) in enumerate(p_code_sources(self.tile_n, self.cfg.v_perm)):
            words[u] = pack_codes(acc_S[a], acc_S[b], acc_S[c], acc_S[d])
        if cutlass.const_expr(not self.cfg.v_perm):
            quad_exchange_p(rP, self.tile_n // 32)

    def p_operand(self, rP: cute.Tensor) -> cute.Tensor:
        """The exchanged registers as ((4 keys, 2 rows, 2 key halves), M, k32 blocks)."""
        return cute.make_tensor(rP.iterator, cute.make_layout(((4, 2, 2), 1, self.tile_n // 32)))

    def tile_offsets(self, seqlen, extra: tuple, batch) -> None:
        if cutlass.const_expr(self.varlen):
            seqlen.offset_v = extra[3][batch]

    def tile_scales(self, ctx, extra: tuple, mQ, mK, head, batch) -> None:
        mQd, mKd, mVd, _ = extra
        head_kv = head // (mQ.shape[2] // mK.shape[2])
        ctx.softmax.scale_log2 = ctx.scale_log2 * mQd[batch, head_kv] * mKd[batch, head_kv]
        ctx.v_descale = mVd[batch, head_kv]

    def output_scale(self, ctx, row_scale):
        for r in range(cute.size(row_scale)):
            row_scale[r] = row_scale[r] * ctx.v_descale
        return row_scale
