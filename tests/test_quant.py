"""The quantize-and-rotate kernels (issue 5) compile for sm_90a with the instructions their design
names -- butterfly shuffles for the cross-lane Walsh-Hadamard stages, saturating e4m3 converts,
one atomic max per warp -- and no local memory, dense and packed (varlen); on a GPU they match
``fp8_ref.quantize_qkv_ref`` / ``quantize_qkv_varlen_ref``."""

from __future__ import annotations

import re

import pytest

from cute_flash import jit
from cute_flash.hopper.quant import ROWS_IN_FLIGHT
from cute_flash.quant import QuantizeConfig, quant_configs


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


VARIANTS = [c for d in (64, 128, 256) for c in quant_configs("bf16", d, rotate=True)]
VARIANTS += quant_configs("fp16", 128, rotate=False)
VARIANTS += [c for d in (64, 128, 256)
             for c in quant_configs("bf16", d, rotate=True, v_perm=True) if c.v_perm]
VARIANTS += [c for d in (64, 128, 256) for c in quant_configs("bf16", d, rotate=True, varlen=True)]
VARIANTS += quant_configs("fp16", 128, rotate=False, varlen=True)
# The fp8=True varlen path's V: bf16 straight into the 16-aligned per-sequence layout.
VARIANTS += [c for d in (64, 128, 256)
             for c in quant_configs("bf16", d, rotate=True, varlen=True, v_aligned=True) if c.v_aligned]
# A caller's e4m3 V re-laid out (scale 1), both token orders, and packed with 16-aligned starts.
VARIANTS += [QuantizeConfig(target=None, dtype="e4m3", hdim=d, rotate=False, transpose=True, phase="quant",
                            v_perm=p) for d in (64, 128, 256) for p in (False, True)]
VARIANTS += [QuantizeConfig(target=None, dtype="e4m3", hdim=d, rotate=False, transpose=True, phase="quant",
                            varlen=True, v_aligned=True) for d in (64, 128, 256)]
# Q / K with several rows per warp (fewer lanes per row, fewer shuffle rounds), dense and packed.
VARIANTS += [c for d, lanes, varlen in ((64, 16, False), (128, 8, False), (128, 4, False), (256, 16, False),
                                        (128, 8, True), (256, 8, True))
             for c in quant_configs("bf16", d, rotate=True, varlen=varlen, qk_lanes=lanes) if not c.transpose]
VARIANTS = [QuantizeConfig(**{**c.__dict__, "target": "sm_90a"}) for c in VARIANTS]


def _id(c: QuantizeConfig) -> str:
    v = "v-kernel-order" if c.v_perm else "v-aligned" if c.v_aligned else "v"
    packed = "-varlen" if c.varlen else ""
    lanes = f"-{c.lanes_per_row}-lanes" if c.lanes_per_row != 32 else ""
    kind = v if c.transpose else "qk-rot" if c.rotate else "qk"
    return f"{c.dtype}-d{c.hdim}-{c.phase}-{kind}{packed}{lanes}"


@pytest.mark.parametrize("cfg", VARIANTS, ids=_id)
def test_quantize_kernels_compile_with_shuffles_converts_and_no_local_memory(cfg: QuantizeConfig) -> None:
    ptx, _ = jit.compile_artifacts(cfg)
    per_lane = cfg.hdim // cfg.lanes_per_row
    # log2(lanes per row) cross-lane stages (5 for a whole warp), one shuffle per element, for each
    # of the rows a warp has in flight.
    stages = cfg.lanes_per_row.bit_length() - 1
    butterflies = stages * per_lane * ROWS_IN_FLIGHT if cfg.rotate else 0
    reduce = 5 if cfg.phase == "amax" else 0  # the warp's max
    assert _count(ptx, r"shfl\.sync\.bfly") == butterflies + reduce
    # Those rows' loads all issue before the first is used (latency: one row at a time left the
    # memory system idle): ROWS_IN_FLIGHT loads of the input per loop body, before any convert.
    body = ptx[ptx.index("$L__BB"):]
    first_use = re.search(r"cvt\.f32\.(bf16|f16)", body)
    if cfg.dtype != "e4m3":
        loads = re.findall(r"ld\.global(?:\.nc)?(?:\.v\d)?\.(?:b|u)(?:16|32|64)", body[:first_use.start()])
        assert len(loads) >= ROWS_IN_FLIGHT, "row loads issued back to back"
    if cfg.phase == "amax":
        assert _count(ptx, r"\b(atom|red)\.[a-z.]*max") == 1, "one atomic max per warp"
        assert _count(ptx, r"cvt\.rn\.satfinite\.e4m3x2") == 0
    else:
        # Two fp32 values per convert, saturating at +-448 (e4m3 has no infinity).
        assert _count(ptx, r"cvt\.rn\.satfinite\.e4m3x2\.f32") == per_lane // 2 * ROWS_IN_FLIGHT
    assert "ld.local" not in ptx and "st.local" not in ptx
    if cfg.transpose and cfg.phase == "quant":
        assert _count(ptx, r"st\.global\.v4\.(b|u)32") >= 1, "16-token stores of V^T"
    if cfg.varlen and cfg.transpose and cfg.phase == "quant":
        # A 16-token chunk shared with another CTA (another sequence's scale) goes out byte by
        # byte, this CTA's tokens only.
        assert _count(ptx, r"st\.global\.(b|u)8") == 16, "predicated byte stores of shared chunks"


def test_quantize_config_rejects_what_the_kernel_cannot_do() -> None:
    with pytest.raises(ValueError):
        QuantizeConfig(target="sm_90a", hdim=96)
    with pytest.raises(ValueError):
        QuantizeConfig(target="sm_90a", rotate=True, transpose=True)
    with pytest.raises(ValueError):
        QuantizeConfig(target="sm_90a", phase="both")
    with pytest.raises(ValueError):
        QuantizeConfig(target="sm_90a", rotate=True, v_perm=True)
    with pytest.raises(ValueError, match="varlen"):
        QuantizeConfig(target="sm_90a", rotate=False, transpose=True, v_perm=True, varlen=True)
    for kw in (dict(lanes_per_row=2), dict(lanes_per_row=12),
               dict(rotate=False, transpose=True, lanes_per_row=8), dict(lanes_per_row=4, rows=64)):
        with pytest.raises(ValueError, match="lanes_per_row|rows|whole warp"):
            QuantizeConfig(target="sm_90a", **kw)
    for kw in (dict(rotate=True), dict(rotate=False), dict(rotate=False, transpose=True, phase="amax")):
        with pytest.raises(ValueError, match="e4m3"):
            QuantizeConfig(target="sm_90a", dtype="e4m3", **kw)


def _hopper() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def _quant_close(got, ref) -> None:
    """Kernel vs reference outputs: descales equal to fp32 rounding; e4m3 values nearly all equal,
    the others one e4m3 step (2^-3 relative) apart, never more -- the kernel's fp32 butterflies
    and its IEEE 448 / amax (torch's is 1 / amax * 448) may round differently from the
    reference's. A NaN (an e4m3 byte never written) fails the ``<=``."""
    import torch

    for name, g, r in zip(("q_descale", "k_descale", "v_descale"), got[3:], ref[3:], strict=True):
        assert g.shape == r.shape and torch.allclose(g, r, rtol=1e-5), name
    for name, g, r in zip("qkv", got[:3], ref[:3], strict=True):
        assert g.shape == r.shape and g.dtype == torch.float8_e4m3fn, name
        gf, rf = g.float(), r.float()
        assert ((gf - rf).abs() <= rf.abs() * 2.0**-3 + 2.0**-9).all(), name
        assert (gf == rf).float().mean() > 0.95, name


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (e4m3 converts)")
@pytest.mark.parametrize("v_perm", [False, True], ids=["v-natural", "v-kernel-order"])
@pytest.mark.parametrize("d,hkv,n", [(64, 2, 100), (128, 1, 1000), (256, 4, 77)])
def test_quantize_qkv_matches_the_reference_within_one_e4m3_step(d: int, hkv: int, n: int,
                                                                 v_perm: bool) -> None:
    import torch

    from cute_flash.fp8_ref import outlier_qkv, quantize_qkv_ref
    from cute_flash.quant import quantize_qkv

    q, _, _ = outlier_qkv(2, n + 3, 4, d, seed=5, device="cuda", dtype=torch.bfloat16)
    _, k, v = outlier_qkv(2, n, hkv, d, seed=6, device="cuda", dtype=torch.bfloat16)
    got = quantize_qkv(q, k, v, rotate=True, seed=7, v_perm=v_perm)
    ref = quantize_qkv_ref(q, k, v, rotate_qk=True, seed=7, v_perm=v_perm)
    _quant_close(got, ref)
    # V: sequence-contiguous; in the kernel order, the whole (B, H_kv, d, N_pad) storage.
    assert got[2].stride(-1 if v_perm else 1) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (e4m3 converts)")
@pytest.mark.parametrize("d,lanes,varlen", [(64, 16, False), (64, 8, False), (64, 8, True), (128, 8, False),
                                            (128, 4, False), (256, 16, False), (128, 8, True),
                                            (256, 8, True)])
def test_several_rows_per_warp_quantize_q_and_k_bit_for_bit_as_one_row_per_warp(d: int, lanes: int,
                                                                                varlen: bool,
                                                                                monkeypatch) -> None:
    """``QK_LANES_PER_ROW`` < 32: the same butterflies in the same order, only on other lanes, so
    Q and K (and the descales) come out byte-identical to the whole-warp kernels; partial last
    CTAs (rows past the end) and, packed, uneven sequences."""
    import torch

    from cute_flash import quant
    from cute_flash.fp8_ref import outlier_qkv, quantize_qkv_ref

    q, _, _ = outlier_qkv(2, 301, 4, d, seed=5, device="cuda", dtype=torch.bfloat16)
    _, k, v = outlier_qkv(2, 157, 2, d, seed=6, device="cuda", dtype=torch.bfloat16)
    if varlen:
        lens_q, lens_k = [301, 0, 45, 255], [157, 3, 0, 154]
        q, k, v = (x.reshape(-1, x.shape[2], d)[:sum(lens)] for x, lens in ((q, lens_q), (k, lens_k),
                                                                            (v, lens_k)))
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32,
                                   device="cuda") for x in (lens_q, lens_k))

        def run():
            return quant.quantize_qkv_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), seed=9)
    else:
        def run():
            return quant.quantize_qkv(q, k, v, seed=9)
    monkeypatch.setattr(quant, "QK_LANES_PER_ROW", 32)
    whole = run()
    monkeypatch.setattr(quant, "QK_LANES_PER_ROW", lanes)
    split = run()
    for i in (0, 1):
        assert torch.equal(_bytes(split[i]), _bytes(whole[i])), "qk"[i]
    for a, b in zip(split[3:], whole[3:], strict=True):
        assert torch.equal(a, b)
    if not varlen:
        _quant_close(split, quantize_qkv_ref(q, k, v, rotate_qk=True, seed=9))


def _bytes(t):
    import torch

    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _packed(lens: list[int], h: int, d: int, seed: int):
    """(x (T, h, d) outlier values, cu_seqlens int32) for sequences of the given lengths."""
    import torch

    from cute_flash.fp8_ref import outlier_qkv

    x, _, _ = outlier_qkv(1, max(sum(lens), 1), h, d, seed=seed)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return x[0, :sum(lens)], cu


def test_varlen_reference_with_one_sequence_is_the_dense_reference() -> None:
    import torch

    from cute_flash.fp8_ref import quantize_qkv_ref, quantize_qkv_varlen_ref

    q, cu_q = _packed([77], 4, 64, seed=1)
    k, cu_k = _packed([45], 2, 64, seed=2)
    v, _ = _packed([45], 2, 64, seed=3)
    got = quantize_qkv_varlen_ref(q, k, v, cu_q, cu_k, rotate_qk=True, seed=4)
    ref = quantize_qkv_ref(q[None], k[None], v[None], rotate_qk=True, seed=4)
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(_bytes(g), _bytes(r[0] if g.dim() == 3 else r))
    # The same token-contiguous V layout, batch dim dropped: (T, H_kv, d) over (H_kv, d, T_pad).
    assert got[2].stride() == ref[2].stride()[1:] == (1, 64 * 48, 48)


def test_varlen_reference_scales_each_sequence_on_its_own() -> None:
    """Per sequence, the dense reference on that sequence alone: its own per-kv-head scales, V in
    the packed token-contiguous storage with zero padding; an empty sequence has descale 0."""
    import torch

    from cute_flash.fp8_ref import E4M3_MAX, quantize_qkv_ref, quantize_qkv_varlen_ref, rotate

    lens_q, lens_k = [50, 3, 0, 129], [77, 1, 300, 45]
    q, cu_q = _packed(lens_q, 4, 64, seed=1)
    k, cu_k = _packed(lens_k, 2, 64, seed=2)
    v, _ = _packed(lens_k, 2, 64, seed=3)
    q8, k8, v8, *ds = quantize_qkv_varlen_ref(q, k, v, cu_q, cu_k, rotate_qk=True, seed=4)
    tk = sum(lens_k)
    assert q8.shape == q.shape and k8.shape == v8.shape == k.shape and q8.is_contiguous()
    assert v8.stride() == (1, 64 * 432, 432)
    assert all(x.shape == (4, 2) for x in ds)
    store = torch.as_strided(_bytes(v8), (2, 64, 432), (64 * 432, 432, 1))
    assert (store[..., tk:] == 0).all(), "V padding"
    assert (ds[0][2] == 0).all(), "empty sequence"
    for s in range(4):
        (q0, q1), (k0, k1) = cu_q[s:s + 2].tolist(), cu_k[s:s + 2].tolist()
        if q1 > q0:
            ref = quantize_qkv_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], rotate_qk=True, seed=4)
            assert torch.equal(_bytes(q8[q0:q1]), _bytes(ref[0][0]))
            assert all(torch.equal(x[s], r[0]) for x, r in zip(ds, ref[3:], strict=True))
        ref = quantize_qkv_ref(k[None, k0:k1], k[None, k0:k1], v[None, k0:k1], rotate_qk=True, seed=4)
        assert torch.equal(_bytes(k8[k0:k1]), _bytes(ref[1][0]))
        assert torch.equal(_bytes(v8[k0:k1]), _bytes(ref[2][0]))
        # Not only the dense reference's word for it: x8 * descale is x M (V: x) to e4m3 precision.
        kr = rotate(k[k0:k1].float(), seed=4)
        assert torch.allclose(k8[k0:k1].float() * ds[1][s, None, :, None], kr,
                              rtol=2.0**-3, atol=ds[1][s].max().item() * E4M3_MAX * 2.0**-9)


def test_quantize_qkv_varlen_rejects_bad_inputs_before_any_launch() -> None:
    import torch

    from cute_flash.quant import quantize_qkv_varlen

    x = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(TypeError, match="bf16 or fp16"):
        quantize_qkv_varlen(x.float(), x, x, cu, cu, 10, 10)
    with pytest.raises(ValueError, match="packed"):
        quantize_qkv_varlen(x[None], x, x, cu, cu, 10, 10)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (e4m3 converts)")
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
    import torch

    from cute_flash.fp8_ref import quantize_qkv_varlen_ref, v_varlen_aligned
    from cute_flash.quant import quantize_qkv_varlen

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
    got = quantize_qkv_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), rotate=True, seed=8)
    aligned = quantize_qkv_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), rotate=True, seed=8,
                                  v_aligned=True)
    monkeypatch.undo()
    ref = quantize_qkv_varlen_ref(q, k, v, cu_q, cu_k, rotate_qk=True, seed=8)
    _quant_close(got, ref)
    # V written straight into the kernel's layout: the same bytes as re-laying the packed V.
    want_v, _ = v_varlen_aligned(got[2], cu_k)
    assert aligned[2].shape == want_v.shape and aligned[2].stride() == want_v.stride()
    assert torch.equal(_bytes(aligned[2]), _bytes(want_v))
    for a, b in zip(aligned[:2] + aligned[3:], got[:2] + got[3:], strict=True):
        assert torch.equal(a.float(), b.float())
    assert got[0].is_contiguous() and got[1].is_contiguous()
    assert got[2].stride() == (1, d * tk_pad, tk_pad)
    store = torch.as_strided(_bytes(got[2]), (hkv, d, tk_pad), (d * tk_pad, tk_pad, 1))
    assert (store[..., tk:] == 0).all(), "V padding"


@pytest.mark.parametrize("n_lanes", [32, 8, 4])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_lane_butterflies_are_the_reference_transform(d: int, n_lanes: int) -> None:
    """The kernel's data movement, emulated: lane l of a row's L lanes holds elements l*E ..
    l*E+E-1 (E = d / L); in-thread butterflies for index bits below log2(E), then per lane bit t
    (t < L) a butterfly shuffle where the lane with bit t clear keeps a + b and its partner
    a - b -- equal to ``fp8_ref.fwht``, for a whole warp per row and for several rows per warp."""
    import torch

    from cute_flash.fp8_ref import fwht

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


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (e4m3 converts)")
@pytest.mark.parametrize("v_perm", [False, True], ids=["v-natural", "v-kernel-order"])
@pytest.mark.parametrize("d,n", [(64, 517), (128, 16), (256, 33)])
def test_relayout_v_is_the_reference_layout_bit_for_bit(d: int, n: int, v_perm: bool) -> None:
    """A caller's e4m3 V through the V quantize kernel at scale 1: exactly the bytes of
    ``fp8_ref.v_kernel_order`` / ``token_contiguous`` (padding zeros), also from a
    non-contiguous view."""
    import torch

    from cute_flash.fp8_ref import _bytes, token_contiguous, v_kernel_order
    from cute_flash.quant import relayout_v

    torch.manual_seed(d + n)
    big = (torch.randn(2, n, 6, d, device="cuda") * 30).to(torch.float8_e4m3fn)
    for v8 in (big[:, :, :3].contiguous(), big[:, :, 1:4]):
        got = relayout_v(v8, v_perm=v_perm)
        want = v_kernel_order(v8) if v_perm else token_contiguous(v8).permute(0, 2, 3, 1)
        if not v_perm:
            store = torch.zeros_like(got, dtype=torch.uint8)
            store[..., :n] = _bytes(want)
            want = store
        assert torch.equal(_bytes(got), _bytes(want))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 GPU (e4m3 converts)")
@pytest.mark.parametrize("d", [64, 128, 256])
def test_relayout_v_varlen_is_the_reference_aligned_layout_bit_for_bit(d: int) -> None:
    """A caller's packed e4m3 V through the V quantize kernel at scale 1 with 16-aligned sequence
    starts: the bytes of ``fp8_ref.v_varlen_aligned`` (gaps and slack zero), same offsets."""
    import torch

    from cute_flash.fp8_ref import _bytes, v_varlen_aligned
    from cute_flash.quant import relayout_v_varlen

    torch.manual_seed(d)
    lens = [77, 0, 1, 300, 16, 45]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    big = (torch.randn(sum(lens), 5, d, device="cuda") * 30).to(torch.float8_e4m3fn)
    for v8 in (big[:, :2].contiguous(), big[:, 1:3]):
        got, cu_v = relayout_v_varlen(v8, cu, max(lens))
        want, cu_v_ref = v_varlen_aligned(v8, cu)
        assert torch.equal(cu_v, cu_v_ref)
        assert got.shape == want.shape and torch.equal(_bytes(got), _bytes(want))
