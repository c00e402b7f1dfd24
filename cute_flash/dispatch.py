"""The one place that decides which kernel family runs a problem and which kernel configs it
launches: the launchers, the inspect tool and the tests all ask here.

Families: ``sm80`` (FlashAttention-2, any sm80+ GPU), ``sm90`` (FlashAttention-3 with wgmma, TMA
and warp specialisation, Hopper only) and ``fp8`` (the e4m3 forward, Hopper only). By default a
Hopper GPU takes the sm90 kernels wherever they cover the problem; ``CUTE_FLASH_FWD_KERNEL`` /
``CUTE_FLASH_BWD_KERNEL`` (``auto``, ``sm80``, ``sm90``; read at every call) force a family.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from cute_flash import jit
from cute_flash.ampere import config as sm80
from cute_flash.ampere import kvcache_config as sm80_kvcache
from cute_flash.hopper import bwd_config as sm90_bwd
from cute_flash.hopper import bwd_fp8_config as fp8_bwd
from cute_flash.hopper import fp8_config as fp8
from cute_flash.hopper import fwd_config as sm90_fwd
from cute_flash.hopper import kvcache_config as sm90_kvcache
from cute_flash.problem import Problem
from cute_flash.validate import SUPPORTED_HEAD_DIMS

FWD_KERNEL_ENV = "CUTE_FLASH_FWD_KERNEL"
BWD_KERNEL_ENV = "CUTE_FLASH_BWD_KERNEL"
FAMILY_CHOICES = ("auto", "sm80", "sm90")
FAMILIES = ("sm80", "sm90")


def _choice(env: str) -> str:
    choice = os.environ.get(env, "auto").strip().lower() or "auto"
    if choice not in FAMILY_CHOICES:
        raise ValueError(f"{env} must be one of {', '.join(FAMILY_CHOICES)}, got {choice!r}")
    return choice


def is_hopper(arch: str) -> bool:
    return arch.startswith("sm_90")


def sm90_fwd_supports(hdim: int, hdim_v: int) -> bool:
    """Whether the sm90 forward has a tile configuration for these head dims."""
    return max(hdim, hdim_v) in sm90_fwd.SM90_FWD_TILES


def fwd_family(arch: str, hdim: int | None = None, hdim_v: int | None = None) -> str:
    """``sm80`` or ``sm90``: the forward kernels for a GPU of ``arch``.

    ``CUTE_FLASH_FWD_KERNEL``: ``auto`` takes the sm90 family on Hopper where it has the head dims
    (``hdim=None`` skips that check) and the sm80 family elsewhere; ``sm80`` forces FA2 (on any
    sm80+ GPU); ``sm90`` forces FA3 and raises ``ValueError`` on a GPU that is not Hopper.
    """
    choice = _choice(FWD_KERNEL_ENV)
    if choice == "sm80":
        return "sm80"
    if not is_hopper(arch):
        if choice == "sm90":
            raise ValueError(f"{FWD_KERNEL_ENV}=sm90: the sm90 forward (wgmma, TMA) needs a Hopper GPU "
                             f"(compute capability 9.x); this one is {arch}. Use sm80 or auto.")
        return "sm80"
    if choice == "auto" and hdim is not None:
        if not sm90_fwd_supports(hdim, hdim if hdim_v is None else hdim_v):
            return "sm80"
    return "sm90"


def sm90_bwd_covers(hdim: int, hdim_v: int, softcap: bool, mods: bool = False) -> bool:
    """Whether the sm90 backward runs this problem."""
    return sm90_bwd.sm90_bwd_covers(hdim, hdim_v, softcap, mods)


def bwd_family(arch: str, hdim: int, hdim_v: int, softcap: bool, mods: bool = False) -> str:
    """``sm80`` or ``sm90``: the backward kernels for a GPU of ``arch``.

    ``CUTE_FLASH_BWD_KERNEL``: ``auto`` takes the FA3 backward on Hopper where it covers the
    problem (head dims 64 / 96 / 128 / 192 / 256 with d_v = d, and (192, 128); score_mod / mask_mod
    at d <= 128) and FA2 elsewhere;
    ``sm80`` forces FA2; ``sm90`` forces FA3, raising ``ValueError`` where it does not apply.
    """
    choice = _choice(BWD_KERNEL_ENV)
    if choice == "sm80":
        return "sm80"
    if is_hopper(arch) and sm90_bwd_covers(hdim, hdim_v, softcap, mods):
        return "sm90"
    if choice == "sm90":
        raise ValueError(f"{BWD_KERNEL_ENV}=sm90: the sm90 backward needs a Hopper GPU, a head dim in "
                         f"{sm90_bwd.SM90_BWD_HDIMS} with d_v = d, softcap at d in "
                         f"{sm90_bwd.SM90_BWD_SOFTCAP_HDIMS} only (got {arch}, d={hdim}, d_v={hdim_v}, "
                         f"softcap={softcap})")
    return "sm80"


# ---------------------------------------------------------------------------------------------
# Configs of a problem
# ---------------------------------------------------------------------------------------------
def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"kernel family must be one of {FAMILIES}, got {family!r}")


def fwd_problem(dtype: str, hdim: int, hdim_v: int, *, causal: bool, local: bool, softcap: bool, varlen: bool,
                seqlen_q: int | None, seqlen_k: int | None, heads_q: int, heads_kv: int, num_sms: int,
                q_dense: bool = True, target: str | None = None, sinks: bool = False,
                mods: object = None) -> Problem:
    """The forward problem of a call as its plan reads it. Packed sequences plan without extents
    (their lengths are on the device; the plan must hold for any of them), as does a call whose
    ``seqlen_q`` is None."""
    known = not varlen and seqlen_q is not None
    return Problem(target=target, dtype=dtype, hdim=hdim, hdim_v=hdim_v, causal=causal, local=local,
                   softcap=softcap, varlen=varlen, sinks=sinks, mods=mods,
                   max_seqlen_q=seqlen_q if known else None,
                   max_seqlen_k=seqlen_k if known else None, heads_q=heads_q, heads_kv=heads_kv,
                   num_sms=num_sms if known else 132, q_dense=q_dense and known)


def bwd_problem(family: str, target: str, dtype: str, hdim: int, hdim_v: int, *, causal: bool, local: bool,
                softcap: bool, varlen: bool, deterministic: bool, dlse: bool, seqlen_q: int, seqlen_k: int,
                heads_q: int, heads_kv: int, batch: int, num_sms: int, mods: object = None) -> Problem:
    """The backward problem of a call: the sm90 plan reads the extents (head split, grid order),
    the sm80 one does not. ``target``: the resolved compile target (the sm80 configs carry it)."""
    base = dict(dtype=dtype, hdim=hdim, hdim_v=hdim_v, causal=causal, local=local, softcap=softcap,
                varlen=varlen, deterministic=deterministic, dlse=dlse, mods=mods)
    if family == "sm90":
        return Problem(target=None, **base, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k, heads_q=heads_q,
                       heads_kv=heads_kv, batch=batch, num_sms=num_sms)
    return Problem(target=target, **base)


def fp8_problem(dtype: str, hdim: int, hdim_v: int, *, causal: bool, local: bool, varlen: bool,
                seqlen_q: int | None, seqlen_k: int | None, heads_q: int, heads_kv: int, num_sms: int,
                q_dense: bool) -> Problem:
    """The FP8 forward problem of a call (``dtype``: the output's): its plan reads the query / key
    extents, the token totals for packed sequences; None on fake (CPU) tensors."""
    return Problem(target=None, dtype=dtype, hdim=hdim, hdim_v=hdim_v, causal=causal, local=local,
                   varlen=varlen, max_seqlen_q=seqlen_q, max_seqlen_k=seqlen_k, heads_q=heads_q,
                   heads_kv=heads_kv, num_sms=num_sms, q_dense=q_dense)


def fwd_config(p: Problem, family: str) -> jit.KernelConfig:
    """The forward kernel of ``family`` for problem ``p``."""
    _check_family(family)
    return sm90_fwd.plan(p) if family == "sm90" else sm80.fwd_plan(p)


def bwd_configs(p: Problem, family: str, overrides: tuple = ()) -> tuple[jit.KernelConfig, ...]:
    """(preprocess, main, postprocess) of ``family`` for problem ``p``; ``overrides``: sm90 main
    config fields as (name, value) pairs (tuning scripts)."""
    _check_family(family)
    if p.hdim not in SUPPORTED_HEAD_DIMS or p.hdim_v not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dims must be in {SUPPORTED_HEAD_DIMS}, got {p.hdim}/{p.hdim_v}")
    if family == "sm90":
        return sm90_bwd.plan(p, overrides)
    if overrides:
        raise ValueError("config overrides are for the sm90 backward")
    return sm80.bwd_plan(p)


def bwd_head_split(p: Problem, family: str, overrides: tuple = ()) -> int:
    """CTA rows per K/V head in the backward of ``family`` (GQA groups split over CTAs, their dK /
    dV partials summed after): 1 where one CTA covers the group."""
    return sm90_bwd.head_split(p, overrides) if family == "sm90" else 1


def fp8_fwd_config(p: Problem, v_perm: bool, overrides: tuple = ()) -> jit.KernelConfig:
    """The FP8 attention kernel for problem ``p`` (``v_perm``: V in the kernel's token order)."""
    return fp8.plan(p, v_perm=v_perm, overrides=overrides)


def fp8_bwd_configs(p: Problem, overrides: tuple = ()) -> tuple[jit.KernelConfig, ...]:
    """(preprocess, main, postprocess) of the FP8 backward of problem ``p`` (``dtype``: the
    gradients'); ``overrides``: main config fields (tuning scripts)."""
    if not fp8_bwd.fp8_bwd_covers(p.hdim, p.hdim_v, local=p.local):
        raise NotImplementedError(f"the FP8 backward runs head dims {fp8_bwd.FP8_BWD_HDIMS} (d_v = d) "
                                  "without sliding windows")
    return fp8_bwd.plan(p, overrides)


def fp8_bwd_head_split(p: Problem, overrides: tuple = ()) -> int:
    """CTA rows per K/V head of the FP8 backward (the 16-bit backward's rule, or ``overrides``)."""
    return sm90_bwd.head_split(p, overrides)


@functools.cache  # (per call of the backward: its validation costs host time)
def fp8_bwd_quant_config(dtype: str, hdim: int, varlen: bool = False) -> jit.KernelConfig:
    """The FP8 backward's quantize kernel: V at its descales (natural layout; ``varlen``: packed,
    one descale per sequence)."""
    return fp8.bwd_quant_config(dtype, hdim, varlen)


def quant_configs(dtype: str, hdim: int, rotate: bool, v_perm: bool = False, varlen: bool = False,
                  v_aligned: bool = False) -> list[jit.KernelConfig]:
    """The quantize kernels of ``quantize_qkv`` (amax and quant phases for Q / K, then for V)."""
    return fp8.quant_configs(dtype, hdim, rotate, v_perm=v_perm, varlen=varlen, v_aligned=v_aligned)


@functools.cache
def relayout_v_config(hdim: int, v_perm: bool, varlen: bool) -> jit.KernelConfig:
    """The V quantize kernel at scale 1 on e4m3 input: a caller's V into the FP8 kernel's layout
    (packed sequences each from the 16-aligned start the caller gives)."""
    return fp8.QuantizeConfig(target=None, dtype="e4m3", hdim=hdim, rotate=False, transpose=True,
                              phase="quant", v_perm=v_perm, varlen=varlen, v_aligned=varlen)


def kvcache_problem(dtype: str, hdim: int, hdim_v: int, *, causal: bool, local: bool, softcap: bool,
                    batch: int, seqlen_q: int, capacity: int, heads_q: int, heads_kv: int, num_sms: int,
                    q_dense: bool, sinks: bool = False) -> Problem:
    """Attention over a KV cache: ``capacity`` (the cache's keys per sequence) stands for the key
    extent, so the plan never depends on the lengths on the device."""
    return Problem(target=None, dtype=dtype, hdim=hdim, hdim_v=hdim_v, causal=causal, local=local,
                   softcap=softcap, sinks=sinks, max_seqlen_q=seqlen_q, max_seqlen_k=capacity,
                   heads_q=heads_q, heads_kv=heads_kv, batch=batch, num_sms=num_sms, q_dense=q_dense)


def kvcache_plan(arch: str, p: Problem, *, batch_idx: bool, leftpad: bool, page_size: int = 0,
                 num_splits: int = 0, kv_dtype: str = "") -> sm80_kvcache.KVCachePlan:
    """The KV-cache kernel (and split merge) for ``p`` on a GPU of ``arch``: the forward family's
    (``fwd_family``), except that pages the sm90 kernel's TMA boxes do not take
    (``takes_pages``) go to the sm80 kernel's row-by-row cp.async loads, and that on Hopper
    decoding over a contiguous 16-bit cache with tiles enough to fill the SMs takes the sm80
    decoding tile (``fills_the_sms_decoding``). ``kv_dtype`` "e4m3": an
    FP8 cache, read by the sm90 kernel only."""
    d = max(p.hdim, p.hdim_v)
    hopper = fwd_family(arch, p.hdim, p.hdim_v) == "sm90"
    fp8 = bool(kv_dtype)
    if hopper and not fp8 and not page_size and sm80_kvcache.fills_the_sms_decoding(p):
        # Enough (batch, KV head) tiles to fill the SMs without splitting: the small two-warp
        # decoding tiles, several per SM, read the cache faster (docs/tuning.md).
        return sm80_kvcache.plan(p, batch_idx=batch_idx, leftpad=leftpad, num_splits=num_splits)
    if hopper and (not page_size or sm90_kvcache.takes_pages(page_size, d, p.masked, fp8)):
        return sm90_kvcache.plan(p, batch_idx=batch_idx, leftpad=leftpad, page_size=page_size,
                                 num_splits=num_splits, kv_dtype=kv_dtype)
    if fp8:
        family = fwd_family(arch, p.hdim, p.hdim_v)
        where = f"page size {page_size}" if hopper else f"{arch} with the {family} family"
        raise NotImplementedError(f"flash_attn_with_kvcache: an e4m3 KV cache runs on the sm90 kernel with "
                                  f"page sizes that are multiples of {sm90_kvcache.PAGE_BOX_MULTIPLE} "
                                  f"(tiles of 64+ keys); not on {where}")
    return sm80_kvcache.plan(p, batch_idx=batch_idx, leftpad=leftpad, page_size=page_size,
                             num_splits=num_splits)


# ---------------------------------------------------------------------------------------------
# Variants: what a user can ask for, by name (the inspect tool, the SASS manifest)
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """A compile-only problem as the command line names it; ``configs_for`` turns it into the
    kernel configs the launchers would run."""

    arch: str = "sm_80"
    kernel: str = "fwd"  # "fwd" or "bwd"
    dtype: str = "bf16"  # "bf16", "fp16", or "e4m3" (the FP8 forward)
    hdim: int = 128
    hdim_v: int | None = None
    causal: bool = False
    local: bool = False
    softcap: bool = False
    varlen: bool = False
    deterministic: bool = False
    family: str = ""  # "" = what the launchers run on ``arch``; else one of FAMILIES

    @property
    def dv(self) -> int:
        return self.hdim if self.hdim_v is None else self.hdim_v

    def label(self) -> str:
        flags = [f for f in ("causal", "local", "softcap", "varlen", "deterministic") if getattr(self, f)]
        d = f"d{self.hdim}" if self.dv == self.hdim else f"d{self.hdim}x{self.dv}"
        kernel = f"{self.kernel}[{self.family}]" if self.family else self.kernel
        return " ".join([self.arch, kernel, self.dtype, d, *flags])

    def problem(self, dtype: str | None = None) -> Problem:
        return Problem(target=self.arch, dtype=dtype or self.dtype, hdim=self.hdim, hdim_v=self.dv,
                       causal=self.causal, local=self.local, softcap=self.softcap, varlen=self.varlen,
                       deterministic=self.deterministic)


def _variant_family(v: Variant) -> str:
    if v.family not in ("", *FAMILIES):
        raise ValueError(f"family must be one of {FAMILIES}, got {v.family!r}")
    if v.family == "sm90" and not is_hopper(v.arch):
        raise ValueError(f"the sm90 kernels compile for sm_90a only, not {v.arch}")
    if v.family:
        return v.family
    if not is_hopper(v.arch):
        return "sm80"
    if v.kernel == "fwd":
        return "sm90" if sm90_fwd_supports(v.hdim, v.dv) else "sm80"
    return "sm90" if sm90_bwd_covers(v.hdim, v.dv, v.softcap) else "sm80"


def configs_for(v: Variant) -> list[jit.KernelConfig]:
    """The kernel configs (one per launched kernel) that make up variant ``v``."""
    if v.kernel not in ("fwd", "bwd"):
        raise ValueError(f"kernel must be fwd or bwd, got {v.kernel!r}")
    if v.dtype == "e4m3":
        if v.kernel != "fwd" or not is_hopper(v.arch) or v.family == "sm80":
            raise ValueError("the e4m3 (FP8) kernels are a Hopper forward (no sm80 family)")
        # The ``fp8=True`` path: quantize-and-rotate Q / K and V, then the e4m3 attention kernel.
        # Packed sequences write V per sequence from a 16-aligned start, in natural token order.
        quant = [_retarget(c, v.arch) for c in quant_configs("bf16", v.hdim, rotate=True, v_perm=not v.varlen,
                                                               varlen=v.varlen, v_aligned=v.varlen)]
        return [*quant, fp8_fwd_config(v.problem("bf16"), v_perm=not v.varlen)]
    if v.dtype not in jit.DTYPES:
        raise ValueError(f"dtype {v.dtype!r} is not supported (have {sorted(jit.DTYPES)} and e4m3)")
    family = _variant_family(v)
    if v.kernel == "fwd":
        return [fwd_config(v.problem(), family)]
    if family == "sm90":
        return sm90_bwd.compile_variants(v.problem())
    return list(bwd_configs(v.problem(), family))


def _retarget(cfg: jit.KernelConfig, arch: str) -> jit.KernelConfig:
    from dataclasses import replace

    return replace(cfg, target=arch)
