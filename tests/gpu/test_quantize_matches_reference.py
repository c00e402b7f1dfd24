"""The quantize-and-rotate kernels of the FP8 forward on a Hopper GPU: they match
``reference_fp8.quantize_qkv_ref`` / ``quantize_qkv_varlen_ref`` within one e4m3 step, dense and
packed, with one or several rows per warp; the V re-layout kernel is the reference layout bit
for bit."""

from __future__ import annotations

import pytest
import torch

from cute_flash import dispatch, launch
from cute_flash.formats import as_bytes, token_contiguous, v_kernel_order, v_varlen_aligned
from cute_flash.hopper import fp8_config
from cute_flash.reference_fp8 import outlier_qkv, quantize_qkv_ref, quantize_qkv_varlen_ref

from attention_checks import needs_hopper

pytestmark = [pytest.mark.gpu, needs_hopper]


def _quant_close(got, ref) -> None:
    """Kernel vs reference outputs: descales equal to fp32 rounding; e4m3 values nearly all equal,
    the others one e4m3 step (2^-3 relative) apart, never more -- the kernel's fp32 butterflies
    and its IEEE 448 / amax (torch's is 1 / amax * 448) may round differently from the
    reference's. A NaN (an e4m3 byte never written) fails the ``<=``."""
    for name, g, r in zip(("q_descale", "k_descale", "v_descale"), got[3:], ref[3:], strict=True):
        assert g.shape == r.shape and torch.allclose(g, r, rtol=1e-5), name
    for name, g, r in zip("qkv", got[:3], ref[:3], strict=True):
        assert g.shape == r.shape and g.dtype == torch.float8_e4m3fn, name
        gf, rf = g.float(), r.float()
        assert ((gf - rf).abs() <= rf.abs() * 2.0**-3 + 2.0**-9).all(), name
        assert (gf == rf).float().mean() > 0.95, name


def _packed(lens: list[int], h: int, d: int, seed: int):
    """(x (T, h, d) outlier values, cu_seqlens int32) for sequences of the given lengths."""
    x, _, _ = outlier_qkv(1, max(sum(lens), 1), h, d, seed=seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return x[0, :sum(lens)], cu


@pytest.mark.parametrize("v_perm", [False, True], ids=["v-natural", "v-kernel-order"])
@pytest.mark.parametrize("d,hkv,n", [(64, 2, 100), (128, 1, 1000), (256, 4, 77)])
def test_quantize_qkv_matches_the_reference_within_one_e4m3_step(d: int, hkv: int, n: int,
                                                                 v_perm: bool) -> None:
    q, _, _ = outlier_qkv(2, n + 3, 4, d, seed=5, device="cuda", dtype=torch.bfloat16)
    _, k, v = outlier_qkv(2, n, hkv, d, seed=6, device="cuda", dtype=torch.bfloat16)
    got = launch.quantize_qkv(q, k, v, rotate=True, seed=7, v_perm=v_perm)
    ref = quantize_qkv_ref(q, k, v, rotate_qk=True, seed=7, v_perm=v_perm)
    _quant_close(got, ref)
    # V: sequence-contiguous; in the kernel order, the whole (B, H_kv, d, N_pad) storage.
    assert got[2].stride(-1 if v_perm else 1) == 1


@pytest.mark.parametrize("d,lanes,varlen", [(64, 16, False), (64, 8, False), (64, 8, True), (128, 8, False),
                                            (128, 4, False), (256, 16, False), (128, 8, True),
                                            (256, 8, True)])
def test_several_rows_per_warp_quantize_q_and_k_bit_for_bit_as_one_row_per_warp(d: int, lanes: int,
                                                                                varlen: bool,
                                                                                monkeypatch) -> None:
    """Q / K with fewer than 32 lanes per row (``quant_configs(..., qk_lanes=...)``): the same
    butterflies in the same order, only on other lanes, so Q and K (and the descales) come out
    byte-identical to the whole-warp kernels; partial last CTAs (rows past the end) and, packed,
    uneven sequences."""
    q, _, _ = outlier_qkv(2, 301, 4, d, seed=5, device="cuda", dtype=torch.bfloat16)
    _, k, v = outlier_qkv(2, 157, 2, d, seed=6, device="cuda", dtype=torch.bfloat16)
    if varlen:
        lens_q, lens_k = [301, 0, 45, 255], [157, 3, 0, 154]
        q, k, v = (x.reshape(-1, x.shape[2], d)[:sum(lens)] for x, lens in ((q, lens_q), (k, lens_k),
                                                                            (v, lens_k)))
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32,
                                   device="cuda") for x in (lens_q, lens_k))

        def run():
            return launch.quantize_qkv_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seed=9)
    else:
        def run():
            return launch.quantize_qkv(q, k, v, seed=9)

    def with_lanes(n: int):
        # The launchers take their kernels from ``dispatch.quant_configs``: the same ones, with
        # Q / K's lanes per row set.
        monkeypatch.setattr(dispatch, "quant_configs",
                            lambda *a, **kw: fp8_config.quant_configs(*a, **kw, qk_lanes=n))
        return run()

    whole = with_lanes(32)
    split = with_lanes(lanes)
    for i in (0, 1):
        assert torch.equal(as_bytes(split[i]), as_bytes(whole[i])), "qk"[i]
    for a, b in zip(split[3:], whole[3:], strict=True):
        assert torch.equal(a, b)
    if not varlen:
        _quant_close(split, quantize_qkv_ref(q, k, v, rotate_qk=True, seed=9))


@pytest.mark.parametrize("lens_q,lens_k", [([77, 1, 300, 45], [77, 1, 300, 45]),
                                           ([50, 0, 129, 3], [77, 1, 300, 0]),
                                           ([1000], [17])],
                         ids=["uneven", "empty-sequences", "one-sequence"])
@pytest.mark.parametrize("d,h,hkv", [(64, 4, 2), (128, 4, 1), (256, 2, 2)])
def test_quantize_qkv_varlen_matches_the_reference_within_one_e4m3_step(d: int, h: int, hkv: int,
                                                                        lens_q: list[int],
                                                                        lens_k: list[int],
                                                                        monkeypatch) -> None:
    """Sequence lengths off the 16-token chunks: V chunks straddle sequences (two CTAs, two
    scales, byte stores) and the padding past T_k is the last token's CTA's to zero."""
    q, cu_q = _packed(lens_q, h, d, seed=5)
    k, cu_k = _packed(lens_k, hkv, d, seed=6)
    v, _ = _packed(lens_k, hkv, d, seed=7)
    q, k, v, cu_q, cu_k = (t.cuda() for t in (q, k, v, cu_q, cu_k))
    q, k, v = (t.bfloat16() for t in (q, k, v))
    tk, tk_pad = sum(lens_k), (sum(lens_k) + 15) // 16 * 16
    # Every e4m3 buffer starts as NaN bytes (0x7F): a byte the kernels leave unwritten, the V
    # padding included, fails the comparisons below.
    empty = torch.empty

    def nan_filled(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.view(torch.uint8).fill_(0x7F).view(t.dtype) if t.dtype == torch.float8_e4m3fn else t

    monkeypatch.setattr(torch, "empty", nan_filled)
    got = launch.quantize_qkv_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), rotate=True, seed=8)
    aligned = launch.quantize_qkv_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), rotate=True, seed=8,
                                         v_aligned=True)
    monkeypatch.undo()
    ref = quantize_qkv_varlen_ref(q, k, v, cu_q, cu_k, rotate_qk=True, seed=8)
    _quant_close(got, ref)
    # V written straight into the kernel's layout: the same bytes as re-laying the packed V.
    want_v, _ = v_varlen_aligned(got[2], cu_k)
    assert aligned[2].shape == want_v.shape and aligned[2].stride() == want_v.stride()
    assert torch.equal(as_bytes(aligned[2]), as_bytes(want_v))
    for a, b in zip(aligned[:2] + aligned[3:], got[:2] + got[3:], strict=True):
        assert torch.equal(a.float(), b.float())
    assert got[0].is_contiguous() and got[1].is_contiguous()
    assert got[2].stride() == (1, d * tk_pad, tk_pad)
    store = torch.as_strided(as_bytes(got[2]), (hkv, d, tk_pad), (d * tk_pad, tk_pad, 1))
    assert (store[..., tk:] == 0).all(), "V padding"


@pytest.mark.parametrize("v_perm", [False, True], ids=["v-natural", "v-kernel-order"])
@pytest.mark.parametrize("d,n", [(64, 517), (128, 16), (256, 33)])
def test_relayout_v_is_the_reference_layout_bit_for_bit(d: int, n: int, v_perm: bool) -> None:
    """A caller's e4m3 V through the V quantize kernel at scale 1: exactly the bytes of
    ``formats.v_kernel_order`` / ``token_contiguous`` (padding zeros), also from a
    non-contiguous view."""
    torch.manual_seed(d + n)
    big = (torch.randn(2, n, 6, d, device="cuda") * 30).to(torch.float8_e4m3fn)
    for v8 in (big[:, :, :3].contiguous(), big[:, :, 1:4]):
        got = launch.relayout_v(v8, v_perm=v_perm)
        want = v_kernel_order(v8) if v_perm else token_contiguous(v8).permute(0, 2, 3, 1)
        if not v_perm:
            store = torch.zeros_like(got, dtype=torch.uint8)
            store[..., :n] = as_bytes(want)
            want = store
        assert torch.equal(as_bytes(got), as_bytes(want))


@pytest.mark.parametrize("d", [64, 128, 256])
def test_relayout_v_varlen_is_the_reference_aligned_layout_bit_for_bit(d: int) -> None:
    """A caller's packed e4m3 V through the V quantize kernel at scale 1 with 16-aligned sequence
    starts: the bytes of ``formats.v_varlen_aligned`` (gaps and slack zero), same offsets."""
    torch.manual_seed(d)
    lens = [77, 0, 1, 300, 16, 45]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    big = (torch.randn(sum(lens), 5, d, device="cuda") * 30).to(torch.float8_e4m3fn)
    for v8 in (big[:, :2].contiguous(), big[:, 1:3]):
        got, cu_v = launch.relayout_v_varlen(v8, cu, max(lens))
        want, cu_v_ref = v_varlen_aligned(v8, cu)
        assert torch.equal(cu_v, cu_v_ref)
        assert got.shape == want.shape and torch.equal(as_bytes(got), as_bytes(want))
