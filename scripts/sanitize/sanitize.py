"""One small problem per kernel family, for compute-sanitizer (``scripts/sanitize.sh`` runs each
family under memcheck, racecheck and synccheck).

Each family runs a dense problem (lengths that are not tile multiples, GQA 8 / 2, no mask) and a
causal packed one whose last sequence is shorter than the longest (grids are sized by the longest
sequence, so the CTAs past a short sequence's end are exercised), forward and, where the family
has one, backward, through the public API. Outputs are checked loosely against the fp32
reference, so a race that the sanitizer's timing brings out shows up as a wrong answer too.

    python scripts/sanitize/sanitize.py --list
    python scripts/sanitize/sanitize.py --family sm90-d128 [--override prefetch_stats=0 ...]
    compute-sanitizer --tool racecheck python scripts/sanitize/sanitize.py --family sm90-d128

``--override`` sets sm90 backward config fields (``BwdSm90Config``) for A/B runs of one switch.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Family:
    hdim: int = 128
    bwd: bool = True
    fp8: bool = False
    env: dict = field(default_factory=dict)
    kw: dict = field(default_factory=dict)


FAMILIES = {
    "sm80-fwd": Family(bwd=False, env={"CUTE_FLASH_FWD_KERNEL": "sm80"}),
    "sm80-bwd": Family(env={"CUTE_FLASH_FWD_KERNEL": "sm80", "CUTE_FLASH_BWD_KERNEL": "sm80"}),
    "sm90-d64": Family(hdim=64),
    "sm90-d96": Family(hdim=96),
    "sm90-d128": Family(hdim=128),
    "sm90-d128-det": Family(hdim=128, kw={"deterministic": True}),
    "sm90-d128-softcap-window": Family(hdim=128, kw={"softcap": 30.0, "window_size": (96, 0)}),
    "sm90-d192": Family(hdim=192),
    "sm90-d256": Family(hdim=256),
    "fp8-d128": Family(hdim=128, bwd=False, fp8=True),
}

DENSE = dict(batch=2, nq=300, nk=300, heads=(8, 2))
PACK = [169, 300, 45]  # the last sequence is the shortest: blocks past its end are past the scratch


def apply_overrides(pairs: list[str]) -> None:
    """Merge ``name=value`` fields into every sm90 backward launch plan."""
    if not pairs:
        return
    from cute_flash import dispatch

    extra = tuple((k, int(v) if v.lstrip("-").isdigit() else v) for k, v in (p.split("=", 1) for p in pairs))
    configs = dispatch.bwd_configs

    def with_overrides(problem, family, overrides=()):
        if family != "sm90":
            return configs(problem, family, overrides)
        return configs(problem, family, tuple(sorted({**dict(overrides), **dict(extra)}.items())))

    dispatch.bwd_configs = with_overrides


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6)).item()


def run_case(fam: Family, varlen: bool, causal: bool) -> list[str]:
    import cute_flash
    from cute_flash.reference import attention_ref

    h, hkv = DENSE["heads"]
    d = fam.hdim
    dt = torch.bfloat16
    if varlen:
        cu = torch.tensor([0, *torch.tensor(PACK).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
        shape_q, shape_k = (sum(PACK), h, d), (sum(PACK), hkv, d)
    else:
        shape_q = (DENSE["batch"], DENSE["nq"], h, d)
        shape_k = (DENSE["batch"], DENSE["nk"], hkv, d)
    q = torch.randn(shape_q, dtype=dt, device="cuda", requires_grad=fam.bwd)
    k = torch.randn(shape_k, dtype=dt, device="cuda", requires_grad=fam.bwd)
    v = torch.randn(shape_k, dtype=dt, device="cuda", requires_grad=fam.bwd)
    kw = dict(causal=causal, **fam.kw)
    if fam.fp8:
        kw["fp8"] = True
    if varlen:
        out = cute_flash.flash_attn_varlen_func(q, k, v, cu, cu, max(PACK), max(PACK), **kw)
        ref_kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu)
    else:
        out = cute_flash.flash_attn_func(q, k, v, **kw)
        ref_kw = {}
    ref_args = {n: kw[n] for n in ("causal", "window_size", "softcap") if n in kw}
    qr, kr, vr = (t.detach().float().requires_grad_(fam.bwd) for t in (q, k, v))
    ref, _ = attention_ref(qr, kr, vr, **ref_args, **ref_kw)
    errs = [("out", rel_err(out, ref))]
    if fam.bwd:
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        rgrads = torch.autograd.grad(ref, (qr, kr, vr), dout.float())
        errs += [(n, rel_err(g, r)) for n, g, r in zip(("dq", "dk", "dv"), grads, rgrads, strict=True)]
    torch.cuda.synchronize()
    bound = 0.08 if fam.fp8 else 2e-2
    label = f"{'varlen' if varlen else 'dense'} causal={int(causal)}"
    bad = [f"{n} rel err {e:.3g}" for n, e in errs if not e <= bound]
    return [f"{label}: " + (", ".join(bad) if bad else "ok " + " ".join(f"{n}={e:.1e}" for n, e in errs))]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES))
    p.add_argument("--list", action="store_true", help="print the family names and exit")
    p.add_argument("--override", nargs="*", default=[], metavar="FIELD=VALUE")
    args = p.parse_args()
    if args.list:
        print("\n".join(FAMILIES))
        return 0
    if not args.family:
        p.error("--family or --list")
    fam = FAMILIES[args.family]
    os.environ.update(fam.env)
    apply_overrides(args.override)
    torch.manual_seed(0)
    lines = []
    for varlen, causal in ((False, False), (True, True)):
        lines += run_case(fam, varlen, causal)
    for line in lines:
        print(f"[{args.family}] {line}")
    return 0 if all(": ok" in line for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
