"""Backward-only device helpers: the padded per-batch scratch layout shared by the three backward
kernels, where the causal/window mask stops/starts being needed along the query blocks of one
K/V block, fp32 reductions into global memory and the ordering semaphore of deterministic mode.

Scratch layout (allocated in ``launch.alloc_scratch``): LSE*log2(e), D = rowsum(dO*O) and the
dQ accumulator are indexed by a *padded* row: dense inputs pad every (batch, head) to
``ceil(Nq / tile_m) * tile_m`` rows; packed (varlen) inputs start batch ``b`` at
``(cu_q[b] + b * tile_m) // tile_m * tile_m``, so every batch begins on a tile boundary and no
two batches share a tile. The kernels therefore read and write whole tiles without row predicates;
the preprocess fills the padding rows with values that make their contributions exact zeros.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash.device.seqlen import SeqlenInfo


# ---------------------------------------------------------------------------------------------
# Padded scratch rows
# ---------------------------------------------------------------------------------------------
def padded_offset_q(seqlen: SeqlenInfo, batch_idx: Int32, tile_m: int) -> Int32:
    """First padded row of this batch in a packed scratch buffer (0 for dense ones, where the batch
    is a separate tensor mode)."""
    if cutlass.const_expr(seqlen.varlen_q):
        # The divisibility hint keeps 16-byte vector accesses legal on the shifted views.
        return cute.assume((seqlen.offset_q + batch_idx * tile_m) // tile_m * tile_m, divby=tile_m)
    return Int32(0)


def scratch_rows(mT: cute.Tensor, seqlen: SeqlenInfo, head: Int32, batch: Int32, tile_m: int) -> cute.Tensor:
    """Per-row fp32 scratch (LSE*log2e, D) of one (batch, head): dense (Npad, H, B), packed
    (Tpad, H)."""
    if cutlass.const_expr(seqlen.varlen_q):
        return cute.domain_offset((padded_offset_q(seqlen, batch, tile_m),), mT[None, head])
    return mT[None, head, batch]


def dq_accum_block(mdQaccum: cute.Tensor, seqlen: SeqlenInfo, head: Int32, batch: Int32, m_block: Int32,
                   tile_m: int, hdim: int) -> cute.Tensor:
    """The ``tile_m * hdim`` fp32 dQ accumulator chunk of one query block: dense (Npad*d, H, B),
    packed (Tpad*d, H). Inside the chunk the order is the main kernel's MMA fragment order (see
    ``FlashBwdSm80``), not row-major, so that each warp's atomics hit whole 128-byte lines."""
    if cutlass.const_expr(seqlen.varlen_q):
        base = cute.domain_offset((padded_offset_q(seqlen, batch, tile_m) * hdim,), mdQaccum[None, head])
    else:
        base = mdQaccum[None, head, batch]
    return cute.local_tile(base, (tile_m * hdim,), (m_block,))


def semaphore_index(seqlen: SeqlenInfo, batch: Int32, m_block: Int32, tile_m: int) -> Int32:
    """Row of the (dense (Mblocks, H, B) | packed (Tpad / tile_m, H)) semaphore tensor."""
    return padded_offset_q(seqlen, batch, tile_m) // tile_m + m_block


def rotated_add_rank(step, m, num_m, q_per, rem, n_div):
    """Deterministic mode with the rotated walk (``rotate_m``, attention without masks): key block
    n of ``num_n`` visits query block ``m`` (of ``num_m``) at ``step = (m - n) mod num_m``, and
    every query block takes its adds in (step, n) order -- each adder's predecessor got there a
    step earlier, so in steady state nobody waits (in the descending order block n waits for
    n + 1 on every query block: N - 1 steps of lag per head). Returns the add's rank in that
    order: the key blocks with a smaller step, plus those at the same step (n' = n mod num_m)
    with a smaller n'.

    ``q_per, rem = divmod(num_n, num_m)`` and ``n_div = n // num_m`` (once per CTA). The key
    blocks at step t of query block m are n' = m - t (mod num_m): q_per of them, one more for a
    residue below ``rem``. The residues of steps 0 .. step - 1 run m, m - 1, .., ``lo``, wrapping
    past 0 to num_m + lo .. num_m - 1 when lo < 0. Branch-free (min / max) for the kernel's Int32
    and the CPU tests' int.
    """
    lo = m - step + 1
    plain = cutlass.max(cutlass.min(m + 1, rem) - cutlass.max(lo, 0), 0)
    wrapped = cutlass.max(rem - num_m - cutlass.min(lo, 0), 0)
    return step * q_per + plain + wrapped + n_div


# ---------------------------------------------------------------------------------------------
# Query-block ranges of one K/V block that need the element-wise mask
# ---------------------------------------------------------------------------------------------
class BwdMaskBounds:
    """For K/V block ``n_block``: query blocks below ``right_end`` may hold keys right of some
    row's limit (the causal diagonal / right window edge); blocks from ``left_start`` on may
    hold keys left of some row's window. Same bottom-right aligned convention as
    ``BlockInfo``: row i sees key j iff i + off - left <= j <= i + off + right, off = Nk - Nq."""

    def __init__(self, tile_m: int, tile_n: int, is_causal: bool, is_local: bool,
                 window_left: Int32, window_right: Int32):
        self.tile_m, self.tile_n = tile_m, tile_n
        self.is_causal, self.is_local = is_causal, is_local
        self.window_left, self.window_right = window_left, window_right

    @cute.jit
    def right_mask_end(self, seqlen: SeqlenInfo, n_block: Int32, m_block_min: Int32) -> Int32:
        """First query block whose every row sees the last key of the block on the right side.
        Block m needs no right mask iff its first row m*tile_m sees key (n+1)*tile_n - 1, i.e.
        m*tile_m + off + right >= (n+1)*tile_n - 1."""
        res = m_block_min
        if cutlass.const_expr(self.is_causal or self.is_local):
            offset = seqlen.seqlen_k - seqlen.seqlen_q
            right = Int32(0)
            if cutlass.const_expr(self.is_local):
                right = self.window_right
            need = (n_block + 1) * self.tile_n - 1 - offset - right  # smallest first row that is safe
            res = cutlass.max(m_block_min, cute.ceil_div(cutlass.max(need, 0), self.tile_m))
            if cutlass.const_expr(self.is_local):
                if self.window_right < 0:
                    res = m_block_min
        return res

    @cute.jit
    def left_mask_start(self, seqlen: SeqlenInfo, n_block: Int32, m_block_max: Int32) -> Int32:
        """First query block that may hold a row whose window starts right of the block's first
        key. Block m needs the left mask iff its last row (m+1)*tile_m - 1 has
        (m+1)*tile_m - 1 + off - left > n*tile_n."""
        res = m_block_max
        if cutlass.const_expr(self.is_local):
            if self.window_left >= 0:
                offset = seqlen.seqlen_k - seqlen.seqlen_q
                # smallest last row that needs the mask: n*tile_n + 1 - off + left
                x = n_block * self.tile_n + 1 - offset + self.window_left
                res = cutlass.min(m_block_max, cutlass.max(x, 0) // self.tile_m)
        return res


# ---------------------------------------------------------------------------------------------
# Global-memory reductions and ordering
# ---------------------------------------------------------------------------------------------
@cute.jit
def red_add_f32(ptr: cute.Pointer, val: Float32):
    """Fire-and-forget fp32 add performed at L2 (``red.global.add.f32``): no return value, so the
    warp does not wait for the round trip the way ``atom`` would."""
    cute.arch.red(ptr, val, op="add", dtype="f32", sem="relaxed", scope="gpu")


def frag_chunk_view(chunk: cute.Tensor, tidx: Int32, num_threads: int, group: int = 128) -> cute.Tensor:
    """Thread ``tidx``'s elements of a ``num_threads``-thread fp32 chunk in fragment order, per
    ``group`` of threads (a warpgroup): thread t = g * group + u keeps element i at
    g * n * group + (i // 4) * 4 * group + u * 4 + i % 4 (n elements per thread), returned as a
    (4, n / 4) view whose flat index is i. Consecutive threads own consecutive 16-byte words, so a
    warp's 16-byte stores and loads cover whole 128-byte lines and hit every smem bank once; each
    warpgroup's part is one contiguous range (one bulk reduce-add per warpgroup, handed over
    without waiting for the other warpgroup) and so is the whole chunk."""
    n = cute.size(chunk) // num_threads
    whole = cute.make_tensor(chunk.iterator, cute.make_layout(
        ((4, (group, num_threads // group)), n // 4), stride=((1, (4, n * group)), 4 * group)))
    return whole[(None, tidx), None]


def bulk_reduce_add_f32(dst: cute.Pointer, src: cute.Pointer, nbytes: int) -> None:
    """``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32``: the copy engine adds
    ``nbytes`` of fp32 from smem into global memory (at L2); bracket with bulk commit / wait."""
    from cutlass.experimental.primitives.nvvm_wrapper import (
        CpReduceOp,
        CpReduceType,
        cp_reduce_async_bulk_global_shared_cta,
    )

    cp_reduce_async_bulk_global_shared_cta(dst, src, nbytes, op=CpReduceOp.ADD, type=CpReduceType.F32)


def _sync(barrier_id: int, num_threads: int) -> None:
    # The whole CTA (``__syncthreads``), or the threads of a named barrier (warp-specialised
    # kernels, where only the consumer warps reduce dQ).
    if cutlass.const_expr(barrier_id == 0):
        cute.arch.barrier()
    else:
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=num_threads)


@cute.jit
def semaphore_spin(ptr: cute.Pointer, expected: Int32):
    """Spin (this thread only) with gpu-scope acquire loads until ``*ptr == expected``."""
    val = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")
    while val != expected:
        val = cute.arch.load(ptr, Int32, sem="acquire", scope="gpu")


@cute.jit
def semaphore_wait(ptr: cute.Pointer, expected: Int32, tidx: Int32, barrier_id: cutlass.Constexpr[int] = 0,
                   num_threads: cutlass.Constexpr[int] = 0):
    """Block the CTA (or the threads of named barrier ``barrier_id``) until ``*ptr == expected``.
    One thread spins with acquire loads (gpu scope); the barrier then extends the acquire to every
    thread, so no thread issues its dQ reductions before the previous K/V block's are visible."""
    if tidx == 0:
        semaphore_spin(ptr, expected)
    _sync(barrier_id, num_threads)


@cute.jit
def semaphore_signal(ptr: cute.Pointer, value: Int32, tidx: Int32, barrier_id: cutlass.Constexpr[int] = 0,
                     num_threads: cutlass.Constexpr[int] = 0):
    """Publish ``value`` after every thread's reductions: each thread fences at gpu scope (its
    red.adds are ordered before the flag), the barrier collects them, one thread releases."""
    cute.arch.fence_acq_rel_gpu()
    _sync(barrier_id, num_threads)
    if tidx == 0:
        cute.arch.store(ptr, value, sem="release", scope="gpu")


def tiled_copy_1d(dtype, num_threads: int, elems: int, async_copy: bool = False):
    """``num_threads`` threads each moving ``elems`` contiguous elements (16 B when
    elems * width == 128): for flat fp32 rows (LSE, D, dQ accumulator chunks)."""
    from cutlass.cute.nvgpu import cpasync

    bits = elems * dtype.width
    if async_copy:
        op = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL if bits == 128
                               else cpasync.LoadCacheMode.ALWAYS)
    else:
        op = cute.nvgpu.CopyUniversalOp()
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=bits)
    return cute.make_tiled_copy_tv(atom, cute.make_layout(num_threads), cute.make_layout(elems))
