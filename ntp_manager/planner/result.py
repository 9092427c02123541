"""What the planner returns: a `Plan` of replicas, their TP groups, the groups set aside, and what
moved relative to the previous plan (`MoveSummary`).

Plain frozen records, no logic beyond reading them: planner/plan.py builds them, planner/moves.py
reads a plan back as the previous layout of the next one (so both import this module, and neither
imports the other's caller).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ntp_manager.planner.spec import Scheme


@dataclass(frozen=True)
class MoveSummary:
    """What a plan changes relative to the previous one.

    moved          groups placed now whose (replica, stage) differs from before, joiners included
    stage_changed  groups placed now that must load a stage's state: stage changed, or newly placed
    joined         groups placed now that were not placed before
    left           groups placed before that are not placed now (idle, dropped or gone)
    bytes          estimated state loaded: the sum of `JobSpec.stage_bytes` over stage_changed
                   groups (None when the job gives no size)
    """

    moved: int
    stage_changed: int
    joined: int
    left: int
    bytes: int | None
    moved_groups: tuple[str, ...] = field(default=(), repr=False)  # ids, in plan order

    def describe(self) -> str:
        size = "" if self.bytes is None else f", ~{_human_bytes(self.bytes)} of state to load"
        return (
            f"moves vs the previous plan: {self.moved} group(s) moved ({self.stage_changed} change stage, "
            f"{self.joined} newly placed), {self.left} left{size}"
        )



@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One TP group of a replica. Identity (domain, group id, GPUs) is read from tables shared by
    the whole cluster, so a plan of a million GPUs neither copies nor touches a million UUIDs."""

    stage: int  # position in its replica (pipeline stage)
    tp: int
    usable: int  # usable GPUs the group had (>= tp)
    spare: bool  # drawn from the spare pool
    power_ratio: float  # limit / nominal limit (base cap, else TDP) on its GPUs; > 1 when boosted
    domain_pos: int  # the domain's position in the cluster
    local: int  # the group's index within its domain
    positions: range | tuple[int, ...]  # its GPUs' positions in `Cluster.flat_uuids`, TP-rank order
    domain_ids: tuple[str, ...] = field(repr=False, compare=False)
    flat_uuids: tuple[str, ...] = field(repr=False, compare=False)
    prev_replica: int | None = None  # where it was in the previous plan (None: not placed, or no previous)
    prev_stage: int | None = None
    pace: float = 1.0  # speed of its slowest GPU (< 1 when it runs a degraded, fail-slow GPU)

    @property
    def domain(self) -> str:
        return self.domain_ids[self.domain_pos]

    @property
    def group_id(self) -> str:
        return f"{self.domain}/g{self.local}"

    @property
    def gpus(self) -> tuple[str, ...]:
        """UUIDs in TP-rank order; len == tp."""
        p = self.positions
        if isinstance(p, range):
            return self.flat_uuids[p.start : p.stop]
        return tuple(self.flat_uuids[i] for i in p)


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    replica_id: int
    groups: tuple[GroupPlan, ...]
    tp: int  # lowest TP degree among its groups
    local_batch: int
    relative_throughput: float  # local_batch / job local batch

    @property
    def boosted(self) -> tuple[str, ...]:
        """UUIDs of this replica's GPUs running above their nominal limit (base cap, else TDP)."""
        return tuple(u for g in self.groups if g.power_ratio > 1.0 for u in g.gpus)


@dataclass(frozen=True, slots=True)
class SetAside:
    """A group the plan does not use, and why (dropped: unusable; idle: not needed or incomplete)."""

    group_id: str
    domain: str
    usable: int
    spare: bool
    reason: str


@dataclass(frozen=True)
class Plan:
    job: str
    scheme: Scheme
    tp: int
    replicas: tuple[ReplicaPlan, ...]
    dropped: tuple[SetAside, ...]
    idle: tuple[SetAside, ...]
    spares_used: tuple[str, ...]
    # GPU UUID -> limit in watts, only where it differs from the GPU's nominal limit (its base cap
    # when the cluster sets one, else TDP); every other GPU runs at its nominal limit.
    power_caps_w: Mapping[str, float]
    global_batch: int
    target_batch: int
    reasons: tuple[str, ...] = field(default=())
    moves: MoveSummary | None = None  # what changed relative to the previous plan, when one was given

    @property
    def relative_throughput(self) -> float:
        """Samples per step over the target (1.0 = as healthy)."""
        return self.global_batch / self.target_batch

    @property
    def meets_target(self) -> bool:
        return self.global_batch >= self.target_batch


def _human_bytes(n: int) -> str:
    x = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if x < 1000:
            return f"{x:.0f} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return f"{x:.1f} TB"
