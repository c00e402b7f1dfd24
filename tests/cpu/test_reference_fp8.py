"""The FP8 references against dense math: the Hadamard rotation is orthogonal and leaves
Q K^T unchanged, the quantizer stays within e4m3 rounding of its input with FA3's per-(batch, kv
head) scales, the FP8 attention reference equals dense attention on the dequantized inputs, and on
the FA3 paper's outlier inputs the rotation lowers the error."""

from __future__ import annotations

import math

import pytest
import torch

from cute_flash.formats import E4M3_MAX, hadamard_signs
from cute_flash.reference import attention_ref
from cute_flash.reference_fp8 import (
    attention_fp8_ref,
    fp8_rmse_table,
    fwht,
    hadamard_matrix,
    outlier_qkv,
    quantize_qkv_ref,
    rotate,
)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_fwht_is_the_dense_normalised_hadamard_product(d: int) -> None:
    x = torch.randn(3, 7, d, dtype=torch.float64)
    dense = x @ hadamard_matrix(d) / math.sqrt(d)
    assert torch.allclose(fwht(x), dense, atol=1e-12)


def test_hadamard_rejects_head_dims_that_are_not_powers_of_two() -> None:
    with pytest.raises(ValueError):
        fwht(torch.randn(2, 96))


def test_rotation_is_orthogonal_and_keeps_qk_products() -> None:
    q = torch.randn(2, 33, 4, 128, dtype=torch.float64)
    k = torch.randn(2, 17, 4, 128, dtype=torch.float64)
    qr, kr = rotate(q, seed=3), rotate(k, seed=3)
    assert torch.allclose(qr.norm(dim=-1), q.norm(dim=-1), rtol=1e-12)
    s = torch.einsum("bihd,bjhd->bhij", q, k)
    s_rot = torch.einsum("bihd,bjhd->bhij", qr, kr)
    assert torch.allclose(s, s_rot, atol=1e-10)
    # Another seed is another rotation (the same one must be used for Q and K).
    assert not torch.allclose(rotate(q, seed=4), qr)
    assert torch.equal(hadamard_signs(128, 3), hadamard_signs(128, 3))


def test_quantize_stays_within_e4m3_rounding_with_group_scales() -> None:
    torch.manual_seed(0)
    b, n, h, hkv, d = 2, 50, 4, 2, 64
    q = torch.randn(b, n, h, d) * torch.linspace(0.5, 4.0, h).reshape(1, 1, h, 1)
    k, v = torch.randn(b, n, hkv, d) * 3.0, torch.randn(b, n, hkv, d)
    q8, k8, v8, qd, kd, vd = quantize_qkv_ref(q, k, v, rotate_qk=True, seed=1)
    assert q8.dtype == k8.dtype == v8.dtype == torch.float8_e4m3fn
    assert qd.shape == kd.shape == vd.shape == (b, hkv) and qd.dtype == torch.float32
    assert v8.shape == v.shape and v8.stride(1) == 1  # sequence-contiguous storage
    for x, x8, ds, rot in ((q, q8, qd, True), (k, k8, kd, True), (v, v8, vd, False)):
        ref = rotate(x, seed=1) if rot else x
        group = x.shape[2] // hkv
        deq = x8.float() * ds.repeat_interleave(group, dim=1).reshape(b, 1, x.shape[2], 1)
        # amax of each (batch, kv-head) group maps to the largest e4m3 value.
        amax = ref.abs().reshape(b, n, hkv, group, d).amax(dim=(1, 3, 4))
        assert torch.allclose(ds * E4M3_MAX, amax, rtol=1e-6)
        # Round to nearest with 3 mantissa bits: relative error <= 2^-4 in the normal range, plus
        # the subnormal step (2^-9 of the scale) near zero.
        step = ds.repeat_interleave(group, dim=1).reshape(b, 1, x.shape[2], 1) * 2.0**-9
        assert ((deq - ref).abs() <= ref.abs() * 2.0**-4 + step).all()


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_attention_reference_is_dense_attention_on_dequantized_inputs(causal: bool) -> None:
    torch.manual_seed(1)
    b, nq, nk, h, hkv, d = 1, 40, 56, 4, 2, 64
    q, k, v = torch.randn(b, nq, h, d), torch.randn(b, nk, hkv, d), torch.randn(b, nk, hkv, d)
    q8, k8, v8, qd, kd, vd = quantize_qkv_ref(q, k, v, rotate_qk=False)
    out, lse = attention_fp8_ref(q8, k8, v8, qd, kd, vd, causal=causal, quantize_p=False)

    def deq(x8: torch.Tensor, ds: torch.Tensor) -> torch.Tensor:
        g = x8.shape[2] // hkv
        return (x8.double() * ds.double().repeat_interleave(g, dim=1).reshape(b, 1, x8.shape[2], 1))

    ref, ref_lse = attention_ref(deq(q8, qd), deq(k8, kd), deq(v8, vd), causal=causal)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)
    # With P in e4m3 the output moves by about its rounding, not more.
    out_p8, _ = attention_fp8_ref(q8, k8, v8, qd, kd, vd, causal=causal)
    assert (out_p8.double() - ref).abs().max() < 0.1 * ref.abs().max()


@pytest.mark.parametrize("d", [128, 256])
def test_rotation_lowers_fp8_error_on_outlier_inputs(d: int) -> None:
    """The FA3 paper's experiment at a CPU-sized N: the rotation lowers the FP8 error by a clear
    margin (N = 1k: 1.6-2.0x; N = 4k, measured here: d=128 1.84e-2 -> 8.9e-3, d=256 2.0e-2 ->
    7.4e-3; bf16 1.5-2e-3)."""
    q, k, v = outlier_qkv(1, 1024, 2, d, seed=1)
    t = fp8_rmse_table(q, k, v)
    assert t["fp8_rotated"] < 0.75 * t["fp8"], t
    assert t["bf16"] < t["fp8_rotated"], t


def test_varlen_v_offsets_are_remembered_per_tensor_until_it_is_written() -> None:
    """The per-sequence 16-aligned V starts: each length rounded up to 16 after the previous start;
    computed once per cu_seqlens tensor, again after an in-place write (version counter) and for
    another tensor with the same values."""
    from cute_flash.formats import v_varlen_aligned, v_varlen_packed, varlen_v_offsets

    cu = torch.tensor([0, 5, 5, 40, 41], dtype=torch.int32)
    cu_v, t_v = varlen_v_offsets(cu, 41)
    assert cu_v.tolist() == [0, 16, 16, 64, 80] and t_v == 48 + 16 * 4
    again, _ = varlen_v_offsets(cu, 41)
    assert again is cu_v
    cu[1:4] += 1  # an in-place write (lengths 6, 0, 35, 0): the remembered starts are stale
    fresh, _ = varlen_v_offsets(cu, 41)
    assert fresh is not cu_v and fresh.tolist() == [0, 16, 16, 64, 64]
    other, _ = varlen_v_offsets(cu.clone(), 41)
    assert other is not fresh and other.tolist() == fresh.tolist()
    # And the aligned layout round-trips.
    v = torch.randn(41, 2, 16).to(torch.float8_e4m3fn)
    aligned, _ = v_varlen_aligned(v, cu)
    assert torch.equal(v_varlen_packed(aligned, cu, 41).view(torch.uint8), v.view(torch.uint8))


def test_summing_the_quantized_p_makes_each_output_row_a_weighted_average() -> None:
    """``sum_quantized_p`` (the kernel's ``sum_mma``): O is divided by the sum of the e4m3 P that
    multiplied V, so a V of ones gives exactly ones; with the unquantized sums it is off by P's
    rounding, and the LSE moves by about that much."""
    torch.manual_seed(0)
    q8, k8 = (torch.randn(1, 64, 2, 32).to(torch.float8_e4m3fn) for _ in range(2))
    v8 = torch.ones(1, 64, 2, 32).to(torch.float8_e4m3fn)
    ds = [torch.ones(1, 2) for _ in range(3)]
    exact, lse_q = attention_fp8_ref(q8, k8, v8, *ds, sum_quantized_p=True)
    plain, lse = attention_fp8_ref(q8, k8, v8, *ds)
    assert torch.allclose(exact, torch.ones_like(exact), atol=1e-6)
    assert (plain - 1).abs().max() > 1e-4
    assert (lse_q - lse).abs().max() < 0.05
