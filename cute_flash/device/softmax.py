"""Online softmax over an MMA accumulator (FA2 recurrence), with exp2 and the scale folded in.

Per row: m = max(m_old, max_j s_j); p_j = 2^(s_j*c - m*c) with c = scale*log2(e) (one FFMA per
score instead of a multiply and an exp); O and the running sum are rescaled by 2^((m_old - m)*c).
Normalisation is deferred to the end (one reciprocal per row instead of one divide per score).
Row sums stay per-thread until ``finalize``: the quad reduction is paid once, not per block.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from cute_flash.device.convert import CODE_UNIT, ceil_f32, exp_code_offset, fma_f32
from cute_flash.device.layout import acc_to_mn

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def score_scales(softmax_scale: Float32, softcap: Float32, has_softcap: bool, has_score_mod: bool = False):
    """(score_scale, scale_log2) shared by forward and backward. Without softcap the raw scores
    go straight to exp2 with scale*log2(e) folded in (score_scale = 1). With softcap, scores become
    softcap*tanh(s*scale/softcap): the tanh input is pre-scaled by scale/softcap and softcap*log2(e)
    plays the softmax scale's role afterwards. A score_mod sees scaled scores (score_scale = scale)
    and returns final ones (log2(e) afterwards)."""
    if cutlass.const_expr(has_score_mod):
        return softmax_scale, Float32(LOG2_E)
    if cutlass.const_expr(has_softcap):
        return softmax_scale / softcap, softcap * Float32(LOG2_E)
    return Float32(1.0), softmax_scale * Float32(LOG2_E)


def row_max_chains(acc_mn: cute.Tensor, r: int, chains: int) -> Float32:
    """Max of row ``r`` with ``chains`` independent chains: one chain of 40-90 dependent max
    instructions costs their full latency on the critical path between two GEMMs (sm90). The
    sm80 kernels keep one chain: their register budget has no room for the extra partials."""
    n = cute.size(acc_mn, mode=[1])
    lanes = min(chains, n)
    part = [acc_mn[r, i] for i in range(lanes)]
    for c in range(lanes, n):  # plain Python: unrolled while tracing
        part[c % lanes] = cute.arch.fmax(part[c % lanes], acc_mn[r, c])
    while len(part) > 1:
        part = [cute.arch.fmax(part[i], part[i + 1]) if i + 1 < len(part) else part[i]
                for i in range(0, len(part), 2)]
    return part[0]


class OnlineSoftmax:
    def __init__(self, scale_log2: Float32, num_rows: int, max_chains: int = 1, seed_sum: bool = False,
                 p_log2_offset: float = 0.0, sum_rows: bool = True, exp_bytes: bool = False):
        self.scale_log2 = scale_log2
        # FP8 P as e4m3 codes (times 2^-24, ``device/convert.py``) from one FFMA per score, no
        # MUFU: at d = 128 the exponentials alone take as long as both GEMMs of a block (16 per
        # clock per SM). The row's reference is its max rounded up to 1/8 in log2 units, so the
        # codes move by whole steps when it grows and the FFMA's addend is exact. Needs the
        # caller's row sums (of the same codes, ``sum_rows=False``).
        self.exp_bytes = exp_bytes
        assert not (exp_bytes and sum_rows)
        # False: the caller sums P itself (the FP8 kernel's ``sum_mma``, on the tensor cores) and
        # hands the sums to ``finalize``; no FADD per score here.
        self.sum_rows = sum_rows
        # P comes out as 2^offset * p: the row sums carry the same factor, so O's normalisation
        # cancels it and only the LSE subtracts it (FP8: P lands in e4m3's normal range at no
        # cost, where a multiply per score would be one more FMUL on the softmax's issue budget).
        self.p_log2_offset = p_log2_offset
        self.max_chains = max_chains
        self.seed_sum = seed_sum
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    def reset(self) -> None:
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    @cute.jit
    def online_softmax(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool]) -> cute.Tensor:
        """Turns scores into unnormalised probabilities in place; returns the per-row factor by
        which the output accumulator must be rescaled."""
        acc_mn = acc_to_mn(acc_S)
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_max)):
            row = acc_mn[r, None].load()
            if cutlass.const_expr(self.max_chains == 1):
                init = -Float32.inf if cutlass.const_expr(is_first) else self.row_max[r]
                m_new = row.reduce(cute.ReductionOp.MAX, init, 0)
            else:
                m_new = row_max_chains(acc_mn, r, self.max_chains)
                if cutlass.const_expr(not is_first):
                    m_new = cute.arch.fmax(m_new, self.row_max[r])
            # The 4 lanes of a quad hold the same row (mma.sync C layout): 2 shuffles.
            m_new = cute.arch.warp_reduction_max(m_new, threads_in_group=4)
            m_old = self.row_max[r]
            self.row_max[r] = m_new
            # A row with every key masked so far has m = -inf: use 0 so exp2 gives 0, not NaN.
            m_scaled = (m_new if m_new != -Float32.inf else Float32(0.0)) * self.scale_log2
            m_p = m_scaled
            if cutlass.const_expr(self.p_log2_offset != 0.0):
                m_p = m_scaled - Float32(self.p_log2_offset)
            if cutlass.const_expr(self.exp_bytes):
                ref8 = self.ref8(m_new)
                row_scale[r] = Float32(1.0)
                if cutlass.const_expr(not is_first):
                    # ceil(-inf) = -inf: a row that saw no key yet has nothing to rescale (factor
                    # 0, not 2^(-ref8 / 8), which overflows for very negative scores).
                    row_scale[r] = cute.math.exp2((self.ceil8(m_old) - ref8) * Float32(0.125), fastmath=True)
                bias = (Float32(exp_code_offset(self.p_log2_offset)) - ref8) * Float32(CODE_UNIT)
                scale = self.scale_log2 * Float32(8.0 * CODE_UNIT)
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    acc_mn[r, c] = fma_f32(acc_mn[r, c], scale, bias)
            elif cutlass.const_expr(not self.sum_rows):
                row_scale[r] = Float32(1.0)
                if cutlass.const_expr(not is_first):
                    row_scale[r] = cute.math.exp2(m_old * self.scale_log2 - m_scaled, fastmath=True)
                self._exp2_row(acc_mn, r, row, m_p)
            elif cutlass.const_expr(self.seed_sum and not is_first):
                # The rescale factor first, and the sum chain seeded with row_sum * scale: the
                # scale's exp2 then heads the longest dependency chain, so ptxas issues it early
                # and the O rescale that needs it can fill the gaps between the P exponentials
                # (otherwise it lands as one serial block before the next GEMM).
                scale = cute.math.exp2(m_old * self.scale_log2 - m_scaled, fastmath=True)
                row_scale[r] = scale
                p = self._exp2_row(acc_mn, r, row, m_p)
                self.row_sum[r] = p.reduce(cute.ReductionOp.ADD, self.row_sum[r] * scale, 0)
            else:
                p = self._exp2_row(acc_mn, r, row, m_p)
                psum = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
                if cutlass.const_expr(is_first):
                    row_scale[r] = Float32(1.0)
                    self.row_sum[r] = psum
                else:
                    scale = cute.math.exp2(m_old * self.scale_log2 - m_scaled, fastmath=True)
                    row_scale[r] = scale
                    self.row_sum[r] = self.row_sum[r] * scale + psum
        return row_scale

    def ceil8(self, m: Float32) -> Float32:
        """ceil(8 m scale_log2): 8 x the row's reference in log2 units (``exp_bytes``)."""
        return ceil_f32(m * (self.scale_log2 * Float32(8.0)))

    @cute.jit
    def ref8(self, m: Float32) -> Float32:
        """``ceil8``, 0 for a row with no key yet (the codes' addend must stay finite)."""
        return self.ceil8(m if m != -Float32.inf else Float32(0.0))

    @cute.jit
    def _exp2_row(self, acc_mn: cute.Tensor, r: int, row, m_scaled: Float32):
        """p = 2^(s * scale_log2 - m_scaled) over row ``r``, stored back into ``acc_mn``."""
        p = cute.math.exp2(row * self.scale_log2 - m_scaled, fastmath=True)
        acc_mn[r, None].store(p)
        return p

    @cute.jit
    def finalize(self, row_sums: cute.Tensor | None = None, sinks: cute.Tensor | None = None) -> cute.Tensor:
        """Returns 1/rowsum per row (0 for rows that saw no key) and turns ``row_sum`` into the
        natural-log LSE (-inf for rows that saw no key). ``row_sums``: whole-row sums from the
        caller (``sum_rows=False``), not partial per lane. ``sinks``: per row, a logit (log2 units)
        that joins the denominator and adds no value (learnable attention sinks); the LSE then
        includes it, so a backward that recomputes P from the LSE needs no other change."""
        row_scale = cute.make_rmem_tensor_like(self.row_max, Float32)
        for r in cutlass.range_constexpr(cute.size(self.row_sum)):
            if cutlass.const_expr(row_sums is None):
                s = cute.arch.warp_reduction_sum(self.row_sum[r], threads_in_group=4)
            else:
                s = row_sums[r]
            if cutlass.const_expr(sinks is not None):
                row_scale[r] = self._finalize_with_sink(r, s, sinks[r])
            else:
                empty = s == Float32(0.0) or s != s
                row_scale[r] = Float32(0.0) if empty else cute.arch.rcp_approx(s)
                log2_sum = cute.math.log2(s, fastmath=True)
                if cutlass.const_expr(self.p_log2_offset != 0.0):
                    log2_sum = log2_sum - Float32(self.p_log2_offset)
                lse = (self.row_ref(r) + log2_sum) * LN_2
                self.row_sum[r] = -Float32.inf if empty else lse
        return row_scale

    @cute.jit
    def row_ref(self, r: int) -> Float32:
        """Row ``r``'s reference in log2 units: the exponentials were taken relative to it."""
        ref = self.row_max[r] * self.scale_log2
        if cutlass.const_expr(self.exp_bytes):
            ref = self.ref8(self.row_max[r]) * Float32(0.125)
        return ref

    @cute.jit
    def _finalize_with_sink(self, r: int, s: Float32, sink: Float32) -> Float32:
        """``finalize`` of row ``r`` (sum ``s``) with a sink logit (log2 units) in the denominator:
        the sum is rebased on max(reference, sink) so neither exponential overflows; returns O's
        factor (0 for a row with no key: the sink adds no value), the LSE includes the sink."""
        empty_row = s == Float32(0.0) or s != s
        base = self.row_ref(r) if not empty_row else -Float32.inf
        s = s if not empty_row else Float32(0.0)
        top = cute.arch.fmax(base, sink)
        o_factor = Float32(0.0)
        if top != -Float32.inf:
            o_factor = cute.math.exp2(base - top, fastmath=True)
            s = s * o_factor + cute.math.exp2(sink - top + Float32(self.p_log2_offset), fastmath=True)
        empty = s == Float32(0.0)
        log2_sum = cute.math.log2(s, fastmath=True) - Float32(self.p_log2_offset)
        self.row_sum[r] = -Float32.inf if empty else (top + log2_sum) * LN_2
        return Float32(0.0) if empty else o_factor * cute.arch.rcp_approx(s)

    @staticmethod
    @cute.jit
    def rescale(acc_O: cute.Tensor, row_scale: cute.Tensor) -> None:
        acc_mn = acc_to_mn(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            acc_mn[r, None].store(acc_mn[r, None].load() * row_scale[r])

    @cute.jit
    def store_lse(self, thr_mma, gLSE: cute.Tensor, tile_m: int, tile_n: int, rows_left) -> None:
        """Write the per-row LSE (after ``finalize``) of one query tile: the lane holding column 0
        of a row writes it, rows past the sequence end are dropped. Works for any accumulator
        layout ``thr_mma.partition_C`` describes (mma.sync and wgmma)."""
        coords = acc_to_mn(thr_mma.partition_C(cute.make_identity_tensor((tile_m, tile_n))))
        if coords[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(self.row_sum)):
                row = coords[r, 0][0]
                if row < rows_left:
                    gLSE[row] = self.row_sum[r]
