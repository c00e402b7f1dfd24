"""sm80 building blocks shared by the forward and backward kernels: swizzled smem tiles, cp.async
tiled copies, the warp-level MMA, ldmatrix-fed GEMMs and predicated row copies."""


from types import SimpleNamespace

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp


class Ctx(SimpleNamespace):
    """Per-CTA state handed to the per-block steps (partitions, accumulators, geometry)."""


def smem_tile(dtype, rows: int, cols: int, stages: int | None = None):
    """Swizzled K-major smem tile. A row chunk of 64 (or 32) 16-bit elements is 128 (64) bytes:
    with the XOR swizzle, the 8 rows one ldmatrix reads land in 8 different 16-byte bank
    groups, so neither the cp.async writes nor the ldmatrix reads conflict."""
    chunk = 64 if cols % 64 == 0 else 32
    bits = 3 if chunk == 64 else 2
    atom = cute.make_composed_layout(cute.make_swizzle(bits, 3, 3), 0,
                                     cute.make_ordered_layout((8, chunk), order=(1, 0)))
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


def _thread_layout(cols: int, num_threads: int, dtype, chunk: int = 0):
    elems = 128 // dtype.width
    chunk = chunk or (64 if cols % 64 == 0 else 32)
    per_row = chunk // elems
    return cute.make_ordered_layout((num_threads // per_row, per_row), order=(1, 0)), elems


def g2s_tiled_copy(dtype, cols: int, num_threads: int):
    """cp.async 16 B per thread per copy (cache-global: K/V/Q are streamed once per CTA)."""
    thr, elems = _thread_layout(cols, num_threads, dtype)
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))


def r2g_tiled_copy(dtype, cols: int, num_threads: int, chunk: int = 0):
    """16-byte vector copies for the smem -> gmem leg of the epilogue; ``chunk`` columns per row
    of threads (0: 64, or 32 where the columns are not a multiple of 64)."""
    thr, elems = _thread_layout(cols, num_threads, dtype, chunk)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))


def r2g_narrow_tiled_copy(out_dtype, dtype, cols: int, num_threads: int):
    """``r2g_tiled_copy(dtype, ...)``'s thread-to-element map with the elements stored as the
    narrower ``out_dtype`` (8 e4m3 of 8 bf16: one 8-byte store), for a copy converted in registers."""
    thr, elems = _thread_layout(cols, num_threads, dtype)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), out_dtype,
                               num_bits_per_copy=elems * out_dtype.width)
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))


def warp_tiled_mma(dtype, num_warps: int, atom_layout=None, perm_n: int = 16):
    """mma.sync m16n8k16 with fp32 accumulators, warps stacked along M (split-Q: each warp owns
    whole rows). The N permutation of 16 pairs two n8 atoms so one x4 ldmatrix feeds both."""
    atom_layout = atom_layout or (num_warps, 1, 1)
    return cute.make_tiled_mma(
        warp.MmaF16BF16Op(dtype, Float32, (16, 8, 16)), atom_layout,
        permutation_mnk=(atom_layout[0] * 16, atom_layout[1] * perm_n, 16))


def to_seq_dim_head(t: cute.Tensor) -> cute.Tensor:
    """(B, N, H, d) -> (N, d, H, B); packed (T, H, d) -> (T, d, H). Views only."""
    mode = [1, 3, 2, 0] if cutlass.const_expr(cute.rank(t.layout) == 4) else [0, 2, 1]
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=mode))


def lse_to_seq_head(t: cute.Tensor) -> cute.Tensor:
    """(B, H, N) -> (N, H, B); packed (H, T) -> (T, H)."""
    mode = [2, 1, 0] if cutlass.const_expr(cute.rank(t.layout) == 3) else [1, 0]
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=mode))


def forward_views(mQ, mK, mV, mO, mLSE):
    """Kernel views of every forward's tensors: Q, K, V, O as (N, d, H, B) (packed: (T, d, H)) and
    LSE as (N, H, B) (packed: (T, H))."""
    return (*[to_seq_dim_head(t) for t in (mQ, mK, mV, mO)], lse_to_seq_head(mLSE))


def grid_rows(mQ: cute.Tensor, mCuSeqlensQ: cute.Tensor | None, max_seqlen_q):
    """(batches, query rows) a forward grid covers: varlen grids are sized by the longest
    sequence (shorter ones leave CTAs that exit at once); ``mQ`` as from ``forward_views``."""
    if mCuSeqlensQ is not None:
        return mCuSeqlensQ.shape[0] - 1, max_seqlen_q
    return mQ.shape[3], mQ.shape[0]


@cute.jit
def load_rows(tiled_copy, thr_copy, gT: cute.Tensor, sT: cute.Tensor, rows: int, cols: int,
              rows_left: Int32, tidx: Int32):
    """cp.async a (rows, cols) tile, skipping rows past the sequence end."""
    tg, ts = thr_copy.partition_S(gT), thr_copy.partition_D(sT)
    tc = thr_copy.partition_S(cute.make_identity_tensor((rows, cols)))
    for m in cutlass.range_constexpr(cute.size(ts, mode=[1])):
        if tc[0, m, 0][0] < rows_left:
            cute.copy(tiled_copy, tg[None, m, None], ts[None, m, None])


@cute.jit
def load_block(tiled_copy, tg: cute.Tensor, ts: cute.Tensor, tc: cute.Tensor, rows_left: Int32,
               partial: cutlass.Constexpr[bool], zero_fill: cutlass.Constexpr[bool]):
    """cp.async one K/V block (already partitioned). Only the block at the sequence end is
    ``partial``: full blocks copy without any predicate."""
    if cutlass.const_expr(not partial):
        cute.copy(tiled_copy, tg, ts)
    else:
        for n in cutlass.range_constexpr(cute.size(ts, mode=[1])):
            if tc[0, n, 0][0] < rows_left:
                cute.copy(tiled_copy, tg[None, n, None], ts[None, n, None])
            else:
                if cutlass.const_expr(zero_fill):
                    ts[None, n, None].fill(0)


@cute.jit
def store_rows(tiled_copy, thr_copy, sT: cute.Tensor, gT: cute.Tensor, rows: int, cols: int,
               rows_left: Int32):
    """smem -> registers (16 B per thread) -> gmem, rows past the sequence end dropped."""
    ts = thr_copy.partition_S(sT)
    tr = cute.make_rmem_tensor_like(ts, sT.element_type)
    cute.autovec_copy(ts, tr)
    tg = thr_copy.partition_D(gT)
    tc = thr_copy.partition_S(cute.make_identity_tensor((rows, cols)))
    for m in cutlass.range_constexpr(cute.size(tr, mode=[1])):
        if tc[0, m, 0][0] < rows_left:
            cute.copy(tiled_copy, tr[None, m, None], tg[None, m, None])


@cute.jit
def gemm_ss(tiled_mma, acc, tCrA, tCrB, tCsA, tCsB, s2r_A, s2r_B,
            prefetch: cutlass.Constexpr[bool] = True):
    """acc += A B^T with both operands in smem: ldmatrix of k-slice k+1 is issued before the
    MMAs of slice k so shared-memory latency hides behind the tensor cores (``prefetch``; off
    when the registers for a second slice are not there)."""
    rA, rB = s2r_A.retile(tCrA), s2r_B.retile(tCrB)
    nk = cute.size(tCsA, mode=[2])
    if cutlass.const_expr(prefetch):
        cute.copy(s2r_A, tCsA[None, None, 0], rA[None, None, 0])
        cute.copy(s2r_B, tCsB[None, None, 0], rB[None, None, 0])
    for k in cutlass.range_constexpr(nk):
        if cutlass.const_expr(not prefetch):
            cute.copy(s2r_A, tCsA[None, None, k], rA[None, None, k])
            cute.copy(s2r_B, tCsB[None, None, k], rB[None, None, k])
        elif cutlass.const_expr(k + 1 < nk):
            cute.copy(s2r_A, tCsA[None, None, k + 1], rA[None, None, k + 1])
            cute.copy(s2r_B, tCsB[None, None, k + 1], rB[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


@cute.jit
def gemm_rs(tiled_mma, acc, tCrA, tCrB, tCsB, s2r_B, prefetch: cutlass.Constexpr[bool] = True):
    """acc += A B^T with A already in registers (P) and B from smem. ``prefetch=False`` for wide
    B slices (large head dims): a whole extra k-slice of V^T in flight costs d/4 registers."""
    rB = s2r_B.retile(tCrB)
    nk = cute.size(tCrA, mode=[2])
    if cutlass.const_expr(prefetch):
        cute.copy(s2r_B, tCsB[None, None, 0], rB[None, None, 0])
    for k in cutlass.range_constexpr(nk):
        if cutlass.const_expr(not prefetch):
            cute.copy(s2r_B, tCsB[None, None, k], rB[None, None, k])
        elif cutlass.const_expr(k + 1 < nk):
            cute.copy(s2r_B, tCsB[None, None, k + 1], rB[None, None, k + 1])
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)


