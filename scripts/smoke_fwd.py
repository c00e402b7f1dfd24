"""Quick forward check on a GPU against a dense fp32 reference (developer smoke test; the full
grid lives in tests/test_gpu_correctness.py). Prints one line per case and exits non-zero on a
mismatch."""

import math
import sys
import time

import torch

from cute_flash.fwd import run_fwd


def ref(q, k, v, scale, causal, window, softcap, upcast=True):
    dt = torch.float32 if upcast else q.dtype
    q, k, v = (t.to(dt) for t in (q, k, v))
    B, Nq, H, d = q.shape
    Nk, Hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(H // Hkv, dim=2)
    v = v.repeat_interleave(H // Hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k).float() * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Nq, device=q.device)[:, None]
    j = torch.arange(Nk, device=q.device)[None, :]
    left, right = window
    if causal:
        right = 0
    ok = torch.ones(Nq, Nk, dtype=torch.bool, device=q.device)
    if right >= 0:
        ok &= j <= i + Nk - Nq + right
    if left >= 0:
        ok &= j >= i + Nk - Nq - left
    s = s.masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("bhqk,bkhd->bqhd", p.to(dt), v).to(torch.float32)
    return o, lse


def case(B, Nq, Nk, H, Hkv, d, dtype, causal=False, window=(-1, -1), softcap=0.0):
    q = torch.randn(B, Nq, H, d, device="cuda", dtype=dtype)
    k = torch.randn(B, Nk, Hkv, d, device="cuda", dtype=dtype)
    v = torch.randn(B, Nk, Hkv, d, device="cuda", dtype=dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((B, H, Nq), float("nan"), device="cuda", dtype=torch.float32)
    scale = 1.0 / math.sqrt(d)
    t = time.time()
    run_fwd(q, k, v, out, lse, softmax_scale=scale, causal=causal, window_size=window, softcap=softcap)
    torch.cuda.synchronize()
    dt_ms = (time.time() - t) * 1e3
    o_ref, lse_ref = ref(q, k, v, scale, causal, window, softcap)
    o_lo, _ = ref(q, k, v, scale, causal, window, softcap, upcast=False)
    err = (out.float() - o_ref).abs().max().item()
    err_lo = (o_lo.to(dtype).float() - o_ref).abs().max().item()
    fin = torch.isfinite(lse_ref)
    lse_err = (lse[fin] - lse_ref[fin]).abs().max().item() if fin.any() else 0.0
    lse_inf_ok = bool((lse[~fin] == float("-inf")).all())
    ok = (not math.isnan(err)) and err <= 2 * err_lo + 1e-3 and lse_err < 1e-2 and lse_inf_ok
    print(f"{'OK ' if ok else 'BAD'} B={B} Nq={Nq} Nk={Nk} H={H}/{Hkv} d={d} {dtype} causal={causal} "
          f"win={window} cap={softcap}: err={err:.2e} torch_err={err_lo:.2e} lse_err={lse_err:.2e} "
          f"inf_ok={lse_inf_ok} ({dt_ms:.0f} ms incl. compile)", flush=True)
    return ok


def main() -> int:
    torch.manual_seed(int(time.time()))
    cases = [
        dict(B=2, Nq=256, Nk=256, H=4, Hkv=4, d=128, dtype=torch.bfloat16),
        dict(B=2, Nq=113, Nk=1000, H=4, Hkv=2, d=128, dtype=torch.bfloat16),
        dict(B=1, Nq=1000, Nk=113, H=4, Hkv=1, d=64, dtype=torch.float16, causal=True),
        dict(B=2, Nq=1, Nk=4224, H=8, Hkv=8, d=256, dtype=torch.bfloat16),
        dict(B=2, Nq=512, Nk=512, H=4, Hkv=4, d=32, dtype=torch.bfloat16, causal=True),
        dict(B=2, Nq=300, Nk=700, H=4, Hkv=4, d=96, dtype=torch.bfloat16, window=(64, 32)),
        dict(B=2, Nq=300, Nk=300, H=4, Hkv=4, d=160, dtype=torch.float16, window=(-1, 16)),
        dict(B=2, Nq=257, Nk=513, H=4, Hkv=4, d=192, dtype=torch.bfloat16, softcap=30.0),
        dict(B=2, Nq=17, Nk=17, H=2, Hkv=2, d=128, dtype=torch.bfloat16, window=(4, -1)),
    ]
    results = []
    for c in cases:
        try:
            results.append(case(**c))
        except Exception as e:  # keep going: one broken variant must not hide the others
            print("ERR", c, repr(e)[:500], flush=True)
            results.append(False)
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
