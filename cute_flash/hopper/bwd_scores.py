"""The scores stage of the sm90 backward main kernels (a mixin of ``bwd.FlashBwdSm90``): the
key-range / causal / window mask of a (query block, K/V block) pair, P = exp2(S * c - LSE2), softcap's
tanh and its chain-rule factor, and dS = P (dP - D), on the S^T accumulators of the narrow kernel
(keys on the rows) or the S accumulators of the wide kernel (queries on the rows, ``stat_mode``).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash.device.layout import acc_to_mn
from cute_flash.device.mods import mod_grads, mod_scores_in_block


class BwdScores:
    """Needs the kernel's ``tile_m``, ``tile_n``, ``is_causal``, ``is_local``, ``has_softcap``, ``mods``,
    ``prefetch_stats`` and ``mask_always``; the consumer context's ``tScS`` (the (key, query) or
    (query, key) coordinate of each accumulator element), ``seqlen``, ``n_block``, scales and window."""

    @cute.jit
    def mask_bounds(self, ctx, m_block: Int32):
        """(last_key, hi, lo) of query block ``m_block`` against this K/V block, in tile-local
        indices (key k, query q): a score is kept iff k <= last_key and, for causal / windows,
        lo <= k - q <= hi (row q sees keys q + offset - left .. q + offset + right, bottom-right
        aligned; unbounded sides never bind). Scalars per block, so no per-column bound stays live
        in registers."""
        offset = ctx.seqlen.seqlen_k - ctx.seqlen.seqlen_q
        key0 = ctx.n_block * self.tile_n
        q0 = m_block * self.tile_m
        # An unbounded side must not bind for any (key, query) pair: key - query spans
        # (-seqlen_q, seqlen_k), so seqlen_q + seqlen_k is out of reach either way. (seqlen_k alone
        # is not: with more queries than keys, offset < 0 and key <= query + offset + seqlen_k cuts.)
        unbounded = ctx.seqlen.seqlen_q + ctx.seqlen.seqlen_k
        right = Int32(0)
        left = unbounded
        if cutlass.const_expr(self.is_local):
            right = unbounded if ctx.window_right < 0 else ctx.window_right
            left = unbounded if ctx.window_left < 0 else ctx.window_left
        return ctx.seqlen.seqlen_k - 1 - key0, q0 + offset + right - key0, q0 + offset - left - key0

    # LSE2 and D come through smem with the block's Q / dO, read where used or into registers
    # under the wgmmas (``prefetch_stats``). Here the accumulator's columns are the queries (S^T);
    # the wide kernel's rows are.
    stat_mode = 1

    def stat_query(self, ctx, i: int):
        """Tile-local query of accumulator column (here) / row (wide kernel) ``i``."""
        return ctx.tScS[0, i][1]

    @cute.jit
    def stats_regs(self, ctx, acc_S, sStat):
        """``prefetch_stats``: this thread's per-query statistics (LSE2 or D), one per accumulator
        column (row in the wide kernel), else None (read where used, ``stat_at``)."""
        regs = None
        if cutlass.const_expr(self.prefetch_stats):
            n = cute.size(acc_to_mn(acc_S), mode=[self.stat_mode])
            regs = cute.make_rmem_tensor(n, Float32)
            for i in cutlass.range_constexpr(n):
                regs[i] = sStat[self.stat_query(ctx, i)]
        return regs

    def stat_at(self, ctx, sStat, regs, i: int) -> Float32:
        """The statistic (LSE2 or D) of accumulator column (wide kernel: row) ``i``: from smem, or
        from ``prefetch_stats``' registers."""
        if cutlass.const_expr(regs is None):
            return sStat[self.stat_query(ctx, i)]
        return regs[i]

    @cute.jit
    def probs(self, ctx, acc_S, sLSE2, m_block: Int32, lse2_regs=None, head: Int32 | None = None):
        """P = exp2(S * c - LSE2[query]) in place (softcap: of tanh(S * score_scale); mods: of
        the modified scores of query head ``head``), after the key-range / causal / window mask;
        S^T here (keys on the accumulator's rows), S in the wide kernel (``stat_mode``). Padding
        query rows have LSE2 = +inf (preprocess), so their P is 0. Returns what the chain rule
        needs (``dscores``): 1 - tanh^2 with softcap, the unmodified scores with a score_mod's
        derivative, else None."""
        dtanh = self.softcap_scores(ctx, acc_S)
        if cutlass.const_expr(self.mods is not None):
            dtanh = self.mods_scores(ctx, acc_S, m_block, head)
        bounds = self.mask_bounds(ctx, m_block)
        # By default only edge blocks (diagonal / window band, the partial last K/V block) pay for
        # the mask. ``mask_always`` masks every block instead: the compare-and-select per score
        # costs less than the branch, whose join keeps ptxas from moving the stores and waits
        # after the exponentials in among them.
        if cutlass.const_expr(self.mask_always):
            self.exp2_scores(ctx, acc_S, sLSE2, lse2_regs, bounds)
        elif self.block_needs_mask(bounds):
            self.exp2_scores(ctx, acc_S, sLSE2, lse2_regs, bounds)
        else:
            self.exp2_scores(ctx, acc_S, sLSE2, lse2_regs, None)
        return dtanh

    @cute.jit
    def exp2_scores(self, ctx, acc_S, sLSE2, lse2_regs, bounds):
        """``probs``' exponentials over this thread's scores, query by query (the accumulator's
        columns here, its rows in the wide kernel: ``stat_mode``), masked by ``bounds``
        (``mask_bounds``) or, with None, not at all. ``mask_always`` turns the bounds into one key
        interval per query (``key_window``): a score pays one compare-and-select (two with a left
        window) instead of two (three); the default's edge blocks keep the per-score compares
        (``masked_exp2``)."""
        acc = acc_to_mn(acc_S)
        qm = self.stat_mode  # the query mode of ``acc`` and of a ``tScS`` coordinate
        for i in cutlass.range_constexpr(cute.size(acc, mode=[qm])):
            lse2 = self.stat_at(ctx, sLSE2, lse2_regs, i)
            window = None
            if cutlass.const_expr(bounds is not None and self.mask_always):
                window = self.key_window(self.stat_query(ctx, i), bounds)
            for j in cutlass.range_constexpr(cute.size(acc, mode=[1 - qm])):
                rc = (j, i) if cutlass.const_expr(qm == 1) else (i, j)
                x = acc[rc] * ctx.scale_log2 - lse2
                key, query = ctx.tScS[rc][1 - qm], ctx.tScS[rc][qm]
                if cutlass.const_expr(bounds is not None and not self.mask_always):
                    acc[rc] = self.masked_exp2(x, key, query, bounds)
                else:
                    acc[rc] = self.window_exp2(x, key, window)

    @cute.jit
    def key_window(self, query: Int32, bounds: tuple):
        """(first, last) tile-local key that query ``query`` sees under ``mask_bounds``' bounds
        (first only with a left window, else None)."""
        last_key, hi, lo = bounds
        last = last_key
        if cutlass.const_expr(self.is_causal or self.is_local):
            last = cutlass.min(last, query + hi)
        first = None
        if cutlass.const_expr(self.is_local):
            first = query + lo
        return first, last

    @cute.jit
    def window_exp2(self, x: Float32, key: Int32, window) -> Float32:
        """exp2(x), or exp2(-inf) = 0 for a key outside ``window`` (``key_window``; None: none)."""
        if cutlass.const_expr(window is not None):
            first, last = window
            ok = key <= last
            if cutlass.const_expr(first is not None):
                ok = ok and key >= first
            x = cutlass.select_(ok, x, -Float32.inf)
        return cute.math.exp2(x, fastmath=True)

    @cute.jit
    def block_needs_mask(self, bounds: tuple):
        """Whether any (key, query) pair of the tile is masked (``mask_bounds``; tile-local key in
        [0, tile_n), query in [0, tile_m)): uniform over the CTA, so a branch, not a select."""
        last_key, hi, lo = bounds
        need = last_key < self.tile_n - 1
        if cutlass.const_expr(self.is_causal or self.is_local):
            need = need or hi < self.tile_n - 1
        if cutlass.const_expr(self.is_local):
            need = need or lo > 1 - self.tile_m
        return need

    @cute.jit
    def softcap_scores(self, ctx, acc_S):
        """Softcap: S <- tanh(S * score_scale) in place; returns 1 - tanh^2 for the chain rule (or
        None without softcap), kept as fp16 (11-bit mantissa, values in [0, 1]): half the registers
        of fp32, which the narrow kernel's budget needs."""
        dtanh = None
        if cutlass.const_expr(self.has_softcap):
            dtanh = cute.make_rmem_tensor_like(acc_S, cutlass.Float16)
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                t = cute.math.tanh(acc_S[i] * ctx.score_scale, fastmath=True)
                acc_S[i] = t
                dtanh[i] = (Float32(1.0) - t * t).to(cutlass.Float16)
        return dtanh

    @cute.jit
    def mods_scores(self, ctx, acc_S, m_block: Int32, head: Int32):
        """The score_mod / mask_mod on S (S^T) in place; returns the scores the score_mod saw when
        its derivative will need them (fp32, like the accumulator), else None."""
        pre = None
        if cutlass.const_expr(self.mods.grads_score):
            pre = cute.make_rmem_tensor_like(acc_S, Float32)
        where = (ctx.tScS, self.stat_mode, m_block * self.tile_m, ctx.n_block * self.tile_n, ctx.batch, head,
                 1, ctx.seqlen.seqlen_q, ctx.seqlen.seqlen_k, ctx.aux, ctx.score_scale)
        mod_scores_in_block(self.mods, acc_S, where, pre, m_block, ctx.full)
        return pre

    @cute.jit
    def softcap_grad(self, acc_dS, dtanh):
        """dS *= 1 - tanh^2 (softcap only)."""
        if cutlass.const_expr(self.has_softcap):
            for i in cutlass.range_constexpr(cute.size(acc_dS)):
                acc_dS[i] = acc_dS[i] * dtanh[i].to(Float32)

    @cute.jit
    def masked_exp2(self, x: Float32, key: Int32, query: Int32, bounds: tuple) -> Float32:
        """exp2(x) where the query sees the key (``mask_bounds``), else exp2(-inf) = 0."""
        last_key, hi, lo = bounds
        ok = key <= last_key
        if cutlass.const_expr(self.is_causal or self.is_local):
            ok = ok and key - query <= hi
        if cutlass.const_expr(self.is_local):
            ok = ok and key - query >= lo
        return cute.math.exp2(cutlass.select_(ok, x, -Float32.inf), fastmath=True)

    @cute.jit
    def dscores(self, ctx, acc_S, acc_dP, dtanh, sDsum, dsum_regs=None, where=None):
        """dS^T = P^T * (dP^T - D[query]) [* (1 - tanh^2)] into ``acc_dP``; with a score_mod's
        derivative, through it (``where``: the block's (query head, query block); ``dtanh``: the
        unmodified scores, ``probs``)."""
        p = acc_to_mn(acc_S)
        dp = acc_to_mn(acc_dP)
        for c in cutlass.range_constexpr(cute.size(dp, mode=[1])):
            dsum = self.stat_at(ctx, sDsum, dsum_regs, c)
            for r in cutlass.range_constexpr(cute.size(dp, mode=[0])):
                dp[r, c] = p[r, c] * (dp[r, c] - dsum)
        self.softcap_grad(acc_dP, dtanh)
        if cutlass.const_expr(self.mods is not None and self.mods.grads_score):
            head, m_block = where
            mod_grads(self.mods, acc_dP, dtanh, ctx.tScS, self.stat_mode, m_block * self.tile_m,
                      ctx.n_block * self.tile_n, ctx.batch, head, ctx.seqlen.seqlen_q, ctx.seqlen.seqlen_k,
                      ctx.aux, ctx.aux_grads)

