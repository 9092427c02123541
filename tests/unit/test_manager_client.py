"""The manager client's failover order (contract/client.py): every client visits every address once
per cycle, starts at the first, and the clients of a manager that dies spread over the others."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from ntp_manager.contract.client import ManagerClient

ADDRS = [f"m{k}:50051" for k in range(4)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_a_client_starts_at_the_first_address_and_visits_each_once_per_cycle(n: int) -> None:
    for seed in range(50):
        c = ManagerClient(ADDRS[:n], rng=random.Random(seed))
        assert c.target == ADDRS[0]
        seen = [c.target]
        for _ in range(n - 1):
            assert c.move(None) is not None
            seen.append(c.target)
        assert sorted(seen) == sorted(ADDRS[:n])  # every address once
        if n > 1:
            c.move(None)
            assert c.target == ADDRS[0]  # and round again
            assert c.failovers == n
        else:
            assert c.move(None) is None and c.failovers == 0


def test_the_clients_of_a_dead_manager_spread_evenly_over_the_others() -> None:
    """1,200 clients on m2 (moved there by balance) lose it: their next addresses are the three
    others in about equal parts (with one fixed order every one of them went to m3)."""
    rng = random.Random(7)
    nxt: Counter[str] = Counter()
    for _ in range(1200):
        c = ManagerClient(ADDRS, rng=rng)
        c.target = ADDRS[2]
        c.move(None)
        nxt[c.target] += 1
    assert set(nxt) == {ADDRS[0], ADDRS[1], ADDRS[3]}
    assert all(300 <= v <= 500 for v in nxt.values()), nxt  # 400 each expected; 5 sigma is ~+-80


def test_a_hint_wins_over_the_cycle_and_a_client_off_its_list_resumes_at_the_first() -> None:
    c = ManagerClient(ADDRS, rng=random.Random(1))
    assert c.move("m3:50051") == "m3:50051"
    c.target = "elsewhere:1"  # a leader's hint to an address of no list (plaintext)
    assert c.move(None) == ADDRS[0]
    assert c.move(ADDRS[0]) is None  # hinted where it is: it stays
