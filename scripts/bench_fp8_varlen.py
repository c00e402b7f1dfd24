"""Developer benchmark (issue 5): FP8 varlen and FP8 decode with packed GQA beside the dense /
bf16 paths, through the public API (TFLOP/s, median of do_bench)."""

from __future__ import annotations

import torch
import triton.testing

from cute_flash import flash_attn_func, flash_attn_varlen_func, quantize_qkv


def bench(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))


def varlen(d: int, n: int, seqs: int, causal: bool) -> None:
    h = 2048 // d
    lens = [n - 7 * i for i in range(seqs)]  # unequal, not multiples of 16
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q, k, v))
    flops = sum(4 * h * x * x * d for x in lens) / (2 if causal else 1)
    f8 = bench(lambda: flash_attn_varlen_func(q8, k8, v8, cu, cu, n, n, causal=causal))
    bf = bench(lambda: flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=causal))
    e2e = bench(lambda: flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=causal, fp8=True))
    # Dense B = seqs x N = n e4m3 (a caller's V, re-laid into the kernel order) for comparison.
    xd = [torch.randn(seqs, n, h, d, device="cuda", dtype=torch.bfloat16).to(torch.float8_e4m3fn)
          for _ in range(3)]
    dense = bench(lambda: flash_attn_func(*xd, causal=causal))
    tf = [flops / t / 1e9 for t in (f8, bf, e2e)]
    tf_dense = 4 * seqs * h * n * n * d / (2 if causal else 1) / dense / 1e9
    print(f"varlen d={d} {seqs}x~{n} causal={int(causal)}: fp8 {tf[0]:.0f} bf16 {tf[1]:.0f} "
          f"quant+fp8 {tf[2]:.0f} TFLOP/s; dense fp8 {seqs}x{n} (caller V) {tf_dense:.0f}")


def decode(d: int, nk: int, b: int, h: int, hkv: int) -> None:
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q8, k8, v8, qd, kd, vd = quantize_qkv(q, k, v)
    f8 = bench(lambda: flash_attn_func(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd))
    bf = bench(lambda: flash_attn_func(q, k, v))
    kv_bytes = 2 * b * nk * hkv * d  # e4m3 K and V; twice that in bf16
    print(f"decode d={d} B={b} Nk={nk} H={h}/{hkv}: fp8 {f8 * 1e3:.1f} us ({kv_bytes / f8 / 1e6:.0f} GB/s of "
          f"K+V), bf16 {bf * 1e3:.1f} us ({2 * kv_bytes / bf / 1e6:.0f} GB/s)")

if __name__ == "__main__":
    for d in (128, 256):
        for causal in (False, True):
            varlen(d, 2048, 8, causal)
    decode(128, 8192, 16, 32, 8)
    decode(128, 32768, 4, 32, 4)
