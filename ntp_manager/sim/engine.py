"""The simulator: drives the real planner over failure placements (static) or failure traces.

Nothing here models the policy: every throughput number comes from `make_plan`, the function the
live manager calls. The simulator only decides *which* GPUs are failed *when*.

- Static mode: for each failed fraction f, `placements` random sets of round(f x N) failed GPUs
  (seeded); each set is planned under every scheme; loss = 1 - plan throughput.
- Trace mode: an event-driven run over `days`. Failures arrive as a Poisson process, each one
  fails a GPU (or its node or domain) until its repair time; the cluster is replanned after every
  batch of simultaneous events and throughput is integrated over time. In fixed-minibatch mode
  training pauses (throughput 0) while the plan's global batch is below the target.

Progress is reported through an optional callback, so the CLI can draw a progress bar while this
module stays free of I/O.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec, Plan, Scheme, make_plan
from ntp_manager.planner.plan import Packing
from ntp_manager.sim.failures import FailureModel, SimError
from ntp_manager.sim.stall import STALL_PRESETS, StallModel
from ntp_manager.topology import Cluster

Progress = Callable[[int], None]


def _noop(_: int) -> None:
    return None


@dataclass(frozen=True)
class SimSetup:
    """A cluster with room for `max_spares` spare groups after the job's primary groups."""

    cluster: Cluster
    job: JobSpec  # spares=0; variants set scheme and spares
    model: FailureModel
    max_spares: int = 0
    packing: Packing = "stable"  # "none": home replicas keep their groups (no resource manager)
    uuids: tuple[str, ...] = field(default=(), repr=False)
    node_of: tuple[int, ...] = field(default=(), repr=False)
    domain_of: tuple[int, ...] = field(default=(), repr=False)
    members: dict[str, tuple[tuple[int, ...], ...]] = field(default_factory=dict, repr=False)

    @classmethod
    def create(
        cls, cluster: Cluster, job: JobSpec, model: FailureModel, max_spares: int = 0, packing: Packing = "stable"
    ) -> SimSetup:
        job.validate()
        model.validate()
        if max_spares < 0:
            raise SimError(f"spares must be >= 0, got {max_spares}")
        uuids: list[str] = []
        node_of: list[int] = []
        domain_of: list[int] = []
        nodes: list[tuple[int, ...]] = []
        domains: list[tuple[int, ...]] = []
        for d in cluster.domains:
            start = len(uuids)
            for node in d.nodes:
                first = len(uuids)
                for u in node.gpus:
                    uuids.append(u)
                    node_of.append(len(nodes))
                    domain_of.append(len(domains))
                nodes.append(tuple(range(first, len(uuids))))
            domains.append(tuple(range(start, len(uuids))))
        if packing == "none" and max_spares:
            raise SimError("without repacking (packing 'none') spares are never used; drop --spares")
        return cls(
            cluster, replace(job, spares=0), model, max_spares, packing, tuple(uuids), tuple(node_of), tuple(domain_of),
            {"node": tuple(nodes), "domain": tuple(domains)},
        )

    @property
    def n_gpus(self) -> int:
        return len(self.uuids)

    def variant(self, scheme: Scheme, spares: int = 0) -> JobSpec:
        if spares > self.max_spares:
            raise SimError(f"{spares} spares asked, the simulated cluster holds {self.max_spares}")
        return replace(self.job, scheme=scheme, spares=spares)

    def blast(self, gpu: int, radius: str) -> Sequence[int]:
        if radius == "gpu":
            return (gpu,)
        owner = self.node_of[gpu] if radius == "node" else self.domain_of[gpu]
        return self.members[radius][owner]

    def snapshot(self, failed: Sequence[int]) -> Cluster:
        return self.cluster.with_states({self.uuids[i]: GpuState.FAILED for i in failed})

    def plan(self, snap: Cluster, job: JobSpec, previous: Plan | None = None) -> Plan:
        return make_plan(snap, job, previous, packing=self.packing)


def plan_throughput(plan: Plan, job: JobSpec) -> float:
    """Samples per second of `plan` relative to the healthy job.

    Without a step model: global batch / target batch (every replica keeps the healthy step time).
    With one (JobSpec.step_model): (global batch / target) x healthy step / the plan's step, where a
    step is the slowest replica's pipeline (each group at its own degree and power) plus the DP sync
    over the plan's replicas, whose bytes per core rank grow by T / t for the lowest degree t in the
    plan (the NTP sync, docs/references.md)."""
    sm = job.step_model
    if sm is None:
        return plan.relative_throughput
    if not plan.replicas:
        return 0.0
    healthy = sm.pipeline_time(job.tp, job.local_batch) + sm.dp_sync_time(job.replicas)
    slowest = 0.0
    lowest = job.tp
    for r in plan.replicas:
        for g in r.groups:
            lowest = min(lowest, g.tp)
            if g.tp < job.tp or g.power_ratio != 1.0:
                speed = job.power.speed(g.power_ratio) if g.power_ratio != 1.0 else 1.0
                slowest = max(slowest, sm.pipeline_time(g.tp, r.local_batch, speed))
            else:
                slowest = max(slowest, sm.pipeline_time(job.tp, r.local_batch))
    step = slowest + sm.dp_sync_time(len(plan.replicas), lowest)
    return plan.relative_throughput * healthy / step


# ---- static mode ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StaticPoint:
    fraction: float
    failed_gpus: int
    scheme: Scheme
    losses: tuple[float, ...]  # one per placement

    @property
    def mean_loss(self) -> float:
        return sum(self.losses) / len(self.losses)

    @property
    def max_loss(self) -> float:
        return max(self.losses)


def static_sweep(
    setup: SimSetup,
    schemes: Sequence[Scheme],
    fractions: Sequence[float],
    placements: int,
    seed: int,
    spares: int = 0,
    progress: Progress = _noop,
) -> list[StaticPoint]:
    """Mean throughput loss per scheme at each failed fraction (placements are shared by schemes)."""
    if placements < 1:
        raise SimError("placements must be >= 1")
    for f in fractions:
        if not 0 <= f < 1:
            raise SimError(f"failed fraction must be in [0, 1), got {f}")
    jobs = {s: setup.variant(s, spares) for s in schemes}
    # Static placements are over the GPUs the job may use (primary + its spares), uniformly.
    pool = _job_pool_size(setup, spares)
    out: list[StaticPoint] = []
    for f in fractions:
        count = round(f * pool)
        losses: dict[Scheme, list[float]] = {s: [] for s in schemes}
        for p in range(placements):
            snap = setup.snapshot(blast_placement(setup, seed, p, pool, count))
            for s in schemes:
                losses[s].append(1.0 - plan_throughput(setup.plan(snap, jobs[s]), jobs[s]))
            progress(1)
        out.extend(StaticPoint(f, count, s, tuple(losses[s])) for s in schemes)
    return out


def placement(seed: int, index: int, pool: int, count: int) -> list[int]:
    """The `index`-th random set of `count` failed GPU positions among the first `pool`
    (deterministic in its arguments). Nested in `count`: the set for k failures is the first k of
    the set for any larger count, so a sweep compares every fraction on the same placements
    (common random numbers) and a placement's loss never moves against the scheme's own behaviour
    between sweep points by chance."""
    rng = random.Random(f"static:{seed}:{index}")
    failed: dict[int, None] = {}  # ordered set
    while len(failed) < count:
        failed.setdefault(rng.randrange(pool))
    return list(failed)


def blast_placement(setup: SimSetup, seed: int, index: int, pool: int, count: int) -> list[int]:
    """Like `placement`, but failures come with the model's blast radius: each draws a GPU not yet
    failed and takes it alone, its node or its domain, until `count` GPUs are failed (the last
    blast is cut short so that exactly `count` fail). Nested in `count` too. Without a blast
    radius it is `placement`."""
    model = setup.model
    if model.blast_node == 0 and model.blast_domain == 0:
        return placement(seed, index, pool, count)
    rng = random.Random(f"static:{seed}:{index}")
    failed: dict[int, None] = {}
    while len(failed) < count:
        gpu = rng.randrange(pool)
        if gpu in failed:
            continue
        for g in setup.blast(gpu, model.draw_radius(rng)):
            if len(failed) < count and g < pool:
                failed.setdefault(g)
    return list(failed)


def job_pool_size(setup: SimSetup, spares: int) -> int:
    """GPUs in the domains that hold the job's primary and first `spares` spare groups."""
    return _job_pool_size(setup, spares)


def _job_pool_size(setup: SimSetup, spares: int) -> int:
    groups = setup.job.primary_groups + spares
    per_domain = [size // setup.job.tp for size in setup.cluster.domain_sizes]
    total = 0
    for d, k in enumerate(per_domain):
        if groups <= 0:
            break
        groups -= k
        total += setup.cluster.domain_sizes[d]
    return total


# ---- trace mode ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Event:
    at_h: float
    failed: tuple[int, ...]  # GPUs that fail now
    repaired: tuple[int, ...]  # GPUs that come back now
    hardware: bool = False


@dataclass(frozen=True)
class Trace:
    hours: float
    n_gpus: int
    events: tuple[Event, ...]
    failures: int  # failure arrivals (a node/domain blast counts once)

    def failed_fraction_profile(self) -> list[tuple[float, float, float]]:
        """(start h, end h, failed fraction) segments."""
        out = []
        failed: set[int] = set()
        t = 0.0
        for e in self.events:
            if e.at_h > t:
                out.append((t, e.at_h, len(failed) / self.n_gpus))
                t = e.at_h
            failed.difference_update(e.repaired)
            failed.update(e.failed)
        if self.hours > t:
            out.append((t, self.hours, len(failed) / self.n_gpus))
        return out

    def time_share_above(self, fraction: float) -> float:
        return sum(b - a for a, b, f in self.failed_fraction_profile() if f > fraction) / self.hours

    def peak_failed(self) -> int:
        return max((round(f * self.n_gpus) for _, _, f in self.failed_fraction_profile()), default=0)


def make_trace(setup: SimSetup, days: float, seed: int, warmup_days: float = 0.0) -> Trace:
    """Failure/repair events over `days` (seeded).

    With `warmup_days` > 0 the process runs that long first and the trace starts from the state it
    reached (one event at time 0 holds every GPU then failed), so the window is in steady state
    rather than starting from a healthy cluster."""
    if days <= 0:
        raise SimError(f"days must be positive, got {days}")
    if warmup_days < 0:
        raise SimError(f"warm-up days must be >= 0, got {warmup_days}")
    model = setup.model
    rng = random.Random(f"trace:{seed}")
    warm = warmup_days * 24.0
    hours = days * 24.0 + warm
    n = setup.n_gpus
    rate = model.effective_rate * n  # failures per hour, whole cluster
    repairs: list[tuple[float, int, tuple[int, ...]]] = []  # (time, tiebreak, gpus)
    failed: set[int] = set()
    events: list[Event] = []
    arrivals = 0
    t = rng.expovariate(rate) if rate > 0 else float("inf")
    tick = 0
    while True:
        next_repair = repairs[0][0] if repairs else float("inf")
        if min(t, next_repair) >= hours:
            break
        if next_repair <= t:
            at, _, gpus = heapq.heappop(repairs)
            failed.difference_update(gpus)
            events.append(Event(at, (), gpus))
            continue
        arrivals += 1
        if len(failed) < n:
            gpu = rng.randrange(n)
            while gpu in failed:
                gpu = rng.randrange(n)
            hit = tuple(g for g in setup.blast(gpu, model.draw_radius(rng)) if g not in failed)
            repair_h, hardware = model.draw_repair_h(rng)
            failed.update(hit)
            events.append(Event(t, hit, (), hardware))
            tick += 1
            heapq.heappush(repairs, (t + repair_h, tick, hit))
        t += rng.expovariate(rate)
    if warm > 0:
        state: set[int] = set()
        kept: list[Event] = []
        for e in events:
            if e.at_h < warm:
                state.difference_update(e.repaired)
                state.update(e.failed)
            else:
                kept.append(replace(e, at_h=e.at_h - warm))
        start = [Event(0.0, tuple(sorted(state)), ())] if state else []
        arrivals = sum(1 for e in kept if e.failed)
        return Trace(hours - warm, n, tuple(start + kept), arrivals)
    return Trace(hours, n, tuple(events), arrivals)


@dataclass(frozen=True)
class TraceStats:
    scheme: Scheme
    spares: int
    fixed_minibatch: bool
    mean_throughput: float  # time-averaged, relative to the healthy job, stalls not counted
    paused_share: float  # share of time with global batch below target
    min_throughput: float
    per_gpu_throughput: float  # mean throughput x primary GPUs / (primary + spare GPUs)
    replans: int
    stall: str = "none"  # the stall model's name
    changes: int = 0  # layout changes that the job acted on
    stalled_share: float = 0.0  # share of the time training stood still for reconfiguration
    effective_throughput: float = 0.0  # time-averaged throughput with stalls counted as zero


def layout_key(plan: Plan) -> tuple[tuple[int, int, tuple[tuple[int, int, int, int], ...]], ...]:
    """What a running job sees of a plan: replicas, their batches, and each group's place and degree."""
    return tuple(
        (r.replica_id, r.local_batch, tuple((g.domain_pos, g.local, g.stage, g.tp) for g in r.groups))
        for r in plan.replicas
    )


def healthy_step_s(job: JobSpec) -> float | None:
    """The job's healthy step time from its step model (None without one)."""
    sm = job.step_model
    return None if sm is None else sm.pipeline_time(job.tp, job.local_batch) + sm.dp_sync_time(job.replicas)


def replay(
    setup: SimSetup,
    trace: Trace,
    configs: Sequence[tuple[Scheme, int]],
    fixed_minibatch: bool = False,
    progress: Progress = _noop,
    stall: StallModel | None = None,
    step_s: float | None = None,
) -> list[TraceStats]:
    """Replan after every batch of simultaneous events and integrate throughput over time.

    With a `stall` model every change of the layout the job acts on stops training for the
    model's stall (chained when changes come faster than stalls end); `step_s` is the healthy step
    time it uses (default: the job's step model, else 0). The trace's first events at time 0 are
    the state the window starts in, not a change. With `repairs="deferred"` repaired GPUs are taken
    back only at the next failure; with "free" taking them back costs nothing."""
    model = stall or STALL_PRESETS["none"]
    model.validate()
    jobs = [setup.variant(s, sp) for s, sp in configs]
    if step_s is None:
        step_s = healthy_step_s(setup.job) or 0.0
    n = len(jobs)
    acc = [0.0] * n
    eff = [0.0] * n
    stalled = [0.0] * n
    stall_until = [0.0] * n
    changes = [0] * n
    paused = [0.0] * n
    lows = [1.0] * n
    snap = setup.cluster
    plans: list[Plan | None] = [setup.plan(snap, job) for job in jobs]
    keys: list[object] = [layout_key(p) for p in plans if p is not None]
    current = [1.0] * n
    below = [False] * n
    pending: dict[str, GpuState] = {}  # repairs not yet acted on (deferred)
    t = 0.0
    replans = 0
    i = 0
    events = trace.events

    def advance(k: int, until: float) -> None:
        span = until - t
        lost = min(span, max(0.0, stall_until[k] - t))
        acc[k] += current[k] * span
        eff[k] += current[k] * (span - lost)
        stalled[k] += lost
        if below[k]:
            paused[k] += span

    while i < len(events):
        at = events[i].at_h
        for k in range(n):
            advance(k, at)
        t = at
        changes_now: dict[str, GpuState] = {}
        any_failure = False
        while i < len(events) and events[i].at_h == at:
            e = events[i]
            for g in e.repaired:
                changes_now[setup.uuids[g]] = GpuState.HEALTHY
            for g in e.failed:
                changes_now[setup.uuids[g]] = GpuState.FAILED
                any_failure = True
            i += 1
        if model.repairs == "deferred" and not any_failure and at > 0:
            pending.update(changes_now)  # taken back at the next restart
            progress(1)
            continue
        snap = snap.with_states({**pending, **changes_now})
        pending.clear()
        replans += 1
        for k, job in enumerate(jobs):
            prev = plans[k]
            plan = setup.plan(snap, job, prev)
            key = layout_key(plan)
            if prev is not None and at > 0 and key != keys[k] and (any_failure or model.repairs == "stall"):
                changes[k] += 1
                seconds = model.stall_s(job, plan, prev, step_s)
                stall_until[k] = max(stall_until[k], at) + seconds / 3600.0
            plans[k], keys[k] = plan, key
            below[k] = not plan.meets_target
            thr = plan_throughput(plan, job)
            current[k] = (0.0 if below[k] else thr) if fixed_minibatch else thr
            lows[k] = min(lows[k], current[k])
        progress(1)
    for k in range(n):
        advance(k, trace.hours)
    out = []
    primary_gpus = setup.job.primary_groups * setup.job.tp
    for k, (s, sp) in enumerate(configs):
        mean = acc[k] / trace.hours
        out.append(
            TraceStats(
                s, sp, fixed_minibatch, mean, paused[k] / trace.hours, lows[k],
                mean * primary_gpus / (primary_gpus + sp * setup.job.tp), replans,
                model.name, changes[k], stalled[k] / trace.hours, eff[k] / trace.hours,
            )
        )
    return out


def min_spares_never_pause(
    setup: SimSetup, trace: Trace, scheme: Scheme, progress: Progress = _noop
) -> int | None:
    """Fewest spare groups with which the plan meets the target batch at every moment of the
    trace (fixed-minibatch training never pauses); None if even `max_spares` is not enough.

    Walks the trace once, raising the spare count only when the current one falls short (more
    spares never lower a plan's global batch, so earlier moments stay satisfied)."""
    spares = 0
    snap = setup.cluster
    i = 0
    events = trace.events
    while i < len(events):
        at = events[i].at_h
        changes: dict[str, GpuState] = {}
        while i < len(events) and events[i].at_h == at:
            for g in events[i].repaired:
                changes[setup.uuids[g]] = GpuState.HEALTHY
            for g in events[i].failed:
                changes[setup.uuids[g]] = GpuState.FAILED
            i += 1
        snap = snap.with_states(changes)
        while not setup.plan(snap, setup.variant(scheme, spares)).meets_target:
            if spares >= setup.max_spares:
                return None
            spares += 1
        progress(1)
    return spares
