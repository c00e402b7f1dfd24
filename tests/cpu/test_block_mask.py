"""Block masks on the CPU: the ranges a kernel reads from a ``BlockMask`` never leave out a visible
(query, key) pair and never call a block full that holds a masked one, for the built-in masks, at
the tilings of both kernel families, forward (per query block) and backward (per key block, a
GQA group's heads merged); calls check that a block mask covers them; and each main kernel
compiles with one."""

from __future__ import annotations

import pytest
import torch

from cute_flash import create_block_mask, jit
from cute_flash.device import mods as m


def _dense(mask, b, h, nq, nk, aux):
    q = torch.arange(nq).view(1, 1, nq, 1)
    k = torch.arange(nk).view(1, 1, 1, nk)
    bb = torch.arange(b).view(b, 1, 1, 1)
    hh = torch.arange(h).view(1, h, 1, 1)
    return torch.as_tensor(mask.torch(bb, hh, q, k, aux)).expand(b, h, nq, nk)


def _check_ranges(keep: torch.Tensor, ranges: torch.Tensor, tm: int, tn: int) -> None:
    """keep (B, H, rows, cols); ranges (B, H, row blocks, 4) over column blocks of ``tn``."""
    b, h, rows, cols = keep.shape
    for bi in range(b):
        for hi in range(h):
            for r in range(-(-rows // tm)):
                lo, end, flo, fend = ranges[bi, hi, r].tolist()
                assert 0 <= lo <= end and lo <= flo <= fend <= max(end, flo)
                for c in range(-(-cols // tn)):
                    tile = keep[bi, hi, r * tm:(r + 1) * tm, c * tn:(c + 1) * tn]
                    if tile.any():
                        assert lo <= c < end, (bi, hi, r, c)
                    if flo <= c < fend:
                        assert tile.all(), (bi, hi, r, c)


def _cases(n: int):
    ids = torch.cumsum(torch.rand(2, n) < 0.004, 1).to(torch.int32)
    return {
        "document": (m.document(), 2, None, (ids,)),
        "prefix_lm": (m.prefix_lm(), 2, None, (torch.tensor([0, 300], dtype=torch.int32),)),
        "sliding_window": (m.sliding_window(200), None, None, ()),
        "causal": (m.causal(), None, None, ()),
    }


@pytest.mark.parametrize("name", ["document", "prefix_lm", "sliding_window", "causal"])
@pytest.mark.parametrize("tm,tn", [(128, 96), (128, 64), (64, 128), (192, 80)])
def test_kernel_ranges_keep_every_visible_pair_and_only_full_blocks_full(name: str, tm: int, tn: int,
                                                                         seed: int) -> None:
    n = 1000
    mask, b, h, aux = _cases(n)[name]
    bm = create_block_mask(mask, b, h, n, n, aux=aux)
    keep = _dense(mask, b or 1, h or 1, n, n, aux)
    _check_ranges(keep, bm.kernel_ranges(tm, tn), tm, tn)
    _check_ranges(keep.transpose(2, 3), bm.kernel_ranges(tm, tn, backward=True), tn, tm)
    assert bm.kernel_ranges(tm, tn) is bm.kernel_ranges(tm, tn)  # made once per tiling
    wide = bm.kernel_ranges(tm, tn, batch=2, heads=3)  # (the kernels' argument, once per call shape)
    assert wide is bm.kernel_ranges(tm, tn, batch=2, heads=3) and wide.is_contiguous()
    assert torch.equal(wide, bm.kernel_ranges(tm, tn).expand(2, 3, -1, -1))


def test_backward_ranges_merge_the_heads_of_a_gqa_group(seed: int) -> None:
    n, heads, group = 300, 4, 2

    def per_head_window(b, h, q_idx, kv_idx, aux):
        return (kv_idx <= q_idx) & (kv_idx >= q_idx - 40 * (h + 1))

    mask = m.Mod(None, per_head_window)
    bm = create_block_mask(mask, None, heads, n, n)
    keep = _dense(mask, 1, heads, n, n, ())
    merged = keep.view(1, heads // group, group, n, n).any(dim=2).transpose(2, 3)
    ranges = bm.kernel_ranges(64, 128, backward=True, group=group)
    assert ranges.shape[1] == heads // group
    _check_ranges(merged, ranges, 128, 64)
    every = keep.view(1, heads // group, group, n, n).all(dim=2).transpose(2, 3)
    for g in range(heads // group):
        for blk in range(ranges.shape[2]):
            flo, fend = ranges[0, g, blk, 2:].tolist()
            for c in range(flo, fend):  # full: every head of the group sees every pair
                assert every[0, g, blk * 128:(blk + 1) * 128, c * 64:(c + 1) * 64].all()


def test_the_grids_match_a_dense_evaluation_cell_by_cell(seed: int) -> None:
    mask, b, h, aux = _cases(777)["document"]
    bm = create_block_mask(mask, b, h, 777, 500, aux=aux)
    keep = _dense(mask, 2, 1, 777, 500, aux)
    for r in range(bm.shape[2]):
        for c in range(bm.shape[3]):
            cell = keep[:, :, r * 16:(r + 1) * 16, c * 16:(c + 1) * 16]
            assert torch.equal(bm.any_visible[:, :, r, c], cell.any(-1).any(-1))
            assert torch.equal(bm.all_visible[:, :, r, c], cell.all(-1).all(-1))


@pytest.mark.parametrize("kw,err,match", [
    (dict(n_mask=36), ValueError, "made for"),
    (dict(mask_batch=3), ValueError, "batch / heads"),
    (dict(no_mask_mod=True), ValueError, "mask_mod it was made from"),
    (dict(not_a_mask=True), TypeError, "BlockMask"),
])
def test_a_block_mask_must_cover_the_call(kw, err, match) -> None:
    import cute_flash

    q, k, v = (torch.randn(2, 37, 4, 32, dtype=torch.bfloat16) for _ in range(3))
    n = kw.get("n_mask", 37)
    bm = create_block_mask(m.causal(), kw.get("mask_batch"), None, n, n)
    args = dict(mask_mod=None if kw.get("no_mask_mod") else m.causal(),
                block_mask="blocks" if kw.get("not_a_mask") else bm)
    with pytest.raises(err, match=match):
        cute_flash.flash_attn_func(q, k, v, **args)


def test_a_call_with_a_block_mask_runs_and_traces(seed: int) -> None:
    import cute_flash

    ids = torch.tensor([[0] * 10 + [1] * 27, [0] * 37], dtype=torch.int32)
    doc = m.document()  # (mods and block masks are made outside compiled code, as Flex's)
    bm = create_block_mask(doc, 2, None, 37, 37, aux=(ids,))
    q, k, v = (torch.randn(2, 37, 4, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return cute_flash.flash_attn_func(q, k, v, mask_mod=doc, aux=(ids,), block_mask=bm)

    want = cute_flash.flash_attn_func(q, k, v, mask_mod=doc, aux=(ids,))
    torch.testing.assert_close(f(q, k, v), want)
    torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v).float().sum().backward()
    assert q.grad is not None


def _sparse_config(kind: str, family: str, both: bool):
    from cute_flash.ampere.config import BwdConfig, FwdConfig
    from cute_flash.hopper.bwd_config import BwdSm90Config
    from cute_flash.hopper.fwd_config import FwdSm90Config

    doc, alibi = m.document(1 if both else 0), m.alibi()
    fields = dict(mask_mod=doc.dsl, block_sparse=True,
                  aux=((("fp32", 1),) if both else ()) + (("int32", 2),))
    if both:
        fields["score_mod"] = alibi.dsl
    if kind == "bwd":
        fields.update(aux_grads=(False,) * len(fields["aux"]),
                      score_mod_bwd=alibi.bwd if both else None)
    kw = dict(dtype="bf16", hdim=128, hdim_v=128, causal=True, mods=m.Mods(**fields))
    cls = {("fwd", "sm90"): FwdSm90Config, ("fwd", "sm80"): FwdConfig, ("bwd", "sm90"): BwdSm90Config,
           ("bwd", "sm80"): BwdConfig}[(kind, family)]
    return cls(target="sm_90a" if family == "sm90" else "sm_80", **kw)


@pytest.mark.parametrize("kind,family,both", [
    pytest.param(kind, family, both, id=f"{kind}-{family}-{'alibi+document' if both else 'document'}",
                 marks=() if (kind, family, both) == ("fwd", "sm90", False) else pytest.mark.slow)
    for kind in ("fwd", "bwd") for family in ("sm90", "sm80") for both in (False, True)])
def test_each_main_kernel_compiles_with_a_block_mask(kind: str, family: str, both: bool) -> None:
    from cute_flash.tools import inspect as ins

    ptx, cubin = jit.compile_artifacts(_sparse_config(kind, family, both))
    assert "ld.local" not in ptx
    # (The sm90 backward with a score_mod and a mask_mod together is a few registers short: its
    # 128-key tile cannot shrink.)
    stack = 64 if (kind, family, both) == ("bwd", "sm90", True) else 0
    if ins.tools_dir() is not None:
        for fn, res in ins.cubin_sass_and_usage(cubin)[1].items():
            assert res.get("LOCAL", 0) == 0 and res.get("STACK", 0) <= stack, (fn, res)


def test_the_ops_find_a_live_block_mask_by_its_grids() -> None:
    import gc
    import weakref

    from cute_flash.block_mask import block_mask_of

    bm = create_block_mask(m.causal(), None, None, 100, 100)
    assert block_mask_of(bm.any_visible, bm.all_visible) is bm
    assert block_mask_of(bm.any_visible, bm.all_visible.clone()) is None
    grid = weakref.ref(bm.any_visible)
    del bm
    gc.collect()
    assert grid() is None  # (the registry keeps neither the mask nor its grids alive)
