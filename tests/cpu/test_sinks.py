"""Learnable attention sinks on the CPU: the reference against the explicit math (a logit column
per head that joins the softmax and is dropped), the op's gradients (q, k, v and the sinks)
against autograd of the reference, rows that see no key, validation, and both forwards compiled
with the sinks' loads (``tests/gpu/test_sinks_match_reference.py`` runs the kernels)."""

from __future__ import annotations

import re

import pytest
import torch

import cute_flash
from cute_flash import jit, launch
from cute_flash.ampere.config import FwdConfig
from cute_flash.hopper.fwd_config import FwdSm90Config
from cute_flash.reference import attention_ref

F64 = torch.float64


def _qkv(b=2, nq=9, nk=13, h=4, hkv=2, d=32, dtype=torch.bfloat16):
    return (torch.randn(b, nq, h, d, dtype=dtype), torch.randn(b, nk, hkv, d, dtype=dtype),
            torch.randn(b, nk, hkv, d, dtype=dtype))


def _explicit(q, k, v, sinks, causal):
    """softmax([Q K^T * scale, sink]) with the sink's column dropped, in fp64."""
    h = q.shape[2]
    rep = h // k.shape[2]
    qf, kf, vf = q.to(F64), k.to(F64).repeat_interleave(rep, 2), v.to(F64).repeat_interleave(rep, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) / q.shape[-1] ** 0.5
    if causal:
        nq, nk = q.shape[1], k.shape[1]
        keep = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + nk - nq
        s = s.masked_fill(~keep, float("-inf"))
    col = sinks.to(F64).view(1, h, 1, 1).expand(*s.shape[:3], 1)
    p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, vf), torch.logsumexp(torch.cat([s, col], -1), -1)


@pytest.mark.parametrize("causal", [False, True])
def test_a_sink_joins_the_softmax_and_adds_no_value(seed: int, causal: bool) -> None:
    q, k, v = _qkv(dtype=F64)
    sinks = torch.randn(4, dtype=torch.float32) * 2
    out, lse = attention_ref(q, k, v, causal=causal, sinks=sinks)
    want_out, want_lse = _explicit(q, k, v, sinks, causal)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    plain, _ = attention_ref(q, k, v, causal=causal)
    assert (out - plain).abs().max() > 1e-3  # (the sinks change the answer)


def _grads(fn, leaves, dout, dlse):
    out, lse = fn(*leaves)
    loss = (out.float() * dout).sum() + (lse.float() * dlse).sum()
    return torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("varlen", [False, True])
def test_the_ops_gradients_of_q_k_v_and_the_sinks_follow_the_reference(seed: int, varlen: bool) -> None:
    q, k, v = (t[0] if varlen else t for t in _qkv(b=1 if varlen else 2))
    sinks = torch.randn(4, dtype=torch.float32)
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    kw = dict(causal=True, return_lse=True)
    if varlen:
        cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 6, 13], dtype=torch.int32)

        def ours(q, k, v, s):
            return cute_flash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 7, sinks=s, **kw)

        def ref(q, k, v, s):
            return attention_ref(q.double(), k.double(), v.double(), causal=True, sinks=s, cu_seqlens_q=cu_q,
                                 cu_seqlens_k=cu_k)
    else:
        def ours(q, k, v, s):
            return cute_flash.flash_attn_func(q, k, v, sinks=s, **kw)

        def ref(q, k, v, s):
            return attention_ref(q.double(), k.double(), v.double(), causal=True, sinks=s)
    out, lse = ours(*leaves)
    dout, dlse = torch.randn(out.shape), torch.randn(lse.shape)
    got = _grads(ours, leaves, dout, dlse)
    want = _grads(ref, leaves, dout, dlse)
    for g, w in zip(got, want, strict=True):
        err = (g.float() - w.float()).abs().max().item()
        assert err <= 3e-2 * w.float().abs().max().item() + 1e-3, err
    assert got[3].abs().max() > 0


def test_rows_that_see_no_key_output_zero_with_the_sink_as_lse(seed: int) -> None:
    # Bottom-right causal with Nq > Nk: the first Nq - Nk queries see no key.
    q, k, v = _qkv(nq=12, nk=5)
    sinks = torch.randn(4, dtype=torch.float32)
    out, lse = cute_flash.flash_attn_func(q, k, v, causal=True, return_lse=True, sinks=sinks)
    assert torch.all(out[:, :7] == 0)
    torch.testing.assert_close(lse[:, :, :7], sinks.view(1, 4, 1).expand(2, 4, 7))
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("bad,err", [(torch.zeros(4, dtype=torch.float16), TypeError),
                                     (torch.zeros(3), ValueError), (torch.zeros(2, 2), ValueError),
                                     ([0.0] * 4, TypeError)])
def test_bad_sinks_raise_before_anything_runs(bad, err) -> None:
    q, k, v = _qkv()
    with pytest.raises(err, match="sinks"):
        cute_flash.flash_attn_func(q, k, v, sinks=bad)


def test_fp8_attention_refuses_sinks() -> None:
    q, k, v = _qkv(d=64)
    with pytest.raises(NotImplementedError, match="sinks"):
        cute_flash.flash_attn_func(q, k, v, fp8=True, sinks=torch.zeros(4))


@pytest.mark.parametrize("cfg", [
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, causal=True, sinks=True),
    pytest.param(FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, pack_gqa=4, sinks=True),
                 marks=pytest.mark.slow),
    FwdConfig(target="sm_80", dtype="bf16", hdim=64, hdim_v=64, sinks=True),
    pytest.param(FwdConfig(target="sm_80", dtype="fp16", hdim=128, hdim_v=128, varlen=True, sinks=True),
                 marks=pytest.mark.slow),
], ids=["sm90-causal", "sm90-packed-gqa", "sm80", "sm80-varlen"])
def test_both_forwards_compile_with_the_sinks_read_once_per_tile(cfg) -> None:
    from dataclasses import replace

    ptx, _ = jit.compile_artifacts(cfg)
    plain, _ = jit.compile_artifacts(replace(cfg, sinks=False))

    def count(text: str, pattern: str) -> int:
        return len(re.findall(pattern, text))

    # The sinks are global loads of their own (one per accumulator row), and a row's sink enters
    # its sum through one more exponential.
    assert count(ptx, r"ld\.global") > count(plain, r"ld\.global")
    assert count(ptx, r"ex2\.approx") > count(plain, r"ex2\.approx")
    assert count(ptx, r"ld\.local") == 0


def test_opcheck_of_the_forward_ops_with_sinks(seed: int) -> None:
    q, k, v = (t.requires_grad_() for t in _qkv())
    sinks = torch.randn(4, requires_grad=True)
    torch.library.opcheck(torch.ops.cute_flash.fwd.default, (q, k, v, 0.2, True, -1, -1, 0.0, False, sinks))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    qp, kp, vp = (t[0, :9].detach().requires_grad_() for t in (q, k, v))
    torch.library.opcheck(torch.ops.cute_flash.varlen_fwd.default,
                          (qp, kp, vp, cu, cu, 5, 5, 0.2, True, -1, -1, 0.0, False, sinks))


def test_compiled_call_with_sinks_matches_eager(seed: int) -> None:
    q, k, v = _qkv()
    sinks = torch.randn(4)

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
        out = fn(*leaves[:3], causal=True, sinks=leaves[3])
        out.float().square().sum().backward()
        return out.detach(), [t.grad for t in leaves]

    compiled = torch.compile(cute_flash.flash_attn_func, fullgraph=True, backend="aot_eager")
    (out_c, g_c), (out_e, g_e) = run(compiled), run(cute_flash.flash_attn_func)
    torch.testing.assert_close(out_c, out_e)
    for a, b in zip(g_c, g_e, strict=True):
        torch.testing.assert_close(a, b)


def test_the_kv_cache_path_takes_sinks_like_the_dense_forward(seed: int) -> None:
    b, h, hkv, d = 2, 8, 2, 64
    bf = torch.bfloat16
    k_cache, v_cache = torch.randn(b, 64, hkv, d, dtype=bf), torch.randn(b, 64, hkv, d, dtype=bf)
    lens = torch.tensor([40, 17], dtype=torch.int32)
    q = torch.randn(b, 3, h, d, dtype=bf)
    sinks = torch.randn(h)
    out = cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,
                                             sinks=sinks)
    for i in range(b):
        n_i = int(lens[i])
        want = cute_flash.flash_attn_func(q[i:i + 1], k_cache[i:i + 1, :n_i], v_cache[i:i + 1, :n_i],
                                          causal=True, sinks=sinks)
        torch.testing.assert_close(out[i:i + 1], want)


def test_split_kv_plans_leave_the_sinks_to_the_merge() -> None:
    from cute_flash import dispatch

    for arch in ("sm_90a", "sm_80"):
        p = dispatch.kvcache_problem("bf16", 128, 128, causal=True, local=False, softcap=False, batch=1,
                                     seqlen_q=1, capacity=65536, heads_q=32, heads_kv=8, num_sms=132,
                                     q_dense=True, sinks=True)
        split = dispatch.kvcache_plan(arch, p, batch_idx=False, leftpad=False)
        assert split.num_splits > 1 and not split.config.sinks and split.combine.sinks
        whole = dispatch.kvcache_plan(arch, p, batch_idx=False, leftpad=False, num_splits=1)
        assert whole.num_splits == 1 and whole.config.sinks and whole.combine is None


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_80"])
def test_kv_cache_kernels_and_the_merge_compile_with_sinks(arch: str) -> None:
    from dataclasses import replace

    from cute_flash import dispatch

    p = dispatch.kvcache_problem("bf16", 128, 128, causal=True, local=False, softcap=False, batch=1,
                                 seqlen_q=1, capacity=65536, heads_q=32, heads_kv=8, num_sms=132,
                                 q_dense=True, sinks=True)
    split = dispatch.kvcache_plan(arch, p, batch_idx=False, leftpad=False)
    whole = dispatch.kvcache_plan(arch, p, batch_idx=False, leftpad=False, num_splits=1)
    for cfg in (replace(whole.config, target=arch), replace(split.combine, target=arch)):
        ptx, _ = jit.compile_artifacts(cfg)
        plain, _ = jit.compile_artifacts(replace(cfg, sinks=False))
        assert len(re.findall(r"ex2\.approx", ptx)) > len(re.findall(r"ex2\.approx", plain))


def _padded_d(d_rows: torch.Tensor, cu: torch.Tensor | None, tile_m: int) -> torch.Tensor:
    """D laid out as the backward preprocess writes it (``launch.alloc_scratch``): dense rows padded
    to a tile multiple, packed sequences each starting on a tile boundary; padding rows 0."""
    if cu is None:
        b, h, n = d_rows.shape
        out = torch.zeros(b, h, -(-n // tile_m) * tile_m)
        out[..., :n] = d_rows
        return out
    h, total = d_rows.shape
    nseq = cu.shape[0] - 1
    out = torch.zeros(h, (total // tile_m + nseq + 1) * tile_m)
    for s in range(nseq):
        lo, hi = int(cu[s]), int(cu[s + 1])
        start = (lo + s * tile_m) // tile_m * tile_m
        out[:, start:start + hi - lo] = d_rows[:, lo:hi]
    return out


@pytest.mark.parametrize("varlen", [False, True])
def test_the_sink_gradient_from_the_preprocess_d_matches_the_direct_one(varlen: bool, seed: int) -> None:
    h, d, tile_m = 4, 32, 64
    sinks = torch.randn(h)
    if varlen:
        cu = torch.tensor([0, 37, 40, 170], dtype=torch.int32)
        out, dout = (torch.randn(170, h, d) for _ in range(2))
        lse, dlse = torch.randn(h, 170) + 3, torch.randn(h, 170)
        d_rows = (dout * out).sum(-1).t() - dlse
    else:
        cu = None
        out, dout = (torch.randn(2, 99, h, d) for _ in range(2))
        lse, dlse = torch.randn(2, h, 99) + 3, torch.randn(2, h, 99)
        d_rows = (dout * out).sum(-1).transpose(1, 2) - dlse
    want = launch.sink_grad(sinks, out, lse, dout, dlse, varlen)
    got = launch.sink_grad_from_d(sinks, lse, _padded_d(d_rows, cu, tile_m), cu, tile_m)
    torch.testing.assert_close(got, want)
