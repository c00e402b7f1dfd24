"""JIT layer: one frozen config object per kernel variant gives both the compile-cache key and the
compile arguments (fake tensors), so a variant is described once and compiled once per process.

Compiling never needs a GPU: the kernels are traced against fake tensors whose extents and strides
are symbolic, and the result is launched through TVM-FFI with torch tensors. ``CUTE_FLASH_ARCH``
(``sm_80`` or ``sm_90a``) overrides the target so every variant can be built on a CPU-only machine.
"""

from __future__ import annotations

import atexit
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import cutlass
import cutlass.cute as cute

from cute_flash import disk_cache

disk_cache.load_runtime()

ARCHS = ("sm_80", "sm_90a")

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
# Tables a kernel reads in any float dtype (rotary cos / sin).
FLOAT_DTYPES = {**DTYPES, "fp32": cutlass.Float32}
# Aux tensors a score / mask mod may read (kernel arguments of their own, None when unused), and
# their element types.
MAX_AUX = 4
AUX_DTYPES = {**FLOAT_DTYPES, "int32": cutlass.Int32, "int64": cutlass.Int64, "bool": cutlass.Boolean}


def arch_from_capability(major: int, minor: int) -> str:
    """Compile target for a device: the chip's own target (a cubin only runs on its major
    version), with the ``a`` suffix on Hopper so wgmma/setmaxnreg are available."""
    if major == 9:
        return "sm_90a"
    if major == 8:
        return f"sm_{major}{minor}"
    raise ValueError(f"cute_flash supports compute capability 8.x and 9.0, got {major}.{minor}")


def resolve_arch(device: Any = None) -> str:
    """Compile target for kernels that will run on ``device``; ``CUTE_FLASH_ARCH`` overrides it."""
    env = os.environ.get("CUTE_FLASH_ARCH")
    if env:
        if env not in ARCHS:
            raise ValueError(f"CUTE_FLASH_ARCH must be one of {ARCHS}, got {env!r}")
        return env
    return device_arch(device)


def device_arch(device: Any = None) -> str:
    """The architecture of ``device`` itself (default: the current CUDA device): what decides the
    kernel family, whatever compile target ``CUTE_FLASH_ARCH`` names."""
    import torch

    if device is None:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: set CUTE_FLASH_ARCH=sm_80|sm_90a to compile without one")
        device = torch.device("cuda", torch.cuda.current_device())
    major, minor = torch.cuda.get_device_capability(device)
    return arch_from_capability(major, minor)


# ---------------------------------------------------------------------------------------------
# Fake tensors
# ---------------------------------------------------------------------------------------------
def sym() -> Any:
    """A symbolic extent; reuse the same object where two extents must be equal at run time."""
    return cute.sym_int()


def fake_tensor(dtype: Any, shape: tuple, leading_dim: int | None = -1, divisibility: int = 1) -> Any:
    """Fake tensor with symbolic strides; ``leading_dim`` gets a static unit stride (what the
    vectorised 16-byte copies need), the others a stride divisible by ``divisibility`` elements."""
    if leading_dim is not None and leading_dim < 0:
        leading_dim += len(shape)
    stride = tuple(
        1 if i == leading_dim else cute.sym_int64(divisibility=divisibility) for i in range(len(shape))
    )
    align = max(divisibility * dtype.width // 8, 1)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def fake_stream() -> Any:
    # The real stream is torch's current stream, read by TVM-FFI at each call.
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def vec_div(dtype: Any) -> int:
    """Stride divisibility (elements) that makes every row start 16-byte aligned."""
    return 128 // dtype.width


# ---------------------------------------------------------------------------------------------
# Configs and the compile cache
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelConfig:
    """Base of every kernel variant's config. Subclasses are frozen dataclasses (hashable: the
    cache key) and implement ``build`` (the kernel object) and ``fake_args`` (compile arguments,
    stream last). ``target`` is the compile target, ``None`` meaning the current device."""

    target: str | None

    kernel_name = "kernel"

    def build(self) -> Any:
        raise NotImplementedError

    def fake_args(self) -> tuple:
        raise NotImplementedError

    def describe(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if k != "target"}
        return f"{self.kernel_name}[{self.target}](" + ", ".join(f"{k}={v}" for k, v in fields.items()) + ")"


_cache: dict[KernelConfig, Any] = {}
_lock = threading.Lock()


def _options(cfg: KernelConfig, keep: bool) -> str:
    opts = ["--enable-tvm-ffi"]
    if cfg.target is not None and os.environ.get("CUTE_DSL_ARCH") != cfg.target:
        # Cross-compile: PTX and cubin are produced for that target without a device.
        opts.append(f"--gpu-arch {cfg.target}")
    if keep:
        # Kept artefacts go to a private temp dir, not the working directory.
        opts.append(f"--keep-ptx --keep-cubin --dump-dir {_dump_dir()}")
    return " ".join(opts)


def _dump_dir() -> str:
    global _DUMP_DIR
    if _DUMP_DIR is None:
        _DUMP_DIR = tempfile.mkdtemp(prefix="cute_flash_dump_")
        # (Kept artefacts are read in memory; plans that compile to size a tile leave none behind.)
        atexit.register(shutil.rmtree, _DUMP_DIR, ignore_errors=True)
    return _DUMP_DIR


_DUMP_DIR: str | None = None


def compile_kernel(cfg: KernelConfig, keep: bool = False) -> Any:
    """Compiled executor for ``cfg``; the first call compiles, later calls hit the cache."""
    fn = _cache.get(cfg)
    if fn is not None and (not keep or getattr(fn, "_cf_keep", False)):
        return fn
    with _lock:
        fn = _cache.get(cfg)
        if fn is None or (keep and not getattr(fn, "_cf_keep", False)):
            key = None if keep or not disk_cache.enabled() else _disk_key(cfg)
            if key is None:
                fn = _compile(cfg, keep)
            else:
                fn = disk_cache.fetch_or_compile(key, lambda: _compile(cfg, keep), dsl_lock=_lock)
            try:
                fn._cf_keep = keep
            except AttributeError:
                pass
            _cache[cfg] = fn
    return fn


def _compile(cfg: KernelConfig, keep: bool) -> Any:
    return cute.compile(cfg.build(), *cfg.fake_args(), options=_options(cfg, keep))


def _dsl_arch() -> str:
    """What the DSL compiles for when no target is named: the device's (or CUTE_DSL_ARCH)."""
    from cutlass.cutlass_dsl import CuTeDSL

    return CuTeDSL._get_dsl().envar.arch


def _disk_key(cfg: KernelConfig) -> str | None:
    """The on-disk cache key of ``cfg``: its class and fields with the compile target resolved (a
    launch on an H100 and a compile-only warm-up for sm_90a share entries); None if a field has no
    stable text form."""
    values = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    values["target"] = cfg.target or _dsl_arch()
    text = ", ".join(f"{name}={value!r}" for name, value in values.items())
    if " at 0x" in text:
        return None
    return f"{type(cfg).__module__}.{type(cfg).__qualname__}({text})"


def compile_artifacts(cfg: KernelConfig) -> tuple[str, bytes]:
    """(PTX text, cubin bytes) of one variant, for inspection."""
    fn = compile_kernel(cfg, keep=True)
    return fn.artifacts.PTX, fn.artifacts.CUBIN


# ---------------------------------------------------------------------------------------------
# Register spills of a compiled variant, read from its cubin (no CUDA tools needed): what a plan
# that widens a tile until it spills (a user's score_mod / mask_mod) asks.
# ---------------------------------------------------------------------------------------------
_EIATTR_FRAME_SIZE = 0x11  # (the ELF ``.nv.info`` attributes ptxas writes per function)
_EIATTR_MIN_STACK_SIZE = 0x12
_spills: dict[KernelConfig, int] = {}


def _elf_sections(elf: bytes) -> dict[str, tuple[int, int]]:
    """Section name -> (file offset, size) of a 64-bit little-endian ELF file (a cubin)."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<I4xQ8xQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][2]
    out = {}
    for name, _, off, size in heads:
        end = elf.index(b"\0", names + name)
        out[elf[names + name:end].decode()] = (off, size)
    return out


def cubin_spill_bytes(cubin: bytes) -> int:
    """The largest stack frame of the cubin's functions plus its local memory, in bytes: what
    ``cuobjdump -res-usage`` calls STACK and LOCAL (ptxas puts register spills there).
    ``UNREADABLE`` where the notes are not in the form expected (a plan then takes it as
    spilling)."""
    sections = _elf_sections(cubin)
    if ".nv.info" not in sections:
        return UNREADABLE
    off, size = sections[".nv.info"]
    info = cubin[off:off + size]
    frame = 0
    i = 0
    while i + 4 <= len(info):  # (format byte, attribute byte, then two bytes: a value or a size)
        fmt, attr, value = info[i], info[i + 1], struct.unpack_from("<H", info, i + 2)[0]
        i += 4
        if fmt == 4:  # sized: for these two, (function symbol, bytes)
            if attr in (_EIATTR_FRAME_SIZE, _EIATTR_MIN_STACK_SIZE) and value == 8:
                frame = max(frame, struct.unpack_from("<I", info, i + 4)[0])
            i += value
        elif fmt not in (1, 2, 3):  # (no value, a byte, a half-word: all in those two bytes)
            return UNREADABLE
    # (Local memory sections hold no file bytes: their header's size is the amount.)
    return frame + sum(size for name, (_, size) in sections.items() if name.startswith(".nv.local."))


UNREADABLE = 1 << 30


def spill_bytes(cfg: KernelConfig) -> int:
    """``cubin_spill_bytes`` of ``cfg`` compiled: the first ask compiles it (kept in the caches,
    so launching it after costs nothing more); the answer is remembered beside the disk cache."""
    got = _spills.get(cfg)
    if got is not None:
        return got
    key = _disk_key(cfg) if disk_cache.enabled() else None
    note = disk_cache.read_note(key, "spill") if key is not None else None
    if note is not None and note.isdigit():
        got = int(note)
    else:
        fn = compile_kernel(cfg, keep=True)
        got = cubin_spill_bytes(fn.artifacts.CUBIN)
        if key is not None:
            if got == 0:  # (a spilling width is never launched: only its note is kept)
                with _lock:  # (the kept compile, on disk too; loading an entry takes the DSL's lock)
                    disk_cache.fetch_or_compile(key, lambda: fn, dsl_lock=_lock)
            disk_cache.write_note(key, "spill", str(got))
    _spills[cfg] = got
    return got


def first_spill_free(candidates: Iterable[KernelConfig]) -> KernelConfig | None:
    """The first of ``candidates`` (widest tile first) that compiles without register spills: how
    a plan sizes the tiles of a kernel with a user's code in it, which only the compiler can
    weigh. None if every one spills."""
    return next((cfg for cfg in candidates if spill_bytes(cfg) == 0), None)
