"""The quantize-and-rotate kernels of the FP8 forward compile for sm_90a with the instructions their
design names -- butterfly shuffles for the cross-lane Walsh-Hadamard stages, saturating e4m3
converts, one atomic max per warp -- and no local memory, dense and packed (varlen); they refuse
what they cannot do. (On a GPU: ``tests/gpu/test_quantize_matches_reference.py``.)"""

from __future__ import annotations

import re

import pytest

from cute_flash import jit
from cute_flash.hopper.fp8_config import QuantizeConfig, quant_configs
from cute_flash.hopper.quant import ROWS_IN_FLIGHT


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


# One kernel in the fast tier (the Q / K quant phase with several rows per warp, what d = 128
# launches); the others are ``slow``.
FAST = next(c for c in VARIANTS
            if (c.hdim, c.phase, c.rotate, c.varlen, c.lanes_per_row) == (128, "quant", True, False, 8))


@pytest.mark.parametrize("cfg", [pytest.param(c, id=_id(c), marks=() if c == FAST else pytest.mark.slow)
                                 for c in VARIANTS])
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
