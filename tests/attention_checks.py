"""The accuracy rule of the GPU tests and the helpers that apply it (imported by the modules of
``tests/gpu``).

    max|ours - ref| <= 2 * max|same_dtype - ref| + floor

where ``ref`` is ``attention_ref`` in fp32 and ``same_dtype`` is the same PyTorch code run in the
inputs' dtype (``upcast=False``): the kernels may be at most twice as wrong as the obvious PyTorch
implementation at the same precision, plus a rounding floor.
"""

from __future__ import annotations

import random

import pytest
import torch

import cute_flash
from cute_flash.reference import attention_ref


def is_hopper() -> bool:
    """A CUDA GPU of compute capability 9.x: what the sm90 and FP8 kernels run on."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


# For the modules of Hopper-only kernels (with ``pytest.mark.gpu``).
needs_hopper = pytest.mark.skipif(not is_hopper(), reason="needs an sm90 (Hopper) GPU")

FLOOR_FWD = 1e-5  # out, lse
FLOOR_BWD = 1e-4  # dq, dk, dv


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, layout: str) -> torch.Tensor:
    """Random normal tensor of logical shape (B, N, H, d) or (T, H, d), laid out as asked."""
    if layout == "bhnd" and len(shape) == 4:
        b, n, h, d = shape
        return torch.randn(b, h, n, d, dtype=dtype, device="cuda").transpose(1, 2)
    if layout == "padded":
        return torch.randn(*shape[:-1], shape[-1] + 8, dtype=dtype, device="cuda")[..., :shape[-1]]
    return torch.randn(*shape, dtype=dtype, device="cuda")


def leaves(tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def finite_lse(lse: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isneginf(lse), 0.0, lse.float())


def assert_rule(name: str, ours: torch.Tensor, ref: torch.Tensor, same: torch.Tensor, floor: float,
                seed: int, case: object) -> None:
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(ours).any(), f"{name}: NaN in ours [{case}] seed={seed}"
    e_ours, e_same = max_err(ours, ref), max_err(same, ref)
    assert e_ours <= 2 * e_same + floor, (f"{name}: max error {e_ours:.3e} > 2 x {e_same:.3e} (same-dtype "
                                          f"PyTorch) + {floor:g} [{case}] seed={seed}")


def assert_lse_rule(ours, ref, same, seed, case) -> None:
    same_rows = torch.equal(torch.isneginf(ours), torch.isneginf(ref))
    assert same_rows, f"lse: -inf rows differ [{case}] seed={seed}"
    assert_rule("lse", finite_lse(ours), finite_lse(ref), finite_lse(same), FLOOR_FWD, seed, case)


def fwd_bwd(fn, q, k, v, dout, **kw):
    """out, lse and (dq, dk, dv) of ``fn`` for the loss <out, dout>."""
    q, k, v = leaves((q, k, v))
    out, lse = fn(q, k, v, **kw)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), lse.detach(), grads


def ours_fn(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None, **kw):
    if cu_seqlens_q is None:
        return cute_flash.flash_attn_func(q, k, v, return_lse=True, **kw)
    return cute_flash.flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             return_lse=True, **kw)


def ref_fn(upcast: bool):
    """``attention_ref`` with the kernels' call signature (the launch-only arguments dropped)."""
    def fn(q, k, v, max_seqlen_q=None, max_seqlen_k=None, deterministic=False, **kw):
        return attention_ref(q, k, v, upcast=upcast, **kw)
    return fn


def check_against_rule(q, k, v, seed, case, **kw) -> None:
    """Forward and backward of ours vs the fp32 reference, bounded by the same-dtype PyTorch."""
    dout = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    out, lse, grads = fwd_bwd(ours_fn, q, k, v, dout, **kw)
    r_out, r_lse, r_grads = fwd_bwd(ref_fn(True), *(t.float() for t in (q, k, v)), dout.float(), **kw)
    s_out, s_lse, s_grads = fwd_bwd(ref_fn(False), q, k, v, dout, **kw)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_rule("out", out, r_out, s_out, FLOOR_FWD, seed, case)
    assert_lse_rule(lse, r_lse, s_lse, seed, case)
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, r_grads, s_grads, strict=True):
        assert g.dtype == q.dtype
        assert_rule(name, g, r, s, FLOOR_BWD, seed, case)


def cu_seqlens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def random_pack(rng: random.Random, *, max_seqs: int = 16, max_len: int = 4096, max_total: int = 20000,
                tile: int = 128) -> list[int]:
    """Lengths of a document pack: 1 .. ``max_seqs`` sequences, each empty (1 in 8), short
    (1 .. 64 tokens, 1 in 4) or drawn from 1 .. ``max_len``, in random order -- so the longest
    is often not last and grids sized by it reach past shorter sequences -- with at most
    ``max_total`` tokens and a total that is not a multiple of ``tile``."""
    lens: list[int] = []
    for _ in range(rng.randint(1, max_seqs)):
        kind = rng.random()
        n = 0 if kind < 0.125 else rng.randint(1, 64) if kind < 0.375 else rng.randint(1, max_len)
        if sum(lens) + n > max_total:
            break
        lens.append(n)
    if sum(lens) % tile == 0:
        lens.append(rng.randint(1, tile - 1))
    rng.shuffle(lens)
    return lens


def balanced_sample(axes: dict[str, tuple], n: int, rng: random.Random) -> list[dict]:
    """n rows over the axes: each axis' values repeated to length n and shuffled on their own, so
    every value appears ~n / len times in varied company (a fixed sample for a fixed ``rng``)."""
    columns = {}
    for name, values in axes.items():
        col = [values[i % len(values)] for i in range(n)]
        rng.shuffle(col)
        columns[name] = col
    return [{name: col[i] for name, col in columns.items()} for i in range(n)]


def small_decoder(family: str, hidden: int, heads: int, kv_heads: int, window: int, vocab: int):
    """A randomly initialised two-layer transformers decoder of ``family`` (llama, qwen2, mistral
    with a sliding window, gemma2 with softcap and a sliding window), no weights downloaded."""
    tf = pytest.importorskip("transformers")
    small = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 3 // 2, num_hidden_layers=2,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512)
    d = hidden // heads
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**small))
    if family == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**small))
    if family == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**small, sliding_window=window))
    return tf.Gemma2ForCausalLM(tf.Gemma2Config(**small, head_dim=d, sliding_window=window,
                                                attn_logit_softcapping=20.0, query_pre_attn_scalar=d))
