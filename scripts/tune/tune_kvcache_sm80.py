"""Tile sweep of the sm80 KV-cache kernel for decoding (developer tool): TB/s of KV read of each
(tile_m, tile_n, threads, stages) candidate, GQA 32 / 8, d 128, one query token, on a paged cache
of one key per page and on a contiguous cache, every call a CUDA-graph replay. Each candidate's
output is checked against the default plan's. Usage:
python scripts/tune/tune_kvcache_sm80.py [--batches 1 8 64] [--keys 4096 32768] [--page-sizes 1 0]"""

import argparse
import math

import torch

import cute_flash
from cute_flash import dispatch, jit
from cute_flash.ampere import kvcache_config
from cute_flash.tools import warmup

H, HKV, D = 32, 8, 128
# None: the plan's own tile (kvcache_config.plan).
CANDIDATES = [None, (128, 64, 256, 1), (64, 64, 128, 1), (64, 64, 128, 2), (32, 64, 64, 1), (32, 64, 64, 2),
              (16, 64, 32, 1), (16, 64, 32, 2)]


def _graphed(fn):
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def api_call(q, k_cache, v_cache, lens, table, num_splits: int):
    return lambda: cute_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                                      page_table=table, causal=True, num_splits=num_splits)


def make_plan(tiles, batch: int, keys: int, page: int, num_sms: int,
              splits: int = 0) -> kvcache_config.KVCachePlan:
    capacity = -(-keys // page) * page if page else keys
    p = dispatch.kvcache_problem("bf16", D, D, causal=True, local=False, softcap=False, batch=batch,
                                 seqlen_q=1, capacity=capacity, heads_q=H, heads_kv=HKV, num_sms=num_sms,
                                 q_dense=True)
    return kvcache_config.plan(p, batch_idx=False, leftpad=False, page_size=page, num_splits=splits,
                               tiles=tiles)


def run_candidate(tiles, splits, q, k_cache, v_cache, lens, table, out, lse):
    """A launch closure of one candidate (its own split count), or None where it does not compile."""
    batch, _, _, _ = q.shape
    page = k_cache.shape[1] if table is not None else 0
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    plan = make_plan(tiles, batch, int(lens[0]), page, num_sms, splits)
    try:
        fn = jit.compile_kernel(plan.config)
    except Exception as e:  # noqa: BLE001 (a candidate that does not compile is reported and skipped)
        print(f"  {tiles}: compile failed {e!r:.200}")
        return None, plan
    merge = jit.compile_kernel(plan.combine) if plan.combine else None
    s = plan.num_splits
    o_acc = torch.empty((batch * s, *out.shape[1:]), dtype=torch.float32, device="cuda")
    lse_acc = torch.empty((batch * s, *lse.shape[1:]), dtype=torch.float32, device="cuda")
    scalars = (1.0 / math.sqrt(D), 0.0, -1, 0, s)

    def call():
        if merge is None:
            fn(q, k_cache, v_cache, out, lse, lens, None, None, table, None, None, *scalars, None)
        else:
            fn(q, k_cache, v_cache, o_acc, lse_acc, lens, None, None, table, None, None, *scalars, None)
            merge(o_acc, lse_acc, out, lse, s, None)
    return call, plan


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8, 64])
    ap.add_argument("--keys", type=int, nargs="*", default=[4096, 32768])
    ap.add_argument("--page-sizes", type=int, nargs="*", default=[1, 0])
    ap.add_argument("--splits", type=int, nargs="*", default=[],
                    help="also force these split counts (with the plan's tile)")
    ap.add_argument("--tiles", choices=["all", "plan"], default="all",
                    help="every candidate tile, or the plan's only")
    ap.add_argument("--workers", type=int, default=12, help="parallel compiles ahead of the timing")
    args = ap.parse_args()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = CANDIDATES if args.tiles == "all" else [None]
    runs = [(t, 0) for t in tiles] + [(None, n) for n in args.splits]
    configs = set()
    for page in args.page_sizes:
        for batch in args.batches:
            for keys in args.keys:
                for tiles, splits in runs:
                    plan = make_plan(tiles, batch, keys, page, num_sms, splits)
                    configs |= {plan.config} | ({plan.combine} if plan.combine else set())
    warmup.warm(sorted(configs, key=repr), args.workers, progress=False)
    for page in args.page_sizes:
        for batch in args.batches:
            for keys in args.keys:
                q = torch.randn(batch, 1, H, D, dtype=torch.bfloat16, device="cuda")
                if page:
                    per = -(-keys // page)
                    k_cache = torch.randn(batch * per, page, HKV, D, dtype=torch.bfloat16, device="cuda")
                    table = torch.randperm(batch * per, device="cuda").reshape(batch, per).to(torch.int32)
                else:
                    k_cache = torch.randn(batch, keys, HKV, D, dtype=torch.bfloat16, device="cuda")
                    table = None
                v_cache = torch.randn_like(k_cache)
                lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
                out = torch.empty_like(q)
                lse = torch.empty(batch, H, 1, dtype=torch.float32, device="cuda")
                ref = None
                kv_bytes = batch * keys * HKV * 2 * D * 2
                for n in (0, 1):  # what the API plans on this GPU, and unsplit
                    api = _graphed(api_call(q, k_cache, v_cache, lens, table, n))
                    ms = triton.testing.do_bench(api, warmup=10, rep=60, return_mode="median")
                    print(f"page={page} B={batch} keys={keys} flash_attn_with_kvcache num_splits={n}: "
                          f"{kv_bytes / (ms * 1e-3) / 1e12:.2f} TB/s", flush=True)
                for tiles, splits in runs:
                    call, plan = run_candidate(tiles, splits, q, k_cache, v_cache, lens, table, out, lse)
                    if call is None:
                        continue
                    out.fill_(float("nan"))
                    call()
                    if ref is None:
                        ref = out.clone()
                    err = (out.float() - ref.float()).abs().max().item()
                    ms = triton.testing.do_bench(_graphed(call), warmup=10, rep=60, return_mode="median")
                    print(f"page={page} B={batch} keys={keys} tiles={plan.config.tiles} "
                          f"splits={plan.num_splits}: "
                          f"{kv_bytes / (ms * 1e-3) / 1e12:.2f} TB/s  max|diff| {err:.1e}", flush=True)
                del k_cache, v_cache
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
