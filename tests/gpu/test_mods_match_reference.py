"""score_mod / mask_mod compiled into the forwards, on the GPU: each built-in and a user-written
mod of each kind, through the launcher, against ``attention_ref`` with the mods' torch forms under
the 2x rule (the same math in bf16 bounds the error), for both forward families, dense and packed,
GQA, lengths that are not tile multiples; outputs poisoned with NaN first."""

from __future__ import annotations

import math

import cutlass
import pytest
import torch

from cute_flash import launch
from cute_flash.device import mods as m
from cute_flash.reference import attention_ref

from attention_checks import FLOOR_FWD, assert_rule, cu_seqlens

pytestmark = [pytest.mark.gpu]

B, N, H, HKV, D = 2, 333, 8, 2, 128


def _user_score(score, b, h, q_idx, kv_idx, aux):
    # A per-head temperature and a distance penalty, written by hand.
    return score * aux[0][h] - cutlass.Float32(0.01) * (q_idx - kv_idx).to(cutlass.Float32)


def _user_score_torch(score, b, h, q_idx, kv_idx, aux):
    return score * aux[0][h] - 0.01 * (q_idx - kv_idx)


def _user_mask(b, h, q_idx, kv_idx, aux):
    # Causal, skipping every third key back.
    return (kv_idx <= q_idx) & ((q_idx - kv_idx) % 3 != 1)


def _user_mask_torch(b, h, q_idx, kv_idx, aux):
    return (kv_idx <= q_idx) & ((q_idx - kv_idx) % 3 != 1)


def _aux(name: str, n: int):
    dev = "cuda"
    if name == "alibi":
        return (torch.rand(H, device=dev) * 0.2,)
    if name == "relative_bias":
        return (torch.randn(H, 2 * 64 + 1, device=dev),)
    if name == "document":
        ids = torch.cumsum(torch.rand(B, n, device=dev) < 0.02, dim=1).to(torch.int32)
        return (ids,)
    if name == "prefix_lm":
        return (torch.tensor([0, 100][:B], dtype=torch.int32, device=dev),)
    if name == "user_score":
        return (torch.rand(H, device=dev) + 0.5,)
    return ()


MODS = {
    "alibi": (lambda: m.alibi(), True, (("fp32", 1),)),
    "relative_bias": (lambda: m.relative_bias(64), True, (("fp32", 2),)),
    "softcap": (lambda: m.softcap(5.0), True, ()),
    "document": (lambda: m.document(), False, (("int32", 2),)),
    "prefix_lm": (lambda: m.prefix_lm(), False, (("int32", 1),)),
    "sliding_window": (lambda: m.sliding_window(100), False, ()),
    "causal": (lambda: m.causal(), False, ()),
    "user_score": (lambda: (_user_score, _user_score_torch), True, (("fp32", 1),)),
    "user_mask": (lambda: (_user_mask, _user_mask_torch), False, ()),
}


def _run(name: str, family: str, varlen: bool, seed: int) -> None:
    make, is_score, aux_types = MODS[name]
    dsl_fn, torch_fn = make()
    mods = m.Mods(score_mod=dsl_fn, aux=aux_types) if is_score else m.Mods(mask_mod=dsl_fn, aux=aux_types)
    aux = _aux(name, N)
    q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16)
    scale = 1.0 / math.sqrt(D)
    ref_kw = dict(softmax_scale=scale, aux=aux)
    ref_kw["score_mod" if is_score else "mask_mod"] = torch_fn
    cu = None
    if varlen:  # the same two sequences, packed (positions restart per sequence)
        q, k, v = (t.reshape(B * N, *t.shape[2:]) for t in (q, k, v))
        cu = cu_seqlens([N] * B)
        ref_kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((H, B * N) if varlen else (B, H, N), float("nan"), device="cuda")
    launch.run_fwd(q, k, v, out, lse, softmax_scale=scale, cu_seqlens_q=cu, cu_seqlens_k=cu,
                   max_seqlen_q=N if varlen else None, family=family, mods=mods, aux=aux)
    torch.cuda.synchronize()
    r_out, r_lse = attention_ref(q, k, v, **ref_kw)
    s_out, s_lse = attention_ref(q, k, v, upcast=False, **ref_kw)
    case = (name, family, varlen)
    assert_rule("out", out, r_out, s_out, FLOOR_FWD, seed, case)
    assert_rule("lse", lse, r_lse, s_lse.float(), FLOOR_FWD * 10, seed, case)


@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("name", list(MODS))
def test_mods_match_the_reference(name: str, family: str, seed: int) -> None:
    if family == "sm90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 forward needs a Hopper GPU")
    _run(name, family, False, seed)


@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("name", ["alibi", "document"])
def test_mods_on_packed_sequences(name: str, family: str, seed: int) -> None:
    if family == "sm90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 forward needs a Hopper GPU")
    _run(name, family, True, seed)


@torch.no_grad()
def test_the_public_function_takes_builtin_pairs(seed: int) -> None:
    import cute_flash

    q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16)
    slopes = torch.rand(H, device="cuda") * 0.2
    out, lse = cute_flash.flash_attn_func(q, k, v, causal=True, score_mod=m.alibi(), aux=(slopes,),
                                          return_lse=True)
    kw = dict(causal=True, score_mod=m.alibi()[1], aux=(slopes,))
    r_out, r_lse = attention_ref(q, k, v, **kw)
    s_out, _ = attention_ref(q, k, v, upcast=False, **kw)
    assert_rule("out", out, r_out, s_out, FLOOR_FWD, seed, "public alibi")
