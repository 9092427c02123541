"""The planner's working records (phase 1 of planner/plan.py): the job's TP groups cut from its
domains, with their usable counts and paces, and the per-plan look-ups into the cluster's tables.

Internal to the planner: make_plan turns these into the `Plan` records of planner/result.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ntp_manager.planner.moves import PreviousLayout
from ntp_manager.planner.result import Plan, SetAside
from ntp_manager.planner.slow import choose
from ntp_manager.planner.spec import JobSpec, PlanError, Scheme
from ntp_manager.topology import Cluster, Domain


@dataclass(slots=True)
class WorkGroup:
    order: int
    dpos: int  # domain position in the cluster (the Domain object is touched only when needed)
    local: int  # group index within its domain
    positions: tuple[int, ...] | None  # usable in-domain positions in TP order; None = home slice
    usable: int
    spare: bool
    pace: float = 1.0  # speed of its slowest usable member (degraded GPUs run below 1)
    speeds: tuple[float, ...] | None = None  # per position when some member is slow, else None
    degraded: bool = False  # it had degraded members (kept or excluded by planner/slow.py)

    def pace_at(self, count: int) -> float:
        """Pace when it runs `count` members (the fastest ones, see `Ctx.local_positions`)."""
        if self.speeds is None:
            return 1.0
        if count >= len(self.speeds):
            return self.pace
        return sorted(self.speeds, reverse=True)[count - 1]


class History:
    """What the previous plan did with a group's degraded GPUs (for hysteresis, planner/slow.py):
    its members are read only when a group with a degraded GPU asks."""

    def __init__(self, previous: Plan | PreviousLayout | None, job: JobSpec) -> None:
        self.previous = previous
        self.job = job
        self._members: Mapping[str, tuple[str, ...]] | None = None

    def excluded(self, gid: str, slow: Sequence[str]) -> bool | None:
        """True when the previous plan placed group `gid` without one of `slow`, False when with all
        of them, None when it did not place the group (or there is no usable previous plan)."""
        prev = self.previous
        if prev is None or prev.tp != self.job.tp:
            return None
        if self._members is None:
            if isinstance(prev, Plan):
                self._members = {g.group_id: g.gpus for r in prev.replicas for g in r.groups}
            else:
                self._members = prev.members
        members = self._members.get(gid)
        if members is None:
            return None
        return any(u not in members for u in slow)


class Ctx:
    """Per-plan look-ups into the cluster's shared tables."""

    def __init__(self, cluster: Cluster, tp: int) -> None:
        self.cluster = cluster
        self.tp = tp
        self.ids = cluster.domain_ids
        self.offsets = cluster.domain_offsets
        self.flat = cluster.flat_uuids

    def gid(self, g: WorkGroup) -> str:
        return f"{self.ids[g.dpos]}/g{g.local}"

    def aside(self, g: WorkGroup, reason: str) -> SetAside:
        return SetAside(self.gid(g), self.ids[g.dpos], g.usable, g.spare, reason)

    def domain(self, g: WorkGroup) -> Domain:
        return self.cluster.domains[g.dpos]

    def local_positions(self, g: WorkGroup, count: int) -> range | tuple[int, ...]:
        """The group's first `count` usable positions; with slow members, its `count` fastest
        (ties: the earlier rank), in TP order."""
        if g.positions is None:
            return range(g.local * self.tp, g.local * self.tp + count)
        if g.speeds is not None and count < len(g.positions):
            sp = g.speeds
            keep = sorted(sorted(range(len(sp)), key=lambda i: (-sp[i], i))[:count])
            return tuple(g.positions[i] for i in keep)
        return g.positions[:count]

    def global_positions(self, g: WorkGroup, count: int) -> range | tuple[int, ...]:
        off = self.offsets[g.dpos]
        if g.positions is None:
            start = off + g.local * self.tp
            return range(start, start + count)
        return tuple(off + p for p in self.local_positions(g, count))

    def uuids(self, g: WorkGroup, count: int) -> tuple[str, ...]:
        p = self.global_positions(g, count)
        if isinstance(p, range):
            return self.flat[p.start : p.stop]
        return tuple(self.flat[i] for i in p)


@dataclass(slots=True)
class Candidate:
    groups: list[WorkGroup]  # in stage order
    home: int | None  # replica id it keeps (intact, or closed under its reference id); None: new
    stayers: int = 0  # groups in their reference slot
    tp: int = 0
    batch: int = 0
    group_tp: list[int] = field(default_factory=list)
    group_power: list[float] = field(default_factory=list)


def job_domain_positions(cluster: Cluster, job: JobSpec) -> Sequence[int]:
    """Positions of the job's domains in the cluster, in the job's order."""
    if not job.domains:
        return range(len(cluster.domain_sizes))
    idx = cluster.domain_index
    for did in job.domains:
        if did not in idx:
            raise PlanError(f"job {job.name!r} names unknown domain {did!r}")
    return [idx[did] for did in job.domains]


def enumerate_groups(
    ctx: Ctx, job: JobSpec, positions: Sequence[int], want: int, reasons: list[str], history: History
) -> list[WorkGroup]:
    """The job's groups in order. A group with degraded (slow) usable members keeps them or drops
    the slowest, by planner/slow.py; under dp-drop (uniform TP, no batch to shrink) a degraded GPU
    counts as unusable."""
    T = ctx.tp
    n_primary = job.primary_groups
    sizes = ctx.cluster.domain_sizes
    unhealthy = ctx.cluster.unhealthy_domains
    groups: list[WorkGroup] = []
    for dpos in positions:
        if len(groups) >= want:
            break
        size = sizes[dpos]
        k = size // T
        if k == 0:
            reasons.append(f"domain {ctx.ids[dpos]} has {size} GPUs, fewer than tp {T}: not used")
            continue
        if dpos not in unhealthy:  # fast path: the domain object itself is not touched
            for j in range(k):
                o = len(groups)
                groups.append(WorkGroup(o, dpos, j, None, T, o >= n_primary))
            continue
        dom = ctx.cluster.domains[dpos]
        bad, slow = dom.unplaceable, dom.slow
        if slow and job.scheme is Scheme.DP_DROP:
            bad = bad | frozenset(slow)
            reasons.extend(f"dp-drop: degraded GPU {dom.gpus[p].uuid} (speed {v:.2f}) counts as unusable"
                           for p, v in slow.items() if p < k * T)
            slow = {}
        # In-domain spares (positions past the last full group) fill unusable slots in order.
        local_spares = [p for p in range(k * T, size) if p not in bad]
        for j in range(k):
            if len(groups) >= want:
                break
            o = len(groups)
            home = range(j * T, (j + 1) * T)
            if not bad.intersection(home) and not any(p in slow for p in home):
                groups.append(WorkGroup(o, dpos, j, None, T, o >= n_primary))
                continue
            picked = []
            for p in home:
                if p not in bad:
                    picked.append(p)
                elif local_spares:
                    picked.append(local_spares.pop(0))
            speeds = [slow.get(p, 1.0) for p in picked]
            if not speeds or min(speeds) == 1.0 or len(picked) < job.min_tp:
                groups.append(WorkGroup(o, dpos, j, tuple(picked), len(picked), o >= n_primary))
                continue
            gid = f"{ctx.ids[dpos]}/g{j}"
            names = [dom.gpus[p].uuid for p in picked]
            cap = job.power.max_boost
            if job.scheme is Scheme.NTP_PW:
                cap = min([cap] + [dom.gpus[p].power.max_w / dom.gpus[p].power.nominal_w for p in picked])
            slow_names = [u for u, v in zip(names, speeds, strict=True) if v < 1.0]
            choice = choose(job, gid, names, speeds, boost_cap=cap, was_excluded=history.excluded(gid, slow_names))
            reasons.append(choice.reason)
            kept = [picked[i] for i in choice.kept]
            kept_speeds = tuple(speeds[i] for i in choice.kept)
            groups.append(WorkGroup(o, dpos, j, tuple(kept), len(kept), o >= n_primary, choice.pace,
                                 kept_speeds if choice.pace < 1.0 else None, True))
    return groups[:want]
