"""The sm90a (FlashAttention-3 style) forward on a Hopper GPU, called through its config (so the
ping-pong switch, packed GQA and the persistent grid can be set), against the fp32 reference with
the usual rule: error at most twice the same-dtype PyTorch error, + 1e-3.
"""

from __future__ import annotations

import math

import pytest
import torch

from cute_flash import jit
from cute_flash.hopper.fwd_config import FwdSm90Config
from cute_flash.launch import normalize_window, tile_counter
from cute_flash.reference import attention_ref

from attention_checks import needs_hopper

pytestmark = [pytest.mark.gpu, needs_hopper]

NO_SINKS_NO_AUX = (None,) * 5  # the call's sinks and aux tensors (device/sinks.py, device/mods.py)

GPU_CASES = [
    # (B, Nq, Nk, H, Hkv, d, causal, window, softcap, varlen, pingpong); None = the tuned default of
    # that head dim.
    (2, 256, 256, 4, 4, 128, False, (-1, -1), 0.0, False, None),
    (2, 200, 333, 4, 2, 64, True, (-1, -1), 0.0, False, None),
    (2, 333, 200, 4, 2, 64, False, (-1, -1), 0.0, False, None),  # 192-row tile, 3 warpgroups
    (1, 300, 300, 2, 1, 256, True, (-1, -1), 0.0, False, None),
    (1, 300, 517, 2, 2, 256, False, (-1, -1), 0.0, False, None),
    (2, 257, 513, 4, 4, 128, False, (64, 32), 0.0, False, None),
    (2, 256, 256, 4, 4, 128, True, (-1, -1), 30.0, False, None),
    (2, 1, 129, 4, 4, 64, False, (-1, -1), 0.0, False, None),
    (3, 190, 250, 4, 2, 128, True, (-1, -1), 0.0, True, None),
    (3, 190, 250, 4, 4, 64, False, (-1, -1), 0.0, True, None),
    (2, 177, 301, 2, 2, 96, True, (-1, -1), 0.0, False, None),
    (2, 177, 301, 2, 2, 192, False, (-1, -1), 0.0, False, None),
    (2, 512, 512, 4, 4, 128, True, (-1, -1), 0.0, False, False),
    (2, 333, 555, 4, 2, 128, True, (-1, -1), 0.0, False, True),
    (2, 512, 512, 4, 4, 128, False, (-1, -1), 0.0, False, True),
    (2, 333, 555, 4, 2, 256, False, (-1, -1), 0.0, False, False),  # O rescaled before P V
]


def _check_on_hopper(case: tuple, pack: int = 1, **extra: bool | int) -> None:
    """Run one config on the GPU against the fp32 reference (the 2x rule, + 1e-3)."""
    B, Nq, Nk, H, Hkv, d, causal, window, softcap, varlen, pingpong = case
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, Nq, H, d, device=dev, dtype=dt)
    k = torch.randn(B, Nk, Hkv, d, device=dev, dtype=dt)
    v = torch.randn(B, Nk, Hkv, d, device=dev, dtype=dt)
    cu_q = cu_k = None
    if varlen:  # ragged lengths, packed
        lq = [Nq - 37 * i for i in range(B)]
        lk = [Nk - 23 * i for i in range(B)]
        q = torch.cat([q[i, :lq[i]] for i in range(B)])
        k = torch.cat([k[i, :lk[i]] for i in range(B)])
        v = torch.cat([v[i, :lk[i]] for i in range(B)])
        cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], device=dev, dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], device=dev, dtype=torch.int32)
        lse = torch.full((H, q.shape[0]), float("nan"), device=dev)
    else:
        lse = torch.full((B, H, Nq), float("nan"), device=dev)
    out = torch.full_like(q, float("nan"))
    scale = 1.0 / math.sqrt(d)
    # Through the config directly, so the ping-pong switch, packed GQA and the grid can be set.
    c, local, left, right = normalize_window(causal, window)
    cfg = FwdSm90Config(target=None, dtype="bf16", hdim=d, hdim_v=d, causal=c, local=local,
                        softcap=softcap > 0, varlen=varlen, pingpong=pingpong, pack_gqa=pack, **extra)
    fn = jit.compile_kernel(cfg)
    mq = max(lq) if varlen else Nq
    fn(q, k, v, out, lse, cu_q, cu_k, scale, softcap, left, right, mq, tile_counter(cfg, q.device),
       *NO_SINKS_NO_AUX)
    torch.cuda.synchronize()
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap,
              cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    o_ref, lse_ref = attention_ref(q, k, v, **kw)
    o_lo, _ = attention_ref(q, k, v, upcast=False, **kw)
    err = (out.float() - o_ref.float()).abs().max().item()
    err_lo = (o_lo.to(dt).float() - o_ref.float()).abs().max().item()
    assert err <= 2 * err_lo + 1e-3, (err, err_lo)
    fin = torch.isfinite(lse_ref)
    assert (lse[~fin] == float("-inf")).all()
    if fin.any():
        assert (lse[fin] - lse_ref[fin]).abs().max().item() < 1e-2


@pytest.mark.parametrize("case", GPU_CASES)
def test_sm90_fwd_matches_reference_on_hopper(case: tuple) -> None:
    _check_on_hopper(case)


# Packed GQA (``pack_gqa`` = query heads per KV head in one M tile): decode-like and short
# prefill shapes, causal (bottom-right) and windowed, partial tiles in both dims.
PACKED_CASES = [
    # (case as in GPU_CASES, pack)
    ((4, 1, 1000, 32, 4, 128, False, (-1, -1), 0.0, False, None), 8),
    ((2, 5, 777, 16, 2, 128, True, (-1, -1), 0.0, False, None), 8),
    ((2, 33, 400, 8, 2, 64, True, (-1, -1), 0.0, False, None), 4),
    ((2, 40, 513, 12, 2, 64, False, (64, 8), 0.0, False, None), 6),
    ((1, 3, 300, 8, 1, 256, True, (-1, -1), 30.0, False, None), 8),
]


@pytest.mark.parametrize("case,pack", PACKED_CASES)
def test_sm90_packed_gqa_matches_reference_on_hopper(case: tuple, pack: int) -> None:
    _check_on_hopper(case, pack)


@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[1], GPU_CASES[3], GPU_CASES[5]])
def test_sm90_seeded_row_sum_matches_reference_on_hopper(case: tuple) -> None:
    _check_on_hopper(case, seed_row_sum=True)


# Persistent grid with far fewer CTAs than tiles, so every CTA carries its pipeline phases, its
# ping-pong turn and the Q/O buffer hand-back from tile to tile: separate and shared O buffers,
# 2 and 3 consumer warpgroups, tiles with no key block (causal, Nq > Nk), windows, packed GQA.
PERSISTENT_CASES = [
    # (case as in GPU_CASES, pack, num_ctas[, dynamic tile claims])
    ((2, 1000, 1000, 4, 2, 128, False, (-1, -1), 0.0, False, None), 1, 7),
    ((2, 1000, 1000, 4, 2, 128, True, (-1, -1), 0.0, False, None), 1, 7, True),
    ((2, 700, 300, 4, 4, 128, True, (-1, -1), 0.0, False, None), 1, 5, True),
    ((2, 555, 600, 2, 2, 256, True, (-1, -1), 0.0, False, None), 1, 3, True),
    ((2, 600, 640, 4, 2, 64, True, (-1, -1), 0.0, False, None), 1, 4, True),
    ((2, 500, 700, 4, 4, 128, False, (64, 32), 0.0, False, None), 1, 6, True),
    ((2, 33, 400, 8, 2, 64, True, (-1, -1), 0.0, False, None), 4, 2, True),
    ((2, 700, 300, 4, 4, 128, True, (-1, -1), 0.0, False, None), 1, 5),
    ((2, 555, 600, 2, 2, 256, True, (-1, -1), 0.0, False, None), 1, 3),
    ((2, 555, 600, 2, 2, 256, False, (-1, -1), 0.0, False, None), 1, 4),
    ((2, 600, 640, 4, 2, 64, True, (-1, -1), 0.0, False, None), 1, 4),
    ((2, 500, 700, 4, 4, 128, False, (64, 32), 0.0, False, None), 1, 6),
    ((2, 512, 512, 4, 4, 128, False, (-1, -1), 0.0, False, False), 1, 5),
    ((2, 512, 512, 4, 4, 128, True, (-1, -1), 0.0, False, True), 1, 5),
    ((2, 300, 500, 4, 4, 192, True, (-1, -1), 0.0, False, None), 1, 3),
    ((4, 1, 1000, 32, 4, 128, False, (-1, -1), 0.0, False, None), 8, 3),
]


@pytest.mark.parametrize("case", PERSISTENT_CASES)
def test_sm90_persistent_grid_matches_reference_on_hopper(case: tuple) -> None:
    problem, pack, num_ctas, *dynamic = case
    _check_on_hopper(problem, pack, num_ctas=num_ctas, dynamic_tiles=bool(dynamic and dynamic[0]))


# d = 64 short sequences on the 128-row ping-pong tile and the persistent grid (the launch rule's
# choice below 2k query rows): causal with atomic claims, bottom-right causal, unmasked, GQA.
SHORT_D64_CASES = [
    ((2, 1000, 1000, 4, 2, 64, True, (-1, -1), 0.0, False, True), True),
    ((1, 517, 333, 4, 4, 64, True, (-1, -1), 0.0, False, True), True),
    ((3, 197, 197, 4, 4, 64, False, (-1, -1), 0.0, False, True), False),
]


@pytest.mark.parametrize("case", SHORT_D64_CASES)
def test_sm90_short_d64_tile_matches_reference_on_hopper(case: tuple) -> None:
    problem, dynamic = case
    _check_on_hopper(problem, num_ctas=132, dynamic_tiles=dynamic, tile_m=128, num_mma_wg=2)

