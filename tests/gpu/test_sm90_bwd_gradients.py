"""The sm90 backward on a Hopper GPU: its gradients against the fp32 reference with the usual rule
(error at most twice the same-dtype PyTorch error, + 1e-3), for every head dim and mask, packed
sequences, the tiles and schedules the launcher or the tuning overrides can pick, and deterministic
mode bitwise reproducible."""

from __future__ import annotations

import math

import pytest
import torch

from cute_flash import jit, launch
from cute_flash.hopper.bwd_config import BwdSm90Config, long_rows_overrides, plan
from cute_flash.problem import Problem
from cute_flash.reference import attention_ref

from attention_checks import needs_hopper

pytestmark = [pytest.mark.gpu, needs_hopper]

# The long-sequence tile (80 query rows at d = 128, non-causal) with the switches that go with it.
LONG_ROWS = long_rows_overrides(dict(hdim=128), max_seqlen_q=1 << 30)

GPU_CASES = [
    # (B, Nq, Nk, H, H_kv, causal, window)
    (2, 256, 256, 4, 4, False, (-1, -1)),
    (2, 256, 256, 4, 4, True, (-1, -1)),
    (1, 333, 517, 2, 2, False, (-1, -1)),
    (1, 517, 333, 2, 2, True, (-1, -1)),  # bottom-right causal, rows that see no key
    (2, 1000, 1000, 3, 3, True, (-1, -1)),
    (2, 400, 600, 8, 2, False, (-1, -1)),  # GQA: dK, dV summed over 4 query heads
    (1, 300, 300, 4, 1, True, (-1, -1)),  # MQA
    (2, 500, 700, 2, 2, False, (96, 32)),  # sliding window
    (2, 300, 300, 4, 2, True, (-1, -1), 30.0),  # softcap
    # Left window only, more queries than keys: the unbounded right side must not bind (it did
    # when "unbounded" was seqlen_k, with key - query reaching past offset + seqlen_k).
    (2, 1000, 113, 6, 1, False, (128, -1)),
]
# (..., softcap, d): softcap 0 unless given; d = 64, 96, 192, 256 on a few of them.
GPU_CASES = [c if len(c) == 8 else (*c, 0.0) for c in GPU_CASES]
GPU_CASES = ([(*c, 128) for c in GPU_CASES] + [(*GPU_CASES[i], 64) for i in (1, 3, 5, 7, 8, 9)]
             + [(*GPU_CASES[i], d) for d in (96, 192, 256) for i in (0, 3, 5, 7, 8, 9)]
             # d = 64 softcap (64-query blocks): bottom-right causal with rows that see no key, GQA
             # with a window, partial blocks on both axes.
             + [(1, 517, 333, 4, 2, True, (-1, -1), 30.0, 64), (2, 500, 700, 6, 2, False, (96, 32), 20.0, 64),
                (1, 1000, 1000, 2, 2, False, (-1, -1), 50.0, 64)])
# d = 128 cases without masks: where the 80-row tile applies.
UNMASKED_CASES = [GPU_CASES[i] for i in (0, 2, 5)]


def _check_gradients(case: tuple, overrides: dict | None = None, deterministic: bool = False) -> None:
    """The sm90 backward (forced, with config ``overrides``) on NaN-poisoned gradients, against
    the fp32 reference's gradients with the 2x rule."""
    B, Nq, Nk, H, Hkv, causal, window, softcap, d = case
    d, dv = d if isinstance(d, tuple) else (d, d)  # (d, d_v) where they differ
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(B, Nq, H, d, device=dev, dtype=dt)
    k = torch.randn(B, Nk, Hkv, d, device=dev, dtype=dt)
    v = torch.randn(B, Nk, Hkv, dv, device=dev, dtype=dt)
    do = torch.randn(B, Nq, H, dv, device=dev, dtype=dt)
    scale = 1.0 / math.sqrt(d)
    kw = dict(softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)
    out, lse = attention_ref(q, k, v, **kw)
    out = out.to(dt)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    launch.run_bwd(do, q, k, v, out, lse.float().contiguous(), *grads, family="sm90", overrides=overrides,
                   deterministic=deterministic, **kw)
    torch.cuda.synchronize()

    def ref_grads(upcast: bool) -> tuple:
        ts = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        o, _ = attention_ref(*ts, upcast=upcast, **kw)
        return torch.autograd.grad(o, ts, do)

    hi, lo = ref_grads(True), ref_grads(False)
    for name, g, g_hi, g_lo in zip("qkv", grads, hi, lo, strict=True):
        err = (g.float() - g_hi.float()).abs().max().item()
        err_lo = (g_lo.float() - g_hi.float()).abs().max().item()
        assert err <= 2 * err_lo + 1e-3, (name, err, err_lo)


@pytest.mark.parametrize("case", GPU_CASES)
def test_sm90_bwd_gradients_within_twice_pytorch_error(case: tuple) -> None:
    _check_gradients(case)


# GQA / MQA groups (4, 4, 2, 6 query heads per K/V head), narrow and wide kernels, masks, softcap.
GQA_CASES = [c for c in GPU_CASES if c[3] != c[4]]


@pytest.mark.parametrize("case", GQA_CASES)
@pytest.mark.parametrize("split", ["whole group in one CTA", "group over two CTAs", "one query head per CTA"])
def test_sm90_bwd_gqa_group_split_over_ctas_keeps_gradients(case: tuple, split: str) -> None:
    """The query heads of a K/V head looped inside one CTA (``head_split`` 1), or split over CTAs
    whose partial dK / dV the launcher sums (two where the group is even)."""
    group = case[3] // case[4]
    head_split = {"whole": 1, "group": 2 if group % 2 == 0 else group, "one": group}[split.split()[0]]
    _check_gradients(case, overrides=dict(head_split=head_split))


@pytest.mark.parametrize("case", [(*GPU_CASES[i][:8], (192, 128)) for i in (0, 3, 5, 7, 8, 9)])
def test_sm90_bwd_narrow_v_gradients_within_twice_pytorch_error(case: tuple) -> None:
    """d_v != d, (192, 128): dP, dV^T and the dO / V tiles at 128, Q / K / dQ / dK at 192."""
    _check_gradients(case)


@pytest.mark.parametrize("case", UNMASKED_CASES)
@pytest.mark.parametrize("ds_before_dv", [False, True])
def test_sm90_bwd_80_query_rows_keep_gradients_within_twice_pytorch_error(case: tuple,
                                                                         ds_before_dv: bool) -> None:
    """The long-sequence tile (tile_m = 80 at d = 128) on short problems: dQ^T = K^T dS^T (head dim
    on M), read back transposed by the postprocess through smem; one-tile stmatrix dS^T; query
    blocks that straddle 64-row boundaries; with and without dS stored before dV's wgmma."""
    _check_gradients(case, overrides={**LONG_ROWS, "ds_before_dv": ds_before_dv})


@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (1, 3, 5, 7, 8, 9)]
                         + [c for c in GPU_CASES if c[-1] == 64][:3])
def test_sm90_bwd_with_dk_before_dq_and_one_ds_buffer_keeps_gradients(case: tuple) -> None:
    """The narrow kernel's schedule switches off (dK before dQ, one dS buffer behind the
    consumers' EMPTY barrier): same rule."""
    _check_gradients(case, overrides=dict(dq_before_dk=False, ds_stages=1))


# Each schedule switch alone, and several together, must keep the gradients right wherever it
# compiles (on or off by default depending on the head dim: the other value is a tuning override).
CANDIDATE_SWITCHES = {
    "prefetch-stats": dict(prefetch_stats=True), "dq-writer-batch": dict(dq_writer_batch=True),
    "dkv-stmatrix": dict(dkv_stmatrix=True), "spin-waits": dict(spin_waits=True),
    "spin-waits-split-loads": dict(spin_waits=True, split_loads=True), "rotate-m": dict(rotate_m=True),
    "mask-always": dict(mask_always=True), "ds-before-dv": dict(ds_before_dv=True),
    "ds-before-dv-mask-always": dict(ds_before_dv=True, mask_always=True),
    "all": dict(prefetch_stats=True, dq_writer_batch=True, dkv_stmatrix=True)}


@pytest.mark.parametrize("name", list(CANDIDATE_SWITCHES))
@pytest.mark.parametrize("case", [GPU_CASES[i] for i in (1, 3, 5, 9)]
                         + [c for c in GPU_CASES if c[-1] == 64][:2])
def test_sm90_bwd_candidate_switches_keep_gradients_within_twice_pytorch_error(case: tuple,
                                                                               name: str) -> None:
    """Statistics read under the wgmmas, the dQ writer's batched reduce-adds, stmatrix dK / dV,
    polling waits, the rotated walk, every block masked, dS before dV: same rule (softcap cases
    skip prefetch_stats, which refuses it)."""
    switches = CANDIDATE_SWITCHES[name]
    if case[7] and switches.get("prefetch_stats"):
        pytest.skip("prefetch_stats refuses softcap")
    _check_gradients(case, overrides=switches)


def test_sm90_bwd_long_sequences_take_the_80_row_tile_and_keep_gradients() -> None:
    """4100 query rows (a partial last 80-row block) at d = 128 non-causal: the launcher compiles
    and runs the long-sequence tile on its own, within the usual error rule."""
    _check_gradients((2, 4100, 4100, 2, 2, False, (-1, -1), 0.0, 128))
    assert any(isinstance(c, BwdSm90Config) and c.tile_m == 80 and c.target is None for c in jit._cache)


@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[-1] in (64, 96, 128, 192, 256)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_sm90_bwd_split_loads_keep_gradients_within_twice_pytorch_error(case: tuple,
                                                                        deterministic: bool) -> None:
    """K / V on a barrier each, Q + LSE2 and dO + D on their own pipelines: every case with
    d_v = d, narrow and wide (GQA / MQA, windows, softcap, rows that see no key), also in
    deterministic mode."""
    if deterministic and case not in (GPU_CASES[1], GPU_CASES[5], GPU_CASES[6]):
        pytest.skip("deterministic mode: three cases")
    _check_gradients(case, overrides=dict(split_loads=True), deterministic=deterministic)


@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[-1] in (192, 256)]
                         + [(*GPU_CASES[i][:8], (192, 128)) for i in (3, 8)])
@pytest.mark.parametrize("switch", ["dkv_stmatrix=1", "dq_before_dk=1", "dq_before_dk=0", "prefetch_stats=0",
                                    "rotate_m=1", "rotate_m=0", "mask_always=1"])
def test_sm90_bwd_wide_switches_keep_gradients(case: tuple, switch: str) -> None:
    """The wide kernel with dK^T / dV^T by (transposing) stmatrix, with and without flash-attn-4's
    order (P stored under the dP GEMM, dV under the dS store, dQ handed over under dK), the
    statistics read from smem where used: every d = 192 / 256 case and (192, 128)."""
    name, value = switch.split("=")
    _check_gradients(case, overrides={name: bool(int(value))})


# Causal problems whose full sections of heads (as many as fit the ``lpt`` walk's L2 budget) would
# leave a short last one: 7 kv heads in sections of 3 (3 + 3 + 1), which the launcher balances
# (3 + 2 + 2). GQA makes each kv head's query rows many without a large reference problem.
BALANCED_CASES = [(1, 1500, 1500, 112, 7, True, (-1, -1), 0.0, 64),
                  (1, 1500, 1500, 56, 7, True, (-1, -1), 0.0, 128),
                  (1, 1000, 1000, 56, 7, True, (-1, -1), 0.0, 192)]


@pytest.mark.parametrize("case", BALANCED_CASES)
def test_sm90_bwd_balanced_longest_first_sections_keep_gradients(case: tuple) -> None:
    """The causal grid walked over evenly sized head sections (the launcher's own choice here):
    every tile once, gradients by the usual rule."""
    B, Nq, Nk, H, Hkv, causal, _, _, d = case
    p = Problem(target=None, dtype="bf16", hdim=d, hdim_v=d, causal=causal, max_seqlen_q=Nq,
                max_seqlen_k=Nk, heads_q=H, heads_kv=Hkv, num_sms=launch.sm_count(torch.device("cuda")))
    assert plan(p)[1].lpt_balanced
    _check_gradients(case)


def test_sm90_bwd_deterministic_mode_keeps_gradients_where_rows_see_no_key() -> None:
    _check_gradients(GPU_CASES[3], deterministic=True)


@pytest.mark.parametrize("d,causal", [(128, False), (128, True), (64, True), (256, True), (96, True),
                                      (192, False)])
def test_sm90_bwd_varlen_gradients_within_twice_pytorch_error(d: int, causal: bool) -> None:
    torch.manual_seed(1)
    dev, dt, H, Hkv = "cuda", torch.bfloat16, 4, 2
    lq, lk = [300, 1, 129, 517], [200, 77, 129, 600]
    cu_q = torch.tensor([0, *torch.tensor(lq).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    q = torch.randn(sum(lq), H, d, device=dev, dtype=dt)
    k = torch.randn(sum(lk), Hkv, d, device=dev, dtype=dt)
    v = torch.randn(sum(lk), Hkv, d, device=dev, dtype=dt)
    do = torch.randn(sum(lq), H, d, device=dev, dtype=dt)
    kw = dict(softmax_scale=1.0 / math.sqrt(d), causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = attention_ref(q, k, v, **kw)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    launch.run_bwd(do, q, k, v, out.to(dt), lse.float().contiguous(), *grads, max_seqlen_q=max(lq),
                   max_seqlen_k=max(lk), family="sm90", **kw)
    torch.cuda.synchronize()

    def ref_grads(upcast: bool) -> tuple:
        ts = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        o, _ = attention_ref(*ts, upcast=upcast, **kw)
        return torch.autograd.grad(o, ts, do)

    for name, g, g_hi, g_lo in zip("qkv", grads, ref_grads(True), ref_grads(False), strict=True):
        err = (g.float() - g_hi.float()).abs().max().item()
        err_lo = (g_lo.float() - g_hi.float()).abs().max().item()
        assert err <= 2 * err_lo + 1e-3, (name, err, err_lo)


def _bitwise_reproducible(q, k, v, do, runs: int, causal: bool, overrides: dict | None = None) -> None:
    out, lse = attention_ref(q, k, v, causal=causal)
    first = None
    for _ in range(runs):
        grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
        launch.run_bwd(do, q, k, v, out.to(q.dtype), lse.float().contiguous(), *grads,
                       softmax_scale=q.shape[-1] ** -0.5, causal=causal, deterministic=True, family="sm90",
                       overrides=overrides)
        torch.cuda.synchronize()
        if first is None:
            first = grads
        else:
            assert all(torch.equal(a, b) for a, b in zip(first, grads, strict=True)), tuple(q.shape)


def test_sm90_bwd_deterministic_mode_is_bitwise_reproducible() -> None:
    """100 runs bitwise equal (the writer warp orders the adds, key blocks in descending order),
    the first also within the 2x rule of the fp32 reference. 16k keys = 128 K/V blocks per head,
    more CTAs than SMs, so a wait on a CTA that cannot become resident would hang here."""
    torch.manual_seed(2)
    dev, dt, d = "cuda", torch.bfloat16, 128
    for n, h, runs in ((1024, 4, 100), (16384, 2, 3)):
        q, do = (torch.randn(1, n, h, d, device=dev, dtype=dt) for _ in range(2))
        k, v = (torch.randn(1, n, h // 2, d, device=dev, dtype=dt) for _ in range(2))
        _bitwise_reproducible(q, k, v, do, runs, causal=True)
        if n <= 1024:
            _check_gradients((1, n, n, h, h // 2, True, (-1, -1), 0.0, d), deterministic=True)


def test_sm90_bwd_rotated_deterministic_order_is_bitwise_reproducible() -> None:
    """Non-causal deterministic mode on the rotated walk (``rotate_m``): repeated runs bitwise
    equal, with more query than key blocks, more key than query blocks (several key blocks at one
    step: ties), GQA, and 128 key blocks per head (all resident on the H200's 132 SMs; a wrong
    rank or a wait on a CTA that is not resident would hang here); gradients within the 2x rule."""
    torch.manual_seed(3)
    dev, dt, d = "cuda", torch.bfloat16, 128
    overrides = dict(rotate_m=True)
    for nq, nk, h, hkv, runs in ((1000, 700, 4, 2, 30), (200, 2100, 4, 4, 30), (16384, 16384, 2, 1, 3)):
        q, do = (torch.randn(1, nq, h, d, device=dev, dtype=dt) for _ in range(2))
        k, v = (torch.randn(1, nk, hkv, d, device=dev, dtype=dt) for _ in range(2))
        _bitwise_reproducible(q, k, v, do, runs, causal=False, overrides=overrides)
        if nq <= 2100:
            _check_gradients((1, nq, nk, h, hkv, False, (-1, -1), 0.0, d), overrides=overrides,
                             deterministic=True)
