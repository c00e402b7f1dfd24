"""The sm90 backward compiles for sm_90a on the CPU with the instructions it is meant to use and no
spills, refuses what it does not build, and its plan (the long-sequence tile, balanced ``lpt``
sections, the rotated deterministic order) follows its launch rules. (On a Hopper GPU:
``tests/gpu/test_sm90_bwd_gradients.py``.)"""

from __future__ import annotations

import re

import pytest

from cute_flash import jit
from cute_flash.hopper.bwd_config import BwdSm90Config, long_rows_overrides
from cute_flash.problem import Problem
from cute_flash.tools import inspect as ins

# The long-sequence tile the launcher takes for non-causal d = 128 (80 query rows, dQ^T with the
# head dim on M, stmatrix dS^T) with the switches that go with it.
LONG_ROWS = long_rows_overrides(dict(hdim=128), max_seqlen_q=1 << 30)

VARIANTS = [
    BwdSm90Config(target="sm_90a", dtype=dtype, hdim=d, causal=mode == "causal", local=mode == "local")
    for dtype in ("bf16", "fp16") for d in (64, 96, 128, 192, 256) for mode in ("plain", "causal", "local")
] + [
    # Packed (varlen) inputs.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, varlen=True)
    for d in (64, 96, 128, 192, 256) for c in (False, True)
] + [
    # Softcap: the 1 - tanh^2 factor of every score kept from S (S^T) to dS (dS^T); d = 64 on
    # 64-query blocks.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, softcap=True)
    for d in (64, 96, 128, 192, 256) for c in (False, True)
] + [
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=64, softcap=True, local=True),
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=64, softcap=True, causal=True, varlen=True),
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=64, softcap=True, causal=True, deterministic=True),
] + [
    # The narrow kernel with dK before dQ and one dS buffer behind an EMPTY barrier (still
    # reachable through overrides for tuning).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, softcap=sc, dq_before_dk=False,
                  ds_stages=1)
    for d, c, sc in ((64, False, False), (128, True, False), (128, False, True))
] + [
    # Every block through the masked exponentials (one basic block per loop body), narrow and wide.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, local=lo, softcap=sc, mask_always=True)
    for d, c, lo, sc in ((64, True, False, False), (64, False, False, True), (128, False, True, False),
                         (192, True, False, False), (256, False, False, False))
] + [
    # d_v != d: (192, 128) in the wide kernel.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=192, hdim_v=128, causal=c, varlen=vl, softcap=sc,
                  deterministic=det)
    for c, vl, sc, det in ((False, False, False, False), (True, True, False, False),
                           (True, False, True, False), (False, False, False, True))
] + [
    # Deterministic dQ: the writer warp's lane 0 waits on the semaphore and publishes after the
    # bulk adds complete, in descending key-block order.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, hdim_v=dv, causal=c, local=lo, varlen=vl, softcap=sc,
                  deterministic=True)
    for d, dv, c, lo, vl, sc in ((64, 64, False, False, False, False), (64, 64, True, False, True, False),
                                 (96, 96, True, False, False, False), (128, 128, False, False, False, True),
                                 (128, 128, True, False, True, False), (128, 128, True, False, False, False),
                                 (192, 192, True, False, False, False), (192, 192, False, False, True, False),
                                 (192, 128, False, False, False, False), (256, 256, True, False, True, False),
                                 (256, 256, False, True, False, False))
] + [
    # Deterministic mode on the rotated walk (no masks): the rotated add order.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, hdim_v=dv, varlen=vl, deterministic=True,
                  rotate_m=True)
    for d, dv, vl in ((64, 64, False), (128, 128, True), (192, 192, False), (256, 256, True))
] + [
    # LSE2 / D read into registers under the S^T / dP^T wgmmas (narrow kernel: default at d = 128),
    # or under S / dP (wide kernel: 2 + 2 per thread, softcap included).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, softcap=sc, prefetch_stats=True)
    for d, c, sc in ((64, False, False), (64, True, False), (128, False, False), (128, True, False),
                     (96, True, False), (192, True, False), (192, False, True), (256, True, False))
] + [
    # The dQ writer issuing both warpgroups' reduce-adds before waiting (default at d = 128, d = 64
    # non-causal).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, dq_writer_batch=True, prefetch_stats=pf)
    for d, c, pf in ((64, False, True), (128, True, False), (256, False, False))
] + [
    # The measured switches off (statistics after the waits, one reduce-add at a time, 2-byte dK / dV
    # stores).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, prefetch_stats=False,
                  dq_writer_batch=False, dkv_stmatrix=False)
    for d, c in ((64, False), (128, False), (256, True))
] + [
    # dK / dV to smem by stmatrix (default at d = 128, d = 64 non-causal).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, varlen=vl, dkv_stmatrix=True)
    for d, c, vl in ((64, True, False), (96, False, True), (128, False, False), (128, True, True))
] + [
    # K / V on a barrier each, Q + LSE2 and dO + D on two pipelines (the first S^T waits for K, Q
    # and LSE2 alone), with the schedules it is measured against.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, varlen=vl, deterministic=det,
                  split_loads=True, **kw)
    for d, c, vl, det, kw in ((64, True, False, False, {}), (64, False, False, False, {}),
                              (128, True, False, False, {}), (128, False, True, False, {}),
                              (96, True, False, True, {}), (64, True, False, False, dict(dkv_stmatrix=True)),
                              (128, True, False, False, dict(dq_before_dk=False, ds_stages=1)),
                              # the wide kernel (d = 192 / 256, d_v = d), with polling waits
                              (256, True, False, False, dict(spin_waits=True)),
                              (256, False, True, False, dict(spin_waits=True)),
                              (192, True, False, True, dict(spin_waits=True)))
] + [
    # The wide kernel's dK^T / dV^T to smem by transposing stmatrix (off where it measured no
    # faster).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, hdim_v=dv, causal=c, softcap=sc, deterministic=det,
                  dkv_stmatrix=True)
    for d, dv, c, sc, det in ((256, 256, False, False, False), (192, 128, False, False, False),
                              (192, 192, True, True, False), (256, 256, True, False, True),
                              (192, 192, False, False, False), (256, 256, True, False, False))
] + [
    # The wide kernel in flash-attn-4's order (P stored under dP, dV under the dS store, dQ handed
    # over under dK).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, hdim_v=dv, causal=c, softcap=sc, deterministic=det,
                  varlen=vl, dq_before_dk=True)
    for d, dv, c, sc, det, vl in ((192, 192, 1, 0, 0, 0), (192, 192, 0, 0, 0, 1), (256, 256, 1, 0, 0, 0),
                                  (192, 128, 1, 0, 0, 0), (192, 192, 1, 1, 0, 0), (256, 256, 1, 0, 1, 1))
] + [
    # mbarrier waits that poll instead of sleeping, narrow and wide, with and without split loads.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, deterministic=det, spin_waits=True, **kw)
    for d, c, det, kw in ((64, True, False, {}), (128, False, False, {}), (128, True, True, {}),
                          (64, True, False, dict(split_loads=True)), (256, True, False, {}))
] + [
    # The longest-first walk over evenly sized head sections.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=True, lpt_balanced=True) for d in (64, 192)
] + [
    # Query blocks walked from the key block's own offset (the default at d = 256 only).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, hdim_v=dv, causal=c, rotate_m=True)
    for d, dv, c in ((64, 64, False), (128, 128, True), (192, 192, False), (192, 128, True))
] + [
    # dS^T stored before dV's wgmma is issued, its fence and barrier after (flash-attn-4's order).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, local=lo, softcap=sc, varlen=vl,
                  deterministic=det, ds_before_dv=True, **kw)
    for d, c, lo, sc, vl, det, kw in ((64, False, False, False, False, False, {}),
                                      (64, True, False, False, False, False, {}),
                                      (96, True, False, False, True, False, {}),
                                      (128, False, False, False, False, False, {}),
                                      (128, True, False, False, False, False, dict(mask_always=True)),
                                      (128, False, True, True, False, False, {}),
                                      (128, True, False, False, True, True, {}),
                                      (128, True, False, False, False, False,
                                       dict(dq_before_dk=False, ds_stages=1)))
] + [
    # The long-sequence tile (80 query rows), with dS^T stored before or after dV's wgmma, and packed.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, varlen=vl, **{**LONG_ROWS, "ds_before_dv": dsb})
    for vl, dsb in ((False, False), (False, True), (True, True))
] + [
    # GQA / MQA groups split over CTAs (partial dK / dV heads), narrow and wide kernels.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, hdim_v=dv, causal=c, varlen=vl, deterministic=det,
                  split_heads=True, **kw)
    for d, dv, c, vl, det, kw in ((64, 64, True, False, False, {}), (128, 128, True, False, False, {}),
                                  (128, 128, True, True, True, {}),
                                  (128, 128, False, False, False, LONG_ROWS),
                                  (256, 256, True, False, False, {}), (192, 128, True, False, False, {}))
]
VARIANTS = list(dict.fromkeys(VARIANTS))  # (an explicit switch may repeat a default)


def _count(ptx: str, op: str) -> int:
    return len(re.findall(rf"^\s*(?:@!?%p\d+\s+)?{re.escape(op)}", ptx, flags=re.M))


def _id(cfg: BwdSm90Config) -> str:
    mode = "causal" if cfg.causal else "local" if cfg.local else "plain"
    names = ("softcap", "varlen", "deterministic", "prefetch_stats", "dq_writer_batch", "dkv_stmatrix",
             "split_loads", "spin_waits", "lpt_balanced", "rotate_m", "mask_always", "ds_before_dv",
             "split_heads")
    flags = [f for f in names if getattr(cfg, f)]
    flags += ["dk-first"] if cfg.hdim <= 128 and not cfg.dq_before_dk else []
    flags += [f"ds-stages{cfg.ds_stages}"] if cfg.hdim <= 128 and cfg.ds_stages != cfg.stages else []
    flags += ["fa4-order"] if cfg.hdim > 128 and cfg.dq_before_dk else []
    dims = f"d{cfg.hdim}" if cfg.hdim_v == cfg.hdim else f"d{cfg.hdim}-dv{cfg.hdim_v}"
    dims += f"-m{cfg.tile_m}" if cfg.tile_m == 80 else ""
    return "-".join([cfg.dtype, dims, mode, *flags])


# One kernel in the fast tier (bf16 d = 128 causal, what an H200 runs most); the others are ``slow``.
FAST = BwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, causal=True)
assert FAST in VARIANTS


@pytest.mark.parametrize("cfg", [pytest.param(c, id=_id(c), marks=() if c == FAST else pytest.mark.slow)
                                 for c in VARIANTS])
def test_sm90_bwd_compiles_with_wgmma_tma_and_no_spills(cfg: BwdSm90Config) -> None:
    ptx, cubin = jit.compile_artifacts(cfg)
    # TMA for Q, dO, K, V; plain bulk copies for the LSE2 / D rows of each query block.
    assert "cp.async.bulk.shared::cluster.global.mbarrier" in ptx
    for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait", "setmaxnreg.inc",
               "setmaxnreg.dec", "ex2.approx"):
        assert _count(ptx, op) > 0, f"no {op} in the PTX"
    # dQ: one bulk reduce-add per query block from the writer warp, never reductions from the
    # consumers.
    assert _count(ptx, "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") > 0
    assert _count(ptx, "red.relaxed.gpu.global.add.f32") == 0
    assert _count(ptx, "red.relaxed.gpu.global.add.v4.f32") == 0
    assert _count(ptx, "ld.local") == 0 and _count(ptx, "st.local") == 0
    # Five GEMMs per query block: S^T, dP^T, dQ as SS; dV, dK with A from registers.
    rs = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(bf16|f16)\.(bf16|f16)\s+\{[^}]*\},\s*\{"
    if cfg.hdim <= 128:  # d=256 reads P and dS from smem (its dK^T / dV^T GEMMs take them as B)
        assert re.search(rs, ptx), "no register-A (RS) wgmma for dK / dV"
    if ins.tools_dir() is None:
        pytest.skip("no cuobjdump: cubin resource usage not checked")
    sass, usage = ins.cubin_sass_and_usage(cubin)
    sass = sass or ""
    for fn, res in usage.items():
        assert res.get("LOCAL", 0) == 0 and res.get("STACK", 0) == 0, f"{fn}: spills {res}"
    if sass:
        spills = len(re.findall(r"\bSTL\b", sass))
        assert spills == 0, f"{spills} spill stores"
        hgmma, depbar = sass.count("HGMMA."), sass.count("WARPGROUP.DEPBAR")
        # k16 steps per query block: d=128 S^T 8, dP^T 8, dV 4, dK 4, dQ 8; d=96 6, 6, 4, 4, 8;
        # d=64 (128 query rows) 4, 4, 8, 8, 8 (64 rows, softcap: 4, 4, 4, 4, 8); d=256 (dK^T /
        # dV^T, two 64-row M slices each) S 16, dP 16, dV^T 8, dK^T 8, dQ 4; d=192 (96 keys; dK^T /
        # dV^T split by keys: three M slices each) 12, 12, 12, 12, 6; (192, 128): dP 8 and dV^T 8
        # (two slices) instead of 12 each.
        expect = {64: 32 if cfg.tile_m == 128 else 24, 96: 28, 128: 32, 192: 54 if cfg.tile_n == 96 else 52,
                  256: 52}[cfg.hdim]
        if cfg.tile_m == 80:  # dV, dK over 80 queries: 5 k16 steps each instead of 4
            expect += 2
        if cfg.hdim_v != cfg.hdim:
            expect -= 8
        assert hgmma == expect, f"{hgmma} HGMMA, expected {expect}"
        assert 0 < depbar <= 4, f"wgmma serialised? {depbar} waits"
        assert "UTMALDG" in sass and "UBLKRED" in sass
        if cfg.tile_m == 80 and not cfg.ds_before_dv:  # dS^T: 20 1-tile stmatrix.trans
            assert len(re.findall(r"STSM\.16\.MT88\b(?!\.)", sass)) == 20
        elif cfg.hdim > 128:  # P and dS: stmatrix.x4 (not transposed)
            assert sass.count("STSM.16.M88.4") == (6 if cfg.tile_n == 96 else 4)
        else:  # dS^T: tile_m / 16 stmatrix.x4.trans per thread and block
            assert sass.count("STSM.16.MT88.4") == cfg.tile_m // 16
        if cfg.dkv_stmatrix and cfg.hdim > 128:
            # dK^T / dV^T: (d + d_v) x tile_n / 2 values per warpgroup, 32 per stmatrix.x4.trans per
            # thread -- and none of the 2-byte stores of the other epilogue.
            per_thread = (cfg.hdim + cfg.hdim_v) * cfg.tile_n // 2 // 128
            assert sass.count("STSM.16.MT88.4") == per_thread // 8
            assert len(re.findall(r"\bSTS\.U16\b", sass)) == 0


@pytest.mark.slow
@pytest.mark.parametrize("ds_before_dv", [False, True])
def test_sm90_bwd_ds_before_dv_moves_the_ds_stores_ahead_of_dvs_wgmma(ds_before_dv: bool) -> None:
    """``ds_before_dv``: dS^T's stmatrix comes before dV's (register-A) wgmma in program order,
    and the proxy fence after it, so the stores drain while dV issues; off, after it."""
    ptx, _ = jit.compile_artifacts(BwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, causal=True,
                                                 ds_before_dv=ds_before_dv))
    rs = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(bf16|f16)\.(bf16|f16)\s+\{[^}]*\},\s*\{"
    first_dv = re.search(rs, ptx).start()
    stores = [m.start() for m in re.finditer(r"stmatrix\.sync\.aligned\.m8n8\.x4\.trans", ptx)]
    assert len(stores) == 4  # tile_m / 16 per thread and block
    assert all((x < first_dv) == ds_before_dv for x in stores)
    fence = ptx.index("fence.proxy.async.shared::cta", max(stores))
    assert fence > first_dv


@pytest.mark.slow
@pytest.mark.parametrize("d,long_rows", [(64, False), (96, False), (128, False), (128, True), (192, False),
                                         (256, False)])
def test_sm90_bwd_postprocess_stages_dq_through_smem_in_16_byte_rows(d: int, long_rows: bool) -> None:
    """dQ leaves the postprocess through stmatrix and 16-byte global stores only (the 80-row
    tile's dQ^T fragment through transposing stmatrix)."""
    cfg = BwdSm90Config(target="sm_90a", hdim=d, **(LONG_ROWS if long_rows else {})).post()
    _, cubin = jit.compile_artifacts(cfg)
    if ins.tools_dir() is None:
        pytest.skip("no cuobjdump")
    sass = ins.cubin_sass_and_usage(cubin)[0] or ""
    stores = re.findall(r"STG\.E(?:\.\w+)*", sass)
    assert "STSM" in sass and stores and set(stores) == {"STG.E.128"}, set(stores)
    # One 16-byte smem read per 16 bytes of the tile: no row pass reaches past it (32-row passes
    # over an 80-row tile did, and faulted on the GPU).
    assert sass.count("LDS.128") == cfg.tile_m * d * 2 // 16 // 256


def test_sm90_bwd_postprocess_compiles() -> None:
    ptx, _ = jit.compile_artifacts(FAST.post())
    assert _count(ptx, "ld.global") > 0 and _count(ptx, "st.global") > 0


def test_sm90_bwd_rejects_what_it_does_not_cover_yet() -> None:
    for kw in (dict(hdim=80), dict(tile_n=64), dict(hdim=160), dict(hdim=64, softcap=True, tile_m=128),
               dict(hdim=64, tile_m=80), dict(hdim=128, tile_m=80, softcap=True), dict(hdim=128, hdim_v=64),
               dict(hdim=128, softcap=True, prefetch_stats=True), dict(hdim=128, tile_m=80, causal=True),
               dict(hdim=128, tile_m=80, local=True), dict(hdim=128, tile_m=80, deterministic=True),
               dict(hdim=192, ds_before_dv=True), dict(hdim=256, ds_stages=2),
               dict(hdim=192, hdim_v=128, split_loads=True),
               dict(hdim=128, deterministic=True, rotate_m=True, causal=True),
               dict(hdim=128, causal=True, varlen=True, lpt=True)):
        with pytest.raises(ValueError):
            BwdSm90Config(target="sm_90a", **kw)


@pytest.mark.parametrize("d,n,kv_heads,short", [(128, 8192, 16, True), (128, 4096, 16, False),
                                                 (192, 8192, 10, True), (64, 8192, 32, True),
                                                 (256, 8192, 8, False), (128, 16384, 16, False),
                                                 (64, 2048, 32, False)])
def test_sm90_bwd_launcher_balances_lpt_sections_only_where_the_last_would_be_short(
        d: int, n: int, kv_heads: int, short: bool) -> None:
    """Sections of as many heads as fit 40 MiB of L2 (d * 8 bytes per query row): 16 heads at
    d = 128, 8k in 5s leave 1 (balanced to 4 x 4); at 4k, 10 + 6 stays."""
    cfg = BwdSm90Config(target="sm_90a", hdim=d, causal=True)
    assert cfg.lpt and cfg.lpt_last_section_short(n, kv_heads) == short


@pytest.mark.parametrize("kw,rows,long", [(dict(hdim=128), 16384, True), (dict(hdim=128), 2048, True),
                                          (dict(hdim=128), 2047, False),
                                          (dict(hdim=128, causal=True), 16384, False),
                                          (dict(hdim=128, local=True), 16384, False),
                                          (dict(hdim=128, softcap=True), 16384, False),
                                          (dict(hdim=128, varlen=True), 16384, False),
                                          (dict(hdim=128, deterministic=True), 16384, False),
                                          (dict(hdim=64), 16384, False), (dict(hdim=256), 16384, False)])
def test_sm90_bwd_launcher_takes_80_query_rows_only_for_long_unmasked_d128(kw: dict, rows: int,
                                                                           long: bool) -> None:
    """``long_rows_overrides``: fixed-length non-causal d = 128 from 2k query rows, nothing else;
    the tile it gives is a valid config (its switches resolve without a conflict)."""
    over = long_rows_overrides(dict(target="sm_90a", **kw), rows)
    assert bool(over) == long
    if long:
        assert BwdSm90Config(target="sm_90a", **kw, **over).tile_m == 80


def _problem(**kw) -> Problem:
    base = dict(target=None, dtype="bf16", hdim=128, hdim_v=128, max_seqlen_q=4096, max_seqlen_k=4096,
                heads_q=16, heads_kv=16, num_sms=132)
    return Problem(**{**base, **kw})


def test_sm90_bwd_plan_follows_its_launch_rules() -> None:
    """``plan``: the long-sequence tile (non-causal d = 128 from 2k rows), overridden by an explicit
    tile; balanced ``lpt`` sections where the last full one would be short; the rotated
    deterministic order where a head's key blocks fit on the SMs; a compile-only problem (no
    extents) gets the base variant; pre / post share the main kernel's query tile."""
    from cute_flash.hopper.bwd_config import plan

    pre, main, post = plan(_problem())
    assert main.tile_m == 80 and pre.tile_m == post.tile_m == 80 and pre.launch_dependents
    assert plan(_problem(), (("tile_m", 64),))[1].tile_m == 64
    assert plan(_problem(max_seqlen_q=1000, max_seqlen_k=1000))[1].tile_m == 64
    assert plan(_problem(max_seqlen_q=None, max_seqlen_k=None))[1].tile_m == 64
    assert plan(_problem(causal=True, max_seqlen_q=8192, max_seqlen_k=8192))[1].lpt_balanced
    assert not plan(_problem(causal=True))[1].lpt_balanced  # 4k: 10 + 6 heads stays
    det = plan(_problem(deterministic=True, max_seqlen_q=1000, max_seqlen_k=1000))[1]
    assert det.rotate_m and det.tile_m == 64
    assert not plan(_problem(deterministic=True, max_seqlen_q=132 * 128 + 1,
                             max_seqlen_k=132 * 128 + 1))[1].rotate_m
    assert plan(_problem(dlse=True))[0].dlse


def test_sm90_bwd_kernels_are_built_once_per_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    """``launch._bwd_kernels``: the configs and kernels of a problem come from its cache on every
    later call (no config rebuilt on the host per launch); the long-rows tile and overrides still
    decide the tile, and a causal problem whose last head section is short gets it balanced."""
    from cute_flash import launch

    built: list = []
    monkeypatch.setattr(jit, "compile_kernel", lambda cfg, keep=False: built.append(cfg) or cfg)
    launch._bwd_kernels.cache_clear()
    try:
        kernels = launch._bwd_kernels(_problem(), "sm90", ())
        assert launch._bwd_kernels(_problem(), "sm90", ()) is kernels
        cfg = kernels[0]
        assert len(built) == 3 and cfg.tile_m == 80 and kernels[1:] == (cfg.pre(), cfg, cfg.post(), 1)
        forced = launch._bwd_kernels(_problem(), "sm90", (("tile_m", 64),))
        assert forced[0].tile_m == 64 and len(built) == 6
        gqa = launch._bwd_kernels(_problem(heads_kv=4), "sm90", ())
        assert gqa[0].split_heads and gqa[-1] == 4  # (4 x 32 key blocks: one query head per CTA)
        causal = _problem(causal=True, max_seqlen_q=8192, max_seqlen_k=8192)
        assert launch._bwd_kernels(causal, "sm90", ())[0].lpt_balanced
        sm80 = launch._bwd_kernels(_problem(target="sm_80", max_seqlen_q=None, max_seqlen_k=None), "sm80", ())
        assert type(sm80[0]).__name__ == "BwdConfig"
        with pytest.raises(ValueError, match="overrides"):
            launch._bwd_kernels(_problem(target="sm_80"), "sm80", (("tile_m", 64),))
    finally:
        launch._bwd_kernels.cache_clear()  # (stand-in kernels must not outlive the test)


def test_sm90_bwd_rotates_the_query_walk_by_default_only_at_d256_and_not_in_deterministic_mode() -> None:
    """The rotated walk measured faster at d = 256 without masks only; deterministic mode takes
    it only when asked (its rotated add order), and never with masks (the order assumes every key
    block sees every query block)."""
    assert BwdSm90Config(target="sm_90a", hdim=256).rotate_m
    assert BwdSm90Config(target="sm_90a", hdim=256, varlen=True).rotate_m
    assert not BwdSm90Config(target="sm_90a", hdim=256, causal=True).rotate_m
    assert not BwdSm90Config(target="sm_90a", hdim=256, deterministic=True).rotate_m
    for d in (64, 96, 128, 192):
        assert not BwdSm90Config(target="sm_90a", hdim=d).rotate_m
    assert BwdSm90Config(target="sm_90a", hdim=128, deterministic=True, rotate_m=True).rotate_m
    for mask in (dict(causal=True), dict(local=True)):
        with pytest.raises(ValueError, match="rotated walk only without"):
            BwdSm90Config(target="sm_90a", hdim=128, deterministic=True, rotate_m=True, **mask)


def test_rotated_add_rank_orders_every_query_blocks_adders_by_step_then_key_block() -> None:
    """``rotated_add_rank`` (branch-free, once per block in the kernel) against sorting: for every
    query block, its N adders ranked 0 .. N - 1 by (step = (m - n) mod M, n) -- also with more key
    than query blocks (several key blocks at the same step) and with fewer."""
    from cute_flash.device.scratch import rotated_add_rank

    for num_n in range(1, 26):
        for num_m in range(1, 26):
            for m in range(num_m):
                adders = sorted(range(num_n), key=lambda n, m=m: ((m - n) % num_m, n))
                got = [rotated_add_rank((m - n) % num_m, m, num_m, num_n // num_m, num_n % num_m, n // num_m)
                       for n in adders]
                assert got == list(range(num_n)), (num_n, num_m, m)
                # The first adder never waits; every other one's predecessor is one step (or, at a
                # tie, one key block) earlier.
                steps = [(m - n) % num_m for n in adders]
                assert steps == sorted(steps)


def test_sm90_bwd_do_stages_only_below_q_stages_in_the_wide_kernel_with_split_loads() -> None:
    """Fewer dO than Q stages: the wide kernel with split loads only (the dO pipeline then has its
    own state); d = 192's tile (2 Q + 1 dO stages beside the dQ writer, flash-attn-4's) is the
    default and fits in smem."""
    for kw in (dict(hdim=128, stages=2, do_stages=1), dict(hdim=192, stages=1, do_stages=2),
               dict(hdim=192, stages=2, do_stages=1, split_loads=False)):
        with pytest.raises(ValueError):
            BwdSm90Config(target="sm_90a", **kw)
    for kw in (dict(), dict(causal=True), dict(deterministic=True), dict(softcap=True)):
        cfg = BwdSm90Config(target="sm_90a", hdim=192, **kw)
        assert (cfg.stages, cfg.do_stages) == (2, 1) and cfg.split_loads, kw
        assert cfg.smem_bytes() <= 227 * 1024


def test_rotated_deterministic_order_only_where_every_key_block_of_a_head_is_resident(monkeypatch) -> None:
    """The launcher's rule for the rotated deterministic order: a head dim where it measured
    faster, no masks, and ceil(Nk / tile_n) key blocks at most one per SM (the waits chain through
    all of them)."""
    from cute_flash.hopper import bwd_config

    monkeypatch.setattr(bwd_config, "SM90_BWD_DET_ROTATE", (128,))
    det = BwdSm90Config(target="sm_90a", hdim=128, deterministic=True)
    assert bwd_config.det_rotate_applies(det, 132 * 128, 132)
    assert not bwd_config.det_rotate_applies(det, 132 * 128 + 1, 132)
    for other in (BwdSm90Config(target="sm_90a", hdim=128, deterministic=True, causal=True),
                  BwdSm90Config(target="sm_90a", hdim=128, deterministic=True, local=True),
                  BwdSm90Config(target="sm_90a", hdim=128)):
        assert not bwd_config.det_rotate_applies(other, 1024, 132)
    d64 = BwdSm90Config(target="sm_90a", hdim=64, deterministic=True)
    assert not bwd_config.det_rotate_applies(d64, 1024, 132)  # not in the patched head dims
    monkeypatch.setattr(bwd_config, "SM90_BWD_DET_ROTATE", ())
    assert not bwd_config.det_rotate_applies(det, 1024, 132)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_deterministic_writer_orders_the_bulk_adds_off_the_consumers(causal: bool) -> None:
    """Deterministic mode: the consumers issue no dQ reductions and no gpu fences; the writer
    warp acquires the flag (spin), fences into the async proxy, bulk-adds both warpgroups'
    halves, waits for their completion (not just the smem read) and releases."""
    cfg = BwdSm90Config(target="sm_90a", hdim=128, causal=causal, deterministic=True)
    ptx, _ = jit.compile_artifacts(cfg)
    assert _count(ptx, "red.relaxed.gpu.global.add.v4.f32") == 0
    assert _count(ptx, "fence.acq_rel.gpu") == 0
    assert _count(ptx, "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 2
    assert _count(ptx, "ld.acquire.gpu") > 0 and _count(ptx, "st.release.gpu") == 1
    assert _count(ptx, "fence.proxy.async.global") == 2
    # One full-completion wait per query block before the release (plus the exit's).
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\s+0;", ptx)) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [False, True])
def test_sm90_bwd_waits_for_the_preprocess_in_every_role(deterministic: bool) -> None:
    """Programmatic dependent launch: the preprocess lets the main kernel launch early, and each
    role of the main kernel that reads the preprocess's output (producer: LSE2 / D; the dQ writer
    and the consumers: the zeroed accumulator, semaphores) waits for it first."""
    cfg = BwdSm90Config(target="sm_90a", hdim=128, deterministic=deterministic)
    ptx, _ = jit.compile_artifacts(cfg)
    pre_ptx, _ = jit.compile_artifacts(cfg.pre())
    assert _count(pre_ptx, "griddepcontrol.launch_dependents") == 1
    assert _count(ptx, "griddepcontrol.wait") == 3


@pytest.mark.slow
def test_inspect_reports_the_sm90_backward_family() -> None:
    """``python -m cute_flash inspect --arch sm_90a --kernel bwd --family sm90 --json``: wgmma, TMA,
    register reallocation both ways, the writer warp's bulk dQ reduce-adds."""
    report = ins.inspect_variant(ins.Variant(arch="sm_90a", kernel="bwd", hdim=128, family="sm90"))
    ptx = report["ptx"]
    for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg.inc", "setmaxnreg.dec",
               "cp.reduce.async.bulk"):
        assert ptx.get(op, 0) > 0, op
    assert report["spill_bytes"] in (0, None)
