"""sm90a backward configs: the FA3-style main kernels (``hopper/bwd.py`` for d <= 128,
``hopper/bwd_wide.py`` for d >= 192), the dQ postprocess (``hopper/bwd_postprocess.py``), their
tables and the plan of one problem.

The preprocess is the sm80 one (LSE2, D, zeroed dQ accumulator over the same padded scratch rows);
the main kernel adds dQ into the accumulator in its MMA fragment order and the sm90 postprocess
converts it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cute_flash import jit, signatures
from cute_flash.ampere.bwd_preprocess import pre_threads_per_row
from cute_flash.ampere.config import BwdPreConfig
from cute_flash.device.tile_scheduler import section_size
from cute_flash.problem import Problem

# Scope of the main kernels (see their docstrings): head dims 64, 96, 128, 192 and 256 (= d_v) (GQA, causal,
# windows, varlen and deterministic mode included); softcap below.
#
# Query-block rows per head dim (FA3's choices): d=64 takes 128 query rows and splits the dQ GEMM
# over the warpgroups by rows; d=96 and 128 take 64 and split dQ by columns (48 / 64 each). Either
# way each consumer warpgroup holds S^T and dP^T of 64 keys x tile_m queries plus dK, dV of 64 keys
# x d. d = 192 and 256 take 96 / 64 keys per CTA with dK^T / dV^T (head dim on M;
# ``hopper/bwd_wide.py``): at d = 192, 96 keys (48 per warpgroup, FA3's tile) still fit 240
# registers and two Q / dO stages; at d = 256, 80 keys would need 228 KiB of smem.
# (d = 96 / 192 need the kernel launched with .minnctapersm 1, see FlashBwdSm90.__call__.)
SM90_BWD_TILE_M = {64: 128, 96: 64, 128: 64, 192: 64, 256: 64}
SM90_BWD_TILE_N = {64: 128, 96: 128, 128: 128, 192: 96, 256: 64}
# The dQ writer warp (``BwdSm90Config.dq_warp``), measured on the H200 at N = 8k: at d = 256 it
# is worth its 64 KiB of smem even with a single Q / dO stage (+9% / +10% non-causal / causal);
# at d = 192 (single stage too) only for causal (441 -> 416 non-causal, 400 -> 416-431 causal) --
# superseded where d_v = d by ``SM90_BWD_DO_STAGES`` (2 Q + 1 dO stage with the writer); at
# (192, 128), where two stages still fit beside it, 408 -> 439 non-causal.
SM90_BWD_DQ_WARP = {64: True, 96: True, 128: True, 192: False, 256: True}
SM90_BWD_DQ_WARP_CAUSAL = {192: True}
SM90_BWD_DQ_WARP_NARROW_V = {(192, 128): True}
# Softcap's 1 - tanh^2 factor needs registers the 96-key d = 192 tile does not have (8 bytes of stack),
# nor d = 64's 128-query blocks (S^T and dP^T of 64 keys x 128 queries are 128 of the 240; it spilled
# 10-72 with every switch): there 64-query blocks, 168 registers, no stack.
SM90_BWD_TILE_N_SOFTCAP = {192: 64}
SM90_BWD_TILE_M_SOFTCAP = {64: 64}
SM90_BWD_HDIMS = tuple(SM90_BWD_TILE_M)
SM90_SMEM_BYTES = 227 * 1024
# d_v != d: (192, 128) (DeepSeek-style MLA prefill heads) in the wide kernel, whose dV^T keeps the
# head dim on M, so a narrower V only shortens it (48 fp32 registers instead of 72).
SM90_BWD_NARROW_V = {192: 128}
SM90_BWD_GPU_CHECKED_V: tuple = ((192, 128),)
# Softcap: d = 64 (64-query blocks) / 96 / 128 (narrow kernel; 7 spill stores at d = 128 without
# ds_stmatrix, none with it) and d = 192 / 256 (wide kernel, none). Autograd takes the sm90 kernels
# only for what has passed the GPU suite.
SM90_BWD_SOFTCAP_HDIMS = (64, 96, 128, 192, 256)
SM90_BWD_SOFTCAP_GPU_CHECKED = (64, 96, 128, 192, 256)
# Head dims that have passed the GPU suite (a new one stays forced-only until it has).
SM90_BWD_GPU_CHECKED = (64, 96, 128, 192, 256)
# The session-6 switches (after flash-attn-4's backward), measured on the H200 in session 7
# (``scripts/tune_bwd_sm90.py``, N = 2k / 8k / 16k, TFLOP/s; docs/notes.md) and on where they won.
# Keyed by (d, masked), masked = causal or a window; anything not listed keeps the switch off.
# - PDL everywhere: the main kernel's launch and K / V loads overlap the preprocess (+1-4% at 2k).
# - dQ postprocess staged through smem where it partitions (d 64 / 128 / 256): +4-6% at 2k.
# - d = 128 non-causal also reads LSE2 / D under the wgmmas and batches the dQ writer, with
#   stmatrix dK / dV: 492 / 578 / 575 -> 532 / 595 / 600. Causal keeps the statistics after the
#   waits (prefetching cost 1-2%): 410 / 521 / 575 -> 438 / 529 / 576.
# - d = 64: the batched writer and stmatrix dK / dV only non-causal (443 / 501 / 508 ->
#   448 / 513 / 518; causal they lost 3-5% at 8k / 16k).
SM90_BWD_PDL = True
# ``mask_always`` by (head dim, softcap), session 17 (one run, 3 rounds, TFLOP/s, N = 2k / 8k,
# non-causal | causal): d = 64 452 / 507 | 388 / 484 -> 475 / 527 | 409 / 504 (flash-attn-4 475 /
# 527 | 404 / 499); d = 192 439 / 472 | 398 / 475 -> 447 / 485 | 400 / 478. GPU-tested as a switch
# on d = 64 / 128 / 192 / 256 cases (causal, windows, GQA, softcap in the wide kernel). d = 128,
# session 18 (N = 2k / 8k / 16k): 516 / 585 / 598 | 455 / 561 / 582 -> 526 / 579 / 591 | 445 / 561 /
# 590, noise (the d = 64 default against itself moved up to 3% in the same run): off. d = 64 with
# softcap (64-query blocks) and d = 256 not measured: off there. d = 96, session 19 (5 rounds,
# N = 2k / 4k / 8k / 16k, non-causal | causal, flash-attn-4 in the same run): 461 / 500 / 521 /
# 529 | 399 / 465 / 496 / 525 -> 488 / 521 / 536 / 543 | 418 / 484 / 513 / 529 (with
# ``ds_before_dv`` causal; flash-attn-4 492 / 533 / 542 / 551 | 410 / 476 / 504 / 526).
SM90_BWD_MASK_ALWAYS = {(64, False), (96, False), (192, False), (192, True)}
# ``ds_before_dv`` by (head dim, causal or window), session 19 (5 rounds, TFLOP/s): on at d = 96
# causal with ``mask_always`` (4k 474 -> 484 over ``mask_always`` alone; non-causal 543 -> 534 at
# 16k, so not there). d = 64 and d = 128: within noise (+-2%, d = 128 causal 16k 595 -> 590).
SM90_BWD_DS_BEFORE_DV = {(96, True)}
# Non-causal d = 128 from 2k query rows: flash-attn-4's 80-query tile with the 64-row tile's
# switches (``long_rows_overrides``). Session 19 (TFLOP/s, ours 64 -> 80, flash-attn-4): 16k
# 597 -> 612 (592), 594 -> 602 (602); 8k 597 -> 596, 586 -> 577; 4k 570 -> 568; 2k 532 -> 524,
# with the 80-row postprocess still storing dQ^T element by element (75 vs 49 us at B.N = 16k).
# Session 20, with it staged through smem (7 rounds, one call): 2k 527 -> 533 (537), 4k 565 ->
# 576 (580), 8k 581 -> 592 (602). Nsight Compute, 16k: 8.03 -> 7.87 ms (flash-attn-4 7.82); 4k
# main kernel 2065 -> 2039 us (2039), though a later call had it 2055 -> 2099 (2067).
SM90_BWD_LONG_ROWS = {128: (2048, dict(tile_m=80, ds_stmatrix=True, dq_writer_batch=True, dkv_stmatrix=True,
                                        mask_always=True))}
# dQ out of the postprocess through smem (stmatrix in, 16-byte rows out). d = 96 / 192 since
# session 17 (half-width swizzle atoms), one run, TFLOP/s, N = 2k / 8k, non-causal | causal:
# d = 192 426 / 478 | 368 / 469 -> 439 / 482 | 389 / 479; d = 96 451 / 519 | 383 / 500 -> 471 /
# 526 | 404 / 506.
SM90_BWD_POST_STAGE_HDIMS = (64, 96, 128, 192, 256)
# Session 11 (one run, TFLOP/s, N = 2k / 8k): prefetching at d = 128 causal now wins, 431 -> 455,
# 518 -> 546 (flash-attn-4 451 / 555; it cost 1-2% in session 7, before the split loads and
# polling waits). Nsight Compute had shown the FFMAs of the exponentials' arguments waiting on
# their LSE2 loads (short scoreboard: 25.6k samples against flash-attn-4's 1.6k). (flash-attn-4's
# other way, each lane loading 2 of every 64 queries' values and shuffling the rest, was built and
# measured 1-4% slower at d = 128 and spilled at d = 64, serialising every wgmma: removed, see
# docs/notes.md.)
SM90_BWD_PREFETCH_STATS = {(128, False), (128, True)}
# The wide kernel (d >= 192), session 12: Nsight Compute at d = 192 causal 8k put 6.3k samples
# (2.3%) on the exponentials' first FFMAs waiting for their LSE2 loads (short scoreboard;
# flash-attn-4 ~0.4k). Its rows are queries, so the prefetch is 2 LSE2 + 2 D registers per
# thread. One run, TFLOP/s, N = 2k / 8k, non-causal | causal: d = 192 431 -> 434, 480 -> 489 |
# 370 -> 377, 456 -> 464; d = 256 400 -> 405, 431 -> 436 | 355 -> 364, 424 -> 446; (192, 128)
# 418 -> 415, 457 -> 463 | 348 -> 354, 428 -> 446. On.
SM90_BWD_WIDE_PREFETCH_STATS = True
SM90_BWD_DQ_WRITER_BATCH = {(128, False), (128, True), (64, False)}
SM90_BWD_DKV_STMATRIX = {(128, False), (128, True), (64, False)}
# (The wide kernel's transposing dK^T / dV^T stmatrix, session 11, beside stmatrix P / dS: d = 192
# 411 -> 417, 471 -> 468, causal 366 -> 371, 455 -> 450 (24 bytes of spills there); d = 256
# 398 -> 398, 431 -> 431, 355 -> 357, 434 -> 431. Noise: off.)
# Session 9 (``scripts/tune_bwd_sm90.py``, one run, TFLOP/s, default -> split loads + polling waits):
# d = 64 causal 2k 381 -> 396, 8k 465 -> 493, non-causal 2k 458 -> 477, 8k 516 -> 529; d = 128
# causal 2k 445 -> 447, 8k 525 -> 544, non-causal 543 -> 544, 598 -> 602. Either one alone moved
# nothing beyond the noise (381 -> 383 / 386 at d = 64 causal 2k): the split adds waits, and a
# sleeping wait wakes late.
SM90_BWD_SPLIT_LOADS = True
SM90_BWD_SPIN_WAITS = True
# Session 10, the wide kernel (one run, TFLOP/s, d = 256, default -> split loads + polling waits):
# causal 2k 336 -> 348, 8k 400 -> 419; non-causal 2k 374 -> 395, 8k 411 -> 419 (split loads alone
# within 1-2% of both together; polling alone 0-2.5%). d = 192 (one run): causal 2k 339 -> 349,
# 8k 426 -> 436, non-causal 383 -> 388, 432 -> 419 -- on there only with the tile below.
SM90_BWD_WIDE_SPLIT_HDIMS = (192, 256)
# d = 192 (d_v = d, not deterministic): flash-attn-4's 2 Q stages + 1 dO stage + the dQ writer
# warp (223 KB of smem) instead of 1 + 1 with the writer (causal) or 2 + 2 without (non-causal).
# One run, TFLOP/s, with split loads + polling: causal 2k 338 -> 355, 8k 423 -> 435; non-causal
# 382 -> 401, 428 -> 450 (flash-attn-4 406 / 495 / 464 / 499 in the same run).
SM90_BWD_DO_STAGES = {192: 1}
# Session 10, one run each (TFLOP/s, default -> switch): the persistent grid d = 64 causal 2k
# 381 -> 386, 8k 491 -> 465, non-causal 453 -> 446, 505 -> 490; d = 128 436 -> 423, 524 -> 523,
# 529 -> 511, 590 -> 566. The dS-staged epilogue alone: within +-3% (noise). Both off.
# Session 11, the wide kernel with stmatrix P / dS (one run, TFLOP/s, N = 2k / 8k): flash-attn-4's
# order of a block (``dq_before_dk``: P stored under the dP GEMM, dV under the dS store, dQ handed
# over under dK) with stmatrix dK^T / dV^T: d = 192 non-causal 398 -> 429, 466 -> 473, causal
# 359 -> 372, 450 -> 454 (the order alone 415 / 476 / 365 / 446). At d = 256 the order lost 15-20%
# (388 -> 309, 420 -> 340: the single Q stage is released only after the dQ hand-off), and with
# two Q / dO stages and no writer warp 393 -> 366, 432 -> 407, causal 349 -> 320, 423 -> 381.
# (192, 128): 412 -> 401, 462 -> 447, causal 334 -> 345, 433 -> 413. Off at both.
SM90_BWD_WIDE_FA4_ORDER = (192,)
SM90_BWD_DKV_VIA_DS = False
SM90_BWD_PERSISTENT = False
# Longest-first walk (``lpt``, causal): L2 budget of one section of heads (Q, dO, dQ accumulator).
SM90_BWD_LPT_L2_BYTES = 40 * 1024 * 1024
# Session 12 (``tune_bwd_sm90.py``, causal, TFLOP/s, full sections -> even ones): d = 128 8k
# 538 -> 571, 559 -> 589 (16 heads in 5s: 5 + 5 + 5 + 1 -> 4 x 4); d = 192 8k 444 -> 461,
# 450 -> 474, 439 -> 459 (10 heads in 3s: 3 + 3 + 3 + 1 -> 3 + 3 + 2 + 2); d = 64 8k (10 + 10 + 10
# + 2) 481 -> 483. A kernel that chose at run time (both walks compiled in) ran d = 128 4k, whose
# walk it left alone (10 + 6), at 546 -> 515, 549 -> 515, 518 -> 505: so the launcher chooses and
# the kernel compiles one walk.
SM90_BWD_LPT_BALANCED = True
# Deterministic mode (session 18, ``tune_bwd_sm90.py``, TFLOP/s, N = 2k / 8k, non-causal | causal;
# default deterministic -> with the writer -> writer + rotated walk; flash-attn-4's deterministic):
#   d = 64   277 / 346 | 273 / 330 -> 380 / 459 | 385 / 503 -> 465 / 510 | -   (fa4-det 464 / 517 | 399 / 509)
#   d = 96   284 / 327 | 263 / 314 -> 388 / 466 | 371 / 464 -> 430 / 465 | -   (420 / 480 | 344 / 435)
#   d = 128  331 / 386 | 285 / 349 -> 454 / 532 | 415 / 516 -> 484 / 531 | -   (497 / 570 | 416 / 525)
#   d = 192  290 / 338 | 252 / 318 -> 361 / 447 | 349 / 431 -> 406 / 339 | -   (403 / 472 | 312 / 410)
#   d = 256  232 / 280 | 219 / 261 -> 292 / 366 | 297 / 355 -> 340 / 375 | -   (264 / 285 | 234 / 269)
# The writer warp orders the adds (``dq_warp`` in deterministic mode too): +24-52% everywhere.
SM90_BWD_DET_WRITER = True
# Without masks, the rotated walk (``rotate_m``; ``scratch.rotated_add_rank``): key block n starts
# at query block n, so each query block's adders arrive one step apart instead of key block n
# waiting for n + 1 on every block (N - 1 steps of lag per head). The waits then chain through
# every key block of a head, so all must be resident at once: the launcher takes it only where a
# head's key blocks fit on the SMs (one CTA each), at the head dims where it measured faster
# (+2-22%; d = 192 8k lost 24%: its rotated walk also lost without determinism).
SM90_BWD_DET_ROTATE = (64, 96, 128, 256)
SM90_NUM_SMS_DEFAULT = 132
# Session 15 (``tune_bwd_sm90.py``, TFLOP/s, in order -> rotated query-block walk). First run, N =
# 8k / 16k, non-causal | causal: d = 256 437 -> 450, 438 -> 450 | 437 -> 443, 446 -> 456; d = 192
# 482 -> 494, 513 -> 512 | 474 -> 472, 496 -> 491; d = 128 and 64 (4k-16k) -1 to -4% everywhere
# but d = 64 non-causal 16k (517 -> 521): in order, the CTAs of a head read each Q / dO block close
# together in time (L2 hits), which the narrow kernel's shorter blocks feel more. Second run, d =
# 256, 5 rounds, N = 2k / 4k / 8k / 16k: non-causal 400 -> 411, 426 -> 443, 435 -> 448, 441 ->
# 440; causal 360 -> 353, 406 -> 403, 436 -> 430, 452 -> 457. Keyed by (d, masked).
SM90_BWD_ROTATE_M = {(256, False)}
# Preprocess CTA size: flash-attn-4's takes 256 threads and ran ~10 us faster at B.N = 16k
# (session 9 profile); 256 measured within noise at d = 64 / 128 causal 2k / 4k (session 10).
SM90_BWD_PRE_THREADS = 128


def sm90_bwd_covers(hdim: int, hdim_v: int, softcap: bool, forced: bool = False) -> bool:
    """Whether the sm90 backward runs this problem: under ``auto`` (``forced=False``) only what has
    been GPU-checked, under ``CUTE_FLASH_BWD_KERNEL=sm90`` everything it compiles."""
    if hdim not in SM90_BWD_HDIMS or hdim_v not in (hdim, SM90_BWD_NARROW_V.get(hdim)):
        return False
    if not forced and (hdim not in SM90_BWD_GPU_CHECKED
                       or (hdim_v != hdim and (hdim, hdim_v) not in SM90_BWD_GPU_CHECKED_V)):
        return False
    if softcap:
        return hdim in (SM90_BWD_SOFTCAP_HDIMS if forced else SM90_BWD_SOFTCAP_GPU_CHECKED)
    return True


@dataclass(frozen=True)
class BwdSm90Config(jit.KernelConfig):
    """``tile_n`` keys per CTA (64 per consumer warpgroup), query blocks of ``tile_m`` rows in a
    ``stages``-deep Q/dO pipeline."""

    dtype: str = "bf16"
    hdim: int = 128
    hdim_v: int = 0  # 0 = hdim
    causal: bool = False
    local: bool = False
    softcap: bool = False
    varlen: bool = False
    deterministic: bool = False
    # 0 = ``SM90_BWD_TILE_M``; 80 at d = 128 is FA3's non-causal tile (dQ^T computed with the head
    # dim on M, ``hopper.bwd.dq_swapab``): compiled with no spills, not yet GPU-checked.
    tile_m: int = 0
    tile_n: int = 0
    # Q / dO pipeline depth (0 = 2, or 1 where the dQ writer warp's tile needs the smem: d = 256).
    stages: int = 0
    # dO + D depth where it is below Q's (wide kernel with split loads; 0 = ``stages``):
    # flash-attn-4's d = 192 tile keeps two Q stages, one dO stage and the dQ writer warp.
    do_stages: int = 0
    # A producer-group warp adds each query block's dQ into the fp32 accumulator with one bulk
    # reduce-add from smem (None = ``SM90_BWD_DQ_WARP``; deterministic mode, and d = 192 without
    # ``SM90_BWD_DO_STAGES``'s tile, let the consumers issue vector reductions instead).
    dq_warp: bool | None = None
    # Narrow kernel schedule (after flash-attn-4's sm90 backward; None = on for d <= 128): issue dQ
    # before dK and hand the dQ tile over while dK runs; double-buffer dS per Q/dO stage (0 = the
    # Q/dO depth), dropping the consumers' EMPTY barrier before each dS store; store dS^T with
    # transposing stmatrix instead of 2-byte stores. Together +4-7% on the H200 (docs/notes.md).
    # ``ds_stmatrix`` in the wide kernel (d >= 192): P and dS to smem by stmatrix (+3-7% at
    # d = 192 / 256, session 11); ``dq_before_dk`` there: flash-attn-4's order of a block's smem
    # stores and GEMMs (``SM90_BWD_WIDE_FA4_ORDER``).
    dq_before_dk: bool | None = None
    ds_stages: int = 0
    ds_stmatrix: bool | None = None
    # Deterministic mode: K/V blocks add dQ in descending order (causal: 1.7-1.8x faster than
    # ascending on the H200, non-causal the same).
    det_descending: bool = True
    # Grid walked longest CTA first within L2-sized head groups (``FlashBwdSm90.longest_first``;
    # None = on for causal without varlen or deterministic mode, whose order it would break).
    lpt: bool | None = None
    # MiB of L2 one group of heads' Q / dO / dQ accumulator may take in that walk (0 = 40: every
    # head's key block n of a group runs before any n + 1, so a group's rows must stay in L2
    # for the ~5 waves it spans; smaller groups trade that for more group boundaries).
    lpt_l2_mib: int = 0
    # ``lpt`` over head sections of even size (``balanced_section_order``) instead of full ones and
    # a short last one. ``run_bwd_sm90`` turns it on where the last section would hold fewer than
    # half a section's heads (``lpt_last_section_short``; ``SM90_BWD_LPT_BALANCED``).
    lpt_balanced: bool = False
    # The walk's divisors set up once by the launcher (FastDivmod, ``section_walk_plan``) instead
    # of four or five integer divisions at every CTA's start (~900 cycles before the first TMA
    # at d = 64). False: the divisions in the kernel, for A/B runs.
    lpt_walk_plan: bool = True
    # Key block n starts at its n-th query block and wraps (``FlashBwdSm90.query_block``), so the
    # CTAs of a head are not all at the same query block at once. Not with deterministic mode (its
    # dQ order is the point). None = ``SM90_BWD_ROTATE_M`` (where it measured faster).
    rotate_m: bool | None = None
    # The switches below: None = the measured defaults (``SM90_BWD_PDL`` .. ``SM90_BWD_DKV_STMATRIX``).
    # Narrow kernel: read LSE2 / D into registers while the S^T / dP^T wgmmas run instead of after
    # their waits (flash-attn-4's order). Not with softcap (no registers left).
    prefetch_stats: bool | None = None
    # dQ writer warp: issue both warpgroups' reduce-adds, then release each chunk as it is read,
    # instead of waiting for the first chunk's read before taking the second (flash-attn-4's writer).
    dq_writer_batch: bool | None = None
    # Programmatic dependent launch: the main kernel may start while the preprocess still runs --
    # CTA launch, barrier init and the K / V loads overlap its tail -- and waits (griddepcontrol)
    # before it reads LSE2 / D or adds into the zeroed dQ accumulator (flash-attn-4 does this).
    pdl: bool | None = None
    # dK / dV to smem by stmatrix instead of 2-byte stores (narrow kernel: ours ran ~900
    # instructions per thread after the loop vs flash-attn-4's 182-265; wide kernel, session 11:
    # transposing stmatrix from dK^T / dV^T, 144 2-byte stores per thread at d = 192).
    dkv_stmatrix: bool | None = None
    # Postprocess: dQ through smem (stmatrix in, 16-byte row stores out) instead of 2- / 4-byte
    # stores from the fragment order (flash-attn-4 stages it too).
    post_stage_smem: bool | None = None
    # K and V on a barrier each, Q + LSE2 and dO + D on two pipelines, so the first S^T of a CTA
    # waits for K, Q and LSE2 alone (flash-attn-4's split) rather than all six loads. d_v = d only.
    # None = ``SM90_BWD_SPLIT_LOADS`` in the narrow kernel and at ``SM90_BWD_WIDE_SPLIT_HDIMS``.
    split_loads: bool | None = None
    # The dQ writer warp's last wait before the CTA exits: for its bulk reduce-adds' smem reads only
    # (flash-attn-4), not for the adds to complete.
    dq_exit_read_only: bool = True
    # mbarrier waits that poll (``kernels/waits.py``) instead of the DSL's sleeping wait, whose
    # late wake-ups cost the forward ~20 us per tile on its persistent grid. None =
    # ``SM90_BWD_SPIN_WAITS``.
    spin_waits: bool | None = None
    # Narrow kernel epilogue: dK / dV staged by stmatrix in the dS buffers instead of K's and V's
    # (``hopper/bwd_epilogue.py``), so K / V can be released before it. None = on with the
    # persistent grid, else ``SM90_BWD_DKV_VIA_DS``.
    dkv_via_ds: bool | None = None
    # Persistent grid (narrow kernel with split loads; not varlen or deterministic mode): ``num_ctas``
    # CTAs (the SM count, set by the launcher; 132 for the compile checks) stride over the K/V
    # tiles in the ``lpt`` section order. The producer loads the next tile's K / V as soon as the
    # consumers' last GEMMs of a tile are done and its Q / dO as stages free, so a tile's loads,
    # barrier set-up and CTA launch hide under the previous tile's epilogue and dQ hand-off. Built
    # to test whether that is the fixed cost per CTA seen at d = 64: +1% there, -1 to -5% elsewhere
    # (docs/notes.md), so off. None = ``SM90_BWD_PERSISTENT``.
    persistent: bool | None = None
    num_ctas: int = 0
    # Preprocess threads per CTA (0 = ``SM90_BWD_PRE_THREADS``; 128 where the thread rows would not
    # tile the query block).
    pre_threads: int = 0
    # Every block through the masked exponentials (flash-attn-4's loop) instead of a uniform
    # branch to an unmasked copy for interior blocks: one basic block, so ptxas may interleave P's
    # conversion, stores and barrier with the exponentials (the branch's join stops it), at one
    # compare-and-select per score. None = ``SM90_BWD_MASK_ALWAYS`` (d = 64, 96 and 192).
    mask_always: bool | None = None
    # Narrow kernel: dS^T to smem before dV's wgmma is issued, its proxy fence and barrier after
    # (flash-attn-4's order): the stores drain while dV's wgmmas issue instead of the fence waiting
    # for them (Nsight Compute, d = 128 causal 16k: fence + barrier + dQ's first wgmma held 10% of
    # the warps' stall samples, flash-attn-4's 2%). None = ``SM90_BWD_DS_BEFORE_DV``.
    ds_before_dv: bool | None = None

    kernel_name = "bwd_sm90"

    def __post_init__(self) -> None:
        if self.hdim not in SM90_BWD_HDIMS:
            raise ValueError(f"sm90 backward: head dim {self.hdim} not supported {SM90_BWD_HDIMS}")
        if not self.hdim_v:
            object.__setattr__(self, "hdim_v", self.hdim)
        if self.hdim_v not in (self.hdim, SM90_BWD_NARROW_V.get(self.hdim)):
            raise ValueError(f"sm90 backward: d_v = {self.hdim_v} with d = {self.hdim} (d_v = d, or "
                             f"{SM90_BWD_NARROW_V})")
        if not self.tile_m:
            tile_m = SM90_BWD_TILE_M[self.hdim]
            if self.softcap:
                tile_m = SM90_BWD_TILE_M_SOFTCAP.get(self.hdim, tile_m)
            object.__setattr__(self, "tile_m", tile_m)
        tile_n = SM90_BWD_TILE_N[self.hdim]
        if self.softcap:
            tile_n = SM90_BWD_TILE_N_SOFTCAP.get(self.hdim, tile_n)
        if not self.tile_n:
            object.__setattr__(self, "tile_n", tile_n)
        # (Deterministic mode too, where the writer orders its adds: the same stages as without.)
        if (self.hdim in SM90_BWD_DO_STAGES and self.hdim_v == self.hdim
                and (not self.deterministic or SM90_BWD_DET_WRITER or self.dq_warp)
                and self.split_loads is not False
                and not self.stages and not self.do_stages and self.dq_warp is not False):
            object.__setattr__(self, "dq_warp", True)
            object.__setattr__(self, "stages", 2)
            object.__setattr__(self, "do_stages", SM90_BWD_DO_STAGES[self.hdim])
        if self.dq_warp is None:
            dq_warp = SM90_BWD_DQ_WARP_NARROW_V.get((self.hdim, self.hdim_v), SM90_BWD_DQ_WARP[self.hdim])
            if self.causal:
                dq_warp = SM90_BWD_DQ_WARP_CAUSAL.get(self.hdim, dq_warp)
            # Deterministic mode: the writer orders the adds (``SM90_BWD_DET_WRITER``), else the
            # consumers order their own reductions.
            object.__setattr__(self, "dq_warp", dq_warp and (SM90_BWD_DET_WRITER or not self.deterministic))
        if not self.stages:
            object.__setattr__(self, "stages", 2)
            if self.smem_bytes() > SM90_SMEM_BYTES:
                object.__setattr__(self, "stages", 1)
        narrow = self.hdim <= 128
        self._resolve_switches(narrow)
        if self.prefetch_stats and self.softcap and narrow:
            # Softcap's 1 - tanh^2 registers leave no room (88 bytes of stack at d = 128). (The
            # wide kernel's rows are queries: 2 LSE2 + 2 D registers per thread, room everywhere.)
            raise ValueError("sm90 backward: prefetch_stats in the narrow kernel refuses softcap")
        if self.mask_always is None:
            object.__setattr__(self, "mask_always", (self.hdim, bool(self.softcap)) in SM90_BWD_MASK_ALWAYS)
        if self.ds_before_dv is None:
            object.__setattr__(self, "ds_before_dv",
                               narrow and (self.hdim, self.causal or self.local) in SM90_BWD_DS_BEFORE_DV)
        if self.ds_before_dv and not narrow:
            raise ValueError("sm90 backward: ds_before_dv is a narrow-kernel (d <= 128) switch")
        if self.lpt is None:
            object.__setattr__(self, "lpt", self.causal and not self.varlen and not self.deterministic)
        if self.rotate_m is None:
            rotate = (self.hdim, self.causal or self.local) in SM90_BWD_ROTATE_M and not self.deterministic
            object.__setattr__(self, "rotate_m", rotate)
        if self.rotate_m and self.deterministic and (self.causal or self.local):
            # (Without masks every key block sees every query block, which the rotated add order
            # -- ``scratch.rotated_add_rank`` -- assumes.)
            raise ValueError("sm90 backward: deterministic mode takes the rotated walk only without "
                             "causal / window masks")
        if self.lpt and (self.varlen or self.deterministic):
            raise ValueError("sm90 backward: lpt walks fixed-length grids, not deterministic mode")
        if self.dq_before_dk is None:
            object.__setattr__(self, "dq_before_dk", narrow or self._wide_fa4_order())
        if self.ds_stmatrix is None:
            # (At tile_m = 80, one 8x8 tile per stmatrix: compiles clean non-causal -- 20 STSM, no
            # spills, wgmmas async -- but is not yet measured; causal spills 24 bytes and
            # deterministic mode serialises the wgmmas, so those are refused below.)
            # Wide kernel (P and dS, session 11, one run, TFLOP/s, N = 2k / 8k): d = 192 non-causal
            # 400 -> 411, 453 -> 471, causal 347 -> 366, 426 -> 455; d = 256 383 -> 398, 423 -> 431,
            # 339 -> 355, 406 -> 434.
            object.__setattr__(self, "ds_stmatrix", self.tile_m % 64 == 0)
        if not self.ds_stages:
            object.__setattr__(self, "ds_stages", self.stages if narrow else 1)
        if self.smem_bytes() > SM90_SMEM_BYTES:
            raise ValueError(f"sm90 backward: {self.smem_bytes()} bytes of smem per CTA (at most "
                             f"{SM90_SMEM_BYTES}); fewer stages or no dQ writer warp")
        if self.hdim > 128 and self.ds_stages != 1:
            raise ValueError("sm90 backward: ds_stages is a narrow-kernel (d <= 128) switch")
        if self.do_stages and self.do_stages != self.stages and not (
                not narrow and self.split_loads and 1 <= self.do_stages < self.stages):
            raise ValueError("sm90 backward: do_stages (fewer than stages) is for the wide kernel with "
                             "split loads")
        if self.split_loads and self.hdim_v != self.hdim:
            # (K and V share one pipeline whose stages expect the same byte count.)
            raise ValueError("sm90 backward: split_loads needs d_v = d")
        fixed_grid = not (self.varlen or self.deterministic)
        # (Softcap's 1 - tanh^2 registers, carried across the tile loop, spill at d = 128.)
        if self.persistent and not (narrow and self.split_loads and fixed_grid and not self.softcap):
            raise ValueError("sm90 backward: the persistent grid is for the narrow kernel (d <= 128) with "
                             "split loads, without varlen, deterministic mode or softcap")
        if self.persistent and not (self.dkv_via_ds or self.dkv_stmatrix):
            # (The 2-byte smem stores' index math, carried across tiles, spills 224-440 bytes.)
            raise ValueError("sm90 backward: the persistent grid takes the dS-staged (dkv_via_ds) or the "
                             "stmatrix dK / dV epilogue")
        if self.dkv_via_ds and not narrow:
            raise ValueError("sm90 backward: dkv_via_ds is a narrow-kernel (d <= 128) epilogue")
        if self.persistent and not self.num_ctas:
            object.__setattr__(self, "num_ctas", SM90_NUM_SMS_DEFAULT)
        if not self.persistent and self.num_ctas:
            raise ValueError("sm90 backward: num_ctas sizes the persistent grid only")
        if self.ds_stages not in (1, self.stages):
            raise ValueError(f"sm90 backward: ds_stages must be 1 or stages ({self.stages})")
        if self.softcap and self.hdim == 64 and self.tile_m == 128:
            raise ValueError("sm90 backward: softcap at head dim 64 takes tile_m = 64 (128 query rows "
                             "spill 15-72 registers)")
        if self.tile_n != tile_n or self.tile_m not in (64, 80, 128) or self.stages < 1:
            raise ValueError(f"sm90 backward: tile_n = {tile_n} at head dim {self.hdim} "
                             "(the warpgroups' key / head-dim split), tile_m 64, 80 or 128")
        if self.tile_m == 80 and (self.hdim != 128 or self.softcap):
            raise ValueError("sm90 backward: tile_m = 80 (dQ^T with the head dim on M, split over the "
                             "two warpgroups) needs d = 128, no softcap (it spills 37 registers)")
        if self.tile_m == 80 and self.ds_stmatrix and (self.causal or self.local or self.deterministic):
            raise ValueError("sm90 backward: stmatrix dS at tile_m = 80 only without masks or "
                             "deterministic mode (they spill / serialise the wgmmas)")

    def _wide_fa4_order(self) -> bool:
        # (Its stmatrix dK^T / dV^T goes with it: without the order, d = 192 causal spills 24 bytes.)
        return (self.hdim in SM90_BWD_WIDE_FA4_ORDER and self.hdim_v == self.hdim
                and self.dq_before_dk is not False)

    def _resolve_switches(self, narrow: bool) -> None:
        # (The 80-row tile keeps its own measured schedule: none of these were timed with it.)
        key = (self.hdim, self.causal or self.local) if self.tile_m != 80 else None
        wide_split = self.hdim in SM90_BWD_WIDE_SPLIT_HDIMS and self.hdim_v == self.hdim
        auto = dict(pdl=SM90_BWD_PDL,
                    post_stage_smem=self.hdim in SM90_BWD_POST_STAGE_HDIMS,
                    prefetch_stats=(key in SM90_BWD_PREFETCH_STATS and not self.softcap) if narrow
                    else SM90_BWD_WIDE_PREFETCH_STATS,
                    dq_writer_batch=key in SM90_BWD_DQ_WRITER_BATCH and bool(self.dq_warp),
                    dkv_stmatrix=key in SM90_BWD_DKV_STMATRIX or self._wide_fa4_order(),
                    split_loads=SM90_BWD_SPLIT_LOADS and (narrow or wide_split),
                    spin_waits=SM90_BWD_SPIN_WAITS and (narrow or wide_split))
        persistent_ok = (narrow and not (self.varlen or self.deterministic or self.softcap)
                         and self.split_loads is not False)
        auto["persistent"] = SM90_BWD_PERSISTENT and persistent_ok
        persistent = auto["persistent"] if self.persistent is None else self.persistent
        auto["dkv_via_ds"] = narrow and (SM90_BWD_DKV_VIA_DS or bool(persistent))
        for name, value in auto.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    def lpt_rows_in_l2(self) -> int:
        """Query rows whose Q + dO (16 bit) and dQ accumulator (fp32), d * 8 bytes each, fit the
        ``lpt`` walk's L2 budget (``lpt_l2_mib`` or ``SM90_BWD_LPT_L2_BYTES``)."""
        l2_bytes = self.lpt_l2_mib * 1024 * 1024 if self.lpt_l2_mib else SM90_BWD_LPT_L2_BYTES
        return l2_bytes // (self.hdim * 8)

    def lpt_last_section_short(self, q_rows_per_kv_head: int, kv_heads: int) -> bool:
        """Whether ``lpt``'s full sections of heads (the kernel's ``longest_first``) leave a last
        one of fewer than half as many heads."""
        group = section_size(self.lpt_rows_in_l2(), max(q_rows_per_kv_head, 1), kv_heads)
        rem = kv_heads % group
        return 0 < 2 * rem < group

    def smem_bytes(self) -> int:
        """Shared memory of the main kernel (tiles 1 KiB aligned, as its storage struct)."""
        elem, d, dv, tm, tn = 2, self.hdim, self.hdim_v or self.hdim, self.tile_m, self.tile_n
        do_stages = self.do_stages or self.stages
        tiles = [self.stages * tm * d * elem, do_stages * tm * dv * elem, tn * d * elem, tn * dv * elem]
        # dS (narrow: per dS stage); the wide kernel also keeps P.
        tiles += [tm * tn * elem] * ((self.ds_stages or self.stages) if self.hdim <= 128 else 2)
        total = sum((t + 1023) // 1024 * 1024 for t in tiles)
        total += (self.stages + do_stages) * tm * 4 + 1024  # LSE2 / D rows, barriers and slack
        return total + (tm * d * 4 if self.dq_warp else 0)

    def build(self):
        if self.hdim > 128:
            from cute_flash.hopper.bwd_wide import FlashBwdSm90Wide

            return FlashBwdSm90Wide(self)
        from cute_flash.hopper.bwd import FlashBwdSm90

        return FlashBwdSm90(self)

    def pre(self, dlse: bool = False) -> BwdPreConfig:
        threads = self.pre_threads or SM90_BWD_PRE_THREADS
        if self.tile_m % (threads // pre_threads_per_row(self.hdim_v)):
            threads = 128  # (its thread rows would not tile the query block)
        return BwdPreConfig(target=self.target, dtype=self.dtype, hdim=self.hdim, hdim_v=self.hdim_v,
                            tile_m=self.tile_m, varlen=self.varlen, deterministic=self.deterministic,
                            launch_dependents=self.pdl, threads=threads, dlse=dlse)

    def post(self) -> BwdSm90PostConfig:
        return BwdSm90PostConfig(target=self.target, dtype=self.dtype, hdim=self.hdim, tile_m=self.tile_m,
                                 varlen=self.varlen, stage_smem=self.post_stage_smem)

    def fake_args(self) -> tuple:
        """Every main backward kernel's arguments (``signatures.bwd_main_fake_args``)."""
        return signatures.bwd_main_fake_args(self.dtype, self.hdim, self.hdim_v, self.varlen,
                                             self.deterministic)


@dataclass(frozen=True)
class BwdSm90PostConfig(jit.KernelConfig):
    """dQ = softmax_scale * dQaccum from the sm90 main kernel's row-major accumulator chunks."""

    dtype: str = "bf16"
    hdim: int = 128
    tile_m: int = 64
    varlen: bool = False
    stage_smem: bool = False  # ``BwdSm90Config.post_stage_smem``

    kernel_name = "bwd_post_sm90"

    def build(self):
        from cute_flash.hopper.bwd_postprocess import FlashBwdPostSm90

        return FlashBwdPostSm90(self)

    def fake_args(self) -> tuple:
        return signatures.bwd_post_fake_args(self.dtype, self.hdim, self.varlen)


def long_rows_overrides(problem: dict, max_seqlen_q: int) -> dict:
    """``SM90_BWD_LONG_ROWS``' launch rule on a problem's ``BwdSm90Config`` fields (hdim, hdim_v,
    causal, ...; checked before any config is built, so the launch path builds one): the fields
    that take the long-sequence tile -- fixed-length, non-causal, no window / softcap /
    deterministic mode, d_v = d, at least the head dim's threshold of query rows -- else none."""
    hdim = problem["hdim"]
    rule = SM90_BWD_LONG_ROWS.get(hdim)
    special = any(problem.get(f) for f in ("causal", "local", "softcap", "varlen", "deterministic"))
    if rule is None or problem.get("hdim_v", hdim) not in (0, hdim) or special or max_seqlen_q < rule[0]:
        return {}
    return dict(rule[1])


def det_rotate_applies(cfg: BwdSm90Config, max_seqlen_k: int, num_sms: int) -> bool:
    """``SM90_BWD_DET_ROTATE``'s launch rule: deterministic, no masks, one grid CTA per key block
    (not persistent), and every key block of a head resident at once (one CTA per SM)."""
    return (cfg.hdim in SM90_BWD_DET_ROTATE and cfg.deterministic and not (cfg.causal or cfg.local)
            and not cfg.persistent
            and (max_seqlen_k + cfg.tile_n - 1) // cfg.tile_n <= num_sms)


def plan(p: Problem, overrides: tuple = ()) -> tuple[BwdPreConfig, BwdSm90Config, BwdSm90PostConfig]:
    """(preprocess, main, postprocess) of one backward problem: the long-sequence tile, the rotated
    deterministic order and balanced ``lpt`` sections where their launch rules hold (extents known);
    ``overrides``: ``BwdSm90Config`` fields as (name, value) pairs (tuning scripts)."""
    problem = dict(dtype=p.dtype, hdim=p.hdim, hdim_v=p.hdim_v, causal=p.causal, local=p.local,
                   softcap=p.softcap, varlen=p.varlen, deterministic=p.deterministic)
    fixed = dict(overrides)
    if not p.extents_known:
        cfg = BwdSm90Config(target=p.target, **problem, **fixed)
        return cfg.pre(dlse=p.dlse), cfg, cfg.post()
    long_rows = {} if "tile_m" in fixed else long_rows_overrides(problem, p.max_seqlen_q)
    cfg = BwdSm90Config(target=p.target, **problem, **{**long_rows, **fixed})
    if cfg.persistent and "num_ctas" not in fixed:
        cfg = dataclasses.replace(cfg, num_ctas=p.num_sms)
    if det_rotate_applies(cfg, p.max_seqlen_k, p.num_sms) and "rotate_m" not in fixed:
        cfg = dataclasses.replace(cfg, rotate_m=True)
    if (cfg.lpt and SM90_BWD_LPT_BALANCED and "lpt_balanced" not in fixed
            and cfg.lpt_last_section_short(p.max_seqlen_q * (p.heads_q // p.heads_kv), p.heads_kv)):
        cfg = dataclasses.replace(cfg, lpt_balanced=True)
    return cfg.pre(dlse=p.dlse), cfg, cfg.post()


def compile_variants(p: Problem) -> list[jit.KernelConfig]:
    """Every kernel a compile-only problem may launch: its plan, and where the launcher takes
    another tile at long sequences (``long_rows_overrides``), that tile's kernels too."""
    configs = list(plan(p))
    problem = dict(dtype=p.dtype, hdim=p.hdim, hdim_v=p.hdim_v, causal=p.causal, local=p.local,
                   softcap=p.softcap, varlen=p.varlen, deterministic=p.deterministic)
    long_rows = long_rows_overrides(problem, max_seqlen_q=1 << 30)
    if long_rows:
        main = BwdSm90Config(target=p.target, **problem, **long_rows)
        configs += [c for c in (main.pre(dlse=p.dlse), main, main.post()) if c not in configs]
    return configs
