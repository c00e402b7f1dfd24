"""Which K/V blocks a query block must visit (and which query blocks a K/V block must visit) under
causal and sliding-window masks, and where the blocks that need element-wise masking begin/end.

Masks are bottom-right aligned as in flash-attn: query row i sees key j iff
``i + (Nk - Nq) - left <= j <= i + (Nk - Nq) + right`` (a negative bound is unbounded; causal is
the window (left, 0)). Blocks entirely outside are skipped; blocks entirely inside skip the
element-wise mask, so only the diagonal band pays for it.
"""


import cutlass
import cutlass.cute as cute
from cutlass import Int32

from cute_flash.device.seqlen import SeqlenInfo


class BlockInfo:
    """``pack``: query rows of the M tile are (token, head-in-group) pairs with the ``pack`` query
    heads of one KV head adjacent (packed GQA): row r is token r // pack. 1 = one head per tile."""

    def __init__(self, tile_m: int, tile_n: int, is_causal: bool, is_local: bool,
                 window_left: Int32, window_right: Int32, pack: int = 1):
        self.tile_m = tile_m
        self.tile_n = tile_n
        self.is_causal = is_causal
        self.is_local = is_local
        self.window_left = window_left
        self.window_right = window_right
        self.pack = pack

    def token_range(self, m_block: Int32):
        """[first, end) query tokens of the rows of ``m_block``."""
        if cutlass.const_expr(self.pack == 1):
            return m_block * self.tile_m, (m_block + 1) * self.tile_m
        return (m_block * self.tile_m) // self.pack, ((m_block + 1) * self.tile_m - 1) // self.pack + 1

    @cute.jit
    def n_block_min_max(self, seqlen: SeqlenInfo, m_block: Int32):
        """K/V blocks [min, max) that hold any key visible from query block ``m_block``."""
        n_block_max = cute.ceil_div(seqlen.seqlen_k, self.tile_n)
        n_block_min = Int32(0)
        offset = seqlen.seqlen_k - seqlen.seqlen_q
        first, end = self.token_range(m_block)
        if cutlass.const_expr(self.is_causal):
            right_end = end + offset
            n_block_max = cutlass.min(n_block_max, cute.ceil_div(cutlass.max(right_end, 0), self.tile_n))
        if cutlass.const_expr(self.is_local):
            w_right_end = end + offset + self.window_right
            w_left_start = first + offset - self.window_left
            if self.window_right >= 0:
                n_block_max = cutlass.min(n_block_max,
                                          cute.ceil_div(cutlass.max(w_right_end, 0), self.tile_n))
            if self.window_left >= 0:
                n_block_min = cutlass.max(w_left_start, 0) // self.tile_n
        return n_block_min, n_block_max

    @cute.jit
    def n_block_right_mask_start(self, seqlen: SeqlenInfo, m_block: Int32, n_block_min: Int32):
        """Blocks at or after this index may contain keys right of some row's limit (need the
        causal/right mask); earlier ones are fully visible on the right."""
        res = n_block_min
        if cutlass.const_expr(self.is_causal or self.is_local):
            offset = seqlen.seqlen_k - seqlen.seqlen_q
            right = Int32(0)
            if cutlass.const_expr(self.is_local):
                right = self.window_right
            # Last key the block's first (most restricted) row may see; blocks ending at or before
            # it are fully visible to every row of the block.
            first_row_limit = self.token_range(m_block)[0] + offset + right
            res = cutlass.max(n_block_min, cutlass.max(first_row_limit + 1, 0) // self.tile_n)
            if cutlass.const_expr(self.is_local):
                if self.window_right < 0:
                    # Unbounded on the right: only the seqlen mask of the last block applies.
                    res = cute.ceil_div(seqlen.seqlen_k, self.tile_n)
        return res

    @cute.jit
    def n_block_left_mask_end(self, seqlen: SeqlenInfo, m_block: Int32, n_block_min: Int32):
        """Blocks before this index may contain keys left of some row's window (need the left
        mask); blocks from here on are fully visible on the left."""
        res = n_block_min
        if cutlass.const_expr(self.is_local):
            offset = seqlen.seqlen_k - seqlen.seqlen_q
            last_row_start = self.token_range(m_block)[1] - 1 + offset - self.window_left
            if self.window_left >= 0:
                res = cutlass.max(n_block_min, cute.ceil_div(cutlass.max(last_row_start, 0), self.tile_n))
        return res

    @cute.jit
    def m_block_min_max(self, seqlen: SeqlenInfo, n_block: Int32):
        """Query blocks [min, max) that see any key of K/V block ``n_block`` (backward)."""
        m_block_max = cute.ceil_div(seqlen.seqlen_q, self.tile_m)
        m_block_min = Int32(0)
        offset = seqlen.seqlen_k - seqlen.seqlen_q
        if cutlass.const_expr(self.is_causal):
            # Row i sees key j iff j <= i + offset: the first row that sees this block's first key.
            first_row = n_block * self.tile_n - offset
            m_block_min = cutlass.max(first_row, 0) // self.tile_m
        if cutlass.const_expr(self.is_local):
            w_first_row = n_block * self.tile_n - offset - self.window_right
            # Row i sees key j iff j >= i + offset - left: rows past the last key + left see nothing.
            w_last_row_end = (n_block + 1) * self.tile_n - offset + self.window_left
            if self.window_right >= 0:
                m_block_min = cutlass.max(w_first_row, 0) // self.tile_m
            if self.window_left >= 0:
                m_block_max = cutlass.min(m_block_max,
                                          cute.ceil_div(cutlass.max(w_last_row_end, 0), self.tile_m))
        return m_block_min, m_block_max
