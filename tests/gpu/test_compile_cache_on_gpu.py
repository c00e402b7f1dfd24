"""The on-disk compile cache on the GPU: a process that loads the forward and backward kernels
another compiled (or that ``python -m cute_flash warmup`` compiled) computes bit for bit what the
compiling process did (the deterministic backward: dQ's atomic adds in a fixed order), without
compiling anything; the same for the ``fp8=True`` forward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

_RUN = textwrap.dedent("""
    import json, sys, time, torch
    from cute_flash import jit
    compiled = []
    real = jit._compile
    jit._compile = lambda cfg, keep: (compiled.append(cfg.describe()), real(cfg, keep))[1]
    import cute_flash
    torch.manual_seed(0)
    mode = sys.argv[2]
    q, k, v = (torch.randn(2, 777, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=mode != "fp8")
               for h in (16, 4, 4))
    t0 = time.perf_counter()
    if mode == "fp8":  # (the fp8=True forward: quantize, then e4m3 attention)
        out = cute_flash.flash_attn_func(q, k, v, causal=True, fp8=True)
    else:
        out = cute_flash.flash_attn_func(q, k, v, causal=True, deterministic=mode == "deterministic")
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    if mode != "fp8":
        out.backward(torch.ones_like(out))
    torch.save([out.detach(), q.grad, k.grad, v.grad], sys.argv[1])
    print(json.dumps({"compiled": compiled, "first_call_s": first}))
""")


def _run(out: Path, env: dict, backward: str = "deterministic") -> dict:
    res = subprocess.run([sys.executable, "-c", _RUN, str(out), backward], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_loaded_kernels_compute_what_the_compiled_ones_did(tmp_path: Path) -> None:
    env = dict(os.environ, CUTE_FLASH_CACHE="1", CUTE_FLASH_CACHE_DIR=str(tmp_path / "cache"))
    first = _run(tmp_path / "a.pt", env)
    second = _run(tmp_path / "b.pt", env)
    assert len(first["compiled"]) >= 4, "forward, preprocess, main and postprocess compile in the first"
    assert second["compiled"] == [], f"the second process compiled {second['compiled']}"
    for a, b in zip(torch.load(tmp_path / "a.pt"), torch.load(tmp_path / "b.pt"), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["default", "fp8"])
def test_a_warmup_compiles_what_the_launch_path_then_loads(tmp_path: Path, mode: str) -> None:
    env = dict(os.environ, CUTE_FLASH_CACHE="1", CUTE_FLASH_CACHE_DIR=str(tmp_path / "cache"))
    args = ["warmup", "--hdim", "128", "--heads", "16", "4", "--seqlen", "777", "--workers", "4"]
    warm = subprocess.run([sys.executable, "-m", "cute_flash", *args, *(["--fp8"] if mode == "fp8" else [])],
                          env=env, capture_output=True, text=True, timeout=600)
    assert warm.returncode == 0, warm.stderr[-3000:]
    run = _run(tmp_path / "c.pt", env, backward=mode)
    assert run["compiled"] == [], f"the warm-up missed {run['compiled']}"
