"""Config and plan of attention over a KV cache on Hopper (``hopper/fwd_kvcache.py``; the split
merge is ``ampere/combine.py``'s): the tile of the forward, packed GQA, paged boxes, the split
count.
"""

from __future__ import annotations

from dataclasses import dataclass

from cute_flash.ampere.kvcache_config import FwdCombineConfig, KVCachePlan, kvcache_fake_args, split_count
from cute_flash.hopper.fwd_config import FwdSm90Config, sm90_tile
from cute_flash.problem import Problem

# Pages reach shared memory as whole TMA boxes of swizzled 8-row groups, at least 16 rows (a block
# of keys is whole pages or a part of one); other page sizes take the sm80 kernel's cp.async rows.
PAGE_BOX_MULTIPLE = 16

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
            if self.page_size % PAGE_BOX_MULTIPLE != 0:
                raise ValueError(f"paged KV: the TMA boxes take page sizes that are multiples of "
                                 f"{PAGE_BOX_MULTIPLE}, got {self.page_size}")
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
        """The KV-cache call signature every family shares (``ampere/kvcache_config.py``)."""
        return kvcache_fake_args(self.dtype, self.hdim, self.hdim_v, self.split, self.batch_idx, self.leftpad,
                                 self.page_size)



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
    num_splits = split_count(p.num_sms, tiles, max(1, -(-p.max_seqlen_k // tile_n)), num_splits)
    split = num_splits > 1
    cfg = FwdSm90KVCacheConfig(target=p.target, dtype=p.dtype, hdim=p.hdim, hdim_v=p.hdim_v, causal=p.causal,
                               local=p.local, softcap=p.softcap, pack_gqa=pack, split=split,
                               batch_idx=batch_idx, leftpad=leftpad, page_size=page_size)
    combine = FwdCombineConfig(target=p.target, dtype=p.dtype, hdim_v=p.hdim_v) if split else None
    return KVCachePlan(cfg, num_splits, combine)
