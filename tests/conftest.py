"""Shared test setup for ``tests/cpu`` (no GPU needed) and ``tests/gpu`` (every test marked ``gpu``):
the ``gpu`` marker skips itself without CUDA, ``seed`` gives each test fresh random inputs whose
seed is printed (shown by pytest when the test fails), and the shared helpers of this folder
(``attention_checks``, ``sass_manifest``) import from either subfolder, whatever the rootdir or
import mode."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

# Tests compile what they check: the on-disk compile cache stays off unless a test (or the caller,
# e.g. scripts/gpu_tests.sh sharing compiles between its shards) turns it on.
os.environ.setdefault("CUTE_FLASH_CACHE", "0")

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

# The tests this run executes (after ``-m`` / ``-k`` deselection): module fixtures that compile in
# parallel ask it which variants to build.
SELECTED_ITEMS = pytest.StashKey[list]()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    config.stash[SELECTED_ITEMS] = list(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def selected_tests(request: pytest.FixtureRequest) -> list[pytest.Item]:
    """The test items this run executes, after deselection."""
    return request.config.stash.get(SELECTED_ITEMS, [])


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
    """Stand-in launchers (``cute_flash.launch.run_fwd`` / ``run_bwd``, which the ops' CUDA
    implementations call) that record their calls, and a no-op ``torch.cuda.device``, so those
    implementations run with CPU tensors and their side of the launcher interface can be checked
    without a GPU. Each call is recorded as ``(kind, args, kwargs)``, kind ``fwd`` or ``bwd``."""
    from cute_flash import launch

    calls: list = []
    monkeypatch.setattr(launch, "run_fwd", lambda *a, **kw: calls.append(("fwd", a, kw)))
    monkeypatch.setattr(launch, "run_bwd", lambda *a, **kw: calls.append(("bwd", a, kw)))
    monkeypatch.setattr(torch.cuda, "device", lambda _dev: contextlib.nullcontext())
    return calls
