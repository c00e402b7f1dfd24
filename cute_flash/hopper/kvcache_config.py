"""Configs and plan of attention over a KV cache on Hopper (``hopper/fwd_kvcache.py``, the split
merge ``hopper/combine.py``): the tile of the forward, packed GQA, and the split count.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass

from cute_flash import jit
from cute_flash.hopper.fwd_config import FwdSm90Config, sm90_tile
from cute_flash.problem import Problem

# Splits are planned to fill the SMs once (one CTA per SM: the tiles' shared memory); more would
# add a second, mostly empty wave. Each split keeps at least this many key blocks, so a split's
# pipeline fill and its merge stay small against its loads.
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 128


def paged_tile_n(page_size: int, d: int, masked: bool) -> int:
    """The tuned tile_n of head dim ``d``, or the largest multiple of 16 below it that divides a page
    or that a page divides (a K / V block is then whole pages, or part of one)."""
    tile_n = sm90_tile(d, masked)[1]
    for n in range(tile_n, 15, -16):
        if page_size % n == 0 or n % page_size == 0:
            return n
    return 16


@dataclass(frozen=True)
class FwdSm90KVCacheConfig(FwdSm90Config):
    """``split``: the split-KV variant (fp32 partials, merged by ``FwdCombineConfig``'s kernel);
    ``batch_idx`` / ``leftpad``: the kernel reads ``cache_batch_idx`` / ``cache_leftpad``."""

    split: bool = False
    batch_idx: bool = False
    leftpad: bool = False
    # Paged cache (num_pages, page_size, H_kv, d): K / V blocks arrive page by page through TMA,
    # boxes of min(page_size, tile_n) rows; 0: a contiguous cache.
    page_size: int = 0

    kernel_name = "fwd_sm90_kvcache"

    def __post_init__(self) -> None:
        if self.page_size:
            if self.page_size % 16 != 0:
                raise ValueError(f"paged KV: page_size must be a multiple of 16, got {self.page_size}")
            if self.batch_idx or self.leftpad:
                raise ValueError("paged KV: the page table already maps sequences to their keys")
            if not self.tile_n:
                object.__setattr__(self, "tile_n", paged_tile_n(self.page_size, max(self.hdim, self.hdim_v),
                                                                self.causal or self.local))
        super().__post_init__()
        if self.varlen or self.num_ctas:
            raise ValueError("the KV-cache forward is dense with one CTA per tile")
        if self.page_size and self.page_size % self.tile_n != 0 and self.tile_n % self.page_size != 0:
            raise ValueError(f"paged KV: tile_n {self.tile_n} and page_size {self.page_size} must divide "
                             "one another")

    @property
    def page_box(self) -> int:
        """Rows of one K / V TMA box: a page, or the part of a page one block takes."""
        return min(self.page_size, self.tile_n) if self.page_size else self.tile_n

    def build(self):
        from cute_flash.hopper.fwd_kvcache import FlashFwdSm90KVCache

        return FlashFwdSm90KVCache(self)

    def fake_args(self) -> tuple:
        """(q, k_cache, v_cache, o, lse, seqused_k, cache_batch_idx, leftpad, page_table, softmax_scale,
        softcap, window_left, window_right, num_splits, stream); ``o`` / ``lse`` fp32 partials with
        ``split``."""
        dt, f32, i32 = jit.DTYPES[self.dtype], cutlass.Float32, cutlass.Int32
        div = jit.vec_div(dt)
        b, bo, bc, nq, nk, h, hkv, pages = (jit.sym() for _ in range(8))
        nk = self.page_size or nk  # (paged: bc counts pages)
        q = jit.fake_tensor(dt, (b, nq, h, self.hdim), divisibility=div)
        k = jit.fake_tensor(dt, (bc, nk, hkv, self.hdim), divisibility=div)
        v = jit.fake_tensor(dt, (bc, nk, hkv, self.hdim_v), divisibility=div)
        o_dt = f32 if self.split else dt
        o = jit.fake_tensor(o_dt, (bo, nq, h, self.hdim_v), divisibility=jit.vec_div(o_dt))
        lse = jit.fake_tensor(f32, (bo, h, nq), divisibility=1)
        per_batch = [jit.fake_tensor(i32, (b,), leading_dim=0) if on else None
                     for on in (True, self.batch_idx, self.leftpad)]
        table = jit.fake_tensor(i32, (b, pages), leading_dim=1) if self.page_size else None
        return (q, k, v, o, lse, *per_batch, table, f32(1.0), f32(0.0), i32(-1), i32(-1), i32(1),
                jit.fake_stream())


@dataclass(frozen=True)
class FwdCombineConfig(jit.KernelConfig):
    """The split merge for one output dtype and value head dim."""

    dtype: str = "bf16"
    hdim_v: int = 128

    kernel_name = "fwd_combine"

    def __post_init__(self) -> None:
        if self.hdim_v % 32 != 0:
            raise ValueError("the split merge takes value head dims that are multiples of 32")

    def build(self):
        from cute_flash.hopper.combine import FwdCombine

        return FwdCombine(self)

    def fake_args(self) -> tuple:
        f32, dt = cutlass.Float32, jit.DTYPES[self.dtype]
        bs, b, nq, h = (jit.sym() for _ in range(4))
        o_acc = jit.fake_tensor(f32, (bs, nq, h, self.hdim_v), divisibility=4)
        lse_acc = jit.fake_tensor(f32, (bs, h, nq), divisibility=1)
        o = jit.fake_tensor(dt, (b, nq, h, self.hdim_v), divisibility=jit.vec_div(dt))
        lse = jit.fake_tensor(f32, (b, h, nq), divisibility=1)
        return (o_acc, lse_acc, o, lse, cutlass.Int32(1), jit.fake_stream())


@dataclass(frozen=True)
class KVCachePlan:
    config: FwdSm90KVCacheConfig
    num_splits: int
    combine: FwdCombineConfig | None


def plan(p: Problem, *, batch_idx: bool, leftpad: bool, page_size: int = 0,
         num_splits: int = 0) -> KVCachePlan:
    """The variant and split count of one call, from shapes only: ``p.max_seqlen_k`` is the cache's
    capacity plus the appended tokens, never the lengths on the device, so a CUDA graph captured
    with this plan stays valid while ``cache_seqlens`` changes. ``num_splits`` > 0 forces a count
    (clipped to the key blocks). ``page_size`` > 0: a paged cache."""
    d = max(p.hdim, p.hdim_v)
    tile_m, tile_n = sm90_tile(d, p.masked)[:2]
    if page_size:
        tile_n = paged_tile_n(page_size, d, p.masked)
    pack = p.heads_q // p.heads_kv
    pack = pack if pack > 1 and tile_m % pack == 0 and p.max_seqlen_q * pack <= tile_m and p.q_dense else 1
    tiles = p.batch * (p.heads_q // pack) * -(-p.max_seqlen_q * pack // tile_m)
    n_blocks = max(1, -(-p.max_seqlen_k // tile_n))
    if num_splits <= 0:
        num_splits = min(p.num_sms // max(tiles, 1), n_blocks // MIN_BLOCKS_PER_SPLIT)
    num_splits = max(1, min(num_splits, n_blocks, MAX_SPLITS))
    split = num_splits > 1
    cfg = FwdSm90KVCacheConfig(target=p.target, dtype=p.dtype, hdim=p.hdim, hdim_v=p.hdim_v, causal=p.causal,
                               local=p.local, softcap=p.softcap, pack_gqa=pack, split=split,
                               batch_idx=batch_idx, leftpad=leftpad, page_size=page_size)
    combine = FwdCombineConfig(target=p.target, dtype=p.dtype, hdim_v=p.hdim_v) if split else None
    return KVCachePlan(cfg, num_splits, combine)
