"""Compiled kernels on disk, so a second process (another rank, a restarted job) loads a variant in
milliseconds instead of compiling it again.

An entry is the object file the DSL exports for one compiled variant (TVM-FFI host code and the
cubin), framed with a magic word and the SHA-256 of its body. It is keyed by the variant's config,
the compile target, the DSL / TVM-FFI / Python versions and a hash of this package's sources, so
a change to any of them misses instead of loading stale code. Entries are written to a private
temporary name and renamed into place (readers see a whole entry or none) by a thread, after the
compiled function is handed back; an entry that fails its digest or does not load is compiled
again and replaced. While one process compiles a
variant, others that want the same one wait on an advisory lock and then load it.

``CUTE_FLASH_CACHE_DIR`` moves the cache (default: ``$XDG_CACHE_HOME/cute_flash`` or
``~/.cache/cute_flash``); ``CUTE_FLASH_CACHE=0`` turns it off. Both are read at every lookup.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

CACHE_ENV = "CUTE_FLASH_CACHE"
CACHE_DIR_ENV = "CUTE_FLASH_CACHE_DIR"
MAGIC = b"CUTEFLK1"
_DIGEST = 32
_FUNCTION = "func"
# Longer than any one compile: past it a waiter compiles the variant itself.
LOCK_TIMEOUT_S = 600.0

_fingerprint: str | None = None


def enabled() -> bool:
    return os.environ.get(CACHE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def cache_root() -> Path:
    """The cache directory (entries sit one level down, in a folder per source fingerprint)."""
    given = os.environ.get(CACHE_DIR_ENV)
    if given:
        return Path(given).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "cute_flash"


def source_fingerprint() -> str:
    """Hash of everything that shapes a compiled kernel besides its config: this package's Python
    sources, the versions of Python, the DSL and TVM-FFI, and the DSL's settings (its environment
    switches: debug, line info, assertions, optimisation level, and the CUDA runtime flavour it
    loaded, cu12 or cu13). Computed once per process."""
    global _fingerprint
    if _fingerprint is None:
        from importlib.metadata import version

        import cutlass
        from cutlass.cutlass_dsl import CuTeDSL

        h = hashlib.sha256()
        h.update(f"py{sys.version_info.major}.{sys.version_info.minor}".encode())
        h.update(f"cutlass={cutlass.__version__};tvm_ffi={version('apache-tvm-ffi')}".encode())
        # (The target is in each entry's key; the DSL's default one is left out here.)
        settings = CuTeDSL._get_dsl().envar.cache_key_str()
        h.update(";".join(f for f in settings.split(";") if not f.startswith("arch=")).encode())
        root = Path(__file__).resolve().parent
        for src in sorted(root.rglob("*.py")):
            body = src.read_bytes()
            h.update(src.relative_to(root).as_posix().encode() + len(body).to_bytes(8, "little") + body)
        _fingerprint = h.hexdigest()[:20]
    return _fingerprint


def entry_path(key: str) -> Path:
    """Where the entry of config key ``key`` (its repr, with the compile target resolved) lives."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:40]
    return cache_root() / source_fingerprint() / f"{digest}.cfk"


def load(path: Path) -> Any | None:
    """The compiled function of the entry at ``path``, or None where there is none or it is bad."""
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    head = len(MAGIC) + _DIGEST
    body = blob[head:]
    if blob[:len(MAGIC)] != MAGIC or hashlib.sha256(body).digest() != blob[len(MAGIC):head] or not body:
        return None
    try:
        return _load_object(body)
    except Exception as err:  # an entry this DSL cannot link: a miss, compiled and replaced
        _warn_once("load", f"cute_flash: compile cache entry {path} did not load ({type(err).__name__}: "
                           f"{err}); compiling instead")
        return None


def load_runtime() -> None:
    """Load what linking an entry needs (TVM-FFI and the DSL's runtime libraries, made global so
    every linked entry resolves against one copy) and the source fingerprint, so the first cached
    variant a process launches costs its link only. Called when the launch stack is imported."""
    import ctypes

    import tvm_ffi  # noqa: F401  (the linked functions are TVM-FFI functions)
    from cutlass.runtime import find_runtime_libraries

    for lib in find_runtime_libraries(enable_tvm_ffi=True):
        if os.path.exists(lib):
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
    if enabled():
        source_fingerprint()


def _load_object(body: bytes) -> Any:
    import cutlass.cute as cute

    def link(file: str) -> Any:
        return getattr(cute.runtime.load_module(file, enable_tvm_ffi=True), _FUNCTION)

    # The loader reads a path; an anonymous in-memory file keeps the cache folder untouched.
    try:
        fd = os.memfd_create("cute_flash_kernel")
    except (AttributeError, OSError):  # (no memfd here: a private temporary file)
        fd = None
    if fd is not None and os.path.exists(f"/proc/self/fd/{fd}"):
        try:
            os.write(fd, body)
            return link(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
    if fd is not None:
        os.close(fd)
    tmp = tempfile.NamedTemporaryFile(suffix=".o", delete=False)
    try:
        with tmp:
            tmp.write(body)
        return link(tmp.name)
    finally:
        os.unlink(tmp.name)


def store(path: Path, compiled: Any) -> bool:
    """Write ``compiled`` (a DSL-compiled function) as the entry at ``path``; False where the cache
    folder is not writable (the kernel still runs, it is compiled again next process)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
    except OSError as err:
        _warn_once("unwritable", f"cute_flash: compile cache {path.parent} is not writable ({err}); kernels "
                   f"are compiled in every process (set {CACHE_DIR_ENV}, or {CACHE_ENV}=0)")
        return False
    os.close(fd)
    obj = tmp + ".o"
    try:
        compiled.export_to_c(object_file_path=obj, function_name=_FUNCTION)
        body = Path(obj).read_bytes()
        if not body:
            raise OSError("empty object file")
        Path(tmp).write_bytes(MAGIC + hashlib.sha256(body).digest() + body)
        os.chmod(tmp, 0o644)  # (mkstemp's 0600 would hide a shared cache from other users)
        os.replace(tmp, path)
        return True
    except Exception as err:  # a full disk, a killed export: no entry rather than a partial one
        _warn_once("write", f"cute_flash: could not write compile cache entry {path} ({type(err).__name__}: "
                   f"{err})")
        return False
    finally:
        for leftover in (tmp, obj):
            with contextlib.suppress(OSError):
                os.unlink(leftover)


def read_note(key: str, kind: str) -> str | None:
    """A short text kept beside the entry of ``key`` (what a plan learnt compiling it: its spill
    bytes), or None."""
    try:
        return entry_path(key).with_suffix(f".{kind}").read_text()
    except OSError:
        return None


def write_note(key: str, kind: str, text: str) -> None:
    """``read_note``'s text, written whole (a private name renamed into place) or not at all."""
    path = entry_path(key).with_suffix(f".{kind}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError:
        pass  # (an unwritable cache: the plan compiles to learn it again next process)


def fetch_or_compile(key: str, compile_fn: Callable[[], Any], dsl_lock: Any = None) -> Any:
    """The cached function for ``key``, else ``compile_fn()`` stored under it. Processes that want
    the same missing entry compile it once: the others wait for the first one's lock, then load.
    The entry is written by a thread after the function is returned (the export takes a tenth of
    a compile, off the first call's path); that thread holds the entry's lock until it is written,
    and ``dsl_lock`` (the caller's compile lock: the DSL is not thread-safe) while it exports."""
    path = entry_path(key)
    fn = load(path)
    if fn is not None:
        return fn
    lock = _lock(path.with_suffix(".lock"))
    try:
        fn = load(path)
        if fn is None:
            fn = compile_fn()
            writer = threading.Thread(target=_store_and_unlock, args=(path, fn, lock, dsl_lock),
                                      name="cute_flash-cache-writer")
            _writers.append(writer)
            writer.start()
            lock = None  # (the writer releases it)
        return fn
    finally:
        _unlock(lock)


def flush() -> None:
    """Wait until every entry this process compiled is on disk."""
    while _writers:
        _writers.pop().join()


_writers: list[threading.Thread] = []


def _store_and_unlock(path: Path, compiled: Any, lock: int | None, dsl_lock: Any) -> None:
    try:
        with dsl_lock if dsl_lock is not None else contextlib.nullcontext():
            store(path, compiled)
    finally:
        _unlock(lock)


def _lock(lock_path: Path) -> int | None:
    """An exclusive advisory lock on ``lock_path`` (its descriptor), or None where locks are not
    available (concurrent compiles are then wasted work, still safe)."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                return fd  # (a holder stuck past any compile time: compile without the lock)
            time.sleep(0.05)
        except OSError:
            return fd  # (no locks on this file system, e.g. NFS without lockd: compile unlocked)


def _unlock(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # (closing releases the lock; a process that dies releases it too)


_warned: set[str] = set()


def _warn_once(kind: str, message: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _fingerprint_dirs() -> list[Path]:
    root = cache_root()
    if not root.is_dir():
        return []
    return [d for d in root.iterdir() if d.is_dir() and len(d.name) == 20
            and all(c in "0123456789abcdef" for c in d.name)]


def entries() -> list[Path]:
    """Every entry under the cache folder, of any source fingerprint."""
    return sorted(p for d in _fingerprint_dirs() for p in d.glob("*.cfk"))


def clear() -> int:
    """Remove the entries, their notes, locks and temporaries of every fingerprint folder (and the folders);
    returns how many entries went. Nothing else in the cache folder is touched."""
    gone = 0
    for d in _fingerprint_dirs():
        for p in [*d.glob("*.cfk"), *d.glob("*.lock"), *d.glob("*.spill"), *d.glob(".*.tmp*")]:
            with contextlib.suppress(OSError):
                p.unlink()
                gone += p.suffix == ".cfk"
        with contextlib.suppress(OSError):
            d.rmdir()
    return gone
