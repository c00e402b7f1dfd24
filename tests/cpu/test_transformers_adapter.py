"""``cute_flash.integrations.transformers``: the adapter maps transformers' attention call onto
ours (heads, masks, window, softcap, padding, packing) and refuses what it cannot run; small
randomly initialised models give the logits and gradients of transformers' own attention. On the
CPU the ops run their reference path: what is checked here is the adapter, not the kernels."""

from __future__ import annotations

import pytest
import torch

from cute_flash.api import flash_attn_func, flash_attn_varlen_func
from cute_flash.integrations import transformers as adapter

from attention_checks import small_decoder

BF16 = torch.bfloat16


class _Attn(torch.nn.Module):
    def __init__(self, is_causal: bool = True, dtype: torch.dtype = BF16) -> None:
        super().__init__()
        self.is_causal = is_causal
        self.proj = torch.nn.Linear(4, 4, dtype=dtype)


def _qkv(b: int = 2, h: int = 4, hkv: int = 2, nq: int = 12, nk: int = 12, d: int = 64,
         dtype: torch.dtype = BF16) -> tuple:
    # transformers' layout: (B, H, N, d)
    return (torch.randn(b, h, nq, d, dtype=dtype), torch.randn(b, hkv, nk, d, dtype=dtype),
            torch.randn(b, hkv, nk, d, dtype=dtype))


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list:
    seen: list = []

    def dense(q, k, v, **flags):
        seen.append(("dense", q, k, v, flags))
        return flash_attn_func(q, k, v, **flags)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **flags):
        seen.append(("varlen", q, k, v, flags, cu_q, cu_k, max_q, max_k))
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **flags)

    monkeypatch.setattr(adapter, "flash_attn_func", dense)
    monkeypatch.setattr(adapter, "flash_attn_varlen_func", varlen)
    return seen


def test_heads_scale_causal_softcap_and_the_window_map_onto_ours(calls, seed) -> None:
    q, k, v = _qkv(nq=12, nk=12)
    flags = dict(scaling=0.3, sliding_window=5, softcap=30.0)
    out, weights = adapter.attention_forward(_Attn(), q, k, v, None, **flags)
    assert weights is None and out.shape == (2, 12, 4, 64)
    kind, _, kk, _, passed = calls[-1]
    assert kind == "dense" and kk.shape == (2, 12, 2, 64), "K / V go in with their own heads"
    assert passed == dict(softmax_scale=0.3, causal=True, window_size=(4, 4), softcap=30.0,
                         deterministic=False)
    adapter.attention_forward(_Attn(is_causal=False), q, k, v, None, sliding_window=12)
    assert calls[-1][4]["window_size"] == (-1, -1) and calls[-1][4]["causal"] is False
    assert calls[-1][4]["softcap"] == 0.0 and calls[-1][4]["softmax_scale"] is None
    adapter.attention_forward(_Attn(is_causal=False), q, k, v, None, is_causal=True)
    assert calls[-1][4]["causal"] is True
    torch.use_deterministic_algorithms(True)
    try:
        adapter.attention_forward(_Attn(), q, k, v, None)
    finally:
        torch.use_deterministic_algorithms(False)
    assert calls[-1][4]["deterministic"] is True
    adapter.attention_forward(_Attn(), q, k, v, None, deterministic=True)
    assert calls[-1][4]["deterministic"] is True
    want = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                           window_size=(4, 4), softcap=30.0, softmax_scale=0.3)
    torch.testing.assert_close(adapter.attention_forward(_Attn(), q, k, v, None, **flags)[0], want)


@pytest.mark.parametrize("bad, error, match", [
    (dict(dropout=0.1), ValueError, "dropout"),
    (dict(s_aux=torch.zeros(4)), ValueError, "sinks"),
    (dict(output_attentions=True), ValueError, "attention weights"),
    (dict(attention_mask=torch.ones(2, 1, 12, 12, dtype=torch.bool)), ValueError, "2D"),
])
def test_what_the_kernels_cannot_run_is_refused_before_any_launch(calls, bad, error, match) -> None:
    q, k, v = _qkv()
    mask = bad.pop("attention_mask", None)
    with pytest.raises(error, match=match):
        adapter.attention_forward(_Attn(), q, k, v, mask, **bad)
    assert not calls


def test_fp32_activations_run_at_the_weights_dtype_and_come_back_in_fp32(calls) -> None:
    q, k, v = _qkv(dtype=torch.float32)
    out, _ = adapter.attention_forward(_Attn(dtype=BF16), q, k, v, None)
    assert calls[-1][1].dtype == BF16 and out.dtype == torch.float32
    with pytest.raises(TypeError, match="bf16"):
        adapter.attention_forward(_Attn(dtype=torch.float32), q, k, v, None)


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_attends_each_row_over_its_real_tokens(calls, seed, side) -> None:
    b, n = 3, 20
    q, k, v = _qkv(b=b, nq=n, nk=n)
    lens = [20, 7, 13]
    mask = torch.zeros(b, n, dtype=torch.bool)
    for i, m in enumerate(lens):
        if side == "left":
            mask[i, n - m:] = True
        else:
            mask[i, :m] = True
    out, _ = adapter.attention_forward(_Attn(), q, k, v, adapter.padding_mask(b, n, n, attention_mask=mask))
    assert calls[-1][0] == "varlen" and calls[-1][7] == 20
    for i in range(b):
        rows = mask[i].nonzero().flatten()
        want = flash_attn_func(*(t[i:i + 1, :, rows].transpose(1, 2) for t in (q, k, v)), causal=True)[0]
        torch.testing.assert_close(out[i, rows], want)
        assert not out[i, ~mask[i]].any(), "padded query rows are zero"
    assert adapter.padding_mask(b, n, n, attention_mask=torch.ones(b, n, dtype=torch.bool)) is None


def test_decoding_over_a_left_padded_cache_uses_the_last_query_rows(calls, seed) -> None:
    q, k, v = _qkv(b=2, nq=1, nk=9)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, :4] = False
    out, _ = adapter.attention_forward(_Attn(), q, k, v, mask)
    want = flash_attn_func(q[1:].transpose(1, 2), k[1:, :, 4:].transpose(1, 2), v[1:, :, 4:].transpose(1, 2),
                           causal=True)
    torch.testing.assert_close(out[1:], want)


def test_a_static_cache_longer_than_the_mask_attends_only_its_filled_slots(calls, seed) -> None:
    q, k, v = _qkv(b=2, nq=1, nk=20)  # 20 slots, 12 filled
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, :5] = False
    out, _ = adapter.attention_forward(_Attn(), q, k, v, mask)
    for i, first in ((0, 0), (1, 5)):
        filled = (q, k[:, :, first:12], v[:, :, first:12])
        want = flash_attn_func(*(t[i:i + 1].transpose(1, 2) for t in filled), causal=True)
        torch.testing.assert_close(out[i:i + 1], want)


def test_sequences_packed_in_one_row_attend_within_their_document(calls, seed) -> None:
    q, k, v = _qkv(b=1, nq=15, nk=15)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]])
    out, _ = adapter.attention_forward(_Attn(), q, k, v, None, position_ids=pos)
    assert calls[-1][0] == "varlen" and calls[-1][5].tolist() == [0, 4, 11, 15]
    for a, e in ((0, 4), (4, 11), (11, 15)):
        want = flash_attn_func(*(t[:, :, a:e].transpose(1, 2) for t in (q, k, v)), causal=True)
        torch.testing.assert_close(out[:, a:e], want)
    cu = torch.tensor([0, 4, 11, 15])
    again, _ = adapter.attention_forward(_Attn(), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                         max_length_q=7, max_length_k=7)
    torch.testing.assert_close(again, out)
    adapter.attention_forward(_Attn(), q, k, v, None, position_ids=torch.arange(15)[None])
    assert calls[-1][0] == "dense", "one increasing sequence is not a pack"


# ---------------------------------------------------------------------------------------------
# Whole models (transformers installed: the dev extra has it)
# ---------------------------------------------------------------------------------------------
def _model(family: str):
    return small_decoder(family, hidden=128, heads=4, kv_heads=2, window=16, vocab=96)


def _run(model, impl: str, ids, mask):
    model.set_attn_implementation(impl)
    model.zero_grad()
    logits = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    logits[real].float().square().mean().backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return logits.detach().float()[real], grads


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_a_small_model_matches_transformers_attention(family: str, padded: bool) -> None:
    torch.manual_seed(0)
    model = _model(family)
    ids = torch.randint(0, 96, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    if padded:
        mask[1, :11] = 0
    # Gemma 2's softcap is the eager path's only; the reference is the same model in fp32.
    peer = "eager" if family == "gemma2" else "sdpa"
    ref = _run(model.float(), "eager", ids, mask)
    model = model.to(BF16)
    theirs = _run(model, peer, ids, mask)
    ours = _run(model, "cute_flash", ids, mask)
    for o, t, r in zip(ours, theirs, ref, strict=True):
        err, peer_err = (o - r).abs().max().item(), (t - r).abs().max().item()
        assert err <= 2 * peer_err + 1e-2 * r.abs().max().item(), (err, peer_err)
