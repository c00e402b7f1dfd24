"""Forward tile sweep on the GPU (developer tool): TFLOP/s of each (tile_m, tile_n, threads)
candidate against SDPA-flash in the same run. Usage: python scripts/tune/tune_fwd.py [d ...]"""

import math
import sys

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

from cute_flash import jit
from cute_flash.ampere.config import FwdConfig

CANDIDATES = {
    32: [(128, 64, 128, 1), (128, 64, 128, 2), (128, 128, 128, 2), (64, 128, 128, 2)],
    64: [(64, 128, 128, 1), (64, 128, 128, 2), (128, 64, 128, 2), (128, 128, 256, 2)],
    96: [(128, 32, 128, 1), (128, 32, 128, 2), (64, 64, 128, 2), (128, 64, 256, 2)],
    128: [(128, 128, 256, 1), (128, 128, 256, 2), (64, 64, 128, 2), (64, 128, 128, 2), (128, 64, 256, 2)],
    192: [(64, 64, 128, 1), (64, 64, 128, 2), (128, 64, 256, 2)],
    256: [(64, 64, 128, 1), (64, 64, 128, 2), (128, 64, 256, 2), (64, 32, 128, 2)],
}


def main() -> None:
    hdims = [int(a) for a in sys.argv[1:]] or [128]
    N = 4096
    for d in hdims:
        H = 2048 // d
        B = 16384 // N
        q, k, v = (torch.randn(B, N, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)
        lse = torch.empty(B, H, N, device="cuda", dtype=torch.float32)
        for causal in (False, True):
            flops = 4 * B * H * N * N * d / (2 if causal else 1)
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

            def sdpa_call(qt=qt, kt=kt, vt=vt, causal=causal):
                return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ms = triton.testing.do_bench(sdpa_call, return_mode="median")
            sdpa = flops / ms / 1e9
            print(f"d={d} causal={causal} SDPA-flash {sdpa:.0f} TFLOP/s", flush=True)
            for tiles in CANDIDATES.get(d, []):
                cfg = FwdConfig(target=None, dtype="bf16", hdim=d, hdim_v=d, causal=causal, tiles=tiles)
                try:
                    fn = jit.compile_kernel(cfg)
                except Exception as e:  # a candidate that doesn't compile is just skipped
                    print(f"  {tiles}: compile failed {e!r:.200}")
                    continue
                args = (q, k, v, out, lse, None, None, 1.0 / math.sqrt(d), 0.0, -1, -1, N, *[None] * 5)
                ms = triton.testing.do_bench(lambda fn=fn, args=args: fn(*args), return_mode="median")
                tf = flops / ms / 1e9
                print(f"  {tiles}: {tf:.0f} TFLOP/s ({tf / sdpa:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
