"""The FP8 backward's recipe in PyTorch (``reference_fp8_bwd``): its algebra against fp64 autograd,
its tile scales, and what the accuracy study rests on."""

import pytest
import torch

from cute_flash import reference_fp8_bwd as r
from cute_flash.reference_fp8 import outlier_qkv


def _inputs(nq=150, nk=200, h=4, hkv=2, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, nq, h, d, generator=gen)
    k, v = (torch.randn(1, nk, hkv, d, generator=gen) for _ in range(2))
    dout = torch.randn(1, nq, h, d, generator=gen)
    return tuple(t.bfloat16() for t in (q, k, v, dout))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rotate_qk,rotate_do", [(False, False), (True, False), (True, True)])
def test_the_recipe_in_exact_arithmetic_gives_autograds_gradients(causal: bool, rotate_qk: bool,
                                                                   rotate_do: bool) -> None:
    """Tiles, GQA groups, lengths off the tile grid, rotations undone: with no rounding anywhere the
    tiled recipe is the exact backward."""
    q, k, v, dout = _inputs()
    recipe = r.Fp8BwdRecipe(qkv="fp32", rotate_qk=rotate_qk, rotate_do=rotate_do, p="fp32", ds="fp32",
                            do="fp32", block_m=64, block_n=48)
    got = r.attention_fp8_bwd_ref(q, k, v, dout, causal=causal, recipe=recipe)
    want = r.exact_grads(q, k, v, dout, causal=causal)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g.double(), w, atol=1e-5 * w.abs().max().item(), rtol=0)


@pytest.mark.parametrize("fmt,top,step", [("e4m3", 448.0, 2.0 ** -4), ("e5m2", 57344.0, 2.0 ** -3)])
def test_a_tile_scale_saturates_nothing_and_rounds_within_one_step(fmt: str, top: float, step: float) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, 64, generator=gen) * torch.logspace(-3, 3, 6).view(2, 3, 1, 1)
    y = r.round_tile(x, fmt)
    amax = x.abs().amax(dim=(-2, -1), keepdim=True)
    assert torch.all(y.abs() <= amax * (1 + 1e-6))
    torch.testing.assert_close(y.abs().amax(dim=(-2, -1), keepdim=True), amax, rtol=1e-6, atol=0)
    normal = x.abs() >= amax * 2.0 ** -6  # (above the formats' subnormals once scaled)
    assert torch.all((y - x).abs()[normal] <= step * x.abs()[normal])


def test_rotating_q_and_k_lowers_the_fp8_gradient_error_on_outlier_inputs() -> None:
    q, k, v = outlier_qkv(1, 512, 2, 128, seed=0)
    dout = torch.randn(1, 512, 2, 128, generator=torch.Generator().manual_seed(0))
    recipes = {"plain": r.Fp8BwdRecipe(rotate_qk=False), "rotated": r.Fp8BwdRecipe()}
    table = r.fp8_bwd_rmse_table(q, k, v, dout, recipes=recipes, block=(64, 64))
    for g in ("dq", "dk", "dv"):
        assert table["rotated"][g] < table["plain"][g], (g, table)


def test_the_bf16_recipe_is_more_accurate_than_pytorchs_bf16_math() -> None:
    """The yardstick (the bf16 kernels' recipe: fp32 P and dS rounded to bf16 only for their GEMMs)
    beats autograd through attention in bf16, the correctness rule's reference."""
    q, k, v, dout = _inputs(nq=200, nk=200, h=2, hkv=2)
    table = r.fp8_bwd_rmse_table(q, k, v, dout, causal=True, recipes={"bf16": r.BF16_RECIPE}, block=(64, 64))
    for g in ("dq", "dk", "dv"):
        assert table["bf16"][g] < table["PyTorch bf16 math"][g], (g, table)


@pytest.mark.parametrize("kw", [dict(p="e3m4"), dict(ds="e4m3_fixed"), dict(do="e4m3_fixed"),
                                dict(qkv="fp16")])
def test_a_recipe_with_an_unknown_format_raises(kw: dict) -> None:
    with pytest.raises(ValueError):
        r.Fp8BwdRecipe(**kw)


def test_row_scaled_do_keeps_the_small_rows_that_one_scale_per_head_flushes() -> None:
    """Rows of dO a million times below the head's largest fall under e4m3's range with one scale
    per head (their queries get no gradient); with one scale per row they keep e4m3's precision."""
    q, k, v, dout = (t.float() for t in _inputs(nq=128, nk=128, h=2, hkv=2))
    small = torch.arange(128) % 2 == 1
    dout[:, small] *= 1e-6
    want = r.exact_grads(q, k, v, dout, causal=True)[0][:, small]
    exact = dict(qkv="fp32", rotate_qk=False, p="fp32", ds="fp32", block_m=64, block_n=64)

    def err(fmt: str) -> float:
        got = r.attention_fp8_bwd_ref(q, k, v, dout, causal=True, recipe=r.Fp8BwdRecipe(do=fmt, **exact))[0]
        return ((got[:, small].double() - want).norm() / want.norm()).item()

    assert err("e4m3") > 0.9
    assert err("e4m3_row") < 0.1
