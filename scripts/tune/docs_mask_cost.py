"""Where a packed-documents forward's time goes (developer tool): ``benchmarks/mods.py``'s causal
16k pack of 9 documents through the same block mask with three mask_mods that keep the same keys
(document ids compared per key; each query's document start, read per row only; and no mask work
at all, ``kv_idx >= 0``, which keeps more keys on the partial blocks but costs nothing), against
our varlen path over the same documents. The gap between the first and the last of the three is
what the mask_mod costs; between the last and varlen, what the block mask's tiles cost.
Usage: python scripts/tune/docs_mask_cost.py [--rounds 3]"""

import argparse
import statistics

import cutlass.cute as cute
import torch

import cute_flash
from cute_flash.device import mods as m

H, D = 16, 128


def starts_mask(at: int = 0) -> m.Mod:
    """Keys at or after the query's document start: aux[at] (B, N) int32 start per position."""
    @cute.jit
    def mask_mod(b, h, q_idx, kv_idx, aux):
        return kv_idx >= aux[at][b, q_idx]

    def torch_mod(b, h, q_idx, kv_idx, aux):
        return kv_idx >= aux[at][b, q_idx]
    return m.Mod(mask_mod, torch_mod)


def no_work() -> m.Mod:
    @cute.jit
    def mask_mod(b, h, q_idx, kv_idx, aux):
        return kv_idx >= 0

    def torch_mod(b, h, q_idx, kv_idx, aux):
        return kv_idx >= 0
    return m.Mod(mask_mod, torch_mod)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = 16384
    lens = [1024, 3000, 512, 2048, 4096, 777, 1500, 2000, 1427]
    lens[-1] += n - sum(lens)
    dev = "cuda"
    ids = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
    ids = ids.to(torch.int32).view(1, -1)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    starts = cu[:-1].repeat_interleave(torch.tensor(lens, device=dev)).view(1, -1).to(torch.int32)
    q, k, v = (torch.randn(1, n, H, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    doc = m.document()
    block = cute_flash.create_block_mask(doc, 1, None, n, n, device=dev, aux=(ids,))
    calls = {
        "document ids": dict(mask_mod=doc, aux=(ids,)),
        "document starts": dict(mask_mod=starts_mask(), aux=(starts,)),
        "no mask work": dict(mask_mod=no_work(), aux=()),
    }
    fns = {name: (lambda kw=kw: cute_flash.flash_attn_func(q, k, v, causal=True, block_mask=block, **kw))
           for name, kw in calls.items()}
    fns["varlen"] = lambda: cute_flash.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, max(lens), max(lens),
                                                             causal=True)
    want = fns["document ids"]()
    got = fns["document starts"]()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    from triton.testing import do_bench

    times: dict[str, list[float]] = {p: [] for p in fns}
    names = list(fns)
    with torch.no_grad():
        for r in range(args.rounds):
            for p in names[r % len(names):] + names[:r % len(names)]:
                times[p].append(do_bench(fns[p], warmup=10, rep=60, return_mode="median"))
    flops = 4 * H * sum(x * (x + 1) // 2 for x in lens) * D
    for p, t in times.items():
        ms = statistics.median(t)
        print(f"{p}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
