"""Programmable attention: a user's ``score_mod`` / ``mask_mod`` (FlexAttention's) traced into the
forward and backward kernels, element by element on the S (S^T) accumulator, before the built-in
masks and the softmax; in the backward, the score_mod's derivative on dS.

    score_mod(score, b, h, q_idx, kv_idx, aux) -> score    (Float32 in and out)
    mask_mod(b, h, q_idx, kv_idx, aux) -> Boolean           (False: the key is masked out)
    score_mod_bwd(grad, score, b, h, q_idx, kv_idx, aux, aux_grads) -> grad of score

``score`` is the scaled score (q . k * softmax_scale); ``b`` the batch (or packed sequence),
``h`` the query head, ``q_idx`` / ``kv_idx`` positions within that sequence (Int32); ``aux`` a
tuple of the call's ``aux`` tensors (cute tensors, indexed like torch's: ``aux[0][h]``). The
functions are CuTe-DSL code: arithmetic, comparisons, ``cute.math`` (exp, log, tanh, ...),
``cutlass.min`` / ``max``, ``cutlass.select_``, reads of ``aux`` tensors and Python constants
(closures too; they are part of the compile key); ``&`` / ``|`` combine conditions, and a mod
decorated with ``cute.jit`` may use ``if`` / ``and`` / ``or`` as well. Positions past a
sequence's end are clamped to its last query / key before the mods see them (those scores are
masked, those rows never stored), so a table lookup by position stays in range; an sm90 forward
block wholly inside both sequences skips the clamp, so the compiler sees each thread's positions
as one base plus constants and shares what a mod computes from ``kv_idx - q_idx`` between the
thread's rows (two rows eight apart read the same relative offsets, eight keys apart). The kernels take
them through their configs (``mods``: ``Mods``) and the launchers (``launch.run_fwd`` /
``run_bwd(mods=, aux=, aux_grads=, blocks=)``); a block mask (``block_mask.py``) narrows the
blocks visited and spares the full ones the mask_mod.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash.device.layout import acc_to_mn
from cute_flash.jit import MAX_AUX
from cute_flash.memo import HostMemo


def callable_key(fn: Callable) -> str:
    """A name for ``fn`` that changes when its code, constants or captured values do: the compile
    cache keys on it (in memory and on disk). ``cute.jit`` wrappers are looked through. Where every
    captured value and default is immutable (numbers, strings, tuples of them: the built-ins'),
    the key is hashed once per set of those objects (a call's host time); otherwise every call
    hashes their reprs, so a container changed in place changes the key."""
    inner = inspect.unwrap(fn)
    held = (*_captured(inner), inner.__defaults__, inner.__kwdefaults__)
    if not all(_immutable(v) for v in held):
        return _callable_key(fn)
    got = _KEYS.get(fn)
    if got is None or len(got[0]) != len(held) or any(a is not b for a, b in zip(got[0], held, strict=True)):
        got = (held, _callable_key(fn))  # (the values held too: their ids stay theirs)
        _KEYS.put(fn, got)
    return got[1]


def _immutable(value: object) -> bool:
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return True
    return isinstance(value, (tuple, frozenset)) and all(_immutable(v) for v in value)


def _captured(fn: Callable) -> tuple:
    out = []
    for cell in fn.__closure__ or ():
        try:
            out.append(cell.cell_contents)
        except ValueError:  # (a cell not bound yet)
            out.append(None)
    return tuple(out)


_KEYS = HostMemo(1024)


def _callable_key(fn: Callable) -> str:
    fn = inspect.unwrap(fn)
    code = fn.__code__
    h = hashlib.sha256(code.co_code)
    parts = [code.co_consts, code.co_names, fn.__defaults__, fn.__kwdefaults__]
    parts += [c.cell_contents for c in (fn.__closure__ or ())]
    for p in parts:
        h.update(repr(p).encode())
    for c in code.co_consts:  # nested functions and lambdas
        if hasattr(c, "co_code"):
            h.update(c.co_code)
    return f"{fn.__module__}.{fn.__qualname__}#{h.hexdigest()[:16]}"


class Mod(NamedTuple):
    """A mod as the built-ins return it: the DSL function compiled into the kernels, its torch form
    (CPU tensors and ``attention_ref``) and, for a score_mod, its derivative (``bwd``: the
    backward's ``score_mod_bwd``)."""

    dsl: Callable
    torch: Callable | None = None
    bwd: Callable | None = None


@dataclass(frozen=True, eq=False)
class Mods:
    """What a kernel compiles in: the mods, the element types and ranks of the aux tensors
    (``aux``: (dtype name, rank) each) and, for a backward, the score_mod's derivative and which
    aux tensors get a gradient (``aux_grads``: one flag per aux). Equal (and hashed) by ``key``."""

    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    aux: tuple[tuple[str, int], ...] = ()
    score_mod_bwd: Callable | None = None
    aux_grads: tuple[bool, ...] = ()
    # A block mask's ranges (``block_mask.py``) narrow the blocks visited and spare the full ones
    # the mask_mod.
    block_sparse: bool = False

    def __post_init__(self) -> None:
        if self.score_mod is None and self.mask_mod is None:
            raise ValueError("Mods: a score_mod, a mask_mod or both")
        if len(self.aux) > MAX_AUX:
            raise ValueError(f"at most {MAX_AUX} aux tensors, got {len(self.aux)}")
        if self.aux_grads and len(self.aux_grads) != len(self.aux):
            raise ValueError("aux_grads: one flag per aux tensor")
        if any(self.aux_grads) and self.score_mod_bwd is None:
            raise ValueError("aux gradients come from the score_mod's derivative (score_mod_bwd)")
        if self.block_sparse and self.mask_mod is None:
            raise ValueError("a block mask goes with the mask_mod it was made from")
        object.__setattr__(self, "_key", self._make_key())  # (every cache lookup hashes it)

    @property
    def key(self) -> str:
        return self._key

    def _make_key(self) -> str:
        fns = (self.score_mod, self.mask_mod, self.score_mod_bwd)
        names = [callable_key(f) if f is not None else "-" for f in fns]
        key = f"score={names[0]},mask={names[1]},aux={self.aux}"
        if self.score_mod_bwd is not None or any(self.aux_grads):
            key += f",bwd={names[2]},grads={self.aux_grads}"
        return key + (",sparse" if self.block_sparse else "")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mods) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"Mods({self.key})"

    def part(self, score: bool) -> Mods | None:
        """The score_mod alone (``score``) or the mask_mod alone, as a Mods; None if absent."""
        if (self.score_mod if score else self.mask_mod) is None:
            return None
        if score:
            return Mods(score_mod=self.score_mod, aux=self.aux, score_mod_bwd=self.score_mod_bwd,
                        aux_grads=self.aux_grads)
        return Mods(mask_mod=self.mask_mod, aux=self.aux)

    @property
    def grads_score(self) -> bool:
        """The backward runs the score_mod's derivative (and keeps the unmodified scores for it)."""
        return self.score_mod is not None and self.score_mod_bwd is not None


def aligned_grads(mods: Mods | None, grads: tuple) -> tuple:
    """A backward kernel's aux gradients, given without the Nones, back at their aux positions
    (None where the call asked for none): what ``score_mod_bwd`` sees as ``aux_grads``."""
    if mods is None:
        return ()
    it = iter(grads)
    flags = mods.aux_grads or (False,) * len(mods.aux)
    return tuple(next(it) if flag else None for flag in flags)


def check_bwd_mods(mods: Mods | None, deterministic: bool) -> None:
    """A backward compiles a score_mod only with its derivative; deterministic mode takes no block
    mask (its add order assumes the unmasked query-block ranges) and no aux gradients."""
    if mods is not None and mods.score_mod is not None and mods.score_mod_bwd is None:
        raise ValueError("a backward with a score_mod needs its derivative (score_mod_bwd)")
    if mods is not None and deterministic and (mods.block_sparse or any(mods.aux_grads)):
        raise ValueError("deterministic mode takes neither a block mask nor aux gradients yet (the latter "
                         "are added atomically, in no fixed order)")


@cute.jit
def grad_add(t: cute.Tensor, coord, value: Float32) -> None:
    """t[coord] += value, atomically: how a ``score_mod_bwd`` accumulates an aux tensor's gradient
    (many scores read one table entry). The gradients are fp64: an entry sums up to every score's
    share, in no fixed order, and fp32 running sums of 10^5 terms lose the answer's digits."""
    cute.arch.atomic_add(t.iterator + cute.crd2idx(coord, t.layout), value.to(t.element_type))


def _axis_index(pos: Int32, base: Int32, is_query: bool, head: Int32, pack: int, seqlen: Int32, clamp: bool):
    """(head, position) of tile-local ``pos`` on the query or the key axis, the position clamped to
    the sequence (so that the mods' table reads stay in range) unless the block lies inside it."""
    idx = base + pos
    h = head
    if is_query and pack > 1:
        h, idx = head * pack + idx % pack, idx // pack
    return h, cutlass.min(idx, seqlen - 1) if clamp else idx


def inside(where: tuple, extent: tuple[int, int]) -> cutlass.Boolean:
    """Whether a block of ``extent`` (queries, keys) at ``where`` (``mod_scores``' arguments after
    the accumulator) lies inside both sequences: its positions need no clamp."""
    q0, k0, seqlen_q, seqlen_k = where[2], where[3], where[7], where[8]
    return (q0 + extent[0] <= seqlen_q) & (k0 + extent[1] <= seqlen_k)


def _each_score(fn: Callable, acc_mn: cute.Tensor, coords: cute.Tensor, q_mode: int, q0: Int32, k0: Int32,
                head: Int32, pack: int, seqlen_q: Int32, seqlen_k: Int32, clamp: bool = True) -> None:
    """``fn(r, c, h, q_idx, kv_idx)`` over every element of an (rows, cols) accumulator view, whose
    tile-local coordinates ``coords`` hold the query on mode ``q_mode`` (the backward's S^T holds
    it on the columns). Column by column: what a mod reads per column is used by the thread's rows
    right away, not held in registers across the whole block."""
    # (Plain Python, called while a kernel traces: its loops unroll.)
    rows = cute.size(acc_mn, mode=[0])
    row_base, row_len = (q0, seqlen_q) if q_mode == 0 else (k0, seqlen_k)
    col_base, col_len = (k0, seqlen_k) if q_mode == 0 else (q0, seqlen_q)
    row_idx = [_axis_index(coords[r, 0][0], row_base, q_mode == 0, head, pack, row_len, clamp)
               for r in range(rows)]
    for c in range(cute.size(acc_mn, mode=[1])):
        col_h, col_idx = _axis_index(coords[0, c][1], col_base, q_mode == 1, head, pack, col_len, clamp)
        for r in range(rows):
            if q_mode == 0:
                fn(r, c, row_idx[r][0], row_idx[r][1], col_idx)
            else:
                fn(r, c, col_h, col_idx, row_idx[r][1])


def mod_scores(mods: Mods, acc_S: cute.Tensor, coords: cute.Tensor, q_mode: int, q0: Int32, k0: Int32,
               batch: Int32, head: Int32, pack: int, seqlen_q: Int32, seqlen_k: Int32, aux: tuple,
               softmax_scale: Float32, pre: cute.Tensor | None = None, clamp: bool = True) -> None:
    """``mods`` on one S (or S^T) block in place: with a score_mod the scores leave scaled (the
    softmax then takes log2(e) as its scale); with a mask_mod the keys it rejects become -inf.
    ``coords``: the tile-local coordinates of ``acc_S``'s elements in (rows, cols) form; ``q0`` /
    ``k0``: the block's first query / key; ``head``: the query head, or with packed GQA the KV
    head (row r is query head head * pack + r % pack). ``pre``: where the backward keeps the
    scores the score_mod saw (its derivative reads them); ``clamp``: False where the block lies
    inside both sequences (``inside``). (Plain Python, called while a kernel traces.)"""
    acc_mn = acc_to_mn(acc_S)
    pre_mn = acc_to_mn(pre) if pre is not None else None

    def one(r, c, h, q_idx, kv_idx):
        if mods.score_mod is not None:
            score = acc_mn[r, c] * softmax_scale
            if pre_mn is not None:
                pre_mn[r, c] = score
            acc_mn[r, c] = mods.score_mod(score, batch, h, q_idx, kv_idx, aux)
        if mods.mask_mod is not None:
            keep = mods.mask_mod(batch, h, q_idx, kv_idx, aux)
            acc_mn[r, c] = cutlass.select_(keep, acc_mn[r, c], -Float32.inf)

    _each_score(one, acc_mn, coords, q_mode, q0, k0, head, pack, seqlen_q, seqlen_k, clamp)


def mod_grads(mods: Mods, acc_dS: cute.Tensor, pre: cute.Tensor, coords: cute.Tensor, q_mode: int, q0: Int32,
              k0: Int32, batch: Int32, head: Int32, seqlen_q: Int32, seqlen_k: Int32, aux: tuple,
              aux_grads: tuple) -> None:
    """The score_mod's chain rule on one dS (or dS^T) block in place: dS <- score_mod_bwd(dS, the
    score it saw, ...), which may also add into ``aux_grads`` (``grad_add``)."""
    ds_mn, pre_mn = acc_to_mn(acc_dS), acc_to_mn(pre)

    def one(r, c, h, q_idx, kv_idx):
        ds_mn[r, c] = mods.score_mod_bwd(ds_mn[r, c], pre_mn[r, c], batch, h, q_idx, kv_idx, aux, aux_grads)

    _each_score(one, ds_mn, coords, q_mode, q0, k0, head, 1, seqlen_q, seqlen_k)


@cute.jit
def block_range(mBlocks: cute.Tensor, batch: Int32, head: Int32, block: Int32, lo: Int32, hi: Int32):
    """A block mask's ranges (``block_mask.BlockMask.kernel_ranges``) for query block ``block``
    (backward: key block): (lo, hi) narrowed to the blocks with any visible pair, and the [first,
    end) of the full blocks, where the mask_mod's work is skipped."""
    b = cutlass.min(block, mBlocks.shape[2] - 1)  # (tiles past a short sequence's end)
    lo = cutlass.max(lo, mBlocks[batch, head, b, 0])
    hi = cutlass.min(hi, mBlocks[batch, head, b, 1])
    return lo, hi, mBlocks[batch, head, b, 2], mBlocks[batch, head, b, 3]


def outside_full(block: Int32, full) -> cutlass.Boolean:
    """Whether ``block`` lies outside a block mask's run of full blocks (``block_range``): the
    mask_mod must run on it."""
    return (block < full[0]) | (block >= full[1])


@cute.jit
def _mods_on_block(mods: cutlass.Constexpr, acc_S: cute.Tensor, where: tuple, pre, block: Int32, full,
                   clamp: cutlass.Constexpr[bool]) -> None:
    if cutlass.const_expr(full is None):
        mod_scores(mods, acc_S, *where, pre, clamp)
    else:
        if cutlass.const_expr(mods.score_mod is not None):
            mod_scores(mods.part(score=True), acc_S, *where, pre, clamp)
        if outside_full(block, full):
            mod_scores(mods.part(score=False), acc_S, *where, None, clamp)


@cute.jit
def mod_scores_in_block(mods: cutlass.Constexpr, acc_S: cute.Tensor, where: tuple, pre, block: Int32,
                        full, extent: cutlass.Constexpr = None) -> None:
    """``mod_scores(mods, acc_S, *where, pre)`` on one block; under a block mask (``full``: its run
    of full blocks, ``block_range``) the mask_mod runs only on the blocks outside that run (a
    uniform branch per block), the score_mod on every block. ``extent``: the block's (queries,
    keys), given where it may lie inside both sequences: a uniform branch then takes the code
    without the positions' clamp (packed GQA rows always clamp)."""
    if cutlass.const_expr(extent is None or where[6] > 1):
        _mods_on_block(mods, acc_S, where, pre, block, full, True)
    else:
        if inside(where, extent):
            _mods_on_block(mods, acc_S, where, pre, block, full, False)
        else:
            _mods_on_block(mods, acc_S, where, pre, block, full, True)


@cute.jit
def apply_mods(mods: cutlass.Constexpr, acc_S: cute.Tensor, thr_mma, tile_m: cutlass.Constexpr[int],
               tile_n: cutlass.Constexpr[int], m_block: Int32, n_block: Int32, batch: Int32, head: Int32,
               pack: cutlass.Constexpr[int], seqlen_q: Int32, seqlen_k: Int32, aux: tuple,
               softmax_scale: Float32, full=None, partial: cutlass.Constexpr[bool] = True) -> None:
    """``mod_scores_in_block`` on a forward's S block (queries on the rows) of query block
    ``m_block`` and K/V block ``n_block``; ``partial``: the block may run past the keys' end (the
    forward's first block), so its positions are always clamped. (The sm80 forward clamps every
    block: the unclamped code beside the clamped one spills its registers.)"""
    coords = acc_to_mn(thr_mma.partition_C(cute.make_identity_tensor((tile_m, tile_n))))
    where = (coords, 0, m_block * tile_m, n_block * tile_n, batch, head, pack, seqlen_q, seqlen_k, aux,
             softmax_scale)
    mod_scores_in_block(mods, acc_S, where, None, n_block, full, None if partial else (tile_m, tile_n))


# ---------------------------------------------------------------------------------------------
# Built-in mods: each factory returns a ``Mod`` (the DSL function, its torch form and, for a
# score_mod, its derivative). ``at``: the position of the mod's tensor in ``aux``.
#
#     score_mod_bwd(grad, score, b, h, q_idx, kv_idx, aux, aux_grads) -> grad of the score
#
# ``grad``: the loss's gradient with respect to the score_mod's output, ``score`` its input;
# ``aux_grads``: per aux tensor, its fp64 gradient (same shape) where the call asked for one, else
# None; add into it with ``grad_add``.
# ---------------------------------------------------------------------------------------------
def alibi(at: int = 0) -> Mod:
    """score + slope[h] * (kv_idx - q_idx); aux[at]: (H,) float32 slopes (learnable: their
    gradient sums grad * (kv_idx - q_idx))."""
    # Positions converted on their own (once per row / key: the conversions are shared across the
    # block) and subtracted in fp32, exact below 2^24: ptxas recomputes a shared per-offset value
    # at each score rather than hold it, and a conversion costs more than the subtraction.
    @cute.jit
    def score_mod(score, b, h, q_idx, kv_idx, aux):
        return score + aux[at][h] * (kv_idx.to(Float32) - q_idx.to(Float32))

    def torch_mod(score, b, h, q_idx, kv_idx, aux):
        return score + aux[at][h] * (kv_idx - q_idx)

    @cute.jit
    def score_mod_bwd(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
        if cutlass.const_expr(aux_grads[at] is not None):
            grad_add(aux_grads[at], (h,), grad * (kv_idx.to(Float32) - q_idx.to(Float32)))
        return grad
    return Mod(score_mod, torch_mod, score_mod_bwd)


def relative_bias(max_distance: int, at: int = 0) -> Mod:
    """score + table[h, clamp(kv_idx - q_idx, -D, D) + D]; aux[at]: (H, 2 D + 1) float32, D =
    ``max_distance`` (a learnable relative-position table, T5 / Swin style without buckets)."""
    d = max_distance

    @cute.jit
    def score_mod(score, b, h, q_idx, kv_idx, aux):
        rel = cutlass.max(cutlass.min(kv_idx - q_idx, Int32(d)), Int32(-d)) + d
        return score + aux[at][h, rel]

    def torch_mod(score, b, h, q_idx, kv_idx, aux):
        return score + aux[at][h, (kv_idx - q_idx).clamp(-d, d) + d]

    @cute.jit
    def score_mod_bwd(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
        if cutlass.const_expr(aux_grads[at] is not None):
            rel = cutlass.max(cutlass.min(kv_idx - q_idx, Int32(d)), Int32(-d)) + d
            grad_add(aux_grads[at], (h, rel), grad)
        return grad
    return Mod(score_mod, torch_mod, score_mod_bwd)


def softcap(cap: float) -> Mod:
    """cap * tanh(score / cap) (Gemma-2, Grok)."""
    @cute.jit
    def score_mod(score, b, h, q_idx, kv_idx, aux):
        return Float32(cap) * cute.math.tanh(score * Float32(1.0 / cap), fastmath=True)

    def torch_mod(score, b, h, q_idx, kv_idx, aux):
        return cap * (score / cap).tanh()

    @cute.jit
    def score_mod_bwd(grad, score, b, h, q_idx, kv_idx, aux, aux_grads):
        t = cute.math.tanh(score * Float32(1.0 / cap), fastmath=True)
        return grad * (Float32(1.0) - t * t)
    return Mod(score_mod, torch_mod, score_mod_bwd)


def document(at: int = 0) -> Mod:
    """Keys of the query's own document: aux[at] (B, N) int32 document ids per position."""
    @cute.jit
    def mask_mod(b, h, q_idx, kv_idx, aux):
        return aux[at][b, q_idx] == aux[at][b, kv_idx]

    def torch_mod(b, h, q_idx, kv_idx, aux):
        ids = aux[at]
        return ids[b, q_idx] == ids[b, kv_idx]
    return Mod(mask_mod, torch_mod)


def prefix_lm(at: int = 0) -> Mod:
    """Causal, except that the first prefix[b] keys are seen by every query (bidirectional
    prefix); aux[at]: (B,) int32 prefix lengths."""
    @cute.jit
    def mask_mod(b, h, q_idx, kv_idx, aux):
        return (kv_idx <= q_idx) | (kv_idx < aux[at][b])

    def torch_mod(b, h, q_idx, kv_idx, aux):
        return (kv_idx <= q_idx) | (kv_idx < aux[at][b])
    return Mod(mask_mod, torch_mod)


def sliding_window(window: int) -> Mod:
    """Causal within ``window`` keys back (q_idx - window <= kv_idx <= q_idx)."""
    @cute.jit
    def mask_mod(b, h, q_idx, kv_idx, aux):
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - window)

    def torch_mod(b, h, q_idx, kv_idx, aux):
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - window)
    return Mod(mask_mod, torch_mod)


def causal() -> Mod:
    """kv_idx <= q_idx (top-left aligned, as FlexAttention's)."""
    @cute.jit
    def mask_mod(b, h, q_idx, kv_idx, aux):
        return kv_idx <= q_idx

    def torch_mod(b, h, q_idx, kv_idx, aux):
        return kv_idx <= q_idx
    return Mod(mask_mod, torch_mod)
