"""The SASS manifest: a digest of the machine code of every shipped kernel variant, so a change to
the host code (module layout, configs, dispatch) can show that the kernels it launches are the same.

A variant is named by what a user asks for (``dispatch.Variant``: arch, direction, dtype, head dims,
masks, features) and compiled through the launch path's own choice of kernels, so the manifest
holds whatever the dispatch picks for it. ``python tests/sass_manifest.py`` rewrites
``tests/sass_manifest.json`` (do that only for a change meant to alter the machine code, and say so
in the commit).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from cute_flash.tools import inspect as ins

MANIFEST = Path(__file__).with_name("sass_manifest.json")

_MODES = (dict(), dict(causal=True), dict(local=True), dict(softcap=True, causal=True),
          dict(varlen=True, causal=True))


def variants() -> list[ins.Variant]:
    """Every head dim of every family with each feature once, plus the fp16 and d_v != d entries."""
    out: list[ins.Variant] = []
    for arch in ("sm_80", "sm_90a"):
        for d in (32, 64, 96, 128, 160, 192, 256):
            for mode in _MODES:
                out.append(ins.Variant(arch=arch, kernel="fwd", hdim=d, **mode))
        bwd_hdims = (32, 64, 96, 128, 160, 192, 256) if arch == "sm_80" else (64, 96, 128, 192, 256)
        for d in bwd_hdims:
            for mode in (*_MODES, dict(deterministic=True, causal=True), dict(deterministic=True)):
                out.append(ins.Variant(arch=arch, kernel="bwd", hdim=d, **mode))
        for kernel in ("fwd", "bwd"):
            out.append(ins.Variant(arch=arch, kernel=kernel, dtype="fp16", hdim=128, causal=True))
            out.append(ins.Variant(arch=arch, kernel=kernel, hdim=192, hdim_v=128, causal=True))
    for d in (64, 128, 256):
        for mode in (dict(), dict(causal=True), dict(varlen=True, causal=True)):
            out.append(ins.Variant(arch="sm_90a", kernel="fwd", dtype="e4m3", hdim=d, **mode))
    return out


def digests(variant: ins.Variant) -> list[str]:
    """Sorted SASS digests of every kernel the variant launches."""
    out: list[str] = []
    for cfg in ins.configs_for(variant):
        sass, _ = ins.cubin_sass_and_usage(ins.compile_config(cfg).cubin)
        if sass is None:
            raise RuntimeError("no nvdisasm / cuobjdump: install the dev extra")
        out += ins.sass_digests(sass)
    return sorted(out)


def compute(selected: list[ins.Variant], workers: int) -> dict[str, list[str]]:
    if workers <= 1:
        return {v.label(): digests(v) for v in selected}
    # spawn, not fork: the parent may already hold an MLIR context and its threads.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip((v.label() for v in selected), pool.map(digests, selected), strict=True))


def load() -> dict[str, list[str]]:
    return json.loads(MANIFEST.read_text())


if __name__ == "__main__":
    n = int(os.environ.get("CUTE_FLASH_COMPILE_WORKERS", os.cpu_count() or 1))
    table = compute(variants(), n)
    MANIFEST.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"{len(table)} variants -> {MANIFEST}", file=sys.stderr)
