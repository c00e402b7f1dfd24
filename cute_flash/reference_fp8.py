"""Pure PyTorch references for the FP8 (e4m3) forward with incoherent processing.

``quantize_qkv_ref`` is what the quantize kernel must produce and ``attention_fp8_ref`` what the
FP8 attention kernel computes from its output; ``outlier_qkv`` and ``fp8_rmse_table`` reproduce
the FA3 paper's accuracy experiment (Q, K, V ~ N(0, 1) + N(0, 100) * Bernoulli(0.001)).

Incoherent processing: Q and K are multiplied along the head dim by the same orthogonal matrix
M = D H / sqrt(d) (D a random +-1 diagonal from ``seed``, H the d x d Sylvester-Hadamard matrix),
so (Q M)(K M)^T = Q K^T exactly while an outlier coordinate is spread over all d coordinates --
the amax that sets the e4m3 scale drops, and with it the rounding error of every other value.
V is not rotated (it would have to be rotated back after P V).

Scales follow FA3: one per (batch, kv head) for each of Q (over the query heads of the group), K
and V; ``x8 = sat_e4m3(x * 448 / amax)``, descale = amax / 448, shape (B, H_kv), fp32.
``v8`` keeps the (B, N, H_kv, d) shape but its storage is (B, H_kv, d, N_pad): the sequence dim
is contiguous, as the FP8 P V wgmma needs its K (= keys) operand K-major (``token_contiguous``).
"""

from __future__ import annotations

import math

import torch

from cute_flash.formats import (
    E4M3_MAX,
    EXP_BYTES_LOG2_SCALE,
    P_SCALE,
    as_bytes,
    hadamard_signs,
    token_contiguous,
    unpermute_v,
    v_kernel_order,
)
from cute_flash.reference import attention_ref, visible_mask


def e4m3_byte_values() -> torch.Tensor:
    """fp32 value of every e4m3 byte 0..255 (NaN at 0x7F / 0xFF)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def p_log_bytes(x_log2: torch.Tensor) -> torch.Tensor:
    """The FP8 kernel's ``exp_bytes`` P: for x = log2 of 2^EXP_BYTES_LOG2_SCALE p, the e4m3
    byte round(8 x + 56) clamped at 0, read back as its e4m3 value. Byte 8 e + 56 + j is
    2^e (1 + j / 8), so within a binade the value follows 2^(j / 8) by the chord 1 + j / 8 (at most
    6% above it, the same for P V's products and their row sums); below 2^-7 P flushes to zero
    (subnormal bytes 1..7 hold j 2^-9). -inf (masked) gives byte 0."""
    t = torch.round(x_log2 * 8.0 + 56.0).clamp_min(0.0)
    t = torch.where(torch.isnan(t), torch.zeros_like(t), t)
    return e4m3_byte_values().to(x_log2.device)[t.long().clamp_max(0x7E)]


def hadamard_matrix(d: int) -> torch.Tensor:
    """Sylvester's H_d (entries +-1, H H^T = d I), fp64; d a power of two."""
    if d <= 0 or d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head dim, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def fwht(x: torch.Tensor) -> torch.Tensor:
    """x H / sqrt(d) along the last dim in O(d log d) (butterflies of stride 1, 2, 4, ...: the
    order the kernel's in-thread then cross-lane stages follow)."""
    d = x.shape[-1]
    if d <= 0 or d & (d - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two head dim, got {d}")
    y = x.clone()
    h = 1
    while h < d:
        y = y.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack([a + b, a - b], dim=-2)
        h *= 2
    return y.reshape(x.shape) / math.sqrt(d)


def rotate(x: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """x M with M = D H / sqrt(d) (orthogonal), along the head dim."""
    signs = hadamard_signs(x.shape[-1], seed).to(device=x.device, dtype=x.dtype)
    return fwht(x * signs)


def group_amax(x: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """amax per (batch, kv head) of a (B, N, H, d) tensor whose H heads form num_kv_heads groups."""
    b, n, h, _ = x.shape
    if n == 0:  # an empty (varlen) sequence: nothing to scale, descale 0 as the kernel's
        return x.new_zeros(b, num_kv_heads)
    per_head = x.abs().amax(dim=(1, 3))  # (B, H)
    return per_head.reshape(b, num_kv_heads, h // num_kv_heads).amax(dim=2)


def _quantize(x: torch.Tensor, amax: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    b, _, h, _ = x.shape
    scale = (E4M3_MAX / amax.clamp_min(torch.finfo(torch.float32).tiny))  # (B, Hkv)
    scale = scale.repeat_interleave(h // num_kv_heads, dim=1).reshape(b, 1, h, 1)
    return (x * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def quantize_qkv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rotate_qk: bool = True,
                     seed: int = 0, v_perm: bool = False) -> tuple[torch.Tensor, ...]:
    """(q8, k8, v8, q_descale, k_descale, v_descale) from (B, N, H, d) q and (B, N, H_kv, d) k, v:
    Q and K rotated (``rotate_qk``), per-(batch, kv head) scales, e4m3 with saturation; v8 stored
    sequence-contiguous (module docstring), or with ``v_perm`` the (B, H_kv, d, N_pad) storage in
    the kernel's order (``V_PERM16``). Computed in fp32."""
    hkv = k.shape[2]
    x = [t.float() for t in (q, k, v)]
    if rotate_qk:
        x[0], x[1] = rotate(x[0], seed), rotate(x[1], seed)
    amax = [group_amax(t, hkv) for t in x]
    q8, k8, v8 = (_quantize(t, a, hkv) for t, a in zip(x, amax, strict=True))
    v8 = v_kernel_order(v8) if v_perm else token_contiguous(v8)
    return q8, k8, v8, *(a / E4M3_MAX for a in amax)


def _expand_descale(descale: torch.Tensor, num_heads: int) -> torch.Tensor:
    b, hkv = descale.shape
    return descale.repeat_interleave(num_heads // hkv, dim=1).reshape(b, num_heads, 1, 1)


def attention_fp8_ref(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, q_descale: torch.Tensor,
                      k_descale: torch.Tensor, v_descale: torch.Tensor, *,
                      softmax_scale: float | None = None, causal: bool = False,
                      window_size: tuple[int, int] = (-1, -1), quantize_p: bool = True,
                      v_perm: bool = False, sum_quantized_p: bool = False, exp_bytes: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out fp32 (B, Nq, H, d), lse (B, H, Nq)) of attention on e4m3 inputs as the FP8 kernel
    computes it: S = (q8 k8^T) * q_descale * k_descale in fp32, softmax statistics in fp32, P =
    exp(S - rowmax) * ``P_SCALE`` cast to e4m3 (``quantize_p``), O = (P8 v8) * v_descale /
    (P_SCALE * rowsum) with the row sums of the unquantized P. (The kernel's P uses the running
    max of its online softmax, not the final one; the difference is within e4m3 rounding.)
    ``v_perm``: v8 is kernel-order (B, H_kv, d, N_pad) storage (``quantize_qkv_ref(v_perm=True)``).
    ``sum_quantized_p``: the row sums of the e4m3 P instead (the kernel's ``sum_mma``).
    ``exp_bytes``: P as the kernel's ``exp_bytes`` forms it (``p_log_bytes``, against the row max
    rounded up to 1/8 in log2 units), with its own row sums."""
    b, nq, h, d = q8.shape
    nk, hkv = k8.shape[1], k8.shape[2]
    if v_perm:
        v8 = unpermute_v(v8, nk)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qf = q8.float().permute(0, 2, 1, 3)
    kf = k8.float().permute(0, 2, 1, 3).repeat_interleave(h // hkv, dim=1)
    vf = v8.float().permute(0, 2, 1, 3).repeat_interleave(h // hkv, dim=1)
    s = qf @ kf.transpose(-1, -2) * (_expand_descale(q_descale, h) * _expand_descale(k_descale, h) * scale)
    mask = visible_mask(nq, nk, causal=causal, window_size=window_size, device=s.device)
    s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    if exp_bytes:
        sl2 = s * math.log2(math.e)
        ref = torch.ceil(m * (8.0 * math.log2(math.e))) / 8.0
        p = p_log_bytes(sl2 - ref + EXP_BYTES_LOG2_SCALE) / 2.0 ** EXP_BYTES_LOG2_SCALE
        rowsum = p.sum(dim=-1, keepdim=True)
        o = p @ vf * _expand_descale(v_descale, h) / rowsum.clamp_min(torch.finfo(torch.float32).tiny)
        o = torch.where(rowsum > 0, o, torch.zeros_like(o))
        lse = (ref * math.log(2.0) + rowsum.log()).squeeze(-1)
        return o.permute(0, 2, 1, 3), lse
    p = torch.exp(s - m)
    rowsum = p.sum(dim=-1, keepdim=True)
    if quantize_p:
        p = (p * P_SCALE).to(torch.float8_e4m3fn).float() / P_SCALE
        if sum_quantized_p:
            rowsum = p.sum(dim=-1, keepdim=True)
    o = p @ vf * _expand_descale(v_descale, h) / rowsum.clamp_min(torch.finfo(torch.float32).tiny)
    o = torch.where(rowsum > 0, o, torch.zeros_like(o))
    lse = (m + rowsum.log()).squeeze(-1)
    return o.permute(0, 2, 1, 3), lse


def attention_fp8_varlen_ref(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             cu_seqlens_k: torch.Tensor, q_descale: torch.Tensor, k_descale: torch.Tensor,
                             v_descale: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_fp8_ref`` on packed sequences: q8 (T_q, H, d), k8 / v8 (T_k, H_kv, d) (any
    strides), descales (S, H_kv) -> (out fp32 (T_q, H, d), lse (H, T_q)); sequence s is rows
    cu[s]:cu[s + 1], its masks aligned within it."""
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = torch.zeros(q8.shape, dtype=torch.float32, device=q8.device)
    lse = torch.full((q8.shape[1], q8.shape[0]), float("-inf"), device=q8.device)
    for s in range(len(cu_q) - 1):
        (q0, q1), (k0, k1) = cu_q[s:s + 2], cu_k[s:s + 2]
        if q1 == q0 or k1 == k0:
            continue  # (no key: O = 0, LSE = -inf, as initialised)
        o, l_ = attention_fp8_ref(q8[None, q0:q1], k8[None, k0:k1], v8[None, k0:k1], q_descale[s:s + 1],
                                  k_descale[s:s + 1], v_descale[s:s + 1], **kwargs)
        out[q0:q1], lse[:, q0:q1] = o[0], l_[0]
    return out, lse


def outlier_qkv(b: int, n: int, h: int, d: int, *, seed: int = 0, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """The FA3 paper's inputs: N(0, 1) + N(0, 100) * Bernoulli(0.001), per element, for Q, K, V."""
    gen = torch.Generator(device=device).manual_seed(int(seed))

    def one() -> torch.Tensor:
        base = torch.randn(b, n, h, d, generator=gen, device=device)
        spikes = torch.randn(b, n, h, d, generator=gen, device=device) * 10.0
        keep = torch.rand(b, n, h, d, generator=gen, device=device) < 1e-3
        return (base + spikes * keep).to(dtype)

    return one(), one(), one()


def fp8_rmse_table(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                   seed: int = 0, exp_bytes: bool = False) -> dict[str, float]:
    """RMSE vs an fp64 reference of: bf16 attention (bf16 inputs, bf16 matmuls), FP8 without
    rotation, FP8 with rotation (both through ``attention_fp8_ref``)."""
    ref, _ = attention_ref(q.double(), k.double(), v.double(), causal=causal)

    def rmse(o: torch.Tensor) -> float:
        return (o.double() - ref).pow(2).mean().sqrt().item()

    bf16, _ = attention_ref(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=causal, upcast=False)
    out = {"bf16": rmse(bf16)}
    for name, rot in (("fp8", False), ("fp8_rotated", True)):
        o, _ = attention_fp8_ref(*quantize_qkv_ref(q, k, v, rotate_qk=rot, seed=seed), causal=causal,
                                 exp_bytes=exp_bytes)
        out[name] = rmse(o)
    return out


def quantize_qkv_varlen_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            cu_seqlens_k: torch.Tensor, *, rotate_qk: bool = True,
                            seed: int = 0) -> tuple[torch.Tensor, ...]:
    """``quantize_qkv_ref`` on packed sequences, one call per sequence s (rows cu[s]:cu[s + 1] of
    q (T_q, H, d) and of k, v (T_k, H_kv, d)), laid out as ``launch.quantize_qkv_varlen`` returns
    it: q8 (T_q, H, d), k8 (T_k, H_kv, d) contiguous; v8 (T_k, H_kv, d) over token-contiguous
    (H_kv, d, T_k_pad) storage, natural order, padding zeros; descales (S, H_kv) fp32. An empty
    sequence quantizes as one zero token: amax 0, descale 0 (the kernel's untouched amax)."""
    tq, h, d = q.shape
    tk, hkv, _ = k.shape
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    num_seqs = len(cu_q) - 1
    q8 = torch.zeros(tq, h, d, dtype=torch.uint8, device=q.device)
    k8 = torch.zeros(tk, hkv, d, dtype=torch.uint8, device=q.device)
    v_store = torch.zeros(hkv, d, (tk + 15) // 16 * 16, dtype=torch.uint8, device=q.device)
    descales = [torch.zeros(num_seqs, hkv, dtype=torch.float32, device=q.device) for _ in range(3)]
    for s in range(num_seqs):
        (q0, q1), (k0, k1) = cu_q[s:s + 2], cu_k[s:s + 2]
        qs = q[None, q0:q1] if q1 > q0 else q.new_zeros(1, 1, h, d)
        ks, vs = (t[None, k0:k1] if k1 > k0 else t.new_zeros(1, 1, hkv, d) for t in (k, v))
        q8s, k8s, v8s, *ds = quantize_qkv_ref(qs, ks, vs, rotate_qk=rotate_qk, seed=seed)
        q8[q0:q1] = as_bytes(q8s[0, :q1 - q0])
        k8[k0:k1] = as_bytes(k8s[0, :k1 - k0])
        v_store[..., k0:k1] = as_bytes(v8s[0, :k1 - k0]).permute(1, 2, 0)
        for out, ds_s in zip(descales, ds, strict=True):
            out[s] = ds_s[0]
    f8 = torch.float8_e4m3fn
    return q8.view(f8), k8.view(f8), v_store.view(f8)[..., :tk].permute(2, 0, 1), *descales
