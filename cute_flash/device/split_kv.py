"""Split-KV pieces shared by the KV-cache forwards: which key blocks a split visits, and its fp32
partial O written straight from the accumulator registers."""

import cutlass
import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def split_block_range(n_block_min: Int32, n_block_max: Int32, split: Int32, num_splits: Int32):
    """Split ``split`` of ``num_splits``: an equal share of the visible blocks (none for the last
    splits when there are fewer blocks than splits; they write O = 0, LSE = -inf, which the merge
    ignores). The share comes from the lengths on the device, the split count from the host."""
    share = cute.ceil_div(cutlass.max(n_block_max - n_block_min, 0), num_splits)
    lo = n_block_min + split * share
    return lo, cutlass.min(n_block_max, lo + share)


@cute.jit
def store_partial_o(thr_mma, acc_O: cute.Tensor, gO: cute.Tensor, tile_m: cutlass.Constexpr[int],
                    hdim_v: cutlass.Constexpr[int], rows_left: Int32) -> None:
    """acc_O (fp32, this thread's MMA C fragment) into the (tile_m, hdim_v) tile ``gO``, rows below
    ``rows_left``. By (row, column) coordinate: a packed-GQA tile's rows ((heads, tokens)) need not
    split along the MMA's row partition (6 heads x 32 tokens of a 192-row tile do not)."""
    coords = thr_mma.partition_C(cute.make_identity_tensor((tile_m, hdim_v)))
    for i in cutlass.range_constexpr(cute.size(acc_O)):
        if coords[i][0] < rows_left:
            gO[coords[i]] = acc_O[i]
