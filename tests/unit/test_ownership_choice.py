"""Which free domains a job without `domains` gets (service/planning/ownership.py `choose_domains`),
against a brute force over every subset: enough groups, the fewest domains, and among those the
least capacity left unused."""

from __future__ import annotations

import itertools
import random

import pytest

from ntp_manager.service.planning.ownership import choose_domains


def brute(free: list[tuple[str, int]], need: int) -> tuple[int, int] | None:
    """(domains, groups) of the best choice: fewest domains, then fewest groups in them."""
    best: tuple[int, int] | None = None
    for k in range(1, len(free) + 1):
        for combo in itertools.combinations(free, k):
            total = sum(g for _, g in combo)
            if total >= need and (best is None or (k, total) < best):
                best = (k, total)
        if best is not None:
            return best
    return None


@pytest.mark.parametrize("seed", range(200))
def test_fewest_domains_and_enough_groups(seed: int) -> None:
    rnd = random.Random(seed)
    free = [(f"d{i:02d}", rnd.choice([0, 1, 1, 2, 4, 8])) for i in range(rnd.randint(0, 8))]
    need = rnd.randint(1, 20)
    got = choose_domains(free, need)
    best = brute(free, need)
    if best is None:
        assert got is None
        return
    assert got is not None and got == sorted(got) and len(set(got)) == len(got)
    groups = dict(free)
    assert sum(groups[d] for d in got) >= need
    assert len(got) == best[0]  # the fewest domains


def test_a_small_job_takes_the_smallest_domain_that_fits() -> None:
    assert choose_domains([("big", 8), ("mid", 2), ("small", 1)], 2) == ["mid"]
    assert choose_domains([("a", 4), ("b", 4), ("c", 1)], 5) == ["a", "c"]
    assert choose_domains([("a", 1)], 2) is None and choose_domains([], 1) is None


def test_earmark_covers_reservations_in_order_with_whole_domains() -> None:
    """The reservations' plan (service/planning/reservations.py): each outstanding reservation takes
    whole free domains in the order given; what the rest cannot cover is named."""
    from ntp_manager.service.planning.reservations import Need, earmark

    free = [("a", 4), ("b", 8), ("c", 4)]
    marks, short = earmark(free, [Need("hi", 4, 1, 1), Need("wide", 8, 1, 2)], choose_domains)
    assert marks == {"hi": ["a"], "wide": ["b"]} and short == []
    marks, short = earmark(free, [Need("x", 4, 3, 3), Need("y", 4, 2, 2)], choose_domains)
    assert marks == {"x": ["a", "b"]} and short == [Need("y", 4, 2, 2)]  # x took 3 of the 4 groups
    assert earmark(free, [Need("big", 8, 2, 2)], choose_domains) == ({}, [Need("big", 8, 2, 2)])
