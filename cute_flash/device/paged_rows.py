"""cp.async loads of one K / V block from a paged cache, row by row: key ``j`` of a sequence lives
at row ``j % page_size`` of page ``page_table[j // page_size]``. Any page size works (one page
per key included), since every thread looks up the page of each row it copies; the lookups hit
L1 (a block's rows share a few page-table entries).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def load_paged_block(tiled_copy, mX: cute.Tensor, pages: cute.Tensor, ts: cute.Tensor, tc: cute.Tensor,
                     n_block: Int32, tile_n: cutlass.Constexpr[int], page_size: cutlass.Constexpr[int],
                     rows_left: Int32, partial: cutlass.Constexpr[bool], zero_fill: cutlass.Constexpr[bool]):
    """cp.async block ``n_block`` of keys into ``ts`` (the thread's partition of the smem stage; ``tc``
    the same partition of the block's coordinates). ``mX``: one KV head of the page pool,
    (page_size, d, num_pages); ``pages``: the sequence's page-table row. Only the ``partial`` block
    checks ``rows_left``: rows at or past it are skipped (their page entries may be unused), or with
    ``zero_fill`` written as zeros."""
    vec = cute.size(ts, mode=[0])
    for m in cutlass.range_constexpr(cute.size(ts, mode=[1])):
        row = tc[0, m, 0][0]
        valid = True
        if cutlass.const_expr(partial):
            valid = row < rows_left
        if valid:
            key = n_block * tile_n + row
            src_row = mX[key % page_size, None, pages[key // page_size]]
            for k in cutlass.range_constexpr(cute.size(ts, mode=[2])):
                src = cute.local_tile(src_row, (vec,), (tc[0, m, k][1] // vec,))
                cute.copy(tiled_copy, src, ts[None, m, k])
        else:
            if cutlass.const_expr(zero_fill):
                ts[None, m, None].fill(0)
