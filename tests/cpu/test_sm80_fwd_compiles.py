"""Every shipped sm80 forward variant compiles for sm_80 (no GPU needed), uses the instructions an FA2
forward must use, and keeps everything in registers (no spills, no local memory).

The variants are compiled once, in parallel worker processes (compiling is CPU-bound and a variant
takes 3-10 s), by a module fixture that compiles only the variants pytest selected; each variant is
then its own test. ``CUTE_FLASH_COMPILE_WORKERS`` sets the number of processes (default: CPU count).
One variant is in the fast tier, the others are marked ``slow``.
"""

from __future__ import annotations

import os
import time

import pytest

from cute_flash.tools import inspect as ins
from cute_flash.validate import SUPPORTED_HEAD_DIMS

SM80_SMEM_LIMIT = 166912  # bytes of shared memory one block may use on sm_80 (163 KiB)


def _variants() -> list[ins.Variant]:
    out = []
    for dtype in ("bf16", "fp16"):
        for d in SUPPORTED_HEAD_DIMS:
            for mode in ("plain", "causal", "local"):
                out.append(ins.Variant(arch="sm_80", kernel="fwd", dtype=dtype, hdim=d,
                                       causal=mode == "causal", local=mode == "local"))
            # The register-heaviest combinations of every head dim (softcap and varlen add
            # live values on top of the masks): these decide whether a tile spills.
            for flags in ({"softcap": True, "varlen": True, "local": True},
                          {"softcap": True, "varlen": True, "causal": True}):
                out.append(ins.Variant(arch="sm_80", kernel="fwd", dtype=dtype, hdim=d, **flags))
    # Single features, for a small and the most used head dim.
    for d in (64, 128):
        for flags in ({"softcap": True}, {"varlen": True}):
            out.append(ins.Variant(arch="sm_80", kernel="fwd", dtype="bf16", hdim=d, **flags))
    return out


VARIANTS = _variants()


def _id(v: ins.Variant) -> str:
    return v.label().removeprefix("sm_80 fwd ").replace(" ", "-")


@pytest.fixture(scope="module")
def reports(request: pytest.FixtureRequest, selected_tests: list[pytest.Item]) -> dict[ins.Variant, dict]:
    selected = [item.callspec.params["variant"] for item in selected_tests
                if getattr(item, "originalname", None) == "test_sm80_fwd_variant"
                and hasattr(item, "callspec")]
    workers = int(os.environ.get("CUTE_FLASH_COMPILE_WORKERS", os.cpu_count() or 1))
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if capman is not None and len(selected) > 1:
        with capman.global_and_fixture_disabled():
            print(f"\n[compile sm80 fwd] compiling {len(selected)} variants in {workers} processes "
                  f"(~{4 * len(selected) // max(workers, 1)} s)...", flush=True)
    t0 = time.perf_counter()
    reps = ins.inspect_many(selected, workers=workers)
    wall = time.perf_counter() - t0
    # Shown even with output capture on: CI logs keep the compile-time budget visible.
    times = sorted((r.get("compile_s", 0.0), _id(v)) for v, r in zip(selected, reps, strict=True))
    line = (f"\n[compile sm80 fwd] {len(selected)} variants, {workers} processes: {wall:.0f} s wall, "
            f"compile {sum(t for t, _ in times):.0f} s summed, slowest: "
            + ", ".join(f"{n} {t:.1f} s" for t, n in times[-3:]))
    if capman is not None:
        with capman.global_and_fixture_disabled():
            print(line, flush=True)
    return dict(zip(selected, reps, strict=True))


# The fast tier's variant: bf16 d = 128 causal, the most used one.
FAST = ins.Variant(arch="sm_80", kernel="fwd", dtype="bf16", hdim=128, causal=True)
assert FAST in VARIANTS


@pytest.mark.parametrize("variant", [pytest.param(v, id=_id(v), marks=() if v == FAST else pytest.mark.slow)
                                     for v in VARIANTS])
def test_sm80_fwd_variant(variant: ins.Variant, reports: dict[ins.Variant, dict]) -> None:
    rep = reports[variant]
    assert "error" not in rep, rep.get("error")
    p = rep["ptx"]
    for key in ("mma.sync", "ldmatrix", "cp.async", "ex2.approx"):
        assert p[key] > 0, f"no {key} in the PTX"
    assert p["wgmma.mma_async"] == 0 and p["ld.local"] == 0 and p["st.local"] == 0
    assert rep["spill_bytes"] == 0, f"{rep['spill_bytes']} B of spills"
    assert rep["local_bytes"] == 0, f"{rep['local_bytes']} B of local memory (stack frame)"
    assert rep["smem_bytes"] is None or rep["smem_bytes"] <= SM80_SMEM_LIMIT
    if rep["sass"]:  # with nvdisasm/cuobjdump: the cubin agrees
        s = rep["sass"]
        assert s["HMMA"] > 0 and s["LDSM"] > 0 and s["LDGSTS"] > 0
        assert s["LDL"] == 0 and s["STL"] == 0


def test_grid_covers_shipped_variants() -> None:
    combos = {(v.dtype, v.hdim, v.causal, v.local) for v in VARIANTS}
    for dtype in ("bf16", "fp16"):
        for d in SUPPORTED_HEAD_DIMS:
            assert {(dtype, d, False, False), (dtype, d, True, False), (dtype, d, False, True)} <= combos
    assert any(v.softcap for v in VARIANTS) and any(v.varlen for v in VARIANTS)
