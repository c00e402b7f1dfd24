"""Input checks run before any kernel launch.

A kernel handed a wrong shape, stride or pointer does not fail loudly: it reads out of bounds or
silently skips tokens. Everything the kernels assume is therefore checked here, and every message
says what was expected and what was got. Wrong types and dtypes raise ``TypeError``; wrong
devices, shapes, strides, alignment and argument values raise ``ValueError``.

The same contract is enforced on every device: the CPU implementation of the ops (the reference)
accepts exactly what the CUDA kernels accept, so CPU tests of these checks hold for the GPU.

The layout rules are the union of what both forward families need: the sm80 kernels' 16-byte
vector loads, and the TMA (tensor memory accelerator) descriptors of the sm90 forward, which take a
16-byte aligned base address, a unit-stride last dim and the other strides 16-byte multiples below
2^40 bytes. Strides of extent-1 dims are never used to address anything and are ignored here; the
launchers hand the kernels stride 0 for those when theirs would break a rule (``ops._kernel_view``).

Checks on tensor *metadata* run on fake tensors too (``torch.compile`` tracing); checks that read
*data* (pointer alignment, cu_seqlens values) need real tensors and are switched by
``check_data``.
"""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Sequence

import torch

from cute_flash.formats import FP8, FP8_BWD_HDIMS, FP8_HDIMS
from cute_flash.memo import HostMemo

SUPPORTED_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# The sm80 kernels move rows with 16-byte vector loads, and TMA (the sm90 forward) takes only
# 16-byte aligned base addresses and strides: every row has to start 16-byte aligned.
ALIGN_BYTES = 16
# A TMA descriptor holds each stride in bytes in fewer than 40 bits.
TMA_MAX_STRIDE_BYTES = 2**40
# Compiled kernels take every extent as an int32 (the call boundary rejects larger ones).
MAX_EXTENT = 2**31 - 1
_DEVICE_TYPES = ("cuda", "cpu", "meta")  # meta: shape inference only (the fake implementations)


def _fmt_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _require_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def check_same_device(tensors: dict[str, torch.Tensor]) -> None:
    """All tensors on one device, and a device cute_flash runs on."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items:
        if t.device.type not in _DEVICE_TYPES:
            raise ValueError(f"{name} is on device {t.device}; cute_flash runs on CUDA "
                             f"(and on the CPU through its PyTorch reference)")
        if t.device != first.device:
            raise ValueError(f"all tensors must be on the same device: {first_name} is on {first.device}, "
                             f"{name} is on {t.device}")


def check_dtypes(tensors: dict[str, torch.Tensor]) -> None:
    """fp16/bf16 only, and the same dtype for all."""
    items = list(tensors.items())
    first_name, first = items[0]
    if first.dtype not in KERNEL_DTYPES:
        raise TypeError(f"{first_name} must be float16 or bfloat16, got {_fmt_dtype(first.dtype)}")
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name} must have the same dtype as {first_name} ({_fmt_dtype(first.dtype)}), "
                            f"got {_fmt_dtype(t.dtype)}")


def check_layout(name: str, t: torch.Tensor, *, check_data: bool = True) -> None:
    """Unit stride in the last dim, the other strides multiples of 16 bytes and below 2^40 bytes
    (TMA), a 16-byte aligned start, int32 extents. Strides of dims of extent <= 1 are never used
    to address anything and are ignored."""
    if t.dim() == 0:
        raise ValueError(f"{name} must not be a scalar")
    for dim, n in enumerate(t.shape):
        if n > MAX_EXTENT:
            raise ValueError(f"{name}.shape[{dim}] = {n} is too large: the kernels take extents up to "
                             f"2^31 - 1, got shape {tuple(t.shape)}")
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride(-1) == 1), "
                         f"got strides {tuple(t.stride())}")
    elem = t.element_size()
    vec = max(ALIGN_BYTES // elem, 1)
    for dim in range(t.dim() - 1):
        if t.shape[dim] <= 1:
            continue
        if t.stride(dim) % vec != 0:
            raise ValueError(f"{name}.stride({dim}) must be a multiple of {vec} elements "
                             f"({ALIGN_BYTES} bytes) for vector loads and TMA, got strides "
                             f"{tuple(t.stride())}")
        if t.stride(dim) * elem >= TMA_MAX_STRIDE_BYTES:
            raise ValueError(f"{name}.stride({dim}) must be below 2^40 bytes (a TMA descriptor's "
                             f"limit), got strides {tuple(t.stride())}")
    if check_data:
        _check_aligned(name, t)


def _check_aligned(name: str, t: torch.Tensor) -> None:
    if t.device.type != "meta" and t.numel() > 0 and t.data_ptr() % ALIGN_BYTES != 0:
        raise ValueError(f"{name} must start at a {ALIGN_BYTES}-byte aligned address, got data_ptr "
                         f"{t.data_ptr():#x} (a view at an unaligned offset? try .clone())")


# Metadata checks already passed, by every tensor's (shape, strides, dtype, device) and the
# scalars with their types: a training loop calls with the same metadata every step, and the
# checks in Python cost ~40-60 us of host time per call (a backward at N = 2k runs in ~0.5 ms
# on the GPU). A repeat runs only the checks that read data (alignment, cu_seqlens values).
_META_PASSED = HostMemo(1024)


def _meta_key(kind: str, tensors: Sequence[object], scalars: Sequence[object]) -> tuple | None:
    """The cache key, or None where the checks must run in full: tensor subclasses (fake or
    functional tensors while tracing), non-tensors, unhashable or symbolic scalars."""
    parts: list = [kind]
    try:
        for t in tensors:
            if t is None:
                parts.append(None)
            elif type(t) is torch.Tensor and t.layout == torch.strided:
                parts.append((t.shape, t.stride(), t.dtype, t.device))
            else:
                return None
        # (type, value) pairs: True == 1 and 1.0 == 1, but the checks tell them apart.
        for x in scalars:
            parts.append(tuple((type(y), y) for y in x) if isinstance(x, (list, tuple)) else (type(x), x))
        key = tuple(parts)
        hash(key)
    except (TypeError, RuntimeError):
        return None
    return key


def _meta_passed(key: tuple | None) -> bool:
    return key is not None and key in _META_PASSED


def _remember(key: tuple | None) -> None:
    if key is None:
        return
    _META_PASSED.put(key)


def _as_float(x: object) -> float | None:
    if isinstance(x, (bool, torch.Tensor)):
        return None
    try:
        return float(x)  # int, float, numpy scalars, SymFloat while tracing
    except (TypeError, ValueError):
        return None


def check_scalars(*, softmax_scale: float, window_size: Sequence[int], softcap: float) -> None:
    # Chained comparisons rather than math.isfinite: they also reject NaN, and they stay
    # traceable when torch.compile turns the float into a symbolic one.
    scale = _as_float(softmax_scale)
    if scale is None or not (0 < scale < math.inf):
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale!r}")
    if not isinstance(window_size, Sequence) or len(window_size) != 2:
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    for side, w in zip(("left", "right"), window_size, strict=True):
        try:
            w_int = operator.index(w)  # ints and numpy ints; not floats
        except TypeError:
            raise ValueError(f"window_size {side} must be an int, got {w!r}") from None
        if isinstance(w, bool):
            raise ValueError(f"window_size {side} must be an int, got {w!r}")
        if w_int < -1:
            raise ValueError(f"window_size {side} must be >= -1 (-1 = unbounded), got {w_int}")
    cap = _as_float(softcap)
    if cap is None or not (0 <= cap < math.inf):
        raise ValueError(f"softcap must be a finite number >= 0 (0 = off), got {softcap!r}")


def check_call(tensors: dict[str, object], flags: dict[str, object]) -> None:
    """What the public functions check before anything else (the default scale divides by the
    head dim): tensors are tensors with a non-empty last dim, and the switches are bools."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if name in ("q", "k", "v") and (t.dim() == 0 or t.shape[-1] == 0):
            raise ValueError(f"{name} needs a head dim (its last dim) in {SUPPORTED_HEAD_DIMS}, got shape "
                             f"{tuple(t.shape)}")
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")


def _check_qkv_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, varlen: bool) -> None:
    rank = 3 if varlen else 4
    layout = "(total, H, d)" if varlen else "(B, N, H, d)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")
    if not varlen and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"q, k, v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, "
                         f"{v.shape[0]}")
    if k.shape[-3] != v.shape[-3]:
        raise ValueError(f"k and v must have the same number of {'tokens' if varlen else 'keys'}, "
                         f"got k {tuple(k.shape)} and v {tuple(v.shape)}")
    h, hkv = q.shape[-2], k.shape[-2]
    if v.shape[-2] != hkv:
        raise ValueError(f"k and v must have the same number of heads, got {hkv} and {v.shape[-2]}")
    if h < 1 or hkv < 1 or h % hkv != 0:
        raise ValueError(f"q heads must be a positive multiple of k/v heads (GQA/MQA), got {h} q heads "
                         f"and {hkv} k/v heads")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
    for name, d in (("q/k", q.shape[-1]), ("v", v.shape[-1])):
        if d not in SUPPORTED_HEAD_DIMS:
            supported = ", ".join(map(str, SUPPORTED_HEAD_DIMS))
            raise ValueError(f"unsupported {name} head dim {d}; supported: {supported}")


def _check_cu_seqlens_meta(cu_q: torch.Tensor, cu_k: torch.Tensor) -> None:
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {_fmt_dtype(cu.dtype)}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D of length batch+1 >= 1, got shape {tuple(cu.shape)}")
        if cu.shape[0] > 1 and cu.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {cu.stride(0)}")
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both have length batch+1, got "
                         f"{cu_q.shape[0]} and {cu_k.shape[0]}")


# cu_seqlens pairs already read and found valid, with their version counters (bumped by every
# in-place write) and the extents they were checked against. A model runs every layer on the
# same cu_seqlens: reading them once, not once per layer and op, saves a host sync per call
# (each exposes the host's launch work as GPU idle time). Weak references, so a freed tensor --
# whose memory a new one may reuse -- never matches.
_CU_CHECKED: list[tuple] = []
_CU_CHECKED_MAX = 8


def _cu_key(cu_q: torch.Tensor, cu_k: torch.Tensor, *extents) -> tuple:
    return (cu_q._version, cu_k._version, *extents)


def _cu_already_checked(cu_q: torch.Tensor, cu_k: torch.Tensor, key: tuple) -> bool:
    return any(rq() is cu_q and rk() is cu_k and k == key for rq, rk, k in _CU_CHECKED)


def _read_cu(cu_q: torch.Tensor, cu_k: torch.Tensor) -> list[int]:
    # One device->host copy for both (a sync on CUDA).
    return torch.cat([cu_q, cu_k]).tolist()


def _check_cu_seqlens_data(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int,
                           max_seqlen_q: int | None, max_seqlen_k: int | None) -> None:
    # Skipped while a CUDA graph is captured, where reading device memory on the host is not
    # allowed.
    if cu_q.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    key = _cu_key(cu_q, cu_k, total_q, total_k, max_seqlen_q, max_seqlen_k)
    if _cu_already_checked(cu_q, cu_k, key):
        return
    both = _read_cu(cu_q, cu_k)
    n = cu_q.shape[0]
    for name, vals, total, max_seqlen in (("cu_seqlens_q", both[:n], total_q, max_seqlen_q),
                                          ("cu_seqlens_k", both[n:], total_k, max_seqlen_k)):
        if vals[0] != 0:
            raise ValueError(f"{name} must start at 0, got {vals[0]}")
        lens = [b - a for a, b in zip(vals[:-1], vals[1:], strict=True)]
        if any(x < 0 for x in lens):
            raise ValueError(f"{name} must be non-decreasing, got {vals}")
        if vals[-1] != total:
            raise ValueError(f"{name}[-1] must equal the number of packed tokens ({total}), got {vals[-1]}")
        if max_seqlen is not None and lens and max(lens) > max_seqlen:
            side = name.removeprefix("cu_seqlens_")
            raise ValueError(f"max_seqlen_{side} ({max_seqlen}) is smaller than the longest sequence "
                             f"({max(lens)}); the kernel would skip tokens")
    _CU_CHECKED.append((weakref.ref(cu_q), weakref.ref(cu_k), key))
    del _CU_CHECKED[:-_CU_CHECKED_MAX]


def check_cu_seqlens(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, total_k: int,
                     max_seqlen_q: int | None, max_seqlen_k: int | None, *, check_data: bool = True) -> None:
    """cu_seqlens of packed inputs: int32, 1-D, as long as each other; with ``check_data`` (real
    tensors) starting at 0, non-decreasing, ending at the token totals, within the max lengths."""
    _check_cu_seqlens_meta(cu_q, cu_k)
    if check_data:
        _check_cu_seqlens_data(cu_q, cu_k, total_q, total_k, max_seqlen_q, max_seqlen_k)


def check_sinks(sinks: torch.Tensor, q: torch.Tensor) -> None:
    """Learnable sinks: a float32 tensor of shape (H,) (one logit per query head) on q's device."""
    _require_tensor("sinks", sinks)
    if sinks.dtype != torch.float32:
        raise TypeError(f"sinks must be float32, got {sinks.dtype}")
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[-2]:
        raise ValueError(f"sinks must have shape (H,) = ({q.shape[-2]},), got {tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device {q.device}, got {sinks.device}")


def check_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, softmax_scale: float,
              window_size: Sequence[int] = (-1, -1), softcap: float = 0.0,
              cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
              max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
              check_data: bool = True) -> None:
    """Everything the forward kernel assumes about its inputs. ``check_data=False`` skips the checks
    that read memory (for fake tensors)."""
    key = _meta_key("fwd", (q, k, v, cu_seqlens_q, cu_seqlens_k),
                    (softmax_scale, window_size, softcap, max_seqlen_q, max_seqlen_k)) if check_data else None
    if _meta_passed(key):
        _check_fwd_data(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        return
    _check_fwd_in_full(q, k, v, softmax_scale, window_size, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, check_data)
    _remember(key)


def _check_fwd_data(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    """The forward's checks that read data, for inputs whose metadata passed before."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_aligned(name, t)
    if cu_seqlens_q is not None and q.device.type != "meta":
        _check_cu_seqlens_data(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)


def _check_fwd_in_full(q, k, v, softmax_scale, window_size, softcap, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, check_data: bool) -> None:
    tensors = {"q": _require_tensor("q", q), "k": _require_tensor("k", k), "v": _require_tensor("v", v)}
    varlen = cu_seqlens_q is not None or cu_seqlens_k is not None
    if varlen:
        if cu_seqlens_q is None or cu_seqlens_k is None:
            raise ValueError("varlen needs both cu_seqlens_q and cu_seqlens_k")
        tensors["cu_seqlens_q"] = _require_tensor("cu_seqlens_q", cu_seqlens_q)
        tensors["cu_seqlens_k"] = _require_tensor("cu_seqlens_k", cu_seqlens_k)
    check_same_device(tensors)
    check_dtypes({"q": q, "k": k, "v": v})
    _check_qkv_shapes(q, k, v, varlen=varlen)
    for name in ("q", "k", "v"):
        check_layout(name, tensors[name], check_data=check_data)
    check_scalars(softmax_scale=softmax_scale, window_size=window_size, softcap=softcap)
    if varlen:
        for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            # SymInt: a traced int under torch.compile(dynamic=True)
            if m is not None and (isinstance(m, bool) or not isinstance(m, (int, torch.SymInt)) or m < 0):
                raise ValueError(f"{name} must be a non-negative int, got {m!r}")
        _check_cu_seqlens_meta(cu_seqlens_q, cu_seqlens_k)
        if check_data and q.device.type != "meta":
            _check_cu_seqlens_data(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                                   max_seqlen_k)


def expected_lse_shape(q: torch.Tensor, varlen: bool) -> tuple[int, ...]:
    """(B, H, Nq) or, packed, (H, total_q)."""
    if varlen:
        return (q.shape[1], q.shape[0])
    return (q.shape[0], q.shape[2], q.shape[1])


def check_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, *, softmax_scale: float, window_size: Sequence[int] = (-1, -1),
              softcap: float = 0.0, cu_seqlens_q: torch.Tensor | None = None,
              cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
              max_seqlen_k: int | None = None, dlse: torch.Tensor | None = None,
              check_data: bool = True) -> None:
    """Everything the backward kernels assume: the forward's checks plus dout/out/lse (and dlse,
    the LSE output's gradient, when given)."""
    # (The key covers the forward's tensors and scalars too: a hit skips its metadata checks.)
    key = _meta_key("bwd", (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, dlse),
                    (softmax_scale, window_size, softcap, max_seqlen_q, max_seqlen_k)) if check_data else None
    if _meta_passed(key):
        _check_fwd_data(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        _check_aligned("dout", dout)
        _check_aligned("out", out)
        return
    check_fwd(q, k, v, softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
              cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
              max_seqlen_k=max_seqlen_k, check_data=check_data)
    _check_bwd_tensors(dout, q, v, out, lse, cu_seqlens_q, dlse, check_data)
    _remember(key)


def _check_bwd_tensors(dout, q, v, out, lse, cu_seqlens_q, dlse, check_data: bool) -> None:
    tensors = {"q": q, "dout": _require_tensor("dout", dout), "out": _require_tensor("out", out),
               "lse": _require_tensor("lse", lse)}
    check_same_device(tensors)
    check_dtypes({"q": q, "dout": dout, "out": out})
    out_shape = (*q.shape[:-1], v.shape[-1])
    for name, t in (("dout", dout), ("out", out)):
        if tuple(t.shape) != out_shape:
            raise ValueError(f"{name} must have shape {out_shape} (q's with v's head dim), "
                             f"got {tuple(t.shape)}")
        check_layout(name, t, check_data=check_data)
    if lse.dtype != torch.float32:
        raise TypeError(f"lse must be float32, got {_fmt_dtype(lse.dtype)}")
    lse_shape = expected_lse_shape(q, cu_seqlens_q is not None)
    if tuple(lse.shape) != lse_shape:
        raise ValueError(f"lse must have shape {lse_shape}, got {tuple(lse.shape)}")
    if lse.shape[-1] > 1 and lse.stride(-1) != 1:
        raise ValueError(f"lse must be contiguous in its last dim, got strides {tuple(lse.stride())}")
    if dlse is not None:
        check_same_device({"q": q, "dlse": _require_tensor("dlse", dlse)})
        if dlse.dtype != torch.float32:
            raise TypeError(f"dlse must be float32, got {_fmt_dtype(dlse.dtype)}")
        if tuple(dlse.shape) != lse_shape:
            raise ValueError(f"dlse must have lse's shape {lse_shape}, got {tuple(dlse.shape)}")


# ---------------------------------------------------------------------------------------------
# FP8 (e4m3) forward and its quantize kernels
# ---------------------------------------------------------------------------------------------
def check_fp8_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window_size: tuple[int, int]) -> None:
    """What the FP8 backward covers, checked at the forward of a call that will need it."""
    if q.shape[-1] not in FP8_BWD_HDIMS:
        raise NotImplementedError(f"the FP8 backward runs head dims {FP8_BWD_HDIMS}, got {q.shape[-1]} "
                                  "(call under torch.no_grad() for the forward alone)")
    if window_size[0] >= 0 or window_size[1] >= 0:
        raise NotImplementedError("the FP8 backward has no sliding window (call under torch.no_grad() for "
                                  "the forward alone)")


def check_fp8_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Dense (B, N, H, d) q and (B, N_k, H_kv, d) k, v as the FP8 kernels take them."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be (B, N, H, d), got shape {tuple(t.shape)}")
    b, _, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k and v must be (B, N_k, H_kv, d) with q's B and d: {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if d not in FP8_HDIMS:
        raise ValueError(f"FP8 attention: head dim {d} not supported {FP8_HDIMS}")
    if k.shape[2] == 0 or h % k.shape[2]:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({k.shape[2]})")
    if not (q.device == k.device == v.device):
        raise ValueError("q, k, v must be on one device")


def check_fp8_heads_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Packed q (T_q, H, d), k / v (T_k, H_kv, d): the shape rules of ``check_fp8_heads``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be packed (T, H, d), got shape {tuple(t.shape)}")
    check_fp8_heads(q[None], k[None], v[None])


def _check_e4m3(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor) -> None:
    for name, t in (("q", q8), ("k", k8), ("v", v8)):
        if t.dtype != FP8:
            raise TypeError(f"FP8 attention: {name} must be torch.float8_e4m3fn, got {t.dtype}")
        if t.requires_grad:
            raise ValueError("FP8 attention is forward-only: the e4m3 inputs must not require grad")


def _check_descales(descales: Sequence[torch.Tensor], shape: tuple[int, int], rows: str, device) -> None:
    for name, t in zip(("q_descale", "k_descale", "v_descale"), descales, strict=True):
        if t.dtype != torch.float32 or tuple(t.shape) != shape or t.device != device:
            raise ValueError(f"{name} must be float32 of shape ({rows}, H_kv) = {shape} on {device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")


def check_fp8_inputs(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor,
                     descales: Sequence[torch.Tensor]) -> None:
    """e4m3 q, k, v with their (B, H_kv) fp32 descales."""
    _check_e4m3(q8, k8, v8)
    check_fp8_heads(q8, k8, v8)
    _check_descales(descales, (q8.shape[0], k8.shape[2]), "B", q8.device)


def check_fp8_varlen_inputs(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, cu_q: torch.Tensor,
                            cu_k: torch.Tensor, max_q: int, max_k: int,
                            descales: Sequence[torch.Tensor]) -> None:
    """Packed e4m3 inputs: everything but the cu_seqlens values (``check_cu_seqlens`` with data,
    in the op's real implementations): also runs while tracing."""
    _check_e4m3(q8, k8, v8)
    check_fp8_heads_varlen(q8, k8, v8)
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.device != q8.device:
            raise ValueError(f"{name} must be a tensor on {q8.device}")
    check_cu_seqlens(cu_q, cu_k, q8.shape[0], k8.shape[0], max_q, max_k, check_data=False)
    _check_descales(descales, (cu_q.shape[0] - 1, k8.shape[1]), "num_seqs", q8.device)


def check_fp8_quantize_request(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               descales: Sequence[torch.Tensor | None]) -> None:
    """``fp8=True``: what quantizing needs of the 16-bit inputs (shapes are checked per layout)."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"fp8=True quantizes bf16 / fp16 inputs, got {q.dtype}")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise TypeError("q, k, v must share a dtype")
    if any(x is not None for x in descales):
        raise ValueError("fp8=True computes the descales itself; pass e4m3 inputs to give your own")


def _check_quantize_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int, shape: str) -> None:
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


def check_quantize_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, varlen: bool,
                          cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                          max_seqlen_q: int = 0, max_seqlen_k: int = 0) -> int:
    """The quantize kernels' inputs (CUDA, 16-byte rows); packed: everything but the cu_seqlens
    values (reading them is a host sync, the op checks them). Returns the number of sequences."""
    if not varlen:
        _check_quantize_tensors(q, k, v, 4, "(B, N, H, d)")
        check_fp8_heads(q, k, v)
        return q.shape[0]
    _check_quantize_tensors(q, k, v, 3, "packed (T, H, d)")
    check_fp8_heads_varlen(q, k, v)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {cu.device}")
    check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k,
                     check_data=False)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs > 65535:
        raise ValueError(f"quantize: at most 65535 sequences (the grid's z extent), got {num_seqs}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"{name} must be a non-negative int, got {m!r}")
    return num_seqs


def check_relayout_v(v8: torch.Tensor, *, varlen: bool) -> None:
    """A caller's e4m3 V for the re-layout kernel: (B, N, H_kv, d) or packed (T, H_kv, d), CUDA."""
    name, rank, shape = (("relayout_v_varlen", 3, "(T, H_kv, d)") if varlen
                         else ("relayout_v", 4, "(B, N, H_kv, d)"))
    if v8.dtype != FP8 or v8.dim() != rank or not v8.is_cuda:
        raise ValueError(f"{name}: a {shape} e4m3 CUDA tensor expected, got {v8.dtype} "
                         f"{tuple(v8.shape)} on {v8.device}")
    if v8.shape[-1] not in FP8_HDIMS:
        raise ValueError(f"{name}: head dim {v8.shape[-1]} not in {FP8_HDIMS}")


def check_fp8_kernel_v(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, *, v_perm: bool, varlen: bool,
                       cu_seqlens_k: torch.Tensor | None, cu_seqlens_v: torch.Tensor | None) -> torch.Tensor:
    """The FP8 attention kernel's V layout; returns the view the kernel reads (``v_perm``: the
    (B, N_pad, H_kv, d) permutation of quantize's (B, H_kv, d, N_pad) storage)."""
    if q8.dtype != FP8 or k8.dtype != q8.dtype or v8.dtype != q8.dtype:
        raise TypeError("FP8 forward: q, k, v must be torch.float8_e4m3fn")
    if varlen and (cu_seqlens_v is None or cu_seqlens_v.shape != cu_seqlens_k.shape):
        raise ValueError("FP8 forward: varlen needs V's own 16-aligned offsets (formats.v_varlen_aligned)")
    if v_perm:
        b, nk, hkv, d = k8.shape
        if varlen or tuple(v8.shape) != (b, hkv, d, (nk + 15) // 16 * 16) or not v8.is_contiguous():
            raise ValueError("FP8 forward: v_perm expects the contiguous (B, H_kv, d, N_pad) storage "
                             "quantize_qkv(..., v_perm=True) returns (dense inputs only)")
        # The kernel reads (B, N_pad, H_kv, d) over it: every stored position, since a token below
        # N may sit past N in the kernel order (its P is zero where the token is past N).
        return v8.permute(0, 3, 1, 2)
    if v8.stride(-3) != 1 or any(st % 16 for st in v8.stride()[:-3] + v8.stride()[-2:]):
        # TMA: the token dim contiguous, every other stride a multiple of 16 bytes.
        raise ValueError("FP8 forward: v must be token-contiguous with 16-byte aligned strides (as "
                         "quantize_qkv writes it)")
    return v8
