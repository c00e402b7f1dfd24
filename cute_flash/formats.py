"""Tensor formats shared by the host, the references and the kernels: dtype names, the e4m3
constants of the FP8 forward, the rotation's sign vector and V's token-contiguous storage (the FP8
P V product reads its K operand -- the keys -- K-major).
"""

from __future__ import annotations

import weakref

import torch

# The kernels' 16-bit input types by name (configs and compile keys carry the name).
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# Tables a kernel reads in any float dtype (rotary cos / sin).
FLOAT_NAMES = {**DTYPE_NAMES, torch.float32: "fp32"}
FP8 = torch.float8_e4m3fn
# FP8 head dims: powers of two (the Walsh-Hadamard rotation), d / 32 lanes per row.
FP8_HDIMS = (64, 128, 256)
# Head dims of the FP8 backward (``hopper/bwd_fp8.py``: k32 GEMMs over 64-row query blocks).
FP8_BWD_HDIMS = (64, 128)


def dtype_name(dtype: torch.dtype) -> str:
    """``bf16`` / ``fp16`` for a kernel's 16-bit input type."""
    return DTYPE_NAMES[dtype]


E4M3_MAX = 448.0


# P in [0, 1] is multiplied by this before its e4m3 cast (and O divided by it after P V): e4m3's
# normal range starts at 2^-6, so unscaled the many small probabilities of a long row would round
# as subnormals (2^-9 steps). 256 keeps P <= 448. At d = 128, N = 4k on the outlier inputs it
# takes the rotated error from 9.2e-3 to 8.9e-3 (P unquantized: 8.8e-3).
P_SCALE = 256.0


# ``exp_bytes`` P is 2^8.75 p: its largest code is then 0x7E (448, e4m3's largest), and P flushes
# to zero 0.75 binades lower than with 2^8 (below 2^-7 of the scaled value; at d = 128, N = 4k on
# the outlier inputs: rotated RMSE 1.02e-2 with 2^8, 9.8e-3 with 2^8.75, 9.5e-3 for e4m3-rounded
# exponentials).
EXP_BYTES_LOG2_SCALE = 8.75


def hadamard_signs(d: int, seed: int = 0) -> torch.Tensor:
    """The random +-1 diagonal D (fp32, CPU; the same for every call with this seed)."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2, (d,), generator=gen).float() * 2.0 - 1.0


def v_storage_strides(b: int, n: int, hkv: int, d: int) -> tuple[int, int, int, int]:
    """Strides of the (B, N, H_kv, d) v8 view over (B, H_kv, d, N_pad) storage, N_pad = N rounded
    up to 16 (16-byte rows: the FP8 kernel's TMA)."""
    n_pad = (n + 15) // 16 * 16
    return (hkv * d * n_pad, 1, d * n_pad, n_pad)


def token_contiguous(v8: torch.Tensor) -> torch.Tensor:
    """v8 (B, N, H_kv, d) with the layout the FP8 P V product needs (``v_storage_strides``);
    the padding tokens are zeros."""
    b, n, hkv, d = v8.shape
    if v8.stride() == v_storage_strides(b, n, hkv, d):
        return v8
    n_pad = (n + 15) // 16 * 16
    store = torch.zeros(b, hkv, d, n_pad, dtype=torch.uint8, device=v8.device)
    store[..., :n] = as_bytes(v8).permute(0, 2, 3, 1)
    return store.view(v8.dtype)[..., :n].permute(0, 3, 1, 2)


# The FP8 kernel's own V order (``v_perm``): within every 16 tokens, storage position p holds token
# V_PERM16[p] (bits p0 p1 p2 p3 -> p0 p2 p3 p1). The S accumulator gives lane q of a quad the key
# pairs 2q, 2q + 1 and 2q + 8, 2q + 9 of each 16; the k32 A fragment wants that lane's 4 P bytes
# at positions 4q .. 4q + 3. Stored in this order, V meets P where each lane already holds it,
# and no P bytes cross lanes (``hopper.fwd_fp8``: a byte merge instead of a quad exchange).
V_PERM16 = tuple((p & 1) | ((p >> 2) & 1) << 1 | ((p >> 3) & 1) << 2 | ((p >> 1) & 1) << 3 for p in range(16))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    # Data movement on e4m3 tensors as bytes: gathers and fills are not implemented for float8
    # on every device, for uint8 they are.
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


_ORDER16: dict[tuple, torch.Tensor] = {}


def _gather16(store: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Each 16 tokens of ``store`` (last dim) gathered by V_PERM16 (or its inverse); the index
    tensor is made once per device, not copied to it on every call."""
    key = (store.device, inverse)
    if key not in _ORDER16:
        order = torch.tensor(V_PERM16)
        _ORDER16[key] = (torch.argsort(order) if inverse else order).to(store.device)
    *lead, n_pad = store.shape
    raw = as_bytes(store).reshape(*lead, n_pad // 16, 16).index_select(-1, _ORDER16[key])
    return raw.reshape(store.shape).view(store.dtype)


def permute_v_storage(store: torch.Tensor) -> torch.Tensor:
    """(B, H_kv, d, N_pad) token-contiguous V storage in natural order -> the kernel order."""
    return _gather16(store, inverse=False)


def unpermute_v(store: torch.Tensor, n: int) -> torch.Tensor:
    """Kernel-order (B, H_kv, d, N_pad) storage -> the (B, N, H_kv, d) V it holds."""
    return _gather16(store, inverse=True)[..., :n].permute(0, 3, 1, 2)


def v_kernel_order(v8: torch.Tensor) -> torch.Tensor:
    """v8 (B, N, H_kv, d) -> (B, H_kv, d, N_pad) storage in the kernel order (padding zeros)."""
    b, n, hkv, d = v8.shape
    n_pad = (n + 15) // 16 * 16
    store = torch.zeros(b, hkv, d, n_pad, dtype=torch.uint8, device=v8.device)
    store[..., :n] = as_bytes(v8).permute(0, 2, 3, 1)
    return permute_v_storage(store.view(v8.dtype))


def token_contiguous_varlen(v8: torch.Tensor) -> torch.Tensor:
    """Packed v8 (T, H_kv, d) as a view over token-contiguous (H_kv, d, T_pad) storage, T_pad = T
    rounded up to 16 (the varlen FP8 kernel's V; natural token order, padding zeros)."""
    t, hkv, d = v8.shape
    t_pad = (t + 15) // 16 * 16
    if v8.stride() == (1, d * t_pad, t_pad):
        return v8
    store = torch.zeros(hkv, d, t_pad, dtype=torch.uint8, device=v8.device)
    store[..., :t] = as_bytes(v8).permute(1, 2, 0)
    return store.view(v8.dtype)[..., :t].permute(2, 0, 1)


# cu_seqlens_v already computed, per cu_seqlens_k (weakly held) and its version counter: a model's
# layers share one cu_seqlens, and the 9 small device ops below cost more host time per call than
# the GPU spends on them (the varlen FP8 path is host-bound at 8 x 2k tokens).
# (Computed on the stream of the first call: a later call on another stream relies on the same
# ordering its cu_seqlens_k already needs.)
_CU_V: list[tuple] = []


_CU_V_MAX = 8


def varlen_v_offsets(cu_seqlens_k: torch.Tensor, total: int) -> tuple[torch.Tensor, int]:
    """(cu_seqlens_v int32 (S + 1,), T_v): sequence s's V starts at cu_seqlens_v[s], its length
    rounded up to 16 tokens after the previous one's start; T_v = round16(T) + 16 S bounds the
    last end without reading cu_seqlens on the host. Remembered per tensor (see ``_CU_V``); the
    caller must not write into the result."""
    key = (cu_seqlens_k._version, cu_seqlens_k.device, int(total))
    for ref, k, cu_v in _CU_V:
        if ref() is cu_seqlens_k and k == key:
            return cu_v, (total + 15) // 16 * 16 + 16 * (cu_seqlens_k.shape[0] - 1)
    cu_v, t_v = _varlen_v_offsets(cu_seqlens_k, total)
    # Not while a CUDA graph is captured: the result would live in the graph's private pool.
    if not (cu_seqlens_k.is_cuda and torch.cuda.is_current_stream_capturing()):
        _CU_V.append((weakref.ref(cu_seqlens_k), key, cu_v))
        del _CU_V[:-_CU_V_MAX]
    return cu_v, t_v


def _varlen_v_offsets(cu_seqlens_k: torch.Tensor, total: int) -> tuple[torch.Tensor, int]:
    cu_k = cu_seqlens_k.long()
    num_seqs = cu_k.shape[0] - 1
    cu_v = torch.zeros(num_seqs + 1, dtype=torch.long, device=cu_k.device)
    cu_v[1:] = torch.cumsum((cu_k[1:] - cu_k[:-1] + 15) // 16 * 16, 0)
    return cu_v.to(torch.int32), (total + 15) // 16 * 16 + 16 * num_seqs


def v_varlen_aligned(v8: torch.Tensor, cu_seqlens_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed v8 (T, H_kv, d) -> (its copy as a (T_v, H_kv, d) view over token-contiguous
    (H_kv, d, T_v) storage, cu_seqlens_v int32 (S + 1,)): sequence s starts at cu_seqlens_v[s], a
    multiple of 16, because the varlen FP8 kernel's TMA boxes over V must start 16-byte aligned in
    the contiguous (token) dim. Gaps are zeros; device ops only (no host sync: T_v is a bound)."""
    t, hkv, d = v8.shape
    cu_k = cu_seqlens_k.long()
    cu_v, t_v = varlen_v_offsets(cu_seqlens_k, t)
    tok = torch.arange(t, device=v8.device)
    seq = torch.searchsorted(cu_k[1:], tok, right=True)
    pos = tok - cu_k[seq] + cu_v.long()[seq]
    store = torch.zeros(hkv, d, t_v, dtype=torch.uint8, device=v8.device)
    store.index_copy_(2, pos, as_bytes(v8).permute(1, 2, 0))
    return store.view(v8.dtype).permute(2, 0, 1), cu_v


def v_varlen_packed(v_aligned: torch.Tensor, cu_seqlens_k: torch.Tensor, total: int) -> torch.Tensor:
    """The inverse of ``v_varlen_aligned``: its (T_v, H_kv, d) view -> packed (T, H_kv, d)."""
    cu_k = cu_seqlens_k.long()
    cu_v, _ = varlen_v_offsets(cu_seqlens_k, total)
    tok = torch.arange(total, device=v_aligned.device)
    seq = torch.searchsorted(cu_k[1:], tok, right=True)
    pos = tok - cu_k[seq] + cu_v.long()[seq]
    return as_bytes(v_aligned).index_select(0, pos).view(v_aligned.dtype)
