"""``python -m cute_flash warmup``: the variants it plans are the ones the launchers run, over any
shape, and what it compiles without a GPU is what a later process loads instead of compiling."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cute_flash import dispatch, jit, launch, launch_kvcache
from cute_flash.tools import warmup
from cute_flash.tools.warmup import AttentionSpec

SPECS = [
    AttentionSpec(hdim=128, heads_q=32, heads_kv=8),
    AttentionSpec(hdim=128, heads_q=64, heads_kv=8),
    AttentionSpec(hdim=64, heads_q=32, heads_kv=1, causal=False),
    AttentionSpec(hdim=64, heads_q=16, heads_kv=16, causal=False),
    AttentionSpec(hdim=256, heads_q=16, heads_kv=8, softcap=True),
    AttentionSpec(hdim=96, heads_q=12, heads_kv=12),
    AttentionSpec(hdim=128, heads_q=32, heads_kv=8, window=True, varlen=True),
    AttentionSpec(hdim=256, heads_q=8, heads_kv=4, window=True, softcap=True),
    AttentionSpec(hdim=64, heads_q=16, heads_kv=16, causal=False, window=True),
]


def _launched(spec: AttentionSpec, nq: int, nk: int, batch: int) -> list[jit.KernelConfig]:
    """The configs the launchers build for one call (``launch.run_fwd`` / ``run_bwd`` plan through
    these two functions), on an sm_90a GPU with 132 SMs."""
    window = (4095, 4095) if spec.window else (-1, -1)  # (as transformers passes a 4096 window)
    causal, local, _, _ = launch.normalize_window(spec.causal, window)
    masks = dict(causal=causal, local=local, softcap=spec.softcap, varlen=spec.varlen)
    fam = dispatch.fwd_family("sm_90a", spec.hdim, spec.hdim)
    p = dispatch.fwd_problem(spec.dtype, spec.hdim, spec.hdim, **masks, seqlen_q=nq, seqlen_k=nk,
                             heads_q=spec.heads_q, heads_kv=spec.heads_kv, num_sms=132)
    out = [dispatch.fwd_config(p, fam)]
    if nq == nk:
        fam = dispatch.bwd_family("sm_90a", spec.hdim, spec.hdim, spec.softcap)
        p = dispatch.bwd_problem(fam, "sm_90a", spec.dtype, spec.hdim, spec.hdim, **masks,
                                 deterministic=False, dlse=False, seqlen_q=nq, seqlen_k=nk,
                                 heads_q=spec.heads_q, heads_kv=spec.heads_kv, batch=batch, num_sms=132)
        out += dispatch.bwd_configs(p, fam)
    return [replace(c, target="sm_90a") for c in out]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label().replace(" ", "-"))
def test_the_sweep_covers_the_plans_of_lengths_and_batches_outside_it(spec: AttentionSpec, seed: int) -> None:
    planned = set(warmup.plan_configs(spec, "sm_90a", 132))
    rng = random.Random(seed)
    for _ in range(150):
        nq = rng.choice([rng.randint(1, 300), rng.randint(1, 6000), rng.randint(1, 131072)])
        nk = nq if rng.random() < 0.7 else rng.randint(nq, 131072)
        batch = rng.randint(1, 256)
        for cfg in _launched(spec, nq, nk, batch):
            assert cfg in planned, f"Nq={nq} Nk={nk} B={batch}: {cfg.describe()} is not warmed"


FP8_SPECS = [
    AttentionSpec(hdim=128, heads_q=32, heads_kv=8, fp8=True, backward=False),
    AttentionSpec(hdim=256, heads_q=16, heads_kv=16, causal=False, fp8=True, backward=False),
    AttentionSpec(hdim=64, heads_q=16, heads_kv=4, varlen=True, fp8=True, backward=False),
    AttentionSpec(hdim=128, heads_q=32, heads_kv=8, window=True, fp8=True, backward=False),
]


def _launched_fp8(spec: AttentionSpec, nq: int, nk: int) -> list[jit.KernelConfig]:
    """The configs of one ``fp8=True`` call: the quantize kernels, then the e4m3 forward planned
    as ``launch.run_fwd_fp8`` plans it (for packed sequences, from the token totals)."""
    causal, local, _, _ = launch.normalize_window(spec.causal, (4095, 0) if spec.window else (-1, -1))
    quant = dispatch.quant_configs(spec.dtype, spec.hdim, True, v_perm=not spec.varlen, varlen=spec.varlen,
                                   v_aligned=spec.varlen)
    p = dispatch.fp8_problem(spec.dtype, spec.hdim, spec.hdim, causal=causal, local=local, varlen=spec.varlen,
                             seqlen_q=nq, seqlen_k=nk, heads_q=spec.heads_q, heads_kv=spec.heads_kv,
                             num_sms=132, q_dense=True)
    return [replace(c, target="sm_90a") for c in (*quant, dispatch.fp8_fwd_config(p, v_perm=not spec.varlen))]


def _launched_fp8_bwd(spec: AttentionSpec, n: int, batch: int) -> list[jit.KernelConfig]:
    """The configs of one FP8 backward, as ``launch.run_bwd_fp8`` plans them: V's quantize
    kernel, the token-contiguous re-layouts, (pre, main, post) (the preprocess quantizes dO)."""
    packed = spec.varlen
    p = dispatch.fp8_problem(spec.dtype, spec.hdim, spec.hdim, causal=spec.causal, local=False, varlen=packed,
                             seqlen_q=n, seqlen_k=n, heads_q=spec.heads_q, heads_kv=spec.heads_kv,
                             num_sms=132, q_dense=True)
    p = replace(p, deterministic=spec.deterministic, dlse=False, batch=batch)
    configs = [dispatch.fp8_bwd_quant_config(spec.dtype, spec.hdim, packed), *dispatch.fp8_bwd_configs(p),
               *(dispatch.relayout_v_config(spec.hdim, v_perm=perm, varlen=packed)
                 for perm in (False, True))]
    return [replace(c, target="sm_90a") for c in configs]


@pytest.mark.parametrize("spec", [AttentionSpec(hdim=128, heads_q=32, heads_kv=8, fp8=True),
                                  AttentionSpec(hdim=64, heads_q=16, heads_kv=16, causal=False, fp8=True),
                                  AttentionSpec(hdim=128, heads_q=16, heads_kv=4, varlen=True, fp8=True)],
                         ids=lambda s: s.label().replace(" ", "-"))
def test_the_fp8_sweep_covers_the_fp8_backward_of_any_length(spec: AttentionSpec, seed: int) -> None:
    planned = set(warmup.plan_configs(spec, "sm_90a", 132))
    assert any(type(c).__name__ == "BwdSm90Fp8Config" for c in planned)
    rng = random.Random(seed)
    for _ in range(100):
        n = rng.choice([rng.randint(1, 300), rng.randint(1, 6000), rng.randint(1, 131072)])
        for cfg in _launched_fp8_bwd(spec, n, rng.randint(1, 8)):
            assert cfg in planned, f"N={n}: {cfg.describe()} is not warmed"


@pytest.mark.parametrize("spec", FP8_SPECS, ids=lambda s: s.label().replace(" ", "-"))
def test_the_fp8_sweep_covers_the_quantize_and_e4m3_plans_of_any_length(spec: AttentionSpec,
                                                                         seed: int) -> None:
    planned = set(warmup.plan_configs(spec, "sm_90a", 132))
    assert any(type(c).__name__ == "FwdSm90Fp8Config" for c in planned)
    rng = random.Random(seed)
    for _ in range(150):
        nq = rng.choice([rng.randint(1, 300), rng.randint(1, 6000), rng.randint(1, 131072)])
        nk = nq if spec.varlen or rng.random() < 0.7 else rng.randint(nq, 131072)
        for cfg in _launched_fp8(spec, nq, nk):
            assert cfg in planned, f"Nq={nq} Nk={nk}: {cfg.describe()} is not warmed"


def test_fp8_warmup_is_refused_off_hopper_and_with_softcap() -> None:
    spec = FP8_SPECS[0]
    with pytest.raises(ValueError, match="Hopper"):
        warmup.plan_configs(spec, "sm_80", 108)
    with pytest.raises(ValueError, match="softcap"):
        warmup.plan_configs(replace(spec, softcap=True), "sm_90a", 132)


KV_SPECS = [
    (AttentionSpec(hdim=128, heads_q=32, heads_kv=8, kvcache=True, backward=False), "sm_90a"),
    (AttentionSpec(hdim=64, heads_q=12, heads_kv=2, window=True, kvcache=True, page_size=16, backward=False),
     "sm_90a"),
    (AttentionSpec(hdim=128, heads_q=16, heads_kv=16, causal=False, kvcache=True, backward=False), "sm_80"),
    (AttentionSpec(hdim=128, heads_q=32, heads_kv=8, kvcache=True, page_size=1, backward=False), "sm_90a"),
    (AttentionSpec(hdim=128, heads_q=32, heads_kv=8, kvcache=True, page_size=64, backward=False), "sm_80"),
    (AttentionSpec(hdim=128, heads_q=32, heads_kv=8, kvcache=True, fp8=True, page_size=16, backward=False),
     "sm_90a"),
]


def _kv_id(x) -> str:
    return x if isinstance(x, str) else x.label().replace(" ", "-")


@pytest.mark.parametrize("spec,arch", KV_SPECS, ids=_kv_id)
def test_the_kvcache_sweep_covers_the_launchers_plans_of_any_shape(spec: AttentionSpec, arch: str,
                                                                   seed: int) -> None:
    planned = set(warmup.plan_configs(spec, arch, 132))
    causal, local, _, _ = launch.normalize_window(spec.causal, (4095, 0) if spec.window else (-1, -1))
    rng = random.Random(seed)
    for _ in range(300):
        nq = rng.choice([1, rng.randint(1, 16), rng.randint(1, 4096)])
        capacity, batch = rng.randint(1, 200_000), rng.choice([1, rng.randint(1, 256)])
        p = dispatch.kvcache_problem(spec.dtype, spec.hdim, spec.hdim, causal=causal, local=local,
                                     softcap=spec.softcap, batch=batch, seqlen_q=nq, capacity=capacity,
                                     heads_q=spec.heads_q, heads_kv=spec.heads_kv, num_sms=132, q_dense=True)
        plan = dispatch.kvcache_plan(arch, p, batch_idx=False, leftpad=False, page_size=spec.page_size,
                                     kv_dtype="e4m3" if spec.fp8 else "")
        for cfg in (plan.config, plan.combine):
            if cfg is not None:
                where = f"Nq={nq} B={batch} cache={capacity}"
                assert replace(cfg, target=arch) in planned, f"{where}: {cfg.describe()}"


@pytest.mark.parametrize("spec,arch", KV_SPECS, ids=_kv_id)
def test_the_kvcache_sweep_covers_the_append_kernels_of_rotary_calls(spec: AttentionSpec, arch: str) -> None:
    planned = set(warmup.plan_configs(spec, arch, 132))
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype]
    cache = torch.float8_e4m3fn if spec.fp8 else dtype
    for table in (None, dtype, torch.float32):
        for interleaved in (True, False):
            for per_token in (True, False):
                cfg = launch_kvcache.append_config(dtype, cache, table, interleaved, per_token,
                                                   paged=spec.page_size > 0, batch_idx=False)
                assert replace(cfg, target=arch) in planned, cfg.describe()


def test_kvcache_warmup_refuses_what_the_path_cannot_run() -> None:
    paged = AttentionSpec(hdim=128, heads_q=32, heads_kv=8, kvcache=True, page_size=64, backward=False)
    with pytest.raises(ValueError, match="forward"):
        warmup.plan_configs(replace(paged, backward=True), "sm_90a", 132)


def test_specs_follow_a_decoder_config() -> None:
    llama = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
             "torch_dtype": "bfloat16"}
    specs = warmup.specs_from_model_config(llama)
    assert {(s.hdim, s.heads_q, s.heads_kv, s.dtype, s.window, s.softcap) for s in specs} == {
        (128, 32, 8, "bf16", False, False)}
    assert {s.varlen for s in specs} == {False, True}  # (padded batches go through varlen)
    gemma2 = {"hidden_size": 2304, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
              "sliding_window": 4096, "attn_logit_softcapping": 50.0, "dtype": "float16",
              "layer_types": ["sliding_attention", "full_attention"]}
    specs = warmup.specs_from_model_config(gemma2, padded=False)
    assert {(s.hdim, s.window, s.softcap, s.dtype) for s in specs} == {(256, False, True, "fp16"),
                                                                       (256, True, True, "fp16")}
    qwen2 = {"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
             "sliding_window": 131072, "use_sliding_window": False}
    assert {s.window for s in warmup.specs_from_model_config(qwen2)} == {False}
    mistral_in_a_vlm = {"text_config": {"hidden_size": 5120, "num_attention_heads": 32,
                                        "num_key_value_heads": 8, "head_dim": 128, "sliding_window": 4096}}
    assert {s.window for s in warmup.specs_from_model_config(mistral_in_a_vlm)} == {False, True}
    # Every layer slides, but sequences shorter than the window run without it.
    all_sliding = dict(llama, sliding_window=4096, layer_types=["sliding_attention"] * 4)
    assert {s.window for s in warmup.specs_from_model_config(all_sliding)} == {False, True}
    no_sliding = dict(llama, sliding_window=4096, layer_types=["full_attention"] * 4)
    assert {s.window for s in warmup.specs_from_model_config(no_sliding)} == {False}
    assert not any(s.backward for s in warmup.specs_from_model_config(llama, backward=False))


def _cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cute_flash", "warmup", *args], env=env, capture_output=True,
                          text=True, timeout=900)


def test_warmup_without_a_gpu_needs_an_architecture(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", CUTE_FLASH_CACHE="1", CUTE_FLASH_CACHE_DIR=str(tmp_path))
    res = _cli(["--hdim", "64"], env)
    assert res.returncode != 0 and "--arch" in res.stderr


def test_a_warmed_variant_is_loaded_by_the_launch_path_of_a_later_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", CUTE_FLASH_CACHE="1", CUTE_FLASH_CACHE_DIR=str(tmp_path))
    args = ["--hdim", "64", "--heads", "4", "4", "--no-bwd", "--seqlen", "300", "--arch", "sm_90a",
            "--workers", "1"]
    listed = _cli([*args, "--list"], env)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.count("fwd_sm90[sm_90a]") == 1
    res = _cli(args, env)
    assert res.returncode == 0, res.stderr
    assert "1 compiled, 0 already cached" in res.stderr
    assert "0 compiled, 1 already cached" in _cli(args, env).stderr
    # The launcher's config has no target (the current GPU, here an H100 as the DSL sees it): it
    # finds the warmed entry.
    monkeypatch.setattr(jit, "_dsl_arch", lambda: "sm_90a")
    monkeypatch.setenv("CUTE_FLASH_CACHE", "1")
    monkeypatch.setenv("CUTE_FLASH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(jit, "_cache", {})
    monkeypatch.setattr(jit, "_compile", lambda cfg, keep: pytest.fail(f"compiled {cfg.describe()}"))
    p = dispatch.fwd_problem("bf16", 64, 64, causal=True, local=False, softcap=False, varlen=False,
                             seqlen_q=300, seqlen_k=300, heads_q=4, heads_kv=4, num_sms=132)
    assert callable(jit.compile_kernel(dispatch.fwd_config(p, "sm90")))
