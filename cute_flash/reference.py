"""Pure PyTorch references for the attention kernels.

``attention_ref`` is the dense ground truth every kernel is checked against (and the CPU
implementation of the ``cute_flash`` ops). ``flash_fwd_tiled_ref`` and ``flash_bwd_tiled_ref``
spell out, tile by tile, the FlashAttention-2 recurrences the sm80 kernels implement, so a
kernel bug can be bisected against readable code that is itself tested against the dense one.

Conventions (the same as flash-attn's and the kernels'):

* layout (B, N, H, d), or varlen packed (total, H, d) with int32 ``cu_seqlens`` of length B+1;
* K/V may have fewer heads than Q (GQA/MQA): query head ``h`` reads kv head ``h // (H // Hkv)``;
* masks are bottom-right aligned: query ``i`` may see key ``j`` iff
  ``j >= i + Nk - Nq - left`` (when ``left >= 0``) and ``j <= i + Nk - Nq + right`` (when
  ``right >= 0``); causal is the window ``(left, 0)``;
* softcap: ``s = softcap * tanh(scale * q.k / softcap)`` replaces the scaled score;
* LSE is the natural-log logsumexp of the final scores, (B, H, Nq) or (H, total_q); a row that
  sees no key has output 0 and LSE -inf.
"""

from __future__ import annotations

import math

import torch

LOG2E = math.log2(math.e)


# ---------------------------------------------------------------------------------------------
# Masks and small helpers
# ---------------------------------------------------------------------------------------------
def window_bounds(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """(left, right) with -1 meaning unbounded; causal forces right = 0, as
    ``launch.normalize_window`` does for the kernels."""
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    return (left if left >= 0 else -1), (right if right >= 0 else -1)


def visible_mask(nq: int, nk: int, *, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                 device: torch.device | str | None = None,
                 rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Boolean (nq, nk) mask, True where query i may attend to key j (bottom-right aligned);
    ``rows=(i0, i1)``: only query rows i0..i1 - 1."""
    left, right = window_bounds(causal, window_size)
    i0, i1 = rows if rows is not None else (0, nq)
    i = torch.arange(i0, i1, device=device).unsqueeze(1)
    j = torch.arange(nk, device=device).unsqueeze(0)
    diag = i + (nk - nq)  # the key aligned with query i when the ends of the sequences line up
    mask = torch.ones(i1 - i0, nk, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= j >= diag - left
    if right >= 0:
        mask &= j <= diag + right
    return mask


def default_softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def _compute_dtype(dtype: torch.dtype, upcast: bool) -> torch.dtype:
    if dtype == torch.float64:
        return torch.float64
    return torch.float32 if upcast else dtype


def _lse_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    # float32 as the kernels store it, except fp64 runs, which keep full precision for gradcheck.
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


def _expand_kv_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, N, Hkv, d) -> (B, N, H, d): q head h reads kv head h // (H // Hkv)."""
    hkv = x.shape[2]
    if num_heads % hkv != 0:
        raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({hkv})")
    return x if hkv == num_heads else x.repeat_interleave(num_heads // hkv, dim=2)


# ---------------------------------------------------------------------------------------------
# Dense reference
# ---------------------------------------------------------------------------------------------
# The dense reference works on blocks of query rows whose scores take at most this many bytes, so
# a long CPU problem (the ops' CPU path) does not materialise all B * H * Nq * Nk scores at once.
REF_BLOCK_BYTES = 256 * 1024 * 1024


def query_block_rows(batch: int, heads: int, nk: int, compute_dtype: torch.dtype) -> int:
    """Query rows per block of the dense reference (``REF_BLOCK_BYTES`` of scores)."""
    elem = torch.finfo(compute_dtype).bits // 8
    return max(1, REF_BLOCK_BYTES // max(1, batch * heads * max(nk, 1) * elem))


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
                     window_size: tuple[int, int], softcap: float, compute_dtype: torch.dtype,
                     sinks: torch.Tensor | None = None,
                     mods: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, Nq, H, d) attention; returns out (B, Nq, H, dv) in compute_dtype, lse (B, H, Nq)."""
    b, nq, h = q.shape[0], q.shape[1], q.shape[2]
    kc = _expand_kv_heads(k.to(compute_dtype), h)
    vc = _expand_kv_heads(v.to(compute_dtype), h)
    step = query_block_rows(b, h, k.shape[1], compute_dtype)
    kw = dict(scale=scale, causal=causal, window_size=window_size, softcap=softcap,
              compute_dtype=compute_dtype, sinks=sinks, mods=mods)
    if nq <= step:
        return _dense_block(q.to(compute_dtype), kc, vc, nq, (0, nq), **kw)
    blocks = [_dense_block(q[:, i:i + step].to(compute_dtype), kc, vc, nq, (i, min(i + step, nq)), **kw)
              for i in range(0, nq, step)]
    return torch.cat([o for o, _ in blocks], dim=1), torch.cat([lse for _, lse in blocks], dim=2)


def _dense_block(qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, nq: int, rows: tuple[int, int], *,
                 scale: float, causal: bool, window_size: tuple[int, int], softcap: float,
                 compute_dtype: torch.dtype, sinks: torch.Tensor | None = None,
                 mods: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows ``rows`` of an Nq-row problem (qc holds just those rows, kc / vc every key);
    ``sinks`` (H,): a logit per head that joins every row's softmax and adds no value; ``mods``:
    (score_mod, mask_mod, aux, first batch index) in torch form (``attention_ref``)."""
    nk = kc.shape[1]
    s = torch.einsum("bqhd,bkhd->bhqk", qc, kc) * scale
    if softcap > 0.0:
        s = softcap * torch.tanh(s / softcap)
    mask = visible_mask(nq, nk, causal=causal, window_size=window_size, device=qc.device, rows=rows)
    if mods is not None:
        score_mod, mask_mod, aux, b0 = mods
        dev = qc.device
        idx = (torch.arange(b0, b0 + s.shape[0], device=dev).view(-1, 1, 1, 1),
               torch.arange(s.shape[1], device=dev).view(1, -1, 1, 1),
               torch.arange(rows[0], rows[1], device=dev).view(1, 1, -1, 1),
               torch.arange(nk, device=dev).view(1, 1, 1, -1))
        if score_mod is not None:
            s = score_mod(s, *idx, aux).to(s.dtype)  # (fp32 aux tensors would promote bf16 math)
        if mask_mod is not None:
            mask = mask & mask_mod(*idx, aux)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        col = sinks.to(compute_dtype).view(1, -1, 1, 1).expand(*s.shape[:3], 1)
        lse = torch.logsumexp(torch.cat([s, col], dim=-1), dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))  # (masked keys: exp(-inf) = 0)
        out = torch.einsum("bhqk,bkhd->bqhd", p, vc)
        return out, lse.to(_lse_dtype(compute_dtype))
    lse = torch.logsumexp(s, dim=-1)  # -inf on rows that see no key
    # softmax of an all -inf row is NaN; give such rows zeros instead (and a zero gradient).
    empty_row = ~mask.any(dim=-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty_row, 0.0), dim=-1).masked_fill(empty_row, 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vc)
    return out, lse.to(_lse_dtype(compute_dtype))


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float | None = None,
                  causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                  cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                  upcast: bool = True, sinks: torch.Tensor | None = None, score_mod=None, mask_mod=None,
                  aux: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention; differentiable with torch autograd (``sinks`` included).

    q (B, Nq, H, d), k (B, Nk, Hkv, d), v (B, Nk, Hkv, dv); or packed q (Tq, H, d),
    k (Tk, Hkv, d), v (Tk, Hkv, dv) with ``cu_seqlens_q``/``cu_seqlens_k`` (B+1,).

    Math runs in fp32 (fp64 for fp64 inputs); ``upcast=False`` runs it in the input dtype, which is
    the "same-dtype PyTorch implementation" a kernel's error is compared with. ``out`` is returned
    in that compute dtype (cast it yourself), ``lse`` as float32 (float64 for fp64 inputs),
    shaped (B, H, Nq) or (H, Tq). ``sinks`` (H,): learnable sink logits, one per query head, that
    join each row's softmax denominator and contribute no value (the LSE includes them).
    ``score_mod(score, b, h, q_idx, kv_idx, aux)`` / ``mask_mod(b, h, q_idx, kv_idx, aux)``: the torch
    form of a kernel's mods (FlexAttention's: broadcast index tensors, (B, H, Nq, Nk) scores),
    applied to the scaled scores before the masks.
    """
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    cdt = _compute_dtype(q.dtype, upcast)
    kw = dict(scale=scale, causal=causal, window_size=window_size, softcap=float(softcap), compute_dtype=cdt,
              sinks=sinks)
    has_mods = score_mod is not None or mask_mod is not None
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return _dense_attention(q, k, v, **kw, mods=(score_mod, mask_mod, aux, 0) if has_mods else None)
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("varlen needs both cu_seqlens_q and cu_seqlens_k")
    # One dense problem per sequence: slow but obviously right, which is what a reference is for.
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(bq) - 1):
        qb = q[bq[b]:bq[b + 1]].unsqueeze(0)
        kb, vb = k[bk[b]:bk[b + 1]].unsqueeze(0), v[bk[b]:bk[b + 1]].unsqueeze(0)
        ob, lb = _dense_attention(qb, kb, vb, **kw, mods=(score_mod, mask_mod, aux, b) if has_mods else None)
        outs.append(ob[0])
        lses.append(lb[0])
    if not outs:  # zero sequences
        h, dv = q.shape[1], v.shape[-1]
        return q.new_zeros((0, h, dv), dtype=cdt), q.new_zeros((h, 0), dtype=_lse_dtype(cdt))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


# ---------------------------------------------------------------------------------------------
# Tiled FA2 references
# ---------------------------------------------------------------------------------------------
def _to_bhnd(x: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    return _expand_kv_heads(x.to(dtype), num_heads).transpose(1, 2)


def _scores(q_tile: torch.Tensor, k_tile: torch.Tensor, scale: float,
            softcap: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Final (scaled, capped) scores of one tile, and tanh of the capped argument (for the
    backward's chain rule) when softcap is on."""
    s = q_tile @ k_tile.transpose(-1, -2)
    if softcap > 0.0:
        t = torch.tanh(s * (scale / softcap))
        return softcap * t, t
    return s * scale, None


def _n_block_range(m0: int, m1: int, nq: int, nk: int, left: int, right: int, block_n: int) -> range:
    """Key tiles a query tile [m0, m1) has to visit; tiles outside are skipped entirely, which is
    where causal/local attention saves its work."""
    lo = 0 if left < 0 else max(0, m0 + nk - nq - left)
    hi = nk if right < 0 else min(nk, m1 - 1 + nk - nq + right + 1)
    if hi <= lo:
        return range(0)
    return range(lo // block_n, (hi + block_n - 1) // block_n)


def _m_block_range(n0: int, n1: int, nq: int, nk: int, left: int, right: int, block_m: int) -> range:
    """Query tiles that see any key of the key tile [n0, n1) (the backward's loop bounds)."""
    lo = 0 if right < 0 else max(0, n0 - (nk - nq) - right)
    hi = nq if left < 0 else min(nq, n1 - 1 - (nk - nq) + left + 1)
    if hi <= lo:
        return range(0)
    return range(lo // block_m, (hi + block_m - 1) // block_m)


def flash_fwd_tiled_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                        softmax_scale: float | None = None, causal: bool = False,
                        window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, block_m: int = 64,
                        block_n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """FA2 forward, one (block_m x block_n) tile at a time, on (B, N, H, d) inputs.

    Returns out (B, Nq, H, dv) and lse (B, H, Nq) in fp32 (fp64 for fp64 inputs). Per query tile
    it keeps the running row max ``m`` (in log2 units), the running row sum ``l`` and an
    unnormalised accumulator; the division by ``l`` is deferred to the end.
    """
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    left, right = window_bounds(causal, window_size)
    cdt = _compute_dtype(q.dtype, True)
    b, nq, h, _ = q.shape
    nk, dv = k.shape[1], v.shape[-1]
    qt, kt, vt = _to_bhnd(q, h, cdt), _to_bhnd(k, h, cdt), _to_bhnd(v, h, cdt)
    mask = visible_mask(nq, nk, causal=causal, window_size=window_size, device=q.device)
    out = torch.zeros(b, h, nq, dv, dtype=cdt, device=q.device)
    lse = torch.full((b, h, nq), float("-inf"), dtype=cdt, device=q.device)

    for m0 in range(0, nq, block_m):
        m1 = min(m0 + block_m, nq)
        q_tile = qt[:, :, m0:m1]
        row_max = torch.full((b, h, m1 - m0), float("-inf"), dtype=cdt, device=q.device)  # log2 units
        row_sum = torch.zeros(b, h, m1 - m0, dtype=cdt, device=q.device)
        acc = torch.zeros(b, h, m1 - m0, dv, dtype=cdt, device=q.device)
        for nb in _n_block_range(m0, m1, nq, nk, left, right, block_n):
            n0, n1 = nb * block_n, min((nb + 1) * block_n, nk)
            qk = q_tile @ kt[:, :, n0:n1].transpose(-1, -2)
            # exp2 is the cheap instruction, so the kernel works in log2 units: log2(e) is folded
            # into the constant that already multiplies the scores.
            if softcap > 0.0:
                s = torch.tanh(qk * (scale / softcap)) * (softcap * LOG2E)
            else:
                s = qk * (scale * LOG2E)
            s = s.masked_fill(~mask[m0:m1, n0:n1], float("-inf"))
            new_max = torch.maximum(row_max, s.amax(dim=-1))
            # A row with no visible key so far has max -inf; subtracting 0 instead keeps
            # exp2(-inf - (-inf)) = NaN out of both the rescale factor and P.
            safe_max = torch.where(new_max == float("-inf"), torch.zeros_like(new_max), new_max)
            rescale = torch.exp2(row_max - safe_max)
            p = torch.exp2(s - safe_max.unsqueeze(-1))
            row_sum = row_sum * rescale + p.sum(dim=-1)
            acc = acc * rescale.unsqueeze(-1) + p @ vt[:, :, n0:n1]
            row_max = new_max
        # Deferred normalisation: one division per row instead of one per tile.
        seen = row_sum > 0
        out[:, :, m0:m1] = torch.where(seen.unsqueeze(-1), acc / row_sum.clamp_min(1e-30).unsqueeze(-1), 0.0)
        lse_tile = row_max / LOG2E + torch.log(row_sum.clamp_min(1e-30))
        lse[:, :, m0:m1] = torch.where(seen, lse_tile, float("-inf"))
    return out.transpose(1, 2), lse.to(_lse_dtype(cdt))


def _sum_kv_group(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, N, d) per-q-head gradients -> (B, N, Hkv, d), summing each GQA group."""
    b, h, n, d = x.shape
    return x.reshape(b, hkv, h // hkv, n, d).sum(dim=2).transpose(1, 2)


def flash_bwd_tiled_ref(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        out: torch.Tensor, lse: torch.Tensor, *, softmax_scale: float | None = None,
                        causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                        block_m: int = 64, block_n: int = 64, dlse: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FA2 backward on (B, N, H, d) inputs, from the forward's ``out`` and ``lse`` (and ``dlse``,
    the gradient of the LSE output, (B, H, N), if it has one).

    Outer loop over key tiles (each owns its dK/dV accumulators, as a kernel CTA does), inner
    loop over query tiles; P is recomputed from the LSE instead of being stored. Returns dq, dk,
    dv in fp32 (fp64 for fp64 inputs), dk/dv with kv-head shapes (summed over each GQA group).
    """
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    left, right = window_bounds(causal, window_size)
    cdt = _compute_dtype(q.dtype, True)
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    qt, kt, vt = _to_bhnd(q, h, cdt), _to_bhnd(k, h, cdt), _to_bhnd(v, h, cdt)
    dot, ot = dout.to(cdt).transpose(1, 2), out.to(cdt).transpose(1, 2)
    mask = visible_mask(nq, nk, causal=causal, window_size=window_size, device=q.device)
    # D_i = rowsum(dO * O) = sum_j P_ij dP_ij: the softmax Jacobian's correction term, computed
    # once per row up front (the kernels' preprocessing pass).
    delta = (dot * ot).sum(dim=-1)
    if dlse is not None:
        # d lse_i / d s_ij = P_ij: the LSE's gradient adds P_ij dlse_i to dS_ij = P_ij (dP_ij - D_i).
        delta = delta - dlse.to(cdt)
    # Rows that saw no key have lse -inf; +inf makes exp(S - lse) = 0 there instead of NaN.
    lse_safe = torch.where(lse == float("-inf"), float("inf"), lse.to(cdt))
    dq = torch.zeros_like(qt)
    dk = torch.zeros_like(kt)
    dv = torch.zeros(b, h, nk, vt.shape[-1], dtype=cdt, device=q.device)

    for n0 in range(0, nk, block_n):
        n1 = min(n0 + block_n, nk)
        k_tile, v_tile = kt[:, :, n0:n1], vt[:, :, n0:n1]
        for mb in _m_block_range(n0, n1, nq, nk, left, right, block_m):
            m0, m1 = mb * block_m, min((mb + 1) * block_m, nq)
            s, t = _scores(qt[:, :, m0:m1], k_tile, scale, softcap)
            p = torch.exp(s - lse_safe[:, :, m0:m1].unsqueeze(-1))
            p = p.masked_fill(~mask[m0:m1, n0:n1], 0.0)
            do_tile = dot[:, :, m0:m1]
            dv[:, :, n0:n1] += p.transpose(-1, -2) @ do_tile
            dp = do_tile @ v_tile.transpose(-1, -2)
            ds = p * (dp - delta[:, :, m0:m1].unsqueeze(-1))
            if t is not None:
                # d/dx [c * tanh(x / c)] = 1 - tanh^2: the softcap's chain-rule factor.
                ds = ds * (1.0 - t * t)
            dq[:, :, m0:m1] += scale * (ds @ k_tile)
            dk[:, :, n0:n1] += scale * (ds.transpose(-1, -2) @ qt[:, :, m0:m1])
    return dq.transpose(1, 2), _sum_kv_group(dk, hkv), _sum_kv_group(dv, hkv)


def attention_bwd_ref(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor, *, softmax_scale: float | None = None,
                      causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                      cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                      dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense backward from ``out`` and ``lse`` (the FA2 identities on a single tile), also for
    packed varlen inputs; dq, dk, dv in fp32 (fp64 for fp64 inputs). ``dlse``: the LSE output's
    gradient (lse's shape) or None.

    This, not torch autograd, is what the CPU implementation of the backward op runs: inside a
    custom op's implementation autograd is switched off, and like the kernels it should consume
    the saved ``out``/``lse`` rather than recompute them.
    """
    kw = dict(softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap)
    if cu_seqlens_q is None:
        rows = query_block_rows(q.shape[0], q.shape[2], k.shape[1], _compute_dtype(q.dtype, True))
        return flash_bwd_tiled_ref(dout, q, k, v, out, lse, block_m=max(min(q.shape[1], rows), 1),
                                   block_n=max(k.shape[1], 1), dlse=dlse, **kw)
    cdt = _compute_dtype(q.dtype, True)
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bq) - 1):
        sq, sk = slice(bq[b], bq[b + 1]), slice(bk[b], bk[b + 1])
        grads = attention_bwd_ref(dout[sq].unsqueeze(0), q[sq].unsqueeze(0), k[sk].unsqueeze(0),
                                  v[sk].unsqueeze(0), out[sq].unsqueeze(0), lse[:, sq].unsqueeze(0),
                                  dlse=None if dlse is None else dlse[:, sq].unsqueeze(0), **kw)
        dq[sq], dk[sk], dv[sk] = (g[0] for g in grads)
    return dq, dk, dv
