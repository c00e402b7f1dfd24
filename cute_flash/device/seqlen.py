"""Per-CTA sequence geometry: where a batch's rows start in (possibly packed) tensors and how long
its query/key sequences are."""


import cutlass
import cutlass.cute as cute
from cutlass import Int32


class SeqlenInfo:
    """Built inside a kernel for one batch index.

    Dense inputs: offsets 0, lengths from the static/dynamic tensor extents. Varlen inputs: the
    batch's tokens are rows ``[cu[b], cu[b+1])`` of the packed tensor, so only the offsets and
    lengths differ and every kernel body stays the same.
    """

    def __init__(self, batch_idx: Int32, seqlen_q_static, seqlen_k_static,
                 mCuSeqlensQ: cute.Tensor | None = None, mCuSeqlensK: cute.Tensor | None = None):
        self.varlen_q = mCuSeqlensQ is not None
        self.varlen_k = mCuSeqlensK is not None
        if cutlass.const_expr(self.varlen_q):
            self.offset_q = mCuSeqlensQ[batch_idx]
            self.seqlen_q = mCuSeqlensQ[batch_idx + 1] - self.offset_q
        else:
            self.offset_q = Int32(0)
            self.seqlen_q = Int32(seqlen_q_static)
        if cutlass.const_expr(self.varlen_k):
            self.offset_k = mCuSeqlensK[batch_idx]
            self.seqlen_k = mCuSeqlensK[batch_idx + 1] - self.offset_k
        else:
            self.offset_k = Int32(0)
            self.seqlen_k = Int32(seqlen_k_static)

    def _rows(self, mT: cute.Tensor, head_idx: Int32, batch_idx: Int32, varlen: bool, offset: Int32):
        # Dense tensors are (N, d, H, B); packed ones (T, d, H): shift the row origin instead.
        if cutlass.const_expr(varlen):
            return cute.domain_offset((offset, 0), mT[None, None, head_idx])
        return mT[None, None, head_idx, batch_idx]

    def q_rows(self, mT: cute.Tensor, head_idx: Int32, batch_idx: Int32) -> cute.Tensor:
        """(seqlen_q, d) view of a Q-shaped tensor (Q, O, dO, dQ) for one head."""
        return self._rows(mT, head_idx, batch_idx, self.varlen_q, self.offset_q)

    def k_rows(self, mT: cute.Tensor, head_idx: Int32, batch_idx: Int32) -> cute.Tensor:
        """(seqlen_k, d) view of a K-shaped tensor (K, V, dK, dV) for one kv head."""
        return self._rows(mT, head_idx, batch_idx, self.varlen_k, self.offset_k)

    def q_vec(self, mT: cute.Tensor, head_idx: Int32, batch_idx: Int32) -> cute.Tensor:
        """(seqlen_q,) view of a per-row float tensor (LSE, D): dense (N, H, B), packed (T, H)."""
        if cutlass.const_expr(self.varlen_q):
            return cute.domain_offset((self.offset_q,), mT[None, head_idx])
        return mT[None, head_idx, batch_idx]


class CacheSeqlenInfo(SeqlenInfo):
    """A KV cache's geometry for one batch: dense query rows; keys ``[leftpad, seqused)`` of cache
    row ``cache_batch_idx[b]`` (or ``b``). The cache's (N_max, d, H, B) extent stays the TMA
    tensor's, so the loads never run past the allocation; keys at or past ``seqused`` are masked
    like any sequence end."""

    def __init__(self, batch_idx: Int32, seqlen_q_static, mSeqUsedK: cute.Tensor,
                 mCacheBatchIdx: cute.Tensor | None = None, mLeftPad: cute.Tensor | None = None):
        self.varlen_q = False
        self.varlen_k = mLeftPad is not None  # (k_rows shifts the row origin, as for packed keys)
        self.offset_q = Int32(0)
        self.seqlen_q = Int32(seqlen_q_static)
        self.batch_k = batch_idx
        if cutlass.const_expr(mCacheBatchIdx is not None):
            self.batch_k = mCacheBatchIdx[batch_idx]
        self.offset_k = Int32(0)
        if cutlass.const_expr(mLeftPad is not None):
            self.offset_k = mLeftPad[batch_idx]
        self.seqlen_k = mSeqUsedK[batch_idx] - self.offset_k

    def k_rows(self, mT: cute.Tensor, head_idx: Int32, batch_idx: Int32) -> cute.Tensor:
        rows = mT[None, None, head_idx, self.batch_k]
        if cutlass.const_expr(self.varlen_k):
            return cute.domain_offset((self.offset_k, 0), rows)
        return rows
