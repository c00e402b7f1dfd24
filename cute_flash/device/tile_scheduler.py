"""Which (m_block, head, batch) tile a CTA of a one-tile-per-CTA grid computes.

Two concerns decide the order in which the hardware should meet the tiles (it dispatches CTAs in
increasing linear block index):

- L2 reuse: every m-block of one (batch, head) streams the same K/V. The tiles are walked in
  *sections* of ``group`` heads whose K/V fit in L2 together, so while a section runs its K/V come
  from L2 instead of HBM (132 SMs each streaming their own K/V would need ~5 TB/s at d=128).
- Longest processing time first (causal / local): query block m visits ~m+1 key blocks, so the
  m-blocks are handed out heaviest first and the grid tail is made of the shortest tiles.

Within a section the head varies fastest, then the m-block. Varlen grids keep the 3-D
(m_block, head, batch) grid: a batch's m-block count is only known on the device.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32

L2_BYTES = 50 * 1024 * 1024  # H100/H200: 50 MB of L2


class TileScheduler:
    def __init__(self, num_m: Int32, num_head: Int32, num_hb: Int32, group: Int32, lpt: bool,
                 varlen: bool):
        self.num_m, self.num_head, self.num_hb, self.group = num_m, num_head, num_hb, group
        self.lpt, self.varlen = lpt, varlen

    @staticmethod
    def create(num_m: Int32, num_head: Int32, num_batch: Int32, seqlen_k: Int32, row_bytes: int,
               lpt: bool, varlen: bool, l2_sections: bool = True) -> "TileScheduler":
        """Host side. ``row_bytes``: bytes of one K row plus one V row (L2 footprint per key).
        ``l2_sections=False``: one head per section, i.e. every m-block of a head before the next
        head (the plain (m, head, batch) grid order)."""
        num_hb = num_head * num_batch
        group = Int32(1)
        if cutlass.const_expr(l2_sections):
            group = Int32(L2_BYTES // row_bytes) // cutlass.max(seqlen_k, 1)
            group = cutlass.max(cutlass.min(group, num_hb), 1)
        return TileScheduler(num_m, num_head, num_hb, group, lpt, varlen)

    def grid(self, num_ctas: int = 0) -> tuple:
        """One CTA per tile, or (``num_ctas`` > 0, dense only) a persistent grid of at most
        ``num_ctas`` CTAs that stride over the linear tile order."""
        if cutlass.const_expr(self.varlen):
            return (self.num_m, self.num_head, self.num_hb // self.num_head)
        if cutlass.const_expr(num_ctas > 0):
            return (cutlass.min(self.num_m * self.num_hb, num_ctas), 1, 1)
        return (self.num_m * self.num_hb, 1, 1)

    def params(self) -> tuple:
        """The values the kernel needs to call ``tile`` (host side: the walk's divisors are set up
        here, ``section_walk_plan``)."""
        plan = ()
        if cutlass.const_expr(not self.varlen):
            div = cute.fast_divmod_create_divisor_v2
            walk = section_walk_plan(self.num_m, self.num_hb, self.group, False, divisor=div)
            plan = (walk, div(self.num_head))
        return (self.num_m, self.num_hb, plan)

    @staticmethod
    def num_tiles(params: tuple):
        num_m, num_hb, _ = params
        return num_m * num_hb

    @staticmethod
    @cute.jit
    def tile(params: tuple, idx: Int32, lpt: cutlass.Constexpr[bool], varlen: cutlass.Constexpr[bool]):
        """Device side: (m_block, head, batch) of linear tile ``idx`` (varlen: of this CTA,
        ``idx`` being its x index)."""
        num_m, _, plan = params
        _, by, bz = cute.arch.block_idx()
        m_block, head, batch = idx, by, bz
        if cutlass.const_expr(not varlen):
            # ``section_order`` without its three integer divisions (``section_walk_plan``).
            walk, d_head = plan
            m_block, hb = planned_section_order(idx, walk, False)
            batch, head = divmod(hb, d_head)
        if cutlass.const_expr(lpt):
            m_block = num_m - 1 - m_block
        return m_block, head, batch


def section_size(rows_in_l2, rows_per_head, num_heads):
    """Heads per section when each head's working set is ``rows_per_head`` rows and
    ``rows_in_l2`` of them fit in L2: at least 1, at most all. Integer code for the kernel (Int32)
    and the host (int)."""
    return cutlass.max(cutlass.min(rows_in_l2 // rows_per_head, num_heads), 1)


def section_order(idx, num_m, num_head, num_hb, group):
    """(m_block, head, batch) of linear tile ``idx``: sections of ``group`` (batch, head) pairs,
    the head varying fastest inside a section, then the m-block. Plain integer arithmetic, so the
    same code runs in the kernel (Int32) and in the CPU tests (int)."""
    per_section = group * num_m
    section = idx // per_section
    in_section = idx - section * per_section
    # The last section may hold fewer heads.
    heads_here = cutlass.min(group, num_hb - section * group)
    m = in_section // heads_here
    hb = section * group + (in_section - m * heads_here)
    batch = hb // num_head
    return m, hb - batch * num_head, batch


def balanced_section_order(idx, num_m, num_head, num_hb, max_group):
    """``section_order`` with the (batch, head) pairs split into ceil(num_hb / max_group) sections
    whose sizes differ by at most one, instead of full sections and a short last one: in a causal
    backward the last section's longest tiles start last, so a short last section (1 head of 16
    in sections of 5) leaves its key block 0 running alone at the grid's end.
    Branch-free integer arithmetic (min / max), for the kernel's Int32 and the CPU tests' int."""
    sections = (num_hb + max_group - 1) // max_group
    base = num_hb // sections  # >= 1
    extra = num_hb - base * sections  # the first ``extra`` sections hold base + 1 pairs
    big, small = (base + 1) * num_m, base * num_m
    g_big = cutlass.min(idx // big, extra)
    is_small = cutlass.max(g_big - extra + 1, 0)  # 1 past the big sections, else 0
    rest = idx - g_big * big
    g_small = (rest // small) * is_small
    rest = rest - g_small * small
    size = base + 1 - is_small
    m = rest // size
    hb = g_big * (base + 1) + g_small * base + (rest - m * size)
    batch = hb // num_head
    return m, hb - batch * num_head, batch


# ----------------------------------------------------------------------------------------------
# The same walks from numbers set up once per launch. A CTA otherwise spends four or five signed
# integer divisions (each an I2F -> MUFU.RCP -> F2I chain through R2UR round trips) on its tile
# before the producer's first TMA. Every divisor
# below depends only on the launch's shapes, so the launcher wraps them as the DSL's FastDivmod
# (a multiply-high and a shift in the kernel; ``divisor=cute.fast_divmod_create_divisor_v2`` in
# host code -- created inside a kernel, the set-up itself is a loop and a 64-bit division call).
# ``divisor=int`` gives plain Python numbers, for the CPU tests.
# ----------------------------------------------------------------------------------------------
def section_walk_plan(num_m, num_hb, group, balanced: bool, divisor=int) -> tuple:
    """Grid-invariant numbers of ``section_order`` (``balanced=False``) or
    ``balanced_section_order`` over (m-block, head) tiles with one batch per grid z."""
    if balanced:
        sections = (num_hb + group - 1) // group
        base = num_hb // sections
        extra = num_hb - base * sections
        return (divisor((base + 1) * num_m), divisor(base * num_m), divisor(base + 1), divisor(base),
                base, extra, num_m)
    last = (num_hb - 1) // group
    heads_last = num_hb - last * group
    return (divisor(group * num_m), divisor(group), divisor(heads_last), group, last)


def planned_section_order(idx, plan: tuple, balanced: bool):
    """(m_block, head) of linear tile ``idx`` under ``section_walk_plan``'s numbers: the same
    order as ``section_order`` / ``balanced_section_order`` (tests/cpu/test_tile_scheduler.py)."""
    if balanced:
        d_big, d_small, d_base1, d_base, base, extra, num_m = plan
        g_big = cutlass.min(idx // d_big, extra)
        is_small = cutlass.max(g_big - extra + 1, 0)  # 1 past the big sections, else 0
        rest = idx - g_big * ((base + 1) * num_m)
        g_small = (rest // d_small) * is_small
        rest = rest - g_small * (base * num_m)
        # Both quotients, then a 0 / 1 pick: the divisors stay the launch's.
        m_big, h_big = divmod(rest, d_base1)
        m_small, h_small = divmod(rest, d_base)
        m = m_big + (m_small - m_big) * is_small
        head = g_big * (base + 1) + g_small * base + h_big + (h_small - h_big) * is_small
        return m, head
    d_section, d_group, d_last, group, last = plan
    section, in_section = divmod(idx, d_section)
    is_last = cutlass.max(section - last + 1, 0)  # the last section may hold fewer heads
    m_full, h_full = divmod(in_section, d_group)
    m_last, h_last = divmod(in_section, d_last)
    m = m_full + (m_last - m_full) * is_last
    return m, section * group + h_full + (h_last - h_full) * is_last
