"""The sm90a (FlashAttention-3 style) forward compiles for sm_90a on a CPU-only machine, uses the
Hopper machinery it is meant to use (wgmma, TMA bulk-tensor loads, mbarrier pipelines, register
reallocation between the producer and consumer warpgroups, QK^T of the next block in flight with
P V of this one) and keeps everything in registers (no local memory: no spills, no stack frame).
(On a Hopper GPU: ``tests/gpu/test_sm90_fwd_matches_reference.py``.)
"""

from __future__ import annotations

import re

import pytest

from cute_flash import jit
from cute_flash.hopper.fwd_config import SM90_FWD_TILES, SM90_FWD_TILES_MASKED, SM90_SMEM_LIMIT, FwdSm90Config
from cute_flash.tools import inspect as ins

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
    # Ping-pong scheduling barriers where the tuned tile has none (d = 128), and masked.
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, pingpong=True),
] + [
    FwdSm90Config(target="sm_90a", dtype=dtype, hdim=d, hdim_v=d, causal=True, pingpong=True)
    for dtype, d in (("bf16", 64), ("fp16", 128), ("bf16", 256))
] + [
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, local=True, softcap=True,
                  pingpong=True),
] + [
    # Packed (varlen) inputs.
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, varlen=True),
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=64, hdim_v=64, varlen=True, causal=True, pingpong=True),
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
    # d = 64 short sequences: the 128-row ping-pong tile on the persistent grid.
    FwdSm90Config(target="sm_90a", dtype="bf16", hdim=64, hdim_v=64, causal=True, tile_m=128, num_mma_wg=2,
                  pingpong=True, num_ctas=132, dynamic_tiles=True),
]

VARIANTS = list(dict.fromkeys(VARIANTS))  # (the explicit switches above may repeat a default)

def _id(cfg: FwdSm90Config) -> str:
    flags = [f for f in ("causal", "local", "softcap", "varlen") if getattr(cfg, f)] or ["plain"]
    flags += [f"pp{int(cfg.pingpong)}", f"{cfg.tile_m}x{cfg.tile_n}"]
    if cfg.pack_gqa > 1:
        flags.append(f"pack{cfg.pack_gqa}")
    if cfg.seed_row_sum:
        flags.append("seeded")
    if cfg.num_ctas:
        flags.append(f"persistent{cfg.num_ctas}" + ("dyn" if cfg.dynamic_tiles else ""))
    return f"{cfg.dtype}-d{cfg.hdim}-" + "-".join(flags)


def _count(ptx: str, op: str) -> int:
    return len(re.findall(rf"^\s*(?:@!?%p\d+\s+)?{re.escape(op)}", ptx, flags=re.M))


# One kernel in the fast tier (bf16 d = 128 causal, what an H200 runs most); the others are ``slow``.
FAST = FwdSm90Config(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, causal=True)
assert FAST in VARIANTS


@pytest.mark.parametrize("cfg", [pytest.param(c, id=_id(c), marks=() if c == FAST else pytest.mark.slow)
                                 for c in VARIANTS])
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
    # Two commit groups in flight: QK^T of the next block and P V of this one.
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
    from cute_flash.ampere.config import FwdConfig

    a = FwdSm90Config(target="sm_90a").fake_args()
    b = FwdConfig(target="sm_90a").fake_args()
    # ... max_seqlen_q, [tile_counter,] sinks, 4 aux tensors, block ranges, stream
    assert len(b) == 19 and len(a) == 20
    # (No sinks, no mods, no block mask: nothing compiled for them.)
    assert all(x is None for x in a[-7:-1]) and all(x is None for x in b[-7:-1])
