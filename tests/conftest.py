"""Shared test setup: the ``gpu`` marker skips itself without CUDA, and ``seed`` gives each test
fresh random inputs whose seed is printed (shown by pytest when the test fails)."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed() -> int:
    """A new seed per test (``torch.seed()``), or ``CUTE_FLASH_SEED`` to replay a failure."""
    env = os.environ.get("CUTE_FLASH_SEED")
    s = int(env) if env else torch.seed()
    torch.manual_seed(s)
    print(f"seed={s}  (replay: CUTE_FLASH_SEED={s})")
    return s
