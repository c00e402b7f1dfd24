"""The FP8 (e4m3) backward without a GPU: its kernel compiles for sm_90a with every GEMM on k32
e4m3 wgmma (QGMMA) and no serialised wgmma, its config refuses what the kernel does not build,
``fp8=True`` is differentiable on CPU tensors through the recipe in PyTorch, and the launcher's
host-side pieces (dO's row quantization, the rotation undone) do what they claim. (On a GPU:
``tests/gpu/test_fp8_bwd_gradients.py``.)"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch

from cute_flash import dispatch, flash_attn_func, flash_attn_varlen_func, jit, launch
from cute_flash.formats import E4M3_MAX
from cute_flash.hopper.bwd_fp8_config import BwdSm90Fp8Config, plan
from cute_flash.problem import Problem
from cute_flash.reference_fp8 import rotate
from cute_flash.reference_fp8_bwd import KERNEL_RECIPE, attention_fp8_bwd_ref, exact_grads, quantize_rows
from cute_flash.tools import inspect as ins

FAST = BwdSm90Fp8Config(target="sm_90a", hdim=128, causal=True)


@pytest.mark.parametrize("cfg", [pytest.param(c, marks=() if c == FAST else pytest.mark.slow,
                                              id=f"d{c.hdim}-{'causal' if c.causal else 'full'}"
                                                 f"{'-varlen' if c.varlen else ''}"
                                                 f"{'-split' if c.split_heads else ''}")
                                 for c in (FAST, *(BwdSm90Fp8Config(target="sm_90a", hdim=d, causal=c)
                                                   for d, c in ((128, False), (64, False), (64, True))),
                                           *(BwdSm90Fp8Config(target="sm_90a", hdim=d, causal=c, varlen=True)
                                             for d, c in ((128, True), (64, False))),
                                           BwdSm90Fp8Config(target="sm_90a", hdim=128, causal=True,
                                                            split_heads=True))])
def test_fp8_backward_compiles_to_e4m3_wgmma(cfg: BwdSm90Fp8Config) -> None:
    ptx, cubin = jit.compile_artifacts(cfg)
    mmas = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k(\d+)\.f32\.(\w+)\.(\w+)", ptx)
    assert mmas and set(mmas) == {("32", "e4m3", "e4m3")}
    assert "griddepcontrol.wait" in ptx  # launched early behind the preprocess (PDL)
    if ins.tools_dir() is None:
        pytest.skip("no cuobjdump: SASS not checked")
    sass, _ = ins.cubin_sass_and_usage(cubin)
    if not sass:
        pytest.skip("no SASS")
    # k32 steps per query block: S^T and dP^T d / 32 each, dV and dK tile_m / 32 each, dQ (head dim
    # split over the warpgroups) tile_n / 32.
    expect = 2 * cfg.hdim // 32 + 2 * cfg.tile_m // 32 + cfg.tile_n // 32
    assert sass.count("QGMMA.") == expect
    assert "HGMMA." not in sass
    assert 0 < sass.count("WARPGROUP.DEPBAR") <= 4, "wgmma serialised?"
    assert "UTMALDG" in sass and "UBLKRED" in sass


def test_fp8_backward_config_refuses_what_the_kernel_does_not_build() -> None:
    for bad in (dict(hdim=256), dict(hdim=128, local=True), dict(hdim=128, causal=True, ds_stages=2),
                dict(hdim=128, softcap=True), dict(hdim=128, tile_m=80), dict(hdim=128, split_loads=True),
                dict(hdim=128, hdim_v=64)):
        with pytest.raises(ValueError):
            BwdSm90Fp8Config(target="sm_90a", **bad)
    assert BwdSm90Fp8Config(target="sm_90a", hdim=128).smem_bytes() <= 227 * 1024


def test_fp8_backward_plan_walks_causal_longest_first() -> None:
    p = Problem(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, causal=True, max_seqlen_q=8192,
                max_seqlen_k=8192, heads_q=32, heads_kv=8, batch=1, num_sms=132)
    pre, main, post = plan(p)
    assert main.lpt and not main.split_loads and main.tile_m == 64
    assert pre.tile_m == post.tile_m == main.tile_m


def test_fp8_backward_plan_splits_gqa_groups_that_leave_sms_idle() -> None:
    """A GQA group's query heads go to several CTA rows (partial dK / dV summed by the launcher)
    where one row per K/V head gives the grid too few CTAs; many K/V heads keep one row;
    ``head_split`` in the overrides must divide the group."""
    def problem(heads_q, heads_kv, n=4096):
        return Problem(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, causal=True, batch=1,
                       num_sms=132, max_seqlen_q=n, max_seqlen_k=n, heads_q=heads_q, heads_kv=heads_kv)

    llama = problem(32, 8)
    assert plan(llama)[1].split_heads and dispatch.fp8_bwd_head_split(llama) == 4
    assert dispatch.fp8_bwd_head_split(problem(128, 64, 16384)) == 1
    assert not plan(problem(16, 16))[1].split_heads
    asked = (("head_split", 2),)
    assert plan(llama, asked)[1].split_heads and dispatch.fp8_bwd_head_split(llama, asked) == 2
    with pytest.raises(ValueError, match="divide"):
        plan(llama, (("head_split", 3),))


def _inputs(b=1, nq=150, nk=150, h=4, hkv=2, d=64, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(b, nq, h, d, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, nk, hkv, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn(b, nq, h, d, dtype=torch.bfloat16)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_true_is_differentiable_on_cpu_through_the_recipe(causal: bool) -> None:
    """CPU tensors: the op's reference implementation runs the kernel's recipe (dO per row, P and
    dS per tile) on the forward's saved e4m3 tensors: the recipe's gradients (up to V's
    re-quantization) and FP8's error against fp64."""
    q, k, v, dout = _inputs()
    out = flash_attn_func(q, k, v, causal=causal, fp8=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    recipe = attention_fp8_bwd_ref(q, k, v, dout, causal=causal, recipe=KERNEL_RECIPE)
    exact = exact_grads(q, k, v, dout, causal=causal)
    for g, r, e in zip(grads, recipe, exact, strict=True):
        assert g.dtype == torch.bfloat16 and g.shape == e.shape
        rel = ((g.double() - e).norm() / e.norm()).item()
        assert 0.0 < rel < 0.1
        assert ((g.double() - r.double()).norm() / r.norm()).item() < 0.01


def test_fp8_true_backward_refuses_what_it_does_not_cover() -> None:
    q, k, v, _ = _inputs(d=256)
    with pytest.raises(NotImplementedError, match="head dims"):
        flash_attn_func(q, k, v, fp8=True)
    with torch.no_grad():  # the forward alone still runs every head dim
        flash_attn_func(q, k, v, fp8=True)


def test_quantize_rows_puts_each_rows_amax_at_448() -> None:
    x = torch.randn(2, 33, 3, 64, dtype=torch.bfloat16) * torch.logspace(-3, 3, 33)[None, :, None, None]
    x[0, 5, 1] = 0
    x[1, 2, 0] *= 2e-29  # amax ~1e-31, below the scale's floor: codes and descale in its units
    x8, descale = quantize_rows(x)
    assert x8.dtype == torch.float8_e4m3fn and descale.shape == (2, 33, 3)
    assert (x8.float().abs().amax(-1)[x.float().abs().amax(-1) >= 1e-30] == E4M3_MAX).all()
    assert (x8[0, 5, 1].float() == 0).all()
    back = x8.float() * descale[..., None]
    assert ((back - x.float()).abs() <= x.float().abs().amax(-1, keepdim=True) / 16).all()


def test_unrotate_undoes_the_forward_rotation() -> None:
    x = torch.randn(2, 7, 3, 128, dtype=torch.float64)
    y = launch.unrotate(rotate(x.float(), 5).double(), 5)
    assert torch.allclose(y, x, atol=1e-5)


def test_unrotate_sums_a_split_groups_partials() -> None:
    """dK's partials of a split GQA group (adjacent per K/V head) unrotated and summed in one GEMM
    equal the unrotation of their sum."""
    parts = torch.randn(2, 7, 3 * 4, 64, dtype=torch.float64)
    summed = parts.unflatten(-2, (3, 4)).sum(-2)
    got = launch.unrotate(parts, 9, split=4)
    assert got.shape == (2, 7, 3, 64)
    assert torch.allclose(got, launch.unrotate(summed, 9), atol=1e-12)


def test_fp8_backward_preprocess_quantizes_do_and_sm80_cannot() -> None:
    """The FP8 backward's preprocess writes dO in e4m3 (cvt.rn.satfinite, 8-byte stores) with no
    spills, dense and packed; the only other quantize kernel is V's, unrotated in natural layout;
    sm80 has no e4m3 conversions."""
    from cute_flash.ampere.config import BwdPreConfig
    from cute_flash.hopper.fp8_config import QuantizeConfig, bwd_quant_config

    for varlen in (False, True):
        pre = BwdSm90Fp8Config(target="sm_90a", dtype="bf16", hdim=64, varlen=varlen).pre()
        assert pre.quantize_do and jit.spill_bytes(pre) == 0
        ptx = jit.compile_artifacts(pre)[0]
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "st.global.v2.b32" in ptx
    quant = bwd_quant_config("bf16", 128)
    assert quant.phase == "quant" and not quant.rotate and not quant.transpose
    with pytest.raises(ValueError, match="phase"):
        QuantizeConfig(target="sm_90a", hdim=128, rotate=False, phase="rows")
    with pytest.raises(ValueError, match="sm89"):
        BwdPreConfig(target="sm_80", quantize_do=True)


def test_opcheck_fp8_backward_op() -> None:
    """``cute_flash::bwd_fp8``'s fake implementation (shapes, dtypes, strides) and registration;
    as for the forward ops, opcheck's schema test does arithmetic CPU e4m3 tensors lack."""
    q, k, v, dout = _inputs(nq=40, nk=40, h=2, hkv=2)
    q, k, v = (t.detach() for t in (q, k, v))
    q8, k8, v8, qd, kd, vd = torch.ops.cute_flash.quantize_qkv(q, k, v, True, 0, True)
    out, lse = torch.ops.cute_flash.fwd_fp8(q8, k8, v8, qd, kd, vd, 0.125, True, -1, -1, torch.bfloat16, True)
    for dlse in (None, torch.randn_like(lse)):
        torch.library.opcheck(torch.ops.cute_flash.bwd_fp8.default,
                              (dout, q8, k8, v, qd, kd, vd, out, lse, dlse, 0.125, True, 0, False),
                              test_utils=("test_faketensor", "test_autograd_registration"))


def test_fp8_true_backward_under_torch_compile_matches_eager() -> None:
    q, k, v, dout = _inputs(nq=40, nk=40, h=2, hkv=2)

    def f(q, k, v):
        return flash_attn_func(q, k, v, causal=True, fp8=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v), dout)
    want = torch.autograd.grad(f(q, k, v), (q, k, v), dout)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_fp8_true_backward_takes_broadcast_gradients_on_cpu() -> None:
    q, k, v, _ = _inputs(nq=30, nk=30, h=2, hkv=2)
    out, lse = flash_attn_func(q, k, v, causal=True, fp8=True, return_lse=True)
    (out.float().sum() + lse.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def _packed(lens_q: list[int], lens_k: list[int], h: int = 4, hkv: int = 2, d: int = 64):
    torch.manual_seed(sum(lens_q))
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(n)], dtype=torch.int32) for n in (lens_q, lens_k))
    q = torch.randn(sum(lens_q), h, d, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), hkv, d, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_true_varlen_backward_is_each_sequence_alone_on_cpu(causal: bool) -> None:
    """Packed sequences (one with no queries, one with no keys) through ``varlen_bwd_fp8``'s
    reference: each sequence's gradients are those of the dense path on it alone (the same
    scales, one per sequence and kv head); an empty side leaves zeros."""
    lens_q, lens_k = [37, 0, 70, 16, 5], [50, 5, 70, 20, 0]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 70, 70, causal=causal, fp8=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for s in range(len(lens_q)):
        (q0, q1), (k0, k1) = cu_q[s:s + 2].tolist(), cu_k[s:s + 2].tolist()
        if q1 == q0 or k1 == k0:
            assert not grads[0][q0:q1].any() and not grads[1][k0:k1].any() and not grads[2][k0:k1].any()
            continue
        parts = [t[a:b][None].detach().requires_grad_() for t, (a, b) in ((q, (q0, q1)), (k, (k0, k1)),
                                                                           (v, (k0, k1)))]
        alone = torch.autograd.grad(flash_attn_func(*parts, causal=causal, fp8=True), parts,
                                    dout[None, q0:q1])
        for g, a, (lo, hi) in zip(grads, alone, ((q0, q1), (k0, k1), (k0, k1)), strict=True):
            assert torch.equal(g[lo:hi], a[0])


def test_padded_starts_follow_the_scratch_layout() -> None:
    """Sequence s of a pack starts at (cu[s] + s tile_m) // tile_m * tile_m in the padded scratch
    rows (and the FP8 backward's Q^T / dO^T): tile-aligned, in order, disjoint, inside the total."""
    cu = torch.tensor([0, 37, 37, 107, 300], dtype=torch.int32)
    starts = launch.padded_starts(cu, 64)
    assert starts.tolist() == [0, 64, 128, 256, 512]
    ends = starts[:-1] + (cu[1:] - cu[:-1])
    assert (ends <= starts[1:]).all() and starts[-1] <= launch.packed_padded_total(300, 4, 64)


def test_opcheck_fp8_varlen_backward_op() -> None:
    q, k, v, cu_q, cu_k = _packed([20, 9], [12, 30], h=2, hkv=2)
    q, k, v = (t.detach() for t in (q, k, v))
    q8, k8, v8, qd, kd, vd = torch.ops.cute_flash.quantize_qkv_varlen(q, k, v, cu_q, cu_k, 20, 30, True, 0,
                                                                       True)
    out, lse = torch.ops.cute_flash.varlen_fwd_fp8(q8, k8, v8, cu_q, cu_k, 20, 30, qd, kd, vd, 0.125, True,
                                                   -1, -1, torch.bfloat16, True)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.cute_flash.varlen_bwd_fp8.default,
                          (dout, q8, k8, v, cu_q, cu_k, 20, 30, qd, kd, vd, out, lse, None, 0.125, True, 0,
                           False),
                          test_utils=("test_faketensor", "test_autograd_registration"))


def test_packed_query_relayout_compiles_in_the_kernel_order() -> None:
    """Q^T / dO^T of packed sequences: the V re-layout kernel with the kernel's token order from
    each sequence's own (padded, 16-aligned) start; without such starts the order is refused."""
    from cute_flash.hopper.fp8_config import QuantizeConfig

    cfg = dispatch.relayout_v_config(128, v_perm=True, varlen=True)
    assert jit.spill_bytes(dataclasses.replace(cfg, target="sm_90a")) == 0
    with pytest.raises(ValueError, match="v_aligned"):
        QuantizeConfig(target="sm_90a", dtype="e4m3", hdim=128, rotate=False, transpose=True, v_perm=True,
                       varlen=True)
