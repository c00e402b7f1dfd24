"""What the FP8 quantize kernels must produce, checked on the CPU: the packed (varlen) reference
against the dense one per sequence, the kernels' cross-lane Walsh-Hadamard data movement emulated
against ``reference_fp8.fwht``, and the launcher refusing bad inputs before anything runs."""

from __future__ import annotations

import pytest
import torch

from cute_flash.formats import E4M3_MAX, as_bytes
from cute_flash.reference_fp8 import fwht, outlier_qkv, quantize_qkv_ref, quantize_qkv_varlen_ref, rotate


def _packed(lens: list[int], h: int, d: int, seed: int):
    """(x (T, h, d) outlier values, cu_seqlens int32) for sequences of the given lengths."""
    x, _, _ = outlier_qkv(1, max(sum(lens), 1), h, d, seed=seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return x[0, :sum(lens)], cu


def test_varlen_reference_with_one_sequence_is_the_dense_reference() -> None:
    q, cu_q = _packed([77], 4, 64, seed=1)
    k, cu_k = _packed([45], 2, 64, seed=2)
    v, _ = _packed([45], 2, 64, seed=3)
    got = quantize_qkv_varlen_ref(q, k, v, cu_q, cu_k, rotate_qk=True, seed=4)
    ref = quantize_qkv_ref(q[None], k[None], v[None], rotate_qk=True, seed=4)
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(as_bytes(g), as_bytes(r[0] if g.dim() == 3 else r))
    # The same token-contiguous V layout, batch dim dropped: (T, H_kv, d) over (H_kv, d, T_pad).
    assert got[2].stride() == ref[2].stride()[1:] == (1, 64 * 48, 48)


def test_varlen_reference_scales_each_sequence_on_its_own() -> None:
    """Per sequence, the dense reference on that sequence alone: its own per-kv-head scales, V in
    the packed token-contiguous storage with zero padding; an empty sequence has descale 0."""
    lens_q, lens_k = [50, 3, 0, 129], [77, 1, 300, 45]
    q, cu_q = _packed(lens_q, 4, 64, seed=1)
    k, cu_k = _packed(lens_k, 2, 64, seed=2)
    v, _ = _packed(lens_k, 2, 64, seed=3)
    q8, k8, v8, *ds = quantize_qkv_varlen_ref(q, k, v, cu_q, cu_k, rotate_qk=True, seed=4)
    tk = sum(lens_k)
    assert q8.shape == q.shape and k8.shape == v8.shape == k.shape and q8.is_contiguous()
    assert v8.stride() == (1, 64 * 432, 432)
    assert all(x.shape == (4, 2) for x in ds)
    store = torch.as_strided(as_bytes(v8), (2, 64, 432), (64 * 432, 432, 1))
    assert (store[..., tk:] == 0).all(), "V padding"
    assert (ds[0][2] == 0).all(), "empty sequence"
    for s in range(4):
        (q0, q1), (k0, k1) = cu_q[s:s + 2].tolist(), cu_k[s:s + 2].tolist()
        if q1 > q0:
            ref = quantize_qkv_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], rotate_qk=True, seed=4)
            assert torch.equal(as_bytes(q8[q0:q1]), as_bytes(ref[0][0]))
            assert all(torch.equal(x[s], r[0]) for x, r in zip(ds, ref[3:], strict=True))
        ref = quantize_qkv_ref(k[None, k0:k1], k[None, k0:k1], v[None, k0:k1], rotate_qk=True, seed=4)
        assert torch.equal(as_bytes(k8[k0:k1]), as_bytes(ref[1][0]))
        assert torch.equal(as_bytes(v8[k0:k1]), as_bytes(ref[2][0]))
        # Not only the dense reference's word for it: x8 * descale is x M (V: x) to e4m3 precision.
        kr = rotate(k[k0:k1].float(), seed=4)
        assert torch.allclose(k8[k0:k1].float() * ds[1][s, None, :, None], kr,
                              rtol=2.0**-3, atol=ds[1][s].max().item() * E4M3_MAX * 2.0**-9)


def test_quantize_qkv_varlen_rejects_bad_inputs_before_any_launch() -> None:
    from cute_flash.launch import quantize_qkv_varlen

    x = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        quantize_qkv_varlen(x.float(), x, x, cu, cu, 10, 10)
    with pytest.raises(ValueError, match="packed"):
        quantize_qkv_varlen(x[None], x, x, cu, cu, 10, 10)


@pytest.mark.parametrize("n_lanes", [32, 8, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_lane_butterflies_are_the_reference_transform(d: int, n_lanes: int) -> None:
    """The kernel's data movement, emulated: lane l of a row's L lanes holds elements l*E ..
    l*E+E-1 (E = d / L); in-thread butterflies for index bits below log2(E), then per lane bit t
    (t < L) a butterfly shuffle where the lane with bit t clear keeps a + b and its partner
    a - b -- equal to ``reference_fp8.fwht``, for a whole warp per row and for several rows per warp."""
    e = d // n_lanes
    x = torch.randn(d, dtype=torch.float64)
    lanes = [x[i * e:(i + 1) * e].clone() for i in range(n_lanes)]
    s = 1
    while s < e:
        for y in lanes:
            for j in range(e):
                if j & s == 0:
                    y[j], y[j + s] = y[j] + y[j + s], y[j] - y[j + s]
        s *= 2
    for t in [1 << i for i in range(n_lanes.bit_length() - 1)]:
        old = [y.clone() for y in lanes]
        for lane in range(n_lanes):
            other = old[lane ^ t]
            lanes[lane] = old[lane] + other if lane & t == 0 else other - old[lane]
    got = torch.cat(lanes) / d**0.5
    assert torch.allclose(got, fwht(x), atol=1e-12)
