"""Learnable sinks on the GPU, through the public functions: out, LSE and the gradients of q, k,
v and the sinks against the fp32 reference (``attention_ref(sinks=...)``), under the 2x rule
(the same math in the inputs' dtype bounds the error), for both forward families, dense and
packed, GQA, causal and windows, lengths that are not tile multiples, and decoding shapes (the
sm90 plan packs a query group into one tile there)."""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash.dispatch import FWD_KERNEL_ENV
from cute_flash.reference import attention_ref

from attention_checks import FLOOR_BWD, FLOOR_FWD, assert_rule, cu_seqlens, needs_hopper

pytestmark = [pytest.mark.gpu]

CASES = [
    # (B, Nq, Nk, H, Hkv, d, causal, window)
    (2, 257, 389, 8, 2, 128, True, (-1, -1)),
    (2, 300, 300, 4, 4, 64, False, (-1, -1)),
    (1, 513, 1000, 8, 1, 128, False, (128, 0)),
    (4, 1, 777, 32, 8, 128, True, (-1, -1)),  # decoding: a packed query group per tile
    (2, 190, 250, 6, 2, 256, True, (-1, -1)),
]


def _run(fn, q, k, v, sinks, dout, dlse, **kw):
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = fn(*leaves, **kw)
    loss = (out.float() * dout.float()).sum() + (lse.float() * dlse).sum()
    return out.detach(), lse.detach(), torch.autograd.grad(loss, leaves)


def _ours(q, k, v, s, cu=None, max_len=None, **kw):
    if cu is None:
        return cute_flash.flash_attn_func(q, k, v, sinks=s, return_lse=True, **kw)
    return cute_flash.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, sinks=s, return_lse=True,
                                             **kw)


def _ref(upcast: bool):
    def fn(q, k, v, s, cu=None, max_len=None, **kw):
        if upcast:
            q, k, v = q.float(), k.float(), v.float()
        return attention_ref(q, k, v, sinks=s, cu_seqlens_q=cu, cu_seqlens_k=cu, upcast=upcast, **kw)
    return fn


def _check(q, k, v, seed, case, **kw) -> None:
    h = q.shape[-2]
    sinks = torch.randn(h, device="cuda") * 2 + 1
    dout = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device="cuda")
    lse_shape = (h, q.shape[0]) if "cu" in kw else (q.shape[0], h, q.shape[1])
    dlse = torch.randn(lse_shape, device="cuda")
    out, lse, grads = _run(_ours, q, k, v, sinks, dout, dlse, **kw)
    r_out, r_lse, r_grads = _run(_ref(True), q, k, v, sinks, dout, dlse, **kw)
    s_out, s_lse, s_grads = _run(_ref(False), q, k, v, sinks, dout, dlse, **kw)
    assert_rule("out", out, r_out, s_out, FLOOR_FWD, seed, case)
    assert_rule("lse", lse, r_lse, s_lse, FLOOR_FWD, seed, case)
    for name, g, r, s in zip(("dq", "dk", "dv", "dsinks"), grads, r_grads, s_grads, strict=True):
        assert_rule(name, g, r, s, FLOOR_BWD * (max(1.0, r.abs().max().item()) if name == "dsinks" else 1.0),
                    seed, case)


@pytest.mark.parametrize("family", ["auto", "sm80"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}x{c[2]}-h{c[3]}/{c[4]}-d{c[5]}" for c in CASES])
def test_sinks_match_the_reference_forward_and_backward(case, family, seed, monkeypatch) -> None:
    monkeypatch.setenv(FWD_KERNEL_ENV, family)
    b, nq, nk, h, hkv, d, causal, window = case
    q = torch.randn(b, nq, h, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16)
    _check(q, k, v, seed, (case, family), causal=causal, window_size=window)


@pytest.mark.parametrize("family", ["auto", "sm80"])
def test_sinks_on_packed_sequences(family, seed, monkeypatch) -> None:
    monkeypatch.setenv(FWD_KERNEL_ENV, family)
    lens = [1, 300, 77, 512]
    cu = cu_seqlens(lens)
    q = torch.randn(sum(lens), 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lens), 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lens), 2, 128, device="cuda", dtype=torch.bfloat16)
    _check(q, k, v, seed, (lens, family), cu=cu, max_len=max(lens), causal=True)


@needs_hopper
def test_rows_that_see_no_key_return_zero_and_the_sink(seed) -> None:
    q = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 100, 4, 64, device="cuda", dtype=torch.bfloat16)
    sinks = torch.randn(4, device="cuda")
    out, lse = cute_flash.flash_attn_func(q, k, k, causal=True, sinks=sinks, return_lse=True)
    assert torch.all(out[:, :200] == 0)
    torch.testing.assert_close(lse[:, :, :200], sinks.view(1, 4, 1).expand(2, 4, 200))


KV_CASES = [
    # (lengths, capacity, page size (0: contiguous), num_splits, forward family)
    ([3000], 4096, 0, 0, "auto"),  # split: the merge adds the sinks
    ([3000], 4096, 0, 1, "auto"),  # unsplit: the kernel does
    ([0, 1500, 4096], 4096, 64, 0, "auto"),
    ([777, 2048], 2048, 1, 0, "auto"),  # one key per page: the sm80 kernel
    ([3000, 5], 4096, 0, 0, "sm80"),
    ([3000, 5], 4096, 0, 1, "sm80"),
]


@pytest.mark.parametrize("case", KV_CASES, ids=[f"{c[0]}-page{c[2]}-splits{c[3]}-{c[4]}" for c in KV_CASES])
def test_sinks_over_a_kv_cache(case, seed, monkeypatch) -> None:
    from cute_flash.reference_kvcache import kvcache_attention_ref

    lens, capacity, page, splits, family = case
    monkeypatch.setenv(FWD_KERNEL_ENV, family)
    b, h, hkv, d = len(lens), 32, 8, 128
    bf = torch.bfloat16
    if page:
        per = capacity // page
        k_cache = torch.randn(b * per, page, hkv, d, device="cuda", dtype=bf)
        table = torch.randperm(b * per, device="cuda").reshape(b, per).to(torch.int32)
    else:
        k_cache, table = torch.randn(b, capacity, hkv, d, device="cuda", dtype=bf), None
    v_cache = torch.randn_like(k_cache)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=bf)
    sinks = torch.randn(h, device="cuda") * 2 + 2
    kw = dict(cache_seqlens=seqlens, page_table=table, causal=True)
    out, lse = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=splits, sinks=sinks,
                                                  return_lse=True, **kw)
    r_out, r_lse = kvcache_attention_ref(q, k_cache, v_cache, sinks=sinks, **kw)
    s_out, s_lse = kvcache_attention_ref(q, k_cache, v_cache, sinks=sinks, upcast=False, **kw)
    assert_rule("out", out, r_out, s_out, FLOOR_FWD, seed, case)
    assert_rule("lse", lse, r_lse, s_lse, FLOOR_FWD, seed, case)
