"""Where TP groups were before a replan, and what a new plan moves.

A group's *assignment* is its (replica id, pipeline stage). Keeping it costs nothing; a group that
keeps its stage but changes replica keeps its layers and only joins other communicators; a group
that changes stage (or is newly placed) must load that stage's parameters and optimizer state.

`PreviousLayout` is what the planner needs of the previous plan: group id -> (replica, stage). Build
it from a `Plan` (`PreviousLayout.from_plan`) or from the plan JSON the manager stores
(`PreviousLayout.from_dict`), and pass it as `make_plan(cluster, job, previous=...)`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ntp_manager.planner.result import MoveSummary, Plan
from ntp_manager.planner.spec import PlanError

__all__ = ["MoveSummary", "PreviousLayout", "diff_assignments"]


@dataclass(frozen=True)
class PreviousLayout:
    """The assignments of a previous plan: group id ("domain/gN") -> (replica id, stage).

    `tp` and `groups_per_replica` are the previous plan's; when they differ from the job's, the
    planner ignores the layout (a group of another size is another group) and says so."""

    assignments: Mapping[str, tuple[int, int]]
    tp: int | None = None
    groups_per_replica: int | None = None
    # group id -> its GPUs (TP order), where known: whether the group ran its degraded members
    members: Mapping[str, tuple[str, ...]] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        seen: set[tuple[int, int]] = set()
        for gid, slot in self.assignments.items():
            if not isinstance(gid, str) or len(slot) != 2 or slot[1] < 0:
                raise PlanError(f"previous layout: bad assignment {gid!r} -> {slot!r}")
            if slot in seen:
                raise PlanError(f"previous layout: replica {slot[0]} stage {slot[1]} is held by two groups")
            seen.add(slot)

    @classmethod
    def from_plan(cls, plan: Plan) -> PreviousLayout:
        per = {len(r.groups) for r in plan.replicas}
        return cls(
            {g.group_id: (r.replica_id, g.stage) for r in plan.replicas for g in r.groups},
            plan.tp,
            per.pop() if len(per) == 1 else None,
            {g.group_id: g.gpus for r in plan.replicas for g in r.groups},
        )

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> PreviousLayout:
        """From plan JSON (docs/plan-json.md); raises PlanError naming what is malformed."""
        try:
            assignments = {
                str(g["group"]): (int(r["id"]), int(g["stage"])) for r in doc["replicas"] for g in r["groups"]
            }
            per = {len(r["groups"]) for r in doc["replicas"]}
            tp = int(doc["tp"])
            members = {str(g["group"]): tuple(g.get("gpus", ())) for r in doc["replicas"] for g in r["groups"]}
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"previous plan JSON is malformed: {e!r}") from None
        return cls(assignments, tp, per.pop() if len(per) == 1 else None, members)


K = TypeVar("K", bound=Hashable)


def diff_assignments(
    before: Mapping[K, tuple[int, int]],
    after: Iterable[tuple[K, tuple[int, int]]],
    stage_bytes: Mapping[int, int] | None = None,
    name: Callable[[K], str] = str,
    left_unknown: int = 0,
) -> MoveSummary:
    """Compare two layouts group by group (`after` in plan order). Groups are named by any key
    (group ids, or the planner's internal ones with `name` to turn them into ids); `left_unknown`
    adds groups of `before` that `before` cannot hold (e.g. no longer in the cluster)."""
    moved: list[K] = []
    stage_changed = joined = 0
    total = 0
    placed: set[K] = set()
    for gid, slot in after:
        placed.add(gid)
        old = before.get(gid)
        if old == slot:
            continue
        moved.append(gid)
        if old is None:
            joined += 1
        if old is None or old[1] != slot[1]:
            stage_changed += 1
            if stage_bytes is not None:
                total += stage_bytes.get(slot[1], 0)
    left = left_unknown + sum(1 for gid in before if gid not in placed)
    return MoveSummary(len(moved), stage_changed, joined, left, None if stage_bytes is None else total,
                       tuple(name(k) for k in moved))
