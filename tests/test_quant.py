"""The quantize-and-rotate kernels (issue 5) compile for sm_90a with the instructions their design
names -- butterfly shuffles for the cross-lane Walsh-Hadamard stages, saturating e4m3 converts,
one atomic max per warp -- and no local memory; on a GPU they match ``fp8_ref.quantize_qkv_ref``."""

from __future__ import annotations

import re

import pytest

from cute_flash import jit
from cute_flash.quant import QuantizeConfig, quant_configs


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx))


VARIANTS = [c for d in (64, 128, 256) for c in quant_configs("bf16", d, rotate=True)]
VARIANTS += quant_configs("fp16", 128, rotate=False)
VARIANTS += [c for d in (64, 128, 256)
             for c in quant_configs("bf16", d, rotate=True, v_perm=True) if c.v_perm]
VARIANTS = [QuantizeConfig(**{**c.__dict__, "target": "sm_90a"}) for c in VARIANTS]


def _id(c: QuantizeConfig) -> str:
    v = "v-kernel-order" if c.v_perm else "v"
    return f"{c.dtype}-d{c.hdim}-{c.phase}-" + (v if c.transpose else "qk-rot" if c.rotate else "qk")


@pytest.mark.parametrize("cfg", VARIANTS, ids=_id)
def test_quantize_kernels_compile_with_shuffles_converts_and_no_local_memory(cfg: QuantizeConfig) -> None:
    ptx, _ = jit.compile_artifacts(cfg)
    lanes = cfg.hdim // 32
    butterflies = 5 * lanes if cfg.rotate else 0  # 5 cross-lane stages, one shuffle per element
    reduce = 5 if cfg.phase == "amax" else 0  # the warp's max
    assert _count(ptx, r"shfl\.sync\.bfly") == butterflies + reduce
    if cfg.phase == "amax":
        assert _count(ptx, r"\b(atom|red)\.[a-z.]*max") == 1, "one atomic max per warp"
        assert _count(ptx, r"cvt\.rn\.satfinite\.e4m3x2") == 0
    else:
        # Two fp32 values per convert, saturating at +-448 (e4m3 has no infinity).
        assert _count(ptx, r"cvt\.rn\.satfinite\.e4m3x2\.f32") == lanes // 2
    assert "ld.local" not in ptx and "st.local" not in ptx
    if cfg.transpose and cfg.phase == "quant":
        assert _count(ptx, r"st\.global\.v4\.(b|u)32") >= 1, "16-token stores of V^T"


def test_quantize_config_rejects_what_the_kernel_cannot_do() -> None:
    with pytest.raises(ValueError):
        QuantizeConfig(target="sm_90a", hdim=96)
    with pytest.raises(ValueError):
        QuantizeConfig(target="sm_90a", rotate=True, transpose=True)
    with pytest.raises(ValueError):
        QuantizeConfig(target="sm_90a", phase="both")
    with pytest.raises(ValueError):
        QuantizeConfig(target="sm_90a", rotate=True, v_perm=True)


def _hopper() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


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
    for name, g, r in zip(("q_descale", "k_descale", "v_descale"), got[3:], ref[3:], strict=True):
        assert torch.allclose(g, r, rtol=1e-5), name
    for name, g, r in zip("qkv", got[:3], ref[:3], strict=True):
        assert g.shape == r.shape and g.dtype == torch.float8_e4m3fn, name
        # The fp32 butterflies may round differently from the reference's: at most one e4m3 step
        # (2^-3 relative) apart, never more.
        gf, rf = g.float(), r.float()
        assert ((gf - rf).abs() <= rf.abs() * 2.0**-3 + 2.0**-9).all(), name
        assert (gf == rf).float().mean() > 0.95, name
    # V: sequence-contiguous; in the kernel order, the whole (B, H_kv, d, N_pad) storage.
    assert got[2].stride(-1 if v_perm else 1) == 1


@pytest.mark.parametrize("d", [64, 128, 256])
def test_lane_butterflies_are_the_reference_transform(d: int) -> None:
    """The kernel's data movement, emulated: lane l holds elements l*E .. l*E+E-1; in-thread
    butterflies for index bits below log2(E), then per lane bit t a butterfly shuffle where the
    lane with bit t clear keeps a + b and its partner a - b -- equal to ``fp8_ref.fwht``."""
    import torch

    from cute_flash.fp8_ref import fwht

    e = d // 32
    x = torch.randn(d, dtype=torch.float64)
    lanes = [x[i * e:(i + 1) * e].clone() for i in range(32)]
    s = 1
    while s < e:
        for y in lanes:
            for j in range(e):
                if j & s == 0:
                    y[j], y[j + s] = y[j] + y[j + s], y[j] - y[j + s]
        s *= 2
    for t in (1, 2, 4, 8, 16):
        old = [y.clone() for y in lanes]
        for lane in range(32):
            other = old[lane ^ t]
            lanes[lane] = old[lane] + other if lane & t == 0 else other - old[lane]
    got = torch.cat(lanes) / d**0.5
    assert torch.allclose(got, fwht(x), atol=1e-12)
