"""The dense reference computes long problems in blocks of query rows, so the CPU path of the ops
never holds every score of a long problem at once; the blocks give the same result as one pass."""

from __future__ import annotations

import pytest
import torch

from cute_flash import reference


@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window_size=(40, 7)), dict(softcap=5.0)],
                         ids=["full", "causal", "window", "softcap"])
def test_query_blocks_give_the_single_pass_result(monkeypatch: pytest.MonkeyPatch, mask: dict) -> None:
    q = torch.randn(2, 301, 4, 32, dtype=torch.float64)
    k, v = torch.randn(2, 350, 2, 32, dtype=torch.float64), torch.randn(2, 350, 2, 16, dtype=torch.float64)
    whole = reference.attention_ref(q, k, v, **mask)
    # 37 query rows per block: 9 blocks, the last one short.
    monkeypatch.setattr(reference, "REF_BLOCK_BYTES", 2 * 4 * 350 * 8 * 37)
    assert reference.query_block_rows(2, 4, 350, torch.float64) == 37
    blocked = reference.attention_ref(q, k, v, **mask)
    for a, b in zip(whole, blocked, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_long_problem_keeps_each_block_of_scores_under_the_budget() -> None:
    # README's example shape on CPU: 2 x 4096 queries x 16 heads over 4096 keys is 2 GiB of fp32
    # scores in one pass; in blocks, each holds at most REF_BLOCK_BYTES.
    rows = reference.query_block_rows(2, 16, 4096, torch.float32)
    assert rows < 4096
    assert 2 * 16 * rows * 4096 * 4 <= reference.REF_BLOCK_BYTES


def test_the_cpu_backward_uses_the_same_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    q, k, v, do = (torch.randn(1, 130, 2, 16, dtype=torch.float64) for _ in range(4))
    out, lse = reference.attention_ref(q, k, v, causal=True)
    whole = reference.attention_bwd_ref(do, q, k, v, out, lse, causal=True)
    monkeypatch.setattr(reference, "REF_BLOCK_BYTES", 2 * 130 * 8 * 20)
    blocked = reference.attention_bwd_ref(do, q, k, v, out, lse, causal=True)
    for a, b in zip(whole, blocked, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
