"""`reshard_moves` works on ranges of units; here it is checked against the rule it implements,
written unit by unit (the form it had before), on many random pairs of layouts: replicas of
different TP degrees, failed ranks, joiners, ranks renumbered between versions, a rank moving to
another replica. Pure, no processes."""

from __future__ import annotations

import random

import pytest

from ntp_manager.worker.reshard import Move, reshard_moves
from ntp_manager.worker.sync import ReplicaGroup, SyncLayout


def unit_by_unit(old: SyncLayout, new: SyncLayout, alive: set[int]) -> list[Move]:
    """Per unit: the rank itself, else the survivor of its old replica holding it, else the
    lowest-numbered survivor holding it."""
    holders: dict[str, dict[int, list[tuple[int, int]]]] = {f: {} for f in new.units}
    for ri, rep in enumerate(old.replicas):
        for rank in rep.ranks:
            if rank in alive:
                for f, units in old.units_of(rank).items():
                    for u in units:
                        holders[f].setdefault(u, []).append((ri, rank))
    moves: dict[tuple[int, int, str], list[int]] = {}
    for rep in new.replicas:
        for rank in rep.ranks:
            in_old = any(rank in r.ranks for r in old.replicas)
            mine = old.units_of(rank) if in_old and rank in alive else {}
            old_replica = old.locate(rank)[0] if in_old else -1
            for f, units in new.units_of(rank).items():
                for u in units:
                    if u in set(mine.get(f, ())):
                        continue
                    cands = holders[f].get(u)
                    if not cands:
                        raise ValueError(f"unit {u} of {f!r} has no surviving holder")
                    same = [r for ri, r in cands if ri == old_replica]
                    moves.setdefault((same[0] if same else min(r for _, r in cands), rank, f), []).append(u)
    return [Move(s, d, f, tuple(us)) for (s, d, f), us in sorted(moves.items())]


def _layout(rng: random.Random, ranks: list[int], units: dict[str, int]) -> SyncLayout:
    """`ranks` cut into 1-3 replicas of random degrees (each unit count >= every degree)."""
    n = rng.randint(1, min(3, len(ranks)))
    cuts = sorted(rng.sample(range(1, len(ranks)), n - 1))
    parts = [ranks[a:b] for a, b in zip([0, *cuts], [*cuts, len(ranks)], strict=True)]
    return SyncLayout(tuple(ReplicaGroup(tuple(p), 1) for p in parts), units)


@pytest.mark.parametrize("seed", range(300))
def test_ranges_give_the_unit_by_unit_result(seed: int) -> None:
    rng = random.Random(seed)
    world = rng.randint(2, 12)
    units = {"heads": rng.randint(world, 3 * world), "mlp": rng.randint(world, 97), "vocab": rng.randint(world, 300)}
    old_ranks = list(range(world))
    rng.shuffle(old_ranks)
    old = _layout(rng, old_ranks, units)
    dead = set(rng.sample(old_ranks, rng.randint(0, world - 1)))
    alive = set(old_ranks) - dead
    # the new layout: survivors (some renumbered onto dead numbers) and maybe joiners
    new_ranks = sorted(alive) + [world + k for k in range(rng.randint(0, 2))]
    new_ranks = rng.sample(new_ranks, rng.randint(1, len(new_ranks)))
    new = _layout(rng, new_ranks, units)
    try:
        want: list[Move] | str = unit_by_unit(old, new, alive)
    except ValueError as e:
        want = str(e)
    try:
        got: list[Move] | str = reshard_moves(old, new, alive)
    except ValueError as e:
        got = str(e)
    assert got == want


def test_a_unit_nobody_holds_is_named() -> None:
    units = {"heads": 4}
    old = SyncLayout((ReplicaGroup((0, 1), 1),), units)
    new = SyncLayout((ReplicaGroup((0,), 1),), units)
    with pytest.raises(ValueError, match="unit 2 of 'heads' has no surviving holder"):
        reshard_moves(old, new, {0})
