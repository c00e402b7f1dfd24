"""One backward pass of ours (``fp8``: the FP8 one) or flash-attn-4's, for Nsight Compute
(developer tool): a few warm passes so ``ncu --launch-skip`` lands on a warm main kernel.

    ncu --clock-control none -k regex:'FlashBwdSm90(Wide)?_object|FlashAttentionBackwardSm90' \\
        --launch-skip 2 --launch-count 1 --set full -o ours python scripts/profile/ncu_bwd.py ours 64 2048 1

A fifth argument ("tile_m=80,mask_always=1") profiles our kernel with those ``BwdSm90Config``
overrides (``launch.run_bwd`` called directly, as ``scripts/tune/tune_bwd_sm90.py`` does).
"""

import sys

import torch


def main() -> None:
    which, d, n, causal = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), bool(int(sys.argv[4]))
    overrides = None
    if len(sys.argv) > 5:
        overrides = {kv.split("=")[0]: int(kv.split("=")[1]) for kv in sys.argv[5].split(",")}
    b, h = max(1, 16384 // n), 2048 // d
    if which == "ours" and overrides:
        from cute_flash.launch import run_bwd, run_fwd

        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        out, lse = torch.empty_like(q), torch.empty(b, h, n, device="cuda", dtype=torch.float32)
        run_fwd(q, k, v, out, lse, softmax_scale=d ** -0.5, causal=causal, window_size=(-1, -1), softcap=0.0)
        grads = [torch.empty_like(t) for t in (q, k, v)]
        for _ in range(4):
            run_bwd(do, q, k, v, out, lse, *grads, family="sm90", softmax_scale=d ** -0.5, causal=causal,
                    deterministic=False, overrides=overrides)
        torch.cuda.synchronize()
        return
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    if which in ("ours", "fp8"):
        from cute_flash import flash_attn_func
    else:
        from flash_attn.cute import flash_attn_func
    out = flash_attn_func(q, k, v, causal=causal, **({"fp8": True} if which == "fp8" else {}))
    out = out[0] if isinstance(out, tuple) else out
    do = torch.randn_like(out)
    for _ in range(4):
        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
