"""What one attention call asks of the kernels, as the per-family plans read it.

The compile-time part (dtype, head dims, masks, features) decides the kernel variant; the run-time
part (sequence extents, heads, the SM count) lets a plan pick launch-dependent fields such as a
persistent grid or packed GQA. A problem without extents (``max_seqlen_q is None``) is a
compile-only question: the plans then return their base variants (what ``inspect`` compiles).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    target: str | None  # compile target; None = the current device
    dtype: str  # "bf16" / "fp16" (the 16-bit inputs, or the FP8 forward's output type)
    hdim: int
    hdim_v: int
    causal: bool = False
    local: bool = False  # a sliding window (causal folded in when both are given)
    softcap: bool = False
    varlen: bool = False
    sinks: bool = False  # (H,) learnable sink logits join the forward's softmax
    mods: object = None  # a score_mod / mask_mod (``device/mods.py``: Mods), or None
    deterministic: bool = False
    dlse: bool = False  # the backward also gets the LSE output's gradient
    # Run-time extents (None: compile-only).
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    heads_q: int = 1
    heads_kv: int = 1
    batch: int = 1  # sequences (varlen: of the pack)
    num_sms: int = 132
    # Q in the dense (B, N, H, d) order (packed-GQA tiles were checked with that layout only).
    q_dense: bool = True

    @property
    def masked(self) -> bool:
        return self.causal or self.local

    @property
    def extents_known(self) -> bool:
        return self.max_seqlen_q is not None
