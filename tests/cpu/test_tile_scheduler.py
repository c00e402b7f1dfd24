"""The one-tile-per-CTA order of the sm90 forward visits every (m_block, head, batch) exactly once,
in sections of ``group`` heads (head fastest, then m-block), for any section size including a
short last section. Checked with the same integer code the kernel traces."""

import itertools

import pytest

from cute_flash.device.tile_scheduler import (
    balanced_section_order,
    planned_section_order,
    section_order,
    section_walk_plan,
)


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


@pytest.mark.parametrize("num_m,num_head,num_batch,group",
                         [(1, 1, 1, 1), (86, 10, 1, 3), (64, 16, 1, 5), (7, 3, 2, 4), (5, 7, 2, 3),
                          (9, 32, 1, 10), (3, 5, 3, 15), (4, 6, 1, 6)])
def test_balanced_sections_visit_every_tile_once(num_m, num_head, num_batch, group):
    num_hb = num_head * num_batch
    seen = [balanced_section_order(i, num_m, num_head, num_hb, group) for i in range(num_m * num_hb)]
    assert sorted(seen) == sorted(itertools.product(range(num_m), range(num_head), range(num_batch)))


@pytest.mark.parametrize("num_head,group,sizes", [(16, 5, [4, 4, 4, 4]), (10, 3, [3, 3, 2, 2]),
                                                  (32, 10, [8, 8, 8, 8]), (6, 6, [6]), (7, 2, [2, 2, 2, 1])])
def test_balanced_sections_differ_by_at_most_one_head_and_walk_blocks_in_order(num_head, group, sizes):
    """No short last section (16 heads in sections of at most 5: 4 x 4, not 5 + 5 + 5 + 1); inside
    a section every head's block m comes before any block m + 1."""
    num_m = 3
    order = [balanced_section_order(i, num_m, num_head, num_head, group)[:2] for i in range(num_m * num_head)]
    start = 0
    for size in sizes:
        chunk = order[start:start + size * num_m]
        assert [m for m, _ in chunk] == [m for m in range(num_m) for _ in range(size)]
        assert sorted({h for _, h in chunk}) == list(range(start // num_m, start // num_m + size))
        start += size * num_m
    assert start == len(order)


@pytest.mark.parametrize("balanced", [False, True])
@pytest.mark.parametrize("num_m,num_head,group", [(1, 1, 1), (16, 32, 5), (16, 16, 5), (7, 10, 3),
                                                  (64, 16, 4), (5, 9, 9), (3, 13, 20), (8, 6, 1)])
def test_planned_section_walk_matches_the_division_walk(balanced, num_m, num_head, group):
    plan = section_walk_plan(num_m, num_head, group, balanced)
    ref = balanced_section_order if balanced else section_order
    for i in range(num_m * num_head):
        assert planned_section_order(i, plan, balanced) == ref(i, num_m, num_head, num_head, group)[:2]


@pytest.mark.parametrize("num_m,num_head,num_batch,group",
                         [(7, 3, 2, 4), (5, 16, 2, 12), (9, 1, 5, 2), (3, 5, 3, 15)])
def test_forward_planned_walk_with_batches_matches_section_order(num_m, num_head, num_batch, group):
    """The forward's use (``TileScheduler.tile``): the walk over (batch, head) pairs, then the pair
    split by a divmod by the head count."""
    num_hb = num_head * num_batch
    plan = section_walk_plan(num_m, num_hb, min(group, num_hb), False)
    for i in range(num_m * num_hb):
        m, hb = planned_section_order(i, plan, False)
        batch, head = divmod(hb, num_head)
        assert (m, head, batch) == section_order(i, num_m, num_head, num_hb, min(group, num_hb))
