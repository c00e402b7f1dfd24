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


def test_the_compile_key_follows_a_captured_value_rebound_between_calls() -> None:
    scale = 1.0

    def mod(score, b, h, q_idx, kv_idx, aux):
        return score * scale

    first = m.callable_key(mod)
    scale = 2.0
    assert m.callable_key(mod) != first
    scale = 1.0
    assert m.callable_key(mod) == first
    assert scale == 1.0


def test_the_compile_key_follows_a_captured_container_changed_in_place() -> None:
    offsets = [0, 4]

    def mod(b, h, q_idx, kv_idx, aux):
        return kv_idx >= q_idx - offsets[1]

    first = m.callable_key(mod)
    offsets[1] = 8
    assert m.callable_key(mod) != first


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


def _problem(mods: m.Mods, d: int = 128):
    from cute_flash.problem import Problem

    return Problem(target="sm_90a", dtype="bf16", hdim=d, hdim_v=d, causal=True, varlen=False,
                   max_seqlen_q=8192, max_seqlen_k=8192, heads_q=16, heads_kv=16, batch=1, num_sms=132,
                   mods=mods)


def test_the_forward_plan_widens_a_mods_block_only_as_far_as_it_compiles_spill_free() -> None:
    """ALiBi fits the plain 128-key block at d 128; the relative-bias gather spills there (read from
    the cubin's own notes, as cuobjdump reports it) and keeps the mods' default 96 keys."""
    from dataclasses import replace

    from cute_flash.hopper.fwd_config import plan
    from cute_flash.tools import inspect as ins

    assert plan(_problem(BUILTINS["alibi"])).tile_n == 128
    rel = plan(_problem(BUILTINS["relative_bias"]))
    assert rel.tile_n == 96
    wide = replace(rel, tile_n=128)
    assert jit.spill_bytes(wide) > 0
    if ins.tools_dir() is not None:
        res = list(ins.cubin_sass_and_usage(jit.compile_artifacts(wide)[1])[1].values())[0]
        assert jit.spill_bytes(wide) == res["STACK"] + res["LOCAL"]


def _bwd_mods(name: str, grads: bool) -> m.Mods:
    mod = {"alibi": m.alibi(), "relative_bias": m.relative_bias(64), "softcap": m.softcap(30.0),
           "document": m.document(), "prefix_lm": m.prefix_lm(),
           "sliding_window": m.sliding_window(256)}[name]
    fwd = BUILTINS[name]
    if fwd.score_mod is None:
        return m.Mods(mask_mod=mod.dsl, aux=fwd.aux, aux_grads=(False,) * len(fwd.aux))
    return m.Mods(score_mod=mod.dsl, aux=fwd.aux, score_mod_bwd=mod.bwd, aux_grads=(grads,) * len(fwd.aux))


def _bwd_config(mods: m.Mods, family: str):
    from cute_flash.ampere.config import BwdConfig
    from cute_flash.hopper.bwd_config import BwdSm90Config

    if family == "sm90":
        return BwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, causal=True, mods=mods)
    return BwdConfig(target="sm_80", dtype="bf16", hdim=128, hdim_v=128, causal=True, mods=mods)


@pytest.mark.parametrize("name,family", [
    pytest.param(name, family, id=f"{name}-{family}",
                 marks=() if (name, family) == ("relative_bias", "sm90") else pytest.mark.slow)
    for name in BUILTINS for family in ("sm90", "sm80")])
def test_each_builtin_compiles_into_both_backwards(name: str, family: str) -> None:
    from cute_flash.tools import inspect as ins

    ptx, cubin = jit.compile_artifacts(_bwd_config(_bwd_mods(name, grads=False), family))
    assert "ld.local" not in ptx
    # (The relative-bias table's per-score gather leaves ptxas one register pair short in the sm90
    # causal kernel: 8 bytes of stack. Anything more is a regression.)
    stack = 8 if (name, family) == ("relative_bias", "sm90") else 0
    if ins.tools_dir() is not None:
        for fn, res in ins.cubin_sass_and_usage(cubin)[1].items():
            assert res.get("LOCAL", 0) == 0 and res.get("STACK", 0) <= stack, (fn, res)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["sm90", "sm80"])
def test_a_learnable_table_adds_its_gradient_atomically(family: str) -> None:
    """The relative-bias table's gradient: one atomic add per score (ptxas spills a little around
    them in the sm90 kernel: STACK, not the PTX's local memory)."""
    from cute_flash.tools import inspect as ins

    without = jit.compile_artifacts(_bwd_config(_bwd_mods("relative_bias", grads=False), family))[0]
    ptx = jit.compile_artifacts(_bwd_config(_bwd_mods("relative_bias", grads=True), family))[0]
    assert "ld.local" not in ptx
    assert ptx.count("red.") + ptx.count("atom.") >= without.count("red.") + without.count("atom.") + 16
    assert ins is not None


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


def _dense_bias_attention(q, k, v, bias, causal=True):
    """Plain torch: softmax(q k^T / sqrt(d) + bias, causal) v, (B, N, H, d) layout."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5 + bias
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


def test_gradients_reach_q_k_v_and_a_learnable_bias_table(seed: int) -> None:
    import cute_flash

    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in _qkv(d=32))
    table = torch.randn(4, 2 * 8 + 1, dtype=torch.float32, requires_grad=True)
    out = cute_flash.flash_attn_func(q, k, v, causal=True, score_mod=m.relative_bias(8), aux=(table,))
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, table), dout)
    n = q.shape[1]
    rel = (torch.arange(n)[None, :] - torch.arange(n)[:, None]).clamp(-8, 8) + 8
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    t64 = table.detach().double().requires_grad_()
    want_out = _dense_bias_attention(*leaves, t64[:, rel].unsqueeze(0))
    want = torch.autograd.grad(want_out, (*leaves, t64), dout.double())
    torch.testing.assert_close(out, want_out.detach().to(out.dtype))
    for g, w, t in zip(got, want, (q, k, v, table), strict=True):
        assert g.dtype == t.dtype
        torch.testing.assert_close(g, w.to(g.dtype))


@pytest.mark.parametrize("direct", [False, True], ids=["through the op", "without the dispatcher"])
def test_eager_mods_calls_give_the_gradients_of_the_ops_own_registration(seed: int, direct: bool,
                                                                          monkeypatch) -> None:
    """Eager calls record their own autograd node (and on CUDA tensors call the implementations
    directly: here the ops stand in for them); out, lse and the gradients of q, k, v, a learnable
    table and the sinks match the op's ``register_autograd``."""
    from cute_flash import launch, ops_mods

    if direct:
        monkeypatch.setattr(launch, "eager_direct", lambda q: True)
        monkeypatch.setattr(ops_mods, "_fwd_cuda", lambda *a: torch.ops.cute_flash.mods_fwd(*a))
        monkeypatch.setattr(ops_mods, "_bwd_cuda", lambda *a: torch.ops.cute_flash.mods_bwd(*a))
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in _qkv(n=11, d=32))
    table = torch.randn(4, 2 * 4 + 1, requires_grad=True)
    sinks = torch.randn(4, requires_grad=True)
    kw = dict(scale=0.3, causal=True, window=(-1, -1), softcap=0.0, deterministic=False, sinks=sinks,
              score_mod=m.relative_bias(4), mask_mod=None, aux=(table,))
    eager = ops_mods.mods_attention(q, k, v, **kw)
    key = ops_mods.register_mods(m.relative_bias(4), None)
    op = torch.ops.cute_flash.mods_fwd(q, k, v, [table], None, None, 0, 0, 0.3, True, -1, -1, False, sinks,
                                       None, None, key)
    assert eager[0].grad_fn.name() != op[0].grad_fn.name()
    results = []
    for out, lse in (eager, op):
        loss = (out.float() * 0.5).sum() + lse.sin().sum()
        results.append((out, lse, *torch.autograd.grad(loss, (q, k, v, table, sinks))))
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_user_mod_with_its_derivative_gives_its_tables_gradient(seed: int) -> None:
    import cute_flash

    def temp(score, b, h, q_idx, kv_idx, aux):
        return score * aux[0][h]

    def temp_bwd(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):  # (the kernels' form; unused on CPU)
        m.grad_add(aux_grads[0], (h,), grad * score)
        return grad * aux[0][h]

    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in _qkv(d=32))
    tau = (torch.rand(4, dtype=torch.float32) + 0.5).requires_grad_()
    cu = torch.tensor([0, 20, 37], dtype=torch.int32)
    qp, kp, vp = (t[0] for t in (q, k, v))
    out = cute_flash.flash_attn_varlen_func(qp, kp, vp, cu, cu, 20, 20, score_mod=(temp, temp, temp_bwd),
                                            aux=(tau,))
    got = torch.autograd.grad(out.float().sum(), (q, tau))
    q64, k64, v64, tau64 = (t.detach().double().requires_grad_() for t in (q, k, v, tau))
    want = 0
    for lo, hi in ((0, 20), (20, 37)):
        s = torch.einsum("qhd,khd->hqk", q64[0, lo:hi], k64[0, lo:hi]) / 32 ** 0.5 * tau64.view(4, 1, 1)
        want = want + torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v64[0, lo:hi]).sum()
    want_q, want_tau = torch.autograd.grad(want, (q64, tau64))
    torch.testing.assert_close(got[0], want_q.to(got[0].dtype))
    torch.testing.assert_close(got[1], want_tau.float())


def test_gradients_through_a_score_mod_need_its_derivative() -> None:
    import cute_flash

    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in _qkv(d=32))
    pair = m.alibi()[:2]  # (DSL function, torch function): no score_mod_bwd
    with pytest.raises(ValueError, match="derivative"):
        cute_flash.flash_attn_func(q, k, v, score_mod=pair, aux=(torch.rand(4),))
    with torch.no_grad():
        cute_flash.flash_attn_func(q, k, v, score_mod=pair, aux=(torch.rand(4),))
    ids = torch.zeros(2, 37, dtype=torch.int32, requires_grad=False)
    out = cute_flash.flash_attn_func(q, k, v, mask_mod=m.document(), aux=(ids,))  # masks need none
    out.float().sum().backward()
    assert q.grad is not None


def test_mods_trace_under_torch_compile_fullgraph(seed: int) -> None:
    import cute_flash

    rel = m.relative_bias(8)
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in _qkv(d=32))
    table = torch.randn(4, 17, requires_grad=True)

    def loss(q, k, v, table):
        out = cute_flash.flash_attn_func(q, k, v, causal=True, score_mod=rel, aux=(table,))
        return out.float().square().sum()

    torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k, v, table).backward()
    got = [t.grad.clone() for t in (q, table)]
    q.grad = table.grad = None
    loss(q, k, v, table).backward()
    torch.testing.assert_close(got[0], q.grad)
    torch.testing.assert_close(got[1], table.grad)


def test_the_mods_forward_op_passes_opcheck() -> None:
    from cute_flash import ops_mods

    q, k, v = (t.to(torch.bfloat16) for t in _qkv(n=9, d=32))
    slopes = torch.rand(4)
    key = ops_mods.register_mods(m.alibi(), None)
    args = (q, k, v, [slopes], None, None, 0, 0, 0.125, True, -1, -1, False, None, None, None, key)
    torch.library.opcheck(torch.ops.cute_flash.mods_fwd.default, args,
                          test_utils=("test_schema", "test_faketensor"))
    # (mods_bwd's CPU form differentiates with torch.func, which opcheck's modes do not wrap; its fake
    # form meets its real one under torch.compile above.)


def test_the_sinks_gradient_through_the_mods_op_matches_the_plain_op(seed: int) -> None:
    import cute_flash

    q, k, v = (t.to(torch.bfloat16) for t in _qkv(d=32))
    sinks = torch.randn(4)
    grads = []
    for kw in (dict(causal=True), dict(mask_mod=m.causal())):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        out = cute_flash.flash_attn_func(*leaves[:3], sinks=leaves[3], **kw)
        grads.append(torch.autograd.grad(out.float().square().sum(), leaves))
    for a, b in zip(*grads, strict=True):  # (the two CPU forms round to bf16 from fp32 / fp64 math)
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_the_backward_gets_each_aux_gradient_where_it_was_compiled() -> None:
    from cute_flash import launch, signatures

    alibi = m.alibi(at=1)
    mods = m.Mods(score_mod=alibi.dsl, mask_mod=m.document(0).dsl, aux=(("int32", 2), ("fp32", 1)),
                  score_mod_bwd=alibi.bwd, aux_grads=(False, True))
    ids, slopes, dslopes = torch.zeros(2, 5, dtype=torch.int32), torch.rand(4), torch.zeros(4)
    compiled = [*signatures.aux_args(mods), *signatures.aux_grad_args(mods)]
    passed = launch.mod_args((ids, slopes), (None, dslopes))
    assert [x is None for x in passed] == [x is None for x in compiled]
    assert passed[jit.MAX_AUX + 1] is dslopes


def test_what_the_backward_cannot_do_raises_before_the_forward(seed: int) -> None:
    import cute_flash

    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in _qkv(d=32))
    table = torch.randn(4, 17, requires_grad=True)
    with pytest.raises(ValueError, match="deterministic"):
        cute_flash.flash_attn_func(q, k, v, score_mod=m.relative_bias(8), aux=(table,), deterministic=True)
    bm = cute_flash.create_block_mask(m.causal(), None, None, 37, 37)
    with pytest.raises(ValueError, match="deterministic"):
        cute_flash.flash_attn_func(q, k, v, mask_mod=m.causal(), block_mask=bm, deterministic=True)
    sinks = torch.randn(4, requires_grad=True)
    with torch.no_grad():
        qq, kk, vv = (t.detach() for t in (q, k, v))
    with pytest.raises(ValueError, match="derivative"):  # (only the sinks learn: still through the mod)
        cute_flash.flash_attn_func(qq, kk, vv, score_mod=m.alibi()[:2], aux=(torch.rand(4),), sinks=sinks)


def test_a_mask_reading_a_float_tensor_gives_it_no_gradient(seed: int) -> None:
    import cute_flash

    def above(b, h, q_idx, kv_idx, aux):
        return aux[0][kv_idx] > 0.0

    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in _qkv(d=32))
    keys = torch.randn(37, requires_grad=True)
    out = cute_flash.flash_attn_func(q, k, v, mask_mod=(above, above), aux=(keys,))
    out.float().sum().backward()
    assert q.grad is not None and keys.grad is None


def test_the_sdpa_style_function_takes_the_mods(seed: int) -> None:
    import cute_flash

    q, k, v = (t.to(torch.bfloat16).transpose(1, 2) for t in _qkv(d=32))  # (B, H, N, d)
    slopes = torch.rand(4)
    got = cute_flash.attention(q, k, v, is_causal=True, score_mod=m.alibi(), aux=(slopes,))
    want = cute_flash.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True,
                                      score_mod=m.alibi(), aux=(slopes,))
    torch.testing.assert_close(got, want.transpose(1, 2))
