"""The NTP planner: cluster snapshot + job spec -> plan (replicas, TP degrees, batches, power caps).

Pure and deterministic: same input, same plan. Every decision leaves a reason.

How a plan is made
1. *Groups.* The job's domains (in order) are cut into home TP groups of `tp` GPUs, in the
   domain's (node, index) order. GPUs left over when `tp` does not divide the domain size act as
   in-domain spares: they fill unusable slots of that domain's groups, in order. The first
   `replicas x groups_per_replica` groups are the job's primary groups, the next `spares` its spare
   pool; further groups are not the job's.
2. *Usable groups.* A group's usable count is how many of its GPUs may take work. `dp-drop` keeps a
   group only when all `tp` are usable; `ntp` and `ntp-pw` keep it while usable >= `min_tp`.
3. *Packing.* A home replica whose groups are all fully healthy stays as it is (no churn). The
   groups of every other home replica, plus the spare groups, are sorted by usable count (most
   first; ties by group order) and cut into replicas of `groups_per_replica`. For a fixed set of
   groups, cutting the sorted list maximises the sum of replica minima (the replica TP degrees):
   the k-th best replica's minimum can never beat the (k x size)-th best group. Keeping intact
   replicas aside does not change that multiset of minima, since they are all at full degree.
4. *Batch.* `dp-drop` replicas run the full local batch. An `ntp` replica runs every group at its
   lowest usable count t and the largest local batch whose step time does not exceed a healthy
   replica's (see JobSpec.work). An `ntp-pw` replica runs each group at its own usable count and
   raises the power of reduced groups so they keep pace (planner/power.py); when the rack cannot
   give enough, the batch shrinks instead.
5. *Selection.* Replicas are taken best batch first until the target global batch
   (replicas x local_batch) is reached; the last one taken is trimmed to land on the target
   exactly. Whatever is left stands by idle. Throughput is the global batch over the target.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from ntp_manager.planner.power import PowerRequest, allocate_domain_power
from ntp_manager.planner.spec import JobSpec, PlanError, Scheme
from ntp_manager.topology import Cluster, Domain


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

    @property
    def relative_throughput(self) -> float:
        """Samples per step over the target (1.0 = as healthy)."""
        return self.global_batch / self.target_batch

    @property
    def meets_target(self) -> bool:
        return self.global_batch >= self.target_batch

    @property
    def gpus_in_use(self) -> int:
        return sum(len(g.gpus) for r in self.replicas for g in r.groups)


# ---- internal working records ---------------------------------------------------------------


@dataclass(slots=True)
class _Group:
    order: int
    dpos: int  # domain position in the cluster (the Domain object is touched only when needed)
    local: int  # group index within its domain
    positions: tuple[int, ...] | None  # usable in-domain positions in TP order; None = home slice
    usable: int
    spare: bool


class _Ctx:
    """Per-plan look-ups into the cluster's shared tables."""

    def __init__(self, cluster: Cluster, tp: int) -> None:
        self.cluster = cluster
        self.tp = tp
        self.ids = cluster.domain_ids
        self.offsets = cluster.domain_offsets
        self.flat = cluster.flat_uuids

    def gid(self, g: _Group) -> str:
        return f"{self.ids[g.dpos]}/g{g.local}"

    def aside(self, g: _Group, reason: str) -> SetAside:
        return SetAside(self.gid(g), self.ids[g.dpos], g.usable, g.spare, reason)

    def domain(self, g: _Group) -> Domain:
        return self.cluster.domains[g.dpos]

    def local_positions(self, g: _Group, count: int) -> range | tuple[int, ...]:
        if g.positions is None:
            return range(g.local * self.tp, g.local * self.tp + count)
        return g.positions[:count]

    def global_positions(self, g: _Group, count: int) -> range | tuple[int, ...]:
        off = self.offsets[g.dpos]
        if g.positions is None:
            start = off + g.local * self.tp
            return range(start, start + count)
        return tuple(off + p for p in g.positions[:count])

    def uuids(self, g: _Group, count: int) -> tuple[str, ...]:
        p = self.global_positions(g, count)
        if isinstance(p, range):
            return self.flat[p.start : p.stop]
        return tuple(self.flat[i] for i in p)


@dataclass(slots=True)
class _Candidate:
    groups: list[_Group]
    home: int | None  # home replica id when kept intact
    tp: int = 0
    batch: int = 0
    group_tp: list[int] = field(default_factory=list)
    group_power: list[float] = field(default_factory=list)


def make_plan(cluster: Cluster, job: JobSpec) -> Plan:
    """Plan `job` on `cluster`. Raises PlanError (a ValueError) for invalid input."""
    job.validate()
    positions = _job_domain_positions(cluster, job)
    T = job.tp
    all_sizes = cluster.domain_sizes
    largest = max((all_sizes[i] for i in positions), default=0)
    if largest < T:
        raise PlanError(f"tp {T} is above the largest domain size {largest}")
    ctx = _Ctx(cluster, T)

    reasons: list[str] = []
    want = job.primary_groups + job.spares
    groups = _enumerate_groups(ctx, positions, want, job.primary_groups, reasons)
    if len(groups) < job.primary_groups:
        reasons.append(
            f"the job's domains hold {len(groups)} TP groups of {T}, fewer than the "
            f"{job.primary_groups} it needs for {job.replicas} replicas"
        )

    threshold = T if job.scheme is Scheme.DP_DROP else job.min_tp
    keep: list[bool] = []
    dropped: list[SetAside] = []
    for g in groups:
        ok = g.usable >= threshold
        keep.append(ok)
        if not ok:
            why = (
                f"{g.usable}/{T} GPUs usable; dp-drop needs all of them"
                if job.scheme is Scheme.DP_DROP
                else f"{g.usable}/{T} GPUs usable, below min_tp {job.min_tp}"
            )
            dropped.append(ctx.aside(g, why))

    # Home replicas that are fully healthy stay intact; everything else is repacked.
    P = job.groups_per_replica
    intact: list[_Candidate] = []
    pool: list[_Group] = []
    broken_homes: list[int] = []
    n_primary = min(len(groups), job.primary_groups)
    for r in range(job.replicas):
        members = groups[r * P : (r + 1) * P] if (r + 1) * P <= n_primary else None
        if members is not None and all(g.usable == T for g in members):
            intact.append(_Candidate(members, r))
        else:
            broken_homes.append(r)
            lo, hi = r * P, min((r + 1) * P, n_primary)
            pool.extend(g for g in groups[lo:hi] if keep[g.order])
    pool.extend(g for g in groups[n_primary:] if keep[g.order])
    pool.sort(key=lambda g: (-g.usable, g.order))

    repacked = [_Candidate(pool[i : i + P], None) for i in range(0, len(pool) - P + 1, P)]
    idle: list[SetAside] = [
        ctx.aside(g, f"too few usable groups to fill a replica of {P}") for g in pool[len(repacked) * P :]
    ]

    full_tp, full_power = [T] * P, [1.0] * P
    for c in intact:
        c.tp, c.batch = T, job.local_batch
        c.group_tp, c.group_power = full_tp, full_power  # shared, never mutated
    _size_repacked(ctx, job, repacked)

    viable = [c for c in repacked if c.batch > 0]
    for c in repacked:
        if c.batch <= 0:
            idle.extend(ctx.aside(g, f"replica at TP{c.tp} would get no sample") for g in c.groups)
    viable.sort(key=lambda c: -c.batch)  # stable: ties keep packing order

    # Select replicas, best batch first, until the target global batch is reached.
    target = job.target_batch
    selected: list[_Candidate] = []
    total = 0
    for c in intact + viable:
        if total >= target:
            idle.extend(ctx.aside(g, "standing by: target batch reached") for g in c.groups)
            continue
        if total + c.batch > target:
            c.batch = target - total
        total += c.batch
        selected.append(c)

    # Replica ids: intact replicas keep theirs; repacked ones take freed ids, then new ones.
    free = iter(broken_homes)
    next_new = job.replicas
    replicas: list[ReplicaPlan] = []
    caps: dict[str, float] = {}
    spares_used: list[str] = []
    ids, flat = ctx.ids, ctx.flat
    for c in selected:
        rid = c.home if c.home is not None else next(free, None)
        if rid is None:
            rid = next_new
            next_new += 1
        gps = []
        for stage, (g, gtp, pr) in enumerate(zip(c.groups, c.group_tp, c.group_power, strict=True)):
            if pr > 1.0 + 1e-12:
                dg = ctx.domain(g).gpus
                capped = False
                for pos in ctx.local_positions(g, gtp):
                    lim = dg[pos].power
                    # whole milliwatts, rounded down (the 1e-6 absorbs float noise at the maximum)
                    caps[dg[pos].uuid] = min(lim.max_w, math.floor(lim.nominal_w * pr * 1000 + 1e-6) / 1000)
                    capped = capped or dg[pos].power.base_w is not None
                base = "base cap" if capped else "TDP"
                reasons.append(
                    f"group {ctx.gid(g)}: TP{gtp} boosted to {pr:.3f}x {base} (needs speed "
                    f"{job.work(gtp):.3f}x, gets {job.power.speed(pr):.3f}x)"
                )
            if g.spare:
                spares_used.append(ctx.gid(g))
            gps.append(
                GroupPlan(
                    stage, gtp, g.usable, g.spare, pr, g.dpos, g.local, ctx.global_positions(g, gtp), ids, flat
                )
            )
        replicas.append(ReplicaPlan(rid, tuple(gps), c.tp, c.batch, c.batch / job.local_batch))
        if c.home is None and (c.tp < T or c.batch < job.local_batch):
            reasons.append(
                f"replica {rid}: groups {', '.join(ctx.gid(g) for g in c.groups)} packed together at "
                f"TP{c.tp}, local batch {c.batch}/{job.local_batch}"
            )
    replicas.sort(key=lambda r: r.replica_id)
    if total < target:
        reasons.append(f"global batch {total} is below the target {target} ({100 * total / target:.2f}%)")
    if spares_used:
        reasons.append(f"{len(spares_used)} spare group(s) in use")

    return Plan(
        job=job.name,
        scheme=job.scheme,
        tp=T,
        replicas=tuple(replicas),
        dropped=tuple(dropped),
        idle=tuple(idle),
        spares_used=tuple(spares_used),
        power_caps_w=caps,
        global_batch=total,
        target_batch=target,
        reasons=tuple(reasons),
    )


def _job_domain_positions(cluster: Cluster, job: JobSpec) -> Sequence[int]:
    """Positions of the job's domains in the cluster, in the job's order."""
    if not job.domains:
        return range(len(cluster.domain_sizes))
    idx = cluster.domain_index
    for did in job.domains:
        if did not in idx:
            raise PlanError(f"job {job.name!r} names unknown domain {did!r}")
    return [idx[did] for did in job.domains]


def _enumerate_groups(
    ctx: _Ctx, positions: Sequence[int], want: int, n_primary: int, reasons: list[str]
) -> list[_Group]:
    T = ctx.tp
    sizes = ctx.cluster.domain_sizes
    unhealthy = ctx.cluster.unhealthy_domains
    groups: list[_Group] = []
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
                groups.append(_Group(o, dpos, j, None, T, o >= n_primary))
            continue
        bad = ctx.cluster.domains[dpos].unplaceable
        # In-domain spares (positions past the last full group) fill unusable slots in order.
        local_spares = [p for p in range(k * T, size) if p not in bad]
        for j in range(k):
            o = len(groups)
            home = range(j * T, (j + 1) * T)
            if not bad.intersection(home):
                groups.append(_Group(o, dpos, j, None, T, o >= n_primary))
                continue
            picked = []
            for p in home:
                if p not in bad:
                    picked.append(p)
                elif local_spares:
                    picked.append(local_spares.pop(0))
            groups.append(_Group(o, dpos, j, tuple(picked), len(picked), o >= n_primary))
    return groups[:want]


def _size_repacked(ctx: _Ctx, job: JobSpec, repacked: list[_Candidate]) -> None:
    """Set TP degrees, power ratios and local batches of repacked replicas, by scheme."""
    T, B = job.tp, job.local_batch
    if job.scheme is Scheme.DP_DROP:
        for c in repacked:
            c.tp, c.batch = T, B
            c.group_tp = [T] * len(c.groups)
            c.group_power = [1.0] * len(c.groups)
        return
    if job.scheme is Scheme.NTP:
        batch_at = {t: job.reduced_batch(t) for t in range(job.min_tp, T + 1)}
        for c in repacked:
            c.tp = min(min(g.usable for g in c.groups), T)
            c.batch = batch_at[c.tp]
            c.group_tp = [c.tp] * len(c.groups)
            c.group_power = [1.0] * len(c.groups)
        return

    # ntp-pw: each group at its own degree; reduced groups ask their rack for power.
    work = {t: job.work(t) for t in range(job.min_tp, T + 1)}
    requests: dict[int, list[PowerRequest]] = {}
    for ci, c in enumerate(repacked):
        c.group_tp = [min(g.usable, T) for g in c.groups]
        c.tp = min(c.group_tp)
        c.group_power = [1.0] * len(c.groups)
        for si, (g, t) in enumerate(zip(c.groups, c.group_tp, strict=True)):
            if t < T:
                requests.setdefault(g.dpos, []).append(
                    PowerRequest((ci, si), ctx.domain(g), ctx.uuids(g, t), work[t])
                )
    for reqs in requests.values():
        grants = allocate_domain_power(reqs[0].domain, reqs, job.power)
        for req in reqs:
            ci, si = cast(tuple[int, int], req.key)
            repacked[ci].group_power[si] = grants[req.key]
    for c in repacked:
        batch = B
        for t, pr in zip(c.group_tp, c.group_power, strict=True):
            if t < T:
                batch = min(batch, job.reduced_batch(t, job.power.speed(pr)))
        c.batch = batch
