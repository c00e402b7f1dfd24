"""Shared test setup: the ``gpu`` marker skips itself without CUDA, and ``seed`` gives each test
fresh random inputs whose seed is printed (shown by pytest when the test fails)."""

from __future__ import annotations

import contextlib
import os
import sys
import types

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def exact_fp32_reference():
    """TF32 would make the fp32 references of the GPU tests only ~10 bits accurate."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def seed() -> int:
    """A new seed per test (``torch.seed()``), or ``CUTE_FLASH_SEED`` to replay a failure."""
    env = os.environ.get("CUTE_FLASH_SEED")
    s = int(env) if env else torch.seed()
    torch.manual_seed(s)
    print(f"seed={s}  (replay: CUTE_FLASH_SEED={s})")
    return s


@pytest.fixture
def fake_launchers(monkeypatch: pytest.MonkeyPatch) -> list:
    """Stand-in kernel modules (``cute_flash.fwd``/``cute_flash.bwd``) that record their calls, and
    a no-op ``torch.cuda.device``, so the CUDA implementations of the ops run with CPU tensors and
    their side of the launcher interface can be checked without a GPU."""
    calls: list = []
    fwd_mod = types.ModuleType("cute_flash.fwd")
    bwd_mod = types.ModuleType("cute_flash.bwd")
    fwd_mod.run_fwd = lambda *a, **kw: calls.append(("fwd", a, kw))
    bwd_mod.run_bwd = lambda *a, **kw: calls.append(("bwd", a, kw))
    monkeypatch.setitem(sys.modules, "cute_flash.fwd", fwd_mod)
    monkeypatch.setitem(sys.modules, "cute_flash.bwd", bwd_mod)
    monkeypatch.setattr(torch.cuda, "device", lambda _dev: contextlib.nullcontext())
    return calls
