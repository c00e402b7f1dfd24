"""Input checks: every violation of the kernels' contract is caught before a launch, with the
right exception type and a message naming what was expected and what was got."""

from __future__ import annotations

import pytest
import torch

import cute_flash
from cute_flash import ops, validate

BF16 = torch.bfloat16


def qkv(b=2, nq=8, nk=8, h=4, hkv=4, d=64, dv=None, dtype=BF16):
    dv = d if dv is None else dv
    return (torch.randn(b, nq, h, d, dtype=dtype), torch.randn(b, nk, hkv, d, dtype=dtype),
            torch.randn(b, nk, hkv, dv, dtype=dtype))


def varlen(lens_q=(3, 5), lens_k=(4, 2), h=4, hkv=2, d=32):
    q = torch.randn(sum(lens_q), h, d, dtype=BF16)
    k = torch.randn(sum(lens_k), hkv, d, dtype=BF16)
    v = torch.randn(sum(lens_k), hkv, d, dtype=BF16)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def check(q, k, v, **kw):
    kw.setdefault("softmax_scale", 0.125)
    validate.check_fwd(q, k, v, **kw)


def misaligned_ptr(shape, dtype=BF16):
    """A tensor with 16-byte aligned strides whose first element sits 2 bytes past alignment."""
    n = 1
    for s in shape:
        n *= s
    return torch.randn(n + 8, dtype=dtype)[1:n + 1].view(shape)


# ---------------------------------------------------------------------------------------------
# Accepted inputs
# ---------------------------------------------------------------------------------------------
def test_accepts_contiguous_gqa_and_a_different_value_head_dim(seed):
    check(*qkv(h=8, hkv=2, d=128, dv=64))


def test_accepts_sdpa_layout_transposed_views_without_copies(seed):
    q, k, v = (torch.randn(2, 4, 16, 64, dtype=torch.float16).transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    check(q, k, v)


def test_accepts_padded_rows_with_16_byte_aligned_strides(seed):
    q = torch.randn(2, 8, 4, 64 + 8, dtype=BF16)[..., :64]  # row stride 72 elements = 144 bytes
    check(q, *qkv()[1:])


def test_ignores_strides_of_extent_one_dims():
    q = torch.randn(1, 8, 4, 64, dtype=BF16).as_strided((1, 8, 4, 64), (3, 256, 64, 1))
    check(q, *qkv(b=1)[1:])


def test_accepts_varlen_with_empty_sequences(seed):
    check(*varlen(lens_q=(3, 0, 1), lens_k=(0, 2, 5))[:3], cu_seqlens_q=varlen((3, 0, 1), (0, 2, 5))[3],
          cu_seqlens_k=varlen((3, 0, 1), (0, 2, 5))[4], max_seqlen_q=3, max_seqlen_k=5)


def test_supported_head_dims_agree_with_the_kernels_tile_tables():
    """What validation lets through, the sm80 kernels (every GPU) have tiles for; the Hopper and
    FP8 kernels cover a subset (the dispatch falls back to sm80 elsewhere)."""
    from cute_flash.ampere.config import SM80_BWD_TILES, SM80_FWD_TILES
    from cute_flash.formats import FP8_HDIMS
    from cute_flash.hopper.bwd_config import SM90_BWD_HDIMS
    from cute_flash.hopper.fwd_config import SM90_FWD_TILES

    supported = set(validate.SUPPORTED_HEAD_DIMS)
    assert supported == set(SM80_FWD_TILES) == set(SM80_BWD_TILES)
    assert set(SM90_FWD_TILES) <= supported and set(SM90_BWD_HDIMS) <= supported
    assert set(FP8_HDIMS) <= supported


# ---------------------------------------------------------------------------------------------
# TypeError: dtypes and types
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8])
def test_rejects_dtypes_other_than_fp16_bf16(dtype):
    with pytest.raises(TypeError, match=r"q must be float16 or bfloat16, got " + str(dtype)[6:]):
        check(*qkv(dtype=dtype) if dtype.is_floating_point else
              (torch.zeros(2, 8, 4, 64, dtype=dtype),) * 3)


def test_rejects_mismatched_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="v must have the same dtype as q .bfloat16., got float16"):
        check(q, k, v.half())


def test_rejects_non_int32_cu_seqlens():
    q, k, v, cu_q, cu_k = varlen()
    with pytest.raises(TypeError, match="cu_seqlens_k must be int32, got int64"):
        check(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k.long())


def test_rejects_non_tensors():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="k must be a torch.Tensor, got list"):
        check(q, [1, 2], v)


# ---------------------------------------------------------------------------------------------
# ValueError: devices, shapes, layouts
# ---------------------------------------------------------------------------------------------
def test_rejects_tensors_on_different_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="same device: q is on cpu, v is on meta"):
        check(q, k, v.to("meta"))


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_rejects_wrong_rank(which):
    t = dict(zip("qkv", qkv(), strict=True))
    t[which] = t[which][0]
    with pytest.raises(ValueError, match=rf"{which} must be 4-D \(B, N, H, d\), got shape"):
        check(t["q"], t["k"], t["v"])


def test_rejects_wrong_rank_for_varlen():
    q, k, v, cu_q, cu_k = varlen()
    with pytest.raises(ValueError, match=r"q must be 3-D \(total, H, d\)"):
        check(q[None], k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


@pytest.mark.parametrize("case,pattern", [
    ("batch", "same batch size, got 2, 3, 3"),
    ("kv_len", "k and v must have the same number of keys"),
    ("kv_heads", "k and v must have the same number of heads, got 4 and 2"),
    ("qk_dim", "q and k must have the same head dim, got 64 and 128"),
    ("gqa", "q heads must be a positive multiple of k/v heads .GQA/MQA., got 6 q heads and 4"),
])
def test_rejects_mismatched_shapes(case, pattern):
    q, k, v = qkv()
    if case == "batch":
        k, v = qkv(b=3)[1:]
    elif case == "kv_len":
        v = qkv(nk=9)[2]
    elif case == "kv_heads":
        v = qkv(hkv=2)[2]
    elif case == "qk_dim":
        k = qkv(d=128)[1]
    elif case == "gqa":
        q = qkv(h=6)[0]
    with pytest.raises(ValueError, match=pattern):
        check(q, k, v)


@pytest.mark.parametrize("d,dv,pattern", [
    (48, 48, "unsupported q/k head dim 48; supported: 32, 64, 96, 128, 160, 192, 256"),
    (512, 512, "unsupported q/k head dim 512"),
    (64, 100, "unsupported v head dim 100"),
])
def test_rejects_unsupported_head_dims(d, dv, pattern):
    with pytest.raises(ValueError, match=pattern):
        check(*qkv(d=d, dv=dv))


def test_rejects_a_last_dim_that_is_not_contiguous():
    q = torch.randn(2, 8, 4, 128, dtype=BF16)[..., ::2]
    with pytest.raises(ValueError, match=r"q must be contiguous in its last dim \(stride\(-1\) == 1\)"):
        check(q, *qkv()[1:])


def test_rejects_strides_that_are_not_16_byte_multiples():
    k = torch.randn(2, 8, 4, 64 + 4, dtype=BF16)[..., :64]  # row stride 68 elements = 136 bytes
    with pytest.raises(ValueError, match=r"k.stride\(2\) must be a multiple of 8 elements \(16 bytes\)"):
        check(qkv()[0], k, qkv()[2])


def test_rejects_a_data_pointer_that_is_not_16_byte_aligned():
    v = misaligned_ptr((2, 8, 4, 64))
    with pytest.raises(ValueError, match="v must start at a 16-byte aligned address"):
        check(*qkv()[:2], v)


def test_fake_tensor_mode_skips_the_pointer_check():
    check(*qkv()[:2], misaligned_ptr((2, 8, 4, 64)), check_data=False)


# The sm90 forward loads q, k, v with TMA, whose descriptors take a 16-byte aligned base address, a
# unit-stride last dim and the other strides 16-byte multiples below 2^40 bytes; the kernels take
# int32 extents. Each is checked for each input, before a launch (the checking function itself, so
# this runs on the CPU; meta tensors stand in for sizes no test machine could allocate).
def _with_stride_off_by_8_bytes(dim, shape=(2, 8, 4, 64)):
    strides = list(torch.empty(shape).stride())
    strides[dim] += 4  # bf16: 8 bytes past a 16-byte multiple
    size = 1 + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
    return torch.randn(size, dtype=BF16).as_strided(shape, strides)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("dim", [0, 1, 2])
def test_rejects_any_stride_tma_cannot_take(which, dim):
    t = dict(zip("qkv", qkv(), strict=True))
    t[which] = _with_stride_off_by_8_bytes(dim)
    with pytest.raises(ValueError, match=rf"{which}.stride\({dim}\) must be a multiple of 8 elements "
                                         r"\(16 bytes\) for vector loads and TMA"):
        validate.check_fwd(t["q"], t["k"], t["v"], softmax_scale=0.125)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_rejects_a_base_address_tma_cannot_take(which):
    t = dict(zip("qkv", qkv(), strict=True))
    t[which] = misaligned_ptr((2, 8, 4, 64))
    with pytest.raises(ValueError, match=f"{which} must start at a 16-byte aligned address"):
        validate.check_fwd(t["q"], t["k"], t["v"], softmax_scale=0.125)


def test_rejects_strides_beyond_the_tma_descriptor_limit():
    q, k, v = (t.to("meta") for t in qkv())
    k = torch.empty_strided((2, 8, 4, 64), (2**39, 256, 64, 1), dtype=BF16, device="meta")  # 2^40 bytes
    with pytest.raises(ValueError, match=r"k.stride\(0\) must be below 2\^40 bytes"):
        check(q, k, v)
    check(q, torch.empty_strided((2, 8, 4, 64), (2**39 - 8, 256, 64, 1), dtype=BF16, device="meta"), v)


def test_rejects_extents_beyond_int32():
    q = torch.empty((1, 2**31, 1, 64), dtype=BF16, device="meta")
    k, v = (torch.empty((1, 16, 1, 64), dtype=BF16, device="meta") for _ in range(2))
    with pytest.raises(ValueError, match=r"q.shape\[1\] = 2147483648 is too large: the kernels take "
                                         r"extents up to 2\^31 - 1"):
        check(q, k, v)
    check(q[:, :2**31 - 1], k, v)


# ---------------------------------------------------------------------------------------------
# ValueError: cu_seqlens
# ---------------------------------------------------------------------------------------------
def test_rejects_cu_seqlens_that_are_not_1d():
    q, k, v, cu_q, cu_k = varlen()
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be 1-D of length batch\+1"):
        check(q, k, v, cu_seqlens_q=cu_q[None], cu_seqlens_k=cu_k)


def test_rejects_cu_seqlens_of_different_batch_sizes():
    q, k, v, cu_q, _ = varlen()
    cu_k = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"both have length batch\+1, got 3 and 2"):
        check(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_rejects_only_one_cu_seqlens():
    q, k, v, cu_q, _ = varlen()
    with pytest.raises(ValueError, match="varlen needs both"):
        check(q, k, v, cu_seqlens_q=cu_q)


@pytest.mark.parametrize("cu,pattern", [
    ([1, 3, 8], "cu_seqlens_q must start at 0, got 1"),
    ([0, 5, 3, 8], "cu_seqlens_q must be non-decreasing"),
    ([0, 3, 7], r"cu_seqlens_q\[-1\] must equal the number of packed tokens \(8\), got 7"),
])
def test_rejects_bad_cu_seqlens_values(cu, pattern):
    q, k, v, _, _ = varlen()
    cu_q = torch.tensor(cu, dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 6][:len(cu)], dtype=torch.int32)
    with pytest.raises(ValueError, match=pattern):
        check(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def test_rejects_max_seqlen_below_the_longest_sequence():
    q, k, v, cu_q, cu_k = varlen(lens_q=(3, 5))
    with pytest.raises(ValueError, match=r"max_seqlen_q \(4\) is smaller than the longest sequence \(5\)"):
        check(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=4)


def test_valid_cu_seqlens_are_read_once_until_written_in_place(monkeypatch):
    """Every layer of a model passes the same cu_seqlens: after one read (a host sync on a GPU)
    they are not read again -- unless written in place, or checked against other extents."""
    from cute_flash import validate

    reads = []
    real = validate._read_cu
    monkeypatch.setattr(validate, "_read_cu", lambda a, b: reads.append(1) or real(a, b))
    q, k, v, cu_q, cu_k = varlen(lens_q=(3, 5))
    for _ in range(3):
        check(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=8)
    assert len(reads) == 1
    check(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6, max_seqlen_k=8)
    assert len(reads) == 2
    cu_q[1] = 6  # lengths (6, 2): the longest is now above max_seqlen_q
    with pytest.raises(ValueError, match="max_seqlen_q"):
        check(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=8)
    # An equal copy is a different tensor: read.
    check(q, k, v, cu_seqlens_q=cu_q.clone(), cu_seqlens_k=cu_k, max_seqlen_q=6, max_seqlen_k=8)
    assert len(reads) == 4


# ---------------------------------------------------------------------------------------------
# ValueError: scalars
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,pattern", [
    (dict(window_size=(-2, 0)), "window_size left must be >= -1"),
    (dict(window_size=(0, -5)), "window_size right must be >= -1"),
    (dict(window_size=(1.5, 0)), "window_size left must be an int, got 1.5"),
    (dict(window_size=(1, 2, 3)), r"window_size must be a pair \(left, right\)"),
    (dict(softcap=-1.0), "softcap must be a finite number >= 0"),
    (dict(softcap=float("inf")), "softcap must be a finite number >= 0"),
    (dict(softmax_scale=0.0), "softmax_scale must be a finite positive number, got 0.0"),
    (dict(softmax_scale=-0.5), "softmax_scale must be a finite positive number"),
    (dict(softmax_scale=float("nan")), "softmax_scale must be a finite positive number"),
])
def test_rejects_bad_scalar_arguments(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        check(*qkv(), **kw)


# ---------------------------------------------------------------------------------------------
# Backward-only inputs
# ---------------------------------------------------------------------------------------------
def _bwd_args():
    q, k, v = qkv(dv=32)
    out = torch.randn(2, 8, 4, 32, dtype=BF16)
    return dict(dout=torch.randn_like(out), q=q, k=k, v=v, out=out, lse=torch.randn(2, 4, 8))


@pytest.mark.parametrize("change,exc,pattern", [
    (dict(dout=torch.randn(2, 8, 4, 64, dtype=BF16)), ValueError,
     r"dout must have shape \(2, 8, 4, 32\) \(q's with v's head dim\)"),
    (dict(out=torch.randn(2, 8, 4, 32, dtype=torch.float16)), TypeError, "out must have the same dtype as q"),
    (dict(lse=torch.randn(2, 4, 8, dtype=torch.float64)), TypeError, "lse must be float32, got float64"),
    (dict(lse=torch.randn(2, 8, 4)), ValueError, r"lse must have shape \(2, 4, 8\), got \(2, 8, 4\)"),
    (dict(lse=torch.randn(2, 4, 16)[..., ::2]), ValueError, "lse must be contiguous in its last dim"),
    (dict(dlse=torch.randn(2, 4, 8, dtype=BF16)), TypeError, "dlse must be float32, got bfloat16"),
    (dict(dlse=torch.randn(2, 4, 7)), ValueError, r"dlse must have lse's shape \(2, 4, 8\), got \(2, 4, 7\)"),
    (dict(dlse=0.5), TypeError, "dlse must be a torch.Tensor"),
])
def test_backward_rejects_bad_dout_out_lse_or_dlse(change, exc, pattern):
    args = _bwd_args() | change
    with pytest.raises(exc, match=pattern):
        validate.check_bwd(softmax_scale=0.1, **args)


# ---------------------------------------------------------------------------------------------
# Repeated calls: metadata checks remembered, data checks every time
# ---------------------------------------------------------------------------------------------
def test_repeated_metadata_skips_the_full_checks_but_not_the_pointer_check(monkeypatch):
    q, k, v = qkv()
    check(q, k, v)
    full = []
    monkeypatch.setattr(validate, "_check_fwd_in_full", lambda *a: full.append(a))
    check(q, k, v)
    assert not full
    bad = misaligned_ptr(q.shape)
    assert bad.stride() == q.stride()
    with pytest.raises(ValueError, match="must start at a 16-byte aligned address"):
        check(bad, k, v)


def test_repeated_backward_metadata_still_rejects_a_misaligned_dout():
    args = _bwd_args()
    validate.check_bwd(softmax_scale=0.1, **args)
    with pytest.raises(ValueError, match="dout must start at a 16-byte aligned address"):
        validate.check_bwd(softmax_scale=0.1, **(args | dict(dout=misaligned_ptr(args["dout"].shape))))


def test_remembered_metadata_keeps_int_and_bool_windows_apart():
    q, k, v = qkv()
    check(q, k, v, window_size=(1, -1))
    with pytest.raises(ValueError, match="window_size left must be an int"):
        check(q, k, v, window_size=(True, -1))


def test_remembered_cu_seqlens_metadata_still_reads_new_values():
    q, k, v, cu_q, cu_k = varlen()
    check(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=5, max_seqlen_k=4)
    with pytest.raises(ValueError, match="must be non-decreasing"):
        check(q, k, v, cu_seqlens_q=torch.tensor([0, 9, 8], dtype=torch.int32), cu_seqlens_k=cu_k,
              max_seqlen_q=5, max_seqlen_k=4)


# ---------------------------------------------------------------------------------------------
# Through the public API and the CUDA implementations
# ---------------------------------------------------------------------------------------------
def test_public_api_raises_the_same_errors(seed):
    q, k, v = qkv()
    with pytest.raises(TypeError, match="q must be float16 or bfloat16, got float32"):
        cute_flash.flash_attn_func(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="window_size left must be >= -1"):
        cute_flash.flash_attn_func(q, k, v, window_size=(-3, 0))
    with pytest.raises(ValueError, match="softmax_scale must be a finite positive number"):
        cute_flash.flash_attn_func(q, k, v, softmax_scale=-1.0)
    q2, k2, v2, cu_q, cu_k = varlen()
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        cute_flash.flash_attn_varlen_func(q2, k2, v2, cu_q + 1, cu_k, 5, 4)


def test_cuda_path_validates_before_launching(fake_launchers):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="unsupported v head dim"):
        ops._fwd_cuda(q, k, v[..., :40], 0.1, False, (-1, -1), 0.0)
    args = _bwd_args() | dict(lse=torch.randn(2, 4, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="lse must be float32"):
        ops._bwd_cuda(*args.values(), 0.1, False, (-1, -1), 0.0, False)
    assert fake_launchers == []


def test_host_memo_drops_the_oldest_entry_past_its_size() -> None:
    from cute_flash.memo import HostMemo

    memo = HostMemo(2)
    for i in range(3):
        memo.put(i, str(i))
    assert 0 not in memo and memo.get(1) == "1" and memo.get(2) == "2"
    assert memo.get(0, "absent") == "absent"


# ---------------------------------------------------------------------------------------------
# The public functions check their arguments before computing anything from them
# ---------------------------------------------------------------------------------------------
def test_public_functions_reject_an_empty_head_dim_before_computing_the_scale():
    z = torch.randn(1, 8, 2, 0, dtype=BF16)
    with pytest.raises(ValueError, match=r"q needs a head dim .* got shape \(1, 8, 2, 0\)"):
        cute_flash.flash_attn_func(z, z, z)
    q, k, v, cu_q, cu_k = varlen()
    with pytest.raises(ValueError, match="k needs a head dim"):
        cute_flash.flash_attn_varlen_func(q, k[..., :0], v, cu_q, cu_k, 5, 4)
    with pytest.raises(ValueError, match="needs a head dim"):
        cute_flash.attention(*(torch.randn(1, 2, 8, 0, dtype=BF16),) * 3)


@pytest.mark.parametrize("kw", [dict(causal=None), dict(return_lse="yes"), dict(deterministic=1),
                                dict(fp8="no")])
def test_public_functions_reject_switches_that_are_not_bools(kw):
    q, k, v = qkv()
    name = next(iter(kw))
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        cute_flash.flash_attn_func(q, k, v, **kw)
    qp, kp, vp, cu_q, cu_k = varlen()
    with pytest.raises(TypeError, match=f"{name} must be a bool"):
        cute_flash.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 5, 4, **kw)


def test_public_functions_reject_lists_and_arrays_with_a_short_message():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^q must be a torch.Tensor, got list$"):
        cute_flash.flash_attn_func(q.tolist(), k, v)
    with pytest.raises(TypeError, match=r"^v must be a torch.Tensor, got ndarray$"):
        cute_flash.flash_attn_func(q, k, v.float().numpy())
    with pytest.raises(TypeError, match=r"^k must be a torch.Tensor, got list$"):
        cute_flash.attention(q, k.tolist(), v)
    qp, kp, vp, cu_q, cu_k = varlen()
    with pytest.raises(TypeError, match=r"^cu_seqlens_k must be a torch.Tensor, got list$"):
        cute_flash.flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k.tolist(), 5, 4)
    with pytest.raises(TypeError, match=r"^rotate must be a bool"):
        cute_flash.quantize_qkv(q, k, v, rotate=None)
