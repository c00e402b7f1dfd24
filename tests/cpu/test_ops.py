"""The custom ops and the public functions on the CPU: opcheck (schema, fake tensors, autograd
registration, AOT dispatch), gradients against the reference, the SDPA-style wrapper, the
launcher side of the CUDA implementations, and torch.compile(fullgraph=True) against eager."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import cute_flash
from cute_flash import launch, ops
from cute_flash.reference import attention_ref

BF16 = torch.bfloat16
NEG_INF = float("-inf")


def qkv(b=2, nq=9, nk=13, h=4, hkv=2, d=32, dv=64, dtype=BF16, requires_grad=False):
    ts = (torch.randn(b, nq, h, d, dtype=dtype), torch.randn(b, nk, hkv, d, dtype=dtype),
          torch.randn(b, nk, hkv, dv, dtype=dtype))
    return tuple(t.requires_grad_(requires_grad) for t in ts)


def packed(lens_q, lens_k, h=4, hkv=2, d=32, dv=32, requires_grad=False):
    ts = (torch.randn(sum(lens_q), h, d, dtype=BF16), torch.randn(sum(lens_k), hkv, d, dtype=BF16),
          torch.randn(sum(lens_k), hkv, dv, dtype=BF16))
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    return (*(t.requires_grad_(requires_grad) for t in ts), cu_q, cu_k)


def ref_grads(q, k, v, dout, dlse=None, **kw):
    """Autograd of the fp32 reference, rounded to the inputs' dtype."""
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, **kw)
    loss = (out * dout.float()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isinf(lse), 0.0, lse) * dlse).sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g.to(t.dtype)
            for g, t in zip(grads, (q, k, v), strict=True)]


def assert_grads_close(got, want):
    """Within a few bf16 rounding steps of the gradient's scale: ours is fp32 math too, but (like
    the kernels) it reads the forward's output rounded to bf16 for rowsum(dO * O)."""
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        err = (g.float() - w.float()).abs().max().item()
        tol = 3e-2 * w.float().abs().max().item() + 1e-3
        assert err <= tol, f"max abs error {err} > {tol}"


MASKS = [
    dict(causal=False, window_left=-1, window_right=-1, softcap=0.0),
    dict(causal=True, window_left=-1, window_right=-1, softcap=0.0),
    dict(causal=False, window_left=3, window_right=2, softcap=0.0),
    dict(causal=True, window_left=-1, window_right=-1, softcap=5.0),
]


# ---------------------------------------------------------------------------------------------
# opcheck
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", MASKS, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_opcheck_fwd_and_bwd(seed, m):
    q, k, v = qkv(requires_grad=True)
    args = (0.2, m["causal"], m["window_left"], m["window_right"], m["softcap"])
    torch.library.opcheck(torch.ops.cute_flash.fwd.default, (q, k, v, *args, False))
    out, lse = torch.ops.cute_flash.fwd(q.detach(), k.detach(), v.detach(), *args)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.cute_flash.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, *args, True))
    torch.library.opcheck(torch.ops.cute_flash.bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, *args, False,
                           torch.randn_like(lse)))


@pytest.mark.parametrize("m", MASKS[:2], ids=["full", "causal"])
def test_opcheck_varlen_fwd_and_bwd(seed, m):
    q, k, v, cu_q, cu_k = packed([3, 0, 5], [4, 2, 1], requires_grad=True)
    args = (5, 4, 0.2, m["causal"], m["window_left"], m["window_right"], m["softcap"])
    torch.library.opcheck(torch.ops.cute_flash.varlen_fwd.default, (q, k, v, cu_q, cu_k, *args, False))
    out, lse = torch.ops.cute_flash.varlen_fwd(q.detach(), k.detach(), v.detach(), cu_q, cu_k, *args)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.cute_flash.varlen_bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k, *args, False))
    torch.library.opcheck(torch.ops.cute_flash.varlen_bwd.default,
                          (dout, q.detach(), k.detach(), v.detach(), out, lse, cu_q, cu_k, *args, False,
                           torch.randn_like(lse)))


def test_fake_implementation_gives_kernel_output_shapes():
    q, k, v = (t.to("meta") for t in qkv(b=3, nq=5, nk=7, h=8, hkv=2, d=64, dv=128))
    out, lse = torch.ops.cute_flash.fwd(q, k, v, 0.1, False, -1, -1, 0.0)
    assert out.shape == (3, 5, 8, 128) and out.dtype == BF16
    assert lse.shape == (3, 8, 5) and lse.dtype == torch.float32
    dq, dk, dv, dsinks = torch.ops.cute_flash.bwd(out, q, k, v, out, lse, 0.1, False, -1, -1, 0.0)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dsinks.numel() == 0


# ---------------------------------------------------------------------------------------------
# Values and gradients through the public API
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window_size=(4, 0)), dict(softcap=3.0),
                                dict(causal=True, softmax_scale=0.5)])
def test_flash_attn_func_matches_reference_forward_and_backward(seed, kw):
    q, k, v = qkv(nq=13, nk=9, requires_grad=True)
    out, lse = cute_flash.flash_attn_func(q, k, v, return_lse=True, **kw)
    want_out, want_lse = attention_ref(q.detach(), k.detach(), v.detach(), **kw)
    torch.testing.assert_close(out, want_out.to(BF16))
    torch.testing.assert_close(lse, want_lse)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    assert_grads_close(got, ref_grads(q, k, v, dout, **kw))


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("direct", [False, True], ids=["through the op", "without the dispatcher"])
def test_eager_autograd_gives_the_gradients_of_the_ops_own_registration(seed, varlen, direct, monkeypatch):
    """The public functions record their own autograd node in eager mode (a cheaper wrapper than
    ``register_autograd``'s), and on CUDA tensors call the implementations without the dispatcher
    (here: the CPU implementations standing in for the CUDA ones); out, lse and every gradient
    match the op called directly."""
    if direct:
        monkeypatch.setattr(launch, "eager_direct", lambda q: True)
        monkeypatch.setattr(ops, "_fwd_cuda", ops._fwd_cpu)
        monkeypatch.setattr(ops, "_bwd_cuda", ops._bwd_cpu)
    q, k, v = qkv(nq=10, nk=10, requires_grad=True)
    flags = (0.3, True, 3, 0, 0.0, False)
    if varlen:
        q, k, v = (t.detach().flatten(0, 1).requires_grad_(True) for t in (q, k, v))
        cu = torch.tensor([0, 4, 10, 20], dtype=torch.int32)
        args, direct = (cu, cu, 10, 10, *flags), torch.ops.cute_flash.varlen_fwd
        eager = ops.attention_varlen_fwd
    else:
        args, direct, eager = flags, torch.ops.cute_flash.fwd, ops.attention_fwd
    results = []
    for fn in (eager, direct):
        out, lse = fn(q, k, v, *args)
        grads = torch.autograd.grad((out.float() * 0.5).sum() + lse.sin().sum(), (q, k, v))
        results.append((out, lse, *grads))
    assert eager(q, k, v, *args)[0].grad_fn.name() != direct(q, k, v, *args)[0].grad_fn.name()
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("direct", [False, True], ids=["through the op", "without the dispatcher"])
def test_double_backward_raises_instead_of_dropping_second_order_terms(seed, direct, monkeypatch):
    if direct:
        monkeypatch.setattr(launch, "eager_direct", lambda q: True)
        monkeypatch.setattr(ops, "_fwd_cuda", ops._fwd_cpu)
        monkeypatch.setattr(ops, "_bwd_cuda", ops._bwd_cpu)
    q, k, v = qkv(nq=6, nk=6, requires_grad=True)
    out = cute_flash.flash_attn_func(q, k, v)
    (dq,) = torch.autograd.grad(out.float().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="cute_flash.bwd"):
        torch.autograd.grad(dq.float().square().sum() + q.float().sum(), q)


def test_only_plain_eager_cuda_calls_skip_the_dispatcher(monkeypatch):
    """CUDA tensors (``is_cuda`` faked here) skip the dispatcher, except under a dispatch mode or
    a torch.func transform; CPU and meta tensors always take the op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q = torch.randn(2, 3)
    assert not launch.eager_direct(q) and not launch.eager_direct(q.to("meta"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert launch.eager_direct(q)
    with Seen():
        assert not launch.eager_direct(q)
    seen = []
    torch.func.vmap(lambda x: seen.append(launch.eager_direct(x)) or x)(q)
    assert seen == [False]


def test_gradient_flows_through_lse(seed):
    q, k, v = qkv(nq=11, nk=11, requires_grad=True)
    out, lse = cute_flash.flash_attn_func(q, k, v, causal=True, window_size=(5, -1), return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))
    assert_grads_close(got, ref_grads(q, k, v, dout, dlse, causal=True, window_size=(5, -1)))


def test_gradient_of_lse_alone_with_fully_masked_rows(seed):
    q, k, v = qkv(nq=12, nk=5, requires_grad=True)  # causal, Nq > Nk: 7 rows see nothing
    _, lse = cute_flash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    dlse = torch.randn_like(lse)
    got = torch.autograd.grad(torch.where(torch.isinf(lse), 0.0, lse * dlse).sum(), (q, k, v),
                              allow_unused=True)
    want = ref_grads(q, k, v, torch.zeros(2, 12, 4, 64), dlse, causal=True)
    got = [torch.zeros_like(t) if g is None else g for g, t in zip(got, (q, k, v), strict=True)]
    assert_grads_close(got, want)
    assert all(torch.isfinite(g).all() for g in got)


def test_gradient_through_lse_with_softcap(seed):
    q, k, v = qkv(nq=10, nk=14, requires_grad=True)
    q = (q.detach() * 3).requires_grad_()  # scores large enough for the cap to bend them
    out, lse = cute_flash.flash_attn_func(q, k, v, softcap=2.0, window_size=(6, 2), return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v))
    assert_grads_close(got, ref_grads(q, k, v, dout, dlse, softcap=2.0, window_size=(6, 2)))


def spy_backward_op(monkeypatch) -> list[dict]:
    """Records, per call of the backward op's CPU implementation, its deterministic flag and dlse."""
    seen = []
    real = ops._bwd_cpu

    def spy(*args, **kw):
        dlse = kw["dlse"] if "dlse" in kw else (args[15] if len(args) > 15 else None)
        seen.append(dict(deterministic=args[10], dlse=dlse))
        return real(*args, **kw)

    monkeypatch.setattr(ops, "_bwd_cpu", spy)
    return seen


def test_unused_lse_reaches_the_backward_op_as_none(seed, monkeypatch):
    seen = spy_backward_op(monkeypatch)
    q, k, v = qkv(requires_grad=True)
    out, _ = cute_flash.flash_attn_func(q, k, v, return_lse=True)
    out.sum().backward()
    torch.compile(cute_flash.flash_attn_func, fullgraph=True, backend="aot_eager")(q, k, v).sum().backward()
    assert [c["dlse"] for c in seen] == [None, None]


@pytest.mark.parametrize("varlen", [False, True])
def test_used_lse_costs_one_backward_call_with_dlse_folded_in(seed, monkeypatch, varlen):
    # Out and lse both used: one backward-op call carries dlse (the kernels fold it into D), not
    # a second call per gradient.
    seen = spy_backward_op(monkeypatch)
    if varlen:
        q, k, v, cu_q, cu_k = packed([5, 9], [7, 4], requires_grad=True)
        out, lse = cute_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 7, return_lse=True)
    else:
        q, k, v = qkv(nq=9, nk=7, requires_grad=True)
        out, lse = cute_flash.flash_attn_func(q, k, v, return_lse=True)
    dlse = torch.randn_like(lse)
    ((out.float() ** 2).sum() + (lse * dlse).sum()).backward()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0]["dlse"], dlse)


def test_backward_accepts_a_stride_zero_dout(seed):
    # out.sum() hands the backward an expanded scalar: every stride 0, the last one too.
    q, k, v = qkv(requires_grad=True)
    cute_flash.flash_attn_func(q, k, v).sum().backward()
    want = ref_grads(q, k, v, torch.ones(2, 9, 4, 64))
    assert_grads_close((q.grad, k.grad, v.grad), want)


def test_deterministic_flag_reaches_the_backward_op(seed, monkeypatch):
    seen = spy_backward_op(monkeypatch)
    q, k, v = qkv(requires_grad=True)
    for det in (True, False):
        cute_flash.flash_attn_func(q, k, v, deterministic=det).sum().backward()
    assert [c["deterministic"] for c in seen] == [True, False]


def test_varlen_matches_dense_per_sequence(seed):
    lens_q, lens_k = [5, 1, 0, 7], [3, 6, 2, 7]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, requires_grad=True)
    out, lse = cute_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 7, causal=True, return_lse=True)
    assert out.shape == (13, 4, 32) and lse.shape == (4, 13)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(4):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = (t[s][None].detach().requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk)))
        ob, lb = cute_flash.flash_attn_func(qb, kb, vb, causal=True, return_lse=True)
        torch.testing.assert_close(out[sq], ob[0])
        torch.testing.assert_close(lse[:, sq], lb[0])
        if qb.numel():
            gb = torch.autograd.grad(ob, (qb, kb, vb), dout[sq][None])
            for g, want in zip((dq[sq], dk[sk], dv[sk]), gb, strict=True):
                torch.testing.assert_close(g, want[0])


def test_varlen_gradient_flows_through_lse(seed):
    q, k, v, cu_q, cu_k = packed([4, 6], [6, 3], requires_grad=True)
    out, lse = cute_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 6, 6, causal=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * dout).sum() + (torch.where(lse.isinf(), 0, lse) * dlse).sum(), (q, k, v))
    want = ref_grads(q, k, v, dout, dlse, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert_grads_close(got, want)


# ---------------------------------------------------------------------------------------------
# SDPA-style wrapper
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nq,nk", [(7, 7), (5, 12), (12, 5)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_matches_sdpa_including_top_left_causal(seed, nq, nk, is_causal):
    q = torch.randn(2, 4, nq, 32, dtype=BF16, requires_grad=True)
    k = torch.randn(2, 2, nk, 32, dtype=BF16, requires_grad=True)
    v = torch.randn(2, 2, nk, 64, dtype=BF16, requires_grad=True)
    out = cute_flash.attention(q, k, v, is_causal=is_causal, scale=0.3, enable_gqa=True)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, is_causal=is_causal, scale=0.3, enable_gqa=True)
    want = torch.nan_to_num(want)  # SDPA gives NaN where a top-left causal row sees nothing
    torch.testing.assert_close(out, want.to(BF16))
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    wgrads = torch.autograd.grad(want, leaves, dout.float())
    assert_grads_close(got, [g.to(BF16) for g in wgrads])


def test_attention_passes_views_not_copies(monkeypatch):
    seen = []
    real = cute_flash.api.flash_attn_func
    monkeypatch.setattr(cute_flash.api, "flash_attn_func", lambda *a, **kw: seen.append(a) or real(*a, **kw))
    q, k, v = (torch.randn(1, 4, 8, 32, dtype=BF16) for _ in range(3))
    cute_flash.attention(q, k, v)
    for passed, orig in zip(seen[0], (q, k, v), strict=True):
        assert passed.data_ptr() == orig.data_ptr() and passed.shape == (1, 8, 4, 32)


def test_attention_has_the_signature_of_sdpa():
    """``scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
    is_causal=False, scale=None, enable_gqa=False)``, the tensors named as in this package, then
    keyword-only extras."""
    import inspect

    params = inspect.signature(cute_flash.attention).parameters
    positional = [(name, p.default) for name, p in params.items() if p.kind != p.KEYWORD_ONLY]
    assert positional == [
        ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
        ("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False), ("scale", None), ("enable_gqa", False)]
    # (The rest -- score_mod, mask_mod, aux, block_mask -- keyword-only, with SDPA's behaviour by default.)
    extra = [(name, p.default) for name, p in params.items() if p.kind == p.KEYWORD_ONLY]
    assert extra == [("score_mod", None), ("mask_mod", None), ("aux", ()), ("block_mask", None)]


def test_attention_takes_sdpa_arguments_by_position():
    q, k, v = (torch.randn(1, 2, 8, 32, dtype=BF16) for _ in range(3))
    torch.testing.assert_close(cute_flash.attention(q, k, v, None, 0.0, True, 0.3),
                               cute_flash.attention(q, k, v, is_causal=True, scale=0.3))


@pytest.mark.parametrize("mask", [torch.ones(8, 8, dtype=torch.bool), torch.zeros(1, 2, 8, 8),
                                  torch.tril(torch.ones(8, 8, dtype=torch.bool))],
                         ids=["bool-all-true", "float-zeros", "bool-causal"])
def test_attention_refuses_a_mask_tensor(mask):
    """Even a mask that hides nothing: the kernels take masks as ``is_causal`` / windows only."""
    q, k, v = (torch.randn(1, 2, 8, 32, dtype=BF16) for _ in range(3))
    with pytest.raises(ValueError, match="attn_mask tensors are not supported"):
        cute_flash.attention(q, k, v, attn_mask=mask)
    with pytest.raises(ValueError, match="attn_mask"):
        cute_flash.attention(q, k, v, mask)


@pytest.mark.parametrize("p", [0.1, 1.0, 1e-9, True, "0.0"])
def test_attention_refuses_dropout(p):
    q, k, v = (torch.randn(1, 2, 8, 32, dtype=BF16) for _ in range(3))
    with pytest.raises(ValueError, match="dropout is not supported"):
        cute_flash.attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("p", [0.0, 0])
def test_attention_accepts_zero_dropout(p):
    q, k, v = (torch.randn(1, 2, 8, 32, dtype=BF16) for _ in range(3))
    torch.testing.assert_close(cute_flash.attention(q, k, v, dropout_p=p), cute_flash.attention(q, k, v))


def test_attention_refuses_before_launching_anything(fake_launchers):
    q, k, v = (torch.randn(1, 2, 8, 32, dtype=BF16) for _ in range(3))
    for kw in (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), dict(dropout_p=0.5)):
        with pytest.raises(ValueError):
            cute_flash.attention(q, k, v, **kw)
    assert fake_launchers == []


def test_attention_requires_enable_gqa_for_fewer_kv_heads():
    q, k, v = torch.randn(1, 4, 8, 32, dtype=BF16), *(torch.randn(1, 2, 8, 32, dtype=BF16) for _ in range(2))
    with pytest.raises(ValueError, match="enable_gqa=True"):
        cute_flash.attention(q, k, v)


# ---------------------------------------------------------------------------------------------
# The CUDA implementations' side of the launcher interface (stand-in launchers)
# ---------------------------------------------------------------------------------------------
def test_cuda_forward_hands_the_launcher_preallocated_outputs(fake_launchers):
    q, k, v = qkv(h=8, hkv=2, d=64, dv=128)
    out, lse = ops._fwd_cuda(q, k, v, 0.1, True, (5, 3), 2.0)
    (kind, args, kw), = fake_launchers
    assert kind == "fwd" and args[3] is out and args[4] is lse
    assert out.shape == (2, 9, 8, 128) and out.dtype == BF16 and out.is_contiguous()
    assert lse.shape == (2, 8, 9) and lse.dtype == torch.float32 and lse.is_contiguous()
    assert kw == dict(softmax_scale=0.1, causal=True, window_size=(5, 3), softcap=2.0, cu_seqlens_q=None,
                      cu_seqlens_k=None, max_seqlen_q=None, sinks=None)


def test_cuda_backward_hands_the_launcher_gradients_shaped_like_inputs(fake_launchers):
    q, k, v, cu_q, cu_k = packed([3, 4], [5, 2], h=8, hkv=2, dv=64)
    out, lse = torch.randn(7, 8, 64, dtype=BF16), torch.randn(8, 7)
    dq, dk, dv, _ = ops._bwd_cuda(torch.randn_like(out), q, k, v, out, lse, 0.1, False, (-1, -1), 0.0, True,
                                  cu_q, cu_k, 4, 5)
    (kind, args, kw), = fake_launchers
    assert kind == "bwd" and args[6:] == (dq, dk, dv)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert kw["deterministic"] is True and kw["max_seqlen_q"] == 4 and kw["max_seqlen_k"] == 5


def test_cuda_path_fixes_unaligned_strides_of_extent_one_dims(fake_launchers):
    q = torch.randn(1, 9, 4, 32, dtype=BF16).as_strided((1, 9, 4, 32), (5, 128, 32, 1))
    ops._fwd_cuda(q, *qkv(b=1)[1:], 0.1, False, (-1, -1), 0.0)
    passed = fake_launchers[0][1][0]
    assert passed.stride() == (0, 128, 32, 1) and torch.equal(passed, q)


def test_cuda_path_zeroes_extent_one_strides_a_tma_descriptor_cannot_hold(fake_launchers):
    # A 16-byte multiple, but 2^40 bytes: never used to address anything (extent 1), and the sm90
    # forward would still have to encode it into its TMA descriptors.
    q = torch.randn(1, 9, 4, 32, dtype=BF16).as_strided((1, 9, 4, 32), (2**39, 128, 32, 1))
    ops._fwd_cuda(q, *qkv(b=1)[1:], 0.1, False, (-1, -1), 0.0)
    passed = fake_launchers[0][1][0]
    assert passed.stride() == (0, 128, 32, 1) and torch.equal(passed, q)


@pytest.mark.parametrize("nq,nk", [(0, 5), (5, 0)])
def test_cuda_path_handles_empty_problems_without_a_launch(fake_launchers, nq, nk):
    q, k, v = qkv(nq=nq, nk=nk)
    out, lse = ops._fwd_cuda(q, k, v, 0.1, False, (-1, -1), 0.0)
    assert torch.all(out == 0) and torch.all(lse == NEG_INF)
    grads = ops._bwd_cuda(torch.zeros_like(out), q, k, v, out, lse, 0.1, False, (-1, -1), 0.0, False)
    assert all(torch.all(g == 0) for g in grads[:3]) and grads[3].numel() == 0
    assert fake_launchers == []


# ---------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True)
# ---------------------------------------------------------------------------------------------
def _fwd_bwd(fn, inputs, *args, **kw):
    leaves = [t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs]
    out, lse = fn(*leaves, *args, return_lse=True, **kw)
    loss = (out.float() ** 2).sum() + torch.where(lse.isinf(), 0.0, lse).sum()
    grads = torch.autograd.grad(loss, [t for t in leaves if t.requires_grad])
    return out, lse, grads


def _assert_same(a, b):
    for x, y in zip(a[:2], b[:2], strict=True):
        torch.testing.assert_close(x, y)
    for x, y in zip(a[2], b[2], strict=True):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window_size=(3, 1)), dict(softcap=4.0)])
def test_compiled_flash_attn_func_matches_eager(seed, kw):
    inputs = qkv()
    fn = cute_flash.flash_attn_func
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    _assert_same(_fwd_bwd(compiled, inputs, **kw), _fwd_bwd(fn, inputs, **kw))


def test_compiled_varlen_matches_eager(seed):
    q, k, v, cu_q, cu_k = packed([4, 0, 6], [5, 3, 6])
    compiled = torch.compile(cute_flash.flash_attn_varlen_func, fullgraph=True, backend="aot_eager")
    args = ((q, k, v, cu_q, cu_k), 6, 6)
    _assert_same(_fwd_bwd(compiled, *args, causal=True), _fwd_bwd(cute_flash.flash_attn_varlen_func, *args,
                                                                  causal=True))


def test_compiled_with_dynamic_shapes_handles_new_lengths_and_windows(seed):
    def f(q, k, v, cu_q, cu_k, max_q, max_k, left):
        return cute_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, window_size=(left, 0))

    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for lens_q, lens_k, left in (([3, 5], [4, 6], 2), ([7, 2, 9], [1, 2, 9], 5)):
        q, k, v, cu_q, cu_k = packed(lens_q, lens_k)
        args = (q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), left)
        torch.testing.assert_close(compiled(*args), f(*args))


def test_compiled_attention_with_inductor_matches_eager(seed):
    q = torch.randn(2, 4, 12, 32, dtype=BF16, requires_grad=True)
    k = torch.randn(2, 2, 7, 32, dtype=BF16, requires_grad=True)
    v = torch.randn(2, 2, 7, 32, dtype=BF16, requires_grad=True)

    def f(q, k, v):
        return cute_flash.attention(q * 2, k, v, is_causal=True, enable_gqa=True).float().square().sum()

    compiled = torch.compile(f, fullgraph=True)  # default backend: inductor
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_package_exports_the_public_api():
    assert set(cute_flash.__all__) == {"__version__", "attention", "flash_attn_func",
                                       "flash_attn_varlen_func", "flash_attn_with_kvcache", "quantize_qkv",
                                       "create_block_mask", "BlockMask"}
