"""Kernel correctness on a CUDA GPU (every test here is marked ``gpu`` and skipped without one).

Every output (out, lse, dq, dk, dv) is held to the accuracy rule of ``attention_checks``: at most
twice the error of the same PyTorch math in the inputs' dtype, plus a rounding floor.

Grid: the full product dtype x head dim x causal (the axes that select most code), then a fixed,
balanced sample over windows, softcap, GQA ratio, sequence lengths (1 .. 4224, Nq != Nk), value
head dims and memory layouts, in which every value of every axis appears several times; varlen,
fully-masked rows, NaN-poisoned outputs, determinism and torch.compile have tests of their own.
Compiling the kernel variants dominates the run time; inputs are fresh random numbers each run
(the seed is printed; ``CUTE_FLASH_SEED`` replays it).

Forward kernel family: every test runs what the public API runs (``CUTE_FLASH_FWD_KERNEL``, default
``auto``: the sm90 FA3 forward on Hopper, the sm80 FA2 one elsewhere; the backward likewise, see
``dispatch.bwd_family``). A few cases force the sm80 kernels on Hopper so that they stay covered there,
and one 128k-token causal problem checks that the forward's memory is O(N). Document packs
(varlen) have their own module, ``test_document_packs``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

import cute_flash
from cute_flash import jit, launch
from cute_flash.dispatch import BWD_KERNEL_ENV, FWD_KERNEL_ENV, fwd_family
from cute_flash.memo import HostMemo
from cute_flash.reference import attention_ref, visible_mask

from attention_checks import (
    FLOOR_BWD,
    FLOOR_FWD,
    assert_lse_rule,
    assert_rule,
    balanced_sample,
    check_against_rule,
    cu_seqlens,
    finite_lse,
    fwd_bwd,
    leaves,
    make_tensor,
    ours_fn,
    ref_fn,
)

pytestmark = pytest.mark.gpu

FP16, BF16 = torch.float16, torch.bfloat16
DTYPES = (FP16, BF16)
HDIMS = (32, 64, 96, 128, 160, 192, 256)
NEG_INF = float("-inf")


@dataclass(frozen=True)
class Case:
    dtype: torch.dtype = BF16
    hdim: int = 128
    hdim_v: int | None = None
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    heads: tuple[int, int] = (4, 4)  # (H, Hkv)
    nq: int = 128
    nk: int = 128
    layout: str = "bnhd"  # bnhd (contiguous) | bhnd (SDPA layout, transposed view) | padded (row stride > d)

    @property
    def dv(self) -> int:
        return self.hdim if self.hdim_v is None else self.hdim_v

    @property
    def batch(self) -> int:
        return 2 if max(self.nq, self.nk) <= 1000 else 1

    def kwargs(self) -> dict:
        return dict(causal=self.causal, window_size=self.window, softcap=self.softcap)

    def __str__(self) -> str:
        dt = "fp16" if self.dtype == FP16 else "bf16"
        parts = [f"{dt}-d{self.hdim}" + (f"v{self.dv}" if self.dv != self.hdim else "")]
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]},{self.window[1]}")
        if self.softcap:
            parts.append(f"cap{self.softcap:g}")
        parts += [f"h{self.heads[0]}:{self.heads[1]}", f"{self.nq}x{self.nk}", self.layout]
        return "-".join(parts)


def make_qkv(c: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, hkv = c.heads
    return (make_tensor((c.batch, c.nq, h, c.hdim), c.dtype, c.layout),
            make_tensor((c.batch, c.nk, hkv, c.hdim), c.dtype, c.layout),
            make_tensor((c.batch, c.nk, hkv, c.dv), c.dtype, c.layout))



# ---------------------------------------------------------------------------------------------
# Dense grids
# ---------------------------------------------------------------------------------------------
CORE_SHAPES = [(113, 113), (1000, 1000), (17, 113), (113, 17), (1, 1000), (1000, 1)]


def core_cases() -> list[Case]:
    """Full product dtype x head dim x causal; shapes and GQA ratios rotate across it."""
    cases = []
    product = [(dt, d, c) for dt in DTYPES for d in HDIMS for c in (False, True)]
    for i, (dtype, hdim, causal) in enumerate(product):
        nq, nk = CORE_SHAPES[i % len(CORE_SHAPES)]
        heads = ((4, 4), (8, 2))[i // len(CORE_SHAPES) % 2]
        cases.append(Case(dtype=dtype, hdim=hdim, causal=causal, heads=heads, nq=nq, nk=nk))
    return cases


def sampled_cases(n: int = 30, seed: int = 2024) -> list[Case]:
    """A fixed, balanced sample: each axis' values are repeated to length n and shuffled
    independently, so every value appears ~n/len times in varied company. The sample is the
    same every run (stable test ids); the tensors are not."""
    rng = random.Random(seed)
    axes = {
        "dtype": DTYPES,
        "hdim": HDIMS,
        "causal": (False, True),
        "window": ((-1, -1), (64, 32), (-1, 0), (0, 0), (128, -1), (-1, 64), (256, 0)),
        "softcap": (0.0, 30.0),
        "heads": ((4, 4), (8, 2), (6, 1)),  # 1:1, 4:1, all:1
        "shape": ((1, 1), (1, 4224), (17, 17), (17, 1000), (113, 1000), (1000, 113), (1000, 1000),
                  (4224, 4224), (128, 4224), (4224, 17)),
        "layout": ("bnhd", "bhnd", "padded"),
    }
    cases = []
    for row in balanced_sample(axes, n, rng):
        nq, nk = row.pop("shape")
        cases.append(Case(nq=nq, nk=nk, **row))
    return cases


@pytest.mark.parametrize("case", core_cases(), ids=str)
def test_dtype_hdim_causal_grid_within_twice_pytorch_error(seed, case):
    check_against_rule(*make_qkv(case), seed, case, **case.kwargs())


@pytest.mark.parametrize("case", sampled_cases(), ids=str)
def test_sampled_feature_combinations_within_twice_pytorch_error(seed, case):
    check_against_rule(*make_qkv(case), seed, case, **case.kwargs())


@pytest.mark.parametrize("case", [
    Case(hdim=192, hdim_v=128, causal=True, nq=1000, nk=1000),
    Case(dtype=FP16, hdim=128, hdim_v=64, heads=(8, 2), nq=113, nk=1000),
], ids=str)
def test_value_head_dim_different_from_qk_head_dim(seed, case):
    check_against_rule(*make_qkv(case), seed, case, **case.kwargs())


@pytest.mark.parametrize("case", [
    Case(hdim=64, causal=True, heads=(4, 2), nq=37, nk=53),
    Case(hdim=128, window=(16, 8), nq=50, nk=50),
    Case(hdim=128, causal=True, softcap=20.0, heads=(2, 1), nq=45, nk=30),
    Case(hdim=256, causal=True, heads=(2, 1), nq=45, nk=30),
    Case(hdim=96, nq=33, nk=41),
], ids=str)
def test_public_api_gradients_match_fp64_finite_differences(seed, case):
    """gradcheck-style, through the public API: the directional derivatives <grad, u> of our
    backward (bf16 inputs) against central differences of the fp64 reference loss <out, dout> at
    the same point. Over 8 random unit directions per input, the RMS deviation from the finite
    differences must be within twice that of the same-dtype PyTorch backward (plus a 1e-4 relative
    floor); the fp64 autograd gradient must match them to 1e-6, so the differences themselves are
    trustworthy."""
    q, k, v = make_qkv(case)
    dout = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    kw = case.kwargs()
    _, _, ours = fwd_bwd(ours_fn, q, k, v, dout, **kw)
    _, _, same = fwd_bwd(ref_fn(False), q, k, v, dout, **kw)
    x64 = [t.detach().double() for t in (q, k, v)]
    do64 = dout.double()
    _, _, exact = fwd_bwd(ref_fn(True), *x64, do64, **kw)

    def loss(ts) -> float:
        out, _ = attention_ref(*ts, upcast=True, **kw)
        return float((out * do64).sum())

    eps = 1e-3
    for i, name in enumerate("qkv"):
        dev_ours, dev_same, scale = [], [], []
        for _ in range(8):
            u = torch.randn_like(x64[i])
            u /= u.norm()
            plus, minus = list(x64), list(x64)
            plus[i], minus[i] = x64[i] + eps * u, x64[i] - eps * u
            fd = (loss(plus) - loss(minus)) / (2 * eps)
            exact_dd = float((exact[i].double() * u).sum())
            assert abs(exact_dd - fd) <= 1e-6 * max(1.0, abs(fd)), (name, exact_dd, fd)
            dev_ours.append(float((ours[i].double() * u).sum()) - fd)
            dev_same.append(float((same[i].double() * u).sum()) - fd)
            scale.append(abs(fd))
        rms = [(sum(x * x for x in d) / len(d)) ** 0.5 for d in (dev_ours, dev_same)]
        floor = 1e-4 * max(scale) + 1e-6
        assert rms[0] <= 2 * rms[1] + floor, (f"d{name}: RMS deviation {rms[0]:.3e} vs torch {rms[1]:.3e} "
                                              f"[{case}] seed={seed}")


def test_kv_broadcast_over_heads_with_zero_stride_within_twice_pytorch_error(seed):
    """K/V expanded over the heads (stride 0, no copy by the caller) give the same answer as the
    materialised tensors; the sm90 forward's TMA descriptors never see a zero stride."""
    b, n, h, d = 2, 333, 4, 128
    q = torch.randn(b, n, h, d, device="cuda", dtype=BF16)
    k, v = (torch.randn(b, n, 1, d, device="cuda", dtype=BF16).expand(b, n, h, d) for _ in range(2))
    assert k.stride(2) == 0
    out, lse = cute_flash.flash_attn_func(q, k, v, causal=True, return_lse=True)
    kc, vc = k.contiguous(), v.contiguous()
    r_out, _ = attention_ref(q.float(), kc.float(), vc.float(), causal=True)
    s_out, _ = attention_ref(q, kc, vc, upcast=False, causal=True)
    assert_rule("out", out, r_out, s_out, FLOOR_FWD, seed, "kv-broadcast")


def test_value_head_dim_larger_than_qk_forward_matches_and_backward_raises(seed):
    case = Case(hdim=64, hdim_v=256, window=(64, 32), nq=1000, nk=113, layout="bhnd")
    q, k, v = make_qkv(case)
    out, _ = ours_fn(q, k, v, **case.kwargs())
    r_out, _ = ref_fn(True)(*(t.float() for t in (q, k, v)), **case.kwargs())
    s_out, _ = ref_fn(False)(q, k, v, **case.kwargs())
    assert_rule("out", out, r_out, s_out, FLOOR_FWD, seed, case)
    qg = q.detach().requires_grad_()
    with pytest.raises(ValueError, match="head dim"):
        o, _ = ours_fn(qg, k, v, **case.kwargs())
        o.sum().backward()


@pytest.mark.parametrize("case", [
    Case(causal=True, nq=1000, nk=113),  # Nq > Nk causal: the first 887 queries see nothing
    Case(dtype=FP16, hdim=64, window=(0, 0), nq=300, nk=17, heads=(8, 2)),  # diagonal past the keys
    Case(hdim=256, window=(16, -1), nq=17, nk=1000),  # no query reaches the first keys
], ids=str)
def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_finite_grads(seed, case):
    q, k, v = make_qkv(case)
    mask = visible_mask(case.nq, case.nk, causal=case.causal, window_size=case.window, device="cuda")
    dead_rows, dead_keys = ~mask.any(dim=1), ~mask.any(dim=0)
    dout = torch.randn(*q.shape[:-1], case.dv, dtype=q.dtype, device="cuda")
    out, lse, grads = fwd_bwd(ours_fn, q, k, v, dout, **case.kwargs())
    assert torch.all(out[:, dead_rows] == 0)
    assert torch.all(lse[:, :, dead_rows] == NEG_INF)
    assert torch.isfinite(lse[:, :, ~dead_rows]).all()
    for g in grads:
        assert torch.isfinite(g).all()
    assert torch.all(grads[0][:, dead_rows] == 0)
    assert torch.all(grads[1][:, dead_keys] == 0) and torch.all(grads[2][:, dead_keys] == 0)
    check_against_rule(q, k, v, seed, case, **case.kwargs())


# ---------------------------------------------------------------------------------------------
# Forward kernel family
# ---------------------------------------------------------------------------------------------
def is_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.fixture
def compiled_families(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the kernels compiled (or fetched from the compile cache) by launches in this test:
    the launcher's memo of kernels by input metadata starts empty, so every launch asks."""
    seen: list[str] = []
    real = jit.compile_kernel

    def spy(cfg, keep=False):
        seen.append(cfg.kernel_name)
        return real(cfg, keep)

    monkeypatch.setattr(jit, "compile_kernel", spy)
    monkeypatch.setattr(launch, "_FWD_KERNELS", HostMemo(512))
    return seen


def test_public_api_runs_the_sm90_forward_on_hopper_and_sm80_elsewhere(seed, compiled_families, monkeypatch):
    monkeypatch.delenv(FWD_KERNEL_ENV, raising=False)
    q, k, v = make_qkv(Case(nq=300, nk=300))
    cute_flash.flash_attn_func(q, k, v, causal=True)
    assert compiled_families == ["fwd_sm90" if is_hopper() else "fwd_sm80"]


SM80_ON_HOPPER_CASES = [
    Case(dtype=BF16, hdim=128, causal=True, heads=(8, 2), nq=1000, nk=1000),
    Case(dtype=FP16, hdim=64, window=(64, 32), softcap=30.0, nq=113, nk=1000, layout="bhnd"),
    Case(dtype=BF16, hdim=256, nq=17, nk=4224, layout="padded"),
    Case(dtype=FP16, hdim=96, causal=True, heads=(6, 1), nq=1000, nk=113),
]


@pytest.mark.skipif(not is_hopper(), reason="sm80 is already the forward of this GPU (the grids cover it)")
@pytest.mark.parametrize("case", SM80_ON_HOPPER_CASES, ids=str)
def test_forced_sm80_forward_on_hopper_within_twice_pytorch_error(seed, case, compiled_families, monkeypatch):
    monkeypatch.setenv(FWD_KERNEL_ENV, "sm80")
    check_against_rule(*make_qkv(case), seed, f"{case} sm80", **case.kwargs())
    assert "fwd_sm80" in compiled_families and "fwd_sm90" not in compiled_families


@pytest.mark.skipif(not is_hopper(), reason="sm80 is already the forward of this GPU (the grids cover it)")
def test_forced_sm80_varlen_forward_on_hopper(seed, compiled_families, monkeypatch):
    monkeypatch.setenv(FWD_KERNEL_ENV, "sm80")
    lens_q, lens_k = [0, 130, 1, 377], [50, 0, 200, 377]
    q = torch.randn(sum(lens_q), 4, 128, dtype=BF16, device="cuda")
    k = torch.randn(sum(lens_k), 2, 128, dtype=BF16, device="cuda")
    v = torch.randn(sum(lens_k), 2, 128, dtype=BF16, device="cuda")
    check_against_rule(q, k, v, seed, "varlen sm80", cu_seqlens_q=cu_seqlens(lens_q),
                       cu_seqlens_k=cu_seqlens(lens_k), max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
                       causal=True)
    assert "fwd_sm80" in compiled_families and "fwd_sm90" not in compiled_families


def test_sm90_forced_on_a_gpu_that_is_not_hopper_raises(monkeypatch):
    if is_hopper():
        pytest.skip("this GPU is a Hopper")
    monkeypatch.setenv(FWD_KERNEL_ENV, "sm90")
    q, k, v = make_qkv(Case(nq=64, nk=64))
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        cute_flash.flash_attn_func(q, k, v)


def test_forward_family_choice_is_read_per_call(monkeypatch):
    arch = jit.resolve_arch(torch.device("cuda"))
    monkeypatch.setenv(FWD_KERNEL_ENV, "sm80")
    assert fwd_family(arch) == "sm80"
    monkeypatch.delenv(FWD_KERNEL_ENV)
    assert fwd_family(arch) == ("sm90" if is_hopper() else "sm80")


# ---------------------------------------------------------------------------------------------
# Long sequence: O(N) memory, spot-checked rows
# ---------------------------------------------------------------------------------------------
def test_128k_causal_forward_uses_linear_memory_and_matches_reference_rows(seed):
    n, h, d = 128 * 1024, 2, 128
    kw = dict(causal=True, return_lse=True)
    # Compile this variant first (sequence lengths are run-time values), so the measured peak is the
    # launch's own.
    cute_flash.flash_attn_func(*make_qkv(Case(nq=256, nk=256, heads=(h, h))), **kw)
    q, k, v = (torch.randn(1, n, h, d, dtype=BF16, device="cuda") for _ in range(3))
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out, lse = cute_flash.flash_attn_func(q, k, v, **kw)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    outputs = out.numel() * out.element_size() + lse.numel() * lse.element_size()
    # The outputs themselves (64 MiB + 1 MiB) and no workspace to speak of; the N x N scores would
    # be 16 GiB even at one byte each.
    assert extra <= 2 * outputs + (16 << 20) < n * n // 64, (extra, outputs)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    # Row i of a causal square problem sees keys 0..i: its reference is a 1 x (i+1) problem.
    gen = torch.Generator().manual_seed(seed)
    rows = sorted({0, 1, 127, 128, 4095, n // 2 + 3, n - 2, n - 1,
                   *torch.randint(0, n, (4,), generator=gen).tolist()})
    refs = {True: [], False: []}
    for i in rows:
        for upcast in (True, False):
            o, l_ = attention_ref(q[:, i:i + 1], k[:, :i + 1], v[:, :i + 1], upcast=upcast)
            refs[upcast].append((o, l_))
    idx = torch.tensor(rows, device="cuda")
    for name, j, floor in (("out", 0, FLOOR_FWD), ("lse", 1, FLOOR_FWD)):
        ref = torch.cat([r[j] for r in refs[True]], dim=1 if j == 0 else 2)
        same = torch.cat([r[j] for r in refs[False]], dim=1 if j == 0 else 2)
        ours = out[:, idx] if j == 0 else lse[:, :, idx]
        assert_rule(name, ours, ref, same, floor, seed, f"128k causal rows {rows}")


# ---------------------------------------------------------------------------------------------
# Varlen
# ---------------------------------------------------------------------------------------------
def random_lengths(batch: int, max_len: int, rng: random.Random) -> list[int]:
    """Random lengths that always include an empty and a one-token sequence."""
    lens = [0, 1] + [rng.randint(0, max_len) for _ in range(batch - 2)]
    rng.shuffle(lens)
    return lens


@pytest.mark.parametrize("case", [
    Case(dtype=BF16, hdim=128, causal=True, heads=(8, 2), nq=300, nk=300),
    Case(dtype=FP16, hdim=64, nq=1000, nk=500, layout="padded"),
    Case(dtype=BF16, hdim=256, window=(64, 32), softcap=30.0, heads=(6, 1), nq=200, nk=600),
    Case(dtype=FP16, hdim=96, causal=True, window=(128, -1), nq=700, nk=200),
    Case(dtype=BF16, hdim=32, causal=True, heads=(4, 4), nq=1, nk=1000),
], ids=str)
def test_varlen_random_lengths_within_twice_pytorch_error(seed, case):
    rng = random.Random(seed)
    batch = 6
    lens_q = random_lengths(batch, case.nq, rng)
    lens_k = lens_q if case.nq == case.nk else random_lengths(batch, case.nk, rng)
    h, hkv = case.heads
    q = make_tensor((sum(lens_q), h, case.hdim), case.dtype, case.layout)
    k = make_tensor((sum(lens_k), hkv, case.hdim), case.dtype, case.layout)
    v = make_tensor((sum(lens_k), hkv, case.dv), case.dtype, case.layout)
    kw = dict(cu_seqlens_q=cu_seqlens(lens_q), cu_seqlens_k=cu_seqlens(lens_k), **case.kwargs())
    check_against_rule(q, k, v, seed, f"{case} lens_q={lens_q} lens_k={lens_k}", max_seqlen_q=max(lens_q),
                       max_seqlen_k=max(lens_k), **kw)


# ---------------------------------------------------------------------------------------------
# Launchers: every output element written
# ---------------------------------------------------------------------------------------------
POISON_CASES = [
    Case(dtype=BF16, hdim=128, causal=True, nq=113, nk=17),
    Case(dtype=FP16, hdim=64, window=(32, 8), nq=17, nk=1000, heads=(8, 2)),
    Case(dtype=BF16, hdim=256, softcap=30.0, nq=1, nk=113, heads=(6, 1)),
]


@pytest.mark.parametrize("case", POISON_CASES, ids=str)
def test_forward_launcher_overwrites_nan_poisoned_outputs(seed, case):
    q, k, v = make_qkv(case)
    out = torch.full((*q.shape[:-1], case.dv), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((case.batch, case.heads[0], case.nq), float("nan"), device="cuda")
    scale = case.hdim ** -0.5
    launch.run_fwd(q, k, v, out, lse, softmax_scale=scale, causal=case.causal, window_size=case.window,
                   softcap=case.softcap)
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    r_out, r_lse = attention_ref(q, k, v, softmax_scale=scale, **case.kwargs())
    s_out, s_lse = attention_ref(q, k, v, softmax_scale=scale, upcast=False, **case.kwargs())
    assert_rule("out", out, r_out, s_out, FLOOR_FWD, seed, case)
    assert_lse_rule(lse, r_lse, s_lse, seed, case)


def test_varlen_forward_launcher_overwrites_nan_poisoned_outputs(seed):
    lens_q, lens_k = [0, 130, 1, 77], [50, 0, 200, 77]
    q = torch.randn(sum(lens_q), 4, 64, dtype=BF16, device="cuda")
    k = torch.randn(sum(lens_k), 2, 64, dtype=BF16, device="cuda")
    v = torch.randn(sum(lens_k), 2, 64, dtype=BF16, device="cuda")
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((4, sum(lens_q)), float("nan"), device="cuda")
    launch.run_fwd(q, k, v, out, lse, softmax_scale=0.125, causal=True, window_size=(-1, -1), softcap=0.0,
                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q))
    torch.cuda.synchronize()
    assert not out.isnan().any() and not lse.isnan().any()
    kw = dict(softmax_scale=0.125, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    r_out, r_lse = attention_ref(q, k, v, **kw)
    s_out, s_lse = attention_ref(q, k, v, upcast=False, **kw)
    assert_rule("out", out, r_out, s_out, FLOOR_FWD, seed, "varlen")
    assert_lse_rule(lse, r_lse, s_lse, seed, "varlen")


@pytest.mark.parametrize("case", POISON_CASES, ids=str)
def test_backward_launcher_overwrites_nan_poisoned_gradients(seed, case):
    q, k, v = make_qkv(case)
    kw = dict(softmax_scale=case.hdim ** -0.5, **case.kwargs())
    out, lse = cute_flash.flash_attn_func(q, k, v, return_lse=True, **kw)
    dout = torch.randn_like(out)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    launch.run_bwd(dout, q, k, v, out, lse, dq, dk, dv, deterministic=True, **kw)
    torch.cuda.synchronize()
    for name, g in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not g.isnan().any(), f"{name} keeps NaN: not every element was written [{case}]"
    _, _, want = fwd_bwd(ours_fn, q, k, v, dout, deterministic=True, **kw)  # the ops allocate with empty()
    for g, w in zip((dq, dk, dv), want, strict=True):
        torch.testing.assert_close(g, w, atol=FLOOR_BWD, rtol=1e-2)


# ---------------------------------------------------------------------------------------------
# Determinism, gradient through lse, torch.compile, SDPA wrapper
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [
    Case(dtype=BF16, hdim=128, heads=(8, 2), nq=1000, nk=1000),
    Case(dtype=FP16, hdim=64, causal=True, heads=(6, 1), nq=4224, nk=4224),
    Case(dtype=BF16, hdim=256, window=(64, 32), softcap=30.0, nq=1000, nk=113),
    # d = 192: the wide kernel in flash-attn-4's order (dQ's ordered add under the dK GEMM).
    Case(dtype=BF16, hdim=192, causal=True, heads=(4, 2), nq=1000, nk=1500),
], ids=str)
def test_deterministic_backward_is_bitwise_reproducible(seed, case):
    q, k, v = make_qkv(case)
    dout = torch.randn(*q.shape[:-1], case.dv, dtype=q.dtype, device="cuda")
    runs = [fwd_bwd(ours_fn, q, k, v, dout, deterministic=True, **case.kwargs())[2] for _ in range(3)]
    for other in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other, strict=True):
            assert torch.equal(a, b), f"{name} differs between deterministic runs [{case}] seed={seed}"


LSE_GRAD_CASES = [  # (case, backward family: auto = sm90 on Hopper where it covers the case)
    (Case(dtype=BF16, hdim=128, causal=True, heads=(8, 2), nq=1000, nk=1000), "auto"),
    (Case(dtype=BF16, hdim=128, causal=True, heads=(8, 2), nq=1000, nk=1000), "sm80"),
    (Case(dtype=FP16, hdim=64, softcap=30.0, window=(64, 32), nq=113, nk=1000), "auto"),
    # The wide kernel, with rows that see no key:
    (Case(dtype=BF16, hdim=192, causal=True, heads=(6, 2), nq=700, nk=500), "auto"),
    (Case(dtype=BF16, hdim=256, window=(100, 0), nq=300, nk=300), "auto"),
    (Case(dtype=FP16, hdim=32, heads=(4, 1), nq=77, nk=300), "auto"),  # the sm80 backward on every GPU
]


@pytest.mark.parametrize("case,family", LSE_GRAD_CASES, ids=lambda x: str(x))
def test_gradient_through_lse_within_twice_pytorch_error(seed, case, family, monkeypatch):
    """A used LSE: its gradient is folded into the preprocess's D (one backward pass), in both
    backward families; also with the LSE as the only output used, and packed (varlen)."""
    monkeypatch.setenv(BWD_KERNEL_ENV, family)

    def loss_grads(fn, q, k, v, dout, dlse, **kw):
        q, k, v = leaves((q, k, v))
        out, lse = fn(q, k, v, **kw)
        loss = (finite_lse(lse) * dlse).sum()
        if dout is not None:
            loss = loss + (out.float() * dout.float()).sum()
        return torch.autograd.grad(loss, (q, k, v), allow_unused=True)

    def check(q, k, v, dout, dlse, label, **kw):
        ours = loss_grads(ours_fn, q, k, v, dout, dlse, **kw)
        ref = loss_grads(ref_fn(True), *(t.float() for t in (q, k, v)), dout, dlse, **kw)
        same = loss_grads(ref_fn(False), q, k, v, dout, dlse, **kw)
        for name, g, r, s in zip(("dq", "dk", "dv"), ours, ref, same, strict=True):
            if r is None:  # the LSE alone does not depend on v
                assert g is None or not g.abs().any(), f"{name} of the LSE alone must be 0 [{label}]"
                continue
            assert_rule(name, g, r, s, FLOOR_BWD, seed, label)

    q, k, v = make_qkv(case)
    dout = torch.randn(*q.shape[:-1], case.dv, dtype=q.dtype, device="cuda")
    dlse = torch.randn(case.batch, case.heads[0], case.nq, device="cuda")
    check(q, k, v, dout, dlse, f"{case} {family}", **case.kwargs())
    check(q, k, v, None, dlse, f"{case} {family} lse only", **case.kwargs())
    # Packed: the batch's sequences back to back (lengths nq / nk each), dlse as (H, total).
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    cu_q = cu_seqlens([case.nq] * case.batch)
    cu_k = cu_seqlens([case.nk] * case.batch)
    check(*flat, dout.reshape(-1, *dout.shape[2:]), dlse.transpose(0, 1).reshape(case.heads[0], -1),
          f"{case} {family} varlen", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=case.nq,
          max_seqlen_k=case.nk, **case.kwargs())


def test_compiled_functions_match_eager(seed):
    q, k, v = make_qkv(Case(hdim=128, heads=(8, 2), nq=300, nk=500))

    def f(q, k, v):
        out, lse = cute_flash.flash_attn_func(q, k, v, causal=True, deterministic=True, return_lse=True)
        return (out.float() ** 2).sum() + finite_lse(lse).sum()

    def g(q, k, v):
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
        return cute_flash.attention(qs, ks, vs, is_causal=True, enable_gqa=True).float().square().sum()

    for fn in (f, g):
        eager_args, compiled_args = leaves((q, k, v)), leaves((q, k, v))
        want = torch.autograd.grad(fn(*eager_args), eager_args)
        got = torch.autograd.grad(torch.compile(fn, fullgraph=True)(*compiled_args), compiled_args)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def test_attention_matches_sdpa_on_gpu(seed):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(2, 8, 300, 128, dtype=BF16, device="cuda")
    k = torch.randn(2, 2, 1000, 128, dtype=BF16, device="cuda")
    v = torch.randn(2, 2, 1000, 128, dtype=BF16, device="cuda")
    for is_causal in (False, True):
        out = cute_flash.attention(q, k, v, is_causal=is_causal, enable_gqa=True)
        with sdpa_kernel(SDPBackend.MATH):  # the plain PyTorch math, in fp32 and in bf16
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=is_causal,
                                                 enable_gqa=True)
            same = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
        assert_rule("out", out, ref, same, FLOOR_FWD, seed, f"sdpa causal={is_causal}")
