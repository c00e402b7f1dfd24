"""``flash_attn_with_kvcache`` as users reach it: the ``cute_flash::fwd_kvcache`` op (opcheck with
the caches declared mutated, ``torch.compile(fullgraph=True)`` with the append seen by the caller),
the errors bad arguments raise before anything is written, and the host plan (variant and split
count) taken from shapes only."""

from __future__ import annotations

import pytest
import torch

from cute_flash import dispatch, flash_attn_with_kvcache
from cute_flash.ampere import kvcache_config as sm80_kvcache
from cute_flash.ampere.config import FwdConfig

BF = torch.bfloat16


def _i32(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _bf(*shape) -> torch.Tensor:
    return torch.randn(*shape, dtype=BF)


def _call_args(batch: int = 2, capacity: int = 32, nq: int = 1, new: int = 1, h: int = 4, hkv: int = 2,
               d: int = 64) -> dict:
    return dict(q=_bf(batch, nq, h, d), k_cache=_bf(batch, capacity, hkv, d),
                v_cache=_bf(batch, capacity, hkv, d), k=_bf(batch, new, hkv, d), v=_bf(batch, new, hkv, d),
                cache_seqlens=torch.tensor([3, capacity - new][:batch], dtype=torch.int32))


def test_opcheck_with_the_caches_mutated(seed: int) -> None:
    a = _call_args()
    cos, sin = torch.randn(64, 16), torch.randn(64, 16)
    args = (a["q"], a["k_cache"], a["v_cache"], a["k"], a["v"], cos, sin, a["cache_seqlens"], None, None,
            None, None, None, 0.125, True, -1, -1, 0.0, False, 0)
    torch.library.opcheck(torch.ops.cute_flash.fwd_kvcache, args)


def test_opcheck_with_an_fp8_cache_and_descales(seed: int) -> None:
    a = _call_args()
    kc, vc = a["k_cache"].to(torch.float8_e4m3fn), a["v_cache"].to(torch.float8_e4m3fn)
    kd, vd = torch.rand(2, 2) + 0.5, torch.rand(2, 2) + 0.5
    args = (a["q"], kc, vc, a["k"], a["v"], None, None, a["cache_seqlens"], None, None, None, kd, vd, 0.125,
            True, -1, -1, 0.0, False, 0)
    # (test_schema compares mutated inputs with a multiply PyTorch's CPU backend lacks for float8.)
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.cute_flash.fwd_kvcache, args, test_utils=utils)


def test_compiled_calls_append_like_eager_calls(seed: int) -> None:
    a = _call_args()
    eager_k, eager_v = a["k_cache"].clone(), a["v_cache"].clone()
    lens = a["cache_seqlens"]
    want = flash_attn_with_kvcache(a["q"], eager_k, eager_v, a["k"], a["v"], cache_seqlens=lens, causal=True)

    def call(q, kc, vc, k, v, lens):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)

    fn = torch.compile(call, fullgraph=True)
    kc, vc = a["k_cache"].clone(), a["v_cache"].clone()
    got = fn(a["q"], kc, vc, a["k"], a["v"], a["cache_seqlens"])
    torch.testing.assert_close(got, want)
    assert torch.equal(kc, eager_k) and torch.equal(vc, eager_v)
    assert not torch.equal(kc, a["k_cache"])


def _bad(**changes):
    a = _call_args()
    a.update(changes)
    return a


def _f8(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.float8_e4m3fn)


def _fp8_caches() -> dict:
    return dict(k_cache=_f8(2, 32, 2, 64), v_cache=_f8(2, 32, 2, 64))


def _paged(table: list, **more) -> dict:
    return dict(k_cache=_bf(4, 16, 2, 64), v_cache=_bf(4, 16, 2, 64),
                page_table=torch.tensor(table, dtype=torch.int32), **more)


BAD_CALLS = {
    "cache_seqlens past the cache": (ValueError, lambda: _bad(cache_seqlens=_i32(3, 32))),
    "negative cache_seqlens": (ValueError, lambda: _bad(cache_seqlens=_i32(-1, 3))),
    "int64 cache_seqlens": (TypeError, lambda: _bad(cache_seqlens=torch.tensor([3, 4]))),
    "cache_seqlens of the wrong batch": (ValueError, lambda: _bad(cache_seqlens=_i32(3))),
    "fp32 cache": (TypeError, lambda: _bad(k_cache=torch.randn(2, 32, 2, 64),
                                           v_cache=torch.randn(2, 32, 2, 64))),
    "k without v": (ValueError, lambda: _bad(v=None)),
    "k of the wrong heads": (ValueError, lambda: _bad(k=_bf(2, 1, 4, 64))),
    "append without cache_seqlens": (ValueError, lambda: _bad(cache_seqlens=None)),
    "unsupported head dim": (ValueError, lambda: _bad(q=_bf(2, 1, 4, 48))),
    "heads not a multiple": (ValueError, lambda: _bad(q=_bf(2, 1, 3, 64))),
    "cache rows != batch": (ValueError, lambda: _bad(k_cache=_bf(3, 32, 2, 64), v_cache=_bf(3, 32, 2, 64))),
    "cache_batch_idx out of range": (ValueError, lambda: _bad(cache_batch_idx=_i32(0, 2))),
    "leftpad past the length": (ValueError, lambda: _bad(cache_leftpad=_i32(4, 0))),
    "page past the pool": (ValueError, lambda: _bad(**_paged([[0, 1], [2, 4]]))),
    "page_table with cache_batch_idx": (ValueError, lambda: _bad(**_paged([[0, 1], [2, 3]],
                                                                          cache_batch_idx=_i32(0, 1)))),
    "rotary table too short": (ValueError, lambda: _bad(rotary_cos=torch.randn(8, 16),
                                                        rotary_sin=torch.randn(8, 16))),
    "rotary wider than the head": (ValueError, lambda: _bad(rotary_cos=torch.randn(64, 40),
                                                            rotary_sin=torch.randn(64, 40))),
    "cos without sin": (ValueError, lambda: _bad(rotary_cos=torch.randn(64, 16))),
    "negative num_splits": (ValueError, lambda: _bad(num_splits=-1)),
    "strided cache_seqlens": (ValueError, lambda: _bad(cache_seqlens=_i32(3, 0, 4, 0)[::2])),
    "cache rows out of range with full caches": (ValueError, lambda: _bad(k=None, v=None, cache_seqlens=None,
                                                                           cache_batch_idx=_i32(0, 5))),
    "pages of no rows": (ValueError, lambda: _bad(k_cache=_bf(4, 0, 2, 64), v_cache=_bf(4, 0, 2, 64),
                                                  page_table=_i32(0, 1, 2, 3).reshape(2, 2))),
    "non-contiguous head dim": (ValueError, lambda: _bad(q=_bf(2, 1, 4, 128)[..., ::2])),
    "descales with a 16-bit cache": (ValueError, lambda: _bad(k_descale=torch.ones(2, 2))),
    "an e4m3 k_cache with a bf16 v_cache": (TypeError, lambda: _bad(k_cache=_f8(2, 32, 2, 64))),
    "e4m3 queries": (TypeError, lambda: _bad(q=_f8(2, 1, 4, 64), **_fp8_caches())),
    "descales of the wrong shape": (ValueError, lambda: _bad(**_fp8_caches(), k_descale=torch.ones(2, 4))),
    "float16 descales": (TypeError, lambda: _bad(**_fp8_caches(), v_descale=torch.ones(2, 2).half())),
    "fp32 new keys for an e4m3 cache": (TypeError, lambda: _bad(**_fp8_caches(), k=torch.randn(2, 1, 2, 64))),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_arguments_raise_before_the_cache_is_touched(name: str) -> None:
    error, make = BAD_CALLS[name]
    a = make()
    before = (a["k_cache"].clone(), a["v_cache"].clone())
    with pytest.raises(error):
        flash_attn_with_kvcache(**a)
    assert torch.equal(a["k_cache"], before[0]) and torch.equal(a["v_cache"], before[1])


def test_rotary_without_new_tokens_is_refused() -> None:
    a = _call_args()
    with pytest.raises(ValueError, match="rotate the appended k"):
        flash_attn_with_kvcache(a["q"], a["k_cache"], a["v_cache"], cache_seqlens=a["cache_seqlens"],
                                rotary_cos=torch.randn(64, 16), rotary_sin=torch.randn(64, 16))


def _plan(batch: int, nq: int, capacity: int, h: int = 32, hkv: int = 8, d: int = 128, num_splits: int = 0,
          causal: bool = False):
    p = dispatch.kvcache_problem("bf16", d, d, causal=causal, local=False, softcap=False, batch=batch,
                                 seqlen_q=nq, capacity=capacity, heads_q=h, heads_kv=hkv, num_sms=132,
                                 q_dense=True)
    return dispatch.kvcache_plan("sm_90a", p, batch_idx=False, leftpad=False, num_splits=num_splits)


def test_long_context_decoding_splits_the_keys_over_the_sms() -> None:
    plan = _plan(batch=1, nq=1, capacity=128 * 1024)
    tiles = 8  # one packed tile per KV head
    assert plan.config.pack_gqa == 4 and plan.config.split and plan.combine is not None
    assert plan.num_splits * tiles <= 132 and plan.num_splits * tiles > 132 // 2


def test_full_batches_and_short_caches_do_not_split() -> None:
    assert _plan(batch=64, nq=1, capacity=4096).num_splits == 1
    assert _plan(batch=1, nq=1, capacity=256).num_splits == 1  # too few key blocks to share
    assert _plan(batch=1, nq=1, capacity=128 * 1024, num_splits=1).combine is None


def test_speculative_queries_pack_the_group_while_they_fit_a_tile() -> None:
    assert _plan(batch=1, nq=16, capacity=8192).config.pack_gqa == 4  # 64 rows
    assert _plan(batch=1, nq=64, capacity=8192).config.pack_gqa == 1  # 256 rows: one head per tile


def test_other_gpus_plan_the_sm80_kernel_paged_caches_included() -> None:
    p = dispatch.kvcache_problem("bf16", 128, 128, causal=False, local=False, softcap=False, batch=1,
                                 seqlen_q=1, capacity=64 * 1024, heads_q=8, heads_kv=8, num_sms=108,
                                 q_dense=True)
    plan = dispatch.kvcache_plan("sm_80", p, batch_idx=False, leftpad=False)
    slots = 108 * sm80_kvcache.ctas_per_sm(plan.config)  # (small decoding CTAs share an SM)
    assert plan.config.kernel_name == "fwd_sm80_kvcache" and plan.config.split
    assert plan.num_splits == slots // 8
    gqa = dispatch.kvcache_problem("bf16", 128, 128, causal=True, local=False, softcap=False, batch=2,
                                   seqlen_q=1, capacity=64 * 1024, heads_q=32, heads_kv=8, num_sms=108,
                                   q_dense=True)
    packed = dispatch.kvcache_plan("sm_80", gqa, batch_idx=False, leftpad=False)
    assert packed.config.pack_gqa == 4 and packed.num_splits == slots // (2 * 8)
    paged = dispatch.kvcache_plan("sm_80", p, batch_idx=False, leftpad=False, page_size=64)
    assert paged.config.kernel_name == "fwd_sm80_kvcache" and paged.config.page_size == 64
    hopper = dispatch.kvcache_plan("sm_90a", p, batch_idx=False, leftpad=False)
    assert hopper.config.kernel_name == "fwd_sm90_kvcache"


@pytest.mark.parametrize("nq,d", [(1, 64), (1, 128), (4, 128), (1, 256)])
def test_sm80_decoding_takes_two_warp_tiles_that_share_an_sm(nq: int, d: int) -> None:
    p = dispatch.kvcache_problem("bf16", d, d, causal=True, local=False, softcap=False, batch=64,
                                 seqlen_q=nq, capacity=4096, heads_q=32, heads_kv=8, num_sms=108,
                                 q_dense=True)
    for page_size in (0, 1):
        cfg = dispatch.kvcache_plan("sm_80", p, batch_idx=False, leftpad=False, page_size=page_size).config
        tile_m, tile_n, threads, _ = cfg.tiles
        assert (tile_m, threads) == (32, 64) and cfg.pack_gqa == 4 and tile_n * 2 * d <= 64 * 256
        assert sm80_kvcache.ctas_per_sm(cfg) >= 4


def test_hopper_decoding_of_full_batches_takes_the_sm80_decoding_tile() -> None:
    def plan(batch: int, page_size: int = 0, kv_dtype: str = ""):
        p = dispatch.kvcache_problem("bf16", 128, 128, causal=True, local=False, softcap=False, batch=batch,
                                     seqlen_q=1, capacity=32768, heads_q=32, heads_kv=8, num_sms=132,
                                     q_dense=True)
        return dispatch.kvcache_plan("sm_90a", p, batch_idx=False, leftpad=False, page_size=page_size,
                                     kv_dtype=kv_dtype).config

    assert plan(64).kernel_name == plan(8).kernel_name == "fwd_sm80_kvcache"  # 512 / 64 tiles
    assert plan(64).tiles[0] == 32
    assert plan(1).kernel_name == "fwd_sm90_kvcache"  # 8 tiles: split over the SMs
    assert plan(64, page_size=64).kernel_name == plan(64, kv_dtype="e4m3").kernel_name == "fwd_sm90_kvcache"


def test_sm80_prefill_keeps_the_forward_tile() -> None:
    p = dispatch.kvcache_problem("bf16", 128, 128, causal=True, local=False, softcap=False, batch=1,
                                 seqlen_q=300, capacity=4096, heads_q=32, heads_kv=8, num_sms=108,
                                 q_dense=True)
    cfg = dispatch.kvcache_plan("sm_80", p, batch_idx=False, leftpad=False).config
    assert cfg.tiles == FwdConfig(target="sm_80", dtype="bf16", hdim=128, hdim_v=128, causal=True).tiles


@pytest.mark.parametrize("page_size,kernel", [(16, "fwd_sm90_kvcache"), (256, "fwd_sm90_kvcache"),
                                              (1, "fwd_sm80_kvcache"), (8, "fwd_sm80_kvcache"),
                                              (40, "fwd_sm80_kvcache")])
def test_hopper_reads_pages_by_tma_boxes_or_else_row_by_row(page_size: int, kernel: str) -> None:
    p = dispatch.kvcache_problem("bf16", 128, 128, causal=True, local=False, softcap=False, batch=2,
                                 seqlen_q=1, capacity=32 * 1024, heads_q=32, heads_kv=8, num_sms=132,
                                 q_dense=True)
    plan = dispatch.kvcache_plan("sm_90a", p, batch_idx=False, leftpad=False, page_size=page_size)
    assert plan.config.kernel_name == kernel and plan.config.page_size == page_size
    assert plan.num_splits > 1


def test_an_fp8_cache_plans_the_sm90_converting_kernel_only() -> None:
    p = dispatch.kvcache_problem("bf16", 128, 128, causal=True, local=False, softcap=False, batch=1,
                                 seqlen_q=1, capacity=64 * 1024, heads_q=32, heads_kv=8, num_sms=132,
                                 q_dense=True)
    plan = dispatch.kvcache_plan("sm_90a", p, batch_idx=False, leftpad=False, kv_dtype="e4m3")
    assert plan.config.kv_dtype == "e4m3" and plan.config.tile_n == 64 and plan.config.pack_gqa == 4
    assert plan.num_splits > 1
    paged = dispatch.kvcache_plan("sm_90a", p, batch_idx=False, leftpad=False, page_size=16, kv_dtype="e4m3")
    assert paged.config.page_size == 16 and paged.config.kv_dtype == "e4m3"
    for arch, page in (("sm_80", 0), ("sm_90a", 8)):
        with pytest.raises(NotImplementedError, match="e4m3"):
            dispatch.kvcache_plan(arch, p, batch_idx=False, leftpad=False, page_size=page, kv_dtype="e4m3")


@pytest.mark.parametrize("page_size", [176, 208])
def test_pages_that_would_leave_tiny_tma_blocks_are_read_row_by_row(page_size: int) -> None:
    p = dispatch.kvcache_problem("bf16", 128, 128, causal=True, local=False, softcap=False, batch=2,
                                 seqlen_q=1, capacity=32 * page_size, heads_q=32, heads_kv=8, num_sms=132,
                                 q_dense=True)
    plan = dispatch.kvcache_plan("sm_90a", p, batch_idx=False, leftpad=False, page_size=page_size)
    assert plan.config.kernel_name == "fwd_sm80_kvcache"


def test_forced_split_counts_stay_within_the_grid() -> None:
    p = dispatch.kvcache_problem("bf16", 128, 128, causal=False, local=False, softcap=False, batch=1024,
                                 seqlen_q=1, capacity=64 * 1024, heads_q=8, heads_kv=8, num_sms=108,
                                 q_dense=True)
    plan = dispatch.kvcache_plan("sm_80", p, batch_idx=False, leftpad=False, num_splits=128)
    assert plan.num_splits * 1024 <= 65535


def test_broadcast_descales_are_taken_like_dense_ones(seed: int) -> None:
    a = _call_args()
    kc, vc = a["k_cache"].to(torch.float8_e4m3fn), a["v_cache"].to(torch.float8_e4m3fn)
    kd = (torch.rand(1, 2) + 0.5).expand(2, 2)
    common = dict(cache_seqlens=a["cache_seqlens"], causal=True)
    got = flash_attn_with_kvcache(a["q"], kc.clone(), vc.clone(), a["k"], a["v"], k_descale=kd, v_descale=kd,
                                  **common)
    want = flash_attn_with_kvcache(a["q"], kc.clone(), vc.clone(), a["k"], a["v"], k_descale=kd.contiguous(),
                                   v_descale=kd.contiguous(), **common)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
