"""One backward pass of ours or flash-attn-4's, for Nsight Compute (developer tool): a few warm
passes so ``ncu --launch-skip`` lands on a warm main kernel.

    ncu --clock-control none -k regex:'FlashBwdSm90(Wide)?_object|FlashAttentionBackwardSm90' \\
        --launch-skip 2 --launch-count 1 --set full -o ours python scripts/ncu_bwd.py ours 64 2048 1
"""

import sys

import torch


def main() -> None:
    which, d, n, causal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4]))
    b, h = max(1, 16384 // n), 2048 // d
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    if which == "ours":
        from cute_flash import flash_attn_func
    else:
        from flash_attn.cute import flash_attn_func
    out = flash_attn_func(q, k, v, causal=causal)
    out = out[0] if isinstance(out, tuple) else out
    do = torch.randn_like(out)
    for _ in range(4):
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
