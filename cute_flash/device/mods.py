"""Programmable attention: a user's ``score_mod`` / ``mask_mod`` (FlexAttention's) traced into the
forward kernels, element by element on the S accumulator, before the built-in masks and the
softmax.

    score_mod(score, b, h, q_idx, kv_idx, aux) -> score    (Float32 in and out)
    mask_mod(b, h, q_idx, kv_idx, aux) -> Boolean           (False: the key is masked out)

``score`` is the scaled score (q . k * softmax_scale); ``b`` the batch (or packed sequence),
``h`` the query head, ``q_idx`` / ``kv_idx`` positions within that sequence (Int32); ``aux`` a
tuple of the call's ``aux`` tensors (cute tensors, indexed like torch's: ``aux[0][h]``). The
functions are CuTe-DSL code: arithmetic, comparisons, ``cute.math`` (exp, log, tanh, ...),
``cutlass.min`` / ``max``, ``cutlass.select_``, reads of ``aux`` tensors and Python constants
(closures too; they are part of the compile key); ``&`` / ``|`` combine conditions, and a mod
decorated with ``cute.jit`` may use ``if`` / ``and`` / ``or`` as well. Positions past a
sequence's end are clamped to its last query / key before the mods see them (those scores are
masked, those rows never stored), so a table lookup by position stays in range. The forwards take
them through their configs (``mods``) and the launcher (``launch.run_fwd(mods=, aux=)``).
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from cute_flash.device.layout import acc_to_mn
from cute_flash.jit import MAX_AUX


def callable_key(fn: Callable) -> str:
    """A name for ``fn`` that changes when its code, constants or captured values do: the compile
    cache keys on it (in memory and on disk). ``cute.jit`` wrappers are looked through."""
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


@dataclass(frozen=True, eq=False)
class Mods:
    """What a forward compiles in: the mods and the element types and ranks of the aux tensors
    (``aux``: (dtype name, rank) each). Equal (and hashed) by ``key``."""

    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    aux: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.score_mod is None and self.mask_mod is None:
            raise ValueError("Mods: a score_mod, a mask_mod or both")
        if len(self.aux) > MAX_AUX:
            raise ValueError(f"at most {MAX_AUX} aux tensors, got {len(self.aux)}")

    @property
    def key(self) -> str:
        names = [callable_key(f) if f is not None else "-" for f in (self.score_mod, self.mask_mod)]
        return f"score={names[0]},mask={names[1]},aux={self.aux}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mods) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"Mods({self.key})"


@cute.jit
def apply_mods(mods: cutlass.Constexpr, acc_S: cute.Tensor, thr_mma, tile_m: cutlass.Constexpr[int],
               tile_n: cutlass.Constexpr[int], m_block: Int32, n_block: Int32, batch: Int32, head: Int32,
               pack: cutlass.Constexpr[int], seqlen_q: Int32, seqlen_k: Int32, aux: tuple,
               softmax_scale: Float32) -> None:
    """``mods`` on one S block in place: with a score_mod the scores leave scaled (the softmax then
    takes log2(e) as its scale); with a mask_mod the keys it rejects become -inf. ``head``: the
    query head, or with packed GQA the KV head (row r is query head head * pack + r % pack)."""
    acc_mn = acc_to_mn(acc_S)
    coords = acc_to_mn(thr_mma.partition_C(cute.make_identity_tensor((tile_m, tile_n))))
    rows = cute.size(acc_mn, mode=[0])
    heads, q_idxs = [], []
    for r in cutlass.range_constexpr(rows):  # (unrolled: plain Python lists)
        row = m_block * tile_m + coords[r, 0][0]
        h, q_idx = head, row
        if cutlass.const_expr(pack > 1):
            h, q_idx = head * pack + row % pack, row // pack
        heads.append(h)
        q_idxs.append(cutlass.min(q_idx, seqlen_q - 1))
    # Column by column: what a mod reads per key is used by the thread's rows right away, not held
    # in registers across the whole block.
    for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
        kv_idx = cutlass.min(n_block * tile_n + coords[0, c][1], seqlen_k - 1)
        for r in cutlass.range_constexpr(rows):
            if cutlass.const_expr(mods.score_mod is not None):
                score = acc_mn[r, c] * softmax_scale
                acc_mn[r, c] = mods.score_mod(score, batch, heads[r], q_idxs[r], kv_idx, aux)
            if cutlass.const_expr(mods.mask_mod is not None):
                if not mods.mask_mod(batch, heads[r], q_idxs[r], kv_idx, aux):
                    acc_mn[r, c] = -Float32.inf


# ---------------------------------------------------------------------------------------------
# Built-in mods: each factory returns (the DSL function, its torch form for ``attention_ref``).
# ``at``: the position of the mod's tensor in ``aux``.
# ---------------------------------------------------------------------------------------------
def alibi(at: int = 0) -> tuple[Callable, Callable]:
    """score + slope[h] * (kv_idx - q_idx); aux[at]: (H,) float32 slopes."""
    @cute.jit
    def score_mod(score, b, h, q_idx, kv_idx, aux):
        return score + aux[at][h] * (kv_idx - q_idx).to(Float32)

    def torch_mod(score, b, h, q_idx, kv_idx, aux):
        return score + aux[at][h] * (kv_idx - q_idx)
    return score_mod, torch_mod


def relative_bias(max_distance: int, at: int = 0) -> tuple[Callable, Callable]:
    """score + table[h, clamp(kv_idx - q_idx, -D, D) + D]; aux[at]: (H, 2 D + 1) float32, D =
    ``max_distance`` (a learnable relative-position table, T5 / Swin style without buckets)."""
    d = max_distance

    @cute.jit
    def score_mod(score, b, h, q_idx, kv_idx, aux):
        rel = cutlass.max(cutlass.min(kv_idx - q_idx, Int32(d)), Int32(-d)) + d
        return score + aux[at][h, rel]

    def torch_mod(score, b, h, q_idx, kv_idx, aux):
        return score + aux[at][h, (kv_idx - q_idx).clamp(-d, d) + d]
    return score_mod, torch_mod


def softcap(cap: float) -> tuple[Callable, Callable]:
    """cap * tanh(score / cap) (Gemma-2, Grok)."""
    @cute.jit
    def score_mod(score, b, h, q_idx, kv_idx, aux):
        return Float32(cap) * cute.math.tanh(score * Float32(1.0 / cap), fastmath=True)

    def torch_mod(score, b, h, q_idx, kv_idx, aux):
        return cap * (score / cap).tanh()
    return score_mod, torch_mod


def document(at: int = 0) -> tuple[Callable, Callable]:
    """Keys of the query's own document: aux[at] (B, N) int32 document ids per position."""
    @cute.jit
    def mask_mod(b, h, q_idx, kv_idx, aux):
        return aux[at][b, q_idx] == aux[at][b, kv_idx]

    def torch_mod(b, h, q_idx, kv_idx, aux):
        ids = aux[at]
        return ids[b, q_idx] == ids[b, kv_idx]
    return mask_mod, torch_mod


def prefix_lm(at: int = 0) -> tuple[Callable, Callable]:
    """Causal, except that the first prefix[b] keys are seen by every query (bidirectional
    prefix); aux[at]: (B,) int32 prefix lengths."""
    @cute.jit
    def mask_mod(b, h, q_idx, kv_idx, aux):
        return (kv_idx <= q_idx) | (kv_idx < aux[at][b])

    def torch_mod(b, h, q_idx, kv_idx, aux):
        return (kv_idx <= q_idx) | (kv_idx < aux[at][b])
    return mask_mod, torch_mod


def sliding_window(window: int) -> tuple[Callable, Callable]:
    """Causal within ``window`` keys back (q_idx - window <= kv_idx <= q_idx)."""
    @cute.jit
    def mask_mod(b, h, q_idx, kv_idx, aux):
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - window)

    def torch_mod(b, h, q_idx, kv_idx, aux):
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - window)
    return mask_mod, torch_mod


def causal() -> tuple[Callable, Callable]:
    """kv_idx <= q_idx (top-left aligned, as FlexAttention's)."""
    @cute.jit
    def mask_mod(b, h, q_idx, kv_idx, aux):
        return kv_idx <= q_idx

    def torch_mod(b, h, q_idx, kv_idx, aux):
        return kv_idx <= q_idx
    return mask_mod, torch_mod
