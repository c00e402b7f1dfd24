"""Configs and plan of attention over a KV cache with the sm80 kernels (``ampere/fwd_kvcache.py``),
and the split merge every family uses (``ampere/combine.py``: sm80 instructions only).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import cutlass

from cute_flash import jit, signatures
from cute_flash.ampere.config import FwdConfig
from cute_flash.problem import Problem

# Splits are planned to fill the SMs once; more would add a second, mostly empty wave. Each split
# keeps at least this many key blocks, so a split's pipeline fill and its merge stay small
# against its loads.
MIN_BLOCKS_PER_SPLIT = 4
MAX_SPLITS = 128
# Decoding (a tile's query rows, packed GQA included, at most DECODE_TILE_M): the forward's tiles
# would spend 128 rows of mma.sync per key block on a few useful ones, which makes a memory-bound
# problem compute-bound; two warps of 16 rows keep the tensor cores below the memory time, and
# several such CTAs share an SM (docs/tuning.md, "sm80 decoding tile").
DECODE_TILE_M = 32
DECODE_KV_STAGE = 64 * 256  # elements of K and V per block: 32 KB, so that four CTAs fit an SM
SM80_SMEM_PER_SM = 227 * 1024
MAX_REGS_PER_THREAD = 255


@dataclass(frozen=True)
class FwdKVCacheConfig(FwdConfig):
    """The sm80 forward over a KV cache: per-batch key ranges ``[leftpad, seqused)`` of cache row
    ``cache_batch_idx[b]`` (``batch_idx`` / ``leftpad``: the kernel reads those tensors), and
    ``split``: fp32 partials of an equal share of the key blocks, merged by the combine kernel;
    ``page_size`` > 0: a paged cache, any page size (cp.async row by row; 0: contiguous);
    ``pack_gqa`` > 1: the query heads of one KV head share the M tile (it must equal H / H_kv and
    divide tile_m)."""

    split: bool = False
    batch_idx: bool = False
    leftpad: bool = False
    page_size: int = 0
    pack_gqa: int = 1

    kernel_name = "fwd_sm80_kvcache"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.varlen:
            raise ValueError("the KV-cache forward takes dense queries")
        if self.page_size < 0 or (self.page_size and (self.batch_idx or self.leftpad)):
            raise ValueError("paged KV: a page size >= 1, and the page table already maps sequences to "
                             "their keys (no batch_idx / leftpad)")
        if self.pack_gqa < 1 or self.tiles[0] % self.pack_gqa != 0:
            raise ValueError(f"pack_gqa {self.pack_gqa} must divide tile_m {self.tiles[0]}")
        if self.page_size and max(self.hdim, self.hdim_v) > 64:
            # Each copied row's page lookup and address take registers the widest tiles do not have.
            tile_m, tile_n, threads, stages = self.tiles
            # (Two warps copy twice the rows per thread: the widest rows then take half the block.)
            cap = 64 if max(self.hdim, self.hdim_v) <= 128 else (32 if threads >= 128 else 16)
            object.__setattr__(self, "tiles", (tile_m, min(tile_n, cap), threads, stages))

    def build(self):
        from cute_flash.ampere.fwd_kvcache import FlashFwdSm80KVCache

        return FlashFwdSm80KVCache(self)

    def fake_args(self) -> tuple:
        """The KV-cache call signature every family shares (``hopper/kvcache_config.py``)."""
        return kvcache_fake_args(self.dtype, self.hdim, self.hdim_v, self.split, self.batch_idx, self.leftpad,
                                 self.page_size, sinks=self.sinks)


def kvcache_fake_args(dtype: str, hdim: int, hdim_v: int, split: bool, batch_idx: bool, leftpad: bool,
                      page_size: int, kv_dtype: str = "", sinks: bool = False) -> tuple:
    """(q, k_cache, v_cache, o, lse, seqused_k, cache_batch_idx, leftpad, page_table, k_descale,
    v_descale, softmax_scale, softcap, window_left, window_right, num_splits, sinks, stream); ``o`` /
    ``lse`` fp32 partials (B * num_splits, ...) with ``split``; ``page_size`` > 0: a paged
    (num_pages, page_size, H_kv, d) cache and its (B, max_pages) table; ``kv_dtype`` "e4m3": an FP8
    cache with fp32 (B, H_kv) descales (else None)."""
    dt, f32, i32 = jit.DTYPES[dtype], cutlass.Float32, cutlass.Int32
    kvt = cutlass.Float8E4M3FN if kv_dtype == "e4m3" else dt
    b, bo, bc, nq, nk, h, hkv, pages = (jit.sym() for _ in range(8))
    nk = page_size or nk  # (paged: bc counts pages)
    q = jit.fake_tensor(dt, (b, nq, h, hdim), divisibility=jit.vec_div(dt))
    k = jit.fake_tensor(kvt, (bc, nk, hkv, hdim), divisibility=jit.vec_div(kvt))
    v = jit.fake_tensor(kvt, (bc, nk, hkv, hdim_v), divisibility=jit.vec_div(kvt))
    o_dt = f32 if split else dt
    o = jit.fake_tensor(o_dt, (bo, nq, h, hdim_v), divisibility=jit.vec_div(o_dt))
    lse = jit.fake_tensor(f32, (bo, h, nq), divisibility=1)
    per_batch = [jit.fake_tensor(i32, (b,), leading_dim=0) if on else None
                 for on in (True, batch_idx, leftpad)]
    table = jit.fake_tensor(i32, (b, pages), leading_dim=1) if page_size else None
    descales = [jit.fake_tensor(f32, (b, hkv), leading_dim=1) if kv_dtype else None for _ in range(2)]
    return (q, k, v, o, lse, *per_batch, table, *descales, f32(1.0), f32(0.0), i32(-1), i32(-1), i32(1),
            signatures.sinks_arg(sinks), jit.fake_stream())


@dataclass(frozen=True)
class FwdCombineConfig(jit.KernelConfig):
    """The split merge for one output dtype and value head dim; ``sinks``: (H,) sink logits join
    each row's merged softmax (the splits' partials leave them out)."""

    dtype: str = "bf16"
    hdim_v: int = 128
    sinks: bool = False

    kernel_name = "fwd_combine"

    def __post_init__(self) -> None:
        if self.hdim_v % 32 != 0:
            raise ValueError("the split merge takes value head dims that are multiples of 32")

    def build(self):
        from cute_flash.ampere.combine import FwdCombine

        return FwdCombine(self)

    def fake_args(self) -> tuple:
        f32, dt = cutlass.Float32, jit.DTYPES[self.dtype]
        bs, b, nq, h = (jit.sym() for _ in range(4))
        o_acc = jit.fake_tensor(f32, (bs, nq, h, self.hdim_v), divisibility=4)
        lse_acc = jit.fake_tensor(f32, (bs, h, nq), divisibility=1)
        o = jit.fake_tensor(dt, (b, nq, h, self.hdim_v), divisibility=jit.vec_div(dt))
        lse = jit.fake_tensor(f32, (b, h, nq), divisibility=1)
        return (o_acc, lse_acc, o, lse, cutlass.Int32(1), signatures.sinks_arg(self.sinks), jit.fake_stream())


@dataclass(frozen=True)
class AppendKVConfig(jit.KernelConfig):
    """The KV-cache append (``ampere/append_kv.py``): new k / v of ``dtype`` into a cache of
    ``kv_dtype`` ("" = ``dtype``, or "e4m3" with descales), rotary with a ``rotary`` ("fp32",
    "bf16", "fp16"; "" = none) table, pairs ``interleaved`` or halves, q rotated per token
    (``per_token_q``) or all at the first new position; a ``paged`` cache, or cache rows picked by
    ``batch_idx``. Head counts and dims are run-time extents."""

    dtype: str = "bf16"
    kv_dtype: str = ""
    rotary: str = ""
    interleaved: bool = True
    per_token_q: bool = True
    paged: bool = False
    batch_idx: bool = False

    kernel_name = "append_kv"

    def __post_init__(self) -> None:
        if self.kv_dtype not in ("", "e4m3") or self.rotary not in ("", "fp32", "bf16", "fp16"):
            raise ValueError(f"append: kv_dtype '' or 'e4m3', rotary '', fp32, bf16 or fp16; got "
                             f"{self.kv_dtype!r}, {self.rotary!r}")
        if self.paged and self.batch_idx:
            raise ValueError("append: a paged cache has no cache rows to pick")

    def build(self):
        from cute_flash.ampere.append_kv import AppendKV

        return AppendKV(self)

    def fake_args(self) -> tuple:
        """(q, q_out, k, v, k_cache, v_cache, cache_seqlens, cache_batch_idx, page_table, cos, sin,
        k_descale, v_descale, stream); q_out / cos / sin None without rotary."""
        dt, f32, i32 = jit.DTYPES[self.dtype], cutlass.Float32, cutlass.Int32
        kvt = cutlass.Float8E4M3FN if self.kv_dtype == "e4m3" else dt
        b, nq, nn, h, hkv, d, dv, bc, nk, pages, ro, r2 = (jit.sym() for _ in range(12))
        q = jit.fake_tensor(dt, (b, nq, h, d))
        q_out = jit.fake_tensor(dt, (b, nq, h, d)) if self.rotary else None
        k, v = jit.fake_tensor(dt, (b, nn, hkv, d)), jit.fake_tensor(dt, (b, nn, hkv, dv))
        k_cache, v_cache = jit.fake_tensor(kvt, (bc, nk, hkv, d)), jit.fake_tensor(kvt, (bc, nk, hkv, dv))
        seqlens = jit.fake_tensor(i32, (b,), leading_dim=0)
        batch_idx = jit.fake_tensor(i32, (b,), leading_dim=0) if self.batch_idx else None
        table = jit.fake_tensor(i32, (b, pages), leading_dim=1) if self.paged else None
        rt = jit.FLOAT_DTYPES.get(self.rotary)
        rot = [jit.fake_tensor(rt, (ro, r2)) if self.rotary else None for _ in range(2)]
        descales = [jit.fake_tensor(f32, (b, hkv), leading_dim=1) if self.kv_dtype else None
                    for _ in range(2)]
        return (q, q_out, k, v, k_cache, v_cache, seqlens, batch_idx, table, *rot, *descales,
                jit.fake_stream())


@dataclass(frozen=True)
class KVCachePlan:
    config: jit.KernelConfig
    num_splits: int
    combine: FwdCombineConfig | None


# A grid's y / z extent; the batch x split extent is one of them.
MAX_GRID_YZ = 65535


def split_count(slots: int, tiles: int, n_blocks: int, num_splits: int, batch: int = 1) -> int:
    """Splits per tile: ``num_splits`` if given (clipped to the key blocks and the grid), else enough
    to fill the ``slots`` (SMs, or resident CTAs of all SMs) once with at least
    ``MIN_BLOCKS_PER_SPLIT`` blocks each."""
    if num_splits <= 0:
        num_splits = min(slots // max(tiles, 1), n_blocks // MIN_BLOCKS_PER_SPLIT)
    return max(1, min(num_splits, n_blocks, MAX_SPLITS, MAX_GRID_YZ // max(batch, 1)))


def _pack(p: Problem, tile_m: int) -> int:
    """Query heads per KV head packed into one tile (1: none) for tiles of ``tile_m`` rows."""
    group = p.heads_q // p.heads_kv
    fits = group > 1 and tile_m % group == 0 and p.max_seqlen_q * group <= tile_m and p.q_dense
    return group if fits else 1


def decode_tiles(tiles: tuple[int, int, int, int], hdim: int, hdim_v: int) -> tuple[int, int, int, int]:
    """The decoding tile beside the forward's ``tiles``: DECODE_TILE_M rows, one warp per 16, the
    forward's tile_n up to DECODE_KV_STAGE elements of K and V, one stage (the SM's other CTAs
    hide the loads)."""
    return DECODE_TILE_M, min(tiles[1], DECODE_KV_STAGE // (hdim + hdim_v)), DECODE_TILE_M // 16 * 32, 1


def fills_the_sms_decoding(p: Problem) -> bool:
    """Decoding (the decoding tile applies) with at least a quarter as many tiles as SMs: on Hopper
    the sm80 decoding tiles then read a contiguous cache faster than the sm90 kernel (which wins
    where few tiles must split the keys)."""
    pack = _pack(p, DECODE_TILE_M)
    decoding = p.max_seqlen_q * pack <= DECODE_TILE_M
    return decoding and p.batch * (p.heads_q // pack) * 4 >= p.num_sms


def ctas_per_sm(cfg: FwdKVCacheConfig) -> int:
    """Resident CTAs of ``cfg`` per SM, bounded by shared memory (Q, the K / V stages) and by
    registers at the most a thread can hold."""
    tile_m, tile_n, threads, stages = cfg.tiles
    smem = 2 * (tile_m * max(cfg.hdim, cfg.hdim_v) + stages * tile_n * (cfg.hdim + cfg.hdim_v))
    return max(1, min(SM80_SMEM_PER_SM // smem, 65536 // (MAX_REGS_PER_THREAD * threads)))


def plan(p: Problem, *, batch_idx: bool, leftpad: bool, page_size: int = 0, num_splits: int = 0,
         tiles: tuple[int, int, int, int] | None = None) -> KVCachePlan:
    """The sm80 variant and split count of one call, from shapes only (``p.max_seqlen_k``: the
    cache's capacity); ``tiles`` forces (tile_m, tile_n, threads, stages) (the tile sweep).
    Decoding takes ``decode_tiles``, and its splits fill every resident CTA slot of the SMs."""
    base = FwdKVCacheConfig(target=p.target, dtype=p.dtype, hdim=p.hdim, hdim_v=p.hdim_v, causal=p.causal,
                            local=p.local, softcap=p.softcap, page_size=page_size,
                            tiles=tiles or (0, 0, 0, 0))
    decoding = p.max_seqlen_q * _pack(p, DECODE_TILE_M) <= DECODE_TILE_M
    if tiles is None and decoding:
        base = replace(base, tiles=decode_tiles(base.tiles, p.hdim, p.hdim_v))
    tile_m, tile_n = base.tiles[:2]
    pack = _pack(p, tile_m)
    slots = p.num_sms * (ctas_per_sm(base) if tile_m <= DECODE_TILE_M else 1)
    tiles = p.batch * (p.heads_q // pack) * -(-p.max_seqlen_q * pack // tile_m)
    splits = split_count(slots, tiles, max(1, -(-p.max_seqlen_k // tile_n)), num_splits, p.batch)
    cfg = replace(base, split=splits > 1, batch_idx=batch_idx, leftpad=leftpad, pack_gqa=pack,
                  sinks=p.sinks and splits == 1)  # (split: the merge adds the sinks)
    combine = (FwdCombineConfig(target=p.target, dtype=p.dtype, hdim_v=p.hdim_v, sinks=p.sinks) if splits > 1
               else None)
    return KVCachePlan(cfg, splits, combine)
