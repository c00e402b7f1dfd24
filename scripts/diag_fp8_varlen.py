"""Developer probe (issue 5): the varlen FP8 forward on sequence lengths given on the command line,
against the reference; run one case per process (a fault poisons the CUDA context)."""

from __future__ import annotations

import math
import sys

import torch

from cute_flash.fp8_ref import attention_fp8_varlen_ref, quantize_qkv_ref, v_varlen_aligned
from cute_flash.fwd_fp8 import run_fwd_fp8


def main(lens_q: list[int], lens_k: list[int], d: int = 128, causal: bool = False) -> None:
    torch.manual_seed(0)
    h, hkv = 4, 2
    parts = [quantize_qkv_ref(*(torch.randn(1, n, heads, d, device="cuda") for n, heads in
                                ((a, h), (b, hkv), (b, hkv))), rotate_qk=True, seed=3)
             for a, b in zip(lens_q, lens_k, strict=True)]
    q8, k8, v8 = (torch.cat([p[i][0].view(torch.uint8) for p in parts]).view(torch.float8_e4m3fn)
                  for i in range(3))
    qd, kd, vd = (torch.cat([p[i] for p in parts]) for i in range(3, 6))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for x in (lens_q, lens_k))
    out = torch.full((q8.shape[0], h, d), float("nan"), device="cuda", dtype=torch.bfloat16)
    lse = torch.full((h, q8.shape[0]), float("nan"), device="cuda")
    v_store, cu_v = v_varlen_aligned(v8, cu_k)
    run_fwd_fp8(q8, k8, v_store, qd, kd, vd, out, lse, softmax_scale=1 / math.sqrt(d), causal=causal,
                cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q), cu_seqlens_v=cu_v)
    torch.cuda.synchronize()
    ref, _ = attention_fp8_varlen_ref(q8, k8, v8, cu_q, cu_k, qd, kd, vd, softmax_scale=1 / math.sqrt(d),
                                      causal=causal)
    print("max err", (out.float() - ref).abs().max().item(), "ref max", ref.abs().max().item())


if __name__ == "__main__":
    lq, lk = ([int(x) for x in a.split(",")] for a in sys.argv[1:3])
    main(lq, lk, int(sys.argv[3]) if len(sys.argv) > 3 else 128, len(sys.argv) > 4 and sys.argv[4] == "1")
