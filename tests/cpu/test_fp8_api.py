"""The FP8 forward through the public API, on the CPU (the ops' reference
implementations): e4m3 inputs with descales and ``fp8=True`` give the reference's results, bad
input is refused before anything runs, ``torch.compile(fullgraph=True)`` traces the path, and V
in the kernel's token order gives the same attention."""

from __future__ import annotations

import math

import pytest
import torch

from cute_flash import flash_attn_func, quantize_qkv
from cute_flash.formats import v_storage_strides
from cute_flash.reference_fp8 import attention_fp8_ref, quantize_qkv_ref


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
    with pytest.raises(NotImplementedError, match="sliding window"):
        flash_attn_func(q.requires_grad_(), k, v, fp8=True, window_size=(8, 0))
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


# ---------------------------------------------------------------------------------------------
# Packed sequences (flash_attn_varlen_func)
# ---------------------------------------------------------------------------------------------
def _varlen_inputs(lens_q=(17, 0, 43, 4), lens_k=(30, 5, 43, 1), h=4, hkv=2, d=64):
    torch.manual_seed(1)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), h, d, dtype=torch.bfloat16)
    k, v = (torch.randn(int(cu_k[-1]), hkv, d, dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, cu_q, cu_k, max(lens_q), max(lens_k)


def _seqs(cu: torch.Tensor) -> list[tuple[int, int]]:
    c = cu.tolist()
    return list(zip(c[:-1], c[1:], strict=True))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_e4m3_inputs_give_each_sequence_its_own_fp8_attention(causal: bool) -> None:
    """Per-(sequence, kv head) descales; each sequence as ``flash_attn_func`` computes it alone
    (masks aligned within the sequence; an empty query sequence and a one-key one included)."""
    from cute_flash import flash_attn_varlen_func

    q, k, v, cu_q, cu_k, mq, mk = _varlen_inputs()
    parts = [quantize_qkv_ref(q[None, a:b], k[None, c:e], v[None, c:e])
             for (a, b), (c, e) in zip(_seqs(cu_q), _seqs(cu_k), strict=True)]
    q8, k8, v8 = (torch.cat([p[i][0].float() for p in parts]).to(torch.float8_e4m3fn) for i in range(3))
    qd, kd, vd = (torch.cat([p[i] for p in parts]) for i in range(3, 6))
    out, lse = flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, mq, mk, causal=causal, q_descale=qd,
                                      k_descale=kd, v_descale=vd, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    for s, ((a, b), (c, e)) in enumerate(zip(_seqs(cu_q), _seqs(cu_k), strict=True)):
        if a == b:
            continue
        ref, ref_lse = flash_attn_func(q8[None, a:b], k8[None, c:e], v8[None, c:e], causal=causal,
                                       q_descale=qd[s:s + 1], k_descale=kd[s:s + 1], v_descale=vd[s:s + 1],
                                       return_lse=True)
        assert torch.equal(out[a:b], ref[0])
        assert torch.equal(lse[:, a:b], ref_lse[0])


def test_varlen_fp8_true_quantizes_each_sequence_with_its_own_scales() -> None:
    from cute_flash import flash_attn_varlen_func

    q, k, v, cu_q, cu_k, mq, mk = _varlen_inputs(d=128)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, fp8=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    for (a, b), (c, e) in zip(_seqs(cu_q), _seqs(cu_k), strict=True):
        if a == b:
            continue
        alone = flash_attn_func(q[None, a:b], k[None, c:e], v[None, c:e], causal=True, fp8=True)
        assert torch.allclose(out[a:b].float(), alone[0].float(), atol=1e-2, rtol=1e-2)
    exact = flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True)
    err = (out.float() - exact.float()).pow(2).mean().sqrt()
    assert err < 0.08 * exact.float().pow(2).mean().sqrt()


def test_varlen_fp8_refuses_bad_input_before_running() -> None:
    from cute_flash import flash_attn_varlen_func

    q, k, v, cu_q, cu_k, mq, mk = _varlen_inputs()
    f8 = torch.float8_e4m3fn
    q8, k8, v8 = q.to(f8), k.to(f8), v.to(f8)
    ones = torch.ones(4, 2)
    with pytest.raises(ValueError, match="descale"):  # (B, H_kv) per sequence, not per batch of 1
        flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, mq, mk, q_descale=ones[:1], k_descale=ones,
                               v_descale=ones)
    with pytest.raises(TypeError, match="int32"):
        flash_attn_varlen_func(q8, k8, v8, cu_q.long(), cu_k, mq, mk)
    with pytest.raises(ValueError, match="packed tokens"):
        flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k + torch.tensor([0, 0, 0, 0, 1], dtype=torch.int32), mq,
                               mk)
    with pytest.raises(ValueError, match="max_seqlen"):
        flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, 5, mk)
    with pytest.raises(ValueError, match="packed"):
        flash_attn_varlen_func(q8[None], k8, v8, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match="softcap"):
        flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, mq, mk, softcap=3.0)
    with pytest.raises(NotImplementedError, match="sliding window"):  # (the FP8 backward has none)
        flash_attn_varlen_func(q.requires_grad_(), k, v, cu_q, cu_k, mq, mk, fp8=True, window_size=(4, 0))
    with pytest.raises(ValueError, match="max_seqlen"):
        flash_attn_varlen_func(q.detach(), k, v, cu_q, cu_k, mq, 2, fp8=True)
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_varlen_func(q8, k8, v8, cu_q, cu_k, mq, mk, window_size=(-3, 0))
    with pytest.raises(ValueError, match="window_size"):
        flash_attn_func(q8[None], k8[None], v8[None], window_size=(0, -7))


def test_torch_compile_traces_the_varlen_fp8_path() -> None:
    from cute_flash import flash_attn_varlen_func

    q, k, v, cu_q, cu_k, mq, mk = _varlen_inputs()

    def f(q, k, v, cu_q, cu_k):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, mq, mk, causal=True, fp8=True)

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(q, k, v, cu_q, cu_k).float(), f(q, k, v, cu_q, cu_k).float())


def test_opcheck_varlen_fp8_ops() -> None:
    from cute_flash.reference_fp8 import quantize_qkv_varlen_ref

    utils = ("test_faketensor", "test_autograd_registration")
    q, k, v, cu_q, cu_k, mq, mk = _varlen_inputs()
    torch.library.opcheck(torch.ops.cute_flash.quantize_qkv_varlen.default,
                          (q, k, v, cu_q, cu_k, mq, mk, True, 3), test_utils=utils)
    q8, k8, v8, qd, kd, vd = quantize_qkv_varlen_ref(q, k, v, cu_q, cu_k)
    torch.library.opcheck(torch.ops.cute_flash.varlen_fwd_fp8.default,
                          (q8, k8, v8, cu_q, cu_k, mq, mk, qd, kd, vd, 0.125, True, -1, 0, torch.bfloat16),
                          test_utils=utils)


def test_opcheck_varlen_fp8_ops_with_v_in_the_kernel_layout() -> None:
    """``v_aligned`` (the ``fp8=True`` path): quantize writes V with every sequence 16-aligned and
    the attention op reads it as it is; the fake shapes (a bound on T_v) match the real ones."""
    from cute_flash.formats import v_varlen_aligned
    from cute_flash.reference_fp8 import quantize_qkv_varlen_ref

    utils = ("test_faketensor", "test_autograd_registration")
    q, k, v, cu_q, cu_k, mq, mk = _varlen_inputs()
    torch.library.opcheck(torch.ops.cute_flash.quantize_qkv_varlen.default,
                          (q, k, v, cu_q, cu_k, mq, mk, True, 3, True), test_utils=utils)
    q8, k8, v8, qd, kd, vd = quantize_qkv_varlen_ref(q, k, v, cu_q, cu_k)
    v_al, _ = v_varlen_aligned(v8, cu_k)
    args = (q8, k8, v_al, cu_q, cu_k, mq, mk, qd, kd, vd, 0.125, True, -1, 0, torch.bfloat16)
    torch.library.opcheck(torch.ops.cute_flash.varlen_fwd_fp8.default, (*args, True), test_utils=utils)
    # Same answer as from the packed V.
    got = torch.ops.cute_flash.varlen_fwd_fp8(*args, True)
    ref = torch.ops.cute_flash.varlen_fwd_fp8(q8, k8, v8, *args[3:])
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
