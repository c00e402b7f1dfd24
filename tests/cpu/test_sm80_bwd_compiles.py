"""Every shipped sm80 backward variant compiles for sm_80 on the CPU, uses the sm80 instructions it
is meant to (mma.sync, ldmatrix, cp.async, fp32 reductions for dQ) and never spills registers.

No GPU needed: the kernels are cross-compiled against fake tensors and the cubin is inspected with
``cuobjdump -res-usage`` (pip package nvidia-cuda-cuobjdump).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile

import pytest

from cute_flash import dispatch, jit
from cute_flash.ampere.config import SM80_BWD_TILES, SM80_BWD_TILES_SOFTCAP, SM80_SMEM_BYTES, BwdConfig
from cute_flash.problem import Problem
from cute_flash.validate import SUPPORTED_HEAD_DIMS

TARGET = "sm_80"


def bwd_configs(dtype: str = "bf16", hdim: int = 128, hdim_v: int | None = None, **flags: bool) -> tuple:
    """(preprocess, main, postprocess) of one sm80 backward variant, as the launchers get them."""
    p = Problem(target=TARGET, dtype=dtype, hdim=hdim, hdim_v=hdim if hdim_v is None else hdim_v, **flags)
    return dispatch.bwd_configs(p, "sm80")


def _cuobjdump() -> str | None:
    try:
        import nvidia

        path = os.path.join(nvidia.__path__[0], "cu13", "bin", "cuobjdump")
        if os.path.exists(path):
            return path
    except ImportError:
        pass
    return shutil.which("cuobjdump")


CUOBJDUMP = _cuobjdump()


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG/STACK/SHARED/LOCAL of the (single) kernel in a cubin."""
    if CUOBJDUMP is None:
        pytest.skip("cuobjdump not installed (pip install nvidia-cuda-cuobjdump)")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    assert m, out
    return dict(zip(("REG", "STACK", "SHARED", "LOCAL"), map(int, m.groups()), strict=True))


def check_no_spills(cfg) -> str:
    ptx, cubin = jit.compile_artifacts(cfg)
    res = resource_usage(cubin)
    # A stack frame on sm80 only ever holds spilled registers here (no recursion, no local arrays).
    assert res["LOCAL"] == 0 and res["STACK"] == 0, f"{cfg.describe()} spills: {res}"
    return ptx


def check_variant(configs: list) -> None:
    pre, main, post = configs
    ptx = check_no_spills(main)
    assert "mma.sync.aligned.m16n8k16" in ptx
    assert "ldmatrix.sync.aligned" in ptx and ".trans" in ptx  # P^T, dS^T, Q^T, dO^T, K^T operands
    assert "cp.async.cg.shared.global" in ptx
    assert re.search(r"(red|atom)\.[a-z.]*global\.add\.f32", ptx), "dQ must be reduced with red/atom"
    if main.deterministic:
        assert "ld.acquire.gpu" in ptx and "st.release.gpu" in ptx  # the dQ ordering semaphore
    pre_ptx = check_no_spills(pre)
    assert "st.global.v4" in pre_ptx  # 16-byte zeroing of the dQ accumulator
    check_no_spills(post)


MASKS = {"plain": dict(causal=False, local=False), "causal": dict(causal=True, local=False),
         "local": dict(causal=False, local=True)}


# Softcap is in the full grid because it is the register-heaviest feature (1 - tanh^2 of every
# score stays live from S to dS); varlen and deterministic change addressing, not the peak, and
# are covered below.
GRID = [(dtype, hdim, mask, softcap) for dtype in ("bf16", "fp16") for hdim in SUPPORTED_HEAD_DIMS
        for mask in MASKS for softcap in (False, True)]
# One variant in the fast tier (bf16 d = 128 causal, the most used); the others are ``slow``.
FAST = ("bf16", 128, "causal", False)


@pytest.mark.parametrize("dtype,hdim,mask,softcap", [
    pytest.param(*g, id=f"{g[0]}-d{g[1]}-{g[2]}-{'softcap' if g[3] else 'nocap'}",
                 marks=() if g == FAST else pytest.mark.slow) for g in GRID])
def test_bwd_variant(dtype: str, hdim: int, mask: str, softcap: bool) -> None:
    check_variant(bwd_configs(dtype, hdim, softcap=softcap, **MASKS[mask]))


# Features orthogonal to the mask, each on a few head dims (the register-heaviest included).
EXTRA = [
    dict(dtype="bf16", hdim=128, softcap=True),
    dict(dtype="fp16", hdim=256, causal=True, softcap=True),
    dict(dtype="bf16", hdim=64, causal=True, varlen=True),
    dict(dtype="bf16", hdim=128, causal=True, deterministic=True),
    dict(dtype="fp16", hdim=96, local=True, softcap=True, varlen=True, deterministic=True),
    dict(dtype="bf16", hdim=192, hdim_v=128, causal=True),
]


@pytest.mark.slow
@pytest.mark.parametrize("kw", EXTRA, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_bwd_feature_variant(kw: dict) -> None:
    check_variant(bwd_configs(**kw))


def test_tile_table_fits_sm80() -> None:
    for hdim, tiles in [*SM80_BWD_TILES.items(), *SM80_BWD_TILES_SOFTCAP.items()]:
        assert tiles.smem_bytes(hdim, hdim) <= SM80_SMEM_BYTES, (hdim, tiles)
        warps = tiles.num_threads // 32
        for atom in (tiles.atom_sdp, tiles.atom_dkv, tiles.atom_dq):
            assert warps % atom == 0
        # S/dP (tile_m x tile_n), dK/dV (tile_n x hdim), dQ (tile_m x hdim) tile the MMA grids.
        assert tiles.tile_m % (16 * tiles.atom_sdp) == 0
        assert tiles.tile_n % (16 * (warps // tiles.atom_sdp)) == 0
        assert tiles.tile_n % (16 * tiles.atom_dkv) == 0 and hdim % (16 * (warps // tiles.atom_dkv)) == 0
        dq_cols = hdim // tiles.dq_splits
        assert tiles.tile_m % (16 * tiles.atom_dq) == 0 and dq_cols % (16 * (warps // tiles.atom_dq)) == 0
        assert dq_cols % 64 == 0 or tiles.dq_splits == 1  # a column slice is whole 64-wide smem atoms


def test_configs_share_the_dq_layout() -> None:
    """Pre/post kernels must use the main kernel's query tile and dQ MMA (the accumulator's
    fragment order), and the configs must be hashable cache keys."""
    for deterministic in (False, True):
        pre, main, post = bwd_configs("bf16", 128, causal=True, varlen=True, deterministic=deterministic)
        assert isinstance(main, BwdConfig)
        assert pre.tile_m == main.tiles.tile_m and post.tiles == main.tiles
        assert pre.deterministic == deterministic and pre.varlen and post.varlen
        assert len({pre, main, post, main}) == 3
    with pytest.raises(ValueError):
        bwd_configs("bf16", 80)


def test_varlen_scratch_holds_every_padded_batch() -> None:
    """The packed scratch rows of batch b start at (cu_q[b] + b*tile_m) // tile_m * tile_m (the
    formula of cute_flash.device.scratch.padded_offset_q): batches must not overlap and must fit
    in what ``launch.run_bwd`` allocates, for any lengths (empty ones included)."""
    import random

    import torch

    from cute_flash.launch import alloc_scratch

    rng = random.Random(0)
    for _ in range(300):
        hdim = rng.choice(SUPPORTED_HEAD_DIMS)
        cfg = bwd_configs("bf16", hdim, varlen=True, deterministic=True)[1]
        tm = cfg.tiles.tile_m
        lens = [rng.choice([0, 1, tm - 1, tm, tm + 1, rng.randint(0, 700)]) for _ in range(rng.randint(1, 6))]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        q = torch.empty(cu[-1], 2, hdim)
        lse2, dsum, dq_acc, sem = alloc_scratch(q, tm, cfg.hdim, cfg.deterministic, len(lens), cu[-1],
                                                varlen=True)
        rows = lse2.shape[-1]
        assert dsum.shape == lse2.shape and dq_acc.shape[-1] == rows * hdim and sem.shape[-1] * tm == rows
        end = 0
        for b, n in enumerate(lens):
            start = (cu[b] + b * tm) // tm * tm
            assert start >= end
            end = start + -(-n // tm) * tm
        assert end <= rows


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm_80", "sm_90a"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_preprocess_with_an_lse_gradient_reads_it_once_per_row(target: str, varlen: bool) -> None:
    """``dlse``: the preprocess loads dLSE beside D's row sum and subtracts it (one scalar load and
    one FSUB per row it owns), no spills; the main kernel is unchanged (D carries the term)."""
    import dataclasses

    from cute_flash.hopper.bwd_config import BwdSm90Config

    if target == "sm_80":
        base = bwd_configs("bf16", 128, causal=True, varlen=varlen)[0]
    else:
        base = BwdSm90Config(target=target, hdim=128, causal=True, varlen=varlen).pre()
    plain_ptx = check_no_spills(base)
    ptx = check_no_spills(dataclasses.replace(base, dlse=True))
    rows = base.tile_m * (64 // 8) // base.threads  # rows per thread that owns a D row (d_v = 128)
    loads = [len(re.findall(r"ld\.global\.(?:b32|f32)", p)) for p in (plain_ptx, ptx)]
    assert loads[1] - loads[0] == rows
    assert ptx.count("sub.f32") - plain_ptx.count("sub.f32") == rows
