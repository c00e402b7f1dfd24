"""Which forward kernel family a launch uses (``cute_flash.fwd.fwd_family``), checked on the CPU: the
device's compute capability is faked and the compile step is replaced by a recorder, so the real
launcher path (public API -> op -> ``run_fwd``) runs up to the point where a kernel would start."""

from __future__ import annotations

import contextlib

import pytest
import torch

import cute_flash
from cute_flash import fwd, jit, ops
from cute_flash.fwd import FWD_KERNEL_ENV, FwdConfig, fwd_family
from cute_flash.fwd_sm90 import FwdSm90Config

BF16 = torch.bfloat16


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch):
    """Set the fake device's capability with ``gpu(major, minor)``; returns the configs that
    ``run_fwd`` compiled (the stand-in kernel writes zeros, so callers get finite outputs)."""
    compiled: list = []

    def compile_kernel(cfg, keep=False):
        compiled.append(cfg)
        return lambda q, k, v, out, lse, *rest: (out.zero_(), lse.zero_())

    monkeypatch.delenv(FWD_KERNEL_ENV, raising=False)
    monkeypatch.setattr(jit, "compile_kernel", compile_kernel)
    monkeypatch.setattr(torch.cuda, "device", lambda _dev: contextlib.nullcontext())

    def set_capability(major: int, minor: int = 0) -> list:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, minor))
        return compiled

    return set_capability


@pytest.mark.parametrize("capability,family", [((9, 0), FwdSm90Config), ((8, 0), FwdConfig),
                                               ((8, 9), FwdConfig), ((10, 0), FwdConfig)])
def test_auto_takes_sm90_on_hopper_only(gpu, capability, family):
    gpu(*capability)
    assert fwd_family("cuda") is family
    assert fwd_family("cuda", 128, 64) is family


def test_env_forces_a_family_per_call(gpu, monkeypatch):
    gpu(9, 0)
    monkeypatch.setenv(FWD_KERNEL_ENV, "sm80")
    assert fwd_family() is FwdConfig
    monkeypatch.setenv(FWD_KERNEL_ENV, "SM90")
    assert fwd_family() is FwdSm90Config
    monkeypatch.setenv(FWD_KERNEL_ENV, "auto")
    assert fwd_family() is FwdSm90Config
    gpu(8, 6)
    monkeypatch.setenv(FWD_KERNEL_ENV, "sm80")
    assert fwd_family() is FwdConfig


def test_sm90_forced_on_a_gpu_that_is_not_hopper_raises(gpu, monkeypatch):
    gpu(8, 6)
    monkeypatch.setenv(FWD_KERNEL_ENV, "sm90")
    with pytest.raises(ValueError, match=r"needs a Hopper GPU \(compute capability 9.x\); this one is 8.6"):
        fwd_family()


def test_unknown_env_value_raises(gpu, monkeypatch):
    gpu(9, 0)
    monkeypatch.setenv(FWD_KERNEL_ENV, "fa3")
    with pytest.raises(ValueError, match="CUTE_FLASH_FWD_KERNEL must be one of auto, sm80, sm90, got 'fa3'"):
        fwd_family()


def test_auto_falls_back_to_sm80_for_head_dims_sm90_lacks(gpu, monkeypatch):
    gpu(9, 0)
    monkeypatch.setattr("cute_flash.fwd_sm90.SM90_FWD_TILES", {128: (128, 128, 2, 2, False, True)})
    assert fwd_family(None, 128, 128) is FwdSm90Config
    assert fwd_family(None, 64, 64) is FwdConfig
    assert fwd_family(None, 64, 256) is FwdConfig  # the larger of the two head dims decides
    assert not fwd.sm90_supports(128, 256)


def test_public_entry_points_launch_the_sm90_family_on_hopper(gpu, monkeypatch):
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


def test_flash_attn_func_reaches_run_fwd_through_the_cuda_op(gpu, monkeypatch):
    """The public functions all end in ``ops._fwd_cuda``, which leaves the family to ``run_fwd``."""
    compiled = gpu(9, 0)
    seen = []
    monkeypatch.setattr(ops, "_fwd_cpu", lambda *a, **kw: seen.append(a) or ops._fwd_cuda(*a, **kw))
    q, k, v = (torch.randn(1, 33, 2, 128, dtype=BF16) for _ in range(3))
    cute_flash.flash_attn_func(q, k, v, causal=True)
    cute_flash.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    cu = torch.tensor([0, 33], dtype=torch.int32)
    cute_flash.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 33, 33)
    assert len(seen) == 3 and [type(c) for c in compiled] == [FwdSm90Config] * 3


def test_sm90_persistent_grid_is_chosen_where_it_measured_faster(monkeypatch):
    """Causal: atomic tile claims (d = 128 at any N, d = 64 from 2k keys, wider heads up to 4k keys);
    unmasked: a static
    stride for d <= 128 up to 2k keys; sliding windows, varlen and everything else: one CTA per tile."""
    from types import SimpleNamespace

    from cute_flash import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "sm_count", lambda device: 132)

    def fields(n: int, d: int, causal: bool = False, local: bool = False, varlen: bool = False) -> dict:
        t = SimpleNamespace(shape=(2, n, 4, d), device=torch.device("cuda", 0))
        return FwdSm90Config.launch_fields(t, t, causal=causal, local=local, varlen=varlen)

    dynamic = {"num_ctas": 132, "dynamic_tiles": True}
    assert fields(16384, 128, causal=True) == dynamic and fields(1024, 128, causal=True) == dynamic
    assert fields(2048, 64, causal=True) == dynamic and fields(1024, 64, causal=True) == {}
    assert fields(4096, 256, causal=True) == dynamic and fields(8192, 256, causal=True) == {}
    assert fields(2048, 128) == {"num_ctas": 132} and fields(4096, 128) == {} and fields(2048, 256) == {}
    assert fields(1024, 128, local=True) == {} and fields(1024, 128, causal=True, varlen=True) == {}


def test_sm90_packs_gqa_heads_when_the_query_group_fits_one_tile(monkeypatch):
    """H / H_kv query heads share the M tile when all their queries fit in it (decode, short
    prefill) and the group size divides the tile; otherwise one head per tile."""
    from types import SimpleNamespace

    from cute_flash import fwd_sm90

    monkeypatch.setattr(fwd_sm90, "sm_count", lambda device: 132)

    def pack(nq: int, h: int, hkv: int, d: int = 128, causal: bool = False, local: bool = False) -> int:
        dev = torch.device("cuda", 0)
        q = SimpleNamespace(shape=(2, nq, h, d), device=dev, stride=lambda: (nq * h * d, h * d, d, 1))
        v = SimpleNamespace(shape=(2, 4096, hkv, d), device=dev)
        return FwdSm90Config.launch_fields(q, v, causal=causal, local=local, varlen=False).get("pack_gqa", 1)

    assert pack(1, 32, 4) == 8 and pack(16, 32, 4, causal=True) == 8 and pack(5, 16, 2, local=True) == 8
    assert pack(17, 32, 4) == 1  # 17 * 8 rows > one 128-row tile
    assert pack(1, 12, 4) == 1  # 3 heads do not divide 128 rows ...
    assert pack(1, 12, 4, d=64) == 3  # ... but divide the 192-row d=64 tile
    assert pack(1, 8, 8) == 1  # no GQA
    # Q as a transposed (B, H, N, d) view (the SDPA-style entry): not packed.
    dev = torch.device("cuda", 0)
    q_t = SimpleNamespace(shape=(2, 4, 32, 128), device=dev, stride=lambda: (16384, 128, 512, 1))
    v = SimpleNamespace(shape=(2, 4096, 4, 128), device=dev)
    assert "pack_gqa" not in FwdSm90Config.launch_fields(q_t, v, causal=False, local=False, varlen=False)


def test_backward_family_is_sm90_on_hopper_where_it_covers_the_problem(monkeypatch):
    """``auto``: the FA3 backward on Hopper for d = 64 / 128 / 256 (softcap too), FA2 elsewhere
    and on other GPUs; ``sm80`` forces FA2; ``sm90`` forces FA3 and refuses what it does not
    cover; anything else is a clear error."""
    from cute_flash import bwd

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    dev = torch.device("cpu")
    uncovered = ((128, 64, 0.0), (256, 128, 0.0), (80, 80, 30.0))
    for choice in (None, "auto", "sm90"):
        if choice is None:
            monkeypatch.delenv(bwd.BWD_KERNEL_ENV, raising=False)
        else:
            monkeypatch.setenv(bwd.BWD_KERNEL_ENV, choice)
        for d in (64, 128, 256):
            assert bwd.bwd_family(dev, d, d, 0.0) == "sm90"
        for d in (64, 128, 256):
            assert bwd.bwd_family(dev, d, d, 30.0) == "sm90"
        # Compiled but not yet GPU-checked: only when forced.
        from cute_flash.bwd_sm90 import SM90_BWD_GPU_CHECKED

        for d in (96, 192):
            expect = "sm90" if choice == "sm90" or d in SM90_BWD_GPU_CHECKED else "sm80"
            assert bwd.bwd_family(dev, d, d, 0.0) == expect
        from cute_flash.bwd_sm90 import SM90_BWD_GPU_CHECKED_V

        expect = "sm90" if choice == "sm90" or (192, 128) in SM90_BWD_GPU_CHECKED_V else "sm80"
        assert bwd.bwd_family(dev, 192, 128, 0.0) == expect
        for args in uncovered:
            if choice == "sm90":
                with pytest.raises(ValueError):
                    bwd.bwd_family(dev, *args)
            else:
                assert bwd.bwd_family(dev, *args) == "sm80"
    monkeypatch.setenv(bwd.BWD_KERNEL_ENV, "sm80")
    assert bwd.bwd_family(dev, 128, 128, 0.0) == "sm80"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.delenv(bwd.BWD_KERNEL_ENV, raising=False)
    assert bwd.bwd_family(dev, 128, 128, 0.0) == "sm80"
    monkeypatch.setenv(bwd.BWD_KERNEL_ENV, "sm90")
    with pytest.raises(ValueError):
        bwd.bwd_family(dev, 128, 128, 0.0)
    monkeypatch.setenv(bwd.BWD_KERNEL_ENV, "fa3")
    with pytest.raises(ValueError):
        bwd.bwd_family(dev, 128, 128, 0.0)


def test_run_bwd_launches_the_sm90_backward_when_forced(monkeypatch):
    from cute_flash import bwd, bwd_sm90

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv(bwd.BWD_KERNEL_ENV, "sm90")
    seen = []
    monkeypatch.setattr(bwd_sm90, "run_bwd_sm90", lambda *a, **kw: seen.append(kw))
    q, k, v, o, do = (torch.randn(2, 70, 4, 128, dtype=BF16) for _ in range(5))
    lse = torch.randn(2, 4, 70)
    bwd.run_bwd(do, q, k, v, o, lse, *(torch.empty_like(t) for t in (q, k, v)), softmax_scale=0.1,
                causal=True, window_size=(-1, 0), softcap=0.0, deterministic=True)
    assert len(seen) == 1 and seen[0]["causal"] and seen[0]["deterministic"]


@pytest.mark.parametrize("causal,window", [(True, (128, -1)), (True, (-1, -1)), (False, (128, -1)),
                                           (False, (-1, 64)), (True, (-1, 64)), (False, (32, 16))])
def test_run_bwd_hands_the_sm90_launcher_the_mask_it_was_given(monkeypatch, causal, window):
    """A causal window (left, -1) is (left, 0): the launcher must not receive causal=False with the
    raw (left, -1), which would unbound the window's right side (this gave wrong gradients on the
    H200 for causal + left-window at d=256)."""
    from cute_flash import bwd, bwd_sm90
    from cute_flash.fwd import normalize_window

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.delenv(bwd.BWD_KERNEL_ENV, raising=False)
    seen = []
    monkeypatch.setattr(bwd_sm90, "run_bwd_sm90", lambda *a, **kw: seen.append(kw))
    q, k, v, o, do = (torch.randn(2, 70, 4, 128, dtype=BF16) for _ in range(5))
    lse = torch.randn(2, 4, 70)
    bwd.run_bwd(do, q, k, v, o, lse, *(torch.empty_like(t) for t in (q, k, v)), softmax_scale=0.1,
                causal=causal, window_size=window, softcap=0.0, deterministic=False)
    assert len(seen) == 1
    assert normalize_window(seen[0]["causal"], seen[0]["window_size"]) == normalize_window(causal, window)


def test_forward_config_is_built_once_per_input_metadata():
    """``fwd_config`` remembers the config of each (family, dtype, shapes, strides, device, mask)
    so a training step does not rebuild it on the host; anything it reads changes the answer."""
    q, k, v = (torch.randn(2, 70, 4, 64, dtype=BF16) for _ in range(3))
    kw = dict(causal=True, local=False, softcap=0.0, varlen=False, config_cls=FwdSm90Config)
    first = fwd.fwd_config(q, v, **kw)
    assert fwd.fwd_config(q.clone(), v.clone(), **kw) is first
    assert not fwd.fwd_config(q, v, **(kw | dict(causal=False))).causal
    assert fwd.fwd_config(q, v, **(kw | dict(softcap=30.0))).softcap
    assert fwd.fwd_config(q[..., :32].contiguous(), v[..., :32].contiguous(), **kw).hdim == 32
    assert type(fwd.fwd_config(q, v, **(kw | dict(config_cls=FwdConfig)))) is FwdConfig
