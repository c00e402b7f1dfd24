"""The sm90a (FlashAttention-3 style) forward compiles for sm_90a on a CPU-only machine, uses the
Hopper machinery it is meant to use (wgmma, TMA bulk-tensor loads, mbarrier pipelines, register
reallocation between the producer and consumer warpgroups) and keeps everything in registers (no
local memory: no spills, no stack frame). Compile-only: the kernel is not in the public dispatch.
"""

from __future__ import annotations

import os
import re
import tempfile

import pytest

from cute_flash import inspect as ins
from cute_flash import jit
from cute_flash.fwd_sm90 import SM90_FWD_TILES, SM90_SMEM_LIMIT, FwdSm90Config

VARIANTS = [
    FwdSm90Config(target="sm_90a", dtype=dtype, hdim=d, hdim_v=d, causal=mode == "causal",
                  local=mode == "local", softcap=mode == "softcap")
    for dtype in ("bf16", "fp16")
    for d in (64, 128, 256)
    for mode in ("plain", "causal")
] + [
    # Sliding window and softcap, for the most used head dim.
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, local=True),
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, causal=True, softcap=True),
] + [
    # Ping-pong scheduling barriers and intra-warpgroup overlap (each alone, then both).
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, pingpong=True),
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, intra_wg_overlap=True),
] + [
    FwdSm90Config(target="sm_90a", dtype=dtype, hdim=d, hdim_v=d, causal=True, pingpong=True,
                  intra_wg_overlap=True)
    for dtype, d in (("bf16", 64), ("fp16", 128), ("bf16", 256))
] + [
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, local=True, softcap=True,
                  pingpong=True, intra_wg_overlap=True),
]


def _id(cfg: FwdSm90Config) -> str:
    flags = [f for f in ("causal", "local", "softcap", "pingpong", "intra_wg_overlap")
             if getattr(cfg, f)] or ["plain"]
    return f"{cfg.dtype}-d{cfg.hdim}-" + "-".join(flags)


def _count(ptx: str, op: str) -> int:
    return len(re.findall(rf"^\s*(?:@!?%p\d+\s+)?{re.escape(op)}", ptx, flags=re.M))


@pytest.mark.parametrize("cfg", VARIANTS, ids=_id)
def test_sm90_fwd_compiles(cfg: FwdSm90Config) -> None:
    ptx, cubin = jit.compile_artifacts(cfg)
    for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait", "mbarrier.arrive",
               "setmaxnreg.inc", "setmaxnreg.dec", "ex2.approx"):
        assert _count(ptx, op) > 0, f"no {op} in the PTX"
    assert _count(ptx, "mma.sync") == 0, "sm80 mma.sync in the sm90 kernel"
    assert _count(ptx, "ld.local") == 0 and _count(ptx, "st.local") == 0
    if cfg.pingpong:  # named barriers beyond the epilogue's: bar.sync / bar.arrive with an id register
        assert _count(ptx, "bar.arrive") > 0 and _count(ptx, "bar.sync") > 2
    if cfg.intra_wg_overlap:  # two commit groups in flight: QK^T(n) and PV(n+1)
        assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)
    if ins.tools_dir() is None:
        pytest.skip("no cuobjdump: cubin resource usage not checked")
    with tempfile.TemporaryDirectory(prefix="cute_flash_sm90_") as tmp:
        path = os.path.join(tmp, "fwd_sm90.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = ins.resource_usage(path)
        sass = ins.disassemble(path) or ""
    assert usage, "cuobjdump -res-usage reported no function"
    for fn, res in usage.items():
        assert res.get("LOCAL", 0) == 0, f"{fn}: {res['LOCAL']} B of local memory (spills)"
        assert res.get("STACK", 0) == 0, f"{fn}: {res['STACK']} B stack frame"
        assert res.get("REG", 0) <= 168, f"{fn}: {res['REG']} registers at launch (3 warpgroups: <= 168)"
    assert not re.search(r"\b(LDL|STL)\b", sass), "local loads/stores in the SASS"


def test_smem_fits() -> None:
    """Q + stages * (K + V) tiles of 16-bit elements (plus barriers) fit in one sm90 block."""
    for d, (tm, tn, st) in SM90_FWD_TILES.items():
        assert (tm * d + st * tn * 2 * d) * 2 + 1024 <= SM90_SMEM_LIMIT, d


def test_unimplemented_features_are_rejected() -> None:
    with pytest.raises(NotImplementedError):
        FwdSm90Config(target="sm_90a", varlen=True)
    with pytest.raises(ValueError):
        FwdSm90Config(target="sm_90a", tile_m=192, num_mma_wg=3, pingpong=True)


def test_same_call_signature_as_sm80() -> None:
    from cute_flash.fwd import FwdConfig

    a = FwdSm90Config(target="sm_90a").fake_args()
    b = FwdConfig(target="sm_90a").fake_args()
    assert len(a) == len(b) == 13
