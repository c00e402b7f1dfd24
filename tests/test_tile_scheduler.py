"""The one-tile-per-CTA order of the sm90 forward visits every (m_block, head, batch) exactly once,
in sections of ``group`` heads (head fastest, then m-block), for any section size including a
short last section. Checked with the same integer code the kernel traces."""

import itertools

import pytest

from cute_flash.kernels.tile_scheduler import section_order


@pytest.mark.parametrize("num_m,num_head,num_batch,group",
                         [(1, 1, 1, 1), (7, 3, 2, 1), (7, 3, 2, 4), (5, 16, 2, 12), (64, 16, 2, 32),
                          (3, 5, 3, 15), (9, 1, 5, 2)])
def test_section_order_is_a_bijection_onto_all_tiles(num_m, num_head, num_batch, group):
    num_hb = num_head * num_batch
    seen = [section_order(i, num_m, num_head, num_hb, group) for i in range(num_m * num_hb)]
    assert sorted(seen) == sorted(itertools.product(range(num_m), range(num_head), range(num_batch)))


def test_section_order_keeps_a_section_of_heads_together_and_walks_m_blocks_in_order():
    num_m, num_head, num_batch, group = 4, 6, 1, 4
    order = [section_order(i, num_m, num_head, num_head * num_batch, group) for i in range(24)]
    # First section: heads 0..3, m-block by m-block.
    assert order[:8] == [(m, h, 0) for m in range(2) for h in range(4)]
    # Last (short) section: heads 4, 5.
    assert order[16:20] == [(0, 4, 0), (0, 5, 0), (1, 4, 0), (1, 5, 0)]


def test_one_head_per_section_is_the_plain_grid_order():
    order = [section_order(i, 3, 2, 4, 1) for i in range(12)]
    assert order == [(m, h, b) for b in range(2) for h in range(2) for m in range(3)]
