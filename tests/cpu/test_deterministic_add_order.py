"""Deterministic mode's dQ add order as a protocol, simulated on the CPU: CTAs (one per key block)
start in launch order on a limited number of SM slots, walk their query blocks, and before each
add wait until the query block's flag equals their rank, then publish rank + 1 (what the sm90
backward's dQ writer warp does, ``hopper/bwd.py``). The rotated order's ranks come from the
kernel's own ``device.scratch.rotated_add_rank``.

What is pinned: every query block's adds happen in one fixed order (bitwise-reproducible sums),
whatever each step takes; the descending order completes with any number of resident CTAs; the
rotated order completes when a head's key blocks all fit
(``hopper.bwd_config.det_rotate_applies``), and can deadlock when they do not -- why the launcher
checks it.
"""

from __future__ import annotations

import random

import pytest

from cute_flash.device.scratch import rotated_add_rank


def rotated_plan(num_n: int, num_m: int):
    """(walk, rank) of the rotated order: key block n visits (n + i) mod M at step i."""
    def walk(n: int) -> list[int]:
        return [(n + i) % num_m for i in range(num_m)]

    def rank(n: int, m: int) -> int:
        step = (m - n % num_m) % num_m
        return rotated_add_rank(step, m, num_m, num_n // num_m, num_n % num_m, n // num_m)

    return walk, rank


def descending_plan(num_n: int, num_m: int):
    """Without masks: every key block walks 0 .. M - 1; block n adds after n + 1."""
    return (lambda n: list(range(num_m))), (lambda n, m: num_n - 1 - n)


def simulate(num_heads: int, num_n: int, num_m: int, slots: int, plan, launch_order, rng: random.Random,
             max_ticks: int = 100_000):
    """Runs the protocol; returns each (head, query block)'s adders in add order, or None on a
    deadlock (every resident CTA waiting, none able to finish)."""
    walk, rank = plan
    queue = [(h, n) for h in range(num_heads) for n in launch_order]
    flags: dict[tuple[int, int], int] = {}
    order: dict[tuple[int, int], list[int]] = {}
    resident: dict[tuple[int, int], dict] = {}
    for _ in range(max_ticks):
        while queue and len(resident) < slots:
            cta = queue.pop(0)
            resident[cta] = dict(items=walk(cta[1]), busy=rng.randint(1, 3))
        if not resident:
            return order
        progressed = False
        for (h, n), st in list(resident.items()):
            if st["busy"] > 0:  # computing the current block's dQ
                st["busy"] -= 1
                progressed = True
                continue
            m = st["items"][0]
            r = rank(n, m)
            if flags.get((h, m), 0) != r:
                continue  # waits for its predecessor's adds
            order.setdefault((h, m), []).append(n)
            flags[(h, m)] = r + 1
            st["items"].pop(0)
            progressed = True
            if st["items"]:
                st["busy"] = rng.randint(1, 3)
            else:
                del resident[(h, n)]
        if not progressed:
            return None
    raise AssertionError("simulation did not finish")


@pytest.mark.parametrize("num_n,num_m", [(1, 1), (5, 5), (8, 3), (3, 8), (17, 4), (40, 24), (12, 7)])
def test_rotated_order_completes_in_one_fixed_order_when_a_heads_key_blocks_fit(num_n, num_m):
    plan = rotated_plan(num_n, num_m)
    orders = []
    for seed in range(3):
        # Slots for exactly one head's key blocks (the launch rule's bound), three heads queued.
        got = simulate(3, num_n, num_m, num_n, plan, list(range(num_n)), random.Random(seed))
        assert got is not None, "deadlock"
        orders.append(got)
    assert orders[0] == orders[1] == orders[2]
    for m in range(num_m):
        assert orders[0][(0, m)] == sorted(range(num_n), key=lambda n, m=m: ((m - n) % num_m, n))


@pytest.mark.parametrize("slots", [1, 2, 5])
def test_descending_order_completes_with_any_number_of_resident_ctas(slots):
    num_n, num_m = 9, 6
    plan = descending_plan(num_n, num_m)
    # The kernel launches the last key block first (``make_work`` reverses blockIdx).
    got = simulate(2, num_n, num_m, slots, plan, list(reversed(range(num_n))), random.Random(slots))
    assert got is not None
    assert all(adders == list(reversed(range(num_n))) for adders in got.values())


def test_rotated_order_can_deadlock_when_a_heads_key_blocks_do_not_fit():
    num_n = num_m = 6
    plan = rotated_plan(num_n, num_m)
    assert simulate(1, num_n, num_m, num_n - 2, plan, list(range(num_n)), random.Random(0)) is None
