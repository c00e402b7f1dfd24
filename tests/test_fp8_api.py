"""The FP8 forward through the public API (issue 5), on the CPU (the ops' reference
implementations): e4m3 inputs with descales and ``fp8=True`` give the reference's results, bad
input is refused before anything runs, ``torch.compile(fullgraph=True)`` traces the path, and V
in the kernel's token order gives the same attention."""

from __future__ import annotations

import math

import pytest
import torch

from cute_flash import flash_attn_func, quantize_qkv
from cute_flash.fp8_ref import attention_fp8_ref, quantize_qkv_ref, v_storage_strides


def _inputs(b=2, nq=40, nk=56, h=4, hkv=2, d=64, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return (torch.randn(b, nq, h, d, dtype=dtype), torch.randn(b, nk, hkv, d, dtype=dtype),
            torch.randn(b, nk, hkv, d, dtype=dtype))


def test_quantize_qkv_is_the_reference_quantizer_with_token_contiguous_v() -> None:
    q, k, v = _inputs()
    got = quantize_qkv(q, k, v, seed=5)
    ref = quantize_qkv_ref(q, k, v, rotate_qk=True, seed=5)
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype and torch.equal(g.float(), r.float())
    b, nk, hkv, d = k.shape
    assert got[2].stride() == v_storage_strides(b, nk, hkv, d)


@pytest.mark.parametrize("causal", [False, True])
def test_e4m3_inputs_with_descales_give_the_fp8_reference(causal: bool) -> None:
    q, k, v = _inputs()
    q8, k8, v8, qd, kd, vd = quantize_qkv_ref(q, k, v, rotate_qk=False)
    out, lse = flash_attn_func(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                               return_lse=True)
    ref, ref_lse = attention_fp8_ref(q8, k8, v8, qd, kd, vd, softmax_scale=1 / math.sqrt(64), causal=causal)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert torch.allclose(out.float(), ref, atol=1e-2, rtol=1e-2)
    assert torch.allclose(lse, ref_lse, atol=1e-5)


def test_fp8_true_quantizes_with_rotation_and_stays_close_to_bf16_attention() -> None:
    q, k, v = _inputs(d=128)
    out = flash_attn_func(q, k, v, fp8=True)
    exact = flash_attn_func(q, k, v)
    assert out.dtype == q.dtype and out.shape == exact.shape
    err = (out.float() - exact.float()).pow(2).mean().sqrt()
    # e4m3 keeps 3 mantissa bits: ~5% relative RMS error here (garbage would be ~100%).
    assert err < 0.08 * exact.float().pow(2).mean().sqrt()
    # Missing descales mean 1.
    q8, k8, v8, *_ = quantize_qkv_ref(q, k, v)
    ones = torch.ones(2, 2)
    a = flash_attn_func(q8, k8, v8)
    b = flash_attn_func(q8, k8, v8, q_descale=ones, k_descale=ones, v_descale=ones)
    assert torch.equal(a, b)


def test_fp8_refuses_bad_input_before_running() -> None:
    q, k, v = _inputs()
    q8, k8, v8, qd, kd, vd = quantize_qkv_ref(q, k, v)
    with pytest.raises(ValueError, match="descale"):
        flash_attn_func(q8, k8, v8, q_descale=qd[:1], k_descale=kd, v_descale=vd)
    with pytest.raises(ValueError, match="descale"):
        flash_attn_func(q8, k8, v8, q_descale=qd.double(), k_descale=kd, v_descale=vd)
    with pytest.raises(TypeError):
        flash_attn_func(q8, k8, v.bfloat16(), q_descale=qd, k_descale=kd, v_descale=vd)
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_func(q8, k8, v8, softcap=10.0)
    with pytest.raises(ValueError, match="forward-only"):
        flash_attn_func(q.requires_grad_(), k, v, fp8=True)
    with pytest.raises(ValueError, match="descale"):
        flash_attn_func(q.detach(), k, v, q_descale=qd)
    q96, k96, v96 = _inputs(d=96)
    with pytest.raises(ValueError, match="head dim"):
        flash_attn_func(q96, k96, v96, fp8=True)
    with pytest.raises(TypeError):
        quantize_qkv(q.float(), k.float(), v.float())


def test_torch_compile_traces_the_fp8_path() -> None:
    q, k, v = _inputs()

    def f(q, k, v):
        return flash_attn_func(q, k, v, fp8=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(q, k, v).float(), f(q, k, v).float())


def test_opcheck_fp8_ops() -> None:
    """Fake implementations (shapes, dtypes, strides: v8's padded token-contiguous view included)
    and autograd registration of the two FP8 ops. (opcheck's schema test compares outputs with
    arithmetic that CPU e4m3 tensors do not support, hence the explicit list.)"""
    utils = ("test_faketensor", "test_autograd_registration")
    q, k, v = _inputs(nk=50)
    torch.library.opcheck(torch.ops.cute_flash.quantize_qkv.default, (q, k, v, True, 3), test_utils=utils)
    q8, k8, v8, qd, kd, vd = quantize_qkv_ref(q, k, v)
    torch.library.opcheck(torch.ops.cute_flash.fwd_fp8.default,
                          (q8, k8, v8, qd, kd, vd, 0.125, True, -1, 0, torch.bfloat16), test_utils=utils)
    # V in the kernel's token order: (B, H_kv, d, N_pad) storage between the two ops.
    quant = torch.ops.cute_flash.quantize_qkv.default
    torch.library.opcheck(quant, (q, k, v, True, 3, True), test_utils=utils)
    q8, k8, v8, qd, kd, vd = quantize_qkv_ref(q, k, v, v_perm=True)
    assert v8.shape == (k.shape[0], k.shape[2], k.shape[3], 64)
    torch.library.opcheck(torch.ops.cute_flash.fwd_fp8.default,
                          (q8, k8, v8, qd, kd, vd, 0.125, True, -1, 0, torch.bfloat16, True),
                          test_utils=utils)


def test_kernel_order_v_gives_the_same_attention_as_natural_v() -> None:
    q, k, v = _inputs(nk=50)
    natural = attention_fp8_ref(*quantize_qkv_ref(q, k, v), causal=True)[0]
    permuted = attention_fp8_ref(*quantize_qkv_ref(q, k, v, v_perm=True), causal=True, v_perm=True)[0]
    assert torch.equal(natural, permuted)
