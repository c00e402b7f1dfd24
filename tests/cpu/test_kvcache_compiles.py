"""The KV-cache forwards and the split merge compile on a CPU-only machine: the sm_90a forward keeps
the Hopper pipeline (wgmma, TMA loads, register reallocation), stays in registers, stores O
through TMA when it does not split and writes fp32 partials from registers when it does (no TMA
store), and loads paged caches box by box; the sm_80 forward keeps mma.sync and cp.async; the
merge reads the partials with no local memory. (On a GPU:
``tests/gpu/test_kvcache_matches_reference.py``.)"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from cute_flash import jit
from cute_flash.ampere.kvcache_config import (
    DECODE_TILE_M,
    AppendKVConfig,
    FwdCombineConfig,
    FwdKVCacheConfig,
    decode_tiles,
)
from cute_flash.hopper.fwd_config import SM90_SMEM_LIMIT
from cute_flash.hopper.kvcache_config import FwdSm90KVCacheConfig
from cute_flash.tools import inspect as ins


def _kv(**kw) -> FwdSm90KVCacheConfig:
    base = dict(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128)
    base.update(kw)
    return FwdSm90KVCacheConfig(**base)


# Decoding with GQA 32 / 8 split over the SMs (what long-context serving runs most) in the fast tier.
FAST = _kv(pack_gqa=4, split=True, causal=True)
FAST_FP8 = _kv(pack_gqa=4, split=True, causal=True, kv_dtype="e4m3")
VARIANTS = [
    FAST,
    _kv(pack_gqa=4),
    _kv(split=True, batch_idx=True, leftpad=True),
    _kv(pack_gqa=8, split=True, local=True, softcap=True),
    _kv(dtype="fp16", hdim=64, hdim_v=64, pack_gqa=6, split=True),
    _kv(hdim=256, hdim_v=256, pack_gqa=2, split=True, causal=True),
    # Paged caches: a block is several pages (16, 64 rows) or part of one (256).
    _kv(pack_gqa=4, split=True, page_size=64),
    _kv(pack_gqa=4, page_size=16, causal=True),
    _kv(pack_gqa=4, split=True, page_size=256),
    _kv(hdim=256, hdim_v=256, pack_gqa=2, split=True, page_size=16),
    # e4m3 caches, turned into 16 bit in shared memory by the producer warpgroup.
    FAST_FP8,
    _kv(hdim=64, hdim_v=64, pack_gqa=6, page_size=64, kv_dtype="e4m3"),
    _kv(dtype="fp16", hdim=256, hdim_v=256, pack_gqa=2, split=True, softcap=True, kv_dtype="e4m3"),
]


def _id(cfg) -> str:
    flags = [f for f in ("split", "causal", "local", "softcap", "batch_idx", "leftpad") if getattr(cfg, f)]
    flags += [f"page{cfg.page_size}"] if getattr(cfg, "page_size", 0) else []
    flags += [f"kv{cfg.kv_dtype}"] if getattr(cfg, "kv_dtype", "") else []
    flags += ["decode"] if isinstance(cfg, FwdKVCacheConfig) and cfg.tiles[0] == DECODE_TILE_M else []
    return f"{cfg.dtype}-d{cfg.hdim}-pack{cfg.pack_gqa}-" + "-".join(flags or ["plain"])


def _count(ptx: str, pattern: str) -> int:
    return len(re.findall(pattern, ptx, flags=re.M))


def _no_local_memory(ptx: str, cubin: bytes) -> None:
    assert _count(ptx, r"^\s*(?:@!?%p\d+\s+)?(ld|st)\.local") == 0
    if ins.tools_dir() is None:
        return
    _, usage = ins.cubin_sass_and_usage(cubin)
    for fn, res in usage.items():
        assert res.get("LOCAL", 0) == 0 and res.get("STACK", 0) == 0, (fn, res)


@pytest.mark.parametrize("cfg", [pytest.param(c, id=_id(c),
                                              marks=() if c in (FAST, FAST_FP8) else pytest.mark.slow)
                                 for c in VARIANTS])
def test_kvcache_forward_compiles(cfg: FwdSm90KVCacheConfig) -> None:
    ptx, cubin = jit.compile_artifacts(cfg)
    smem = ins.dynamic_smem_from_ir(str(jit.compile_kernel(cfg, keep=True).ir_module))
    assert smem and max(smem.values()) <= SM90_SMEM_LIMIT, smem
    tma_loads = r"cp\.async\.bulk\.tensor\.\dd\.shared::\w+\.global"
    for op in (r"wgmma\.mma_async", tma_loads, r"setmaxnreg\.inc"):
        assert _count(ptx, op) > 0, op
    tma_stores = _count(ptx, r"cp\.async\.bulk\.tensor\.\dd\.global\.shared")
    if cfg.split:
        # Partials leave from registers as fp32: no TMA store, 32-bit global stores.
        assert tma_stores == 0
        assert _count(ptx, r"st\.global\.v2\.b32") > 0
    else:
        assert tma_stores > 0
    if cfg.page_size:
        # Every K and V block is tile_n / page_box boxes, each at its own page.
        assert _count(ptx, tma_loads) >= 2 * (cfg.tile_n // cfg.page_box) + 1
    if cfg.kv_dtype:
        # Staged e4m3 bytes in 16-byte loads, moved into 16-bit fields (a byte permute per two
        # codes) and rescaled by one packed multiply, stored 16 bytes at a time and fenced for
        # wgmma before the consumers are signalled.
        kind = "bf16x2" if cfg.dtype == "bf16" else "f16x2"
        assert _count(ptx, rf"mul\.rn\.{kind}") >= 16 and _count(ptx, r"prmt\.b32") >= 16
        assert _count(ptx, r"cvt[^\n]*e4m3") == 0
        assert _count(ptx, r"ld\.shared\.v4") > 0 and _count(ptx, r"st\.shared\.v4") > 0
        assert _count(ptx, r"fence\.proxy\.async") > 0
    if cfg.batch_idx or cfg.leftpad:
        # cache_batch_idx / cache_leftpad are read per tile, beside cache_seqlens.
        plain, _ = jit.compile_artifacts(replace(cfg, batch_idx=False, leftpad=False))
        assert _count(ptx, r"ld\.global") > _count(plain, r"ld\.global") > 0
    _no_local_memory(ptx, cubin)


@pytest.mark.parametrize("dtype,hdim_v", [("bf16", 128), pytest.param("fp16", 64, marks=pytest.mark.slow),
                                          pytest.param("bf16", 256, marks=pytest.mark.slow)])
def test_split_merge_compiles(dtype: str, hdim_v: int) -> None:
    ptx, cubin = jit.compile_artifacts(FwdCombineConfig(target="sm_90a", dtype=dtype, hdim_v=hdim_v))
    # Warp reductions of the split LSEs (max, then sum of exponentials) and a log for the merged LSE.
    assert _count(ptx, r"shfl\.sync") >= 10
    assert _count(ptx, r"ex2\.approx") > 0 and _count(ptx, r"lg2\.approx") > 0
    _no_local_memory(ptx, cubin)


def _sm80(dtype: str = "bf16", d: int = 128, **kw) -> FwdKVCacheConfig:
    return FwdKVCacheConfig(target="sm_80", dtype=dtype, hdim=d, hdim_v=d, **kw)


SM80 = [
    _sm80(split=True, causal=True),
    _sm80(),
    _sm80("fp16", 64, split=True, batch_idx=True, leftpad=True),
    _sm80(d=256, split=True, local=True, softcap=True),
    # Packed GQA (a KV head's query group in one tile).
    _sm80(split=True, causal=True, pack_gqa=4),
    _sm80("fp16", 64, pack_gqa=8, local=True, softcap=True),
    # Paged caches read row by row: one key per page, and pages a block neither holds nor splits.
    _sm80(split=True, causal=True, page_size=1, pack_gqa=8),
    _sm80("fp16", 64, page_size=48),
    # Decoding tiles (two warps), as planned: one key per page at the widest rows, and contiguous.
    _sm80(d=256, split=True, causal=True, page_size=1, pack_gqa=4,
          tiles=decode_tiles((64, 64, 128, 1), 256, 256)),
    _sm80(split=True, causal=True, softcap=True, local=True, pack_gqa=4,
          tiles=decode_tiles((128, 128, 256, 1), 128, 128)),
]


@pytest.mark.parametrize("cfg", [pytest.param(c, id=_id(c).replace("-pack1", ""),
                                              marks=() if i == 0 else pytest.mark.slow)
                                 for i, c in enumerate(SM80)])
def test_sm80_kvcache_forward_compiles(cfg: FwdKVCacheConfig) -> None:
    ptx, cubin = jit.compile_artifacts(cfg)
    assert _count(ptx, r"mma\.sync") > 0 and _count(ptx, r"cp\.async\.cg\.shared\.global") > 0
    assert _count(ptx, r"wgmma") == 0 and _count(ptx, r"cp\.async\.bulk") == 0
    if cfg.split:
        assert _count(ptx, r"st\.global\.v2\.b32") > 0  # fp32 partials, two columns per store
    if cfg.page_size:
        # Each copied row looks up its page: more global loads than the contiguous kernel's.
        plain, _ = jit.compile_artifacts(replace(cfg, page_size=0))
        assert _count(ptx, r"ld\.global") > _count(plain, r"ld\.global")
    _no_local_memory(ptx, cubin)


def test_paged_blocks_are_whole_pages_or_parts_of_one() -> None:
    for d in (64, 128, 256):
        for page in (16, 32, 48, 64, 128, 256, 512):
            cfg = _kv(hdim=d, hdim_v=d, page_size=page)
            assert cfg.page_size % cfg.tile_n == 0 or cfg.tile_n % cfg.page_size == 0, (d, page)
            assert cfg.page_box == min(page, cfg.tile_n) and cfg.tile_n % 16 == 0
    assert _kv(page_size=256).tile_n == 128  # the tuned tile where pages allow it
    with pytest.raises(ValueError):
        _kv(page_size=24)


def test_kvcache_configs_are_dense_one_cta_per_tile() -> None:
    with pytest.raises(ValueError):
        _kv(varlen=True)
    with pytest.raises(ValueError):
        _kv(num_ctas=132)
    with pytest.raises(ValueError):
        FwdCombineConfig(target="sm_90a", hdim_v=80)


APPENDS = [
    AppendKVConfig(target="sm_90a", rotary="fp32"),
    AppendKVConfig(target="sm_80", dtype="fp16", rotary="fp16", interleaved=False, per_token_q=False,
                   batch_idx=True),
    AppendKVConfig(target="sm_90a", rotary="bf16", paged=True, kv_dtype="e4m3"),
    AppendKVConfig(target="sm_80"),
]


@pytest.mark.parametrize("cfg", APPENDS, ids=lambda c: f"{c.target}-{c.dtype}-rot{c.rotary or 'none'}-"
                         f"{'paged' if c.paged else 'rows'}-{c.kv_dtype or c.dtype}")
def test_the_append_compiles_to_one_small_kernel(cfg: AppendKVConfig) -> None:
    ptx, cubin = jit.compile_artifacts(cfg)
    assert _count(ptx, r"^\.(?:visible|weak) \.entry") == 1
    assert _count(ptx, r"wgmma|cp\.async") == 0  # sm80 instructions only: every family runs it
    stores = _count(ptx, r"st\.global")
    # The cache's K and V rows, and q's rotated rows with rotary.
    assert stores >= (3 if cfg.rotary else 2)
    if cfg.rotary:
        assert _count(ptx, r"\b(?:fma|mul)\.[a-z.]*f32") > 0
    if cfg.kv_dtype:
        # Divided by the descale (IEEE, as torch's reference), rounded with saturation to e4m3.
        assert _count(ptx, r"div\.rn\.f32") > 0 and _count(ptx, r"cvt\.rn\.satfinite\.e4m3x2\.f32") > 0
    _no_local_memory(ptx, cubin)
