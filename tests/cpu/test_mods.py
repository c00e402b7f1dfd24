"""score_mod / mask_mod on the CPU: the compile key follows a mod's code and captured values, the
built-ins' torch forms agree with the explicit masks and biases they stand for (through
``attention_ref``), and both forward families compile each built-in into the kernel with no
local memory. (On a GPU: ``tests/gpu/test_mods_match_reference.py``.)"""

from __future__ import annotations

import pytest
import torch

from cute_flash import jit
from cute_flash.ampere.config import FwdConfig
from cute_flash.device import mods as m
from cute_flash.hopper.fwd_config import FwdSm90Config
from cute_flash.reference import attention_ref, visible_mask


def test_the_compile_key_follows_code_and_captured_values() -> None:
    a1, a2, b1 = m.alibi(0)[0], m.alibi(1)[0], m.alibi(0)[0]
    assert m.callable_key(a1) == m.callable_key(b1) != m.callable_key(a2)
    assert m.Mods(score_mod=a1) == m.Mods(score_mod=b1)
    assert hash(m.Mods(score_mod=a1)) == hash(m.Mods(score_mod=b1))
    assert m.Mods(score_mod=a1) != m.Mods(score_mod=m.softcap(30.0)[0])
    assert m.Mods(score_mod=m.softcap(30.0)[0]) != m.Mods(score_mod=m.softcap(50.0)[0])
    assert m.Mods(mask_mod=m.causal()[0]) != m.Mods(mask_mod=m.causal()[0], aux=(("int32", 2),))
    with pytest.raises(ValueError):
        m.Mods()


def _qkv(b=2, n=37, h=4, d=16):
    return (torch.randn(b, n, h, d, dtype=torch.float64) for _ in range(3))


def test_builtin_masks_match_the_masks_they_stand_for(seed: int) -> None:
    q, k, v = _qkv()
    n = q.shape[1]
    # causal (top-left, Nq = Nk), window, prefix-LM, documents
    want, _ = attention_ref(q, k, v, causal=True)
    got, _ = attention_ref(q, k, v, mask_mod=m.causal()[1])
    torch.testing.assert_close(got, want)
    want, _ = attention_ref(q, k, v, causal=True, window_size=(5, 0))
    got, _ = attention_ref(q, k, v, mask_mod=m.sliding_window(5)[1])
    torch.testing.assert_close(got, want)
    prefix = torch.tensor([0, 9])
    got, _ = attention_ref(q, k, v, mask_mod=m.prefix_lm()[1], aux=(prefix,))
    for b in range(2):
        keep = visible_mask(n, n, causal=True, window_size=(-1, -1), device="cpu")
        keep[:, :int(prefix[b])] = True
        s = torch.einsum("qhd,khd->hqk", q[b], k[b]) / 4.0
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1)
        torch.testing.assert_close(got[b], torch.einsum("hqk,khd->qhd", p, v[b]))
    ids = torch.tensor([[0] * 10 + [1] * 27, [0] * 30 + [1] * 7])
    got, _ = attention_ref(q, k, v, mask_mod=m.document()[1], aux=(ids,))
    for b in range(2):
        cut = 10 if b == 0 else 30
        for lo, hi in ((0, cut), (cut, n)):
            want, _ = attention_ref(q[b:b + 1, lo:hi], k[b:b + 1, lo:hi], v[b:b + 1, lo:hi])
            torch.testing.assert_close(got[b:b + 1, lo:hi], want)


def test_builtin_scores_match_the_biases_they_stand_for(seed: int) -> None:
    q, k, v = _qkv()
    n = q.shape[1]
    slopes = torch.rand(4, dtype=torch.float64)
    rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    got, _ = attention_ref(q, k, v, score_mod=m.alibi()[1], aux=(slopes,))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / 4.0 + slopes.view(1, 4, 1, 1) * rel
    torch.testing.assert_close(got, torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v))
    table = torch.randn(4, 2 * 8 + 1, dtype=torch.float64)
    got, _ = attention_ref(q, k, v, score_mod=m.relative_bias(8)[1], aux=(table,))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / 4.0 + table[:, rel.clamp(-8, 8) + 8].unsqueeze(0)
    torch.testing.assert_close(got, torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v))
    got, _ = attention_ref(q, k, v, score_mod=m.softcap(3.0)[1])
    want, _ = attention_ref(q, k, v, softcap=3.0)
    torch.testing.assert_close(got, want)


BUILTINS = {
    "alibi": m.Mods(score_mod=m.alibi()[0], aux=(("fp32", 1),)),
    "relative_bias": m.Mods(score_mod=m.relative_bias(64)[0], aux=(("fp32", 2),)),
    "softcap": m.Mods(score_mod=m.softcap(30.0)[0]),
    "document": m.Mods(mask_mod=m.document()[0], aux=(("int32", 2),)),
    "prefix_lm": m.Mods(mask_mod=m.prefix_lm()[0], aux=(("int32", 1),)),
    "sliding_window": m.Mods(mask_mod=m.sliding_window(256)[0]),
}


@pytest.mark.parametrize("name,family", [
    pytest.param(name, family, id=f"{name}-{family}",
                 marks=() if (name, family) == ("alibi", "sm90") else pytest.mark.slow)
    for name in BUILTINS for family in ("sm90", "sm80")])
def test_each_builtin_compiles_into_both_forwards(name: str, family: str) -> None:
    mods = BUILTINS[name]
    if family == "sm90":
        cfg = FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, mods=mods)
    else:
        cfg = FwdConfig(target="sm_80", dtype="bf16", hdim=128, hdim_v=128, mods=mods)
    ptx, cubin = jit.compile_artifacts(cfg)
    from cute_flash.tools import inspect as ins

    assert "ld.local" not in ptx
    if ins.tools_dir() is not None:
        for fn, res in ins.cubin_sass_and_usage(cubin)[1].items():
            assert res.get("LOCAL", 0) == 0 and res.get("STACK", 0) == 0, (fn, res)


def test_the_public_functions_run_the_mods_torch_forms_on_cpu(seed: int) -> None:
    import cute_flash

    q, k, v = (t.to(torch.bfloat16) for t in _qkv(d=32))
    slopes = torch.rand(4)
    out = cute_flash.flash_attn_func(q, k, v, causal=True, score_mod=m.alibi(), aux=(slopes,))
    want, _ = attention_ref(q, k, v, causal=True, score_mod=m.alibi()[1], aux=(slopes,))
    torch.testing.assert_close(out, want.to(out.dtype))
    cu = torch.tensor([0, 20, 37], dtype=torch.int32)
    ids = torch.tensor([[0] * 10 + [1] * 27, [0] * 37])
    qp, kp, vp = (t[0] for t in (q, k, v))
    out = cute_flash.flash_attn_varlen_func(qp, kp, vp, cu, cu, 20, 20, mask_mod=m.document(), aux=(ids,))
    want, _ = attention_ref(qp, kp, vp, mask_mod=m.document()[1], aux=(ids,), cu_seqlens_q=cu,
                            cu_seqlens_k=cu)
    torch.testing.assert_close(out, want.to(out.dtype))


@pytest.mark.parametrize("kw,err,match", [
    (dict(softcap=5.0), ValueError, "softcap"),
    (dict(score_mod=m.alibi()[0]), ValueError, "torch function"),  # a DSL function alone on CPU
    (dict(aux=[torch.zeros(4, dtype=torch.float64)]), TypeError, "dtype"),
    (dict(aux=tuple(torch.zeros(4) for _ in range(5))), ValueError, "at most"),
    (dict(aux=("slopes",)), TypeError, "aux"),
    (dict(score_mod="alibi"), TypeError, "score_mod"),
    (dict(fp8=True), NotImplementedError, "FP8"),
])
def test_bad_mod_calls_raise_before_anything_runs(kw, err, match) -> None:
    import cute_flash

    q, k, v = (t.to(torch.bfloat16) for t in _qkv(d=64))
    args = dict(score_mod=m.alibi(), aux=(torch.rand(4),))
    args.update(kw)
    with pytest.raises(err, match=match):
        cute_flash.flash_attn_func(q, k, v, **args)


def test_mods_are_forward_only_for_now() -> None:
    import cute_flash

    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in _qkv(d=32))
    with pytest.raises(NotImplementedError, match="forward only"):
        cute_flash.flash_attn_func(q, k, v, mask_mod=m.causal())
    with torch.no_grad():
        cute_flash.flash_attn_func(q, k, v, mask_mod=m.causal())
