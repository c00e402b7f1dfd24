"""Which kernel family and which configs a launch uses (``cute_flash.dispatch`` and the plans it
asks), checked on the CPU: the device's compute capability is faked and the compile step is
replaced by a recorder whose stand-in kernels do nothing but write zeros, so the real launcher
path (public API -> op -> ``launch.run_fwd`` / ``run_bwd``) runs up to the point where a kernel
would start."""

from __future__ import annotations

import contextlib

import pytest
import torch

import cute_flash
from cute_flash import dispatch, jit, launch, ops
from cute_flash.ampere.config import BwdConfig, FwdConfig
from cute_flash.dispatch import BWD_KERNEL_ENV, FWD_KERNEL_ENV, bwd_family, fwd_family
from cute_flash.hopper import fwd_config
from cute_flash.hopper.bwd_config import (
    SM90_BWD_HDIMS,
    SM90_BWD_NARROW_V,
    SM90_BWD_SOFTCAP_HDIMS,
    BwdSm90Config,
)
from cute_flash.hopper.fwd_config import FwdSm90Config
from cute_flash.memo import HostMemo
from cute_flash.problem import Problem

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def no_arch_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """The family choice reads the environment at every call: start each test from ``auto`` on the
    device's own arch."""
    for env in ("CUTE_FLASH_ARCH", FWD_KERNEL_ENV, BWD_KERNEL_ENV):
        monkeypatch.delenv(env, raising=False)


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    """Set the fake device's capability with ``gpu(major, minor)``; returns the configs that the
    launchers compiled. The stand-in kernels write zeros into their first outputs (so callers get
    finite results); the launchers' caches of compiled kernels start empty and are emptied after
    the test, so no stand-in outlives it."""
    compiled: list = []

    def compile_kernel(cfg, keep=False):
        compiled.append(cfg)

        def kernel(*args):
            for t in args[3:5]:  # the forward's out and lse
                if isinstance(t, torch.Tensor):
                    t.zero_()
        return kernel

    monkeypatch.setattr(jit, "compile_kernel", compile_kernel)
    monkeypatch.setattr(launch, "_FWD_KERNELS", HostMemo(512))
    monkeypatch.setattr(torch.cuda, "device", lambda _dev: contextlib.nullcontext())
    monkeypatch.setattr(launch, "sm_count", lambda device: 132)
    launch._bwd_kernels.cache_clear()

    def set_capability(major: int, minor: int = 0) -> list:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        return compiled

    yield set_capability
    launch._bwd_kernels.cache_clear()


# ---------------------------------------------------------------------------------------------
# The forward family
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,family", [("sm_90a", "sm90"), ("sm_80", "sm80"), ("sm_86", "sm80"),
                                         ("sm_89", "sm80")])
def test_auto_takes_sm90_on_hopper_only(arch: str, family: str) -> None:
    assert fwd_family(arch) == family
    assert fwd_family(arch, 128, 64) == family


def test_the_launch_reads_the_arch_of_the_device(gpu) -> None:
    gpu(9, 0)
    assert jit.resolve_arch(torch.device("cuda", 0)) == "sm_90a"
    gpu(8, 6)
    assert jit.resolve_arch(torch.device("cuda", 0)) == "sm_86"
    gpu(10, 0)
    with pytest.raises(ValueError, match=r"compute capability 8.x and 9.0, got 10.0"):
        jit.resolve_arch(torch.device("cuda", 0))


def test_env_forces_a_family_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FWD_KERNEL_ENV, "sm80")
    assert fwd_family("sm_90a") == "sm80"
    monkeypatch.setenv(FWD_KERNEL_ENV, "SM90")
    assert fwd_family("sm_90a") == "sm90"
    monkeypatch.setenv(FWD_KERNEL_ENV, "auto")
    assert fwd_family("sm_90a") == "sm90"
    monkeypatch.setenv(FWD_KERNEL_ENV, "")
    assert fwd_family("sm_90a") == "sm90"
    monkeypatch.setenv(FWD_KERNEL_ENV, "sm80")
    assert fwd_family("sm_86") == "sm80"


def test_sm90_forced_on_a_gpu_that_is_not_hopper_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FWD_KERNEL_ENV, "sm90")
    with pytest.raises(ValueError, match=r"needs a Hopper GPU \(compute capability 9.x\); this one is sm_86"):
        fwd_family("sm_86")


def test_unknown_env_value_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FWD_KERNEL_ENV, "fa3")
    with pytest.raises(ValueError, match="CUTE_FLASH_FWD_KERNEL must be one of auto, sm80, sm90, got 'fa3'"):
        fwd_family("sm_90a")


def test_auto_falls_back_to_sm80_for_head_dims_sm90_lacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fwd_config, "SM90_FWD_TILES", {128: fwd_config.SM90_FWD_TILES[128]})
    assert fwd_family("sm_90a", 128, 128) == "sm90"
    assert fwd_family("sm_90a", 64, 64) == "sm80"
    assert fwd_family("sm_90a", 64, 256) == "sm80"  # the larger of the two head dims decides
    assert not dispatch.sm90_fwd_supports(128, 256)
    monkeypatch.setenv(FWD_KERNEL_ENV, "sm90")
    assert fwd_family("sm_90a", 64, 64) == "sm90"  # forced: no fallback


def test_public_entry_points_launch_the_sm90_family_on_hopper(gpu, monkeypatch) -> None:
    compiled = gpu(9, 0)
    q, k, v = (torch.randn(2, 70, 4, 64, dtype=BF16) for _ in range(3))
    # The ops' CUDA implementation, called directly (CPU tensors would take the reference one).
    ops._fwd_cuda(q, k, v, 0.125, True, (-1, -1), 0.0)
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    ops._fwd_cuda(q[0], k[0], v[0], 0.125, False, (16, 0), 5.0, cu, cu, 40, 40)
    monkeypatch.setenv(FWD_KERNEL_ENV, "sm80")
    ops._fwd_cuda(q, k, v, 0.125, False, (-1, -1), 0.0)
    assert [type(c) for c in compiled] == [FwdSm90Config, FwdSm90Config, FwdConfig]
    sm90, sm90_varlen, sm80 = compiled
    assert sm90.target is None and sm90.causal and not sm90.varlen and sm90.hdim == 64
    assert sm90_varlen.varlen and sm90_varlen.local and sm90_varlen.softcap
    assert not sm80.causal


def test_the_family_follows_the_device_not_the_compile_target_override(gpu, monkeypatch) -> None:
    """``CUTE_FLASH_ARCH`` names a compile target (cross-compiling without a GPU); on a GPU the
    family still comes from the device, so a Hopper keeps its sm90 kernels."""
    compiled = gpu(9, 0)
    monkeypatch.setenv("CUTE_FLASH_ARCH", "sm_80")
    q, k, v = (torch.randn(2, 70, 4, 64, dtype=BF16) for _ in range(3))
    ops._fwd_cuda(q, k, v, 0.125, True, (-1, -1), 0.0)
    assert [type(c) for c in compiled] == [FwdSm90Config]
    assert dispatch.bwd_family(jit.device_arch(torch.device("cuda", 0)), 128, 128, False) == "sm90"


def test_an_unknown_family_name_is_refused() -> None:
    p = Problem(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128)
    for call in (lambda: dispatch.fwd_config(p, "fp8"), lambda: dispatch.bwd_configs(p, "sm9O")):
        with pytest.raises(ValueError, match="kernel family must be one of"):
            call()


def test_a_gpu_the_kernels_do_not_support_is_a_clear_error(gpu) -> None:
    gpu(10, 0)
    q, k, v = (torch.randn(2, 70, 4, 64, dtype=BF16) for _ in range(3))
    with pytest.raises(ValueError, match=r"compute capability 8.x and 9.0, got 10.0"):
        ops._fwd_cuda(q, k, v, 0.125, True, (-1, -1), 0.0)


def test_flash_attn_func_reaches_run_fwd_through_the_cuda_op(gpu, monkeypatch) -> None:
    """The public functions all end in ``ops._fwd_cuda``, which leaves the family to ``run_fwd``."""
    gpu(9, 0)
    seen, kernels = [], []
    monkeypatch.setattr(ops, "_fwd_cpu", lambda *a, **kw: seen.append(a) or ops._fwd_cuda(*a, **kw))
    real = launch._fwd_kernel
    monkeypatch.setattr(launch, "_fwd_kernel", lambda *a, **kw: kernels.append(real(*a, **kw)) or kernels[-1])
    q, k, v = (torch.randn(1, 33, 2, 128, dtype=BF16) for _ in range(3))
    cute_flash.flash_attn_func(q, k, v, causal=True)
    cute_flash.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    cu = torch.tensor([0, 33], dtype=torch.int32)
    cute_flash.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 33, 33)
    assert len(seen) == 3 and [type(cfg) for cfg, _ in kernels] == [FwdSm90Config] * 3
    assert [cfg.varlen for cfg, _ in kernels] == [False, False, True]


def test_forward_kernel_is_built_once_per_input_metadata(gpu) -> None:
    """``launch._fwd_kernel`` remembers the config and compiled kernel of each (family, dtype,
    shapes, strides, device, mask) so a training step does not rebuild them on the host; anything
    it reads changes the answer."""
    compiled = gpu(9, 0)
    q, v = (torch.randn(2, 70, 4, 64, dtype=BF16) for _ in range(2))
    kw = dict(causal=True, local=False, softcap=0.0, varlen=False)
    first = launch._fwd_kernel(q, v, "sm90", **kw)
    assert launch._fwd_kernel(q.clone(), v.clone(), "sm90", **kw) is first and len(compiled) == 1
    cfg, kernel = first
    assert isinstance(cfg, FwdSm90Config) and callable(kernel)
    assert not launch._fwd_kernel(q, v, "sm90", **(kw | dict(causal=False)))[0].causal
    assert launch._fwd_kernel(q, v, "sm90", **(kw | dict(softcap=30.0)))[0].softcap
    assert launch._fwd_kernel(q[..., :32].contiguous(), v[..., :32].contiguous(), "sm90", **kw)[0].hdim == 32
    assert type(launch._fwd_kernel(q, v, "sm80", **kw)[0]) is FwdConfig
    assert len(compiled) == 5


# ---------------------------------------------------------------------------------------------
# The sm90 forward's launch rules (``hopper.fwd_config.plan``)
# ---------------------------------------------------------------------------------------------
def _fwd_plan(n: int, d: int, causal: bool = False, local: bool = False, varlen: bool = False, nq: int = 0,
              heads: tuple[int, int] = (4, 4), q_dense: bool = True) -> FwdSm90Config:
    p = Problem(target=None, dtype="bf16", hdim=d, hdim_v=d, causal=causal, local=local, varlen=varlen,
                max_seqlen_q=nq or n, max_seqlen_k=n, heads_q=heads[0], heads_kv=heads[1], num_sms=132,
                q_dense=q_dense)
    return fwd_config.plan(p)


def test_sm90_persistent_grid_is_chosen_where_it_measured_faster() -> None:
    """Causal: atomic tile claims (d = 128 at any N, d = 64 from 2k keys, wider heads up to 4k
    keys); unmasked: a static stride for d <= 128 up to 2k keys; sliding windows, varlen and
    everything else: one CTA per tile."""
    def grid(*args, **kw) -> tuple[int, bool]:
        cfg = _fwd_plan(*args, **kw)
        return cfg.num_ctas, cfg.dynamic_tiles

    assert grid(16384, 128, causal=True) == grid(1024, 128, causal=True) == (132, True)
    assert grid(2048, 64, causal=True) == (132, True) and grid(1024, 64, causal=True) == (132, True)
    assert grid(4096, 256, causal=True) == (132, True) and grid(8192, 256, causal=True) == (0, False)
    assert grid(2048, 128) == (132, False) and grid(4096, 128) == (0, False) and grid(2048, 256) == (0, False)
    assert grid(1024, 128, local=True) == (0, False)
    assert grid(1024, 128, causal=True, varlen=True) == (0, False)


def test_sm90_short_d64_takes_the_128_row_tile_where_it_pads_less() -> None:
    """d = 64 below 2k query rows: 128-row tiles on the persistent grid, causal always, unmasked
    where fewer rows are padded than with the 192-row tile; longer sequences, windows and packed
    GQA keep the 192-row tile."""
    def tile(n: int, **kw) -> tuple:
        cfg = _fwd_plan(n, 64, **kw)
        return cfg.tile_m, cfg.num_mma_wg, cfg.num_ctas, cfg.dynamic_tiles

    assert tile(1000, causal=True) == (128, 2, 132, True)
    assert tile(197) == (128, 2, 132, False)  # 256 padded rows instead of 384
    assert tile(257)[0] == tile(1101)[0] == 192  # the same rows either way
    assert tile(4429)[0] == tile(2048, causal=True)[0] == tile(197, local=True)[0] == 192
    assert _fwd_plan(4096, 64, nq=1, heads=(12, 4)).tile_m == 192  # packed GQA


def test_sm90_packs_gqa_heads_when_the_query_group_fits_one_tile() -> None:
    """H / H_kv query heads share the M tile when all their queries fit in it (decode, short
    prefill) and the group size divides the tile; otherwise one head per tile."""
    def pack(nq: int, h: int, hkv: int, d: int = 128, **kw) -> int:
        return _fwd_plan(4096, d, nq=nq, heads=(h, hkv), **kw).pack_gqa

    assert pack(1, 32, 4) == 8 and pack(16, 32, 4, causal=True) == 8 and pack(5, 16, 2, local=True) == 8
    assert pack(17, 32, 4) == 1  # 17 * 8 rows > one 128-row tile
    assert pack(1, 12, 4) == 1  # 3 heads do not divide 128 rows ...
    assert pack(1, 12, 4, d=64) == 3  # ... but divide the 192-row d=64 tile
    assert pack(1, 8, 8) == 1  # no GQA
    assert pack(1, 32, 4, varlen=True) == 1
    # Q as a transposed (B, H, N, d) view (the SDPA-style entry): not packed.
    assert pack(1, 32, 4, q_dense=False) == 1


def test_the_launch_tells_dense_queries_from_transposed_views() -> None:
    q = torch.empty(2, 32, 4, 128)
    assert launch.dense_bnhd(q)
    assert not launch.dense_bnhd(torch.empty(2, 4, 32, 128).transpose(1, 2))
    assert not launch.dense_bnhd(torch.empty(2, 32, 4, 256)[..., :128])


def test_a_compile_only_problem_is_the_base_variant() -> None:
    cfg = fwd_config.plan(Problem(target="sm_90a", dtype="bf16", hdim=128, hdim_v=128, causal=True,
                                  heads_q=32, heads_kv=4))
    assert (cfg.num_ctas, cfg.dynamic_tiles, cfg.pack_gqa, cfg.target) == (0, False, 1, "sm_90a")


def _gqa_problem(heads_q: int, heads_kv: int, known: bool = True) -> Problem:
    n = 4096 if known else None
    return Problem(target=None, dtype="bf16", hdim=128, hdim_v=128, causal=True, max_seqlen_q=n,
                   max_seqlen_k=n, heads_q=heads_q, heads_kv=heads_kv, num_sms=132, batch=1)


def test_sm90_bwd_splits_a_gqa_group_over_ctas() -> None:
    from cute_flash.hopper import bwd_config

    gqa, mha = _gqa_problem(32, 8), _gqa_problem(16, 16)
    assert bwd_config.plan(gqa)[1].split_heads and dispatch.bwd_head_split(gqa, "sm90") > 1
    assert not bwd_config.plan(mha)[1].split_heads and dispatch.bwd_head_split(mha, "sm90") == 1
    assert dispatch.bwd_head_split(gqa, "sm80") == 1
    one = (("head_split", 1),)
    assert not bwd_config.plan(gqa, one)[1].split_heads and bwd_config.head_split(gqa, one) == 1
    # A compile-only GQA problem builds both kernels; the split one where the extents ask for it.
    variants = bwd_config.compile_variants(_gqa_problem(32, 8, known=False))
    assert {c.split_heads for c in variants if isinstance(c, BwdSm90Config)} == {False, True}


@pytest.mark.parametrize("heads,batch,seqlen,want", [
    ((32, 1), 2, 8192, 8),  # MQA: 128 CTA rows of key blocks -> 8 per K/V head for 1024 CTAs
    ((32, 8), 1, 8192, 2),  # 512 -> 1024
    ((32, 8), 1, 32768, 1),  # 2048 CTAs already
    ((24, 8), 1, 3001, 3),  # 192 CTAs: the whole group of 3
])
def test_sm90_bwd_head_split_fills_the_grid_with_the_fewest_splits(heads, batch, seqlen, want) -> None:
    from cute_flash.hopper import bwd_config

    p = Problem(target=None, dtype="bf16", hdim=128, hdim_v=128, causal=True, max_seqlen_q=seqlen,
                max_seqlen_k=seqlen, heads_q=heads[0], heads_kv=heads[1], batch=batch, num_sms=132)
    assert bwd_config.head_split(p) == want


def test_sm90_bwd_head_split_must_divide_the_group() -> None:
    from cute_flash.hopper import bwd_config

    with pytest.raises(ValueError, match="divide the group"):
        bwd_config.head_split(_gqa_problem(32, 8), (("head_split", 3),))


@pytest.mark.parametrize("causal,window,want", [
    (False, (-1, -1), (False, False, -1, -1)), (True, (-1, -1), (True, False, -1, 0)),
    (True, (128, -1), (False, True, 128, 0)), (False, (128, -1), (False, True, 128, -1)),
    (False, (-1, 64), (False, True, -1, 64)), (True, (-1, 64), (True, False, -1, 0)),
    (False, (32, 16), (False, True, 32, 16)), (False, (-5, -3), (False, False, -1, -1))])
def test_windows_normalize_to_what_the_kernels_take(causal: bool, window: tuple, want: tuple) -> None:
    """(causal, local, left, right): a causal mask is the window (left, 0); causal with a left
    bound is a sliding window; a window unbounded on both sides is no window."""
    assert launch.normalize_window(causal, window) == want


# ---------------------------------------------------------------------------------------------
# The backward family and launcher
# ---------------------------------------------------------------------------------------------
def test_backward_family_is_sm90_on_hopper_where_it_covers_the_problem(monkeypatch) -> None:
    """``auto``: the FA3 backward on Hopper for its head dims (d_v = d, and (192, 128)), softcap
    at its softcap head dims; FA2 elsewhere and on other GPUs; ``sm80`` forces FA2; ``sm90``
    forces FA3 and refuses what it does not cover; anything else is a clear error."""
    assert set(SM90_BWD_HDIMS) >= {64, 96, 128, 192, 256} and SM90_BWD_NARROW_V == {192: 128}
    uncovered = ((128, 64, False), (256, 128, False), (80, 80, True), (32, 32, False), (160, 160, False))
    for choice in (None, "auto", "sm90"):
        if choice is None:
            monkeypatch.delenv(BWD_KERNEL_ENV, raising=False)
        else:
            monkeypatch.setenv(BWD_KERNEL_ENV, choice)
        for d in SM90_BWD_HDIMS:
            assert bwd_family("sm_90a", d, d, False) == "sm90"
            assert bwd_family("sm_90a", d, d, True) == ("sm90" if d in SM90_BWD_SOFTCAP_HDIMS else "sm80")
        assert bwd_family("sm_90a", 192, 128, False) == "sm90"
        for args in uncovered:
            if choice == "sm90":
                with pytest.raises(ValueError, match="CUTE_FLASH_BWD_KERNEL=sm90"):
                    bwd_family("sm_90a", *args)
            else:
                assert bwd_family("sm_90a", *args) == "sm80"
    monkeypatch.setenv(BWD_KERNEL_ENV, "sm80")
    assert bwd_family("sm_90a", 128, 128, False) == "sm80"
    monkeypatch.delenv(BWD_KERNEL_ENV)
    assert bwd_family("sm_80", 128, 128, False) == "sm80"
    monkeypatch.setenv(BWD_KERNEL_ENV, "sm90")
    with pytest.raises(ValueError, match="needs a Hopper GPU"):
        bwd_family("sm_80", 128, 128, False)
    monkeypatch.setenv(BWD_KERNEL_ENV, "fa3")
    with pytest.raises(ValueError, match="CUTE_FLASH_BWD_KERNEL must be one of"):
        bwd_family("sm_90a", 128, 128, False)


def test_backward_configs_are_refused_for_unsupported_head_dims() -> None:
    for family in ("sm80", "sm90"):
        with pytest.raises(ValueError, match="head dims must be in"):
            dispatch.bwd_configs(Problem(target="sm_90a", dtype="bf16", hdim=80, hdim_v=80), family)


def _run_bwd(causal: bool, window: tuple[int, int], deterministic: bool = False, d: int = 128, **kw) -> None:
    q, k, v, o, do = (torch.randn(2, 70, 4, d, dtype=BF16) for _ in range(5))
    lse = torch.randn(2, 4, 70)
    launch.run_bwd(do, q, k, v, o, lse, *(torch.empty_like(t) for t in (q, k, v)), softmax_scale=0.1,
                   causal=causal, window_size=window, softcap=0.0, deterministic=deterministic, **kw)


def test_run_bwd_launches_the_sm90_backward_when_forced(gpu, monkeypatch) -> None:
    compiled = gpu(9, 0)
    monkeypatch.setenv(BWD_KERNEL_ENV, "sm90")
    _run_bwd(causal=True, window=(-1, 0), deterministic=True)
    pre, main, post = compiled
    assert [type(c).__name__ for c in compiled] == ["BwdPreConfig", "BwdSm90Config", "BwdSm90PostConfig"]
    assert main.causal and main.deterministic and pre.deterministic and pre.launch_dependents
    assert pre.tile_m == post.tile_m == main.tile_m and main.target is None


def test_run_bwd_passes_overrides_to_the_sm90_plan_only(gpu) -> None:
    compiled = gpu(9, 0)
    _run_bwd(causal=True, window=(-1, -1), family="sm90", overrides=dict(mask_always=True, rotate_m=True))
    assert isinstance(compiled[1], BwdSm90Config) and compiled[1].mask_always and compiled[1].rotate_m
    with pytest.raises(ValueError, match="overrides are for the sm90 backward"):
        _run_bwd(causal=True, window=(-1, -1), family="sm80", overrides=dict(tile_m=64))


def test_run_bwd_refuses_a_value_head_dim_above_the_qk_one_before_anything_runs(gpu) -> None:
    compiled = gpu(9, 0)
    q, k, o, do = (torch.randn(2, 70, 4, 64, dtype=BF16) for _ in range(4))
    v = torch.randn(2, 70, 4, 128, dtype=BF16)
    with pytest.raises(ValueError, match="v's head dim <= q's head dim"):
        launch.run_bwd(do, q, k, v, o, torch.randn(2, 4, 70), torch.empty_like(q), torch.empty_like(k),
                       torch.empty_like(v), softmax_scale=0.1, causal=False)
    assert compiled == []


def test_run_bwd_of_an_empty_problem_zeroes_the_gradients_without_a_launch(gpu) -> None:
    compiled = gpu(9, 0)
    q, k, v, o, do = (torch.randn(2, 70, 4, 64, dtype=BF16) for _ in range(5))
    cu = torch.zeros(3, dtype=torch.int32)
    grads = [torch.full_like(t, float("nan")) for t in (q[0], k[0], v[0])]
    launch.run_bwd(do[0], q[0], k[0], v[0], o[0], torch.randn(4, 70), *grads, softmax_scale=0.1, causal=True,
                   cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=0, max_seqlen_k=0)
    assert compiled == [] and all((g == 0).all() for g in grads)


@pytest.mark.parametrize("causal,window", [(True, (128, -1)), (True, (-1, -1)), (False, (128, -1)),
                                           (False, (-1, 64)), (True, (-1, 64)), (False, (32, 16))])
def test_run_bwd_hands_the_sm90_kernel_the_mask_it_was_given(gpu, monkeypatch, causal, window) -> None:
    """A causal window (left, -1) is (left, 0): the kernel must not receive causal=False with the
    raw (left, -1), which would unbound the window's right side (this gave wrong gradients on the
    H200 for causal + left-window at d=256)."""
    compiled = gpu(9, 0)
    calls = []
    real = jit.compile_kernel

    def recording(cfg, keep=False):
        real(cfg, keep)
        return lambda *args: calls.append((cfg, args))

    monkeypatch.setattr(jit, "compile_kernel", recording)
    _run_bwd(causal=causal, window=window, d=256)
    (main, args), = [(c, a) for c, a in calls if isinstance(c, BwdSm90Config)]
    left, right = args[14:16]
    assert (main.causal, main.local, left, right) == launch.normalize_window(causal, window)
    assert len(compiled) == 3


def test_sm80_backward_plan_shares_the_query_tile_and_dlse() -> None:
    p = Problem(target="sm_80", dtype="fp16", hdim=96, hdim_v=96, causal=True, deterministic=True, dlse=True)
    pre, main, post = dispatch.bwd_configs(p, "sm80")
    assert isinstance(main, BwdConfig) and main.causal and main.deterministic and main.dtype == "fp16"
    assert pre.dlse and pre.tile_m == main.tiles.tile_m and post.tiles == main.tiles
    assert pre.target == main.target == post.target == "sm_80"
