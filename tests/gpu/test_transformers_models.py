"""``attn_implementation="cute_flash"`` in small randomly initialised transformers models on the GPU
(no weights downloaded): logits and gradients, with and without padding, and a decode step over a
KV cache, against transformers' own attention under the accuracy rule (at most twice the error of
the peer in the same dtype, both against the same model in fp32 with eager attention)."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu
tf = pytest.importorskip("transformers")

import cute_flash.integrations.transformers  # noqa: E402,F401  (registers "cute_flash")

from attention_checks import small_decoder  # noqa: E402

BF16 = torch.bfloat16


def _model(family: str):
    # d = 64 heads, GQA 8 / 2; lengths below that are no tile multiple, windows shorter than them.
    return small_decoder(family, hidden=512, heads=8, kv_heads=2, window=96, vocab=256)


def _peer(family: str) -> str:
    return "eager" if family == "gemma2" else "sdpa"  # (Gemma 2's softcap: eager only)


def _step(model, impl: str, ids, mask):
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    logits[real].float().square().mean().backward()
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().float()[real], grads


def _within_rule(name: str, ours: torch.Tensor, peer: torch.Tensor, ref: torch.Tensor) -> None:
    assert not torch.isnan(ours).any(), f"{name}: NaN"
    err, peer_err = (ours - ref).abs().max().item(), (peer - ref).abs().max().item()
    floor = 1e-3 * ref.abs().max().item() + 1e-5
    assert err <= 2 * peer_err + floor, f"{name}: ours {err:.3g} vs peer {peer_err:.3g}"


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2"])
@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
def test_logits_and_gradients_match_transformers_attention(family: str, padded: bool) -> None:
    torch.manual_seed(0)
    model = _model(family).cuda()
    ids = torch.randint(0, 256, (3, 333), device="cuda")
    mask = torch.ones(3, 333, dtype=torch.long, device="cuda")
    if padded:
        mask[1, :101] = 0  # left padding
        mask[2, 250:] = 0  # right padding
    ref_logits, ref_grads = _step(copy.deepcopy(model).float(), "eager", ids, mask)
    model = model.to(BF16)
    peer_logits, peer_grads = _step(model, _peer(family), ids, mask)
    ours_logits, ours_grads = _step(model, "cute_flash", ids, mask)
    _within_rule("logits", ours_logits, peer_logits, ref_logits)
    for name, ref in ref_grads.items():
        _within_rule(name, ours_grads[name], peer_grads[name], ref)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_decode_step_over_a_left_padded_cache_matches(family: str) -> None:
    torch.manual_seed(0)
    model = _model(family).cuda().eval()
    ids = torch.randint(0, 256, (2, 150), device="cuda")
    mask = torch.ones(2, 151, dtype=torch.long, device="cuda")
    mask[1, :37] = 0
    nxt = torch.randint(0, 256, (2, 1), device="cuda")

    def decode(m, impl):
        m.set_attn_implementation(impl)
        with torch.no_grad():
            cache = m(input_ids=ids, attention_mask=mask[:, :150], use_cache=True).past_key_values
            return m(input_ids=nxt, attention_mask=mask, past_key_values=cache).logits.float()

    ref = decode(copy.deepcopy(model).float(), "eager")
    model = model.to(BF16)
    _within_rule("decode logits", decode(model, "cute_flash"), decode(model, _peer(family)), ref)


def test_training_mode_with_attention_dropout_is_refused() -> None:
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128,
                                               num_hidden_layers=1, num_attention_heads=2,
                                               attention_dropout=0.1)).cuda().to(BF16).train()
    model.set_attn_implementation("cute_flash")
    with pytest.raises(ValueError, match="dropout"):
        model(input_ids=torch.randint(0, 64, (1, 16), device="cuda"))
