"""Learnable attention sinks: one logit per query head that joins every row's softmax
denominator and contributes no value (gpt-oss). The forward folds it into the row sum at the end
(``OnlineSoftmax.finalize``) and into the LSE, so the backward, which recomputes P from the LSE,
is unchanged; the sinks' own gradient is -sum over rows of exp(sink - LSE) * rowsum(dO * O).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash.device.layout import acc_to_mn
from cute_flash.device.softmax import LOG2_E


@cute.jit
def row_sinks(mSinks: cute.Tensor, thr_mma, tile_m: cutlass.Constexpr[int], cols: cutlass.Constexpr[int],
              head: Int32, pack: cutlass.Constexpr[int], num_rows: cutlass.Constexpr[int]) -> cute.Tensor:
    """The sinks (log2 units) of this thread's accumulator rows, as ``OnlineSoftmax.finalize``
    takes them. ``head``: the tile's query head, or with packed GQA (``pack`` > 1) its KV head,
    row r then being query head head * pack + r % pack (a tile starts at a multiple of pack)."""
    coords = acc_to_mn(thr_mma.partition_C(cute.make_identity_tensor((tile_m, cols))))
    sinks = cute.make_rmem_tensor(num_rows, Float32)
    for r in cutlass.range_constexpr(num_rows):
        h = head
        if cutlass.const_expr(pack > 1):
            h = head * pack + coords[r, 0][0] % pack
        sinks[r] = mSinks[h] * Float32(LOG2_E)
    return sinks
