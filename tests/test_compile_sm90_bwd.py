"""The sm90 backward compiles for sm_90a on the CPU with the instructions it is meant to use and no
spills; on a Hopper GPU its gradients are checked against the fp32 reference with the usual 2x
rule."""

from __future__ import annotations

import re

import pytest

from cute_flash import inspect as ins
from cute_flash import jit
from cute_flash.bwd_sm90 import BwdSm90Config

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
    # The narrow kernel's earlier schedule (its switches off: dK before dQ, one dS buffer behind an
    # EMPTY barrier, 2-byte dS stores), still reachable through overrides for tuning.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, softcap=sc, dq_before_dk=False,
                  ds_stages=1, ds_stmatrix=False)
    for d, c, sc in ((64, False, False), (128, True, False), (128, False, True))
] + [
    # 80-row query blocks at d = 128 (dQ^T with the head dim on M).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, tile_m=80, causal=c, varlen=vl, deterministic=det)
    for c, vl, det in ((False, False, False), (True, True, False), (False, False, True))
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
    # Deterministic dQ (ordered accumulation through semaphores), ascending and descending order.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, varlen=vl, deterministic=True,
                  det_descending=desc)
    for d, c, vl, desc in ((128, False, False, False), (128, True, True, False), (128, True, False, True),
                           (256, True, True, True), (96, True, False, True), (192, False, True, True))
] + [
    # Deterministic dQ through the writer warp (flash-attn-4's sm90 scheme): its lane 0 waits on
    # the semaphore and publishes after the bulk adds complete; the consumers hand dQ over as in
    # the default mode.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, hdim_v=dv, causal=c, local=lo, varlen=vl, softcap=sc,
                  deterministic=True, dq_warp=True)
    for d, dv, c, lo, vl, sc in ((64, 64, False, False, False, False), (64, 64, True, False, True, False),
                                 (96, 96, True, False, False, False), (128, 128, False, False, False, True),
                                 (128, 128, True, False, True, False), (192, 192, True, False, False, False),
                                 (192, 128, False, False, False, False),
                                 (256, 256, False, True, False, False))
] + [
    # Deterministic mode with the consumers ordering their own reductions (the writer is the
    # default since session 18).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, deterministic=True, dq_warp=False)
    for d, c in ((64, True), (128, False), (256, True))
] + [
    # Deterministic mode on the rotated walk (no masks): the rotated add order, with the writer or
    # the consumers ordering the adds.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, hdim_v=dv, varlen=vl, deterministic=True,
                  rotate_m=True, dq_warp=w)
    for d, dv, vl, w in ((64, 64, False, True), (128, 128, True, True), (128, 128, False, False),
                         (192, 192, False, True), (192, 128, False, False), (256, 256, True, True))
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
    # Programmatic dependent launch after the preprocess (the default everywhere).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, deterministic=det, pdl=True)
    for d, c, det in ((64, True, False), (128, False, False), (128, True, True), (256, True, False))
] + [
    # FA4's d = 128 non-causal tile with stmatrix dS (one 8x8 tile per instruction; off: it lost to
    # the 64-row tile with the other switches on).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, tile_m=80, ds_stmatrix=True, varlen=vl)
    for vl in (False, True)
] + [
    # The same tile with dS^T stored ahead of dV's wgmma: 4 tiles per stmatrix (5 per block), the
    # wgmmas not serialised (3-4% slower than the default in session 21's timing: off).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, tile_m=80, ds_stmatrix=True, dq_writer_batch=True,
                  dkv_stmatrix=True, mask_always=True, ds_before_dv=True)
] + [
    # The schedule before session 7's switches (each one off; still reachable through overrides).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=c, pdl=False, post_stage_smem=False,
                  prefetch_stats=False, dq_writer_batch=False, dkv_stmatrix=False)
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
                              (192, True, False, True, dict(spin_waits=True)),
                              # two Q stages, one dO stage and the dQ writer (flash-attn-4's d = 192)
                              (192, True, False, False, dict(stages=2, do_stages=1, dq_warp=True)),
                              (192, False, True, False, dict(stages=2, do_stages=1, dq_warp=True)))
] + [
    # The wide kernel's P and dS to smem by stmatrix (on by default since session 11).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, hdim_v=dv, causal=c, softcap=sc, ds_stmatrix=True)
    for d, dv, c, sc in ((192, 192, True, False), (256, 256, False, False), (192, 128, True, False),
                         (256, 256, True, True))
] + [
    # The wide kernel's dK^T / dV^T to smem by transposing stmatrix (session 11: noise, off; with
    # stmatrix P / dS at d = 192 causal it spills 24 bytes).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, hdim_v=dv, causal=c, softcap=sc, deterministic=det,
                  dkv_stmatrix=True, **kw)
    for d, dv, c, sc, det, kw in ((192, 192, True, False, False, dict(ds_stmatrix=False)),
                                  (256, 256, False, False, False, {}),
                                  (192, 128, False, False, False, {}), (192, 192, True, True, False, {}),
                                  (256, 256, True, False, True, {}),
                                  (192, 192, False, False, False, dict(ds_stmatrix=True)),
                                  (256, 256, True, False, False, dict(ds_stmatrix=True)))
] + [
    # The wide kernel in flash-attn-4's order (P stored under dP, dV under the dS store, dQ handed
    # over under dK; session 11).
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
    # dK / dV staged in the dS buffers, on one CTA per tile and on the persistent grid.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=mode == "causal", local=mode == "local",
                  softcap=sc, dkv_via_ds=True, persistent=p)
    for d, mode, sc, p in ((64, "causal", False, False), (128, "plain", False, False),
                           (64, "causal", False, True), (64, "plain", False, True),
                           (128, "causal", False, True), (128, "local", False, True),
                           (96, "causal", False, True), (128, "causal", True, False))
] + [
    # The longest-first walk over evenly sized head sections (session 12).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=True, lpt_balanced=True) for d in (64, 192)
] + [
    # The persistent grid with the stmatrix epilogue through sK / sV (K / V released after it).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, causal=True, persistent=True, dkv_via_ds=False,
                  dkv_stmatrix=True)
    for d in (64, 128)
] + [
    # Query blocks walked from the key block's own offset (the default at d = 256 only).
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, hdim_v=dv, causal=c, rotate_m=True)
    for d, dv, c in ((64, 64, False), (128, 128, True), (192, 192, False), (192, 128, True))
] + [
    # dS^T stored before dV's wgmma is issued, its fence and barrier after (flash-attn-4's order),
    # on both dS paths (stmatrix on two buffers, 2-byte stores behind the EMPTY barrier).
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
                                       dict(dq_before_dk=False, ds_stages=1, ds_stmatrix=False)))
] + [
    # flash-attn-4's d = 128 non-causal tile (80 query rows) with the 64-row tile's switches.
    BwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, tile_m=80, ds_stmatrix=True, varlen=vl,
                  dq_writer_batch=True, dkv_stmatrix=True, mask_always=True, ds_before_dv=dsb)
    for vl, dsb in ((False, False), (False, True), (True, True))
]


def _count(ptx: str, op: str) -> int:
    return len(re.findall(rf"^\s*(?:@!?%p\d+\s+)?{re.escape(op)}", ptx, flags=re.M))


def _id(cfg: BwdSm90Config) -> str:
    mode = "causal" if cfg.causal else "local" if cfg.local else "plain"
    names = ("softcap", "varlen", "deterministic", "prefetch_stats", "dq_writer_batch", "pdl", "dkv_stmatrix",
             "post_stage_smem", "split_loads", "spin_waits", "dkv_via_ds", "persistent", "lpt_balanced",
             "rotate_m", "mask_always", "ds_before_dv")
    flags = [f for f in names if getattr(cfg, f)]
    flags += ["ascending"] if cfg.deterministic and not cfg.det_descending else []
    flags += ["consumers"] if cfg.deterministic and not cfg.dq_warp else []
    flags += ["old-schedule"] if cfg.hdim <= 128 and not cfg.ds_stmatrix else []
    flags += ["pds-stmatrix"] if cfg.hdim > 128 and cfg.ds_stmatrix else []
    flags += ["fa4-order"] if cfg.hdim > 128 and cfg.dq_before_dk else []
    flags += ["stmatrix"] if cfg.tile_m == 80 and cfg.ds_stmatrix else []
    dims = f"d{cfg.hdim}" if cfg.hdim_v == cfg.hdim else f"d{cfg.hdim}-dv{cfg.hdim_v}"
    dims += f"-m{cfg.tile_m}" if cfg.tile_m == 80 else ""
    return "-".join([cfg.dtype, dims, mode, *flags])


@pytest.mark.parametrize("cfg", VARIANTS, ids=_id)
def test_sm90_bwd_compiles_with_wgmma_tma_and_no_spills(cfg: BwdSm90Config) -> None:
    ptx, cubin = jit.compile_artifacts(cfg)
    # TMA for Q, dO, K, V; plain bulk copies for the LSE2 / D rows of each query block.
    assert "cp.async.bulk.shared::cluster.global.mbarrier" in ptx
    for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait", "setmaxnreg.inc",
               "setmaxnreg.dec", "ex2.approx"):
        assert _count(ptx, op) > 0, f"no {op} in the PTX"
    # dQ: one bulk reduce-add per query block from the writer warp, or 16-byte vector reductions
    # from the consumers (d = 192, deterministic mode) -- never scalar ones.
    dq_op = ("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" if cfg.dq_warp
             else "red.relaxed.gpu.global.add.v4.f32")
    assert _count(ptx, dq_op) > 0, f"no {dq_op} in the PTX"
    assert _count(ptx, "red.relaxed.gpu.global.add.f32") == 0
    assert _count(ptx, "ld.local") == 0 and _count(ptx, "st.local") == 0
    # Five GEMMs per query block: S^T, dP^T, dQ as SS; dV, dK with A from registers.
    rs = r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k16\.f32\.(bf16|f16)\.(bf16|f16)\s+\{[^}]*\},\s*\{"
    if cfg.hdim <= 128:  # d=256 reads P and dS from smem (its dK^T / dV^T GEMMs take them as B)
        assert re.search(rs, ptx), "no register-A (RS) wgmma for dK / dV"
    if ins.tools_dir() is None:
        pytest.skip("no cuobjdump: cubin resource usage not checked")
    sass, usage = ins.cubin_sass_and_usage(cubin)
    sass = sass or ""
    # No spills, except softcap at d = 128 with 2-byte dS stores (the old schedule): its 1 - tanh^2
    # factor costs 7 spill stores at this register budget, where dK, dV, S^T, dP^T are 192 of the
    # 240 -- bounded so a real regression still fails.
    clean = not (cfg.softcap and cfg.hdim == 128 and not cfg.ds_stmatrix)
    for fn, res in usage.items():
        if clean:
            assert res.get("LOCAL", 0) == 0 and res.get("STACK", 0) == 0, f"{fn}: spills {res}"
    if sass:
        spills = len(re.findall(r"\bSTL\b", sass))
        assert spills <= (0 if clean else 12), f"{spills} spill stores"
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
        assert "UTMALDG" in sass and ("UBLKRED" if cfg.dq_warp else "REDG") in sass
        if cfg.ds_stmatrix and cfg.tile_m == 80 and not cfg.ds_before_dv:  # dS^T: 20 1-tile stmatrix.trans
            assert len(re.findall(r"STSM\.16\.MT88\b(?!\.)", sass)) == 20
        elif cfg.ds_stmatrix and cfg.hdim > 128:  # P and dS: stmatrix.x4 (not transposed)
            assert sass.count("STSM.16.M88.4") == (6 if cfg.tile_n == 96 else 4)
        elif cfg.ds_stmatrix:  # dS^T: tile_m / 16 stmatrix.x4.trans per thread and block
            assert sass.count("STSM.16.MT88.4") == cfg.tile_m // 16
        if cfg.dkv_stmatrix and cfg.hdim > 128:
            # dK^T / dV^T: (d + d_v) x tile_n / 2 values per warpgroup, 32 per stmatrix.x4.trans per
            # thread -- and none of the 2-byte stores of the other epilogue beyond P's and dS's.
            per_thread = (cfg.hdim + cfg.hdim_v) * cfg.tile_n // 2 // 128
            assert sass.count("STSM.16.MT88.4") == per_thread // 8
            pds = 0 if cfg.ds_stmatrix else 2 * cfg.tile_m * cfg.tile_n // 256
            assert len(re.findall(r"\bSTS\.U16\b", sass)) <= pds  # (some pairs merge into 4-byte stores)


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


@pytest.mark.parametrize("d,tile_m", [(64, 0), (96, 0), (128, 0), (128, 80), (192, 0), (256, 0)])
def test_sm90_bwd_postprocess_staged_through_smem_writes_16_byte_rows(d: int, tile_m: int) -> None:
    """``post_stage_smem``: dQ leaves through stmatrix and 16-byte global stores only (the 80-row
    tile's dQ^T fragment through transposing stmatrix)."""
    cfg = BwdSm90Config(target="sm_90a", hdim=d, tile_m=tile_m, post_stage_smem=True).post()
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
    ptx, _ = jit.compile_artifacts(VARIANTS[0].post())
    assert _count(ptx, "ld.global") > 0 and _count(ptx, "st.global") > 0


def test_sm90_bwd_rejects_what_it_does_not_cover_yet() -> None:
    with pytest.raises(ValueError):
        BwdSm90Config(target="sm_90a", hdim=80)
    with pytest.raises(ValueError):
        BwdSm90Config(target="sm_90a", tile_n=64)
    with pytest.raises(ValueError):
        BwdSm90Config(target="sm_90a", hdim=160)
    with pytest.raises(ValueError):
        BwdSm90Config(target="sm_90a", hdim=64, softcap=True, tile_m=128)
    with pytest.raises(ValueError):
        BwdSm90Config(target="sm_90a", hdim=64, tile_m=80)
    with pytest.raises(ValueError):
        BwdSm90Config(target="sm_90a", hdim=128, tile_m=80, softcap=True)
    with pytest.raises(ValueError):
        BwdSm90Config(target="sm_90a", hdim=128, hdim_v=64)
    with pytest.raises(ValueError):
        BwdSm90Config(target="sm_90a", hdim=128, softcap=True, prefetch_stats=True)
    with pytest.raises(ValueError):
        BwdSm90Config(target="sm_90a", hdim=128, tile_m=80, ds_stmatrix=True, causal=True)


def test_sm90_bwd_persistent_grid_refuses_what_it_cannot_walk() -> None:
    """The persistent grid strides over a fixed tile count with split loads in the narrow kernel:
    varlen (tiles per batch known on the device), deterministic mode (its semaphore order needs
    CTAs in blockIdx order), softcap (spills), the wide kernel and unsplit loads are refused;
    num_ctas without it too, and the 2-byte smem epilogue (it spills there). Asked for, it brings the epilogue
    through the dS buffers (K / V released before it) and a grid size."""
    for kw in (dict(varlen=True), dict(deterministic=True), dict(hdim=256), dict(split_loads=False),
               dict(hdim=128, softcap=True),
               dict(dkv_via_ds=False, dkv_stmatrix=False)):
        with pytest.raises(ValueError):
            BwdSm90Config(target="sm_90a", persistent=True, **kw)
    with pytest.raises(ValueError):
        BwdSm90Config(target="sm_90a", num_ctas=8)
    with pytest.raises(ValueError):
        BwdSm90Config(target="sm_90a", hdim=256, dkv_via_ds=True)


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
    the tile it gives compiles (its switches resolve without a conflict)."""
    from cute_flash.bwd_sm90 import long_rows_overrides

    over = long_rows_overrides(dict(target="sm_90a", **kw), rows)
    assert bool(over) == long
    if long:
        assert BwdSm90Config(target="sm_90a", **kw, **over).tile_m == 80


def test_sm90_bwd_launch_plan_is_built_once_per_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    """``launch_plan``: the configs and kernels of a problem come from its cache on every later
    call (no config rebuilt on the host per launch); the long-rows tile and overrides still
    decide the tile, and a causal problem whose last head section is short gets it balanced."""
    from cute_flash import bwd_sm90

    built: list = []
    monkeypatch.setattr(jit, "compile_kernel", lambda cfg, keep=False: built.append(cfg) or cfg)
    fields = dict(dtype="bf16", hdim=128, hdim_v=128, causal=False, local=False, softcap=False,
                  varlen=False, deterministic=False)
    bwd_sm90.launch_plan.cache_clear()
    try:
        problem = tuple(fields.items())
        plan = bwd_sm90.launch_plan(problem, 4096, 4096, 16, 16, 132, False, ())
        assert bwd_sm90.launch_plan(problem, 4096, 4096, 16, 16, 132, False, ()) is plan
        cfg = plan[0]
        assert len(built) == 3 and cfg.tile_m == 80 and plan[1:] == (cfg.pre(), cfg, cfg.post())
        forced = bwd_sm90.launch_plan(problem, 4096, 4096, 16, 16, 132, False, (("tile_m", 64),))
        assert forced[0].tile_m == 64 and len(built) == 6
        causal = tuple({**fields, "causal": True}.items())
        assert bwd_sm90.launch_plan(causal, 8192, 8192, 16, 16, 132, False, ())[0].lpt_balanced
    finally:
        bwd_sm90.launch_plan.cache_clear()  # (stand-in kernels must not outlive the test)


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
    from cute_flash.kernels.bwd_math import rotated_add_rank

    for num_n in range(1, 34):
        for num_m in range(1, 34):
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
    own state); flash-attn-4's d = 192 tile (2 + 1 stages with the dQ writer) fits in smem."""
    for kw in (dict(hdim=128, stages=2, do_stages=1), dict(hdim=192, stages=1, do_stages=2, dq_warp=False),
               dict(hdim=192, stages=2, do_stages=1, split_loads=False)):
        with pytest.raises(ValueError):
            BwdSm90Config(target="sm_90a", **kw)
    cfg = BwdSm90Config(target="sm_90a", hdim=192, stages=2, do_stages=1, dq_warp=True, split_loads=True)
    assert cfg.smem_bytes() <= 227 * 1024
    cfg = BwdSm90Config(target="sm_90a", hdim=64, causal=True, persistent=True)
    assert cfg.dkv_via_ds and cfg.num_ctas == 132
    assert not BwdSm90Config(target="sm_90a", hdim=64, persistent=True, dkv_via_ds=False,
                             dkv_stmatrix=True).dkv_via_ds


def _hopper() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


GPU_CASES = [
    # (B, Nq, Nk, H, H_kv, causal, window)
    (2, 256, 256, 4, 4, False, (-1, -1)),
    (2, 256, 256, 4, 4, True, (-1, -1)),
    (1, 333, 517, 2, 2, False, (-1, -1)),
    (1, 517, 333, 2, 2, True, (-1, -1)),  # bottom-right causal, rows that see no key
    (2, 1000, 1000, 3, 3, True, (-1, -1)),
    (2, 400, 600, 8, 2, False, (-1, -1)),  # GQA: dK, dV summed over 4 query heads
    (1, 300, 300, 4, 1, True, (-1, -1)),  # MQA
    (2, 500, 700, 2, 2, False, (96, 32)),  # sliding window
    (2, 300, 300, 4, 2, True, (-1, -1), 30.0),  # softcap
    # Left window only, more queries than keys: the unbounded right side must not bind (it did
    # when "unbounded" was seqlen_k, with key - query reaching past offset + seqlen_k).
    (2, 1000, 113, 6, 1, False, (128, -1)),
]
# (..., softcap, d): softcap 0 unless given; d = 64, 96, 192, 256 on a few of them.
GPU_CASES = [c if len(c) == 8 else (*c, 0.0) for c in GPU_CASES]
GPU_CASES = ([(*c, 128) for c in GPU_CASES] + [(*GPU_CASES[i], 64) for i in (1, 3, 5, 7, 8, 9)]
             + [(*GPU_CASES[i], d) for d in (96, 192, 256) for i in (0, 3, 5, 7, 8, 9)]
             # d = 64 softcap (64-query blocks): bottom-right causal with rows that see no key, GQA
             # with a window, partial blocks on both axes.
             + [(1, 517, 333, 4, 2, True, (-1, -1), 30.0, 64), (2, 500, 700, 6, 2, False, (96, 32), 20.0, 64),
                (1, 1000, 1000, 2, 2, False, (-1, -1), 50.0, 64)])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case", GPU_CASES)
def test_sm90_bwd_gradients_within_twice_pytorch_error(case: tuple) -> None:
    _check_gradients(case)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case", [(*GPU_CASES[i][:8], (192, 128)) for i in (0, 3, 5, 7, 8, 9)])
def test_sm90_bwd_narrow_v_gradients_within_twice_pytorch_error(case: tuple) -> None:
    """d_v != d, (192, 128): dP, dV^T and the dO / V tiles at 128, Q / K / dQ / dK at 192."""
    _check_gradients(case)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (0, 1, 2, 3, 5, 7, 9)])
@pytest.mark.parametrize("staged", [True, False], ids=["post-staged", "post-direct"])
def test_sm90_bwd_80_query_rows_keep_gradients_within_twice_pytorch_error(case: tuple, staged: bool) -> None:
    """tile_m = 80 at d = 128: dQ^T = K^T dS^T (head dim on M), read back transposed by the
    postprocess (through smem by transposing stmatrix, or stored straight from the fragment);
    query blocks that straddle 64-row boundaries."""
    _check_gradients(case, overrides=dict(tile_m=80, post_stage_smem=staged))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("switches", [dict(dq_before_dk=False, ds_stages=1, ds_stmatrix=False),
                                      dict(ds_stmatrix=False)],
                         ids=["old-schedule", "ds-2byte-stores"])
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (1, 3, 5, 7, 8, 9)]
                         + [c for c in GPU_CASES if c[-1] == 64][:3])
def test_sm90_bwd_schedule_switches_keep_gradients_within_twice_pytorch_error(case: tuple,
                                                                              switches: dict) -> None:
    """The schedule switches off (dK before dQ, one dS buffer, 2-byte dS stores), or only stmatrix
    off: same rule."""
    _check_gradients(case, overrides=switches)


# The switches of session 6, measured in session 7 and now on where they won (docs/notes.md):
# each one alone, and all together, must keep the gradients right wherever it compiles.
CANDIDATE_SWITCHES = {
    "prefetch-stats": dict(prefetch_stats=True), "dq-writer-batch": dict(dq_writer_batch=True),
    "pdl": dict(pdl=True), "dkv-stmatrix": dict(dkv_stmatrix=True),
    "post-stage-smem": dict(post_stage_smem=True), "spin-waits": dict(spin_waits=True),
    "spin-waits-split-loads": dict(spin_waits=True, split_loads=True),
    "pre-256-threads": dict(pre_threads=256), "rotate-m": dict(rotate_m=True),
    "mask-always": dict(mask_always=True), "ds-before-dv": dict(ds_before_dv=True),
    "ds-before-dv-mask-always": dict(ds_before_dv=True, mask_always=True),
    "all": dict(prefetch_stats=True, dq_writer_batch=True, pdl=True, dkv_stmatrix=True, post_stage_smem=True)}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("name", list(CANDIDATE_SWITCHES))
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (1, 3, 5, 9)]
                         + [c for c in GPU_CASES if c[-1] == 64][:2])
def test_sm90_bwd_candidate_switches_keep_gradients_within_twice_pytorch_error(case: tuple,
                                                                               name: str) -> None:
    """Statistics read under the wgmmas, the dQ writer's batched reduce-adds, PDL after the
    preprocess, stmatrix dK / dV: same rule (softcap cases skip prefetch_stats, which refuses it)."""
    switches = CANDIDATE_SWITCHES[name]
    if case[7] and switches.get("prefetch_stats"):
        pytest.skip("prefetch_stats refuses softcap")
    _check_gradients(case, overrides=switches)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (0, 2, 5)])
def test_sm90_bwd_80_query_rows_with_stmatrix_ds_keep_gradients(case: tuple) -> None:
    """tile_m = 80 with one-tile stmatrix dS^T (non-causal, no window: what it allows)."""
    _check_gradients(case, overrides=dict(tile_m=80, ds_stmatrix=True))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
def test_sm90_bwd_long_sequences_take_the_80_row_tile_and_keep_gradients() -> None:
    """4100 query rows (a partial last 80-row block) at d = 128 non-causal: the launcher compiles
    and runs the long-sequence tile on its own, within the usual error rule."""
    _check_gradients((2, 4100, 4100, 2, 2, False, (-1, -1), 0.0, 128))
    assert any(isinstance(c, BwdSm90Config) and c.tile_m == 80 and c.target is None for c in jit._cache)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (0, 2, 5)])
@pytest.mark.parametrize("ds_before_dv", [False, True])
def test_sm90_bwd_80_query_rows_with_the_64_row_switches_keep_gradients(case: tuple,
                                                                        ds_before_dv: bool) -> None:
    """tile_m = 80 with the switches the 64-row tile takes at d = 128 (the dQ writer's batched
    adds, stmatrix dK / dV, every block masked), with and without dS stored before dV's wgmma."""
    _check_gradients(case, overrides=dict(tile_m=80, ds_stmatrix=True, dq_writer_batch=True,
                                          dkv_stmatrix=True, mask_always=True, ds_before_dv=ds_before_dv))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[-1] in (64, 96, 128, 192, 256)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_sm90_bwd_split_loads_keep_gradients_within_twice_pytorch_error(case: tuple,
                                                                        deterministic: bool) -> None:
    """K / V on a barrier each, Q + LSE2 and dO + D on their own pipelines: every case with
    d_v = d, narrow and wide (GQA / MQA, windows, softcap, rows that see no key), also in
    deterministic mode."""
    if deterministic and case not in (GPU_CASES[1], GPU_CASES[5], GPU_CASES[6]):
        pytest.skip("deterministic mode: three cases")
    _check_gradients(case, overrides=dict(split_loads=True), deterministic=deterministic)


# Key blocks that no query sees (a window far from the start): a tile with no query block, which
# on the persistent grid must still move the K/V pipeline by one phase.
UNSEEN_KEYS_CASE = (1, 128, 1024, 2, 2, False, (32, 0), 0.0, 64)
NARROW_CASES = [c for c in GPU_CASES if c[-1] in (64, 96, 128)] + [UNSEEN_KEYS_CASE]
PERSISTENT_SWITCHES = {
    "persistent-3-ctas": dict(persistent=True, num_ctas=3), "persistent": dict(persistent=True),
    "persistent-smem-epilogue": dict(persistent=True, num_ctas=5, dkv_via_ds=False, dkv_stmatrix=True),
    "ds-epilogue": dict(dkv_via_ds=True)}


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("name", list(PERSISTENT_SWITCHES))
@pytest.mark.parametrize("case", NARROW_CASES)
def test_sm90_bwd_persistent_grid_and_ds_staged_epilogue_keep_gradients(case: tuple, name: str) -> None:
    """The persistent grid (3 / 5 CTAs: every CTA walks several tiles, the pipelines' states and
    the dQ writer's hand-off carried across them; the SM count) and the dK / dV epilogue staged in
    the dS buffers (rows past the last key dropped): every narrow case under the same 2x rule."""
    switches = PERSISTENT_SWITCHES[name]
    if case[7] and switches.get("persistent"):
        pytest.skip("the persistent grid refuses softcap")
    if switches.get("num_ctas") == 5 and case[-1] != 128:
        pytest.skip("smem epilogue: d = 128 cases")
    _check_gradients(case, overrides=switches)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[-1] in (96, 192)]
                         + [(*GPU_CASES[i][:8], (192, 128)) for i in (3, 8)])
def test_sm90_bwd_staged_postprocess_at_96_and_192_columns_keeps_dq(case: tuple) -> None:
    """dQ leaves the postprocess through a 64-byte (d = 192) / 32-byte (d = 96) swizzled smem tile:
    the dQ MMA's head-dim halves, 96 / 48 columns, do not tile the 128-byte atom."""
    _check_gradients(case, overrides=dict(post_stage_smem=True))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[-1] == 192])
def test_sm90_bwd_one_do_stage_under_two_q_stages_keeps_gradients(case: tuple) -> None:
    """d = 192 with two Q stages, one dO stage (its own pipeline state) and the dQ writer warp."""
    _check_gradients(case, overrides=dict(stages=2, do_stages=1, dq_warp=True, split_loads=True,
                                          spin_waits=True))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[-1] in (192, 256)]
                         + [(*GPU_CASES[i][:8], (192, 128)) for i in (3, 8)])
@pytest.mark.parametrize("switch", ["ds_stmatrix=0", "dkv_stmatrix=1", "dq_before_dk=1", "dq_before_dk=0",
                                    "prefetch_stats=0", "rotate_m=1", "rotate_m=0", "mask_always=1"])
def test_sm90_bwd_wide_switches_keep_gradients(case: tuple, switch: str) -> None:
    """The wide kernel with P and dS by 2-byte stores, dK^T / dV^T by (transposing) stmatrix, with
    and without flash-attn-4's order (P stored under the dP GEMM, dV under the dS store, dQ handed
    over under dK), the statistics read from smem where used: every d = 192 / 256 case and
    (192, 128)."""
    name, value = switch.split("=")
    _check_gradients(case, overrides={name: bool(int(value))})


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case,l2_mib", [((2, 600, 700, 7, 7, True, (-1, -1), 0.0, 64), 1),
                                         ((1, 300, 300, 7, 7, True, (-1, -1), 0.0, 128), 1),
                                         ((1, 400, 500, 7, 7, True, (-1, -1), 0.0, 192), 2)])
def test_sm90_bwd_balanced_longest_first_sections_keep_gradients(case: tuple, l2_mib: int) -> None:
    """The causal grid walked over evenly sized head sections, with an L2 budget small enough for
    sections of at most 3 heads: 7 heads as 3 + 2 + 2 (the plain walk: 3 + 3 + 1). Every tile
    once, gradients by the usual rule."""
    _check_gradients(case, overrides=dict(lpt_balanced=True, lpt_l2_mib=l2_mib))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
def test_sm90_bwd_with_pdl_is_deterministic_and_right_in_deterministic_mode() -> None:
    _check_gradients(GPU_CASES[3], overrides=dict(pdl=True), deterministic=True)


def _check_gradients(case: tuple, overrides: dict | None = None, deterministic: bool = False) -> None:
    import math

    import torch

    from cute_flash.bwd_sm90 import run_bwd_sm90
    from cute_flash.reference import attention_ref

    B, Nq, Nk, H, Hkv, causal, window, softcap, d = case
    d, dv = d if isinstance(d, tuple) else (d, d)  # (d, d_v) where they differ
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, Nq, H, d, device=dev, dtype=dt)
    k = torch.randn(B, Nk, Hkv, d, device=dev, dtype=dt)
    v = torch.randn(B, Nk, Hkv, dv, device=dev, dtype=dt)
    do = torch.randn(B, Nq, H, dv, device=dev, dtype=dt)
    scale = 1.0 / math.sqrt(d)
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)
    out, lse = attention_ref(q, k, v, **kw)
    out = out.to(dt)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    run_bwd_sm90(do, q, k, v, out, lse.float().contiguous(), *grads, overrides=overrides,
                 deterministic=deterministic, **kw)
    torch.cuda.synchronize()

    def ref_grads(upcast: bool) -> tuple:
        ts = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        o, _ = attention_ref(*ts, upcast=upcast, **kw)
        return torch.autograd.grad(o, ts, do)

    hi, lo = ref_grads(True), ref_grads(False)
    for name, g, g_hi, g_lo in zip("qkv", grads, hi, lo, strict=True):
        err = (g.float() - g_hi.float()).abs().max().item()
        err_lo = (g_lo.float() - g_hi.float()).abs().max().item()
        assert err <= 2 * err_lo + 1e-3, (name, err, err_lo)


def test_inspect_reports_the_sm90_backward_family() -> None:
    """``python -m cute_flash inspect --arch sm_90a --kernel bwd --family sm90 --json``: wgmma, TMA,
    register reallocation both ways, the writer warp's bulk dQ reduce-adds."""
    report = ins.inspect_variant(ins.Variant(arch="sm_90a", kernel="bwd", hdim=128, family="sm90"))
    ptx = report["ptx"]
    for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "setmaxnreg.inc", "setmaxnreg.dec",
               "cp.reduce.async.bulk"):
        assert ptx.get(op, 0) > 0, op
    assert report["spill_bytes"] in (0, None)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("d,causal,split", [(128, False, False), (128, True, False), (64, True, False),
                                            (256, True, False), (96, True, False), (192, False, False),
                                            (64, True, True), (128, False, True)])
def test_sm90_bwd_varlen_gradients_within_twice_pytorch_error(d: int, causal: bool, split: bool) -> None:
    import math

    import torch

    from cute_flash.bwd_sm90 import run_bwd_sm90
    from cute_flash.reference import attention_ref

    torch.manual_seed(1)
    dev, dt, H, Hkv = "cuda", torch.bfloat16, 4, 2
    lq, lk = [300, 1, 129, 517], [200, 77, 129, 600]
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    q = torch.randn(sum(lq), H, d, device=dev, dtype=dt)
    k = torch.randn(sum(lk), Hkv, d, device=dev, dtype=dt)
    v = torch.randn(sum(lk), Hkv, d, device=dev, dtype=dt)
    do = torch.randn(sum(lq), H, d, device=dev, dtype=dt)
    kw = dict(softmax_scale=1.0 / math.sqrt(d), causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = attention_ref(q, k, v, **kw)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    run_bwd_sm90(do, q, k, v, out.to(dt), lse.float().contiguous(), *grads, max_seqlen_q=max(lq),
                 max_seqlen_k=max(lk), overrides=dict(split_loads=True) if split else None, **kw)
    torch.cuda.synchronize()

    def ref_grads(upcast: bool) -> tuple:
        ts = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        o, _ = attention_ref(*ts, upcast=upcast, **kw)
        return torch.autograd.grad(o, ts, do)

    for name, g, g_hi, g_lo in zip("qkv", grads, ref_grads(True), ref_grads(False), strict=True):
        err = (g.float() - g_hi.float()).abs().max().item()
        err_lo = (g_lo.float() - g_hi.float()).abs().max().item()
        assert err <= 2 * err_lo + 1e-3, (name, err, err_lo)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("writer", [False, True], ids=["consumers", "writer"])
@pytest.mark.parametrize("descending", [False, True], ids=["ascending", "descending"])
def test_sm90_bwd_deterministic_mode_is_bitwise_reproducible(descending: bool, writer: bool) -> None:
    """100 runs bitwise equal, in either dQ order (descending: ``det_descending``), with the
    consumers or the writer warp (``dq_warp``) ordering the adds; the first also within the 2x
    rule of the fp32 reference. 16k keys = 128 K/V blocks per head, more CTAs than SMs, so a wait
    on a CTA that cannot become resident would hang here."""
    import torch

    from cute_flash.bwd_sm90 import run_bwd_sm90
    from cute_flash.reference import attention_ref

    torch.manual_seed(2)
    dev, dt, d = "cuda", torch.bfloat16, 128
    for n, h, runs in ((1024, 4, 100), (16384, 2, 3)):
        q, do = (torch.randn(1, n, h, d, device=dev, dtype=dt) for _ in range(2))
        k, v = (torch.randn(1, n, h // 2, d, device=dev, dtype=dt) for _ in range(2))
        out, lse = attention_ref(q, k, v, causal=True)
        first = None
        for _ in range(runs):
            grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
            run_bwd_sm90(do, q, k, v, out.to(dt), lse.float().contiguous(), *grads, softmax_scale=d ** -0.5,
                         causal=True, deterministic=True,
                         overrides=dict(det_descending=descending, dq_warp=writer))
            torch.cuda.synchronize()
            if first is None:
                first = grads
            else:
                assert all(torch.equal(a, b) for a, b in zip(first, grads, strict=True))
        if n <= 1024:
            _check_gradients((1, n, n, h, h // 2, True, (-1, -1), 0.0, d),
                             overrides=dict(det_descending=descending, dq_warp=writer), deterministic=True)


def test_rotated_deterministic_order_only_where_every_key_block_of_a_head_is_resident(monkeypatch) -> None:
    """The launcher's rule for the rotated deterministic order: a head dim where it measured
    faster, no masks, and ceil(Nk / tile_n) key blocks at most one per SM (the waits chain through
    all of them)."""
    from cute_flash import bwd_sm90

    monkeypatch.setattr(bwd_sm90, "SM90_BWD_DET_ROTATE", (128,))
    det = BwdSm90Config(target="sm_90a", hdim=128, deterministic=True)
    assert bwd_sm90.det_rotate_applies(det, 132 * 128, 132)
    assert not bwd_sm90.det_rotate_applies(det, 132 * 128 + 1, 132)
    for other in (BwdSm90Config(target="sm_90a", hdim=128, deterministic=True, causal=True),
                  BwdSm90Config(target="sm_90a", hdim=128, deterministic=True, local=True),
                  BwdSm90Config(target="sm_90a", hdim=128)):
        assert not bwd_sm90.det_rotate_applies(other, 1024, 132)
    d64 = BwdSm90Config(target="sm_90a", hdim=64, deterministic=True)
    assert not bwd_sm90.det_rotate_applies(d64, 1024, 132)  # not in the patched head dims
    monkeypatch.setattr(bwd_sm90, "SM90_BWD_DET_ROTATE", ())
    assert not bwd_sm90.det_rotate_applies(det, 1024, 132)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("writer", [False, True], ids=["consumers", "writer"])
def test_sm90_bwd_rotated_deterministic_order_is_bitwise_reproducible(writer: bool) -> None:
    """Non-causal deterministic mode on the rotated walk (``rotate_m``): repeated runs bitwise
    equal, with more query than key blocks, more key than query blocks (several key blocks at one
    step: ties), GQA, and 128 key blocks per head (all resident on the H200's 132 SMs; a wrong
    rank or a wait on a CTA that is not resident would hang here); gradients within the 2x rule."""
    import torch

    from cute_flash.bwd_sm90 import run_bwd_sm90
    from cute_flash.reference import attention_ref

    torch.manual_seed(3)
    dev, dt, d = "cuda", torch.bfloat16, 128
    overrides = dict(rotate_m=True, dq_warp=writer)
    for nq, nk, h, hkv, runs in ((1000, 700, 4, 2, 30), (200, 2100, 4, 4, 30), (16384, 16384, 2, 1, 3)):
        q, do = (torch.randn(1, nq, h, d, device=dev, dtype=dt) for _ in range(2))
        k, v = (torch.randn(1, nk, hkv, d, device=dev, dtype=dt) for _ in range(2))
        out, lse = attention_ref(q, k, v)
        first = None
        for _ in range(runs):
            grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
            run_bwd_sm90(do, q, k, v, out.to(dt), lse.float().contiguous(), *grads, softmax_scale=d ** -0.5,
                         causal=False, deterministic=True, overrides=overrides)
            torch.cuda.synchronize()
            if first is None:
                first = grads
            else:
                assert all(torch.equal(a, b) for a, b in zip(first, grads, strict=True)), (nq, nk)
        if nq <= 2100:
            _check_gradients((1, nq, nk, h, hkv, False, (-1, -1), 0.0, d), overrides=overrides,
                             deterministic=True)


@pytest.mark.parametrize("causal", [False, True])
def test_sm90_deterministic_writer_orders_the_bulk_adds_off_the_consumers(causal: bool) -> None:
    """Deterministic mode with the writer warp: the consumers issue no dQ reductions and no gpu
    fences; the writer acquires the flag (spin), fences into the async proxy, bulk-adds both
    warpgroups' halves, waits for their completion (not just the smem read) and releases."""
    cfg = BwdSm90Config(target="sm_90a", hdim=128, causal=causal, deterministic=True, dq_warp=True)
    ptx, _ = jit.compile_artifacts(cfg)
    assert _count(ptx, "red.relaxed.gpu.global.add.v4.f32") == 0
    assert _count(ptx, "fence.acq_rel.gpu") == 0
    assert _count(ptx, "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 2
    assert _count(ptx, "ld.acquire.gpu") > 0 and _count(ptx, "st.release.gpu") == 1
    assert _count(ptx, "fence.proxy.async.global") == 2
    # One full-completion wait per query block before the release (plus the exit's).
    assert len(re.findall(r"cp\.async\.bulk\.wait_group\s+0;", ptx)) >= 1
    consumers, _ = jit.compile_artifacts(BwdSm90Config(target="sm_90a", hdim=128, causal=causal,
                                                       deterministic=True, dq_warp=False))
    assert _count(consumers, "red.relaxed.gpu.global.add.v4.f32") > 0  # without the writer: consumers add
    assert BwdSm90Config(target="sm_90a", hdim=128, causal=causal, deterministic=True).dq_warp  # the default


@pytest.mark.parametrize("deterministic", [False, True])
def test_sm90_bwd_with_pdl_waits_for_the_preprocess_in_every_role(deterministic: bool) -> None:
    """``pdl``: the preprocess lets the main kernel launch early, and each role of the main
    kernel that reads the preprocess's output (producer: LSE2 / D; dQ writer or consumers: the
    zeroed accumulator, semaphores) waits for it first."""
    cfg = BwdSm90Config(target="sm_90a", hdim=128, deterministic=deterministic, pdl=True)
    ptx, _ = jit.compile_artifacts(cfg)
    pre_ptx, _ = jit.compile_artifacts(cfg.pre())
    assert _count(pre_ptx, "griddepcontrol.launch_dependents") == 1
    # Producer, consumers, and the dQ writer warp where there is one (deterministic mode too since
    # session 18: the writer orders the adds there).
    assert _count(ptx, "griddepcontrol.wait") == (3 if cfg.dq_warp else 2)
    plain, _ = jit.compile_artifacts(BwdSm90Config(target="sm_90a", hdim=128, deterministic=deterministic,
                                                   pdl=False))
    assert "griddepcontrol" not in plain
