"""``flash_attn_with_kvcache`` on a Hopper GPU against the fp64 reference, under the 2x rule
(error at most twice the same PyTorch math in the input dtype, + 1e-5): ragged ``cache_seqlens``
(0 and a full cache included), GQA ratios, rotary on and off, append on and off, paged caches of
several page sizes (TMA boxes, and row by row), cache rows and left padding, forced and planned
split counts; the sm80 kernel (forced with ``CUTE_FLASH_FWD_KERNEL=sm80``) on contiguous and paged
cases. Cache slots no
sequence owns hold NaN, so a kernel that reads past a sequence's end shows it; the append kernel
writes what the reference's torch ops write. A CUDA graph captured once replays correctly while
``cache_seqlens`` changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from cute_flash import flash_attn_with_kvcache, formats, jit, kv_append
from cute_flash.ampere.kvcache_config import FwdCombineConfig
from cute_flash.reference_kvcache import kvcache_attention_ref, merge_splits_ref

from attention_checks import FLOOR_FWD, assert_lse_rule, assert_rule, needs_hopper

pytestmark = [pytest.mark.gpu, needs_hopper]


@dataclass(frozen=True)
class Case:
    lens: tuple[int, ...]  # cached keys per sequence before the call
    capacity: int
    nq: int = 1
    new: int = 1
    h: int = 32
    hkv: int = 8
    d: int = 128
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    rotary: str = ""  # "", "gptj" (interleaved pairs), "neox" (halves)
    page_size: int = 0
    batch_idx: bool = False
    leftpad: bool = False
    num_splits: int = 0
    dtype: torch.dtype = torch.bfloat16
    fp8: bool = False  # an e4m3 cache with (B, H_kv) descales


CASES = [
    Case(lens=(0, 1, 777, 2047), capacity=2048, rotary="gptj"),  # empty, one key, ragged, full
    Case(lens=(0, 1, 777, 2047), capacity=2048, rotary="neox", num_splits=1),
    Case(lens=(5000, 17, 8191), capacity=8192, num_splits=7),
    Case(lens=(30000,), capacity=32768, rotary="gptj"),  # one sequence, split over the SMs
    Case(lens=(100, 3000, 0), capacity=4096, page_size=16),
    Case(lens=(100, 3000, 0), capacity=4096, page_size=64, rotary="neox"),
    Case(lens=(100, 3000, 4095), capacity=4096, page_size=256),
    # Pages the TMA boxes do not take: one key per page, and 40 keys (read row by row, cp.async).
    Case(lens=(0, 300, 1023), capacity=1024, page_size=1, rotary="gptj"),
    Case(lens=(3997, 5, 1200), capacity=4000, page_size=40, nq=3, new=3, h=16, hkv=4, num_splits=5),
    Case(lens=(63, 500), capacity=1024, nq=4, new=4, h=8, hkv=1),  # speculative, 8 heads a KV head
    Case(lens=(0, 600), capacity=1024, nq=300, new=300, h=4, hkv=4, d=128),  # chunked prefill
    Case(lens=(40, 900), capacity=1024, new=0, batch_idx=True, leftpad=True, causal=False),
    Case(lens=(700, 1500), capacity=2048, new=2, nq=2, h=12, hkv=2, d=64, window=(256, 0), softcap=20.0,
         rotary="gptj", batch_idx=True, causal=False),
    Case(lens=(3000, 10), capacity=4096, h=4, hkv=2, d=256, leftpad=True, rotary="neox"),
    Case(lens=(1234, 2), capacity=2048, h=16, hkv=16, d=64, causal=False, dtype=torch.float16),
    # e4m3 caches: converted in shared memory; split, paged, rotary, softcap, fp16 queries.
    Case(lens=(0, 1, 777, 2047), capacity=2048, rotary="gptj", fp8=True),
    Case(lens=(30000,), capacity=32768, fp8=True),
    Case(lens=(100, 3000, 0), capacity=4096, page_size=64, rotary="neox", fp8=True),
    Case(lens=(700, 1500), capacity=2048, new=2, nq=2, h=12, hkv=2, d=64, window=(256, 0), softcap=20.0,
         batch_idx=True, causal=False, fp8=True),
    Case(lens=(3000, 10), capacity=4096, h=4, hkv=2, d=256, leftpad=True, dtype=torch.float16, fp8=True),
    # e4m3 without splits (O through TMA), blocks of several 16-key pages, one head per tile.
    Case(lens=(900, 3000), capacity=4096, num_splits=1, fp8=True),
    Case(lens=(100, 3000, 0), capacity=4096, page_size=16, rotary="gptj", fp8=True),
    Case(lens=(0, 600), capacity=1024, nq=300, new=300, h=8, hkv=2, fp8=True),
]


def _id(c: Case) -> str:
    parts = [f"B{len(c.lens)}", f"cap{c.capacity}", f"q{c.nq}", f"new{c.new}", f"h{c.h}/{c.hkv}", f"d{c.d}"]
    parts += [f for f in ("causal", "batch_idx", "leftpad") if getattr(c, f)]
    parts += [f"win{c.window[0]}"] if c.window != (-1, -1) else []
    parts += [f"cap{c.softcap:g}"] if c.softcap else []
    parts += [c.rotary] if c.rotary else []
    parts += [f"page{c.page_size}"] if c.page_size else []
    parts += [f"split{c.num_splits}"] if c.num_splits else []
    parts += ["e4m3"] if c.fp8 else []
    return "-".join(parts)


def _setup(c: Case) -> dict:
    """Inputs of one call; every cache slot no sequence owns (past its length, before its left
    padding, pages of no sequence, rows no sequence uses) is NaN."""
    dev, dt, b = "cuda", c.dtype, len(c.lens)
    lens = torch.tensor(c.lens, dtype=torch.int32, device=dev)
    rows = b + 2 if c.batch_idx else b
    kc = torch.full((rows, c.capacity, c.hkv, c.d), float("nan"), dtype=dt, device=dev)
    vc = torch.full_like(kc, float("nan"))
    pad = torch.tensor([n // 3 for n in c.lens], dtype=torch.int32, device=dev) if c.leftpad else None
    batch_idx = torch.randperm(rows, device=dev)[:b].to(torch.int32) if c.batch_idx else None
    for i, n in enumerate(c.lens):
        r = int(batch_idx[i]) if c.batch_idx else i
        start = int(pad[i]) if c.leftpad else 0
        kc[r, start:n] = torch.randn(n - start, c.hkv, c.d, dtype=dt, device=dev)
        vc[r, start:n] = torch.randn(n - start, c.hkv, c.d, dtype=dt, device=dev)
    page_table = None
    if c.page_size:
        per_seq = c.capacity // c.page_size
        pool = 2 * b * per_seq
        page_table = torch.randperm(pool, device=dev)[:b * per_seq].reshape(b, per_seq).to(torch.int32)
        k_pages = torch.full((pool, c.page_size, c.hkv, c.d), float("nan"), dtype=dt, device=dev)
        v_pages = torch.full_like(k_pages, float("nan"))
        for i in range(b):
            k_pages[page_table[i].long()] = kc[i].reshape(per_seq, c.page_size, c.hkv, c.d)
            v_pages[page_table[i].long()] = vc[i].reshape(per_seq, c.page_size, c.hkv, c.d)
        kc, vc = k_pages, v_pages
    descales = dict(k_descale=None, v_descale=None)
    if c.fp8:
        # Codes of values / descale (NaN slots stay NaN).
        descales = {name: torch.rand(b, c.hkv, device=dev) + 0.5 for name in ("k_descale", "v_descale")}
        owners = batch_idx if c.batch_idx else torch.arange(b, device=dev)
        kc = (kc.float() / _per_slot(descales["k_descale"], kc, page_table, owners)).to(torch.float8_e4m3fn)
        vc = (vc.float() / _per_slot(descales["v_descale"], vc, page_table, owners)).to(torch.float8_e4m3fn)
    cos = sin = None
    if c.rotary:
        angle = torch.rand(c.capacity + c.nq, c.d // 4, device=dev) * 6.2832  # rotary_dim = d / 2
        cos, sin = angle.cos().to(dt), angle.sin().to(dt)
    new = c.new
    return dict(q=torch.randn(b, c.nq, c.h, c.d, dtype=dt, device=dev), k_cache=kc, v_cache=vc,
                k=torch.randn(b, new, c.hkv, c.d, dtype=dt, device=dev) if new else None,
                v=torch.randn(b, new, c.hkv, c.d, dtype=dt, device=dev) if new else None,
                rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, cache_batch_idx=batch_idx,
                cache_leftpad=pad, page_table=page_table, **descales)


def _per_slot(descale: torch.Tensor, cache: torch.Tensor, page_table: torch.Tensor | None,
              rows: torch.Tensor) -> torch.Tensor:
    """Sequence b's (H_kv,) descales broadcast over the cache slots it owns: its pages, or its cache
    row ``rows[b]`` (1 elsewhere)."""
    scale = torch.ones(cache.shape[:3], device=cache.device)
    for b in range(descale.shape[0]):
        if page_table is not None:
            scale[page_table[b].long()] = descale[b]
        else:
            scale[int(rows[b])] = descale[b]
    return scale[..., None]


def _reference(c: Case, a: dict) -> tuple[tuple, tuple, dict]:
    """(fp64 out, lse), (same-dtype out, lse), and the caches after the append: the append and
    rotary in the input dtype (what the caches store), then attention over the appended caches."""
    kc, vc = a["k_cache"].clone(), a["v_cache"].clone()
    per_token = kv_append.rotary_per_token(c.causal, c.window, c.capacity)
    index = (a["cache_seqlens"], a["cache_batch_idx"], a["cache_leftpad"], a["page_table"])
    q = kv_append.append_and_rotate(a["q"], kc, vc, a["k"], a["v"], a["rotary_cos"], a["rotary_sin"], *index,
                                    per_token, c.rotary != "neox", a["k_descale"], a["v_descale"])
    rest = dict(cache_seqlens=a["cache_seqlens"] + c.new, cache_batch_idx=a["cache_batch_idx"],
                cache_leftpad=a["cache_leftpad"], page_table=a["page_table"], causal=c.causal,
                window_size=c.window, softcap=c.softcap, k_descale=a["k_descale"], v_descale=a["v_descale"])
    # (e4m3 caches go in as they are: the reference dequantizes them.)
    ref = kvcache_attention_ref(q.double(), *((kc, vc) if c.fp8 else (kc.double(), vc.double())), **rest)
    same = kvcache_attention_ref(q, kc, vc, upcast=False, **rest)
    return ref, same, dict(k_cache=kc, v_cache=vc)


def _poison_free_memory(nbytes: int) -> None:
    """NaN into blocks the caching allocator hands out next (the outputs and split partials), so
    an element the kernels never write shows as NaN."""
    block = torch.full((max(nbytes, 1 << 20) // 4,), float("nan"), dtype=torch.float32, device="cuda")
    del block


def _call(c: Case, a: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return flash_attn_with_kvcache(**a, causal=c.causal, window_size=c.window, softcap=c.softcap,
                                   rotary_interleaved=c.rotary != "neox", num_splits=c.num_splits,
                                   return_lse=True)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kvcache_matches_the_fp64_reference(case: Case, seed: int) -> None:
    a = _setup(case)
    ref, same, appended = _reference(case, a)
    _poison_free_memory(a["q"].numel() * 64)
    out, lse = _call(case, a)
    # The append kernel wrote what the reference's torch ops wrote, up to one rounding step of the
    # cache's dtype (its rotary may fuse a multiply-add); every other slot is untouched (NaN as NaN).
    step = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10, torch.float8_e4m3fn: 2.0**-3}
    for name in ("k_cache", "v_cache"):
        got_cache, want_cache = a[name], appended[name]
        fp8 = got_cache.dtype == torch.float8_e4m3fn  # (codes: e4m3's subnormal step is 2^-9)
        torch.testing.assert_close(got_cache.float(), want_cache.float(), rtol=step[got_cache.dtype],
                                   atol=2.0**-9 if fp8 else 0.0, equal_nan=True, msg=name)
    assert_rule("out", out, ref[0], same[0].to(case.dtype), FLOOR_FWD, seed, _id(case))
    assert_lse_rule(lse, ref[1].float(), same[1], seed, _id(case))


SM80_CASES = [c for c in CASES if not c.page_size][:6]
SM80_CASES += [c for c in CASES if c.page_size == 64 and not c.fp8]


@pytest.mark.parametrize("case", SM80_CASES, ids=_id)
def test_the_sm80_kernel_matches_the_fp64_reference(case: Case, seed: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUTE_FLASH_FWD_KERNEL", "sm80")
    test_kvcache_matches_the_fp64_reference(case, seed)


@pytest.mark.parametrize("dtype,hdim_v", [(torch.bfloat16, 128), (torch.float16, 64), (torch.bfloat16, 256)])
def test_the_merge_kernel_matches_the_merge_formula(seed: int, dtype: torch.dtype, hdim_v: int) -> None:
    """The combine kernel alone on random partials, some splits empty (LSE -inf) and one row with
    every split empty."""
    b, splits, nq, h = 3, 5, 2, 4
    o_acc = torch.randn(b * splits, nq, h, hdim_v, device="cuda")
    lse_acc = torch.randn(b * splits, h, nq, device="cuda") * 4
    lse_acc[torch.rand_like(lse_acc) < 0.3] = float("-inf")
    lse_acc[1 * splits:2 * splits, 2, 1] = float("-inf")
    o_acc[lse_acc.transpose(1, 2).isneginf()] = 0.0
    out = torch.full((b, nq, h, hdim_v), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((b, h, nq), float("nan"), device="cuda")
    merge = jit.compile_kernel(FwdCombineConfig(target=None, dtype=formats.dtype_name(dtype), hdim_v=hdim_v))
    merge(o_acc, lse_acc, out, lse, splits, None)
    parts = o_acc.reshape(b, splits, nq, h, hdim_v).transpose(0, 1).double()
    lse_parts = lse_acc.reshape(b, splits, h, nq).transpose(0, 1).transpose(2, 3).double()
    want, want_lse = merge_splits_ref(parts, lse_parts)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=1e-2)
    want_lse = want_lse.transpose(1, 2)
    assert torch.equal(lse.isneginf(), want_lse.isneginf())
    torch.testing.assert_close(lse.double().nan_to_num(neginf=0.0), want_lse.nan_to_num(neginf=0.0),
                               atol=1e-5, rtol=1e-5)
    assert not out[1, 1, 2].any()


def test_a_captured_graph_replays_over_changing_cache_seqlens(seed: int) -> None:
    case = Case(lens=(100, 2000), capacity=4096, rotary="gptj")
    a = _setup(case)
    # Finite data everywhere: the replays move the sequence ends over slots written before.
    a["k_cache"].normal_()
    a["v_cache"].normal_()
    base_k, base_v = a["k_cache"].clone(), a["v_cache"].clone()
    lens = a["cache_seqlens"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _call(case, a)  # warm-up: compiles and checks the call outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = _call(case, a)
    for new_lens in ((0, 4095), (1, 1), (3071, 17), (100, 2000)):
        a["k_cache"].copy_(base_k)
        a["v_cache"].copy_(base_v)
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        ref, same, _ = _reference(case, {**a, "k_cache": base_k, "v_cache": base_v})
        graph.replay()
        torch.cuda.synchronize()
        assert_rule("out", out, ref[0], same[0].to(case.dtype), FLOOR_FWD, seed, new_lens)
        assert_lse_rule(lse, ref[1].float(), same[1], seed, new_lens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_e4m3_code_reaches_o_exactly(dtype: torch.dtype) -> None:
    """V rows holding all 254 finite e4m3 codes, subnormals included; key j of sequence j scores
    far above the others, so O is that V row: its codes converted exactly (descale 1)."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes != 0x7F) & (codes != 0xFF)].to(torch.uint8)  # (NaN codes excluded)
    d, n, b = 128, 64, 2
    v_rows = torch.zeros(b, d, dtype=torch.uint8)
    v_rows.view(-1)[:codes.numel()] = codes
    vc = torch.zeros(b, n, 1, d, dtype=torch.uint8)
    vc[:, :b, 0] = v_rows  # (rows b.. stay code 0 = 0.0)
    kc = torch.zeros(b, n, 1, d, dtype=torch.float32)
    for j in range(b):
        kc[j, j, 0, 0] = 448.0  # sequence j's key j: score 448 * 16 / sqrt(d), the rest 0
    q = torch.zeros(b, 1, 1, d, dtype=dtype)
    q[..., 0] = 16.0
    k8, v8 = kc.to(torch.float8_e4m3fn).cuda(), vc.view(torch.float8_e4m3fn).cuda()
    out = flash_attn_with_kvcache(q.cuda(), k8, v8, cache_seqlens=torch.full((b,), n, dtype=torch.int32,
                                                                              device="cuda"))
    want = v_rows.view(torch.float8_e4m3fn).float()
    for j in range(b):
        torch.testing.assert_close(out[j, 0, 0].float().cpu(), want[j], atol=0, rtol=0)
