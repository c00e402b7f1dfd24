"""The FMA-pipe 2^x of ``kernels/softmax.exp2_poly``, mirrored step by step in fp32 numpy (the
same constants the PTX embeds): relative error, exact powers of two, and masked scores (-inf)
coming out as exact zeros."""

from __future__ import annotations

import numpy as np

from cute_flash.kernels import softmax


def _mirror(x: np.ndarray) -> np.ndarray:
    f32 = np.float32
    c1, c2, c3 = (f32(c) for c in softmax.EXP2_POLY)
    x = np.maximum(x.astype(f32), f32(-127.0))
    t = (x + f32(12582912.0)).astype(f32)
    f = (x - (t - f32(12582912.0))).astype(f32)
    p = ((f * c3 + c2) * f + c1).astype(f32)
    p = (p * f + f32(1.0)).astype(f32)
    bits = (p.view(np.uint32).astype(np.uint64) + (t.view(np.uint32).astype(np.uint64) << 23)) & 0xFFFFFFFF
    return bits.astype(np.uint32).view(f32)


def test_the_ptx_embeds_the_mirrored_constants() -> None:
    ptx = softmax._EXP2_POLY_PTX
    for c in softmax.EXP2_POLY:
        assert softmax._f32_hex(c) in ptx
    for const in ("0fC2FE0000", "0f4B400000", "0f3F800000"):  # -127, 1.5 * 2^23, 1
        assert const in ptx


def test_poly_exp2_is_within_1_1e4_relative_over_the_softmax_range() -> None:
    x = np.linspace(-125.0, 8.0, 400_001, dtype=np.float32)  # FP8 P: up to 2^8
    rel = np.abs(_mirror(x) / np.exp2(x.astype(np.float64)) - 1.0)
    assert rel.max() < 1.1e-4


def test_poly_exp2_is_exact_at_integers_and_zero_for_masked_scores() -> None:
    ints = np.arange(-126, 9, dtype=np.float32)
    assert np.array_equal(_mirror(ints), np.exp2(ints))
    out = _mirror(np.array([-np.inf, -1e30, -1000.0, -127.0], dtype=np.float32))
    assert np.array_equal(out, np.zeros(4, dtype=np.float32)) and not np.signbit(out).any()
