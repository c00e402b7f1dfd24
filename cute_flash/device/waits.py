"""mbarrier waits for the TMA pipelines (``cutlass.pipeline.PipelineTmaAsync``), shared by the
sm90 forward and backward.

The DSL's plain wait is a try_wait loop with a 10 ms suspend-time hint, which ptxas emits as
TRYWAIT + NANOSLEEP.SYNCS: a warp that finds the stage not ready is put to sleep and wakes up
late. ``spin=True`` polls try_wait without the hint instead (a bounded hardware wait per poll, as
CUTLASS C++'s barrier wait); ``spin=False`` keeps the DSL's wait, after one poll without the hint
for the consumers (flash-attn-4's order).
"""

import cutlass
import cutlass.cute as cute


@cute.jit
def spin(mbar_ptr, phase):
    ready = cute.arch.mbarrier_try_wait(mbar_ptr, phase)
    while not ready:
        ready = cute.arch.mbarrier_try_wait(mbar_ptr, phase)
    return ready


def wait_full(pipe, state, spin_wait: bool) -> None:
    """Consumer wait for a filled stage."""
    if cutlass.const_expr(spin_wait):
        pipe.consumer_wait(state, spin(pipe.sync_object_full.get_barrier(state.index), state.phase))
    else:
        pipe.consumer_wait(state, pipe.consumer_try_wait(state))


def acquire_empty(pipe, state, spin_wait: bool) -> None:
    """Producer wait for a free stage (then the expected-transaction arrive for its TMA)."""
    if cutlass.const_expr(spin_wait):
        pipe.producer_acquire(state, spin(pipe.sync_object_empty.get_barrier(state.index), state.phase))
    else:
        pipe.producer_acquire(state)
