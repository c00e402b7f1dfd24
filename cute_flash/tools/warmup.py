"""``python -m cute_flash warmup``: compile ahead of time, into the on-disk compile cache, the kernel
variants a model's attention calls will launch, so that a job's first step loads them instead.

The variants come from the launch path's own plans (``dispatch``): each attention spec (head dims,
heads, dtype, masks) is planned over a sweep of sequence lengths and batch sizes, because a plan
picks tiles and grids from the extents (a persistent grid for short causal sequences, packed GQA
for decode, the query-head split of the backward). Without a GPU, name the architecture
(``--arch sm_90a``) and its SM count (``--num-sms``, default 132: H100 SXM / H200).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

from cute_flash import disk_cache, dispatch, jit, launch
from cute_flash.ampere.kvcache_config import AppendKVConfig
from cute_flash.formats import FP8_BWD_HDIMS

# The plans' thresholds fall anywhere, so the sweep is dense (planning is host arithmetic, ~0.1 s a
# spec): query = key lengths of training and prefill in steps of ~8% from 1 to 128k, (query, key)
# pairs of decode and chunked prefill, and batch sizes in steps of ~20% up to 256.
# Compile targets a warm-up can name (the launchers compile for the device's own: sm_86 / sm_89
# for Ampere / Ada cards).
TARGETS = ("sm_80", "sm_86", "sm_89", "sm_90a")
SEQLENS = tuple(sorted({round(1.08 ** i) for i in range(156)}))
DECODE = tuple((nq, nk) for nq in SEQLENS if nq <= 4096 for nk in (1024, 4096, 32768, 131072) if nq < nk)
BATCHES = tuple(sorted({round(1.2 ** i) for i in range(31)}))


@dataclass(frozen=True)
class AttentionSpec:
    """One kind of attention call a model makes."""

    hdim: int
    heads_q: int
    heads_kv: int
    hdim_v: int | None = None
    dtype: str = "bf16"
    causal: bool = True
    window: bool = False
    softcap: bool = False
    varlen: bool = False
    backward: bool = True
    deterministic: bool = False
    # The ``fp8=True`` forward (quantize with the rotation, then e4m3 attention); with ``kvcache``, an
    # e4m3 cache.
    fp8: bool = False
    # ``flash_attn_with_kvcache`` (decoding, chunked prefill) over a cache of these pages (0: contiguous).
    kvcache: bool = False
    page_size: int = 0

    def label(self) -> str:
        names = ("causal", "window", "softcap", "varlen", "deterministic", "fp8", "kvcache")
        flags = [f for f in names if getattr(self, f)] + ([f"page{self.page_size}"] if self.page_size else [])
        dv = "" if self.hdim_v in (None, self.hdim) else f"x{self.hdim_v}"
        return f"{self.dtype} d{self.hdim}{dv} {self.heads_q}/{self.heads_kv} heads {' '.join(flags)}".strip()


def specs_from_model_config(config: dict, dtype: str | None = None, backward: bool = True,
                            padded: bool = True) -> list[AttentionSpec]:
    """The attention specs of a Hugging Face decoder config (``config.json`` as a dict): GQA heads,
    head dim, softcap, and a windowed spec for sliding-window layers. ``padded``: also the packed
    (varlen) variants that padded batches go through."""
    c = config.get("text_config") or config
    heads = int(c["num_attention_heads"])
    hdim = int(c.get("head_dim") or c["hidden_size"] // heads)
    heads_kv = int(c.get("num_key_value_heads") or heads)
    softcap = bool(c.get("attn_logit_softcapping"))
    window = c.get("sliding_window")
    kinds = set(c.get("layer_types") or ["sliding_attention"])
    slides = bool(window) and c.get("use_sliding_window") is not False and "sliding_attention" in kinds
    # (A sliding layer attends without its window while the keys fit in it: both variants.)
    windows = [False, True] if slides else [False]
    if dtype is None:
        named = str(c.get("dtype") or c.get("torch_dtype") or config.get("torch_dtype") or "bfloat16")
        dtype = "fp16" if "float16" in named and "bfloat16" not in named else "bf16"
    return [AttentionSpec(hdim=hdim, heads_q=heads, heads_kv=heads_kv, dtype=dtype, window=w, softcap=softcap,
                          varlen=varlen, backward=backward)
            for w in windows for varlen in ((False, True) if padded else (False,))]


def plan_configs(spec: AttentionSpec, arch: str, num_sms: int, seqlens: tuple[int, ...] = SEQLENS,
                 batches: tuple[int, ...] = BATCHES, decode: bool = True) -> list[jit.KernelConfig]:
    """Every kernel config the launchers would run for ``spec`` over the sweep, for target ``arch``."""
    dv = spec.hdim if spec.hdim_v is None else spec.hdim_v
    # (The launchers' own mask rule: a causal window is the window (left, 0), not causal.)
    causal, local, _, _ = launch.normalize_window(spec.causal, (1, 1) if spec.window else (-1, -1))
    pairs = [(n, n) for n in seqlens] + (list(DECODE) if decode and not spec.varlen else [])
    if spec.kvcache:
        return _plan_kvcache(spec, arch, num_sms, causal, local)
    if spec.fp8:
        return _plan_fp8(spec, arch, num_sms, pairs, causal, local)
    fwd_family = dispatch.fwd_family(arch, spec.hdim, dv)
    bwd_family = dispatch.bwd_family(arch, spec.hdim, dv, spec.softcap) if spec.backward else None
    masks = dict(causal=causal, local=local, softcap=spec.softcap, varlen=spec.varlen)
    out: dict[jit.KernelConfig, None] = {}
    for nq, nk in pairs:
        p = dispatch.fwd_problem(spec.dtype, spec.hdim, dv, **masks, seqlen_q=nq, seqlen_k=nk,
                                 heads_q=spec.heads_q, heads_kv=spec.heads_kv, num_sms=num_sms, target=arch)
        out[dispatch.fwd_config(p, fwd_family)] = None
        if bwd_family is None or nq != nk:
            continue
        for batch in batches:
            p = dispatch.bwd_problem(bwd_family, arch, spec.dtype, spec.hdim, dv, **masks,
                                     deterministic=spec.deterministic, dlse=False, seqlen_q=nq, seqlen_k=nk,
                                     heads_q=spec.heads_q, heads_kv=spec.heads_kv, batch=batch,
                                     num_sms=num_sms)
            out.update(dict.fromkeys(dispatch.bwd_configs(p, bwd_family)))
    return list(dict.fromkeys(replace(c, target=arch) for c in out))


def _plan_fp8(spec: AttentionSpec, arch: str, num_sms: int, pairs: list[tuple[int, int]], causal: bool,
              local: bool) -> list[jit.KernelConfig]:
    """The ``fp8=True`` path's kernels: quantize Q / K (rotated) and V, then the e4m3 forward, whose
    plan reads the extents (the token totals of a pack); with ``backward`` where the FP8 backward
    covers the spec (no window, d in ``FP8_BWD_HDIMS``), its quantize / re-layout kernels and its
    (pre, main, post) per length."""
    if not dispatch.is_hopper(arch):
        raise ValueError(f"the FP8 kernels are Hopper kernels (sm_90a), not {arch}")
    if spec.softcap or spec.hdim_v not in (None, spec.hdim):
        raise ValueError("the FP8 path has no softcap, and one head dim for Q, K and V")
    packed = spec.varlen
    out: dict[jit.KernelConfig, None] = dict.fromkeys(dispatch.quant_configs(
        spec.dtype, spec.hdim, rotate=True, v_perm=not packed, varlen=packed, v_aligned=packed))
    backward = spec.backward and not local and spec.hdim in FP8_BWD_HDIMS
    if backward:
        out[dispatch.fp8_bwd_quant_config(spec.dtype, spec.hdim, packed)] = None
        # Q^T / dO^T in the kernel's order, K^T in the natural one (packed: from padded starts).
        out.update(dict.fromkeys(dispatch.relayout_v_config(spec.hdim, v_perm=perm, varlen=packed)
                                 for perm in (False, True)))
    for nq, nk in pairs:
        p = dispatch.fp8_problem(spec.dtype, spec.hdim, spec.hdim, causal=causal, local=local, varlen=packed,
                                 seqlen_q=nq, seqlen_k=nk, heads_q=spec.heads_q, heads_kv=spec.heads_kv,
                                 num_sms=num_sms, q_dense=True)
        out[dispatch.fp8_fwd_config(p, v_perm=not spec.varlen)] = None
        if backward and nq == nk:
            p = replace(p, deterministic=spec.deterministic, dlse=False)
            out.update(dict.fromkeys(dispatch.fp8_bwd_configs(p)))
    return list(dict.fromkeys(replace(c, target=arch) for c in out))


def _plan_kvcache(spec: AttentionSpec, arch: str, num_sms: int, causal: bool,
                  local: bool) -> list[jit.KernelConfig]:
    """The KV-cache kernel and merge of every (queries, batch, cache size) the launcher may see: the
    plan packs GQA by the query rows and splits by the tiles and the cache's key blocks (one, a
    few, many), never by the lengths in the cache."""
    if spec.backward or spec.varlen:
        raise ValueError("the KV-cache path is a forward over dense queries")
    dv = spec.hdim if spec.hdim_v is None else spec.hdim_v
    out: dict[jit.KernelConfig, None] = {}
    for nq in (n for n in SEQLENS if n <= 4096):
        for batch in BATCHES:
            for capacity in (64, 1024, 131072):
                p = dispatch.kvcache_problem(spec.dtype, spec.hdim, dv, causal=causal, local=local,
                                             softcap=spec.softcap, batch=batch, seqlen_q=nq,
                                             capacity=capacity, heads_q=spec.heads_q, heads_kv=spec.heads_kv,
                                             num_sms=num_sms, q_dense=True)
                plan = dispatch.kvcache_plan(arch, p, batch_idx=False, leftpad=False,
                                             page_size=spec.page_size, kv_dtype="e4m3" if spec.fp8 else "")
                out[plan.config] = None
                if plan.combine is not None:
                    out[plan.combine] = None
    out.update(dict.fromkeys(_appends(spec)))
    return list(dict.fromkeys(replace(c, target=arch) for c in out))


def _appends(spec: AttentionSpec) -> list[jit.KernelConfig]:
    """The append kernels of the spec's calls with new tokens: no rotary, or a table in the model's
    dtype or fp32, pairs interleaved or halves, q rotated per token or not."""
    base = dict(target=None, dtype=spec.dtype, kv_dtype="e4m3" if spec.fp8 else "", paged=spec.page_size > 0)
    out = [AppendKVConfig(**base)]
    for rotary in (spec.dtype, "fp32"):
        for interleaved in (True, False):
            for per_token in (True, False):
                out.append(AppendKVConfig(**base, rotary=rotary, interleaved=interleaved,
                                                       per_token_q=per_token))
    return out


def _compile_one(cfg: jit.KernelConfig) -> tuple[str, float, bool]:
    """(label, seconds, whether it was compiled rather than already cached), in a worker process."""
    compiled = []
    real = jit._compile

    def counting(c: jit.KernelConfig, keep: bool):
        compiled.append(c)
        return real(c, keep)

    jit._compile = counting
    try:
        t0 = time.perf_counter()
        jit.compile_kernel(cfg)
        disk_cache.flush()
        return cfg.describe(), time.perf_counter() - t0, bool(compiled)
    finally:
        jit._compile = real


def warm(configs: list[jit.KernelConfig], workers: int,
         progress: bool = True) -> list[tuple[str, float, bool]]:
    """Compile ``configs`` into the disk cache in ``workers`` processes; (label, s, compiled) each."""
    if not disk_cache.enabled():
        raise RuntimeError(f"the compile cache is off ({disk_cache.CACHE_ENV}=0): a warm-up would be lost")
    results: list[tuple[str, float, bool]] = []
    bar = _progress(len(configs)) if progress else None
    if workers <= 1:
        for cfg in configs:
            results.append(_compile_one(cfg))
            bar and bar.update(1)
    else:
        # spawn, not fork: the parent may already hold an MLIR context and its threads.
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for fut in as_completed([pool.submit(_compile_one, cfg) for cfg in configs]):
                results.append(fut.result())
                bar and bar.update(1)
    bar and bar.close()
    return results


class _Counter:
    """A progress line on stderr where tqdm is not installed."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def update(self, n: int) -> None:
        self.done += n
        print(f"\rcompiled {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr)


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total)
    return tqdm(total=total, desc="cute_flash warm-up", unit="kernel")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a Hugging Face config: config.json, a model folder, or (with "
                                    "transformers installed) a model id")
    p.add_argument("--hdim", type=int, nargs="+", default=[], help="head dims (without --config)")
    p.add_argument("--heads", type=int, nargs=2, metavar=("H", "HKV"), default=None,
                   help="query and key/value heads (default 32 8 without --config)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default=None)
    p.add_argument("--mask", nargs="+", choices=("causal", "none", "window"), default=["causal"],
                   help="masks to warm (without --config); window: a causal sliding window")
    p.add_argument("--softcap", action="store_true", help="with a score softcap (without --config)")
    p.add_argument("--varlen", action="store_true", help="also the packed-sequence (varlen) variants")
    p.add_argument("--no-bwd", action="store_true", help="forward kernels only (inference)")
    p.add_argument("--deterministic", action="store_true", help="the deterministic backward")
    p.add_argument("--fp8", action="store_true", help="the fp8=True path instead (Hopper: quantize with the "
                                                     "rotation, e4m3 attention, its backward where it "
                                                     "covers the spec); with --kvcache, an e4m3 cache")
    p.add_argument("--kvcache", action="store_true", help="the flash_attn_with_kvcache kernels instead "
                                                         "(decoding, chunked prefill; forward only)")
    p.add_argument("--page-size", type=int, default=0, help="with --kvcache: a paged cache of these pages")
    p.add_argument("--seqlen", type=int, nargs="+", default=None, help="sequence lengths to plan for "
                   "(default: a sweep from 64 to 128k and decode shapes)")
    p.add_argument("--arch", choices=TARGETS, default=None, help="compile target (default: this GPU)")
    p.add_argument("--num-sms", type=int, default=None, help="SM count of the target GPU (default: this GPU, "
                                                             "or 132 with --arch)")
    p.add_argument("--workers", type=int, default=None, help="compile processes (default: CPU count)")
    p.add_argument("--list", action="store_true", help="print the variants without compiling")


def _load_config(name: str) -> dict:
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    try:
        from transformers import AutoConfig
    except ImportError as err:
        raise SystemExit(f"{name}: no such config file (a model id needs transformers installed)") from err
    return AutoConfig.from_pretrained(name).to_dict()


def specs_from_args(args: argparse.Namespace) -> list[AttentionSpec]:
    if args.config:
        specs = specs_from_model_config(_load_config(args.config), dtype=args.dtype, backward=not args.no_bwd,
                                        padded=not args.kvcache)
        return [replace(s, deterministic=args.deterministic, **_fp8_fields(args)) for s in specs]
    if not args.hdim:
        raise SystemExit("name the head dims (--hdim 128 ...) or a model (--config)")
    heads_q, heads_kv = args.heads or (32, 8)
    masks = [dict(causal=m != "none", window=m == "window", softcap=args.softcap) for m in args.mask]
    return [AttentionSpec(hdim=d, heads_q=heads_q, heads_kv=heads_kv, dtype=args.dtype or "bf16",
                          varlen=varlen, deterministic=args.deterministic,
                          **{**m, "backward": not args.no_bwd, **_fp8_fields(args)})
            for d in args.hdim for m in masks for varlen in ((False, True) if args.varlen else (False,))]


def _fp8_fields(args: argparse.Namespace) -> dict:
    """The fields of --fp8 (its backward where it covers the spec, unless --no-bwd) and --kvcache
    (forward only)."""
    if args.kvcache:  # (with --fp8: an e4m3 cache)
        return dict(kvcache=True, fp8=args.fp8, page_size=args.page_size, backward=False)
    return dict(fp8=True) if args.fp8 else {}


def _target(args: argparse.Namespace) -> tuple[str, int]:
    import torch

    if args.arch is None:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA GPU here: name the target with --arch sm_90a (or sm_80)")
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return jit.device_arch(), args.num_sms or props.multi_processor_count
    return args.arch, args.num_sms or 132


def main(args: argparse.Namespace) -> int:
    arch, num_sms = _target(args)
    specs = specs_from_args(args)
    seqlens = tuple(args.seqlen) if args.seqlen else SEQLENS
    configs: dict[jit.KernelConfig, None] = {}
    for spec in specs:
        try:
            planned = plan_configs(spec, arch, num_sms, seqlens=seqlens, decode=not args.seqlen)
        except (ValueError, NotImplementedError) as err:
            raise SystemExit(f"{spec.label()}: {err}") from err
        configs.update(dict.fromkeys(planned))
    print(f"{len(configs)} kernel variants for {arch} ({num_sms} SMs) from {len(specs)} attention specs:",
          file=sys.stderr)
    for spec in specs:
        print(f"  {spec.label()}" + ("" if spec.backward else " (forward only)"), file=sys.stderr)
    if args.list:
        print("\n".join(c.describe() for c in configs))
        return 0
    print(f"cache: {disk_cache.cache_root()}", file=sys.stderr)
    t0 = time.perf_counter()
    results = warm(list(configs), args.workers or os.cpu_count() or 1)
    fresh = sum(compiled for _, _, compiled in results)
    print(f"{fresh} compiled, {len(results) - fresh} already cached, in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    return 0
