"""Quick backward check on a GPU against fp32 autograd of a dense reference (developer smoke test;
the full grid lives in tests/test_gpu_correctness.py). One line per case; non-zero exit on a
mismatch."""

import math
import sys
import time

import torch

from cute_flash.bwd import run_bwd
from cute_flash.fwd import run_fwd

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from smoke_fwd import ref  # noqa: E402


def case(B, Nq, Nk, H, Hkv, d, dtype, causal=False, window=(-1, -1), softcap=0.0, deterministic=False):
    q = torch.randn(B, Nq, H, d, device="cuda", dtype=dtype)
    k = torch.randn(B, Nk, Hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(B, Nk, Hkv, d, device="cuda", dtype=dtype)
    dout = torch.randn(B, Nq, H, d, device="cuda", dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    lse = torch.empty(B, H, Nq, device="cuda", dtype=torch.float32)
    run_fwd(q, k, v, out, lse, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    t = time.time()
    run_bwd(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=scale, causal=causal, window_size=window,
            softcap=softcap, deterministic=deterministic)
    torch.cuda.synchronize()
    ms = (time.time() - t) * 1e3
    grads = {}
    for upcast in (True, False):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        o, _ = ref(qq, kk, vv, scale, causal, window, softcap, upcast=upcast)
        o.backward(dout.float())
        grads[upcast] = (qq.grad.float(), kk.grad.float(), vv.grad.float())
    ok = True
    msg = []
    for name, ours, r32, rlo in zip("qkv", (dq, dk, dv), grads[True], grads[False], strict=True):
        e = (ours.float() - r32).abs().max().item()
        elo = (rlo - r32).abs().max().item()
        good = not math.isnan(e) and e <= 2 * elo + 1e-3
        ok &= good
        msg.append(f"d{name} {e:.1e}/{elo:.1e}{'' if good else '!'}")
    print(f"{'OK ' if ok else 'BAD'} B={B} Nq={Nq} Nk={Nk} H={H}/{Hkv} d={d} {dtype} causal={causal} "
          f"win={window} cap={softcap} det={deterministic}: {' '.join(msg)} ({ms:.0f} ms)", flush=True)
    return ok


def main() -> int:
    torch.manual_seed(int(time.time()))
    cases = [
        dict(B=2, Nq=256, Nk=256, H=4, Hkv=4, d=128, dtype=torch.bfloat16),
        dict(B=2, Nq=113, Nk=1000, H=4, Hkv=2, d=128, dtype=torch.bfloat16),
        dict(B=1, Nq=1000, Nk=113, H=4, Hkv=1, d=64, dtype=torch.float16, causal=True),
        dict(B=2, Nq=512, Nk=512, H=4, Hkv=4, d=32, dtype=torch.bfloat16, causal=True),
        dict(B=2, Nq=300, Nk=700, H=4, Hkv=4, d=96, dtype=torch.bfloat16, window=(64, 32)),
        dict(B=2, Nq=300, Nk=300, H=4, Hkv=4, d=160, dtype=torch.float16, window=(-1, 16)),
        dict(B=2, Nq=257, Nk=513, H=4, Hkv=4, d=192, dtype=torch.bfloat16, softcap=30.0),
        dict(B=1, Nq=333, Nk=333, H=2, Hkv=2, d=256, dtype=torch.bfloat16, causal=True),
        dict(B=2, Nq=17, Nk=17, H=2, Hkv=2, d=128, dtype=torch.bfloat16, window=(4, -1)),
        dict(B=2, Nq=200, Nk=300, H=4, Hkv=2, d=64, dtype=torch.bfloat16, deterministic=True),
    ]
    results = []
    for c in cases:
        try:
            results.append(case(**c))
        except Exception as e:  # keep going: one broken variant must not hide the others
            print("ERR", c, repr(e)[:800], flush=True)
            results.append(False)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
