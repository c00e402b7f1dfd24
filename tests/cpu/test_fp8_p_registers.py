"""The FP8 forward's P registers, emulated on the CPU from the fragments' thread-value layouts (as
the DSL reports them): the quad exchange moves every byte of the S accumulator to the k32 A slot
the e4m3 wgmma reads it from; with V in the kernel's token order each lane already holds its P
bytes; ``exp_bytes``' codes (one FFMA and an f16 conversion per score) are the reference's
rounded codes; the kernel-order V round-trips."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cute_flash.device.convert import CODE_UNIT, exp_code_offset
from cute_flash.formats import EXP_BYTES_LOG2_SCALE, V_PERM16, unpermute_v, v_kernel_order
from cute_flash.reference_fp8 import e4m3_byte_values, p_log_bytes


def _tv_coords(shape, stride, m: int, thread: int, nvals: int) -> list[tuple[int, int]]:
    """(row, col) of each value of ``thread`` under a thread-value layout over an (m, *) tile
    (column-major linear index), values in register (colexicographic) order."""
    def flat(coord_shape, coord_stride, i):
        out = 0
        for s, d in zip(coord_shape, coord_stride, strict=True):
            out += (i % s) * d
            i //= s
        return out

    t = flat(shape[0], stride[0], thread)
    idx = [t + flat(shape[1], stride[1], v) for v in range(nvals)]
    return [(i % m, i // m) for i in idx]


@pytest.mark.parametrize("tile_n", [64, 96, 128])
def test_quad_exchange_puts_each_p_byte_in_its_k32_a_slot(tile_n: int) -> None:
    """The S accumulator (``m64n{tile_n}k32`` C: ((4,8,4),(2,2,N/8)):((128,1,16),(64,8,512))) and
    the e4m3 A fragment of each 32-key block (((4,8,4),(4,2,2)):((256,1,16),(64,8,1024))), as the
    DSL reports them; the exchange below is ``hopper.fwd_fp8.quad_exchange_p`` on byte labels."""
    c_shape, c_stride = ((4, 8, 4), (2, 2, tile_n // 8)), ((128, 1, 16), (64, 8, 512))
    a_shape, a_stride = ((4, 8, 4), (4, 2, 2)), ((256, 1, 16), (64, 8, 1024))
    nkb = tile_n // 32
    # Registers of every thread: 32-bit words of 4 byte labels (row, col).
    regs = {}
    for t in range(128):
        c = _tv_coords(c_shape, c_stride, 64, t, 4 * (tile_n // 8))
        regs[t] = [c[4 * w:4 * w + 4] for w in range(tile_n // 8)]
    new = {t: [None] * len(regs[t]) for t in regs}
    for t in range(128):
        lane = t % 32
        q, base = lane & 3, t - (lane & 3)
        src_a = base + ((q >> 1) | ((q & 1) << 1))
        src_b = base + (((q >> 1) ^ 1) | ((q & 1) << 1))
        for kb in range(nkb):
            for h in range(2):
                # The sender picks the word by its own lane parity (round b: the other one).
                ra = regs[src_a][4 * kb + 2 * h + ((src_a % 32) & 1)]
                rb = regs[src_b][4 * kb + 2 * h + ((src_b % 32) & 1 ^ 1)]
                x0, x1 = (rb, ra) if q >= 2 else (ra, rb)
                new[t][4 * kb + 2 * h] = [x0[0], x0[1], x1[0], x1[1]]
                new[t][4 * kb + 2 * h + 1] = [x0[2], x0[3], x1[2], x1[3]]
    for t in range(128):
        for kb in range(nkb):
            want = _tv_coords(a_shape, a_stride, 64, t, 16)
            got = [b for w in new[t][4 * kb:4 * kb + 4] for b in w]
            assert got == [(r, k + 32 * kb) for r, k in want], (t, kb)


@pytest.mark.parametrize("tile_n", [64, 96, 128, 192])
def test_with_v_in_kernel_order_each_lane_already_holds_its_p_bytes(tile_n: int) -> None:
    """``hopper.fwd_fp8.merge_own_p`` on byte labels: with V stored in ``formats.V_PERM16`` order,
    the k32 A slot of every thread at position k of each 32 keys gets P of the key stored there,
    from the thread's own accumulator registers (no lane exchange)."""
    c_shape, c_stride = ((4, 8, 4), (2, 2, tile_n // 8)), ((128, 1, 16), (64, 8, 512))
    a_shape, a_stride = ((4, 8, 4), (4, 2, 2)), ((256, 1, 16), (64, 8, 1024))
    for t in range(128):
        c = _tv_coords(c_shape, c_stride, 64, t, 4 * (tile_n // 8))
        words = [c[4 * w:4 * w + 4] for w in range(tile_n // 8)]
        want = _tv_coords(a_shape, a_stride, 64, t, 16)
        for kb in range(tile_n // 32):
            merged = []
            for h in range(2):
                w0, w1 = words[4 * kb + 2 * h], words[4 * kb + 2 * h + 1]
                merged += [[w0[0], w0[1], w1[0], w1[1]], [w0[2], w0[3], w1[2], w1[3]]]
            got = [b for w in merged for b in w]
            stored = [(r, 32 * kb + 16 * (k // 16) + V_PERM16[k % 16]) for r, k in want]
            assert got == stored, (t, kb)


@pytest.mark.parametrize("tile_n", [128, 192])
def test_p_codes_are_gathered_into_the_words_the_merge_or_the_exchange_expects(tile_n: int) -> None:
    """``exp_bytes`` packs the codes straight from the S registers: with V in the kernel order into
    the words ``merge_own_p`` makes of converted pairs (row r + 8 i halves of accumulator words
    w, w + 1), else the accumulator's own words (the quad exchange's input)."""
    from cute_flash.hopper.fwd_fp8 import p_code_sources

    acc_words = [[4 * w + j for j in range(4)] for w in range(tile_n // 8)]
    merged = []
    for kb in range(tile_n // 32):
        for h in range(2):
            w0, w1 = acc_words[4 * kb + 2 * h], acc_words[4 * kb + 2 * h + 1]
            merged += [[w0[0], w0[1], w1[0], w1[1]], [w0[2], w0[3], w1[2], w1[3]]]
    assert [list(x) for x in p_code_sources(tile_n, v_perm=True)] == merged
    assert [list(x) for x in p_code_sources(tile_n, v_perm=False)] == acc_words


def test_p_code_from_the_ffma_and_f16_conversion_is_the_references_rounded_code() -> None:
    """The arithmetic of ``exp_bytes``: fp32(s * 8 c 2^-24 + (code(2^offset) - ref8) 2^-24) is
    the code times 2^-24, an f16 subnormal whose ulp is 2^-24, so the (relu) f32 -> f16 conversion
    rounds it to the nearest-even integer code -- the one ``reference_fp8.p_log_bytes`` takes -- with
    codes below 0 and masked (-inf) scores at +0."""
    rng = np.random.default_rng(0)
    c = np.float32(1.0 / math.sqrt(128) * math.log2(math.e))
    s = rng.normal(0.0, 4.0, 200_000).astype(np.float32)
    s[::97] = -np.inf
    m = np.float32(np.max(s))
    ref8 = np.ceil(np.float32(m * np.float32(c * np.float32(8.0))))
    scale = np.float32(c * np.float32(8.0 * CODE_UNIT))
    bias = np.float32((np.float32(exp_code_offset(EXP_BYTES_LOG2_SCALE)) - ref8) * np.float32(CODE_UNIT))
    assert float(bias) / CODE_UNIT == exp_code_offset(EXP_BYTES_LOG2_SCALE) - float(ref8)  # exact
    with np.errstate(invalid="ignore"):
        x = (s.astype(np.float64) * np.float64(scale) + np.float64(bias)).astype(np.float32)
    half = np.maximum(x, np.float32(0.0)).astype(np.float16)  # round to nearest even, subnormal
    codes = half.view(np.uint16).astype(np.int64)
    assert codes.max() <= 0x7E and (codes[::97] == 0).all()
    want = p_log_bytes(torch.from_numpy(s.astype(np.float64) * float(c) - float(ref8) / 8.0
                                        + EXP_BYTES_LOG2_SCALE)).double()
    got = e4m3_byte_values()[torch.from_numpy(codes)].double()
    # The reference computes x in fp64, the kernel in one fp32 FFMA: a code may differ at a tie.
    assert (got != want).double().mean().item() < 1e-4
    assert torch.allclose(got, want, rtol=0.13, atol=2.0 ** -9)


def test_kernel_order_v_round_trips_and_pads_with_zeros() -> None:
    v = torch.randn(2, 37, 3, 64).to(torch.float8_e4m3fn)
    store = v_kernel_order(v)
    assert store.shape == (2, 3, 64, 48)
    assert torch.equal(unpermute_v(store, 37).float(), v.float())
    assert (store.float().abs().sum(dim=(0, 1, 2)) > 0).sum() == 37  # 11 zero padding positions
