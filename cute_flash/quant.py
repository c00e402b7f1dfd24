"""Quantize-and-rotate for the FP8 forward (issue 5): kernel configs and the torch-side launchers of
``cute_flash.hopper.quant``, dense (``quantize_qkv``) and packed (``quantize_qkv_varlen``);
``cute_flash.fp8_ref.quantize_qkv_ref`` / ``quantize_qkv_varlen_ref`` are the references.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import torch

from cute_flash import jit, validate
from cute_flash.fp8_ops import FP8_HDIMS as QUANT_HDIMS  # powers of two (Walsh-Hadamard), d / 32 lanes
from cute_flash.fp8_ops import check_heads, check_heads_varlen
from cute_flash.fp8_ref import E4M3_MAX, hadamard_signs


@dataclass(frozen=True)
class QuantizeConfig(jit.KernelConfig):
    """One phase (``amax`` or ``quant``) of quantizing one of Q, K (``rotate``) or V
    (``transpose``: sequence-contiguous output), ``rows`` tokens of one head per CTA."""

    dtype: str = "bf16"
    hdim: int = 128
    rotate: bool = True
    transpose: bool = False
    phase: str = "quant"
    rows: int = 64
    # With ``transpose``: tokens stored in the FP8 kernel's order (``fp8_ref.V_PERM16``).
    v_perm: bool = False
    # Packed (T, H, d) input with cu_seqlens; scales per (sequence, kv head).
    varlen: bool = False
    # Varlen V: each sequence written from its own 16-aligned start (``fp8_ref.varlen_v_offsets``,
    # the varlen FP8 kernel's V layout) instead of at its cu_seqlens offset.
    v_aligned: bool = False
    # Lanes per row (``hopper.quant``): 32, or 4 / 8 / 16 for Q and K -- a warp then rotates 32 / L
    # rows at once with fewer shuffle rounds. Needs ``rows`` a multiple of 16 * 32 / L.
    lanes_per_row: int = 32

    kernel_name = "quantize"

    def __post_init__(self) -> None:
        if self.hdim not in QUANT_HDIMS:
            raise ValueError(f"quantize: head dim {self.hdim} not in {QUANT_HDIMS}")
        if self.phase not in ("amax", "quant"):
            raise ValueError(f"quantize: phase must be amax or quant, got {self.phase!r}")
        if self.rotate and self.transpose:
            raise ValueError("quantize: V (the transposed output) is not rotated")
        if self.v_perm and not (self.transpose and self.phase == "quant"):
            raise ValueError("quantize: v_perm orders the transposed V output")
        relayout_only = self.transpose and self.phase == "quant" and not self.rotate
        if self.v_aligned and not (self.varlen and self.transpose and self.phase == "quant"):
            raise ValueError("quantize: v_aligned places packed V (varlen, transposed quant phase)")
        if self.dtype == "e4m3" and not relayout_only:
            raise ValueError("quantize: e4m3 input only re-lays V out (transpose, quant phase)")
        if self.lanes_per_row not in (4, 8, 16, 32) or self.hdim // self.lanes_per_row < 2:
            raise ValueError(f"quantize: lanes_per_row must be 4, 8, 16 or 32 (at most d / 2), got "
                             f"{self.lanes_per_row}")
        if self.lanes_per_row != 32 and self.transpose:
            raise ValueError("quantize: V (transposed through smem) takes a whole warp per row")
        if self.rows % (16 * 32 // self.lanes_per_row):
            raise ValueError(f"quantize: rows must be a multiple of {16 * 32 // self.lanes_per_row} "
                             f"with {self.lanes_per_row} lanes per row")
        if self.v_perm and self.varlen:
            # The kernel order permutes each 16-token chunk, and packed chunks straddle sequences.
            raise ValueError("quantize: v_perm is not supported with varlen (packed) inputs")

    def build(self):
        from cute_flash.hopper.quant import QuantizeSm90

        return QuantizeSm90(self)

    def fake_args(self) -> tuple:
        """(x, signs, amax, out, cu_seqlens, max_seqlen, cu_seqlens_out, stream); dense: both
        cu_seqlens None; cu_seqlens_out only with ``v_aligned``."""
        dt = cutlass.Float8E4M3FN if self.dtype == "e4m3" else jit.DTYPES[self.dtype]
        h, hkv, d = jit.sym(), jit.sym(), self.hdim
        signs = jit.fake_tensor(cutlass.Float32, (d,))
        if self.varlen:
            t, s1 = jit.sym(), jit.sym()
            x = jit.fake_tensor(dt, (t, h, d), divisibility=jit.vec_div(dt))
            amax = jit.fake_tensor(cutlass.Float32, (jit.sym(), hkv))
            cu = jit.fake_tensor(cutlass.Int32, (s1,), leading_dim=0)
            if self.transpose:
                # (H_kv, d, T_pad) storage, T_pad a multiple of 16 (as the dense N_pad).
                out = jit.fake_tensor(cutlass.Float8E4M3FN, (h, d, jit.sym()), leading_dim=2, divisibility=16)
            else:
                out = jit.fake_tensor(cutlass.Float8E4M3FN, (t, h, d), divisibility=16)
            cu_out = jit.fake_tensor(cutlass.Int32, (s1,), leading_dim=0) if self.v_aligned else None
            return x, signs, amax, out, cu, cutlass.Int32(0), cu_out, jit.fake_stream()
        b, n = jit.sym(), jit.sym()
        x = jit.fake_tensor(dt, (b, n, h, d), divisibility=jit.vec_div(dt))
        amax = jit.fake_tensor(cutlass.Float32, (b, hkv))
        if self.transpose:
            # (B, H_kv, d, N_pad) storage, N_pad a multiple of 16 (16-byte rows for the stores
            # here and for the attention kernel's TMA).
            out = jit.fake_tensor(cutlass.Float8E4M3FN, (b, h, d, jit.sym()), leading_dim=3, divisibility=16)
        else:
            out = jit.fake_tensor(cutlass.Float8E4M3FN, (b, n, h, d), divisibility=16)
        return x, signs, amax, out, None, cutlass.Int32(0), None, jit.fake_stream()


# Q / K lanes per row (``QuantizeConfig.lanes_per_row``) by head dim. Measured on the H200 (session 9,
# ``scripts/bench_fp8.py``, whole quantize of Q, K, V at 2k-16k tokens): d = 128 with 8 lanes per row
# 234-240 -> 201-207 us (the whole-warp row is bound by its 20 shuffles per row, 8 lanes need 12),
# d = 64 272 -> 236 us;
# d = 256 with 8 / 16 lanes 242 -> 257 / 247 us (its rows are long enough that the whole warp is
# bandwidth-bound, and 8 lanes per row hold 32 values per lane). Head dims not listed keep the
# whole warp per row until measured. ``QK_LANES_PER_ROW`` (an int) overrides the table, for the
# benchmarks and the GPU tests.
QK_LANES_BY_HDIM = {64: 8, 128: 8}
QK_LANES_PER_ROW: int | None = None


def qk_lanes_per_row(hdim: int) -> int:
    """Q / K lanes per row the quantize launches use at this head dim."""
    if QK_LANES_PER_ROW is not None:
        return QK_LANES_PER_ROW
    return QK_LANES_BY_HDIM.get(hdim, 32)


def quant_configs(dtype: str, hdim: int, rotate: bool, v_perm: bool = False,
                  varlen: bool = False, v_aligned: bool = False,
                  qk_lanes: int | None = None) -> list[QuantizeConfig]:
    """Every kernel ``quantize_qkv`` (``varlen``: ``quantize_qkv_varlen``) launches: amax and quant
    phases for Q / K and for V (``qk_lanes``: Q / K's lanes per row, None = ``qk_lanes_per_row``)."""
    lanes = qk_lanes_per_row(hdim) if qk_lanes is None else qk_lanes
    rows = max(64, 16 * 32 // lanes)
    return [QuantizeConfig(target=None, dtype=dtype, hdim=hdim, rotate=rot, transpose=tr, phase=ph,
                           v_perm=v_perm and tr and ph == "quant", varlen=varlen,
                           v_aligned=v_aligned and tr and ph == "quant",
                           **({} if tr or lanes == 32 else dict(lanes_per_row=lanes, rows=rows)))
            for rot, tr in ((rotate, False), (False, True)) for ph in ("amax", "quant")]


def _check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, shape: str) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor")
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{name}: bf16 or fp16 input expected, got {t.dtype}")
        if t.dim() != rank or not t.is_cuda:
            raise ValueError(f"{name}: a {shape} CUDA tensor expected, got {tuple(t.shape)} on "
                             f"{t.device}")
        if t.stride(-1) != 1 or any(s % 8 for s in t.stride()[:-1]):
            raise ValueError(f"{name}: the head dim must be contiguous and rows 16-byte aligned")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise TypeError("q, k, v must share a dtype")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check_tensors(q, k, v, 4, "(B, N, H, d)")
    check_heads(q, k, v)


_SIGNS: dict[tuple, torch.Tensor] = {}


def _signs(d: int, seed: int, device: torch.device) -> torch.Tensor:
    """The rotation's +-1 diagonal on the device, made once per (d, seed, device) rather than
    drawn and copied on every call."""
    key = (d, int(seed), device)
    if key not in _SIGNS:
        _SIGNS[key] = hadamard_signs(d, seed).to(device)
    return _SIGNS[key]


def quantize_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotate: bool = True,
                 seed: int = 0, v_perm: bool = False) -> tuple[torch.Tensor, ...]:
    """(q8, k8, v8, q_descale, k_descale, v_descale), as ``fp8_ref.quantize_qkv_ref``: Q and K
    rotated by D H / sqrt(d) (``rotate``), e4m3 with per-(batch, kv head) scales, v8 of shape
    (B, N, H_kv, d) over sequence-contiguous (B, H_kv, d, N_pad) storage (padding zeroed), or
    with ``v_perm`` that storage itself, tokens in the FP8 kernel's order."""
    _check(q, k, v)
    dtype = "bf16" if q.dtype == torch.bfloat16 else "fp16"
    b, _, _, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    # Three separate buffers, not one (3, B, H_kv): the descales are returned, and outputs of a
    # custom op must not alias one another.
    amax = [torch.zeros(b, hkv, device=q.device, dtype=torch.float32) for _ in range(3)]
    signs = _signs(d, seed, q.device)
    f8 = torch.float8_e4m3fn
    q8, k8 = torch.empty_like(q, dtype=f8), torch.empty_like(k, dtype=f8)
    v_store = torch.empty(b, hkv, d, (nk + 15) // 16 * 16, device=q.device, dtype=f8)
    cfgs = quant_configs(dtype, d, rotate, v_perm)
    qk_amax, qk_quant, v_amax, v_quant = (jit.compile_kernel(c) for c in cfgs)
    for i, (x, out) in enumerate(((q, q8), (k, k8))):
        qk_amax(x, signs, amax[i], out, None, 0, None)
    v_amax(v, signs, amax[2], v_store, None, 0, None)
    for i, (x, out) in enumerate(((q, q8), (k, k8))):
        qk_quant(x, signs, amax[i], out, None, 0, None)
    v_quant(v, signs, amax[2], v_store, None, 0, None)
    v8 = v_store if v_perm else v_store[..., :nk].permute(0, 3, 1, 2)
    return q8, k8, v8, *(a.div_(E4M3_MAX) for a in amax)


def _check_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int) -> int:
    """Everything but the cu_seqlens values (reading them is a host sync: the op checks them,
    ``fp8_ops.check_cu_data``); returns the number of sequences."""
    _check_tensors(q, k, v, 3, "packed (T, H, d)")
    check_heads_varlen(q, k, v)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {cu.device}")
    validate.check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                              max_seqlen_k, check_data=False)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs > 65535:
        raise ValueError(f"quantize: at most 65535 sequences (the grid's z extent), got {num_seqs}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"{name} must be a non-negative int, got {m!r}")
    return num_seqs


def quantize_qkv_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                        cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                        rotate: bool = True, seed: int = 0, v_aligned: bool = False
                        ) -> tuple[torch.Tensor, ...]:
    """``quantize_qkv`` on packed sequences, as ``fp8_ref.quantize_qkv_varlen_ref``: q (T_q, H, d),
    k, v (T_k, H_kv, d); sequence s is rows cu[s]:cu[s + 1] (int32 cu_seqlens, S + 1 entries,
    starting at 0, ending at T; ``max_seqlen_*`` at least the longest sequence -- not checked
    here, the op does it). Returns q8 (T_q, H, d), k8 (T_k, H_kv, d) contiguous e4m3, v8 a
    (T_k, H_kv, d) view over token-contiguous (H_kv, d, T_k_pad) storage (natural order, padding
    zeroed), and fp32 (S, H_kv) descales, one scale per (sequence, kv head). ``v_aligned``: v8 is
    instead ``fp8_ref.v_varlen_aligned``'s (T_v, H_kv, d) view, every sequence from a 16-aligned
    start -- the varlen FP8 kernel's V, written once instead of re-laid after."""
    num_seqs = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    dtype = "bf16" if q.dtype == torch.bfloat16 else "fp16"
    d = q.shape[2]
    tk, hkv = k.shape[0], k.shape[1]
    amax = [torch.zeros(num_seqs, hkv, device=q.device, dtype=torch.float32) for _ in range(3)]
    signs = _signs(d, seed, q.device)
    f8 = torch.float8_e4m3fn
    q8 = torch.empty(q.shape, device=q.device, dtype=f8)
    k8 = torch.empty(k.shape, device=q.device, dtype=f8)
    cu_v = None
    if v_aligned:
        from cute_flash.fp8_ref import varlen_v_offsets

        cu_v, t_v = varlen_v_offsets(cu_seqlens_k, tk)
        # Zeroed: the slack past the last sequence's chunks (T_v is a bound) is not written.
        v_store = torch.zeros(hkv, d, t_v, device=q.device, dtype=f8)
    else:
        # Not zeroed: every byte, the padding tokens T_k .. T_k_pad - 1 included, is written by
        # the kernel (the CTA holding the last token writes the padding).
        v_store = torch.empty(hkv, d, (tk + 15) // 16 * 16, device=q.device, dtype=f8)
    cfgs = quant_configs(dtype, d, rotate, varlen=True, v_aligned=v_aligned)
    qk_amax, qk_quant, v_amax, v_quant = (jit.compile_kernel(c) for c in cfgs)
    q_args = (q, q8, amax[0], cu_seqlens_q, max_seqlen_q, None)
    k_args = (k, k8, amax[1], cu_seqlens_k, max_seqlen_k, None)
    v_args = (v, v_store, amax[2], cu_seqlens_k, max_seqlen_k, None)
    runs = ((qk_amax, q_args), (qk_amax, k_args), (v_amax, v_args),
            (qk_quant, q_args), (qk_quant, k_args), (v_quant, v_args[:-1] + (cu_v,)))
    for fn, (x, out, a, cu, max_seqlen, cu_out) in runs:
        # A grid with no CTAs is no launch: with no (non-empty) sequence, nothing runs and the
        # descales stay 0.
        if num_seqs and max_seqlen:
            fn(x, signs, a, out, cu, max_seqlen, cu_out)
    v8 = (v_store if v_aligned else v_store[..., :tk]).permute(2, 0, 1)
    return q8, k8, v8, *(a.div_(E4M3_MAX) for a in amax)


def relayout_v(v8: torch.Tensor, v_perm: bool = True) -> torch.Tensor:
    """A caller's e4m3 V (B, N, H_kv, d) -> the (B, H_kv, d, N_pad) token-contiguous storage the
    FP8 P V product reads (``v_perm``: in the kernel's token order, ``fp8_ref.v_kernel_order``;
    else natural), bit for bit, padding zeros: the V quantize kernel with scale 1 (e4m3 -> fp32
    -> e4m3 is exact), whose smem transpose writes 16 tokens per store -- a torch byte permute
    of the same tensor runs at ~90 GB/s (one 32-byte sector per byte read)."""
    if v8.dtype != torch.float8_e4m3fn or v8.dim() != 4 or not v8.is_cuda:
        raise ValueError(f"relayout_v: a (B, N, H_kv, d) e4m3 CUDA tensor expected, got {v8.dtype} "
                         f"{tuple(v8.shape)} on {v8.device}")
    b, nk, hkv, d = v8.shape
    if d not in QUANT_HDIMS:
        raise ValueError(f"relayout_v: head dim {d} not in {QUANT_HDIMS}")
    if v8.stride(-1) != 1 or any(st % 16 for st in v8.stride()[:-1]):
        v8 = v8.contiguous()  # 16-byte rows for the kernel's vector loads
    store = torch.empty(b, hkv, d, (nk + 15) // 16 * 16, device=v8.device, dtype=v8.dtype)
    unit = torch.full((b, hkv), E4M3_MAX, device=v8.device, dtype=torch.float32)
    cfg = QuantizeConfig(target=None, dtype="e4m3", hdim=d, rotate=False, transpose=True, phase="quant",
                         v_perm=v_perm)
    jit.compile_kernel(cfg)(v8, _signs(d, 0, v8.device), unit, store, None, 0, None)
    return store


def relayout_v_varlen(v8: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_k: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_ref.v_varlen_aligned`` by the V quantize kernel at scale 1 (e4m3 in, 16-byte
    stores): a caller's packed e4m3 V (T, H_kv, d) -> (a (T_v, H_kv, d) view over token-contiguous
    (H_kv, d, T_v) storage with every sequence 16-aligned, cu_seqlens_v). cu_seqlens_k must have
    been checked (``fp8_ops.check_cu_data``)."""
    from cute_flash.fp8_ref import varlen_v_offsets

    if v8.dtype != torch.float8_e4m3fn or v8.dim() != 3 or not v8.is_cuda:
        raise ValueError(f"relayout_v_varlen: a (T, H_kv, d) e4m3 CUDA tensor expected, got {v8.dtype} "
                         f"{tuple(v8.shape)} on {v8.device}")
    t, hkv, d = v8.shape
    if d not in QUANT_HDIMS:
        raise ValueError(f"relayout_v_varlen: head dim {d} not in {QUANT_HDIMS}")
    if v8.stride(-1) != 1 or any(st % 16 for st in v8.stride()[:-1]):
        v8 = v8.contiguous()
    cu_v, t_v = varlen_v_offsets(cu_seqlens_k, t)
    # Zeroed: the kernel writes every sequence's chunks whole, but not the slack past the last one
    # (T_v is a bound, no host sync), which the attention kernel's last V box may read.
    store = torch.zeros(hkv, d, t_v, device=v8.device, dtype=v8.dtype)
    num_seqs = cu_seqlens_k.shape[0] - 1
    if num_seqs and max_seqlen_k and t:
        unit = torch.full((num_seqs, hkv), E4M3_MAX, device=v8.device, dtype=torch.float32)
        cfg = QuantizeConfig(target=None, dtype="e4m3", hdim=d, rotate=False, transpose=True, phase="quant",
                             varlen=True, v_aligned=True)
        jit.compile_kernel(cfg)(v8, _signs(d, 0, v8.device), unit, store, cu_seqlens_k, max_seqlen_k, cu_v)
    return store.permute(2, 0, 1), cu_v
