"""Element-wise attention mask on an MMA accumulator: sequence end, causal/right bound, left bound.

Only the boundary blocks call this (block_info says which); everything else runs unmasked.
Masked scores become -inf so exp2 turns them into exact zeros.
"""


import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash.device.layout import acc_to_mn
from cute_flash.device.seqlen import SeqlenInfo


class AttentionMask:
    def __init__(self, tile_m: int, tile_n: int, seqlen: SeqlenInfo, window_left: Int32,
                 window_right: Int32, pack: int = 1):
        # pack > 1: packed GQA rows (see BlockInfo), row r of the tile is token r // pack.
        self.pack = pack
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.seqlen = seqlen
        self.window_left = window_left
        self.window_right = window_right

    @cute.jit
    def apply_mask(self, acc_S: cute.Tensor, thr_mma, m_block: Int32, n_block: Int32,
                   mask_seqlen: cutlass.Constexpr[bool], mask_causal: cutlass.Constexpr[bool],
                   mask_local: cutlass.Constexpr[bool], transpose: cutlass.Constexpr[bool] = False):
        """``transpose``: the accumulator holds S^T (rows are keys), as in backward kernels that
        compute dV/dK with K/V-major tiles."""
        acc_mn = acc_to_mn(acc_S, transpose=transpose)
        shape = (self.tile_n, self.tile_m) if cutlass.const_expr(transpose) else (self.tile_m, self.tile_n)
        coords = acc_to_mn(thr_mma.partition_C(cute.make_identity_tensor(shape)), transpose=transpose)
        ROW = 0 if cutlass.const_expr(not transpose) else 1
        COL = 1 if cutlass.const_expr(not transpose) else 0
        seqlen_k = self.seqlen.seqlen_k
        offset = seqlen_k - self.seqlen.seqlen_q
        row0 = m_block * self.tile_m
        col0 = n_block * self.tile_n
        use_right = cutlass.const_expr(mask_causal or mask_local)
        right = Int32(0)
        if cutlass.const_expr(mask_local):
            right = self.window_right
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            row = row0 + coords[r, 0][ROW]
            if cutlass.const_expr(self.pack > 1):
                row = row // self.pack
            # Key limits of this row; the unbounded sides get limits no key reaches.
            col_hi = seqlen_k
            if cutlass.const_expr(use_right):
                hi = row + offset + right + 1
                if cutlass.const_expr(mask_local):
                    if self.window_right < 0:
                        hi = seqlen_k
                col_hi = cutlass.min(col_hi, hi)
            col_lo = Int32(0)
            if cutlass.const_expr(mask_local):
                if self.window_left >= 0:
                    col_lo = row + offset - self.window_left
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                col = col0 + coords[0, c][COL]
                if cutlass.const_expr(use_right or mask_local):
                    if col >= col_hi or col < col_lo:
                        acc_mn[r, c] = -Float32.inf
                elif cutlass.const_expr(mask_seqlen):
                    if col >= col_hi:
                        acc_mn[r, c] = -Float32.inf
