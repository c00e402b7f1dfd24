"""Quantize-and-rotate for the FP8 forward (issue 5): kernel configs and the torch-side launcher of
``cute_flash.hopper.quant``; ``cute_flash.fp8_ref.quantize_qkv_ref`` is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import torch

from cute_flash import jit
from cute_flash.fp8_ops import FP8_HDIMS as QUANT_HDIMS  # powers of two (Walsh-Hadamard), d / 32 lanes
from cute_flash.fp8_ops import check_heads
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

    def build(self):
        from cute_flash.hopper.quant import QuantizeSm90

        return QuantizeSm90(self)

    def fake_args(self) -> tuple:
        dt = jit.DTYPES[self.dtype]
        b, n, h, hkv, d = jit.sym(), jit.sym(), jit.sym(), jit.sym(), self.hdim
        x = jit.fake_tensor(dt, (b, n, h, d), divisibility=jit.vec_div(dt))
        signs = jit.fake_tensor(cutlass.Float32, (d,))
        amax = jit.fake_tensor(cutlass.Float32, (b, hkv))
        if self.transpose:
            # (B, H_kv, d, N_pad) storage, N_pad a multiple of 16 (16-byte rows for the stores
            # here and for the attention kernel's TMA).
            out = jit.fake_tensor(cutlass.Float8E4M3FN, (b, h, d, jit.sym()), leading_dim=3, divisibility=16)
        else:
            out = jit.fake_tensor(cutlass.Float8E4M3FN, (b, n, h, d), divisibility=16)
        return x, signs, amax, out, jit.fake_stream()


def quant_configs(dtype: str, hdim: int, rotate: bool, v_perm: bool = False) -> list[QuantizeConfig]:
    """Every kernel ``quantize_qkv`` launches: amax and quant phases for Q / K and for V."""
    return [QuantizeConfig(target=None, dtype=dtype, hdim=hdim, rotate=rot, transpose=tr, phase=ph,
                           v_perm=v_perm and tr and ph == "quant")
            for rot, tr in ((rotate, False), (False, True)) for ph in ("amax", "quant")]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor")
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{name}: bf16 or fp16 input expected, got {t.dtype}")
        if t.dim() != 4 or not t.is_cuda:
            raise ValueError(f"{name}: a (B, N, H, d) CUDA tensor expected, got {tuple(t.shape)} on "
                             f"{t.device}")
        if t.stride(-1) != 1 or any(s % 8 for s in t.stride()[:-1]):
            raise ValueError(f"{name}: the head dim must be contiguous and rows 16-byte aligned")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise TypeError("q, k, v must share a dtype")
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
        qk_amax(x, signs, amax[i], out)
    v_amax(v, signs, amax[2], v_store)
    for i, (x, out) in enumerate(((q, q8), (k, k8))):
        qk_quant(x, signs, amax[i], out)
    v_quant(v, signs, amax[2], v_store)
    v8 = v_store if v_perm else v_store[..., :nk].permute(0, 3, 1, 2)
    return q8, k8, v8, *(a.div_(E4M3_MAX) for a in amax)
