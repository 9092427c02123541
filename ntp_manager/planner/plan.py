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
from collections.abc import Mapping
from typing import Literal, cast

from ntp_manager.planner.groups import Candidate, Ctx, History, WorkGroup, enumerate_groups, job_domain_positions
from ntp_manager.planner.moves import PreviousLayout
from ntp_manager.planner.packing import Item, pack
from ntp_manager.planner.power import PowerRequest, allocate_domain_power
from ntp_manager.planner.result import GroupPlan, MoveSummary, Plan, ReplicaPlan, SetAside
from ntp_manager.planner.spec import JobSpec, PlanError, Scheme
from ntp_manager.topology import Cluster

__all__ = ["GroupPlan", "MoveSummary", "Packing", "Plan", "ReplicaPlan", "SetAside", "make_plan"]


Packing = Literal["stable", "sorted", "none"]


def make_plan(
    cluster: Cluster, job: JobSpec, previous: Plan | PreviousLayout | None = None, *, packing: Packing = "stable"
) -> Plan:
    """Plan `job` on `cluster`. Raises PlanError (a ValueError) for invalid input.

    `previous` is the plan currently running (a Plan, or `PreviousLayout.from_dict(plan_json)`):
    among the packings with the best total, the planner keeps as many groups as it can in their
    previous (replica, stage), then moves the fewest bytes, and the plan reports what moved. Without
    it, the job's home layout (group k of the job in replica k // P, stage k % P) is the reference
    and no moves are reported. `packing="sorted"` is the packer before stage identity (sort by
    usable count, cut): the same totals, kept for comparison (bench/planner.py). `packing="none"`
    does not repack at all: every home replica keeps its groups, so under dp-drop one unusable GPU
    idles its whole replica (all its pipeline stages) and under ntp the replica runs at its lowest
    degree; spares are not used. It is the baseline of a job without a resource manager."""
    job.validate()
    if packing not in ("stable", "sorted", "none"):
        raise PlanError(f"packing must be 'stable', 'sorted' or 'none', got {packing!r}")
    positions = job_domain_positions(cluster, job)
    T = job.tp
    all_sizes = cluster.domain_sizes
    largest = max((all_sizes[i] for i in positions), default=0)
    if largest < T:
        raise PlanError(f"tp {T} is above the largest domain size {largest}")
    ctx = Ctx(cluster, T)

    reasons: list[str] = []
    want = job.primary_groups + job.spares
    history = History(previous, job)
    groups = enumerate_groups(ctx, job, positions, want, reasons, history)
    if len(groups) < job.primary_groups:
        reasons.append(
            f"the job's domains hold {len(groups)} TP groups of {T}, fewer than the "
            f"{job.primary_groups} it needs for {job.replicas} replicas"
        )

    keep, dropped = _usable(ctx, job, groups)
    prev_slot, prev_unknown = _previous_slots(ctx, previous, job, reasons)
    idle: list[SetAside] = []
    grants: dict[int, float] = {}
    if packing == "sorted":
        intact, repacked, free_ids = _pack_sorted(ctx, job, groups, keep, idle)
    elif packing == "none":
        intact, repacked, free_ids = _pack_none(ctx, job, groups, keep, idle)
    else:
        intact, repacked, free_ids = _pack_stable(ctx, job, groups, keep, prev_slot or {}, idle, grants)
    selected, total = _size_and_select(ctx, job, intact, repacked, grants, packing, idle, reasons)
    built = _Assembly(ctx, job, prev_slot, reasons)
    built.place(selected, free_ids, packing)
    target = job.target_batch
    if total < target:
        reasons.append(f"global batch {total} is below the target {target} ({100 * total / target:.2f}%)")
    if built.spares_used:
        reasons.append(f"{len(built.spares_used)} spare group(s) in use")
    moves = built.move_summary(prev_unknown)
    return Plan(
        job=job.name,
        scheme=job.scheme,
        tp=T,
        replicas=tuple(built.replicas),
        dropped=tuple(dropped),
        idle=tuple(idle),
        spares_used=tuple(built.spares_used),
        power_caps_w=built.caps,
        global_batch=total,
        target_batch=target,
        reasons=tuple(reasons),
        moves=moves,
    )


def _usable(ctx: Ctx, job: JobSpec, groups: list[WorkGroup]) -> tuple[list[bool], list[SetAside]]:
    """Phase 2: which groups may take work, and why the others are dropped."""
    T = job.tp
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
    return keep, dropped


def _size_and_select(
    ctx: Ctx,
    job: JobSpec,
    intact: list[Candidate],
    repacked: list[Candidate],
    grants: dict[int, float],
    packing: Packing,
    idle: list[SetAside],
    reasons: list[str],
) -> tuple[list[Candidate], int]:
    """Phases 4 and 5: each candidate's degree and batch, then the replicas taken (best batch first)
    until the target global batch; the rest stand by in `idle`. Returns (selected, global batch)."""
    T, P = job.tp, job.groups_per_replica
    full_tp, full_power = [T] * P, [1.0] * P
    for c in intact:
        c.tp, c.batch = T, job.local_batch
        c.group_tp, c.group_power = full_tp, full_power  # shared, never mutated
    _size_repacked(ctx, job, repacked, grants)

    viable = [c for c in repacked if c.batch > 0]
    for c in repacked:
        if c.batch <= 0:
            idle.extend(ctx.aside(g, f"replica at TP{c.tp} would get no sample") for g in c.groups)
    # Best batch first; among equals, the replicas that keep the most groups in place (stable: ties
    # keep packing order).
    viable.sort(key=lambda c: (-c.batch, -c.stayers))

    chosen, total = _select(intact + viable, job.target_batch)
    if job.scheme is Scheme.NTP_PW and packing == "stable":
        chosen, total = _power_aware_selection(ctx, job, intact, viable, chosen, total)
    ids_in = {id(c) for c, _ in chosen}
    for c in intact + viable:
        if id(c) not in ids_in:
            for g in c.groups:
                idle.append(ctx.aside(g, "standing by: target batch reached"))
                if g.degraded:
                    reasons.append(f"group {ctx.gid(g)} (a degraded GPU; alone it runs TP{g.usable} at pace "
                                   f"{g.pace:.2f}) stands by: groups at full speed (spares) give the target batch")
    selected: list[Candidate] = []
    for c, used in chosen:
        c.batch = used
        selected.append(c)
    return selected, total


class _Assembly:
    """The selected candidates turned into the plan's replicas: replica ids, group records, power
    caps, the spares in use, and (with a previous plan) what moved."""

    def __init__(
        self, ctx: Ctx, job: JobSpec, prev_slot: Mapping[tuple[int, int], tuple[int, int]] | None,
        reasons: list[str],
    ) -> None:
        self.ctx, self.job, self.reasons = ctx, job, reasons
        self.has_prev = prev_slot is not None
        self.prev_slot = prev_slot or {}
        self.replicas: list[ReplicaPlan] = []
        self.caps: dict[str, float] = {}
        self.spares_used: list[str] = []
        # moved groups: (key, previous slot or None, new slot); placed_before: placed groups that had a slot
        self.moved: list[tuple[tuple[int, int], tuple[int, int] | None, tuple[int, int]]] = []
        self.placed_before = 0

    def place(self, selected: list[Candidate], free_ids: list[int], packing: Packing) -> None:
        """Replica ids: kept ones keep theirs; new ones take free ids (in order), then fresh ones."""
        ctx, job = self.ctx, self.job
        used_ids = {c.home for c in selected if c.home is not None}
        free = iter(sorted(i for i in free_ids if i not in used_ids) if packing == "stable" else free_ids)
        next_new = max([job.replicas - 1, *free_ids, *used_ids]) + 1
        for c in selected:
            rid = c.home if c.home is not None else next(free, None)
            if rid is None:
                rid = next_new
                next_new += 1
            gps = [
                self._group(rid, stage, g, gtp, pr)
                for stage, (g, gtp, pr) in enumerate(zip(c.groups, c.group_tp, c.group_power, strict=True))
            ]
            self.replicas.append(ReplicaPlan(rid, tuple(gps), c.tp, c.batch, c.batch / job.local_batch))
            if c.stayers < len(c.groups) and (c.tp < job.tp or c.batch < job.local_batch):
                self.reasons.append(
                    f"replica {rid}: groups {', '.join(ctx.gid(g) for g in c.groups)} packed together at "
                    f"TP{c.tp}, local batch {c.batch}/{job.local_batch}"
                )
        self.replicas.sort(key=lambda r: r.replica_id)

    def _group(self, rid: int, stage: int, g: WorkGroup, gtp: int, pr: float) -> GroupPlan:
        ctx = self.ctx
        if pr > 1.0 + 1e-12:
            self._boost(g, gtp, pr)
        if g.spare:
            self.spares_used.append(ctx.gid(g))
        was = self.prev_slot.get((g.dpos, g.local)) if self.has_prev else None
        if self.has_prev:
            if was is not None:
                self.placed_before += 1
            if was is None or was[0] != rid or was[1] != stage:
                self.moved.append(((g.dpos, g.local), was, (rid, stage)))
        return GroupPlan(
            stage, gtp, g.usable, g.spare, pr, g.dpos, g.local, ctx.global_positions(g, gtp), ctx.ids, ctx.flat,
            None if was is None else was[0], None if was is None else was[1], g.pace_at(gtp),
        )

    def _boost(self, g: WorkGroup, gtp: int, pr: float) -> None:
        """Power caps for a boosted group's GPUs, and the reason."""
        ctx, job = self.ctx, self.job
        dg = ctx.domain(g).gpus
        capped = False
        for pos in ctx.local_positions(g, gtp):
            lim = dg[pos].power
            # whole milliwatts, rounded down (the 1e-6 absorbs float noise at the maximum)
            self.caps[dg[pos].uuid] = min(lim.max_w, math.floor(lim.nominal_w * pr * 1000 + 1e-6) / 1000)
            capped = capped or lim.base_w is not None
        base = "base cap" if capped else "TDP"
        pace = g.pace_at(gtp)
        slow = f" at pace {pace:.2f} (degraded GPU)" if pace < 1.0 else ""
        self.reasons.append(
            f"group {ctx.gid(g)}: TP{gtp}{slow} boosted to {pr:.3f}x {base} (needs speed "
            f"{job.speed_needed(gtp) / pace:.3f}x, gets {job.power.speed(pr):.3f}x)"
        )

    def move_summary(self, prev_unknown: int) -> MoveSummary | None:
        """What moved relative to the previous plan (None without one), with its reasons."""
        if not self.has_prev:
            return None
        moved, ids = self.moved, self.ctx.ids
        sizes = self.job.stage_sizes()
        changing = [new for _, old, new in moved if old is None or old[1] != new[1]]
        moves = MoveSummary(
            moved=len(moved),
            stage_changed=len(changing),
            joined=sum(1 for _, old, _ in moved if old is None),
            left=len(self.prev_slot) - self.placed_before + prev_unknown,
            bytes=None if sizes is None else sum(sizes[new[1]] for new in changing),
            moved_groups=tuple(f"{ids[k[0]]}/g{k[1]}" for k, _, _ in moved),
        )
        self.reasons.append(moves.describe())
        for (_, old, new), gid in zip(moved[:MAX_MOVE_REASONS], moves.moved_groups, strict=False):
            was_at = "newly placed" if old is None else f"replica {old[0]} stage {old[1]}"
            self.reasons.append(f"group {gid}: {was_at} -> replica {new[0]} stage {new[1]}")
        if len(moved) > MAX_MOVE_REASONS:
            self.reasons.append(f"... and {len(moved) - MAX_MOVE_REASONS} more moved group(s)")
        return moves


MAX_MOVE_REASONS = 20  # moved groups named one by one in a plan's reasons


def _previous_slots(
    ctx: Ctx, previous: Plan | PreviousLayout | None, job: JobSpec, reasons: list[str]
) -> tuple[dict[tuple[int, int], tuple[int, int]] | None, int]:
    """Previous (replica, stage) by (domain position, group index in its domain), and how many of
    its groups this cluster does not hold; (None, 0) without a usable previous plan."""
    if previous is None:
        return None, 0
    if isinstance(previous, Plan):
        tp: int | None = previous.tp
        per = {len(r.groups) for r in previous.replicas}
        P_prev = per.pop() if len(per) == 1 else None
    else:
        tp, P_prev = previous.tp, previous.groups_per_replica
    if tp is not None and tp != job.tp:
        reasons.append(f"previous plan ignored: its TP degree {tp} is not the job's {job.tp}")
        return None, 0
    if P_prev is not None and P_prev != job.groups_per_replica:
        reasons.append(
            f"previous plan ignored: its replicas have {P_prev} groups, the job's {job.groups_per_replica}"
        )
        return None, 0
    out: dict[tuple[int, int], tuple[int, int]] = {}
    unknown = 0
    if isinstance(previous, Plan) and all(
        g.domain_ids is ctx.ids for r in previous.replicas[:1] for g in r.groups[:1]
    ):
        # a plan of this cluster (the same shape): positions are comparable, no ids to parse
        for r in previous.replicas:
            for g in r.groups:
                out[(g.domain_pos, g.local)] = (r.replica_id, g.stage)
        return out, 0
    layout = previous if isinstance(previous, PreviousLayout) else PreviousLayout.from_plan(previous)
    index = ctx.cluster.domain_index
    for gid, slot in layout.assignments.items():
        dom, sep, local = gid.rpartition("/g")
        dpos = index.get(dom)
        if sep and dpos is not None and local.isdigit():
            out[(dpos, int(local))] = slot
        else:
            unknown += 1
    return out, unknown


def _pack_stable(
    ctx: Ctx,
    job: JobSpec,
    groups: list[WorkGroup],
    keep: list[bool],
    prev_slot: Mapping[tuple[int, int], tuple[int, int]],
    idle: list[SetAside],
    grants: dict[int, float],
) -> tuple[list[Candidate], list[Candidate], list[int]]:
    """Replicas with stage identity: (intact, repacked, ids of reference replicas).

    The reference is the previous plan, else the home layout. A reference replica whose P groups
    are all still fully usable stays exactly as it is. Every other usable group is packed by
    planner/packing.py, keyed by what sets a replica's value under the scheme. Under ntp-pw the
    power grants behind the keys are left in `grants` (group order -> power ratio) for reuse,
    minus the racks where a reduced group was left over (those are granted again without it)."""
    T, P = job.tp, job.groups_per_replica
    n_primary = min(len(groups), job.primary_groups)

    def ref(g: WorkGroup) -> tuple[int, int] | None:
        if prev_slot:
            slot = prev_slot.get((g.dpos, g.local))
            return slot if slot is not None and slot[1] < P else None
        return (g.order // P, g.order % P) if g.order < n_primary else None

    rows: dict[int, list[WorkGroup | None]] = {}
    if prev_slot:
        for g in groups:
            slot = ref(g)
            if slot is not None:
                row = rows.get(slot[0])
                if row is None:
                    row = rows[slot[0]] = [None] * P
                row[slot[1]] = g
    else:  # the home layout: replica r holds the job's groups r*P .. r*P+P-1
        for r in range(-(-n_primary // P)):
            home: list[WorkGroup | None] = [*groups[r * P : min((r + 1) * P, n_primary)]]
            rows[r] = home + [None] * (P - len(home))
    intact: list[Candidate] = []
    in_intact: set[int] = set()
    for rid in sorted(rows):
        members = rows[rid]
        if all(g is not None and keep[g.order] and g.usable == T and g.pace == 1.0 for g in members):
            full = [g for g in members if g is not None]
            intact.append(Candidate(full, rid, P))
            in_intact.update(g.order for g in full)
    pool = [g for g in groups if keep[g.order] and g.order not in in_intact]
    keys = _packing_keys(ctx, job, pool, grants)
    slack = _rack_slack(job, pool)
    items = [Item(i, keys[i], ref(g), slack[i]) for i, g in enumerate(pool)]
    sizes = job.stage_sizes()
    blocks, left = pack(items, P, None if sizes is None else [sizes[s] for s in range(P)])
    repacked = [Candidate([pool[i] for i in b.slots], b.rid, b.stayers) for b in blocks]
    idle.extend(ctx.aside(pool[i], f"too few usable groups to fill a replica of {P}") for i in left)
    stale = {pool[i].dpos for i in left if pool[i].usable < T or pool[i].pace < 1.0}
    if stale:
        for order in [o for o in grants if groups[o].dpos in stale]:
            del grants[order]
    free_ids = sorted(set(rows) - {c.home for c in intact})
    return intact, repacked, free_ids


def _select(cands: list[Candidate], target: int) -> tuple[list[tuple[Candidate, int]], int]:
    """Candidates in order until `target` samples are reached, each with the batch it runs (the
    last one trimmed to land on the target exactly), and the total."""
    out: list[tuple[Candidate, int]] = []
    total = 0
    for c in cands:
        if total >= target:
            break
        used = min(c.batch, target - total)
        out.append((c, used))
        total += used
    return out, total


def _power_aware_selection(
    ctx: Ctx,
    job: JobSpec,
    intact: list[Candidate],
    viable: list[Candidate],
    chosen: list[tuple[Candidate, int]],
    total: int,
) -> tuple[list[tuple[Candidate, int]], int]:
    """Under ntp-pw, give the power of reduced groups that will not run to their selected rack-mates.

    Two kinds of groups do not run: those of replicas standing by, and possibly those of the last
    selected replica when it is trimmed (it may become unnecessary once its rack-mates run faster).
    Their racks are granted again among the selected reduced groups (grants only rise, so the
    budget holds while the others draw nominal) and the replicas selected again. If the trimmed
    replica is needed after all, the attempt is undone (it would draw more than nominal)."""
    target = job.target_batch
    for _ in range(4):
        ids_in = {id(c) for c, _ in chosen}
        others = [c for c in viable if id(c) not in ids_in]
        keep = [c for c, _ in chosen]
        last, used = chosen[-1] if chosen else (None, 0)
        dropping = last is not None and used < last.batch and last.tp < job.tp
        if dropping:
            assert last is not None
            others.append(last)
            keep.pop()
        saved = {id(c): (list(c.group_power), c.batch) for c in keep}
        if not _regrant_selected(ctx, job, keep, others):
            # no batch rose: the grants it raised are undone too. They assumed every replica in
            # `others` draws nominal, and a trimmed last replica is still selected and runs boosted
            # (its rack went over budget: a TP6 raised to 1.3x beside its TP7 rack-mate at 1.23x)
            for c in keep:
                c.group_power[:], c.batch = saved[id(c)]
            return chosen, total
        viable.sort(key=lambda c: (-c.batch, -c.stayers))
        again, again_total = _select(intact + viable, target)
        out = {id(c) for c in others}
        if any(id(c) in out for c, _ in again):
            # undo: a replica the grants counted at nominal (the trimmed last one, or one standing
            # by) runs after all, at the grant it had before
            for c in keep:
                c.group_power[:], c.batch = saved[id(c)]
            viable.sort(key=lambda c: (-c.batch, -c.stayers))
            return _select(intact + viable, target)
        chosen, total = again, again_total
    return chosen, total


def _regrant_selected(ctx: Ctx, job: JobSpec, selected: list[Candidate], others: list[Candidate]) -> bool:
    """Grant power again, among the selected replicas' reduced groups only, in the racks where a
    reduced group of a replica in `others` (not selected) held a grant. Batches of the selected
    replicas are recomputed; returns whether any rose. Removing requests from a water-filling never
    lowers what the others get, so no grant and no batch falls."""
    T = job.tp
    racks = {g.dpos for c in others for g, t in zip(c.groups, c.group_tp, strict=True) if _boostable(g, t, T)}
    if not racks:
        return False
    need = {t: job.speed_needed(t) for t in range(job.min_tp, T + 1)}
    requests: dict[int, list[PowerRequest]] = {}
    for ci, c in enumerate(selected):
        for si, (g, t) in enumerate(zip(c.groups, c.group_tp, strict=True)):
            if _boostable(g, t, T) and g.dpos in racks:
                requests.setdefault(g.dpos, []).append(
                    PowerRequest((ci, si), ctx.domain(g), ctx.uuids(g, t), need[t] / g.pace_at(t)))
    touched: set[int] = set()
    for reqs in requests.values():
        for key, ratio in allocate_domain_power(reqs[0].domain, reqs, job.power).items():
            ci, si = cast(tuple[int, int], key)
            if ratio > selected[ci].group_power[si]:
                selected[ci].group_power[si] = ratio
                touched.add(ci)
    rose = False
    for ci in touched:
        c = selected[ci]
        batch = _pw_batch(job, c)
        if batch > c.batch:
            c.batch = batch
            rose = True
    return rose


def _boostable(g: WorkGroup, t: int, T: int) -> bool:
    """Whether a group running `t` members asks its rack for power (ntp-pw): reduced, or slow."""
    return t < T or g.pace_at(t) < 1.0


def _pw_batch(job: JobSpec, c: Candidate) -> int:
    """Local batch of an ntp-pw replica: each group at its own degree, its GPUs at their power's
    speed times the group's pace (a degraded member slows its group)."""
    batch = job.local_batch
    for g, t, pr in zip(c.groups, c.group_tp, c.group_power, strict=True):
        if _boostable(g, t, job.tp):
            batch = min(batch, job.reduced_batch(t, job.power.speed(pr) * g.pace_at(t)))
    return batch


def _rack_slack(job: JobSpec, pool: list[WorkGroup]) -> list[int]:
    """Under ntp-pw, 0 for a reduced group whose rack holds another reduced group of the pool (they
    share the rack's spare power), else 1; all 1 under the other schemes (no power is shared)."""
    if job.scheme is not Scheme.NTP_PW:
        return [1] * len(pool)
    reduced: dict[int, int] = {}
    for g in pool:
        if g.usable < job.tp or g.pace < 1.0:
            reduced[g.dpos] = reduced.get(g.dpos, 0) + 1
    return [0 if (g.usable < job.tp or g.pace < 1.0) and reduced[g.dpos] > 1 else 1 for g in pool]


def _packing_keys(ctx: Ctx, job: JobSpec, pool: list[WorkGroup], grants: dict[int, float]) -> list[int]:
    """What a replica is worth is the lowest key of its groups: all equal under dp-drop (only full
    groups are kept), the usable count under ntp (the replica runs at its lowest), and under ntp-pw
    the local batch the group's power grant allows (each group runs at its own degree, boosted
    within its rack's budget; grants here count every reduced group of the pool). A group with a
    degraded member is worth the local batch its pace allows (under ntp too, where a pool holding
    one is keyed by batch: a replica runs at its lowest degree and its slowest group's pace)."""
    T = job.tp
    if job.scheme is Scheme.DP_DROP:
        return [0] * len(pool)
    if job.scheme is Scheme.NTP:
        if all(g.pace == 1.0 for g in pool):
            return [min(g.usable, T) for g in pool]
        return [job.reduced_batch(min(g.usable, T), g.pace) for g in pool]
    work = {t: job.speed_needed(t) for t in range(job.min_tp, T + 1)}
    requests: dict[int, list[PowerRequest]] = {}
    for i, g in enumerate(pool):
        t = min(g.usable, T)
        if _boostable(g, t, T):
            requests.setdefault(g.dpos, []).append(PowerRequest(i, ctx.domain(g), ctx.uuids(g, t), work[t] / g.pace))
    keys = [job.local_batch] * len(pool)
    for reqs in requests.values():
        granted = allocate_domain_power(reqs[0].domain, reqs, job.power)
        for req in reqs:
            i = cast(int, req.key)
            g = pool[i]
            keys[i] = job.reduced_batch(min(g.usable, T), job.power.speed(granted[req.key]) * g.pace)
            grants[g.order] = granted[req.key]
    return keys


def _pack_sorted(
    ctx: Ctx, job: JobSpec, groups: list[WorkGroup], keep: list[bool], idle: list[SetAside]
) -> tuple[list[Candidate], list[Candidate], list[int]]:
    """The packer before stage identity: intact home replicas stay, every other usable group is
    sorted by usable count and the list is cut into replicas (a group's stage is its position)."""
    T, P = job.tp, job.groups_per_replica
    intact: list[Candidate] = []
    pool: list[WorkGroup] = []
    broken_homes: list[int] = []
    n_primary = min(len(groups), job.primary_groups)
    for r in range(job.replicas):
        members = groups[r * P : (r + 1) * P] if (r + 1) * P <= n_primary else None
        if members is not None and all(g.usable == T and g.pace == 1.0 for g in members):
            intact.append(Candidate(members, r, P))
        else:
            broken_homes.append(r)
            lo, hi = r * P, min((r + 1) * P, n_primary)
            pool.extend(g for g in groups[lo:hi] if keep[g.order])
    pool.extend(g for g in groups[n_primary:] if keep[g.order])
    pool.sort(key=lambda g: (-g.usable, g.order))
    repacked = [Candidate(pool[i : i + P], None) for i in range(0, len(pool) - P + 1, P)]
    idle.extend(ctx.aside(g, f"too few usable groups to fill a replica of {P}") for g in pool[len(repacked) * P :])
    return intact, repacked, broken_homes


def _pack_none(
    ctx: Ctx, job: JobSpec, groups: list[WorkGroup], keep: list[bool], idle: list[SetAside]
) -> tuple[list[Candidate], list[Candidate], list[int]]:
    """No repacking: home replica r is the job's groups r*P .. r*P+P-1, whatever their health. A
    replica with a dropped group (dp-drop: any unusable GPU; ntp: below min_tp) is idle whole."""
    T, P = job.tp, job.groups_per_replica
    intact: list[Candidate] = []
    reduced: list[Candidate] = []
    n_primary = min(len(groups), job.primary_groups)
    for r in range(n_primary // P):
        members = groups[r * P : (r + 1) * P]
        if all(g.usable == T and g.pace == 1.0 for g in members):
            intact.append(Candidate(members, r, P))
        elif all(keep[g.order] for g in members):
            reduced.append(Candidate(members, r, P))
        else:
            bad = next(g for g in members if not keep[g.order])
            idle.extend(
                ctx.aside(g, f"no repacking: replica {r} lost group {ctx.gid(bad)}") for g in members if keep[g.order]
            )
    idle.extend(ctx.aside(g, "no repacking: spares are not used") for g in groups[n_primary:] if keep[g.order])
    return intact, reduced, []


def _size_repacked(
    ctx: Ctx, job: JobSpec, repacked: list[Candidate], known: Mapping[int, float] | None = None
) -> None:
    """Set TP degrees, power ratios and local batches of repacked replicas, by scheme. `known`:
    power ratios already granted (group order -> ratio) for racks whose reduced groups are exactly
    the ones packed here."""
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
            pace = min(g.pace_at(c.tp) for g in c.groups)
            c.batch = batch_at[c.tp] if pace == 1.0 else job.reduced_batch(c.tp, pace)
            c.group_tp = [c.tp] * len(c.groups)
            c.group_power = [1.0] * len(c.groups)
        return

    # ntp-pw: each group at its own degree; reduced groups ask their rack for power.
    work = {t: job.speed_needed(t) for t in range(job.min_tp, T + 1)}
    requests: dict[int, list[PowerRequest]] = {}
    for ci, c in enumerate(repacked):
        c.group_tp = [min(g.usable, T) for g in c.groups]
        c.tp = min(c.group_tp)
        c.group_power = [1.0] * len(c.groups)
        for si, (g, t) in enumerate(zip(c.groups, c.group_tp, strict=True)):
            if _boostable(g, t, T):
                if known is not None and g.order in known:
                    c.group_power[si] = known[g.order]
                    continue
                requests.setdefault(g.dpos, []).append(
                    PowerRequest((ci, si), ctx.domain(g), ctx.uuids(g, t), work[t] / g.pace_at(t))
                )
    for reqs in requests.values():
        grants = allocate_domain_power(reqs[0].domain, reqs, job.power)
        for req in reqs:
            ci, si = cast(tuple[int, int], req.key)
            repacked[ci].group_power[si] = grants[req.key]
    for c in repacked:
        c.batch = _pw_batch(job, c)
