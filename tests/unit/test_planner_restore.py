"""planner/restore.py: which units no surviving GPU holds, and the step the layout carries."""

from __future__ import annotations

from typing import Any

import pytest

from ntp_manager.planner.layout import GroupDoc, LayoutDoc, ReplicaDoc
from ntp_manager.planner.restore import lost_units, restore_step


def plan(*replicas: list[list[str]]) -> LayoutDoc:
    """A layout: each replica a list of stages, each stage its GPUs in TP order."""
    reps = tuple(ReplicaDoc(i, min(len(g) for g in stages), 4, 1.0, tuple(
        GroupDoc(f"d{i}/g{s}", f"d{i}", s, len(g), len(g), False, 1.0, tuple(g)) for s, g in enumerate(stages)))
        for i, stages in enumerate(replicas))
    return LayoutDoc(job="j", scheme="ntp", tp=4, global_batch=4 * len(reps), target_batch=4 * len(reps),
                     relative_throughput=1.0, meets_target=True, replicas=reps)


A, B = ["a0", "a1", "a2", "a3"], ["b0", "b1", "b2", "b3"]
UNITS = {"heads": 8, "mlp_columns": 10}


@pytest.mark.parametrize("previous, new, lost", [
    # two TP4 replicas, a3 fails: b3 still holds what a3 held
    (plan([A], [B]), plan([A[:3]], [B]), {}),
    # a3 and b3 fail: heads 6-7 (8 over 4: 2 each) and columns 8-9 (10 over 4: 3, 3, 2, 2) are gone
    (plan([A], [B]), plan([A[:3]], [B[:3]]), {0: {"heads": [(6, 8)], "mlp_columns": [(8, 10)]}}),
    # one replica, its whole group replaced by another domain's GPUs: everything is gone
    (plan([A]), plan([B]), {0: {"heads": [(0, 8)], "mlp_columns": [(0, 10)]}}),
    # TP4 + TP3 (sync degree 3). Heads, 8 over 3: chunks 0-2, 3-5, 6-7; the TP4 keeps two of each
    # (a0 0-1, a1 3-4, a2 6-7) and its extra rank a3 holds the tails 2 and 5; b0 0-2, b1 3-5, b2 6-7.
    # Columns, 10 over 3: chunks 0-3, 4-6, 7-9; a0 0-2, a1 4-6, a2 7-8, a3 3 and 9.
    # b1 fails: a1 and a3 still hold 3-5
    (plan([A], [B[:3]]), plan([A], [["b0", "b2"]]), {}),
    # b1 and a3 fail: head 5 had no other holder (columns 3 and 9: b0 and b2 hold them)
    (plan([A], [B[:3]]), plan([A[:3]], [["b0", "b2"]]), {0: {"heads": [(5, 6)]}}),
    # b1 and a1 fail: heads 3-4 and columns 4-6
    (plan([A], [B[:3]]), plan([["a0", "a2", "a3"]], [["b0", "b2"]]), {0: {"heads": [(3, 5)], "mlp_columns": [(4, 7)]}}),
    # two stages: stage 1 loses both holders of its TP index 0, stage 0 nothing
    (plan([A[:2], A[2:]], [B[:2], B[2:]]), plan([A[:2], ["a3"]], [B[:2], ["b3"]]),
     {1: {"heads": [(0, 4)], "mlp_columns": [(0, 5)]}}),
])
def test_lost_units(previous: LayoutDoc, new: LayoutDoc, lost: dict[int, Any]) -> None:
    assert lost_units(previous, new, UNITS) == lost


def test_the_layout_carries_the_known_step_only_when_a_unit_is_lost() -> None:
    before, after = plan([A], [B]), plan([A[:3]], [B[:3]])
    assert restore_step(before, plan([A[:3]], [B]), UNITS, 40) == (None, "")
    assert restore_step(None, after, UNITS, 40) == (None, "")  # a first layout loses nothing
    step, why = restore_step(before, after, UNITS, 40)
    assert step == 40
    assert why == ("no surviving GPU holds units 6-7 of 'heads' in stage 0 (and 1 more families or stages): "
                   "restore from the checkpoint of step 40")
    step, why = restore_step(before, after, UNITS, None)
    assert step is None and why.endswith("the manager knows no verified checkpoint: the workers look for one "
                                         "themselves")
    assert restore_step(before, after, {"heads": 0}, 40) == (None, "")  # no units of a family: nothing to lose


def brute_lost(previous: LayoutDoc, new: LayoutDoc, units: dict[str, int]) -> dict[int, dict[str, list[Any]]]:
    """Unit by unit: lost when no surviving GPU of the previous layout computes it."""
    from ntp_manager.contract.ntp_map import ntp_map

    survivors = set(new.gpus)
    stages: dict[int, list[tuple[int, tuple[str, ...]]]] = {}
    for r in previous.replicas:
        for g in r.groups:
            stages.setdefault(g.stage, []).append((g.tp, g.gpus))
    out: dict[int, dict[str, list[Any]]] = {}
    for stage, groups in sorted(stages.items()):
        sync = min(tp for tp, _ in groups)
        for fam, n in units.items():
            gone = [u for u in range(n) if not any(gpus[j] in survivors and u in ntp_map(n, tp, sync).units_of(j)
                                                   for tp, gpus in groups for j in range(tp))]
            ranges: list[tuple[int, int]] = []
            for u in gone:
                if ranges and ranges[-1][1] == u:
                    ranges[-1] = (ranges[-1][0], u + 1)
                else:
                    ranges.append((u, u + 1))
            if ranges:
                out.setdefault(stage, {})[fam] = ranges
    return out


@pytest.mark.parametrize("seed", range(80))
def test_lost_units_is_the_brute_force(seed: int) -> None:
    import random

    rng = random.Random(seed)
    stages = rng.randint(1, 3)
    ragged = rng.random() < 0.3  # replicas of different depths: a stage's groups are fewer than its replicas
    previous = plan(*[[[f"r{r}s{s}g{k}" for k in range(rng.randint(1, 4))]
                       for s in range(rng.randint(1, stages) if ragged else stages)]
                      for r in range(rng.randint(1, 4))])
    every = sorted(previous.gpus)
    kept = [u for u in every if rng.random() < rng.choice([0.5, 0.9, 1.0])]
    # the new layout places `kept` (in whatever groups: only which GPUs it places matters)
    new = plan(*[[kept[i:i + 4]] for i in range(0, len(kept), 4)]) if kept else plan([["x"]])
    units = {"heads": rng.randint(4, 12), "mlp_columns": rng.randint(4, 20), "none": 0}  # >= the largest TP
    assert lost_units(previous, new, units) == brute_lost(previous, new, units)
