"""Views of MMA accumulators that cost nothing: the same registers, re-indexed."""


import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum


def acc_to_mn(acc: cute.Tensor, transpose: bool = False) -> cute.Tensor:
    """Accumulator as (rows, cols) of this thread.

    sm80 mma.sync C fragments are ((2, 2), MMA_M, MMA_N): the inner (2, 2) is (col pair, row
    half); sm90 wgmma ones are ((2, 2, N/8), MMA_M, MMA_N). Rows = (row half, MMA_M), cols = the
    rest, so a row-wise softmax is a loop over mode 0 and a reduction over mode 1.
    """
    lay = cute.make_layout(acc.layout.shape)  # column-major index space of the fragment
    s, d = lay.shape, lay.stride
    shape = ((s[0][1], s[1]), (s[0][0], *s[0][2:], s[2]), *s[3:])
    stride = ((d[0][1], d[1]), (d[0][0], *d[0][2:], d[2]), *d[3:])
    if cutlass.const_expr(transpose):
        shape = (shape[1], shape[0], *shape[2:])
        stride = (stride[1], stride[0], *stride[2:])
    return cute.make_tensor(acc.iterator,
                            cute.composition(acc.layout, cute.make_layout(shape, stride=stride)))


def acc_to_frgA(acc: cute.Tensor) -> cute.Tensor:
    """sm80: the (4, MMA_M, MMA_N) C fragment of S = Q K^T, converted to 16-bit, *is* the A
    fragment of P V for k16 (two adjacent n8 tiles form one k16 slice), so P never leaves the
    registers. Regroup (4, M, N) -> ((4, 2), M, N/2)."""
    lay = cute.logical_divide(acc.layout, (None, None, 2))
    s, d = lay.shape, lay.stride
    new = cute.make_layout(((s[0][0], s[0][1], s[2][0]), s[1], s[2][1]),
                           stride=((d[0][0], d[0][1], d[2][0]), d[1], d[2][1]))
    return cute.make_tensor(acc.iterator, new)


def transpose_smem(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a (rows, cols, ...) smem tensor: V (n, d) read as V^T (d, n)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


def pack_heads(t: cute.Tensor, pack: int, head_mode: int) -> cute.Tensor:
    """Packed GQA view: (N, ..., H, ...) -> ((pack, N), ..., H/pack, ...), the ``pack`` query heads
    of one KV head interleaved with the tokens (row r = token r // pack, head r % pack)."""
    s, d = t.layout.shape, t.layout.stride
    shape = ((pack, s[0]), *s[1:head_mode], s[head_mode] // pack, *s[head_mode + 1:])
    stride = ((d[head_mode], d[0]), *d[1:head_mode], d[head_mode] * pack, *d[head_mode + 1:])
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


def wgmma_smem_tile(dtype, rows: int, cols: int, stages: int | None = None):
    """K-major wgmma-canonical swizzled smem tile of ``dtype``, the columns contiguous (the widest
    of the 128 / 64 / 32-byte swizzles the row allows), ``stages`` deep or single."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))
