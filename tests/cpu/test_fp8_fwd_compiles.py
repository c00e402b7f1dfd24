"""The FP8 (e4m3) Hopper forward compiles for sm_90a with k32 e4m3 wgmma (QGMMA in SASS), TMA,
register reallocation and no spills, refuses what it does not do, and its plan picks the
persistent grid and packed GQA where they measured faster. (The P register layouts:
``test_fp8_p_registers.py``; on a GPU: ``tests/gpu/test_fp8_fwd_matches_reference.py``.)"""

from __future__ import annotations

import re

import pytest

from cute_flash import jit
from cute_flash.hopper.fp8_config import FwdSm90Fp8Config, fp8_launch_fields, plan
from cute_flash.problem import Problem
from cute_flash.tools import inspect as ins

VARIANTS = [FwdSm90Fp8Config(target="sm_90a", hdim=d, hdim_v=d, causal=m == "causal", local=m == "local")
            for d in (64, 128, 256) for m in ("plain", "causal", "local")]
# V in the kernel's token order (the fp8=True path): no P exchange between lanes.
VARIANTS += [FwdSm90Fp8Config(target="sm_90a", hdim=d, hdim_v=d, causal=c, v_perm=True)
             for d in (64, 128, 256) for c in (False, True)]
# The persistent grid (the launch's choice up to 4k keys): causal with atomic tile claims, static.
VARIANTS += [FwdSm90Fp8Config(target="sm_90a", hdim=128, hdim_v=128, causal=True, v_perm=True, num_ctas=132,
                              dynamic_tiles=True),
             FwdSm90Fp8Config(target="sm_90a", hdim=256, hdim_v=256, v_perm=True, num_ctas=132)]
# d = 128 with P's row sums by FADDs (still reachable through overrides).
VARIANTS += [FwdSm90Fp8Config(target="sm_90a", hdim=128, hdim_v=128, causal=c, v_perm=True, sum_mma=False)
             for c in (False, True)]

# Packed sequences (natural V order, a domain offset on V's token mode) and packed GQA (decode).
VARIANTS += [FwdSm90Fp8Config(target="sm_90a", hdim=d, hdim_v=d, causal=m == "causal", local=m == "local",
                              varlen=True)
             for d in (64, 128, 256) for m in ("plain", "causal", "local")]
VARIANTS += [FwdSm90Fp8Config(target="sm_90a", hdim=d, hdim_v=d, causal=c, pack_gqa=p)
             for d, c, p in ((64, False, 8), (128, True, 4), (256, False, 8))]
# Row sums of P on the tensor cores (d = 128; on by default but for windows, so the lists above
# cover the other launch shapes): with a window, and static persistent.
VARIANTS += [FwdSm90Fp8Config(target="sm_90a", hdim=128, hdim_v=128, sum_mma=True, **kw)
             for kw in (dict(local=True), dict(v_perm=True, num_ctas=132))]
# P's e4m3 codes from an FFMA and a max per score, no MUFU (d = 128 with sum_mma).
VARIANTS += [FwdSm90Fp8Config(target="sm_90a", hdim=128, hdim_v=128, exp_bytes=True, **kw)
             for kw in (dict(v_perm=True), dict(v_perm=True, causal=True), dict(causal=True),
                        dict(v_perm=True, num_ctas=132), dict(varlen=True, causal=True))]
VARIANTS += [FwdSm90Fp8Config(target="sm_90a", hdim=256, hdim_v=256, sum_mma=True, exp_bytes=True, **kw)
             for kw in (dict(v_perm=True), dict(v_perm=True, causal=True), dict(varlen=True))]
# d = 64 on three warpgroups (192 x 160, MUFU exponentials; still reachable through overrides).
VARIANTS += [FwdSm90Fp8Config(target="sm_90a", hdim=64, hdim_v=64, tile_m=192, tile_n=160, num_mma_wg=3,
                              pingpong=False, **kw)
             for kw in (dict(v_perm=True), dict(v_perm=True, causal=True))]
VARIANTS = list(dict.fromkeys(VARIANTS))  # (an explicit switch may repeat a default)


def _id(c: FwdSm90Fp8Config) -> str:
    mode = "causal" if c.causal else "local" if c.local else "plain"
    grid = f"-persistent{'-dynamic' if c.dynamic_tiles else ''}" if c.num_ctas else ""
    packed = ("-varlen" if c.varlen else "") + (f"-pack{c.pack_gqa}" if c.pack_gqa > 1 else "")
    sums = ("-sum-mma" if c.sum_mma else "") + ("-exp-bytes" if c.exp_bytes else "")
    return f"d{c.hdim}-{mode}" + ("-v-kernel-order" if c.v_perm else "") + grid + packed + sums


# One kernel in the fast tier (d = 128 causal with V in the kernel order: the ``fp8=True`` path's
# default, with ``sum_mma`` and ``exp_bytes``); the others are ``slow``.
FAST = FwdSm90Fp8Config(target="sm_90a", hdim=128, hdim_v=128, causal=True, v_perm=True)
assert FAST in VARIANTS


@pytest.mark.parametrize("cfg", [pytest.param(c, id=_id(c), marks=() if c == FAST else pytest.mark.slow)
                                 for c in VARIANTS])
def test_fp8_forward_compiles_with_e4m3_wgmma_tma_and_no_spills(cfg: FwdSm90Fp8Config) -> None:
    ptx, cubin = jit.compile_artifacts(cfg)
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.e4m3\.e4m3", ptx)
    assert not re.search(r"wgmma\.mma_async\S*\.(bf16|f16)\.", ptx)
    for op in ("cp.async.bulk.tensor", "setmaxnreg.inc", "setmaxnreg.dec"):
        assert op in ptx, op
    # P to e4m3: by conversion, or (exp_bytes) read off the FFMA results' low bytes.
    assert ("cvt.rn.satfinite.e4m3x2.f32" in ptx) != cfg.exp_bytes
    assert ("cvt.rn.relu.f16x2.f32" in ptx and "cvt.rpi.f32.f32" in ptx) == cfg.exp_bytes
    assert "ld.local" not in ptx and "st.local" not in ptx
    # The quad exchange of P: 4 indexed shuffles per 32 keys (per copy of the loop body); with V
    # in the kernel order, none (the few left broadcast scalars).
    exchange = 4 * (cfg.tile_n // 32)
    idx = len(re.findall(r"shfl\.sync\.idx", ptx))
    assert idx < exchange if cfg.v_perm else idx >= exchange, idx
    if ins.tools_dir() is None:
        pytest.skip("no cuobjdump")
    sass, usage = ins.cubin_sass_and_usage(cubin)
    sass = sass or ""
    for fn, res in usage.items():
        assert res.get("LOCAL", 0) == 0 and res.get("STACK", 0) == 0, f"{fn}: spills {res}"
    if sass:
        assert "QGMMA" in sass and "HGMMA" not in sass
        assert sass.count("WARPGROUP.DEPBAR") <= 8, "wgmma serialised?"
        assert "STL" not in sass
    if cfg.exp_bytes and sass:
        # Per row and block one exponential is left (O's rescale), against one per score.
        per_body = 2 * cfg.tile_n // 4
        plain = FwdSm90Fp8Config(**{**cfg.__dict__, "exp_bytes": False})
        sass0 = ins.cubin_sass_and_usage(jit.compile_artifacts(plain)[1])[0] or ""
        assert sass.count("MUFU.EX2") * per_body // 2 < sass0.count("MUFU.EX2"), sass.count("MUFU.EX2")
    if cfg.sum_mma:
        # One m64n8k32 per 32 keys beside P V, in every copy of the P V issue; the FADD chains of
        # the row sums gone from the loop.
        n8 = len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n8k32\.f32\.e4m3\.e4m3", ptx))
        assert n8 > 0 and n8 % (cfg.tile_n // 32) == 0, n8
        if sass:
            plain = FwdSm90Fp8Config(**{**cfg.__dict__, "sum_mma": False, "exp_bytes": False})
            sass0 = ins.cubin_sass_and_usage(jit.compile_artifacts(plain)[1])[0] or ""
            assert sass.count("FADD") < sass0.count("FADD") - 2 * cfg.tile_n // 4


def test_fp8_forward_refuses_what_it_does_not_do_yet() -> None:
    for kw in (dict(hdim=96, hdim_v=96), dict(softcap=True), dict(varlen=True, v_perm=True),
               dict(tile_n=80),
               dict(hdim=64, hdim_v=64, num_mma_wg=3, sum_mma=True), dict(exp_bytes=True, sum_mma=False),
               dict(local=True, exp_bytes=True),
               dict(hdim=64, hdim_v=64, num_mma_wg=3, exp_bytes=True)):
        with pytest.raises(ValueError):
            FwdSm90Fp8Config(target="sm_90a", **{"hdim": 128, "hdim_v": 128, **kw})


def test_fp8_launch_takes_the_persistent_grid_for_short_sequences_and_claims_causal_tiles() -> None:
    assert fp8_launch_fields(4096, causal=False, local=False, num_sms=132) == {"num_ctas": 132,
                                                                               "dynamic_tiles": False}
    assert fp8_launch_fields(300, causal=True, local=False, num_sms=132) == {"num_ctas": 132,
                                                                            "dynamic_tiles": True}
    assert fp8_launch_fields(4097, causal=False, local=False, num_sms=132) == {}
    assert fp8_launch_fields(8192, causal=True, local=False, num_sms=132)["dynamic_tiles"]  # d = 128
    assert fp8_launch_fields(8193, causal=True, local=False, num_sms=132) == {}
    assert fp8_launch_fields(8192, causal=True, local=False, num_sms=132, hdim=256) == {}
    assert fp8_launch_fields(2048, causal=True, local=False, num_sms=132, hdim=64) == {}  # unmeasured
    assert fp8_launch_fields(300, causal=False, local=True, num_sms=132) == {}


@pytest.mark.slow
def test_inspect_shows_the_fp8_path_for_sm90a() -> None:
    """``python -m cute_flash inspect --arch sm_90a --kernel fwd --dtype e4m3 --hdim 256 --json``:
    the quantize kernels and the attention kernel, e4m3 wgmma (QGMMA), TMA, setmaxnreg, no spills."""
    report = ins.inspect_variant(ins.Variant(arch="sm_90a", kernel="fwd", dtype="e4m3", hdim=256))
    ptx = report["ptx"]
    for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg.inc", "cvt.e4m3"):
        assert ptx.get(op, 0) > 0, op
    if report["sass"]:
        assert report["sass"].get("QGMMA", 0) > 0 and report["sass"].get("HGMMA", 0) == 0
    assert report["spill_bytes"] in (0, None) and report["local_bytes"] in (0, None)


def test_fp8_plan_takes_the_launch_fields_only_when_the_extents_are_known() -> None:
    """``plan(Problem)``: a compile-only problem (no extents) is the base variant; with extents,
    the persistent grid for short key sequences and packed GQA for short query sequences."""
    base = dict(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, causal=True)
    cfg = plan(Problem(**base), v_perm=True)
    assert (cfg.num_ctas, cfg.pack_gqa, cfg.v_perm) == (0, 1, True)
    cfg = plan(Problem(**base, max_seqlen_q=1000, max_seqlen_k=1000, heads_q=8, heads_kv=2, num_sms=132))
    assert (cfg.num_ctas, cfg.dynamic_tiles, cfg.pack_gqa) == (132, True, 1)
    cfg = plan(Problem(**base, max_seqlen_q=5, max_seqlen_k=9000, heads_q=16, heads_kv=2, num_sms=132))
    assert (cfg.num_ctas, cfg.pack_gqa) == (0, 8)
    # Overrides (the tuning scripts') win over the launch rule.
    cfg = plan(Problem(**base, max_seqlen_q=1000, max_seqlen_k=1000, num_sms=132),
               overrides=(("num_ctas", 0), ("dynamic_tiles", False)))
    assert cfg.num_ctas == 0 and not cfg.dynamic_tiles
