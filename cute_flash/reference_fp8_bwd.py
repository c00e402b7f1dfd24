"""The FP8 backward's recipe in PyTorch, tile by tile, and the accuracy study behind its choices.

From what the FP8 forward keeps (Q8, K8 rotated by M = D H / sqrt(d) when ``rotate_qk``, V8, their
per-(batch, kv head) descales, O and the LSE) the backward recomputes S = Q8 K8^T (rotation
leaves Q K^T unchanged) and P = exp(S * scale - LSE), and runs its four GEMMs on 8-bit operands:

    dV = P^T dO          P and dO quantized (``p``, ``do``)
    dP = dO V^T          with ``rotate_do``: dO and V both rotated by M (dO V^T unchanged, dV
                         comes out rotated and is rotated back)
    dS = P (dP - D)      D = rowsum(dO * O) from the unquantized dO, as the bf16 preprocess
    dQ = dS K, dK = dS^T Q   dS quantized (``ds``); dQ, dK rotated back with ``rotate_qk``

A tile-scaled format takes one scale per (query block, key block) tile from the tile's amax
(e4m3: 448 / amax, e5m2: 57344 / amax), so no value saturates; one scale per tile factors out of
every GEMM that contracts over the tile, where a per-row scale would not (dQ contracts over keys,
dK over queries, dV over queries). dO and V take one scale per (batch, kv head), like Q and K, or
dO one per (token, head) row (``do="e4m3_row"``): a row scale factors out of dP = dO V^T by rows
and out of dV = P^T dO through P (P / s quantized with its tile's scale), and rows far below
the head's largest keep e4m3's precision instead of flushing to zero.
``fp8_bwd_rmse_table`` measures each choice's gradient RMSE against fp64 on the FA3 paper's
normal and outlier inputs, with the bf16 backward (bf16 inputs, P and dS rounded to bf16 for their
GEMMs, fp32 accumulation) as the yardstick.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from cute_flash.formats import E4M3_MAX, P_SCALE, hadamard_signs
from cute_flash.reference import attention_ref, default_softmax_scale, visible_mask
from cute_flash.reference_fp8 import attention_fp8_ref, fwht, group_amax, quantize_qkv_ref, rotate

E5M2_MAX = 57344.0

# How an operand is rounded before its GEMM: e4m3 / e5m2 with the tile's (or the head group's)
# amax scale, e4m3 at P's fixed forward scale (``P_SCALE``: P <= 1), bf16, or kept in fp32.
FORMATS = ("e4m3", "e5m2", "e4m3_fixed", "bf16", "fp32")
_FP8 = {"e4m3": (torch.float8_e4m3fn, E4M3_MAX), "e5m2": (torch.float8_e5m2, E5M2_MAX)}


@dataclass(frozen=True)
class Fp8BwdRecipe:
    """The backward's number formats. ``qkv``: "e4m3" (the FP8 forward's saved Q8, K8, V8), "bf16"
    (the bf16 backward's inputs) or "fp32" (exact arithmetic: what checks the algebra); ``p`` /
    ``ds`` / ``do``: ``FORMATS``; ``block_m`` / ``block_n``: the tile (queries, keys) that a tile
    scale covers."""

    qkv: str = "e4m3"
    rotate_qk: bool = True
    rotate_do: bool = False
    p: str = "e4m3"
    ds: str = "e4m3"
    do: str = "e4m3"
    block_m: int = 128
    block_n: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        if self.qkv not in ("e4m3", "bf16", "fp32"):
            raise ValueError(f"qkv: e4m3, bf16 or fp32, got {self.qkv!r}")
        for name in ("p", "ds", "do"):
            allowed = FORMATS + (("e4m3_row",) if name == "do" else ())
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: one of {allowed}, got {getattr(self, name)!r}")
        if self.do == "e4m3_fixed" or self.ds == "e4m3_fixed":
            raise ValueError("e4m3_fixed is P's format only (P <= 1)")
        if self.do == "e4m3_row" and self.p == "e4m3_fixed":
            raise ValueError("with dO's row scales P carries them (P / s exceeds 1): a tile-scaled P")


BF16_RECIPE = Fp8BwdRecipe(qkv="bf16", rotate_qk=False, p="bf16", ds="bf16", do="bf16")


def round_to(x: torch.Tensor, fmt: str, amax: torch.Tensor | None = None) -> torch.Tensor:
    """x rounded through ``fmt`` and back to fp32; ``amax`` (broadcast against x) sets the scale
    of e4m3 / e5m2 (fmt_max / amax: nothing saturates)."""
    x = x.float()
    if fmt == "fp32":
        return x
    if fmt == "bf16":
        return x.bfloat16().float()
    if fmt == "e4m3_fixed":
        return (x * P_SCALE).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() / P_SCALE
    dtype, top = _FP8[fmt]
    scale = top / amax.float().clamp_min(torch.finfo(torch.float32).tiny)
    return (x * scale).clamp(-top, top).to(dtype).float() / scale


def round_tile(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``round_to`` with one scale per (batch, head) tile: x (B, H, rows, cols)."""
    return round_to(x, fmt, x.abs().amax(dim=(-2, -1), keepdim=True) if fmt in _FP8 else None)


def _round_grouped(x: torch.Tensor, fmt: str, hkv: int) -> torch.Tensor:
    """``round_to`` with one scale per (batch, kv head) group of x (B, N, H, d)."""
    if fmt not in _FP8:
        return round_to(x, fmt)
    b, _, h, _ = x.shape
    amax = group_amax(x, hkv).repeat_interleave(h // hkv, dim=1).reshape(b, 1, h, 1)
    return round_to(x, fmt, amax)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, descale): x (..., d) in e4m3 with one scale per row, its amax at 448, and the fp32
    (...) descales, as the FP8 backward's preprocess writes dO: rows below a 1e-30 floor keep
    codes and descale in the floor's units (all-zero rows: codes and descale 0)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    top = amax.clamp_min(1e-30)
    codes = x.float() * (E4M3_MAX / top)
    descale = torch.where(amax > 0, top / E4M3_MAX, 0.0)
    return codes.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), descale.squeeze(-1)


def unrotate(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """x M^T (``rotate``'s inverse: H / sqrt(d) is symmetric and orthogonal)."""
    signs = hadamard_signs(x.shape[-1], seed).to(device=x.device, dtype=x.dtype)
    return fwht(x) * signs


def _saved_inputs(q, k, v, recipe: Fp8BwdRecipe, scale: float, causal: bool):
    """What the forward keeps, dequantized to fp32 (B, N, H, d): (q, k, v, out, lse (B, H, Nq))."""
    if recipe.qkv != "e4m3":
        qs, ks, vs = (round_to(t, recipe.qkv) for t in (q, k, v))
        out, lse = attention_ref(qs, ks, vs, softmax_scale=scale, causal=causal)
        if recipe.rotate_qk:
            qs, ks = rotate(qs, recipe.seed), rotate(ks, recipe.seed)
        return qs, ks, vs, round_to(out, recipe.qkv), lse.float()
    q8, k8, v8, qd, kd, vd = quantize_qkv_ref(q, k, v, rotate_qk=recipe.rotate_qk, seed=recipe.seed)
    out, lse = attention_fp8_ref(q8, k8, v8, qd, kd, vd, softmax_scale=scale, causal=causal)
    h, hkv = q.shape[2], k.shape[2]
    qs = q8.float() * qd.repeat_interleave(h // hkv, dim=1)[:, None, :, None]
    ks, vs = (t.float() * ds[:, None, :, None] for t, ds in ((k8, kd), (v8, vd)))
    return qs, ks, vs, out.to(q.dtype).float(), lse.float()


def attention_fp8_bwd_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                          causal: bool = False, softmax_scale: float | None = None,
                          recipe: Fp8BwdRecipe = Fp8BwdRecipe()) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) in fp32 of attention on q (B, Nq, H, d), k / v (B, Nk, H_kv, d) with gradient
    ``dout`` of its output, computed as ``recipe`` says (module docstring) from the forward's saved
    tensors, which this function forms too (the FP8 forward's, or the bf16 one's)."""
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    qs, ks, vs, out, lse = _saved_inputs(q, k, v, recipe, scale, causal)
    return _grads_from_saved(qs, ks, vs, out, lse, dout, None, v, recipe, scale, causal)


# The FP8 backward kernel's recipe: dO per (token, head) row, P and dS per tile, the kernel's tile.
KERNEL_RECIPE = Fp8BwdRecipe(do="e4m3_row", block_m=64, block_n=128)


def fp8_bwd_from_saved(dout: torch.Tensor, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
                       q_descale: torch.Tensor, k_descale: torch.Tensor, v_descale: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, dlse: torch.Tensor | None = None, *,
                       softmax_scale: float, causal: bool, seed: int,
                       recipe: Fp8BwdRecipe = KERNEL_RECIPE) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) in fp32 from what the ``fp8=True`` forward keeps: e4m3 q8 / k8 (B, N, H, d),
    rotated with ``seed``, v8 (B, N, H_kv, d) in natural order, their (B, H_kv) descales, O and
    the LSE (B, H, Nq); ``dlse``: the LSE's own gradient, or None. dQ / dK rotated back."""
    h, hkv = q8.shape[2], k8.shape[2]
    qs = q8.float() * q_descale.repeat_interleave(h // hkv, dim=1)[:, None, :, None]
    ks, vs = (t.float() * ds[:, None, :, None] for t, ds in ((k8, k_descale), (v8, v_descale)))
    # (The recipe's rotation, with the forward's seed, is what rotates dQ / dK back.)
    recipe = dataclasses.replace(recipe, rotate_qk=True, seed=seed)
    return _grads_from_saved(qs, ks, vs, out.float(), lse.float(), dout, dlse, None, recipe,
                             float(softmax_scale), causal)


def fp8_bwd_from_saved_varlen(dout: torch.Tensor, q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, q_descale: torch.Tensor,
                              k_descale: torch.Tensor, v_descale: torch.Tensor, out: torch.Tensor,
                              lse: torch.Tensor, dlse: torch.Tensor | None = None, *, softmax_scale: float,
                              causal: bool, seed: int, recipe: Fp8BwdRecipe = KERNEL_RECIPE
                              ) -> tuple[torch.Tensor, ...]:
    """``fp8_bwd_from_saved`` on packed sequences, one sequence at a time: q8 / dout / out (T_q, H,
    d), k8 / v8 (T_k, H_kv, d), (S, H_kv) descales, lse / dlse (H, T_q). Gradients packed, fp32."""
    dq = torch.zeros(q8.shape, dtype=torch.float32, device=q8.device)
    dk, dv = (torch.zeros(k8.shape, dtype=torch.float32, device=q8.device) for _ in range(2))
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = cu_q[s:s + 2], cu_k[s:s + 2]
        if q1 == q0 or k1 == k0:
            continue  # no query or no key: every gradient of the sequence is 0
        grads = fp8_bwd_from_saved(
            dout[None, q0:q1], q8[None, q0:q1], k8[None, k0:k1], v8[None, k0:k1], q_descale[s:s + 1],
            k_descale[s:s + 1], v_descale[s:s + 1], out[None, q0:q1], lse[None, :, q0:q1],
            None if dlse is None else dlse[None, :, q0:q1], softmax_scale=softmax_scale, causal=causal,
            seed=seed, recipe=recipe)
        for full, part, (a, b) in zip((dq, dk, dv), grads, ((q0, q1), (k0, k1), (k0, k1)), strict=True):
            full[a:b] = part[0]
    return dq, dk, dv


def _grads_from_saved(qs, ks, vs, out, lse, dout, dlse, v, recipe: Fp8BwdRecipe, scale: float,
                      causal: bool) -> tuple[torch.Tensor, ...]:
    """The recipe's tile loop on the saved tensors (fp32 (B, N, H, d), lse (B, H, Nq)); ``v``: the
    unquantized V, which ``rotate_do`` re-quantizes rotated."""
    b, nq, h, _ = qs.shape
    nk, hkv = ks.shape[1], ks.shape[2]
    do = dout.float()
    delta = (do * out).sum(dim=-1).transpose(1, 2)  # (B, H, Nq): D from the unquantized dO
    if dlse is not None:
        delta = delta - dlse.float()
    vr = v.float() if recipe.rotate_do else None
    if recipe.rotate_do:
        do, vr = rotate(do, recipe.seed), rotate(vr, recipe.seed)
    row_descale = None
    if recipe.do == "e4m3_row":
        # One scale per (token, head) row of dO (its amax, which the preprocess pass reading dO for
        # D takes): it factors out of dP = dO V^T by rows, and out of dV = P^T dO through P.
        do8, row_descale = quantize_rows(do)
        do8, row_descale = do8.float(), row_descale[..., None].transpose(1, 2)  # (B, H, N, 1)
    else:
        do8 = _round_grouped(do, recipe.do, hkv)
    # dP = dO V^T reads V in the format dO has: the forward's V8, or V re-quantized rotated.
    v_dp = _round_grouped(vr, recipe.qkv, hkv) if recipe.rotate_do else vs
    qt, dot = (t.transpose(1, 2) for t in (qs, do8))
    kt, vt, vdp = (t.transpose(1, 2).repeat_interleave(h // hkv, dim=1) for t in (ks, vs, v_dp))
    mask = visible_mask(nq, nk, causal=causal, device=qs.device)
    lse_safe = torch.where(lse == float("-inf"), float("inf"), lse)
    dq, dk = torch.zeros_like(qt), torch.zeros_like(kt)
    dv = torch.zeros(b, h, nk, vt.shape[-1], device=qs.device)
    bm, bn = recipe.block_m, recipe.block_n
    for n0 in range(0, nk, bn):
        n1 = min(n0 + bn, nk)
        for m0 in range(0, nq, bm):
            m1 = min(m0 + bm, nq)
            vis = mask[m0:m1, n0:n1]
            if not vis.any():
                continue
            s = qt[:, :, m0:m1] @ kt[:, :, n0:n1].transpose(-1, -2) * scale
            p = torch.exp(s - lse_safe[:, :, m0:m1, None]).masked_fill(~vis, 0.0)
            rows = 1.0 if row_descale is None else row_descale[:, :, m0:m1]
            dv[:, :, n0:n1] += round_tile(p * rows, recipe.p).transpose(-1, -2) @ dot[:, :, m0:m1]
            dp = (dot[:, :, m0:m1] @ vdp[:, :, n0:n1].transpose(-1, -2)) * rows
            ds = round_tile(p * (dp - delta[:, :, m0:m1, None]), recipe.ds)
            dq[:, :, m0:m1] += scale * (ds @ kt[:, :, n0:n1])
            dk[:, :, n0:n1] += scale * (ds.transpose(-1, -2) @ qt[:, :, m0:m1])
    dq, dk, dv = dq.transpose(1, 2), _sum_groups(dk, hkv), _sum_groups(dv, hkv)
    if recipe.rotate_qk:
        dq, dk = unrotate(dq, recipe.seed), unrotate(dk, recipe.seed)
    if recipe.rotate_do:
        dv = unrotate(dv, recipe.seed)
    return dq, dk, dv


def _sum_groups(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, H, N, d) per query head -> (B, N, H_kv, d), each GQA group summed."""
    b, h, n, d = x.shape
    return x.reshape(b, hkv, h // hkv, n, d).sum(dim=2).transpose(1, 2)


def exact_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                causal: bool = False, softmax_scale: float | None = None) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) in fp64 by autograd through the dense reference."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = attention_ref(q64, k64, v64, softmax_scale=softmax_scale, causal=causal)
    return torch.autograd.grad(out, (q64, k64, v64), dout.double())


RECIPES = {
    "bf16 backward": BF16_RECIPE,
    "fp8": Fp8BwdRecipe(rotate_qk=False),
    "fp8 rotated": Fp8BwdRecipe(),
    "fp8 rotated, dO rotated": Fp8BwdRecipe(rotate_do=True),
    "fp8 rotated, P at fixed scale": Fp8BwdRecipe(p="e4m3_fixed"),
    "fp8 rotated, dS e5m2": Fp8BwdRecipe(ds="e5m2"),
    "fp8 rotated, dO e5m2": Fp8BwdRecipe(do="e5m2"),
}


def fp8_bwd_rmse_table(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, *,
                       causal: bool = False, recipes: dict[str, Fp8BwdRecipe] | None = None,
                       block: tuple[int, int] = (128, 128)) -> dict[str, dict[str, float]]:
    """Per recipe (``RECIPES`` by default), the RMSE of dq, dk, dv against fp64 autograd from the
    same bf16 inputs; "PyTorch bf16 math" is autograd through the dense reference run in bf16 (the
    correctness rule's yardstick)."""
    q, k, v, dout = (t.bfloat16() for t in (q, k, v, dout))
    want = exact_grads(q, k, v, dout, causal=causal)

    def rmse(got) -> dict[str, float]:
        return {g: math.sqrt((a.double() - w).pow(2).mean().item())
                for g, a, w in zip(("dq", "dk", "dv"), got, want, strict=True)}

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, causal=causal, upcast=False)
    table = {"PyTorch bf16 math": rmse(torch.autograd.grad(out, leaves, dout))}
    for name, recipe in (recipes or RECIPES).items():
        recipe = Fp8BwdRecipe(**{**recipe.__dict__, "block_m": block[0], "block_n": block[1]})
        table[name] = rmse(attention_fp8_bwd_ref(q, k, v, dout, causal=causal, recipe=recipe))
    return table
