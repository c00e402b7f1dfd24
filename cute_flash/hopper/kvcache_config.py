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

def fp8_tile_n(d: int) -> int:
    """tile_n with an e4m3 cache: its staging buffers take shared memory from the 16-bit stages."""
    return 64 if d <= 128 else 32


def kv_tile_n(page_size: int, d: int, masked: bool, fp8: bool) -> int:
    """The tuned tile_n of head dim ``d`` (capped for an e4m3 cache); paged, the largest multiple of
    16 below it that divides a page or that a page divides (a K / V block is then whole pages, or
    part of one)."""
    tile_n = sm90_tile(d, masked)[1]
    if fp8:
        tile_n = min(tile_n, fp8_tile_n(d))
    if not page_size:
        return tile_n
    for n in range(tile_n, 15, -16):
        if page_size % n == 0 or n % page_size == 0:
            return n
    return 16


def takes_pages(page_size: int, d: int, masked: bool, fp8: bool) -> bool:
    """Whether the TMA boxes take these pages at a useful block size: multiples of 16 rows whose
    block (``kv_tile_n``) keeps at least 64 keys or the unpaged tile_n (208-row pages would leave
    16-key blocks)."""
    if page_size % PAGE_BOX_MULTIPLE != 0:
        return False
    return kv_tile_n(page_size, d, masked, fp8) >= min(64, kv_tile_n(0, d, masked, fp8))


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
    # "e4m3": an FP8 cache with (B, H_kv) descales and 16-bit queries, its blocks turned into
    # ``dtype`` in shared memory by the producer warpgroup (``hopper/fwd_kvcache_fp8.py``); "": the
    # cache is ``dtype``.
    kv_dtype: str = ""

    kernel_name = "fwd_sm90_kvcache"

    def __post_init__(self) -> None:
        if self.page_size:
            if self.page_size % PAGE_BOX_MULTIPLE != 0:
                raise ValueError(f"paged KV: the TMA boxes take page sizes that are multiples of "
                                 f"{PAGE_BOX_MULTIPLE}, got {self.page_size}")
            if self.batch_idx or self.leftpad:
                raise ValueError("paged KV: the page table already maps sequences to their keys")
        if self.kv_dtype not in ("", "e4m3") or (self.kv_dtype and self.dtype not in ("bf16", "fp16")):
            raise ValueError(f"KV cache dtype {self.kv_dtype!r}: '' (the queries') or 'e4m3' with 16-bit "
                             f"queries, got queries {self.dtype}")
        if not self.tile_n and (self.page_size or self.kv_dtype):
            object.__setattr__(self, "tile_n", kv_tile_n(self.page_size, max(self.hdim, self.hdim_v),
                                                         self.causal or self.local, bool(self.kv_dtype)))
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

    def smem_bytes(self, separate_o: bool) -> int:
        staging = self.stages * self.tile_n * (self.hdim + self.hdim_v) if self.kv_dtype else 0
        return super().smem_bytes(separate_o) + staging + (2 * 1024 if self.kv_dtype else 0)

    def build(self):
        if self.kv_dtype:
            from cute_flash.hopper.fwd_kvcache_fp8 import FlashFwdSm90KVCacheFp8

            return FlashFwdSm90KVCacheFp8(self)
        from cute_flash.hopper.fwd_kvcache import FlashFwdSm90KVCache

        return FlashFwdSm90KVCache(self)

    def fake_args(self) -> tuple:
        """The KV-cache call signature every family shares (``ampere/kvcache_config.py``)."""
        return kvcache_fake_args(self.dtype, self.hdim, self.hdim_v, self.split, self.batch_idx, self.leftpad,
                                 self.page_size, self.kv_dtype, self.sinks)



def plan(p: Problem, *, batch_idx: bool, leftpad: bool, page_size: int = 0, num_splits: int = 0,
         kv_dtype: str = "") -> KVCachePlan:
    """The variant and split count of one call, from shapes only: ``p.max_seqlen_k`` is the cache's
    capacity plus the appended tokens, never the lengths on the device, so a CUDA graph captured
    with this plan stays valid while ``cache_seqlens`` changes. ``num_splits`` > 0 forces a count
    (clipped to the key blocks). ``page_size`` > 0: a paged cache."""
    d = max(p.hdim, p.hdim_v)
    tile_m, tile_n = sm90_tile(d, p.masked)[:2]
    if page_size or kv_dtype:
        tile_n = kv_tile_n(page_size, d, p.masked, bool(kv_dtype))
    pack = p.heads_q // p.heads_kv
    pack = pack if pack > 1 and tile_m % pack == 0 and p.max_seqlen_q * pack <= tile_m and p.q_dense else 1
    tiles = p.batch * (p.heads_q // pack) * -(-p.max_seqlen_q * pack // tile_m)
    num_splits = split_count(p.num_sms, tiles, max(1, -(-p.max_seqlen_k // tile_n)), num_splits, p.batch)
    split = num_splits > 1
    # (Split, the sinks join in the merge: each split's partial LSE must not count them.)
    cfg = FwdSm90KVCacheConfig(target=p.target, dtype=p.dtype, hdim=p.hdim, hdim_v=p.hdim_v, causal=p.causal,
                               local=p.local, softcap=p.softcap, pack_gqa=pack, split=split,
                               batch_idx=batch_idx, leftpad=leftpad, page_size=page_size, kv_dtype=kv_dtype,
                               sinks=p.sinks and not split)
    combine = None
    if split:
        combine = FwdCombineConfig(target=p.target, dtype=p.dtype, hdim_v=p.hdim_v, sinks=p.sinks)
    return KVCachePlan(cfg, num_splits, combine)
