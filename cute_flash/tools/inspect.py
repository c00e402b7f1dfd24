"""Compile a kernel variant without a GPU and report what the compiler made of it.

``python -m cute_flash inspect --arch sm_80 --kernel fwd --dtype bf16 --hdim 128 [--causal] [--json]``
prints, per compiled kernel function: registers per thread, spill / local-memory bytes, shared
memory, the instructions that decide attention performance (tensor-core MMAs, async copies,
barriers, exponentials, ...) in PTX and SASS, and compile time.

Why this exists: most performance bugs (a spill, a missing ``ldmatrix``, scalar instead of 16-byte
loads, an accidental local array) are visible in the compiler output alone, without a GPU.

Which configs a variant compiles is ``dispatch.configs_for``: the kernels the launchers run on
such a GPU (on ``sm_90a`` the Hopper FA3 kernels where they cover the variant, else the sm80 code
compiled for sm_90a); ``--family sm80`` / ``sm90`` force one family.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from cute_flash import jit
from cute_flash.dispatch import FAMILIES, Variant, configs_for
from cute_flash.validate import SUPPORTED_HEAD_DIMS

KERNELS = ("fwd", "bwd")
DTYPES = ("bf16", "fp16", "e4m3")

# ---------------------------------------------------------------------------------------------
# PTX
# ---------------------------------------------------------------------------------------------
def _is_cp_async_nonbulk(op: str) -> bool:
    parts = op.split(".")
    return len(parts) > 2 and parts[0] == "cp" and parts[1] == "async" and parts[2] in ("ca", "cg")


def _is_global_add(op: str, base: str) -> bool:
    # red/atom without a state space address generic memory, which in our kernels is global.
    parts = op.split(".")
    return parts[0] == base and "add" in parts and "shared" not in parts and "shared::cta" not in op


def _bar_kind(op: str) -> str | None:
    """'sync', 'arrive', 'red', ... of a CTA barrier (``bar``/``barrier``, optionally ``.cta``);
    None for anything else (``bar.warp.sync`` is a warp-level op: 'warp')."""
    parts = op.split(".")
    if parts[0] not in ("bar", "barrier"):
        return None
    rest = [p for p in parts[1:] if p != "cta"]
    return rest[0] if rest else "sync"  # plain 'bar' / 'barrier' is bar.sync


def _is_named_barrier(op: str, args: str) -> bool:
    # Barrier 0 is __syncthreads; any other id (a literal > 0, or an id in a register, which our
    # kernels compute only for the ping-pong barriers) is a named barrier between some warps.
    if _bar_kind(op) not in ("sync", "arrive", "red"):
        return False
    first = args.split(",", 1)[0].strip()
    try:
        return int(first, 0) != 0
    except ValueError:
        return bool(first)


# (key, predicate on the full opcode) in display order. Each is an instruction count in the PTX text
# (static, not executed counts); a key may match opcodes that differ only in modifiers.
PTX_COUNTERS: tuple[tuple[str, Callable[[str], bool]], ...] = (
    ("mma.sync", lambda op: op.startswith("mma.sync")),
    ("wgmma.mma_async", lambda op: op.startswith("wgmma.mma_async")),
    ("wgmma.fence", lambda op: op.startswith("wgmma.fence")),
    ("wgmma.commit_group", lambda op: op.startswith("wgmma.commit_group")),
    ("wgmma.wait_group", lambda op: op.startswith("wgmma.wait_group")),
    ("ldmatrix", lambda op: op.startswith("ldmatrix")),
    ("stmatrix", lambda op: op.startswith("stmatrix")),
    ("cp.async", _is_cp_async_nonbulk),
    ("cp.async.commit_group", lambda op: op.startswith("cp.async.commit_group")),
    ("cp.async.wait_group", lambda op: op.startswith(("cp.async.wait_group", "cp.async.wait_all"))),
    ("cp.async.bulk.tensor", lambda op: op.startswith("cp.async.bulk.tensor")),
    ("cp.reduce.async.bulk", lambda op: op.startswith("cp.reduce.async.bulk")),
    ("mbarrier", lambda op: op.startswith("mbarrier.")),
    ("mbarrier.wait", lambda op: op.startswith(("mbarrier.try_wait", "mbarrier.test_wait"))),
    ("setmaxnreg", lambda op: op.startswith("setmaxnreg")),
    ("setmaxnreg.inc", lambda op: op.startswith("setmaxnreg.inc")),
    ("setmaxnreg.dec", lambda op: op.startswith("setmaxnreg.dec")),
    ("bar.sync", lambda op: _bar_kind(op) == "sync"),
    ("bar.arrive", lambda op: _bar_kind(op) == "arrive"),
    ("fence.proxy.async", lambda op: op.startswith("fence.proxy.async")),
    ("ex2.approx", lambda op: op.startswith("ex2.approx")),
    ("red.global.add", lambda op: _is_global_add(op, "red")),
    ("atom.global.add", lambda op: _is_global_add(op, "atom")),
    ("shfl.sync", lambda op: op.startswith("shfl.sync")),
    ("ld.global", lambda op: op.startswith("ld.global")),
    ("st.global", lambda op: op.startswith("st.global")),
    ("ld.shared", lambda op: op.startswith("ld.shared")),
    ("st.shared", lambda op: op.startswith("st.shared")),
    # Local memory in the PTX itself means an array the front end could not keep in registers.
    ("ld.local", lambda op: op.startswith("ld.local")),
    ("st.local", lambda op: op.startswith("st.local")),
    ("cvt.e4m3", lambda op: op.startswith("cvt") and "e4m3" in op),
)
# Counters that need the operands too: (key, predicate on (opcode, operand text)).
PTX_OPERAND_COUNTERS: tuple[tuple[str, Callable[[str, str], bool]], ...] = (
    ("bar.named", _is_named_barrier),  # bar.sync/arrive/red with an id other than 0
)
PTX_KEYS = tuple(k for k, _ in PTX_COUNTERS) + tuple(k for k, _ in PTX_OPERAND_COUNTERS)

_PTX_ENTRY = re.compile(
    r"^\s*(?:\.visible\s+|\.weak\s+|\.extern\s+)*\.(entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)")
_PTX_PRED = re.compile(r"^@!?%\w+\s+")


def ptx_opcodes(ptx: str) -> dict[str, list[str]]:
    """Instruction opcodes of each ``.entry``/``.func`` in ``ptx``, in order."""
    return {name: [i.split(None, 1)[0] for i in insns] for name, insns in ptx_instructions(ptx).items()}


def ptx_instructions(ptx: str) -> dict[str, list[str]]:
    """Instructions (opcode and operands, without predicate, comment and ';') of each
    ``.entry``/``.func`` in ``ptx``, in order."""
    funcs: dict[str, list[str]] = {}
    current: list[str] | None = None
    for raw in ptx.splitlines():
        line = raw.split("//", 1)[0].strip()
        if not line:
            continue
        m = _PTX_ENTRY.match(line)
        if m:
            current = funcs.setdefault(m.group(2), [])
            continue
        if current is None or line[0] in ".{}(),)" or line.endswith(":"):
            continue  # directives, braces, parameter lists, labels
        line = _PTX_PRED.sub("", line).rstrip(";").strip()
        if line and line[0].isalpha():
            current.append(line)
    return funcs


def count_ptx(instructions: Iterable[str]) -> dict[str, int]:
    """Counts of ``PTX_KEYS`` over instructions (``ptx_instructions``) or bare opcodes
    (``ptx_opcodes``; then the operand-aware counters see no operands)."""
    counts = dict.fromkeys(PTX_KEYS, 0)
    for insn in instructions:
        parts = insn.split(None, 1)
        op, args = parts[0].rstrip(";"), (parts[1] if len(parts) > 1 else "")
        for key, pred in PTX_COUNTERS:
            if pred(op):
                counts[key] += 1
        for key, pred2 in PTX_OPERAND_COUNTERS:
            if pred2(op, args):
                counts[key] += 1
    return counts


def ptx_threads(ptx: str) -> dict[str, int]:
    """Threads per block of each entry from ``.reqntid`` (the DSL emits it for static block sizes)."""
    out: dict[str, int] = {}
    name = None
    for line in ptx.splitlines():
        m = _PTX_ENTRY.match(line)
        if m:
            name = m.group(2)
        r = re.match(r"^\s*\.reqntid\s+(\d+)(?:\s*,\s*(\d+))?(?:\s*,\s*(\d+))?", line)
        if r and name:
            out[name] = int(r.group(1)) * int(r.group(2) or 1) * int(r.group(3) or 1)
    return out


# ---------------------------------------------------------------------------------------------
# SASS and resource usage (nvdisasm / cuobjdump from the pip packages; no CUDA toolkit needed)
# ---------------------------------------------------------------------------------------------
# Display order; each key is a base opcode (before the first '.') unless it contains a '.', in which
# case it is an opcode prefix (MUFU.EX2). Several bases fold into one key (see _SASS_ALIASES).
SASS_KEYS = ("HMMA", "HGMMA", "QGMMA", "LDSM", "STSM", "LDGSTS", "UTMALDG", "UTMASTG", "UTMAREDG",
             "UBLKCP", "LDL", "STL", "MUFU.EX2", "RED", "ATOM", "BAR", "USETMAXREG", "SYNCS", "WARPGROUP",
             "LDG", "STG", "LDS", "STS", "SHFL")
# sm80 global atomics disassemble as RED/ATOM, sm90 as REDG/ATOMG; shared atomics (ATOMS) stay out.
_SASS_ALIASES = {"REDG": "RED", "ATOMG": "ATOM"}

_SASS_INSN = re.compile(
    r"^\s*/\*[0-9a-fA-F]{4,}\*/\s+(?:@!?U?P(?:T|\d+)\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)")
_SASS_FUNC = (re.compile(r"^\s*Function\s*:\s*(\S+)"), re.compile(r"^\.text\.(\S+):\s*$"))
_SASS_FULL_INSN = re.compile(r"^\s*/\*[0-9a-fA-F]{4,}\*/\s+([^;]*;)")
_SASS_LABEL = re.compile(r"^\.L_x_\d+:\s*$")


def tools_dir() -> str | None:
    """Directory of nvdisasm/cuobjdump: the pip wheels' ``nvidia/cu13/bin``, else ``PATH``."""
    try:
        import nvidia  # namespace package of the pip CUDA wheels

        for root in nvidia.__path__:
            for sub in ("cu13", "cuda_nvdisasm", "cuda_cuobjdump"):
                d = os.path.join(root, sub, "bin")
                if any(os.path.exists(os.path.join(d, t)) for t in ("cuobjdump", "nvdisasm")):
                    return d
    except ImportError:
        pass
    return None


def _tool(name: str) -> str | None:
    d = tools_dir()
    if d and os.path.exists(os.path.join(d, name)):
        return os.path.join(d, name)
    return shutil.which(name)


def _run_tool(name: str, args: Sequence[str]) -> str | None:
    exe = _tool(name)
    if exe is None:
        return None
    proc = subprocess.run([exe, *args], capture_output=True, text=True, check=False)
    return proc.stdout if proc.returncode == 0 else None


def disassemble(cubin_path: str) -> str | None:
    """SASS text of every function in the cubin (nvdisasm, else cuobjdump -sass); None without tools."""
    out = _run_tool("nvdisasm", ["-c", cubin_path])
    if out is None:
        out = _run_tool("cuobjdump", ["-sass", cubin_path])
    return out


def sass_opcodes(sass: str) -> dict[str, list[str]]:
    """Full SASS opcodes (with modifiers) of each function in an nvdisasm or cuobjdump listing."""
    funcs: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in sass.splitlines():
        for pat in _SASS_FUNC:
            m = pat.match(line)
            if m:
                current = funcs.setdefault(m.group(1), [])
                break
        else:
            m = _SASS_INSN.match(line)
            if m and current is not None:
                current.append(m.group(1))
    return funcs


def sass_digests(sass: str) -> list[str]:
    """SHA-256 of each function's instruction stream (opcodes, operands and branch labels, without
    addresses, encodings or symbol names), sorted: equal lists mean the same machine code whatever
    the kernels' module paths or mangled names."""
    import hashlib

    digests, current = [], None
    for line in sass.splitlines():
        if any(pat.match(line) for pat in _SASS_FUNC):
            if current is not None:
                digests.append(current.hexdigest())
            current = hashlib.sha256()
            continue
        if current is None:
            continue
        m = _SASS_FULL_INSN.match(line)
        if m:
            current.update(m.group(1).encode() + b"\n")
        elif _SASS_LABEL.match(line):
            current.update(line.strip().encode() + b"\n")
    if current is not None:
        digests.append(current.hexdigest())
    return sorted(digests)


def count_sass(opcodes: Iterable[str]) -> tuple[dict[str, int], dict[str, int]]:
    """(counts of SASS_KEYS plus 'total', histogram of base opcodes)."""
    hist: Counter[str] = Counter()
    counts = dict.fromkeys(SASS_KEYS, 0)
    total = 0
    for op in opcodes:
        total += 1
        base = op.split(".", 1)[0]
        hist[base] += 1
        key = _SASS_ALIASES.get(base, base)
        if key in counts:
            counts[key] += 1
        if op.startswith("MUFU.EX2"):
            counts["MUFU.EX2"] += 1
    counts["total"] = total
    return counts, dict(hist.most_common())


def parse_res_usage(text: str) -> dict[str, dict[str, int]]:
    """Parse ``cuobjdump -res-usage``: per function REG, STACK, SHARED (static), LOCAL, ..."""
    res: dict[str, dict[str, int]] = {}
    name = None
    for line in text.splitlines():
        m = re.match(r"^\s*Function\s+([^\s:]+)\s*:", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            res[name] = {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line)}
            name = None
    return res


def resource_usage(cubin_path: str) -> dict[str, dict[str, int]]:
    """``cuobjdump -res-usage`` of a cubin, parsed; empty without cuobjdump."""
    out = _run_tool("cuobjdump", ["-res-usage", cubin_path])
    return parse_res_usage(out) if out else {}


def parse_ptxas_remarks(log: str) -> dict[str, dict[str, int]]:
    """ptxas ``-v`` style lines from ``remarks{ptx}``: per function stack frame, spill stores/loads,
    registers and barriers."""
    # The DSL word-wraps and colours its remarks (a spill remark re-indents the ptxas output inside a
    # paragraph), so strip ANSI codes, collapse all whitespace and scan the text as one stream.
    text = re.sub(r"\s+", " ", re.sub(r"\x1b\[[0-9;]*m", "", log))
    events = re.compile(
        r"Compiling entry function '(?P<entry>[^']+)'"
        r"|Function properties for (?P<props>[\w$]+)"
        r"|(?P<stack>\d+) bytes stack frame, (?P<st>\d+) bytes spill stores, (?P<ld>\d+) bytes spill loads"
        r"|Used (?P<regs>\d+) registers(?:, used (?P<bars>\d+) barriers)?")
    out: dict[str, dict[str, int]] = {}
    name = None
    for m in events.finditer(text):
        if m.group("entry") or m.group("props"):
            name = m.group("entry") or m.group("props")
            out.setdefault(name, {})
        elif name is None:
            continue
        elif m.group("stack"):
            out[name].update(stack_frame=int(m.group("stack")), spill_stores=int(m.group("st")),
                             spill_loads=int(m.group("ld")))
        elif m.group("regs"):
            out[name]["registers"] = int(m.group("regs"))
            if m.group("bars"):
                out[name]["barriers"] = int(m.group("bars"))
    return out


# ---------------------------------------------------------------------------------------------
# Dynamic shared memory
# ---------------------------------------------------------------------------------------------
# The DSL sums the kernel's SmemAllocator requests at trace time and stores the total as a constant
# into the launch-config struct {grid[3], block[3], i64 smem, stream, attrs, nattrs} that the host
# code hands to cudaLaunchKernelEx. The lowered host IR is the only place that number survives, so
# read it there: constant -> store into field 2 of that struct -> the next kernel address taken.
_LAUNCH_STRUCT = "struct<(array<3 x i32>, array<3 x i32>, i64, ptr, ptr, i32)>"
_IR_CONST = re.compile(r"(%\w+) = llvm\.mlir\.constant\((\d+) : i64\)")
_IR_GEP = re.compile(r"(%\w+) = llvm\.getelementptr (%\w+)\[0, 2\] .*" + re.escape(_LAUNCH_STRUCT))
_IR_STORE = re.compile(r"llvm\.store (%\w+), (%\w+) : i64")
_IR_KERNEL = re.compile(r"llvm\.mlir\.addressof @kernels_(\w+)")
_IR_FUNC = re.compile(r"^\s*llvm\.func ")


def dynamic_smem_from_ir(ir_text: str) -> dict[str, int]:
    """{kernel function name: dynamic smem bytes} for launches whose size is a compile-time constant."""
    out: dict[str, int] = {}
    consts: dict[str, int] = {}
    geps: set[str] = set()
    pending: int | None = None
    for line in ir_text.splitlines():
        if _IR_FUNC.match(line):
            consts, geps, pending = {}, set(), None  # SSA names are per function
            continue
        m = _IR_CONST.search(line)
        if m:
            consts[m.group(1)] = int(m.group(2))
            continue
        m = _IR_GEP.search(line)
        if m:
            geps.add(m.group(1))
            continue
        m = _IR_STORE.search(line)
        if m and m.group(2) in geps:
            pending = consts.get(m.group(1))
            continue
        m = _IR_KERNEL.search(line)
        if m and pending is not None:
            out[m.group(1)] = pending
            pending = None
    return out


def _smem_from_kernel_object(obj: Any) -> int | None:
    """Fallback: a ``cute.struct`` the kernel object kept (``self.shared_storage = Smem`` pattern)."""
    sizes = []
    for v in vars(obj).values() if hasattr(obj, "__dict__") else ():
        f = getattr(v, "size_in_bytes", None)
        if callable(f):
            with contextlib.suppress(Exception):
                sizes.append(int(f()))
    return max(sizes) if sizes else None


# ---------------------------------------------------------------------------------------------
# Compile and report
# ---------------------------------------------------------------------------------------------
@dataclass
class Compiled:
    ptx: str
    cubin: bytes
    log: str  # compiler diagnostics (ptxas remarks) captured from stderr
    dyn_smem: dict[str, int]
    obj_smem: int | None
    compile_s: float


def compile_config(cfg: jit.KernelConfig) -> Compiled:
    """Compile ``cfg`` for inspection: PTX, cubin, ptxas remarks, launch smem, compile time.

    Uses ``jit._options`` so the code is the same as what ``jit.compile_kernel`` builds, but compiles
    on its own (the compile time is the point; the runtime cache is left alone), into a temporary
    dump directory (the DSL writes kept artefacts to the CWD otherwise), with ``remarks{ptx}`` (the
    only way to get ptxas's spill report out of the in-process compiler).
    """
    import cutlass.cute as cute

    with tempfile.TemporaryDirectory(prefix="cute_flash_inspect_") as tmp:
        # jit's own options (target, TVM-FFI) without its keep/dump flags, then ours.
        opts = f"{jit._options(cfg, keep=False)} --keep-ptx --keep-cubin --dump-dir {tmp} remarks{{ptx}}"
        obj = cfg.build()
        args = cfg.fake_args()
        err = io.StringIO()
        t0 = time.perf_counter()
        with contextlib.redirect_stderr(err):
            fn = cute.compile(obj, *args, options=opts)
        compile_s = time.perf_counter() - t0
        ptx, cubin = fn.artifacts.PTX, fn.artifacts.CUBIN
        if not isinstance(ptx, str) or not isinstance(cubin, bytes):
            raise RuntimeError(f"compile of {cfg.describe()} kept no PTX/cubin")
        try:
            dyn = dynamic_smem_from_ir(str(fn.ir_module))
        except Exception:  # the IR is a debugging aid here, never a reason to fail
            dyn = {}
    return Compiled(ptx=ptx, cubin=cubin, log=err.getvalue(), dyn_smem=dyn,
                    obj_smem=_smem_from_kernel_object(obj), compile_s=compile_s)


@dataclass
class KernelReport:
    """One kernel function of one compiled config."""

    name: str  # config kernel_name, '#i' appended when a cubin holds several functions
    function: str  # mangled name in the cubin
    config: str  # cfg.describe()
    ptx: dict[str, int]
    sass: dict[str, int]
    registers: int | None
    threads: int | None
    spill_bytes: int | None  # spill stores + spill loads (ptxas remarks); local_bytes without remarks
    spill_stores: int | None
    spill_loads: int | None
    stack_bytes: int | None
    local_bytes: int | None  # stack frame + LOCAL
    smem_static: int | None
    smem_dynamic: int | None
    smem_bytes: int | None
    compile_s: float  # of the whole config (shared by its functions)
    sass_opcodes: dict[str, int] = field(default_factory=dict)


def _lookup_kernel(name: str, table: dict[str, Any]) -> Any:
    # The host IR names a kernel as in the cubin (after its 'kernels_' module prefix), so an exact
    # match is the rule; a suffix/prefix match covers a name decorated differently by a DSL update.
    if name in table:
        return table[name]
    for k, v in table.items():
        if k.endswith(name) or name.endswith(k):
            return v
    return None


def cubin_sass_and_usage(cubin: bytes) -> tuple[str | None, dict[str, dict[str, int]]]:
    """(SASS text or None without cuobjdump, per-function resource usage) of a cubin in memory."""
    with tempfile.TemporaryDirectory(prefix="cute_flash_cubin_") as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return disassemble(path), resource_usage(path)


def report_config(cfg: jit.KernelConfig, compiled: Compiled,
                  dump_dir: str | None = None) -> list[KernelReport]:
    """Per-function reports of one compiled config; optionally writes PTX/SASS/log to ``dump_dir``."""
    ptx_funcs = ptx_instructions(compiled.ptx)
    threads = ptx_threads(compiled.ptx)
    remarks = parse_ptxas_remarks(compiled.log)
    sass, res = cubin_sass_and_usage(compiled.cubin)
    sass_funcs = sass_opcodes(sass) if sass else {}

    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        stem = os.path.join(dump_dir, _file_stem(cfg))
        with open(stem + ".ptx", "w") as f:
            f.write(compiled.ptx)
        with open(stem + ".cubin", "wb") as f:
            f.write(compiled.cubin)
        if sass:
            with open(stem + ".sass", "w") as f:
                f.write(sass)
        with open(stem + ".log", "w") as f:
            f.write(compiled.log)

    names = list(ptx_funcs) or list(sass_funcs) or list(res)
    entries = [n for n in names if n in threads] or names
    reports = []
    for i, fname in enumerate(entries):
        r = res.get(fname, {})
        rem = remarks.get(fname, {})
        sass_counts, hist = count_sass(sass_funcs.get(fname, []))
        if not sass_funcs:
            sass_counts = {}
        dyn = _lookup_kernel(fname, compiled.dyn_smem)
        if dyn is None and len(entries) == 1:
            dyn = compiled.obj_smem
        static = r.get("SHARED")
        spill_st, spill_ld = rem.get("spill_stores"), rem.get("spill_loads")
        # Per-thread local memory: the ABI stack frame (spills and dynamically indexed arrays live
        # there in DSL kernels) plus non-stack LOCAL; either is a performance bug in these kernels.
        stack = r.get("STACK", rem.get("stack_frame"))
        local = None if stack is None and "LOCAL" not in r else (stack or 0) + r.get("LOCAL", 0)
        if spill_st is not None and spill_ld is not None:
            spill = spill_st + spill_ld
        else:
            spill = local  # spills land in local memory; no remarks -> the best proxy we have
        regs = r.get("REG", rem.get("registers"))
        reports.append(KernelReport(
            name=cfg.kernel_name if len(entries) == 1 else f"{cfg.kernel_name}#{i}",
            function=fname, config=cfg.describe(), ptx=count_ptx(ptx_funcs.get(fname, [])),
            sass=sass_counts, registers=regs, threads=threads.get(fname), spill_bytes=spill,
            spill_stores=spill_st, spill_loads=spill_ld, stack_bytes=stack,
            local_bytes=local, smem_static=static, smem_dynamic=dyn,
            smem_bytes=(static or 0) + (dyn or 0) if static is not None or dyn is not None else None,
            compile_s=compiled.compile_s, sass_opcodes=hist))
    return reports


def _file_stem(cfg: jit.KernelConfig) -> str:
    fields = [f"{k}{v}" for k, v in cfg.__dict__.items() if k != "target" and v not in (False, None)]
    s = "_".join([cfg.kernel_name, str(cfg.target), *fields])
    return re.sub(r"[^\w.=-]+", "", s.replace(", ", "x").replace("(", "").replace(")", ""))[:150]


def _sum_dicts(ds: Sequence[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def _max_opt(vals: Iterable[int | None]) -> int | None:
    vs = [v for v in vals if v is not None]
    return max(vs) if vs else None


def _sum_opt(vals: Iterable[int | None]) -> int | None:
    vs = list(vals)
    return None if any(v is None for v in vs) or not vs else sum(vs)  # type: ignore[arg-type]


def inspect_variant(variant: Variant, dump_dir: str | None = None) -> dict[str, Any]:
    """Compile every config of ``variant`` and return the report as a JSON-ready dict.

    Totals: PTX/SASS counts and spill/local bytes are summed over kernels, registers and smem are the
    maximum over kernels, compile time is the sum (one process, one config after another).
    """
    cfgs = configs_for(variant)
    kernels: list[KernelReport] = []
    compile_total = 0.0
    for cfg in cfgs:
        compiled = compile_config(cfg)
        compile_total += compiled.compile_s
        kernels.extend(report_config(cfg, compiled, dump_dir))
    return {
        "arch": variant.arch,
        "kernel": variant.kernel,
        "dtype": variant.dtype,
        "hdim": variant.hdim,
        "hdim_v": variant.dv,
        "causal": variant.causal,
        "local": variant.local,
        "softcap": variant.softcap,
        "varlen": variant.varlen,
        "deterministic": variant.deterministic,
        "family": variant.family,
        "ptx": _sum_dicts([k.ptx for k in kernels]),
        "sass": _sum_dicts([k.sass for k in kernels]),
        "registers": _max_opt(k.registers for k in kernels),
        "spill_bytes": _sum_opt(k.spill_bytes for k in kernels),
        "local_bytes": _sum_opt(k.local_bytes for k in kernels),
        "smem_bytes": _max_opt(k.smem_bytes for k in kernels),
        "compile_s": round(compile_total, 3),
        "kernels": [asdict(k) for k in kernels],
    }


def _inspect_worker(variant: Variant) -> dict[str, Any]:
    try:
        return inspect_variant(variant)
    except Exception as e:  # report, don't kill the pool: the caller decides what a failure means
        return {"variant": asdict(variant), "error": f"{type(e).__name__}: {e}"}


def inspect_many(variants: Sequence[Variant], workers: int | None = None) -> list[dict[str, Any]]:
    """Inspect several variants, in parallel processes when ``workers`` > 1 (compiling is CPU-bound and
    holds the GIL for long stretches, so threads would not help). Failures come back as
    ``{"variant", "error"}`` entries in input order rather than raising."""
    workers = min(len(variants), workers if workers is not None else (os.cpu_count() or 1))
    if workers <= 1:
        return [_inspect_worker(v) for v in variants]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the parent may already hold an MLIR context and its threads.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_inspect_worker, variants))


# ---------------------------------------------------------------------------------------------
# Text output
# ---------------------------------------------------------------------------------------------
# (column header, key) of the instruction-mix table; PTX counts in lower case, SASS in upper case.
_TABLE_PTX = (("mma", "mma.sync"), ("wgmma", "wgmma.mma_async"), ("ldmatrix", "ldmatrix"),
              ("cp.async", "cp.async"), ("tma", "cp.async.bulk.tensor"), ("mbar.wait", "mbarrier.wait"),
              ("nreg+", "setmaxnreg.inc"), ("nreg-", "setmaxnreg.dec"), ("bar.sync", "bar.sync"),
              ("bar.named", "bar.named"), ("ex2", "ex2.approx"), ("red", "red.global.add"),
              ("bulk.red", "cp.reduce.async.bulk"), ("shfl", "shfl.sync"), ("ld.g", "ld.global"),
              ("st.g", "st.global"))
_TABLE_SASS = (("HMMA", "HMMA"), ("HGMMA", "HGMMA"), ("LDSM", "LDSM"), ("LDGSTS", "LDGSTS"),
               ("UTMALDG", "UTMALDG"), ("EX2", "MUFU.EX2"), ("RED", "RED"), ("BAR", "BAR"), ("LDL", "LDL"),
               ("STL", "STL"))


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def mix_table(reports: Sequence[dict[str, Any]]) -> str:
    """Markdown table, one row per kernel function of each report (error rows keep their place).
    Lower-case instruction columns are PTX counts, upper-case ones SASS counts (static, per kernel)."""
    head = ["variant", "kernel", "regs", "spill", "local", "smem KiB", "thr", "compile s",
            *[h for h, _ in _TABLE_PTX], *[h for h, _ in _TABLE_SASS]]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rep in reports:
        if "error" in rep:
            v = Variant(**rep["variant"])
            rows.append(f"| {v.label()} | ERROR: {rep['error'][:200]} |")
            continue
        v = Variant(**{k: rep[k] for k in asdict(Variant()).keys()})
        for k in rep["kernels"]:
            smem = k["smem_bytes"]
            cells = [v.label(), k["name"], _fmt(k["registers"]), _fmt(k["spill_bytes"]),
                     _fmt(k["local_bytes"]), "-" if smem is None else f"{smem / 1024:.1f}",
                     _fmt(k["threads"]), f"{k['compile_s']:.1f}",
                     *[_fmt(k["ptx"].get(p)) for _, p in _TABLE_PTX],
                     *[_fmt(k["sass"].get(s)) for _, s in _TABLE_SASS]]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _key_count(k: dict[str, Any], sass_keys: Sequence[str], ptx_keys: Sequence[str]) -> str:
    """Sum of SASS counts when the cubin was disassembled, else of the PTX counts (marked ``*``)."""
    if k["sass"]:
        return str(sum(k["sass"].get(x, 0) for x in sass_keys))
    return f"{sum(k['ptx'].get(x, 0) for x in ptx_keys)}*"


def summary_table(reports: Sequence[dict[str, Any]]) -> str:
    """A newcomer's table, one row per kernel: registers, spills, shared memory and the
    instructions that decide attention speed (tensor-core MMAs, asynchronous copies, MUFU
    exponentials). ``mix_table`` and ``format_report`` have the rest."""
    head = ["variant", "kernel", "regs", "spill B", "smem KiB", "MMA", "async copy", "exp2"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rep in reports:
        if "error" in rep:
            rows.append(f"| {Variant(**rep['variant']).label()} | ERROR: {rep['error'][:200]} |")
            continue
        v = Variant(**{k: rep[k] for k in asdict(Variant()).keys()})
        for k in rep["kernels"]:
            smem = k["smem_bytes"]
            rows.append("| " + " | ".join([
                v.label(), k["name"], _fmt(k["registers"]), _fmt(k["spill_bytes"]),
                "-" if smem is None else f"{smem / 1024:.1f}",
                _key_count(k, ("HMMA", "HGMMA", "QGMMA"), ("mma.sync", "wgmma.mma_async")),
                _key_count(k, ("LDGSTS", "UTMALDG"), ("cp.async", "cp.async.bulk.tensor")),
                _key_count(k, ("MUFU.EX2",), ("ex2.approx",))]) + " |")
    return "\n".join(rows)


def format_report(rep: dict[str, Any]) -> str:
    """Human-readable report of one variant."""
    v = Variant(**{k: rep[k] for k in asdict(Variant()).keys()})
    lines = [f"{v.label()}: {len(rep['kernels'])} kernel(s), compile {rep['compile_s']:.1f} s"]
    for k in rep["kernels"]:
        smem = "-" if k["smem_bytes"] is None else (
            f"{k['smem_bytes']} B (static {_fmt(k['smem_static'])} + dynamic {_fmt(k['smem_dynamic'])})")
        lines += [
            "",
            f"[{k['name']}] {k['config']}",
            f"  function   {k['function'][:120]}{'...' if len(k['function']) > 120 else ''}",
            f"  threads {_fmt(k['threads'])}  registers {_fmt(k['registers'])}  "
            f"spill {_fmt(k['spill_bytes'])} B (stores {_fmt(k['spill_stores'])}, "
            f"loads {_fmt(k['spill_loads'])})  stack {_fmt(k['stack_bytes'])} B  "
            f"local {_fmt(k['local_bytes'])} B",
            f"  smem {smem}",
            "  PTX   " + "  ".join(f"{p}={n}" for p, n in k["ptx"].items() if n),
            "  SASS  " + ("  ".join(f"{s}={n}" for s, n in k["sass"].items() if n)
                          or "(no nvdisasm/cuobjdump)"),
        ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def add_arguments(p: Any) -> None:
    """Arguments of ``python -m cute_flash inspect`` (shared with the top-level parser)."""
    p.add_argument("--arch", choices=jit.ARCHS, default="sm_80")
    p.add_argument("--kernel", choices=KERNELS, default="fwd")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--hdim", type=int, default=128, choices=SUPPORTED_HEAD_DIMS, metavar="D",
                   help=f"head dim, one of {', '.join(map(str, SUPPORTED_HEAD_DIMS))} (default: 128)")
    p.add_argument("--hdim-v", type=int, default=None, choices=SUPPORTED_HEAD_DIMS, metavar="DV",
                   help="head dim of V (default: --hdim)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--local", action="store_true", help="sliding-window variant")
    p.add_argument("--softcap", action="store_true")
    p.add_argument("--varlen", action="store_true")
    p.add_argument("--deterministic", action="store_true", help="backward only")
    p.add_argument("--family", choices=FAMILIES, default="",
                   help="kernel family (default: what runs on that arch; sm_90a fwd: sm90)")
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument("--dump", metavar="DIR", default=None,
                   help="write PTX, cubin, SASS and the ptxas log here")


def main(args: Any) -> int:
    """Entry of ``python -m cute_flash inspect``; returns the exit code."""
    variant = Variant(arch=args.arch, kernel=args.kernel, dtype=args.dtype, hdim=args.hdim,
                      hdim_v=args.hdim_v, causal=args.causal, local=args.local, softcap=args.softcap,
                      varlen=args.varlen, deterministic=args.deterministic, family=args.family)
    try:
        rep = inspect_variant(variant, dump_dir=args.dump)
    except Exception as e:
        if args.json:
            print(json.dumps({"variant": asdict(variant), "error": f"{type(e).__name__}: {e}"}))
        else:
            print(f"inspect {variant.label()} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rep))
    else:
        print(format_report(rep))
        if args.dump:
            print(f"\nPTX/SASS/cubin/log written to {args.dump}")
    return 0


__all__ = ["Variant", "configs_for", "inspect_variant", "inspect_many", "mix_table",
           "format_report", "compile_config", "report_config", "ptx_opcodes", "ptx_instructions", "count_ptx",
           "sass_opcodes", "count_sass", "resource_usage", "parse_res_usage", "parse_ptxas_remarks",
           "dynamic_smem_from_ir"]
