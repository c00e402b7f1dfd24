"""The sm90a (FlashAttention-3 style) forward compiles for sm_90a on a CPU-only machine, uses the
Hopper machinery it is meant to use (wgmma, TMA bulk-tensor loads, mbarrier pipelines, register
reallocation between the producer and consumer warpgroups) and keeps everything in registers (no
local memory: no spills, no stack frame). On a Hopper GPU, the kernel (called through its config,
so the ping-pong / overlap switches can be set) matches the fp32 reference.
"""

from __future__ import annotations

import re

import pytest

from cute_flash import inspect as ins
from cute_flash import jit
from cute_flash.fwd_sm90 import SM90_FWD_TILES, SM90_FWD_TILES_MASKED, SM90_SMEM_LIMIT, FwdSm90Config

VARIANTS = [
    FwdSm90Config(target="sm_90a", dtype=dtype, hdim=d, hdim_v=d, causal=mode == "causal",
                  local=mode == "local", softcap=mode == "softcap")
    for dtype in ("bf16", "fp16")
    for d in (64, 128, 256)
    for mode in ("plain", "causal")
] + [
    # The other head dims of the tile tables.
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=d, hdim_v=d, causal=c)
    for d in (32, 96, 160, 192) for c in (False, True)
] + [
    # (d_qk, d_v) = (192, 128), and d=64 on two consumer warpgroups (the masked table's shape).
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=192, hdim_v=128),
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=64, hdim_v=64, tile_m=128, tile_n=128)
] + [
    # Sliding window and softcap, for the most used head dim.
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, local=True),
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, causal=True, softcap=True),
] + [
    # Ping-pong scheduling barriers and intra-warpgroup overlap (each alone, then both).
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, pingpong=p, intra_wg_overlap=o)
    for p, o in ((False, False), (True, False), (False, True))
] + [
    FwdSm90Config(target="sm_90a", dtype=dtype, hdim=d, hdim_v=d, causal=True, pingpong=True,
                  intra_wg_overlap=True)
    for dtype, d in (("bf16", 64), ("fp16", 128), ("bf16", 256))
] + [
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, local=True, softcap=True,
                  pingpong=True, intra_wg_overlap=True),
] + [
    # Packed (varlen) inputs.
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, varlen=True),
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=64, hdim_v=64, varlen=True, causal=True,
                  pingpong=True, intra_wg_overlap=True),
] + [
    # Packed GQA (query heads of a KV group in one M tile), for short query sequences.
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, pack_gqa=8),
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, causal=True, pack_gqa=4),
    FwdSm90Config(target="sm_90a", dtype="fp16", hdim=64, hdim_v=64, local=True, pack_gqa=6),
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=256, hdim_v=256, causal=True, softcap=True, pack_gqa=8),
] + [
    # The row-sum chain seeded with the rescale factor (flash-attn-4's order; default at d=128).
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, seed_row_sum=False),
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=64, hdim_v=64, causal=True, seed_row_sum=True),
] + [
    # Persistent grids: static stride (unmasked) and atomic tile claims (causal), with O in its
    # own smem buffer (d <= 128) and in Q's (d = 256), 2 and 3 consumer warpgroups.
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, num_ctas=132),
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=64, hdim_v=64, num_ctas=132),
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, causal=True, num_ctas=132,
                  dynamic_tiles=True),
    FwdSm90Config(target="sm_90a", dtype="fp16", hdim=64, hdim_v=64, causal=True, num_ctas=132,
                  dynamic_tiles=True),
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=256, hdim_v=256, causal=True, num_ctas=132,
                  dynamic_tiles=True),
]


def _id(cfg: FwdSm90Config) -> str:
    flags = [f for f in ("causal", "local", "softcap", "varlen") if getattr(cfg, f)] or ["plain"]
    flags += [f"pp{int(cfg.pingpong)}", f"ov{int(cfg.intra_wg_overlap)}", f"{cfg.tile_m}x{cfg.tile_n}"]
    if cfg.pack_gqa > 1:
        flags.append(f"pack{cfg.pack_gqa}")
    if cfg.seed_row_sum:
        flags.append("seeded")
    if cfg.num_ctas:
        flags.append(f"persistent{cfg.num_ctas}" + ("dyn" if cfg.dynamic_tiles else ""))
    return f"{cfg.dtype}-d{cfg.hdim}-" + "-".join(flags)


def _count(ptx: str, op: str) -> int:
    return len(re.findall(rf"^\s*(?:@!?%p\d+\s+)?{re.escape(op)}", ptx, flags=re.M))


@pytest.mark.parametrize("cfg", VARIANTS, ids=_id)
def test_sm90_fwd_compiles(cfg: FwdSm90Config) -> None:
    ptx, cubin = jit.compile_artifacts(cfg)
    # Dynamic shared memory of the launch (Q + stages * (K + V) + mbarriers) fits one sm90 block.
    smem = ins.dynamic_smem_from_ir(str(jit.compile_kernel(cfg, keep=True).ir_module))
    assert smem and max(smem.values()) <= SM90_SMEM_LIMIT, smem
    for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait", "mbarrier.arrive",
               "setmaxnreg.inc", "setmaxnreg.dec", "ex2.approx"):
        assert _count(ptx, op) > 0, f"no {op} in the PTX"
    assert _count(ptx, "mma.sync") == 0, "sm80 mma.sync in the sm90 kernel"
    assert _count(ptx, "ld.local") == 0 and _count(ptx, "st.local") == 0
    if cfg.pingpong:  # named barriers beyond the epilogue's: bar.sync / bar.arrive with an id register
        assert _count(ptx, "bar.arrive") > 0 and _count(ptx, "bar.sync") > 2
    if cfg.dynamic_tiles:  # one atomic per claimed tile, handed over through named barriers 5 / 6
        assert _count(ptx, "atom.") + _count(ptx, "red.") > 0 and _count(ptx, "bar.arrive") > 0
    if cfg.intra_wg_overlap:  # two commit groups in flight: QK^T(n) and PV(n+1)
        assert re.search(r"wgmma\.wait_group\.sync\.aligned\s+1;", ptx)
    if ins.tools_dir() is None:
        pytest.skip("no cuobjdump: cubin resource usage not checked")
    sass, usage = ins.cubin_sass_and_usage(cubin)
    sass = sass or ""
    assert usage, "cuobjdump -res-usage reported no function"
    for fn, res in usage.items():
        assert res.get("LOCAL", 0) == 0, f"{fn}: {res['LOCAL']} B of local memory (spills)"
        assert res.get("STACK", 0) == 0, f"{fn}: {res['STACK']} B stack frame"
        assert res.get("REG", 0) <= 168, f"{fn}: {res['REG']} registers at launch (3 warpgroups: <= 168)"
    if sass:
        assert not re.search(r"\b(LDL|STL)\b", sass), "local loads/stores in the SASS"
        hgmma, depbar = sass.count("HGMMA."), sass.count("WARPGROUP.DEPBAR")
        assert hgmma > 0 and "UTMALDG" in sass and "USETMAXREG" in sass
        # ptxas serialises wgmma (a wait after every instruction) when it cannot keep the
        # accumulators in place: one wait per GEMM is expected, not one per instruction.
        assert 0 < depbar < hgmma / 2, f"wgmma serialised? {depbar} waits for {hgmma} HGMMA"


def test_smem_fits() -> None:
    """Q + stages * (K + V) tiles of 16-bit elements (plus barriers) fit in one sm90 block."""
    for d, (tm, tn, st, *_) in [*SM90_FWD_TILES.items(), *SM90_FWD_TILES_MASKED.items()]:
        assert (tm * d + st * tn * 2 * d) * 2 + 1024 <= SM90_SMEM_LIMIT, d


def test_invalid_configs_are_rejected() -> None:
    with pytest.raises(ValueError):
        FwdSm90Config(target="sm_90a", tile_m=192, num_mma_wg=2)
    with pytest.raises(ValueError):
        FwdSm90Config(target="sm_90a", tile_m=64)
    with pytest.raises(ValueError):
        FwdSm90Config(target="sm_90a", stages=1)
    with pytest.raises(ValueError):  # 128 rows do not split into groups of 3 heads
        FwdSm90Config(target="sm_90a", pack_gqa=3)
    with pytest.raises(ValueError):
        FwdSm90Config(target="sm_90a", pack_gqa=4, varlen=True)


def test_call_signature_is_sm80_plus_a_tile_counter() -> None:
    from cute_flash.fwd import FwdConfig

    a = FwdSm90Config(target="sm_90a").fake_args()
    b = FwdConfig(target="sm_90a").fake_args()
    assert len(b) == 13 and len(a) == 14  # ... max_seqlen_q, [tile_counter,] stream


# ---------------------------------------------------------------------------------------------
# First numbers on a Hopper GPU (skipped everywhere else): the sm90 kernel against the fp32
# reference, with the usual rule (error at most twice the same-dtype PyTorch error, + 1e-3).
# ---------------------------------------------------------------------------------------------
def _hopper() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


GPU_CASES = [
    # (B, Nq, Nk, H, Hkv, d, causal, window, softcap, varlen, pingpong, overlap); None = the tuned
    # default of that head dim.
    (2, 256, 256, 4, 4, 128, False, (-1, -1), 0.0, False, None, None),
    (2, 200, 333, 4, 2, 64, True, (-1, -1), 0.0, False, None, None),
    (2, 333, 200, 4, 2, 64, False, (-1, -1), 0.0, False, None, None),  # 192-row tile, 3 warpgroups
    (1, 300, 300, 2, 1, 256, True, (-1, -1), 0.0, False, None, None),
    (1, 300, 517, 2, 2, 256, False, (-1, -1), 0.0, False, None, None),
    (2, 257, 513, 4, 4, 128, False, (64, 32), 0.0, False, None, None),
    (2, 256, 256, 4, 4, 128, True, (-1, -1), 30.0, False, None, None),
    (2, 1, 129, 4, 4, 64, False, (-1, -1), 0.0, False, None, None),
    (3, 190, 250, 4, 2, 128, True, (-1, -1), 0.0, True, None, None),
    (3, 190, 250, 4, 4, 64, False, (-1, -1), 0.0, True, None, None),
    (2, 177, 301, 2, 2, 96, True, (-1, -1), 0.0, False, None, None),
    (2, 177, 301, 2, 2, 192, False, (-1, -1), 0.0, False, None, None),
    (2, 512, 512, 4, 4, 128, False, (-1, -1), 0.0, False, False, False),
    (2, 512, 512, 4, 4, 128, False, (-1, -1), 0.0, False, True, False),
    (2, 512, 512, 4, 4, 128, True, (-1, -1), 0.0, False, False, True),
    (2, 333, 555, 4, 2, 128, True, (-1, -1), 0.0, False, True, True),
    (2, 333, 555, 4, 2, 256, False, (-1, -1), 0.0, False, False, True),  # O rescaled before P V
]


def _check_on_hopper(case: tuple, pack: int = 1, **extra: bool | int) -> None:
    """Run one config on the GPU against the fp32 reference (the 2x rule, + 1e-3)."""
    import math

    import torch

    from cute_flash import fwd_sm90
    from cute_flash.fwd import normalize_window
    from cute_flash.reference import attention_ref

    B, Nq, Nk, H, Hkv, d, causal, window, softcap, varlen, pingpong, overlap = case
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, Nq, H, d, device=dev, dtype=dt)
    k = torch.randn(B, Nk, Hkv, d, device=dev, dtype=dt)
    v = torch.randn(B, Nk, Hkv, d, device=dev, dtype=dt)
    cu_q = cu_k = None
    if varlen:  # ragged lengths, packed
        lq = [Nq - 37 * i for i in range(B)]
        lk = [Nk - 23 * i for i in range(B)]
        q = torch.cat([q[i, :lq[i]] for i in range(B)])
        k = torch.cat([k[i, :lk[i]] for i in range(B)])
        v = torch.cat([v[i, :lk[i]] for i in range(B)])
        cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], device=dev, dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], device=dev, dtype=torch.int32)
        lse = torch.full((H, q.shape[0]), float("nan"), device=dev)
    else:
        lse = torch.full((B, H, Nq), float("nan"), device=dev)
    out = torch.full_like(q, float("nan"))
    scale = 1.0 / math.sqrt(d)
    # Through the config directly, so the ping-pong / overlap switches can be set.
    c, local, left, right = normalize_window(causal, window)
    cfg = fwd_sm90.FwdSm90Config(target=None, dtype="bf16", hdim=d, hdim_v=d, causal=c, local=local,
                                 softcap=softcap > 0, varlen=varlen, pingpong=pingpong,
                                 intra_wg_overlap=overlap, pack_gqa=pack, **extra)
    fn = jit.compile_kernel(cfg)
    mq = max(lq) if varlen else Nq
    fn(q, k, v, out, lse, cu_q, cu_k, scale, softcap, left, right, mq, *cfg.launch_args(q.device))
    torch.cuda.synchronize()
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
              cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    o_ref, lse_ref = attention_ref(q, k, v, **kw)
    o_lo, _ = attention_ref(q, k, v, upcast=False, **kw)
    err = (out.float() - o_ref.float()).abs().max().item()
    err_lo = (o_lo.to(dt).float() - o_ref.float()).abs().max().item()
    assert err <= 2 * err_lo + 1e-3, (err, err_lo)
    fin = torch.isfinite(lse_ref)
    assert (lse[~fin] == float("-inf")).all()
    if fin.any():
        assert (lse[fin] - lse_ref[fin]).abs().max().item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case", GPU_CASES)
def test_sm90_fwd_matches_reference_on_hopper(case: tuple) -> None:
    _check_on_hopper(case)


# Packed GQA (``pack_gqa`` = query heads per KV head in one M tile): decode-like and short
# prefill shapes, causal (bottom-right) and windowed, partial tiles in both dims.
PACKED_CASES = [
    # (case as in GPU_CASES, pack)
    ((4, 1, 1000, 32, 4, 128, False, (-1, -1), 0.0, False, None, None), 8),
    ((2, 5, 777, 16, 2, 128, True, (-1, -1), 0.0, False, None, None), 8),
    ((2, 33, 400, 8, 2, 64, True, (-1, -1), 0.0, False, None, None), 4),
    ((2, 40, 513, 12, 2, 64, False, (64, 8), 0.0, False, None, None), 6),
    ((1, 3, 300, 8, 1, 256, True, (-1, -1), 30.0, False, None, None), 8),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case,pack", PACKED_CASES)
def test_sm90_packed_gqa_matches_reference_on_hopper(case: tuple, pack: int) -> None:
    _check_on_hopper(case, pack)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[1], GPU_CASES[3], GPU_CASES[5]])
def test_sm90_seeded_row_sum_matches_reference_on_hopper(case: tuple) -> None:
    _check_on_hopper(case, seed_row_sum=True)


# Persistent grid with far fewer CTAs than tiles, so every CTA carries its pipeline phases, its
# ping-pong turn and the Q/O buffer hand-back from tile to tile: separate and shared O buffers,
# 2 and 3 consumer warpgroups, tiles with no key block (causal, Nq > Nk), windows, packed GQA.
PERSISTENT_CASES = [
    # (case as in GPU_CASES, pack, num_ctas[, dynamic tile claims])
    ((2, 1000, 1000, 4, 2, 128, False, (-1, -1), 0.0, False, None, None), 1, 7),
    ((2, 1000, 1000, 4, 2, 128, True, (-1, -1), 0.0, False, None, None), 1, 7, True),
    ((2, 700, 300, 4, 4, 128, True, (-1, -1), 0.0, False, None, None), 1, 5, True),
    ((2, 555, 600, 2, 2, 256, True, (-1, -1), 0.0, False, None, None), 1, 3, True),
    ((2, 600, 640, 4, 2, 64, True, (-1, -1), 0.0, False, None, None), 1, 4, True),
    ((2, 500, 700, 4, 4, 128, False, (64, 32), 0.0, False, None, None), 1, 6, True),
    ((2, 33, 400, 8, 2, 64, True, (-1, -1), 0.0, False, None, None), 4, 2, True),
    ((2, 700, 300, 4, 4, 128, True, (-1, -1), 0.0, False, None, None), 1, 5),
    ((2, 555, 600, 2, 2, 256, True, (-1, -1), 0.0, False, None, None), 1, 3),
    ((2, 555, 600, 2, 2, 256, False, (-1, -1), 0.0, False, None, None), 1, 4),
    ((2, 600, 640, 4, 2, 64, True, (-1, -1), 0.0, False, None, None), 1, 4),
    ((2, 500, 700, 4, 4, 128, False, (64, 32), 0.0, False, None, None), 1, 6),
    ((2, 512, 512, 4, 4, 128, False, (-1, -1), 0.0, False, False, False), 1, 5),
    ((2, 512, 512, 4, 4, 128, True, (-1, -1), 0.0, False, True, True), 1, 5),
    ((2, 300, 500, 4, 4, 192, True, (-1, -1), 0.0, False, None, None), 1, 3),
    ((4, 1, 1000, 32, 4, 128, False, (-1, -1), 0.0, False, None, None), 8, 3),
]


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs an sm90 (Hopper) GPU")
@pytest.mark.parametrize("case", PERSISTENT_CASES)
def test_sm90_persistent_grid_matches_reference_on_hopper(case: tuple) -> None:
    problem, pack, num_ctas, *dynamic = case
    _check_on_hopper(problem, pack, num_ctas=num_ctas, dynamic_tiles=bool(dynamic and dynamic[0]))
