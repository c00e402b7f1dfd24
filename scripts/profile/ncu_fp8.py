"""A few FP8 forward passes (d, N, causal from argv; V in the kernel order), for Nsight Compute
(developer tool): ``ncu --launch-skip 2 --launch-count 1 -k regex:FlashFwdSm90Fp8``."""

import math
import sys

import torch

from cute_flash.launch import quantize_qkv, run_fwd_fp8


def main() -> None:
    d, n, causal = int(sys.argv[1]), int(sys.argv[2]), bool(int(sys.argv[3]))
    b, h = max(1, 16384 // n), 2048 // d
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    t8p = quantize_qkv(q, k, v, rotate=True, v_perm=True)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, n, device="cuda")
    for _ in range(5):
        run_fwd_fp8(*t8p, out, lse, softmax_scale=1.0 / math.sqrt(d), causal=causal, v_perm=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
