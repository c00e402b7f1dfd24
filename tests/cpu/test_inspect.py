"""``cute_flash.tools.inspect`` / ``python -m cute_flash inspect``: the parsers on fixed snippets
(fast), which kernels a variant names (``dispatch.configs_for``), and the reports of real compiles
of the sm80 forward, the sm80 backward and the sm90 (Hopper) forward (no GPU needed)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cute_flash
from cute_flash.tools import inspect as ins

# The checkout the package is imported from (where ``python -m cute_flash`` must find it).
PACKAGE_ROOT = Path(cute_flash.__file__).resolve().parent.parent


# ---------------------------------------------------------------------------------------------
# Parsers
# ---------------------------------------------------------------------------------------------
PTX = """
.version 9.4
.target sm_80
.extern .shared .align 1024 .b8 __dynamic_shmem__0[];

.visible .entry kern_a(
\t.param .align 8 .b8 kern_a_param_0[24]
)
.reqntid 128, 1, 1
{
\t.reg .b32 \t%r<9>;
\tcp.async.cg.shared.global [%r1], [%rd1], 16;   // mma.sync in a comment must not count
\t@%p1 cp.async.cg.shared.global [%r1], [%rd1], 16;
\tcp.async.commit_group;
\tcp.async.wait_group 1;
\tbar.sync \t0;
\tbarrier.sync.aligned 1, 256;
\tbar.arrive 2, 256;
\tldmatrix.sync.aligned.m8n8.x4.shared.b16 {%r1, %r2, %r3, %r4}, [%r5];
\tmma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1,%f2,%f3,%f4}, {%r1,%r2,%r3,%r4}, {%r5,%r6}, {%f1};
$L__BB0_2:
\t@!%p2 ex2.approx.ftz.f32 \t%f5, %f6;
\tshfl.sync.bfly.b32 \t%r7, %r8, 1, 31, -1;
\tred.global.add.f32 \t[%rd2], %f1;
\tatom.add.f32 \t%f2, [%rd2], %f1;
\tatom.shared.add.u32 \t%r1, [%r2], 1;
\tld.global.nc.v4.u32 \t{%r1, %r2, %r3, %r4}, [%rd3];
\tst.global.v4.b32 \t[%rd3], {%r1, %r2, %r3, %r4};
\tst.local.u32 \t[%rd4], %r1;
\tret;
}

.visible .entry kern_b(
\t.param .u64 kern_b_param_0
)
.reqntid 384
{
\twgmma.fence.sync.aligned;
\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, 1, 1, 1, 0, 0;
\twgmma.commit_group.sync.aligned;
\twgmma.wait_group.sync.aligned 0;
\tcp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2}], [%r3];
\tcp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%rd1, {%r1}], [%r2];
\tmbarrier.try_wait.parity.shared::cta.b64 %p1, [%r1], %r2;
\tmbarrier.arrive.expect_tx.shared::cta.b64 _, [%r1], 16384;
\tsetmaxnreg.inc.sync.aligned.u32 240;
\tsetmaxnreg.dec.sync.aligned.u32 24;
\tbar.sync \t%r3, 256;
\tbar.cta.arrive.aligned 0x0, 256;
\tcvt.rn.satfinite.e4m3x2.f32 %rs1, %f1, %f2;
\tret;
}
"""


def test_ptx_counts_per_entry() -> None:
    funcs = ins.ptx_instructions(PTX)
    assert list(funcs) == ["kern_a", "kern_b"]
    assert funcs["kern_a"][0] == "cp.async.cg.shared.global [%r1], [%rd1], 16"
    a, b = ins.count_ptx(funcs["kern_a"]), ins.count_ptx(funcs["kern_b"])
    assert set(a) == set(ins.PTX_KEYS)
    assert a["cp.async"] == 2  # the predicated one too; commit/wait are counted apart
    assert a["cp.async.commit_group"] == 1 and a["cp.async.wait_group"] == 1
    assert a["bar.sync"] == 2 and a["bar.arrive"] == 1
    assert a["bar.named"] == 2  # barrier ids 1 and 2; 'bar.sync 0' is __syncthreads
    assert a["ldmatrix"] == 1 and a["mma.sync"] == 1  # not the one in the comment
    assert a["ex2.approx"] == 1 and a["shfl.sync"] == 1
    assert a["red.global.add"] == 1 and a["atom.global.add"] == 1  # generic atom.add; not atom.shared
    assert a["ld.global"] == 1 and a["st.global"] == 1 and a["st.local"] == 1
    assert a["wgmma.mma_async"] == 0 and a["cp.async.bulk.tensor"] == 0
    assert b["wgmma.mma_async"] == 1 and b["wgmma.fence"] == 1 and b["wgmma.commit_group"] == 1
    assert b["wgmma.wait_group"] == 1
    assert b["cp.async.bulk.tensor"] == 1 and b["cp.reduce.async.bulk"] == 1 and b["cp.async"] == 0
    assert b["mbarrier"] == 2 and b["mbarrier.wait"] == 1 and b["cvt.e4m3"] == 1
    assert b["setmaxnreg"] == 2 and b["setmaxnreg.inc"] == 1 and b["setmaxnreg.dec"] == 1
    assert b["bar.sync"] == 1 and b["bar.arrive"] == 1
    assert b["bar.named"] == 1  # the id in a register is named; 'arrive 0x0' is barrier 0
    # Bare opcodes count the same, except what needs the operands.
    b_ops = ins.count_ptx(ins.ptx_opcodes(PTX)["kern_b"])
    assert b_ops["bar.named"] == 0 and {k: v for k, v in b_ops.items() if k != "bar.named"} == {
        k: v for k, v in b.items() if k != "bar.named"}
    assert ins.ptx_threads(PTX) == {"kern_a": 128, "kern_b": 384}


NVDISASM = """
\t.section\t.text.kern_a,"ax",@progbits
.text.kern_a:
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;
        /*0010*/                   LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64] ;
        /*0020*/              @!P0 LDSM.16.M88.4 R8, [R2] ;
        /*0030*/                   HMMA.16816.F32.BF16 R12, R8, R10, R12 ;
        /*0040*/                   MUFU.EX2 R5, R5 ;
        /*0050*/                   MUFU.RCP R6, R6 ;
        /*0060*/               @P1 RED.E.ADD.F32.FTZ.RN.STRONG.GPU [R2.64], R5 ;
        /*0070*/                   STL [R1], R5 ;
        /*0080*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0090*/                   NOP;
.text.kern_b:
        /*0000*/                   USETMAXREG.TRY_ALLOC.CTAPOOL 0xf0 ;
        /*0010*/             @!UPT UTMALDG.4D [UR8], [UR4] ;
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0030*/                   REDG.E.ADD.F32.FTZ.RN.STRONG.GPU desc[UR6][R2.64], R5 ;
        /*0040*/                   ATOMS.ADD R1, [R2], R3 ;
        /*0050*/                   SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [UR4+0x8], RZ ;
"""

CUOBJDUMP = """
\tcode for sm_80
\t\tFunction : kern_a
\t.headerflags\t@"EF_CUDA_SM80 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM80)"
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;     /* 0x00000a00ff017624 */
                                                                               /* 0x000fe400078e00ff */
        /*0010*/                   HMMA.16816.F32.BF16 R12, R8, R10, R12 ;     /* 0x0000000a080c723c */
                                                                               /* 0x000fe20000041820 */
"""


def test_sass_counts() -> None:
    funcs = ins.sass_opcodes(NVDISASM)
    assert list(funcs) == ["kern_a", "kern_b"]
    a, hist_a = ins.count_sass(funcs["kern_a"])
    b, _ = ins.count_sass(funcs["kern_b"])
    assert a["total"] == 10 and hist_a["MUFU"] == 2 and hist_a["NOP"] == 1
    assert (a["LDGSTS"], a["LDSM"], a["HMMA"], a["MUFU.EX2"], a["RED"], a["STL"], a["BAR"]) == (1,) * 7
    assert a["HGMMA"] == 0 and a["LDL"] == 0
    assert (b["USETMAXREG"], b["UTMALDG"], b["HGMMA"], b["RED"], b["SYNCS"]) == (1,) * 5
    assert b["ATOM"] == 0  # shared-memory atomics are not global adds
    c = ins.sass_opcodes(CUOBJDUMP)
    assert list(c) == ["kern_a"] and ins.count_sass(c["kern_a"])[0]["HMMA"] == 1
    assert ins.count_sass(c["kern_a"])[0]["total"] == 2  # encoding lines are not instructions


RES_USAGE = """
Resource usage:
 Common:
  GLOBAL:0
 Function kern_a:
  REG:255 STACK:56 SHARED:0 LOCAL:0 CONSTANT[0]:600 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function kern_b:
  REG:168 STACK:0 SHARED:1024 LOCAL:8 CONSTANT[0]:424 TEXTURE:0 SURFACE:0 SAMPLER:0
"""

# What remarks{ptx} prints on a spill: coloured, and the ptxas output re-wrapped inside a paragraph.
REMARKS_WRAPPED = (
    "\x1b[96mremark[ptxas]:\x1b[0m ptxas detected register spills\n\n  --> fwd.py:133:8\n"
    "          ptxas output:\n          ptxas info    : 0 bytes gmem\n"
    "          ptxas info    : Compiling entry function\n          'kern_a'\n          for 'sm_80'\n"
    "          ptxas info    : Function properties for\n          kern_a\n"
    "          ptxas         .     56 bytes stack frame, 96 bytes spill stores, 68 bytes spill loads\n"
    "          ptxas info    : Used 255 registers, used 1 barriers, 56 bytes cumulative stack size, 600\n"
    "          bytes cmem[0]\n"
)
REMARKS_PLAIN = (
    "\x1b[96mremark[ptxas info]:\x1b[0m ptxas output: ptxas info    : 0 bytes gmem\n"
    "ptxas info    : Compiling entry function 'kern_b' for 'sm_90a'\n"
    "ptxas info    : Function properties for kern_b\n"
    "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
    "ptxas info    : Used 168 registers, used 3 barriers, 424 bytes cmem[0]\n"
)


def test_res_usage_and_remarks() -> None:
    res = ins.parse_res_usage(RES_USAGE)
    assert res["kern_a"]["REG"] == 255 and res["kern_a"]["STACK"] == 56
    assert res["kern_b"]["SHARED"] == 1024 and res["kern_b"]["LOCAL"] == 8
    rem = ins.parse_ptxas_remarks(REMARKS_WRAPPED + REMARKS_PLAIN)
    assert rem["kern_a"] == {"stack_frame": 56, "spill_stores": 96, "spill_loads": 68, "registers": 255,
                             "barriers": 1}
    assert rem["kern_b"] == {"stack_frame": 0, "spill_stores": 0, "spill_loads": 0, "registers": 168,
                             "barriers": 3}


HOST_IR = """
  llvm.func @host(%arg0: i32) -> i32 {
    %7 = llvm.mlir.constant(1 : i32) : i32
    %9 = llvm.mlir.constant(65536 : i64) : i64
    %20 = llvm.alloca %7 x !llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)> : (i32) -> !llvm.ptr
    %26 = llvm.getelementptr %20[0, 2] : (!llvm.ptr) -> !llvm.ptr, !llvm.struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>
    llvm.store %9, %26 : i64, !llvm.ptr
    %90 = llvm.mlir.addressof @kernels_kern_a : !llvm.ptr
  }
"""  # noqa: E501  (IR lines are long)


def test_dynamic_smem_from_ir() -> None:
    assert ins.dynamic_smem_from_ir(HOST_IR) == {"kern_a": 65536}
    assert ins.dynamic_smem_from_ir("") == {}


def test_variants_name_the_kernels_the_launchers_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """``dispatch.configs_for`` (re-exported by the inspect tool): what a GPU of the variant's arch
    would launch, or the family the variant forces."""
    from cute_flash import dispatch
    from cute_flash.ampere.config import FwdConfig
    from cute_flash.hopper.fwd_config import FwdSm90Config

    assert ins.Variant is dispatch.Variant and ins.configs_for is dispatch.configs_for
    v = ins.Variant(arch="sm_90a", kernel="fwd", dtype="bf16", hdim=64, causal=True)
    (cfg,) = ins.configs_for(v)  # what an H200 runs: the Hopper forward
    assert isinstance(cfg, FwdSm90Config) and cfg.target == "sm_90a" and cfg.hdim == 64 and cfg.causal
    (cfg,) = ins.configs_for(dataclasses.replace(v, family="sm80"))  # CUTE_FLASH_FWD_KERNEL=sm80
    assert type(cfg) is FwdConfig and cfg.target == "sm_90a" and cfg.causal
    (cfg,) = ins.configs_for(dataclasses.replace(v, arch="sm_80"))
    assert type(cfg) is FwdConfig and cfg.target == "sm_80"
    with pytest.raises(ValueError, match="sm90 kernels compile for sm_90a only"):
        ins.configs_for(dataclasses.replace(v, arch="sm_80", family="sm90"))
    with pytest.raises(ValueError, match="family must be one of"):
        ins.configs_for(dataclasses.replace(v, family="fa3"))
    # The backward on Hopper: the FA3 main kernel + postprocess (sm80 preprocess) where it covers
    # the variant, else the sm80 code built for sm_90a -- as the launcher's auto mode picks.
    bwd = ins.configs_for(ins.Variant(arch="sm_90a", kernel="bwd", hdim=64))
    assert [type(c).__name__ for c in bwd] == ["BwdPreConfig", "BwdSm90Config", "BwdSm90PostConfig"]
    bwd = ins.configs_for(ins.Variant(arch="sm_90a", kernel="bwd", hdim=192, hdim_v=128))
    assert [type(c).__name__ for c in bwd] == ["BwdPreConfig", "BwdSm90Config", "BwdSm90PostConfig"]
    bwd = ins.configs_for(ins.Variant(arch="sm_90a", kernel="bwd", hdim=64, softcap=True))
    assert type(bwd[1]).__name__ == "BwdSm90Config" and bwd[1].tile_m == 64  # softcap: 64-query blocks
    bwd = ins.configs_for(ins.Variant(arch="sm_90a", kernel="bwd", hdim=128, hdim_v=64))
    assert bwd and all(c.target == "sm_90a" and "Sm90" not in type(c).__name__ for c in bwd)
    bwd = ins.configs_for(ins.Variant(arch="sm_90a", kernel="bwd", hdim=64, family="sm80"))
    assert all("Sm90" not in type(c).__name__ for c in bwd)
    # A non-causal d = 128 backward also names the long-sequence tile the launcher may take.
    bwd = ins.configs_for(ins.Variant(arch="sm_90a", kernel="bwd", hdim=128))
    assert sorted(c.tile_m for c in bwd if type(c).__name__ == "BwdSm90Config") == [64, 80]
    # e4m3: the FP8 forward path (quantize kernels + FP8 attention) on sm_90a only, every kernel
    # built for the variant's arch.
    for family in ("", "sm90"):
        fp8 = ins.configs_for(ins.Variant(arch="sm_90a", dtype="e4m3", family=family))
        assert [type(c).__name__ for c in fp8] == ["QuantizeConfig"] * 4 + ["FwdSm90Fp8Config"]
        assert all(c.target == "sm_90a" for c in fp8)
    for kw in (dict(kernel="bwd"), dict(arch="sm_80")):
        with pytest.raises(ValueError, match="e4m3"):
            ins.configs_for(ins.Variant(**{"arch": "sm_90a", "dtype": "e4m3", **kw}))
    with pytest.raises(ValueError, match="kernel must be fwd or bwd"):
        ins.configs_for(ins.Variant(arch="sm_90a", kernel="nope"))
    # Head dims the sm90 forward lacks fall back to sm80, as the launcher's auto mode does.
    from cute_flash.hopper import fwd_config

    monkeypatch.setattr(fwd_config, "SM90_FWD_TILES", {128: fwd_config.SM90_FWD_TILES[128]})
    (cfg,) = ins.configs_for(v)
    assert type(cfg) is FwdConfig


# ---------------------------------------------------------------------------------------------
# A real compile (sm80 forward, bf16, d=128): ~5 s, no GPU
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fwd_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    dump = tmp_path_factory.mktemp("dump")
    variant = ins.Variant(arch="sm_80", kernel="fwd", dtype="bf16", hdim=128)
    return ins.inspect_variant(variant, dump_dir=str(dump)), dump


def test_json_schema(fwd_report: tuple[dict, Path]) -> None:
    rep, _ = fwd_report
    rep = json.loads(json.dumps(rep))  # what --json prints: plain JSON types only
    for key, typ in (("arch", str), ("kernel", str), ("dtype", str), ("hdim", int), ("ptx", dict),
                     ("sass", dict), ("registers", int), ("spill_bytes", int), ("local_bytes", int),
                     ("smem_bytes", int), ("compile_s", float), ("kernels", list)):
        assert isinstance(rep[key], typ), key
    assert (rep["arch"], rep["kernel"], rep["dtype"], rep["hdim"]) == ("sm_80", "fwd", "bf16", 128)
    for key in ("mma.sync", "ldmatrix", "cp.async", "wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier",
                "setmaxnreg", "bar.sync", "bar.arrive", "ex2.approx", "red.global.add", "atom.global.add",
                "shfl.sync", "st.global", "ld.global"):
        assert isinstance(rep["ptx"][key], int), key
    assert len(rep["kernels"]) == 1
    k = rep["kernels"][0]
    for key in ("name", "function", "config", "ptx", "sass", "registers", "threads", "spill_bytes",
                "local_bytes", "smem_static", "smem_dynamic", "smem_bytes", "compile_s", "sass_opcodes"):
        assert key in k, key
    assert k["ptx"] == rep["ptx"]  # one kernel: totals are that kernel's counts


def test_sm80_fwd_counts(fwd_report: tuple[dict, Path]) -> None:
    rep, _ = fwd_report
    p = rep["ptx"]
    assert p["mma.sync"] > 0 and p["ldmatrix"] > 0 and p["cp.async"] > 0 and p["ex2.approx"] > 0
    assert p["wgmma.mma_async"] == 0 and p["cp.async.bulk.tensor"] == 0 and p["setmaxnreg"] == 0
    assert p["mbarrier"] == 0
    assert 0 < rep["registers"] <= 255
    assert rep["spill_bytes"] == 0 and rep["local_bytes"] == 0
    assert rep["kernels"][0]["threads"] in (128, 256)
    # Q tile plus K and V stages in bf16: at least (128 + 2*64) rows x 128 x 2 B, within sm80's 163 KiB.
    assert 48 * 1024 <= rep["smem_bytes"] <= 166912
    if ins.tools_dir() is None and not rep["sass"]:
        pytest.skip("no nvdisasm/cuobjdump: SASS not checked")
    s = rep["sass"]
    assert s["HMMA"] == p["mma.sync"]  # one m16n8k16 mma.sync is one HMMA.16816 on sm80
    assert s["LDSM"] > 0 and s["LDGSTS"] > 0 and s["MUFU.EX2"] > 0
    assert s["HGMMA"] == 0 and s["LDL"] == 0 and s["STL"] == 0


def test_dump(fwd_report: tuple[dict, Path]) -> None:
    _, dump = fwd_report
    exts = {f.suffix for f in dump.iterdir()}
    assert {".ptx", ".cubin", ".log"} <= exts
    ptx = next(dump.glob("*.ptx")).read_text()
    assert ".target sm_80" in ptx and "mma.sync" in ptx
    if ins.tools_dir() is not None:
        assert "HMMA" in next(dump.glob("*.sass")).read_text()


def test_mix_table(fwd_report: tuple[dict, Path]) -> None:
    rep, _ = fwd_report
    variant = dataclasses.asdict(ins.Variant(arch="sm_80", kernel="bwd"))
    err = {"variant": variant, "error": "RuntimeError: boom"}
    table = ins.mix_table([rep, err]).splitlines()
    assert len(table) == 4 and table[2].startswith("| sm_80 fwd bf16 d128 |") and "boom" in table[3]
    assert "registers" in ins.format_report(rep)


def test_cli_subprocess_sm90a_is_the_hopper_forward() -> None:
    """End to end through ``python -m cute_flash inspect --json``: on sm_90a the forward is the FA3
    kernel, and the report shows its Hopper machinery: wgmma, TMA, mbarrier waits, register
    reallocation both ways, named barriers (the epilogue's id 1), no local memory; SASS HGMMA and
    UTMALDG."""
    env = dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = ["inspect", "--arch", "sm_90a", "--kernel", "fwd", "--dtype", "bf16", "--hdim", "128", "--json"]
    proc = subprocess.run([sys.executable, "-m", "cute_flash", *cmd],
                          capture_output=True, text=True, env=env, cwd=PACKAGE_ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = json.loads(proc.stdout)  # exactly one JSON object on stdout
    assert (rep["arch"], rep["kernel"], rep["hdim"], rep["family"]) == ("sm_90a", "fwd", 128, "")
    assert rep["kernels"][0]["config"].startswith("fwd_sm90[sm_90a]")
    p = rep["ptx"]
    assert p["mma.sync"] == 0 and p["ldmatrix"] == 0 and p["cp.async"] == 0
    for key in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.wait", "setmaxnreg.inc",
                "setmaxnreg.dec", "bar.named", "ex2.approx"):
        assert p[key] > 0, key
    assert p["bar.named"] < p["bar.sync"] + p["bar.arrive"]  # the __syncthreads after the mbarrier inits
    assert p["ld.local"] == 0 and p["st.local"] == 0
    assert rep["spill_bytes"] == 0 and rep["local_bytes"] == 0
    assert rep["kernels"][0]["threads"] == 128 * 3  # producer + two consumer warpgroups
    if ins.tools_dir() is None and not rep["sass"]:
        pytest.skip("no nvdisasm/cuobjdump: SASS not checked")
    s = rep["sass"]
    assert s["HGMMA"] > 0 and s["UTMALDG"] > 0 and s["USETMAXREG"] == 2
    assert s["HMMA"] == 0 and s["LDL"] == 0 and s["STL"] == 0


def test_sm80_family_on_sm90a_and_the_mix_table(capsys: pytest.CaptureFixture[str]) -> None:
    """``--family sm80`` inspects the FA2 forward built for sm_90a (what CUTE_FLASH_FWD_KERNEL=sm80
    runs on an H200); the mix table labels the family and has the Hopper columns."""
    import argparse

    p = argparse.ArgumentParser()
    ins.add_arguments(p)
    args = p.parse_args(["--arch", "sm_90a", "--family", "sm80", "--hdim", "64", "--causal", "--json"])
    assert ins.main(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["family"] == "sm80" and rep["ptx"]["mma.sync"] > 0 and rep["ptx"]["wgmma.mma_async"] == 0
    assert rep["spill_bytes"] == 0
    table = ins.mix_table([rep]).splitlines()
    for col in ("| wgmma |", "| tma |", "| mbar.wait |", "| nreg+ |", "| nreg- |", "| bar.named |",
                "| HGMMA |", "| UTMALDG |"):
        assert col in table[0], col
    assert table[2].startswith("| sm_90a fwd[sm80] bf16 d64 causal |")


def test_bwd_several_kernels() -> None:
    """A backward variant is several kernels (preprocess, main, postprocess): per-kernel details, and
    totals that are sums (counts, spills) or maxima (registers, smem) over them."""
    rep = ins.inspect_variant(ins.Variant(arch="sm_80", kernel="bwd", dtype="bf16", hdim=64))
    ks = rep["kernels"]
    assert len(ks) >= 2 and len({k["name"] for k in ks}) == len(ks)
    for key in rep["ptx"]:
        assert rep["ptx"][key] == sum(k["ptx"][key] for k in ks), key
    assert rep["registers"] == max(k["registers"] for k in ks)
    assert rep["smem_bytes"] == max(k["smem_bytes"] for k in ks)
    assert rep["spill_bytes"] == sum(k["spill_bytes"] for k in ks)
    assert rep["ptx"]["mma.sync"] > 0 and rep["ptx"]["wgmma.mma_async"] == 0
    assert rep["compile_s"] > 0


def test_cli_rejects_an_unsupported_head_dim_with_the_supported_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    from cute_flash.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["inspect", "--arch", "sm_90a", "--hdim", "100"])
    assert exc.value.code == 2
    assert "invalid choice: 100 (choose from 32, 64, 96, 128, 160, 192, 256)" in capsys.readouterr().err
