"""The on-disk compile cache (``cute_flash/disk_cache.py``): a second process loads what the first
compiled, and a bad, stale or concurrently written entry never becomes a crash or a wrong kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cute_flash import disk_cache, jit
from cute_flash.hopper.bwd_config import BwdSm90PostConfig

# A small kernel (the sm90 backward's dQ conversion): compiles in well under a second.
CFG = BwdSm90PostConfig(target="sm_90a", dtype="bf16", hdim=64, tile_m=64, varlen=False)
OTHER = BwdSm90PostConfig(target="sm_90a", dtype="fp16", hdim=128, tile_m=64, varlen=True)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(disk_cache.CACHE_ENV, "1")
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(jit, "_cache", {})
    monkeypatch.setattr(disk_cache, "_warned", set())
    return tmp_path / "cache"


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every real compile, recorded (the cache's hits never reach the compiler)."""
    seen: list = []
    real = jit._compile

    def counting(cfg, keep):
        seen.append(cfg)
        return real(cfg, keep)

    monkeypatch.setattr(jit, "_compile", counting)
    return seen


def _compile(cfg):
    """``jit.compile_kernel``, then wait for its cache entry to be written (a writer thread)."""
    fn = jit.compile_kernel(cfg)
    disk_cache.flush()
    return fn


def _fresh_process_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jit, "_cache", {})


def test_a_compiled_variant_is_loaded_from_disk_by_the_next_process(cache_dir, compiles, monkeypatch) -> None:
    fn = _compile(CFG)
    assert len(compiles) == 1 and callable(fn)
    assert [p.suffix for p in disk_cache.entries()] == [".cfk"]
    _fresh_process_cache(monkeypatch)
    loaded = _compile(CFG)
    assert len(compiles) == 1, "a cached variant was compiled again"
    assert callable(loaded) and loaded is not fn
    assert _compile(CFG) is loaded  # (then held in memory)


def test_variants_and_targets_have_their_own_entries(cache_dir, compiles, monkeypatch) -> None:
    _compile(CFG)
    _compile(OTHER)
    assert len(disk_cache.entries()) == 2
    # A config with no target (the current device) shares the entry of what the DSL compiles
    # it for.
    on_device = BwdSm90PostConfig(target=None, dtype="bf16", hdim=64, tile_m=64, varlen=False)
    monkeypatch.setattr(jit, "_dsl_arch", lambda: "sm_90a")
    assert jit._disk_key(CFG) == jit._disk_key(on_device)
    monkeypatch.setattr(jit, "_dsl_arch", lambda: "sm_80")
    assert jit._disk_key(CFG) != jit._disk_key(on_device)


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage_with_a_valid_digest", "wrong_magic"])
def test_a_damaged_entry_is_compiled_again_and_replaced(cache_dir, compiles, monkeypatch, damage) -> None:
    import hashlib

    _compile(CFG)
    (entry,) = disk_cache.entries()
    blob = entry.read_bytes()
    if damage == "truncated":
        entry.write_bytes(blob[: len(blob) // 2])
    elif damage == "empty":
        entry.write_bytes(b"")
    elif damage == "garbage_with_a_valid_digest":
        body = os.urandom(4096)
        entry.write_bytes(disk_cache.MAGIC + hashlib.sha256(body).digest() + body)
    else:
        entry.write_bytes(b"XXXXXXXX" + blob[8:])
    _fresh_process_cache(monkeypatch)
    if damage == "garbage_with_a_valid_digest":  # (a whole entry that does not link: said once)
        with pytest.warns(RuntimeWarning, match="did not load"):
            assert callable(_compile(CFG))
    else:
        assert callable(_compile(CFG))
    assert len(compiles) == 2, "a damaged entry must be compiled again"
    assert entry.read_bytes() == blob or disk_cache.load(entry) is not None, "the entry was not replaced"
    _fresh_process_cache(monkeypatch)
    _compile(CFG)
    assert len(compiles) == 2, "the replaced entry did not load"


def test_a_dsl_version_change_misses_instead_of_loading_stale_code(cache_dir, compiles, monkeypatch) -> None:
    import cutlass

    _compile(CFG)
    first = disk_cache.entry_path(jit._disk_key(CFG))
    monkeypatch.setattr(cutlass, "__version__", cutlass.__version__ + ".post99")
    monkeypatch.setattr(disk_cache, "_fingerprint", None)
    _fresh_process_cache(monkeypatch)
    _compile(CFG)
    assert len(compiles) == 2
    assert disk_cache.entry_path(jit._disk_key(CFG)) != first
    assert len(disk_cache.entries()) == 2


def test_the_cache_can_be_turned_off(cache_dir, compiles, monkeypatch) -> None:
    monkeypatch.setenv(disk_cache.CACHE_ENV, "0")
    _compile(CFG)
    _fresh_process_cache(monkeypatch)
    _compile(CFG)
    assert len(compiles) == 2
    assert not cache_dir.exists()


def test_an_unwritable_cache_folder_warns_and_still_compiles(tmp_path, compiles, monkeypatch) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(disk_cache.CACHE_ENV, "1")
    monkeypatch.setenv(disk_cache.CACHE_DIR_ENV, str(blocker / "cache"))
    monkeypatch.setattr(jit, "_cache", {})
    monkeypatch.setattr(disk_cache, "_warned", set())
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert callable(_compile(CFG))
    assert len(compiles) == 1


def test_the_entry_is_written_after_the_function_is_handed_back(cache_dir, compiles, monkeypatch) -> None:
    """The export (a tenth of a compile) is off the first call's path: a thread writes the entry
    while the caller launches, holding the entry's lock until it is written."""
    import threading

    release, real_store = threading.Event(), disk_cache.store
    monkeypatch.setattr(disk_cache, "store", lambda path, fn: release.wait(60) and real_store(path, fn))
    fn = jit.compile_kernel(CFG)
    assert callable(fn) and not disk_cache.entries()
    release.set()
    disk_cache.flush()
    assert len(disk_cache.entries()) == 1 and disk_cache.load(disk_cache.entries()[0]) is not None


def test_kept_artifacts_bypass_the_cache(cache_dir, compiles) -> None:
    ptx, cubin = jit.compile_artifacts(CFG)
    assert "ld.global" in ptx or "st.global" in ptx
    assert isinstance(cubin, bytes)
    assert not disk_cache.entries()


_WORKER = textwrap.dedent("""
    import json, sys
    from cute_flash import jit
    from cute_flash.hopper.bwd_config import BwdSm90PostConfig
    compiled = []
    real = jit._compile
    jit._compile = lambda cfg, keep: (compiled.append(repr(cfg)), real(cfg, keep))[1]
    for dtype, hdim in (("bf16", 64), ("fp16", 128)):
        cfg = BwdSm90PostConfig(target="sm_90a", dtype=dtype, hdim=hdim, tile_m=64, varlen=False)
        assert callable(jit.compile_kernel(cfg))
    print(json.dumps(compiled))
""")


@pytest.mark.slow
def test_eight_processes_filling_the_cache_at_once_compile_each_variant_once(tmp_path) -> None:
    env = dict(os.environ, CUTE_FLASH_CACHE="1", CUTE_FLASH_CACHE_DIR=str(tmp_path / "cache"),
               CUTE_FLASH_ARCH="sm_90a")
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(8)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-2000:]
    compiled = [c for out, _ in outs for c in json.loads(out.strip().splitlines()[-1])]
    assert len(compiled) == 2, f"each variant should compile in one process only, got {compiled}"
    entries = sorted((tmp_path / "cache").glob("*/*.cfk"))
    assert len(entries) == 2 and all(disk_cache.load(e) is not None for e in entries)
    assert not list((tmp_path / "cache").glob("*/.*")), "temporary files left behind"


_FIRST_LOAD = textwrap.dedent("""
    import json, sys, time
    import cute_flash
    loaded_at_import = "tvm_ffi" in sys.modules and "cutlass" in sys.modules
    from cute_flash import disk_cache, jit
    from cute_flash.hopper.bwd_config import BwdSm90PostConfig
    fingerprinted = disk_cache._fingerprint is not None
    jit._compile = lambda cfg, keep: sys.exit("compiled a cached variant")
    t0 = time.perf_counter()
    cfg = BwdSm90PostConfig(target="sm_90a", dtype="bf16", hdim=64, tile_m=64, varlen=False)
    fn = jit.compile_kernel(cfg)
    print(json.dumps([loaded_at_import, fingerprinted, callable(fn), time.perf_counter() - t0]))
""")


def test_after_import_a_cached_variant_costs_only_its_link(cache_dir, compiles) -> None:
    """``import cute_flash`` loads the DSL, TVM-FFI, the runtime libraries and the fingerprint, so a
    fresh process's first cached variant is a read and an in-memory link (milliseconds)."""
    _compile(CFG)
    env = dict(os.environ, CUTE_FLASH_CACHE="1", CUTE_FLASH_CACHE_DIR=str(cache_dir))
    res = subprocess.run([sys.executable, "-c", _FIRST_LOAD], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    at_import, fingerprinted, ok, seconds = json.loads(res.stdout.strip().splitlines()[-1])
    assert at_import and fingerprinted and ok
    assert seconds < 0.25, f"loading a cached variant took {seconds:.3f} s"
