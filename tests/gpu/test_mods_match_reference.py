"""score_mod / mask_mod compiled into the kernels, on the GPU: each built-in and a user-written mod
of each kind against ``attention_ref`` with the mods' torch forms under the 2x rule (the same math
in bf16 bounds the error). Forwards through the launcher for both families, dense and packed, GQA,
lengths that are not tile multiples, outputs poisoned with NaN first; backwards through the public
function for both backward families, gradients of q, k, v and of the learnable aux tables
(ALiBi slopes, the relative-bias table, the user mod's temperatures) and sinks."""

from __future__ import annotations

import math

import cutlass
import pytest
import torch

from cute_flash import launch
from cute_flash.device import mods as m
from cute_flash.reference import attention_ref

from attention_checks import FLOOR_BWD, FLOOR_FWD, assert_rule, cu_seqlens

pytestmark = [pytest.mark.gpu]

B, N, H, HKV, D = 2, 333, 8, 2, 128


def _user_score(score, b, h, q_idx, kv_idx, aux):
    # A per-head temperature and a distance penalty, written by hand.
    return score * aux[0][h] - cutlass.Float32(0.01) * (q_idx - kv_idx).to(cutlass.Float32)


def _user_score_torch(score, b, h, q_idx, kv_idx, aux):
    return score * aux[0][h] - 0.01 * (q_idx - kv_idx)


def _user_score_bwd(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
    # d/d score = temperature; d/d temperature = score (accumulated per head).
    if cutlass.const_expr(aux_grads[0] is not None):
        m.grad_add(aux_grads[0], (h,), grad * score)
    return grad * aux[0][h]


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
    "user_score": (lambda: m.Mod(_user_score, _user_score_torch, _user_score_bwd), True, (("fp32", 1),)),
    "user_mask": (lambda: (_user_mask, _user_mask_torch), False, ()),
}


def _run(name: str, family: str, varlen: bool, seed: int) -> None:
    make, is_score, aux_types = MODS[name]
    dsl_fn, torch_fn = make()[:2]
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


# The aux tensors a backward differentiates (learnable tables); the others are ids / lengths.
LEARNABLE = {"alibi", "relative_bias", "user_score"}


def _grads(fn, q, k, v, aux, dout, sinks, learn: bool, **kw):
    """out and the gradients of <out, dout> w.r.t. q, k, v, the learnable aux tensor and sinks."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    aux = tuple(t.detach().clone().requires_grad_(learn and i == 0) for i, t in enumerate(aux))
    extra = [t for t in aux if t.requires_grad]
    if sinks is not None:
        sinks = sinks.detach().clone().requires_grad_()
        extra.append(sinks)
    out = fn(*leaves, aux=aux, sinks=sinks, **kw)
    return out.detach(), torch.autograd.grad(out, leaves + extra, dout)


def _ref(upcast: bool):
    def fn(q, k, v, aux, sinks, score_mod=None, mask_mod=None, cu=None, causal=False, block_mask=None):
        kw = dict(softmax_scale=1.0 / math.sqrt(D), aux=aux, sinks=sinks, causal=causal, upcast=upcast,
                  cu_seqlens_q=cu, cu_seqlens_k=cu,
                  score_mod=None if score_mod is None else score_mod[1],
                  mask_mod=None if mask_mod is None else mask_mod[1])
        return attention_ref(q, k, v, **kw)[0]
    return fn


def _ours(q, k, v, aux, sinks, score_mod=None, mask_mod=None, cu=None, causal=False, block_mask=None):
    import cute_flash

    kw = dict(aux=aux, sinks=sinks, score_mod=score_mod, mask_mod=mask_mod, causal=causal,
              block_mask=block_mask)
    if cu is None:
        return cute_flash.flash_attn_func(q, k, v, **kw)
    return cute_flash.flash_attn_varlen_func(q, k, v, cu, cu, N, N, **kw)


def _run_bwd(name: str, varlen: bool, with_sinks: bool, seed: int, blocks: bool = False) -> None:
    make, is_score, _ = MODS[name]
    mod = m.Mod(*make())
    aux = _aux(name, N)
    q = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16)
    cu = None
    if varlen:
        q, k, v = (t.reshape(B * N, *t.shape[2:]) for t in (q, k, v))
        cu = cu_seqlens([N] * B)
    dout = torch.randn_like(q)
    sinks = torch.randn(H, device="cuda") if with_sinks else None
    learn = name in LEARNABLE
    kw = dict(cu=cu, causal=name in ("alibi", "relative_bias"))
    kw["score_mod" if is_score else "mask_mod"] = mod
    if blocks:
        import cute_flash

        kw["block_mask"] = cute_flash.create_block_mask(mod, B, None, N, N, device="cuda", aux=aux)
    out, grads = _grads(_ours, q, k, v, aux, dout, sinks, learn, **kw)
    q32, k32, v32 = (t.float() for t in (q, k, v))
    r_out, r_grads = _grads(_ref(True), q32, k32, v32, aux, dout.float(), sinks, learn, **kw)
    s_out, s_grads = _grads(_ref(False), q, k, v, aux, dout, sinks, learn, **kw)
    case = (name, varlen, with_sinks, blocks)
    assert_rule("out", out, r_out, s_out, FLOOR_FWD, seed, case)
    names = ["dq", "dk", "dv"] + (["daux"] if learn else []) + (["dsinks"] if with_sinks else [])
    for gname, g, r, s_ in zip(names, grads, r_grads, s_grads, strict=True):
        # (A table entry sums a whole diagonal or head: its floor scales with the sum's size.)
        floor = FLOOR_BWD if gname in ("dq", "dk", "dv") else FLOOR_BWD * N
        assert_rule(gname, g, r, s_, floor, seed, case)


@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("name", list(MODS))
def test_mod_gradients_match_the_reference(name: str, family: str, seed: int, monkeypatch) -> None:
    if family == "sm90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 backward needs a Hopper GPU")
    monkeypatch.setenv("CUTE_FLASH_BWD_KERNEL", family)
    _run_bwd(name, False, False, seed)


@pytest.mark.parametrize("name", ["alibi", "document", "user_score"])
def test_mod_gradients_on_packed_sequences_with_sinks(name: str, seed: int) -> None:
    _run_bwd(name, True, True, seed)


def test_mods_train_under_torch_compile(seed: int) -> None:
    import cute_flash

    rel = m.relative_bias(64)
    table = torch.randn(H, 129, device="cuda", requires_grad=True)
    q, k, v = (torch.randn(B, N, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (H, HKV, HKV))

    def step(q, k, v, table):
        return cute_flash.flash_attn_func(q, k, v, causal=True, score_mod=rel, aux=(table,)).float().sum()

    torch.compile(step, fullgraph=True)(q, k, v, table).backward()
    want = [t.grad.clone() for t in (q, k, v, table)]
    for t in (q, k, v, table):
        t.grad = None
    step(q, k, v, table).backward()
    for w, t in zip(want, (q, k, v, table), strict=True):
        torch.testing.assert_close(t.grad, w, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("name,varlen", [("document", False), ("document", True), ("prefix_lm", False),
                                         ("user_mask", False), ("sliding_window", True)])
def test_block_masks_give_the_same_result_as_the_mask_alone(name: str, varlen: bool, family: str, seed: int,
                                                            monkeypatch) -> None:
    if family == "sm90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need a Hopper GPU")
    monkeypatch.setenv("CUTE_FLASH_FWD_KERNEL", family)
    monkeypatch.setenv("CUTE_FLASH_BWD_KERNEL", family)
    _run_bwd(name, varlen, False, seed, blocks=True)
