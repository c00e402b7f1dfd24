"""Forward pass: variant configs, the choice of kernel family, and the torch-side launcher.

Two forward families share one compiled call signature: the sm80 FlashAttention-2 kernel
(``FwdConfig``, runs on every sm80+ GPU) and the sm90a FlashAttention-3 kernel
(``cute_flash.fwd_sm90.FwdSm90Config``, Hopper only). ``fwd_family`` picks one per launch; the
backward is the sm80 family on every GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import cutlass
import torch

from cute_flash import jit
from cute_flash.memo import HostMemo

SUPPORTED_HDIMS = (32, 64, 96, 128, 160, 192, 256)

# (tile_m, tile_n, num_threads, num_stages) of the sm80 forward per head dim: for each head dim, the
# fastest candidate measured on the H200 (docs/notes.md, tile sweep) whose every variant (causal,
# local, softcap, varlen) compiles for sm_80 with zero spills (tests/test_compile_sm80_fwd.py).
SM80_FWD_TILES: dict[int, tuple[int, int, int, int]] = {
    32: (64, 128, 128, 2),
    64: (64, 128, 128, 1),
    96: (128, 32, 128, 1),
    128: (128, 128, 256, 1),
    160: (64, 64, 128, 1),
    192: (64, 64, 128, 1),
    256: (64, 64, 128, 1),
}
# Sliding windows and softcap add ~20 live registers (two row limits, tanh scale); where that tips
# the default tile into spilling, these variants take a narrower K/V block.
SM80_FWD_TILES_MASKED: dict[int, tuple[int, int, int, int]] = {
    256: (64, 32, 128, 1),
}


@dataclass(frozen=True)
class FwdConfig(jit.KernelConfig):
    """One sm80 forward variant. Sequence lengths, batch, heads and the GQA ratio are run-time
    values; everything here is baked into the compiled code. ``target=None`` compiles for the
    current device (what launches use); an explicit target cross-compiles for inspection."""

    dtype: str = "bf16"
    hdim: int = 128
    hdim_v: int = 128
    causal: bool = False
    local: bool = False
    softcap: bool = False
    varlen: bool = False
    tiles: tuple[int, int, int, int] = field(default=(0, 0, 0, 0))

    kernel_name = "fwd_sm80"

    def __post_init__(self) -> None:
        if self.tiles == (0, 0, 0, 0):
            d = max(self.hdim, self.hdim_v)
            table = SM80_FWD_TILES_MASKED if (self.local or self.softcap) else SM80_FWD_TILES
            object.__setattr__(self, "tiles", table.get(d, SM80_FWD_TILES[d]))

    def build(self):
        from cute_flash.ampere.fwd import FlashFwdSm80

        return FlashFwdSm80(self)

    def fake_args(self) -> tuple:
        return fwd_fake_args(self.dtype, self.hdim, self.hdim_v, self.varlen)


def fwd_fake_args(dtype: str, hdim: int, hdim_v: int, varlen: bool) -> tuple:
    """Compile arguments of every forward kernel (sm80 and sm90 share the call signature):
    (q, k, v, o, lse, cu_q, cu_k, softmax_scale, softcap, window_left, window_right, max_seqlen_q,
    stream), flash-attn layouts, extents and strides symbolic."""
    dt = jit.DTYPES[dtype]
    div = jit.vec_div(dt)
    h, hkv, d, dv = jit.sym(), jit.sym(), hdim, hdim_v
    if varlen:
        tq, tk, b1 = jit.sym(), jit.sym(), jit.sym()
        q = jit.fake_tensor(dt, (tq, h, d), divisibility=div)
        k = jit.fake_tensor(dt, (tk, hkv, d), divisibility=div)
        v = jit.fake_tensor(dt, (tk, hkv, dv), divisibility=div)
        o = jit.fake_tensor(dt, (tq, h, dv), divisibility=div)
        lse = jit.fake_tensor(cutlass.Float32, (h, tq), divisibility=1)
        cu_q = jit.fake_tensor(cutlass.Int32, (b1,), leading_dim=0)
        cu_k = jit.fake_tensor(cutlass.Int32, (b1,), leading_dim=0)
    else:
        b, nq, nk = jit.sym(), jit.sym(), jit.sym()
        q = jit.fake_tensor(dt, (b, nq, h, d), divisibility=div)
        k = jit.fake_tensor(dt, (b, nk, hkv, d), divisibility=div)
        v = jit.fake_tensor(dt, (b, nk, hkv, dv), divisibility=div)
        o = jit.fake_tensor(dt, (b, nq, h, dv), divisibility=div)
        lse = jit.fake_tensor(cutlass.Float32, (b, h, nq), divisibility=1)
        cu_q = cu_k = None
    scalars = (cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(-1), cutlass.Int32(-1),
               cutlass.Int32(0))
    return (q, k, v, o, lse, cu_q, cu_k, *scalars, jit.fake_stream())


def max_seqlen(cu: torch.Tensor, given: int | None) -> int:
    """The longest sequence of packed inputs: ``given``, or read from cu_seqlens (a host sync)."""
    if given is not None:
        return int(given)
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


def normalize_window(causal: bool, window_size: tuple[int, int]) -> tuple[bool, bool, int, int]:
    """(causal, local, left, right) as the kernel wants them: -1 means unbounded on that side;
    a causal mask is the window (left, 0); a window unbounded on both sides is no window."""
    left, right = (int(window_size[0]), int(window_size[1]))
    if causal:
        right = 0
    left = -1 if left < 0 else left
    right = -1 if right < 0 else right
    local = (left >= 0 or right >= 0) and not (causal and left < 0)
    if local:
        causal = False
    return causal, local, left, right


# Which forward family runs: "auto" (sm90 on Hopper for the head dims it has, else sm80), or one
# family forced. Read at every launch, so tests and benchmarks can switch it per call.
FWD_KERNEL_ENV = "CUTE_FLASH_FWD_KERNEL"
FWD_KERNEL_CHOICES = ("auto", "sm80", "sm90")


def sm90_supports(hdim: int, hdim_v: int) -> bool:
    """Whether the sm90 forward has a tile configuration for these head dims."""
    from cute_flash.fwd_sm90 import SM90_FWD_TILES  # lazy: fwd_sm90 imports this module

    return max(hdim, hdim_v) in SM90_FWD_TILES


def fwd_family(device: torch.device | int | str | None = None, hdim: int | None = None,
               hdim_v: int | None = None) -> type:
    """The forward config class to launch on ``device`` (default: the current CUDA device).

    ``CUTE_FLASH_FWD_KERNEL`` (read now, not at import): ``auto`` (default) takes the sm90 family
    on a compute capability 9.x GPU when it has the head dims (``max(hdim, hdim_v)``; ``hdim=None``
    skips that check) and the sm80 family everywhere else; ``sm80`` forces the FA2 kernel (on any
    sm80+ GPU, Hopper included, e.g. for comparisons); ``sm90`` forces the FA3 kernel and raises
    ``ValueError`` on a GPU that is not Hopper. Any other value raises ``ValueError``.
    """
    choice = os.environ.get(FWD_KERNEL_ENV, "auto").strip().lower() or "auto"
    if choice not in FWD_KERNEL_CHOICES:
        raise ValueError(f"{FWD_KERNEL_ENV} must be one of {', '.join(FWD_KERNEL_CHOICES)}, got {choice!r}")
    if choice == "sm80":
        return FwdConfig
    from cute_flash.fwd_sm90 import FwdSm90Config

    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        if choice == "sm90":
            raise ValueError(f"{FWD_KERNEL_ENV}=sm90: the sm90 forward (wgmma, TMA) needs a Hopper GPU "
                             f"(compute capability 9.x); this one is {major}.{minor}. Use sm80 or auto.")
        return FwdConfig
    if choice == "auto" and hdim is not None and not sm90_supports(hdim, hdim if hdim_v is None else hdim_v):
        return FwdConfig
    return FwdSm90Config


# ``fwd_config`` by everything it reads: building a config (a frozen dataclass with its checks)
# costs ~25-35 us of host time, once per training step per attention call otherwise.
_FWD_CONFIGS = HostMemo(512)


def fwd_config(q: torch.Tensor, v: torch.Tensor, *, causal: bool, local: bool, softcap: float,
               varlen: bool, target: str | None = None, config_cls: type = FwdConfig) -> jit.KernelConfig:
    """The variant of ``config_cls`` (sm80 ``FwdConfig`` or sm90 ``FwdSm90Config``) for these inputs."""
    key = (config_cls, target, q.dtype, tuple(q.shape), q.stride(), tuple(v.shape), v.stride(), q.device,
           bool(causal), bool(local), softcap > 0.0, bool(varlen))
    cfg = _FWD_CONFIGS.get(key)
    if cfg is None:
        cfg = _build_fwd_config(q, v, causal=causal, local=local, softcap=softcap, varlen=varlen,
                                target=target, config_cls=config_cls)
        _FWD_CONFIGS.put(key, cfg)
    return cfg


def _build_fwd_config(q: torch.Tensor, v: torch.Tensor, *, causal: bool, local: bool, softcap: float,
                      varlen: bool, target: str | None, config_cls: type) -> jit.KernelConfig:
    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[q.dtype]
    # Families may pick more fields from the inputs (sm90: a persistent grid for short sequences).
    launch_fields = getattr(config_cls, "launch_fields", None)
    extra = launch_fields(q, v, causal=causal, local=local, varlen=varlen) if launch_fields else {}
    return config_cls(target=target, dtype=dtype, hdim=q.shape[-1], hdim_v=v.shape[-1], causal=causal,
                      local=local, softcap=softcap > 0.0, varlen=varlen, **extra)


def run_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *,
            softmax_scale: float, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
            softcap: float = 0.0, cu_seqlens_q: torch.Tensor | None = None,
            cu_seqlens_k: torch.Tensor | None = None, max_seqlen_q: int | None = None,
            config_cls: type | None = None) -> None:
    """Launch the forward on validated CUDA tensors; writes ``out`` and ``lse`` in place.

    q (B, Nq, H, d) | (Tq, H, d); k, v (B, Nk, Hkv, d/dv) | (Tk, Hkv, d/dv); out like q with dv;
    lse (B, H, Nq) | (H, Tq) float32. Every forward kernel family shares this call signature;
    ``config_cls`` picks the family, ``None`` meaning ``fwd_family`` (sm90 on Hopper, else sm80).
    """
    if config_cls is None:
        config_cls = fwd_family(q.device, q.shape[-1], v.shape[-1])
    if config_cls is not FwdConfig:
        # Broadcast inputs (stride 0 on a dim of extent > 1, e.g. K/V expanded over heads) are not
        # a layout we have checked the TMA descriptors with: materialise them rather than risk it.
        q, k, v = (t.contiguous() if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True))
                   else t for t in (q, k, v))
    causal, local, left, right = normalize_window(causal, window_size)
    varlen = cu_seqlens_q is not None
    cfg = fwd_config(q, v, causal=causal, local=local, softcap=softcap, varlen=varlen, config_cls=config_cls)
    fn = jit.compile_kernel(cfg)
    mq = max_seqlen(cu_seqlens_q, max_seqlen_q) if varlen else q.shape[1]
    # Families may take more runtime arguments after the shared ones (sm90: a tile counter).
    launch_args = getattr(cfg, "launch_args", None)
    extra = launch_args(q.device) if launch_args else ()
    fn(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, float(softmax_scale),
       float(softcap) if softcap > 0 else 0.0, left, right, mq, *extra)
