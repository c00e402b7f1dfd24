"""Block sparsity for ``mask_mod``: which blocks of the (query, key) plane a mask leaves empty,
partial or full, computed once from the mask's torch form and reused across calls and layers (as
FlexAttention's ``BlockMask``).

The mask is evaluated on every (query, key) pair once, in chunks of query rows, and kept as two
boolean grids of ``BLOCK`` x ``BLOCK`` cells: some pair of the cell visible (``any_visible``),
every pair of it visible (``all_visible``). A kernel reads them through ``kernel_ranges``: for each
of its query blocks (forward) or key blocks (backward) the range of the other axis' blocks that
hold any visible pair, and within it the first run of full blocks, which runs without the
mask_mod's element-wise work. Blocks outside the range are skipped. (A hole inside the range is
computed and masked: correct, not skipped.)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

Tensor = torch.Tensor

# Cell size of the grids: divides every kernel tile (multiples of 16 rows and keys).
BLOCK = 16
# Query rows evaluated per chunk (bounds the dense boolean chunk to rows * seqlen_k).
CHUNK_ELEMS = 1 << 26


@dataclass(frozen=True, eq=False)
class BlockMask:
    """The block structure of a mask over ``seqlen_q`` x ``seqlen_k`` positions: bool grids of
    shape (B, H, ceil(seqlen_q / BLOCK), ceil(seqlen_k / BLOCK)), B and H 1 where the mask does not
    depend on them (broadcast). Positions count from each sequence's start (varlen: per
    sequence, B = the number of sequences)."""

    any_visible: Tensor
    all_visible: Tensor
    seqlen_q: int
    seqlen_k: int
    _ranges: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        key = id(self.any_visible)
        _BY_GRID[key] = weakref.ref(self)
        weakref.finalize(self, _BY_GRID.pop, key, None)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return tuple(self.any_visible.shape)

    def density(self) -> float:
        """Share of the cells that hold any visible pair."""
        return float(self.any_visible.float().mean())

    def kernel_ranges(self, tile_m: int, tile_n: int, backward: bool = False, group: int = 1,
                      batch: int | None = None, heads: int | None = None) -> Tensor:
        """int32 (B, H, blocks, 4): per query block of ``tile_m`` rows (``backward``: per key block
        of ``tile_n`` keys, the heads taken ``group`` at a time -- a K/V head's query heads --
        their union / intersection), [first, end) blocks of the other axis holding any visible
        pair, then [first, end) of the first run of full blocks in it. With ``batch`` / ``heads``:
        broadcast to them and materialized (the kernels' argument). Cached per tiling and shape."""
        key = (tile_m, tile_n, backward, group, batch, heads)
        if key not in self._ranges:
            if batch is None:
                self._ranges[key] = _ranges(self, tile_m, tile_n, backward, group)
            else:
                r = self.kernel_ranges(tile_m, tile_n, backward, group)
                self._ranges[key] = r.expand(batch, heads, *r.shape[2:]).contiguous()
        return self._ranges[key]


# Live block masks by their first grid's id: the custom ops carry the two grids, and find the mask
# (with the ranges it caches per tiling) again from them.
_BY_GRID: dict[int, weakref.ref] = {}


def block_mask_of(any_visible: Tensor, all_visible: Tensor) -> BlockMask | None:
    """The ``BlockMask`` these grids belong to, if it is still alive."""
    ref = _BY_GRID.get(id(any_visible))
    known = ref() if ref is not None else None
    ok = known is not None and known.any_visible is any_visible and known.all_visible is all_visible
    return known if ok else None


def _pool(grid: Tensor, rows: int, cols: int, pad: bool, reduce: str) -> Tensor:
    """``grid`` (B, H, R, C) pooled over rows x cols cells ("any" or "all"), padded with ``pad``."""
    b, h, r, c = grid.shape
    rr, cc = -(-r // rows) * rows, -(-c // cols) * cols
    g = torch.full((b, h, rr, cc), pad, dtype=torch.bool, device=grid.device)
    g[:, :, :r, :c] = grid
    g = g.view(b, h, rr // rows, rows, cc // cols, cols)
    return g.any(dim=5).any(dim=3) if reduce == "any" else g.all(dim=5).all(dim=3)


def _first_true(x: Tensor, default: Tensor) -> Tensor:
    """Index of the first True along the last dim, ``default`` where there is none."""
    n = x.shape[-1]
    idx = torch.arange(n, device=x.device).expand_as(x)
    first = torch.where(x, idx, n).amin(dim=-1)
    return torch.where(first == n, default, first)


def _ranges(mask: BlockMask, tile_m: int, tile_n: int, backward: bool, group: int) -> Tensor:
    if tile_m % BLOCK or tile_n % BLOCK:
        raise ValueError(f"kernel tiles must be multiples of {BLOCK} (got {tile_m} x {tile_n})")
    anyv = _pool(mask.any_visible, tile_m // BLOCK, tile_n // BLOCK, False, "any")
    allv = _pool(mask.all_visible, tile_m // BLOCK, tile_n // BLOCK, True, "all")
    if backward:
        anyv, allv = anyv.transpose(2, 3), allv.transpose(2, 3)
        if group > 1 and anyv.shape[1] > 1:
            b, h, r, c = anyv.shape
            anyv = anyv.view(b, h // group, group, r, c).any(dim=2)
            allv = allv.view(b, h // group, group, r, c).all(dim=2)
    n = anyv.shape[-1]
    idx = torch.arange(n, device=anyv.device)
    zero = torch.zeros(anyv.shape[:-1], dtype=torch.long, device=anyv.device)
    first = _first_true(anyv, zero)
    end = torch.where(anyv.any(dim=-1), n - _first_true(anyv.flip(-1), zero), zero)
    full = allv & anyv & (idx >= first.unsqueeze(-1)) & (idx < end.unsqueeze(-1))
    full_first = _first_true(full, end)
    after = ~full & (idx >= full_first.unsqueeze(-1))
    full_end = torch.minimum(_first_true(after, end), end)
    return torch.stack([first, end, full_first, full_end], dim=-1).to(torch.int32).contiguous()


def create_block_mask(mask_mod: Callable | tuple, B: int | None, H: int | None, seqlen_q: int, seqlen_k: int,
                      device: torch.device | str | None = None, aux: tuple = ()) -> BlockMask:
    """The ``BlockMask`` of ``mask_mod`` (its torch form: a function, or a built-in's ``Mod``) over
    ``seqlen_q`` x ``seqlen_k`` positions; ``B`` / ``H`` None where the mask does not depend on the
    batch / head (one grid, broadcast). ``aux``: the tensors the mask reads (as in the call);
    ``device``: where the grids live (default: the aux tensors', else the GPU if any)."""
    fn = mask_mod
    if isinstance(mask_mod, tuple):  # (DSL function, torch function[, ...]) or a Mod
        fn = mask_mod[1] if len(mask_mod) >= 2 else None
    if fn is None or not callable(fn):
        raise TypeError("create_block_mask needs the mask's torch form: a torch function or a Mod / "
                        "(DSL function, torch function) pair")
    if seqlen_q < 1 or seqlen_k < 1:
        raise ValueError(f"create_block_mask: positive lengths, got {seqlen_q} x {seqlen_k}")
    nb, nh = B or 1, H or 1
    if device is None:  # (the aux tensors' device, else the GPU when there is one, as Flex's)
        device = aux[0].device if aux else ("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    b = torch.arange(nb, device=dev).view(nb, 1, 1, 1)
    h = torch.arange(nh, device=dev).view(1, nh, 1, 1)
    kv = torch.arange(seqlen_k, device=dev).view(1, 1, 1, seqlen_k)
    rows_q, cols_k = -(-seqlen_q // BLOCK), -(-seqlen_k // BLOCK)
    anyv = torch.zeros(nb, nh, rows_q, cols_k, dtype=torch.bool, device=dev)
    allv = torch.zeros_like(anyv)
    chunk = max(BLOCK, (CHUNK_ELEMS // max(seqlen_k * nb * nh, 1)) // BLOCK * BLOCK)
    for q0 in range(0, seqlen_q, chunk):
        q1 = min(q0 + chunk, seqlen_q)
        q = torch.arange(q0, q1, device=dev).view(1, 1, q1 - q0, 1)
        keep = torch.as_tensor(fn(b, h, q, kv, tuple(aux)), device=dev).expand(nb, nh, q1 - q0, seqlen_k)
        r0 = q0 // BLOCK
        anyv[:, :, r0:r0 + -(-(q1 - q0) // BLOCK)] = _pool(keep, BLOCK, BLOCK, False, "any")
        allv[:, :, r0:r0 + -(-(q1 - q0) // BLOCK)] = _pool(keep, BLOCK, BLOCK, True, "all")
    return BlockMask(anyv, allv, seqlen_q, seqlen_k)
