"""What compute-sanitizer's racecheck takes as ordering between threads and async copies.

One CTA, one smem buffer of 128 fp32, one mbarrier, and a correct hand-off in three forms: warp 0
fills the buffer -- ``bulk``: one cp.async.bulk completing on the mbarrier (how the sm90 backward
loads LSE2 / D); ``tma``: the same through a 1-D TMA tensor copy; ``sts``: plain stores, then an
mbarrier arrive (how consumers hand a stage back to the producer) -- and warp 1 waits on the
mbarrier's phase and reads the buffer with ld.shared. All three are ordered by the PTX memory
model (complete-tx / arrive have release semantics, try_wait acquire), and each copies exactly.

Measured on the H200 (compute-sanitizer 2025.3.1): ``bulk`` and ``tma`` 0 hazards, ``sts`` a
hazard on every store. racecheck orders an async copy before the waiters of the mbarrier it
completes on, but not a thread's accesses before another thread's across an mbarrier
arrive -> wait; ``scripts/sanitize.sh`` prints the three verdicts beside the kernels'.

    compute-sanitizer --tool racecheck python scripts/sanitize/racecheck_probe.py sts
"""

import sys

import cutlass
import cutlass.cute as cute
import torch
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import from_dlpack
from cutlass.memory import SmemAllocator

N = 128
MODES = ("bulk", "tma", "sts")


class HandOff:
    def __init__(self, mode: str) -> None:
        self.mode = mode

    @cute.jit
    def __call__(self, mX: cute.Tensor, mOut: cute.Tensor):
        tma, tX = None, mX
        if cutlass.const_expr(self.mode == "tma"):
            g2s = cpasync.CopyBulkTensorTileG2SOp()
            tma, tX = cpasync.make_tiled_tma_atom(g2s, mX, cute.make_layout(N), (N,))
        self.kernel(tX, mOut, tma).launch(grid=[1, 1, 1], block=[64, 1, 1], smem=N * 4 + 256)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mOut: cute.Tensor, tma: cute.CopyAtom | None):
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        alloc = SmemAllocator()
        bar = alloc.allocate_array(cutlass.Int64, 1)
        sX = alloc.allocate_tensor(Float32, cute.make_layout(N), 128)
        if tidx == 0:
            cute.arch.mbarrier_init(bar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.barrier()
        if warp == 0:
            self.fill(mX, sX, bar, tma, tidx)
        else:
            cute.arch.mbarrier_wait(bar, 0)
            for i in cutlass.range_constexpr(N // 32):
                mOut[tidx - 32 + 32 * i] = sX[tidx - 32 + 32 * i]

    @cute.jit
    def fill(self, mX, sX, bar, tma, tidx):
        if cutlass.const_expr(self.mode == "sts"):
            for i in cutlass.range_constexpr(N // 32):
                sX[tidx + 32 * i] = mX[tidx + 32 * i]
            cute.arch.sync_warp()
            if tidx == 0:
                cute.arch.mbarrier_arrive(bar)
        else:
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(bar, N * 4)
            if cutlass.const_expr(self.mode == "tma"):
                tXs, tXg = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(sX, 0, 1),
                                                 cute.group_modes(cute.local_tile(mX, (N,), (0,)), 0, 1))
                cute.copy(tma, tXg, tXs, tma_bar_ptr=bar)
            else:
                with cute.arch.elect_one():
                    cute.copy(cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32), mX, sX, mbar_ptr=bar)


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode not in MODES:
        print(f"usage: racecheck_probe.py {{{'|'.join(MODES)}}}")
        return 2
    x = torch.randn(N, device="cuda")
    out = torch.full((N,), float("nan"), device="cuda")
    args = [from_dlpack(t, assumed_align=16) for t in (x, out)]
    cute.compile(HandOff(mode), *args)(*args)
    torch.cuda.synchronize()
    ok = torch.equal(x, out)
    print(f"probe {mode}: {'copied exactly' if ok else 'WRONG COPY'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
