"""The KV-cache reference (``reference_kvcache``, the CPU implementation of
``flash_attn_with_kvcache`` and the GPU tests' ground truth) against brute force written out
here: rotary by its defining formula, the append at ``cache_seqlens``, each sequence's keys
``[leftpad, cache_seqlens + new)``, bottom-right masks; paged caches give what the same keys in a
contiguous cache give."""

from __future__ import annotations

import math

import pytest
import torch

from cute_flash import flash_attn_with_kvcache, kv_append
from cute_flash.reference_kvcache import kvcache_attention_ref, merge_splits_ref, split_kv_ref


def _rotate_brute(x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  interleaved: bool) -> torch.Tensor:
    """x (B, N, H, d) rotated element by element: channel pair (a, b) at angle index i."""
    out = x.clone()
    half = cos.shape[1]
    for b in range(x.shape[0]):
        for n in range(x.shape[1]):
            p = int(pos[b, n])
            for i in range(half):
                a, c = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                xa, xb = x[b, n, :, a].double(), x[b, n, :, c].double()
                cs, sn = float(cos[p, i]), float(sin[p, i])
                out[b, n, :, a] = (xa * cs - xb * sn).to(x.dtype)
                out[b, n, :, c] = (xa * sn + xb * cs).to(x.dtype)
    return out


def _attend_brute(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, causal: bool,
                  window: tuple[int, int], softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q (Nq, H, d), keys (Nk, Hkv, d); bottom-right aligned masks; fp64 loops."""
    nq, h, _ = q.shape
    nk, hkv = keys.shape[0], keys.shape[1]
    out = torch.zeros(nq, h, values.shape[-1], dtype=torch.float64)
    lse = torch.full((h, nq), -math.inf, dtype=torch.float64)
    left, right = window
    if causal:
        right = 0
    for i in range(nq):
        diag = i + nk - nq
        for hh in range(h):
            kv = hh // (h // hkv)
            scores = []
            for j in range(nk):
                if (left >= 0 and j < diag - left) or (right >= 0 and j > diag + right):
                    continue
                s = float(q[i, hh].double() @ keys[j, kv].double()) * scale
                if softcap > 0:
                    s = softcap * math.tanh(s / softcap)
                scores.append((j, s))
            if not scores:
                continue
            m = max(s for _, s in scores)
            total = sum(math.exp(s - m) for _, s in scores)
            lse[hh, i] = m + math.log(total)
            for j, s in scores:
                out[i, hh] += math.exp(s - m) / total * values[j, kv].double()
    return out, lse


def _inputs(batch: int, capacity: int, nq: int, new: int, h: int, hkv: int, d: int, dtype=torch.float64):
    q = torch.randn(batch, nq, h, d, dtype=dtype)
    k_cache = torch.randn(batch, capacity, hkv, d, dtype=dtype)
    v_cache = torch.randn(batch, capacity, hkv, d, dtype=dtype)
    k = torch.randn(batch, new, hkv, d, dtype=dtype) if new else None
    v = torch.randn(batch, new, hkv, d, dtype=dtype) if new else None
    return q, k_cache, v_cache, k, v


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_matches_its_formula(seed: int, interleaved: bool) -> None:
    x = torch.randn(2, 3, 2, 32, dtype=torch.float64)
    cos, sin = torch.randn(10, 8, dtype=torch.float64), torch.randn(10, 8, dtype=torch.float64)
    pos = torch.tensor([[0, 4, 9], [3, 3, 7]])
    got = kv_append.apply_rotary(x, cos, sin, pos, interleaved)
    torch.testing.assert_close(got, _rotate_brute(x, pos, cos, sin, interleaved))
    assert torch.equal(got[..., 16:], x[..., 16:])  # channels past rotary_dim untouched


@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (5, 0), 0.0), (True, (-1, -1), 3.0)])
@pytest.mark.parametrize("rotary", [False, True])
def test_reference_appends_rotates_and_attends_like_brute_force(seed: int, causal: bool, window: tuple,
                                                                softcap: float, rotary: bool) -> None:
    batch, capacity, nq, new, h, hkv, d = 3, 24, 3, 3, 4, 2, 32
    q, k_cache, v_cache, k, v = _inputs(batch, capacity, nq, new, h, hkv, d)
    cache_seqlens = torch.tensor([0, 9, capacity - new], dtype=torch.int32)  # empty, partial, full
    cos = sin = None
    if rotary:
        cos, sin = torch.randn(32, 6, dtype=torch.float64), torch.randn(32, 6, dtype=torch.float64)
    kc, vc = k_cache.clone(), v_cache.clone()
    scale = 0.3
    out, lse = kvcache_attention_ref(q, kc, vc, k, v, cos, sin, cache_seqlens, softmax_scale=scale,
                                     causal=causal, window_size=window, softcap=softcap)
    per_token = causal or window != (-1, -1)
    for b in range(batch):
        n = int(cache_seqlens[b])
        kb, qb = k[b:b + 1], q[b:b + 1]
        if rotary:
            kb = _rotate_brute(kb, torch.arange(n, n + new)[None], cos, sin, True)
            qpos = torch.arange(n, n + nq) if per_token else torch.full((nq,), n)
            qb = _rotate_brute(qb, qpos[None], cos, sin, True)
        keys = torch.cat([k_cache[b, :n], kb[0]])
        values = torch.cat([v_cache[b, :n], v[b]])
        # The caches hold the new tokens at [n, n + new) and nothing else changed.
        assert torch.equal(kc[b, :n + new], keys) and torch.equal(vc[b, :n + new], values)
        assert torch.equal(kc[b, n + new:], k_cache[b, n + new:])
        o_b, lse_b = _attend_brute(qb[0], keys, values, scale, causal, window, softcap)
        torch.testing.assert_close(out[b], o_b)
        torch.testing.assert_close(lse[b], lse_b)


def test_batch_rows_and_left_padding_pick_each_sequences_keys(seed: int) -> None:
    batch, capacity, h, d = 2, 20, 2, 32
    q, k_cache, v_cache, k, v = _inputs(batch, capacity, 2, 1, h, 1, d)
    # Four cache rows for two sequences.
    k_cache, v_cache = torch.cat([k_cache, k_cache.flip(0)]), torch.cat([v_cache, v_cache.flip(0)])
    rows = torch.tensor([3, 1], dtype=torch.int32)
    pad = torch.tensor([2, 0], dtype=torch.int32)
    lens = torch.tensor([7, 12], dtype=torch.int32)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = kvcache_attention_ref(q, kc, vc, k, v, cache_seqlens=lens, cache_batch_idx=rows,
                                     cache_leftpad=pad, causal=True)
    for b in range(batch):
        r, p, n = int(rows[b]), int(pad[b]), int(lens[b])
        assert torch.equal(kc[r, n], k[b, 0])
        o_b, lse_b = _attend_brute(q[b], kc[r, p:n + 1], vc[r, p:n + 1], 1 / math.sqrt(d), True, (-1, -1),
                                   0.0)
        torch.testing.assert_close(out[b], o_b)
        torch.testing.assert_close(lse[b], lse_b)
    untouched = [0, 2]
    assert torch.equal(kc[untouched], k_cache[untouched])


def test_left_padding_keeps_rotary_positions_at_cache_slots(seed: int) -> None:
    """flash-attn rotates a new key written at slot n at position n, left padding or not (the
    keys before the pad were rotated at their slots too)."""
    batch, capacity, h, d = 2, 24, 2, 16
    q, k_cache, v_cache, k, v = _inputs(batch, capacity, 1, 2, h, h, d)
    angle = torch.rand(capacity + 2, d // 2, dtype=torch.float64) * 6.2832
    cos, sin = angle.cos(), angle.sin()
    lens, pad = torch.tensor([9, 15], dtype=torch.int32), torch.tensor([4, 0], dtype=torch.int32)
    kc, vc = k_cache.clone(), v_cache.clone()
    kvcache_attention_ref(q, kc, vc, k, v, cos, sin, cache_seqlens=lens, cache_leftpad=pad, causal=True)
    for b in range(batch):
        n = int(lens[b])
        want = _rotate_brute(k[b:b + 1], torch.arange(n, n + 2)[None], cos, sin, interleaved=True)[0]
        torch.testing.assert_close(kc[b, n:n + 2], want)


@pytest.mark.parametrize("page_size", [1, 5, 16, 32])
def test_a_paged_cache_gives_what_the_same_keys_give_contiguous(seed: int, page_size: int) -> None:
    batch, h, hkv, d = 2, 4, 2, 32
    pages_per_seq = -(-64 // page_size)
    capacity = pages_per_seq * page_size
    q, k_cache, v_cache, k, v = _inputs(batch, capacity, 2, 2, h, hkv, d)
    lens = torch.tensor([capacity - 2, 3], dtype=torch.int32)
    # The pages of both sequences, shuffled over a pool with spare pages.
    pool = 3 * batch * pages_per_seq
    table = torch.randperm(pool)[:batch * pages_per_seq].reshape(batch, pages_per_seq).to(torch.int32)
    k_pages = torch.randn(pool, page_size, hkv, d, dtype=torch.float64)
    v_pages = torch.randn(pool, page_size, hkv, d, dtype=torch.float64)
    for b in range(batch):
        k_pages[table[b].long()] = k_cache[b].reshape(pages_per_seq, page_size, hkv, d)
        v_pages[table[b].long()] = v_cache[b].reshape(pages_per_seq, page_size, hkv, d)
    used = -(-(3 + 2) // page_size)
    table[1, used:] = -7  # entries past the short sequence's last page may hold anything
    kp, vp = k_pages.clone(), v_pages.clone()
    got = kvcache_attention_ref(q, kp, vp, k, v, cache_seqlens=lens, page_table=table, causal=True)
    want = kvcache_attention_ref(q, k_cache.clone(), v_cache.clone(), k, v, cache_seqlens=lens, causal=True)
    torch.testing.assert_close(got, want)
    for b in range(batch):
        slot = int(lens[b])
        page, off = int(table[b, slot // page_size]), slot % page_size
        assert torch.equal(kp[page, off], k[b, 0])
    spare = sorted(set(range(pool)) - set(table.flatten().tolist()))
    assert torch.equal(kp[spare], k_pages[spare])  # pages of no sequence never written


def test_the_public_function_on_cpu_runs_the_reference_and_appends(seed: int) -> None:
    q, k_cache, v_cache, k, v = _inputs(2, 16, 1, 1, 4, 2, 64, dtype=torch.bfloat16)
    kc, vc = k_cache.clone(), v_cache.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=5, causal=True, return_lse=True)
    want, want_lse = kvcache_attention_ref(q, k_cache.clone(), v_cache.clone(), k, v,
                                           cache_seqlens=torch.full((2,), 5, dtype=torch.int32), causal=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out, want.to(torch.bfloat16))
    torch.testing.assert_close(lse, want_lse)
    assert torch.equal(kc[:, 5], k[:, 0]) and torch.equal(vc[:, 5], v[:, 0])


def test_without_cache_seqlens_every_row_is_full(seed: int) -> None:
    q, k_cache, v_cache, _, _ = _inputs(2, 12, 2, 0, 2, 2, 32)
    out, lse = kvcache_attention_ref(q, k_cache, v_cache, causal=True)
    for b in range(2):
        o_b, lse_b = _attend_brute(q[b], k_cache[b], v_cache[b], 1 / math.sqrt(32), True, (-1, -1), 0.0)
        torch.testing.assert_close(out[b], o_b)
        torch.testing.assert_close(lse[b], lse_b)


@pytest.mark.parametrize("nk,num_splits,causal", [(1000, 4, False), (1000, 4, True), (130, 7, True),
                                                  (64, 5, False), (3, 2, True)])
def test_split_partials_merge_into_the_whole_attention(seed: int, nk: int, num_splits: int,
                                                       causal: bool) -> None:
    """The split-KV recurrence the kernels and the merge implement, against dense attention: equal
    shares of 64-key blocks, partials normalised by their own sums, splits past the last block
    (more splits than blocks) empty with LSE -inf and weight 0."""
    nq, h, d = 3, 2, 32
    q = torch.randn(nq, h, d, dtype=torch.float64)
    keys, values = torch.randn(nk, h, d, dtype=torch.float64), torch.randn(nk, h, d, dtype=torch.float64)
    o_parts, lse_parts, out, lse = split_kv_ref(q, keys, values, tile_n=64, num_splits=num_splits,
                                                softmax_scale=0.2, causal=causal)
    want, want_lse = _attend_brute(q, keys, values, 0.2, causal, (-1, -1), 0.0)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)
    blocks = -(-nk // 64)
    share = -(-blocks // num_splits)
    for s in range(num_splits):
        if s * share >= blocks:  # an empty split: O = 0, LSE = -inf
            assert torch.isneginf(lse_parts[s]).all() and not o_parts[s].any()


def test_a_row_with_no_key_in_any_split_merges_to_zero_and_minus_inf() -> None:
    o_parts = torch.zeros(3, 2, 4, 8)
    lse_parts = torch.full((3, 2, 4), float("-inf"))
    lse_parts[1, 0] = 0.5  # one row sees keys in one split only
    o_parts[1, 0] = 2.0
    out, lse = merge_splits_ref(o_parts, lse_parts)
    assert torch.equal(out[0], torch.full((4, 8), 2.0)) and torch.allclose(lse[0], torch.tensor(0.5))
    assert not out[1].any() and torch.isneginf(lse[1]).all()


@pytest.mark.parametrize("paged", [False, True])
def test_an_fp8_cache_reads_codes_times_each_sequences_descales(seed: int, paged: bool) -> None:
    batch, capacity, h, hkv, d = 2, 32, 4, 2, 32
    q, k_cache, v_cache, k, v = _inputs(batch, capacity, 1, 1, h, hkv, d, dtype=torch.float32)
    kd, vd = torch.rand(batch, hkv) + 0.25, torch.rand(batch, hkv) + 0.25
    k8, v8 = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    lens = torch.tensor([20, 7], dtype=torch.int32)
    table = None
    if paged:  # pages of 8 keys, in reverse order
        pool_pages = 2 * batch * capacity // 8
        table = torch.arange(pool_pages - 1, -1, -1, dtype=torch.int32)[:batch * 4].reshape(batch, 4)
        pool8 = [torch.zeros(pool_pages, 8, hkv, d).to(torch.float8_e4m3fn) for _ in range(2)]
        for pool, cache in zip(pool8, (k8, v8), strict=True):
            for b in range(batch):
                pool[table[b].long()] = cache[b].reshape(4, 8, hkv, d)
        k8, v8 = pool8
    got, got_lse = kvcache_attention_ref(q, k8, v8, k, v, cache_seqlens=lens, page_table=table, causal=True,
                                         k_descale=kd, v_descale=vd)
    # The same attention over the dequantized keys, the new token quantized the same way.
    new_k = (k / kd[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    new_v = (v / vd[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    keys = k_cache.to(torch.float8_e4m3fn).double() * kd.double()[:, None, :, None]
    values = v_cache.to(torch.float8_e4m3fn).double() * vd.double()[:, None, :, None]
    for b in range(batch):
        n = int(lens[b])
        keys[b, n] = new_k[b, 0].double() * kd[b].double()[:, None]
        values[b, n] = new_v[b, 0].double() * vd[b].double()[:, None]
        o_b, lse_b = _attend_brute(q[b].double(), keys[b, :n + 1], values[b, :n + 1], 1 / math.sqrt(d),
                                   True, (-1, -1), 0.0)
        torch.testing.assert_close(got[b].double(), o_b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_lse[b].double(), lse_b, atol=1e-5, rtol=1e-5)
    if paged:
        b, n = 1, int(lens[1])
        written = k8[int(table[b, n // 8]), n % 8]
    else:
        written = k8[1, int(lens[1])]
    assert torch.equal(written.view(torch.uint8), new_k[1, 0].view(torch.uint8))
