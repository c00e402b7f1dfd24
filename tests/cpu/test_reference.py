"""The PyTorch references: the dense one against first principles (SDPA, explicit masks and
formulas), the tiled FA2 recurrences against the dense one and torch autograd."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from cute_flash.reference import (
    _m_block_range,
    _n_block_range,
    attention_bwd_ref,
    attention_ref,
    flash_bwd_tiled_ref,
    flash_fwd_tiled_ref,
    visible_mask,
    window_bounds,
)

F64 = torch.float64


def rand_qkv(b, nq, nk, h, hkv, d, dv=None, dtype=F64, requires_grad=False):
    dv = d if dv is None else dv
    q = torch.randn(b, nq, h, d, dtype=dtype)
    k = torch.randn(b, nk, hkv, d, dtype=dtype)
    v = torch.randn(b, nk, hkv, dv, dtype=dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def probs_of(q, k, **kw):
    """The attention matrix P itself: with one-hot values (v = identity), out[i] = P[i, :]."""
    nk = k.shape[1]
    eye = torch.eye(nk, dtype=q.dtype).reshape(1, nk, 1, nk).expand(q.shape[0], nk, k.shape[2], nk)
    out, _ = attention_ref(q, k, eye, **kw)
    return out.transpose(1, 2)  # (B, H, Nq, Nk)


def test_dense_matches_sdpa_with_gqa_and_custom_scale(seed):
    q, k, v = rand_qkv(2, 19, 23, 6, 2, 16, dv=8)
    out, _ = attention_ref(q, k, v, softmax_scale=0.3)
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.3,
                                          enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, want)


def test_default_scale_is_one_over_sqrt_head_dim(seed):
    q, k, v = rand_qkv(1, 5, 7, 2, 2, 32)
    torch.testing.assert_close(attention_ref(q, k, v)[0],
                               attention_ref(q, k, v, softmax_scale=1 / math.sqrt(32))[0])


@pytest.mark.parametrize("nq,nk", [(3, 5), (5, 3), (4, 4)])
def test_causal_mask_is_bottom_right_aligned(seed, nq, nk):
    q, k, _ = rand_qkv(1, nq, nk, 1, 1, 8)
    p = probs_of(q, k, causal=True)[0, 0]
    for i in range(nq):
        for j in range(nk):
            assert (p[i, j] > 0) == (j <= i + nk - nq), (i, j)


@pytest.mark.parametrize("left,right", [(0, 0), (2, 1), (-1, 3), (4, -1), (1, 0), (0, 2)])
@pytest.mark.parametrize("nq,nk", [(6, 9), (9, 6)])
def test_window_mask_follows_the_documented_rule(seed, left, right, nq, nk):
    q, k, _ = rand_qkv(1, nq, nk, 1, 1, 8)
    p = probs_of(q, k, window_size=(left, right))[0, 0]
    for i in range(nq):
        for j in range(nk):
            ok = (left < 0 or j >= i + nk - nq - left) and (right < 0 or j <= i + nk - nq + right)
            assert (p[i, j] > 0) == ok, (i, j)


def test_causal_is_the_window_left_zero_and_forces_right_to_zero():
    assert window_bounds(True, (-1, -1)) == (-1, 0)
    assert window_bounds(True, (3, 7)) == (3, 0)
    assert window_bounds(False, (-5, 2)) == (-1, 2)
    for left in (-1, 0, 3):
        for right in (-1, 0, 5):
            assert torch.equal(visible_mask(7, 11, causal=True, window_size=(left, right)),
                               visible_mask(7, 11, window_size=(left, 0)))


def test_softcap_caps_the_scaled_scores_with_tanh(seed):
    q, k, v = rand_qkv(1, 7, 9, 2, 2, 16)
    q = q * 4  # large scores, so the cap matters
    scale, cap = 0.25, 2.0
    out, lse = attention_ref(q, k, v, softmax_scale=scale, softcap=cap)
    s = cap * torch.tanh(torch.einsum("bqhd,bkhd->bhqk", q, k) * scale / cap)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    torch.testing.assert_close(out, torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v))


def test_gqa_reads_kv_head_h_div_group(seed):
    q, k, v = rand_qkv(2, 5, 6, 8, 2, 16)
    out, lse = attention_ref(q, k, v, causal=True)
    out_rep, lse_rep = attention_ref(q, k.repeat_interleave(4, 2), v.repeat_interleave(4, 2), causal=True)
    torch.testing.assert_close(out, out_rep)
    torch.testing.assert_close(lse, lse_rep)


def test_lse_is_natural_log_sum_exp_shaped_b_h_nq(seed):
    q, k, v = rand_qkv(2, 5, 6, 3, 3, 16)
    _, lse = attention_ref(q, k, v, softmax_scale=0.5)
    assert lse.shape == (2, 3, 5)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.5
    torch.testing.assert_close(lse, s.exp().sum(-1).log())


def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_finite_grads(seed):
    # Nq > Nk causal: the first Nq - Nk queries see no key.
    q, k, v = rand_qkv(1, 6, 2, 2, 1, 8, requires_grad=True)
    out, lse = attention_ref(q, k, v, causal=True)
    assert torch.all(out[:, :4] == 0)
    assert torch.all(lse[:, :, :4] == float("-inf"))
    assert torch.isfinite(lse[:, :, 4:]).all()
    (out.sum() * 1.0).backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.all(q.grad[:, :4] == 0)


def test_value_head_dim_may_differ_from_qk_head_dim(seed):
    q, k, v = rand_qkv(1, 4, 5, 2, 2, 16, dv=40)
    out, _ = attention_ref(q, k, v)
    assert out.shape == (1, 4, 2, 40)


def test_varlen_equals_dense_per_sequence_including_empty_and_single_token(seed):
    lens_q, lens_k = [3, 0, 1, 5], [4, 2, 0, 7]
    h, hkv, d = 4, 2, 16
    q = torch.randn(sum(lens_q), h, d, dtype=F64)
    k = torch.randn(sum(lens_k), hkv, d, dtype=F64)
    v = torch.randn(sum(lens_k), hkv, d, dtype=F64)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    out, lse = attention_ref(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert out.shape == (sum(lens_q), h, d) and lse.shape == (h, sum(lens_q))
    for b in range(len(lens_q)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, lb = attention_ref(q[sq][None], k[sk][None], v[sk][None], causal=True)
        torch.testing.assert_close(out[sq], o[0])
        torch.testing.assert_close(lse[:, sq], lb[0])
    # the third sequence has one query and no key
    assert torch.all(out[3] == 0) and torch.all(lse[:, 3] == float("-inf"))


def test_upcast_false_computes_in_the_input_dtype(seed):
    q, k, v = rand_qkv(1, 33, 40, 2, 2, 32, dtype=torch.bfloat16)
    out_lo, lse_lo = attention_ref(q, k, v, upcast=False)
    out_hi, lse_hi = attention_ref(q, k, v)
    assert out_lo.dtype == torch.bfloat16 and out_hi.dtype == torch.float32
    assert lse_lo.dtype == lse_hi.dtype == torch.float32
    err = (out_lo.float() - out_hi).abs().max().item()
    assert 0 < err < 0.05  # bf16 rounding: present but small


def test_fp64_inputs_keep_fp64(seed):
    q, k, v = rand_qkv(1, 3, 4, 1, 1, 8)
    out, lse = attention_ref(q, k, v)
    assert out.dtype == lse.dtype == F64


# ---------------------------------------------------------------------------------------------
# Tiled FA2 references
# ---------------------------------------------------------------------------------------------
problems = st.fixed_dictionaries({
    "b": st.integers(1, 2),
    "nq": st.integers(1, 70),
    "nk": st.integers(0, 70),
    "heads": st.sampled_from([(1, 1), (4, 4), (4, 2), (4, 1)]),
    "d": st.sampled_from([8, 16]),
    "dv": st.sampled_from([8, 24]),
    "causal": st.booleans(),
    "window": st.tuples(st.integers(-1, 40), st.integers(-1, 40)),
    "softcap": st.sampled_from([0.0, 0.0, 3.0]),
    "block_m": st.sampled_from([16, 32, 64]),
    "block_n": st.sampled_from([16, 48, 64]),
    "seed": st.integers(0, 2**31 - 1),
})


def _make(p, requires_grad=False):
    torch.manual_seed(p["seed"])
    h, hkv = p["heads"]
    q, k, v = rand_qkv(p["b"], p["nq"], p["nk"], h, hkv, p["d"], p["dv"], requires_grad=requires_grad)
    kw = dict(causal=p["causal"], window_size=p["window"], softcap=p["softcap"])
    return q, k, v, kw


def assert_lse_close(a, b):
    assert torch.equal(torch.isneginf(a), torch.isneginf(b))
    fin = torch.isfinite(b)
    torch.testing.assert_close(a[fin], b[fin])


@settings(max_examples=40, deadline=None)
@given(p=problems)
def test_tiled_forward_matches_dense_reference(p):
    q, k, v, kw = _make(p)
    out, lse = flash_fwd_tiled_ref(q, k, v, block_m=p["block_m"], block_n=p["block_n"], **kw)
    want_out, want_lse = attention_ref(q, k, v, **kw)
    torch.testing.assert_close(out, want_out)
    assert_lse_close(lse, want_lse)


@settings(max_examples=40, deadline=None)
@given(p=problems)
@pytest.mark.parametrize("with_dlse", [False, True], ids=["out", "out+lse"])
def test_tiled_backward_matches_torch_autograd(p, with_dlse):
    """Also with a gradient on the LSE output, which the tiled backward folds into D = rowsum(dO*O)
    (as the kernels' preprocess does) instead of a second pass."""
    q, k, v, kw = _make(p, requires_grad=True)
    out, lse = attention_ref(q, k, v, **kw)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    loss = (out * dout).sum()
    if with_dlse:
        loss = loss + (torch.where(torch.isneginf(lse), 0.0, lse) * dlse).sum()
    want = torch.autograd.grad(loss, (q, k, v), allow_unused=True)
    got = flash_bwd_tiled_ref(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                              block_m=p["block_m"], block_n=p["block_n"], dlse=dlse, **kw)
    for g, w, t in zip(got, want, (q, k, v), strict=True):
        assert g.shape == t.shape
        torch.testing.assert_close(g, torch.zeros_like(t) if w is None else w)


def test_tiled_backward_sums_gqa_groups_into_kv_heads(seed):
    q, k, v = rand_qkv(1, 9, 11, 6, 2, 8)
    out, lse = attention_ref(q, k, v)
    dout = torch.randn_like(out)
    dq, dk, dv = flash_bwd_tiled_ref(dout, q, k, v, out, lse, block_m=4, block_n=4)
    _, dk_rep, dv_rep = flash_bwd_tiled_ref(dout, q, k.repeat_interleave(3, 2), v.repeat_interleave(3, 2),
                                            out, lse, block_m=4, block_n=4)
    assert dk.shape == k.shape
    torch.testing.assert_close(dk, dk_rep.reshape(1, 11, 2, 3, 8).sum(3))
    torch.testing.assert_close(dv, dv_rep.reshape(1, 11, 2, 3, 8).sum(3))


def test_dense_backward_reference_matches_autograd_for_varlen(seed):
    lens_q, lens_k = [2, 0, 5, 1], [3, 4, 5, 0]
    cu_q = torch.tensor([0, 2, 2, 7, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 3, 7, 12, 12], dtype=torch.int32)
    q = torch.randn(sum(lens_q), 4, 8, dtype=F64, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 8, dtype=F64, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 16, dtype=F64, requires_grad=True)
    kw = dict(causal=True, softcap=2.0, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = attention_ref(q, k, v, **kw)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    loss = (out * dout).sum() + (torch.where(torch.isneginf(lse), 0.0, lse) * dlse).sum()
    want = torch.autograd.grad(loss, (q, k, v))
    got = attention_bwd_ref(dout, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), dlse=dlse,
                            **kw)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@settings(max_examples=200, deadline=None)
@given(nq=st.integers(0, 300), nk=st.integers(0, 300), left=st.integers(-1, 200), right=st.integers(-1, 200),
       causal=st.booleans(), bm=st.sampled_from([16, 64, 128]), bn=st.sampled_from([16, 64, 128]))
def test_tile_loop_bounds_visit_exactly_the_tiles_with_a_visible_key(nq, nk, left, right, causal, bm, bn):
    mask = visible_mask(nq, nk, causal=causal, window_size=(left, right))
    lo, hi = window_bounds(causal, (left, right))
    for m0 in range(0, nq, bm):
        want = [nb for nb in range(math.ceil(nk / bn)) if mask[m0:m0 + bm, nb * bn:(nb + 1) * bn].any()]
        assert list(_n_block_range(m0, min(m0 + bm, nq), nq, nk, lo, hi, bn)) == want
    for n0 in range(0, nk, bn):
        want = [mb for mb in range(math.ceil(nq / bm)) if mask[mb * bm:(mb + 1) * bm, n0:n0 + bn].any()]
        assert list(_m_block_range(n0, min(n0 + bn, nk), nq, nk, lo, hi, bm)) == want
