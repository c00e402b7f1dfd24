"""Document packs through ``flash_attn_varlen_func`` on a CUDA GPU: how LLMs are trained.

Random packs (``attention_checks.random_pack``: 1-16 sequences of 0-4096 tokens in random order,
totals that are not tile multiples, ``max_seqlen`` sometimes above the longest sequence) over GQA
ratios 1, 4, 8 and all heads, every head dim, no mask / causal / sliding windows, queries packed
like the keys or on their own lengths, forward and backward against the fp32 reference under the
accuracy rule of ``attention_checks``. Grids are sized by ``max_seqlen``, so most CTAs of a pack
fall past the end of their sequence; the per-sequence scratch of the backward holds only each
sequence's own tiles. A new pack is drawn from each run's seed (printed; ``CUTE_FLASH_SEED``
replays it). The FP8 varlen path has its pack test in ``test_fp8_fwd_matches_reference``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from cute_flash.dispatch import BWD_KERNEL_ENV

from attention_checks import balanced_sample, check_against_rule, cu_seqlens, make_tensor, random_pack

pytestmark = pytest.mark.gpu

FP16, BF16 = torch.float16, torch.bfloat16
HEADS = 16
KV_HEADS = (16, 4, 2, 1)  # GQA ratios 1, 4, 8 and all heads on one kv head


@dataclass(frozen=True)
class PackCase:
    hdim: int = 128
    heads: int = HEADS
    kv_heads: int = 4
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    own_k_lens: bool = False  # keys of other lengths than the queries (cross attention, prefill chunks)
    dtype: torch.dtype = BF16
    deterministic: bool = False

    def __str__(self) -> str:
        mask = "causal" if self.causal else "" if self.window == (-1, -1) else f"win{self.window}"
        parts = ["fp16" if self.dtype == FP16 else "bf16", f"d{self.hdim}", f"h{self.heads}:{self.kv_heads}",
                 mask, "kq" if self.own_k_lens else "", "det" if self.deterministic else ""]
        return "-".join(p for p in parts if p)


def pack_cases(n: int = 16, seed: int = 29) -> list[PackCase]:
    """A fixed, balanced sample: each axis repeated to length n and shuffled on its own."""
    rng = random.Random(seed)
    axes = {
        "hdim": (64, 96, 128, 192, 256, 32, 128, 64),
        "kv_heads": KV_HEADS,
        "mask": ((False, (-1, -1)), (True, (-1, -1)), (False, (256, 0)), (True, (1024, -1)),
                 (False, (300, 100))),
        "own_k_lens": (False, True, False),
        "dtype": (BF16, FP16, BF16),
        "deterministic": (False, False, False, True),
    }
    cases = []
    for row in balanced_sample(axes, n, rng):
        causal, window = row.pop("mask")
        cases.append(PackCase(causal=causal, window=window, **row))
    return cases


def check_pack(lens_q: list[int], lens_k: list[int], case: PackCase, seed: int, slack: int = 0) -> None:
    q = make_tensor((sum(lens_q), case.heads, case.hdim), case.dtype, "bnhd")
    k = make_tensor((sum(lens_k), case.kv_heads, case.hdim), case.dtype, "bnhd")
    v = make_tensor((sum(lens_k), case.kv_heads, case.hdim), case.dtype, "bnhd")
    label = f"{case} lens_q={lens_q} lens_k={lens_k} slack={slack}"
    check_against_rule(q, k, v, seed, label, cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_k=cu_seqlens(lens_k),
                       max_seqlen_q=max(lens_q) + slack, max_seqlen_k=max(lens_k) + slack, causal=case.causal,
                       window_size=case.window, deterministic=case.deterministic)


@pytest.mark.parametrize("case", pack_cases(), ids=str)
def test_random_document_pack_within_twice_pytorch_error(seed, case):
    rng = random.Random(seed)
    lens_q = random_pack(rng)
    lens_k = lens_q
    if case.own_k_lens:
        lens_k = [rng.randint(0, 4096) if n else 0 for n in lens_q]
    slack = rng.choice((0, 0, rng.randint(1, 300)))
    check_pack(lens_q, lens_k, case, seed, slack)


@pytest.mark.parametrize("lens,case", [
    # A 2460-token pack whose last sequence is far shorter than the longest: the backward's
    # postprocess CTAs past its end used to read past the dQ accumulator (illegal address).
    ([869, 1131, 460], PackCase(hdim=128, heads=32, kv_heads=8, causal=True)),
    ([869, 1131, 460], PackCase(hdim=64, kv_heads=1, deterministic=True)),
    ([3017, 2955, 69, 1092], PackCase(hdim=128, kv_heads=4)),
], ids=lambda x: str(x))
def test_pack_ending_in_a_short_sequence_within_twice_pytorch_error(seed, lens, case):
    q = make_tensor((sum(lens), case.heads, case.hdim), case.dtype, "bnhd")
    k = make_tensor((sum(lens), case.kv_heads, case.hdim), case.dtype, "bnhd")
    v = make_tensor((sum(lens), case.kv_heads, case.hdim), case.dtype, "bnhd")
    cu = cu_seqlens(lens)
    check_against_rule(q, k, v, seed, f"{case} lens={lens}", cu_seqlens_q=cu, cu_seqlens_k=cu,
                       max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=case.causal,
                       deterministic=case.deterministic)


def test_random_document_pack_on_the_sm80_backward(seed, monkeypatch):
    """The FA2 backward (every GPU; forced on Hopper) on a random pack."""
    monkeypatch.setenv(BWD_KERNEL_ENV, "sm80")
    rng = random.Random(seed)
    lens = random_pack(rng, max_total=8000)
    check_pack(lens, lens, PackCase(hdim=128, kv_heads=2, causal=True), seed, slack=rng.randint(0, 200))
