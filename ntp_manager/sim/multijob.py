"""Multi-job simulation: several jobs on one cluster, one failure trace, two spare policies.

Every throughput number still comes from `make_plan`: a job is planned on the domains it holds
(`JobSpec.domains`), with every group of those domains beyond its primary groups as a spare. What
this module adds is *who holds which domain when*, under the rules of the live manager:

- Each domain is held by at most one job (ownership is by whole NVLink domain, so no GPU is ever in
  two jobs). A job starts with its *home* domains (enough for its primary groups), laid out job
  after job from the start of the cluster; the domains after them are the spare pool.
- `private`: the pool is split once. Each job gets its reservation (`JobSpec.spares`, in groups,
  rounded up to domains) and the rest of the pool in proportion to its home domains (largest
  remainder first, ties to the earlier job). A job keeps those domains for the whole trace, failed
  or not, and nobody else may use them: the single-job trace mode, once per job.
- `shared`: after every batch of simultaneous events,
  1. *Return*: a job whose domains saw a repair lets go of every domain beyond its home ones whose
     loss would not lower its planned throughput, the most recently granted first (a repaired GPU
     thus stays with the job that held it while it still wants the domain, else goes back to the
     pool). So does a job that stays below its target after asking (step 2): what it took without
     reaching the target goes back if it did not help.
  2. *Grant*, jobs in order of priority (highest first; ties: arrival, i.e. job order), each job
     below its target batch in turn, one domain at a time and replanning after each: a job holding
     fewer than its home count plus its reservation gets any free domain (a *reserved* grant);
     beyond that only while its throughput is below `min_throughput` (default 0: never), and only
     from free domains nobody's outstanding reservation claims (a *pool* grant). Free domains are
     healthy domains no job holds; the lowest-numbered goes first. A held domain beyond the home
     ones that has a failed GPU does not count against the reservation, so a job whose spare
     breaks may draw a healthy one (it returns the broken one once it no longer needs it).
  3. *Preempt*: a job still below `min_throughput` with nothing left to grant takes one replica's
     worth of healthy domains (groups_per_replica groups) from a `preemptible` job of strictly
     lower priority (the lowest first; ties: the latest arrival), as many as it needs; what it does
     not need goes back to the pool, where the victim, entitled to its home domains, takes it back.

Effective time per job = its plan throughput (relative to its healthy throughput) integrated over
the trace / the trace's length, with the time a stall model stops it counted as zero (`run`'s
`stall`; without one replanning is free): the single-job trace mode's effective throughput.

Deterministic: the same setup and trace give the same result; no randomness beyond the trace.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec, Plan, make_plan
from ntp_manager.sim.engine import Progress, SimSetup, Trace, layout_key, plan_throughput
from ntp_manager.sim.failures import FailureModel, SimError
from ntp_manager.sim.stall import StallModel
from ntp_manager.topology import Cluster

Policy = Literal["private", "shared"]
EQUAL = 1e-4  # "equal effective time": within 0.01 percentage points of the goal
FREE = -1  # owner of a domain in the pool
OUTSIDE = -2  # owner of a domain this run does not use
_EPS = 1e-12


def _noop(_: int) -> None:
    return None


@dataclass(frozen=True)
class JobEntry:
    """One job of a multi-job run: the planner's spec plus what the pool policy reads.

    `job.spares` is the reservation (TP groups, held in whole domains); `job.domains` is ignored
    (the simulator lays the jobs out)."""

    job: JobSpec
    priority: int = 0
    preemptible: bool = False
    min_throughput: float = 0.0

    @property
    def name(self) -> str:
        return self.job.name


@dataclass(frozen=True)
class MultiSetup:
    """Jobs on one cluster: home domains job after job, then `pool` spare domains; any domains
    after those are outside the run (only the private spare search borrows them)."""

    cluster: Cluster
    jobs: tuple[JobEntry, ...]
    model: FailureModel
    pool: int
    domain_size: int
    home: tuple[tuple[int, ...], ...] = field(repr=False)  # per job: its home domain positions
    pool_domains: tuple[int, ...] = field(repr=False)  # the pool's domain positions
    sim: SimSetup = field(repr=False)  # GPU <-> domain tables and the trace generator

    @classmethod
    def create(cls, cluster: Cluster, jobs: Sequence[JobEntry], model: FailureModel, pool: int) -> MultiSetup:
        if not jobs:
            raise SimError("a multi-job run needs at least one job")
        names = [e.name for e in jobs]
        if len(set(names)) != len(names):
            raise SimError(f"job names must be unique, got {names}")
        sizes = set(cluster.domain_sizes)
        if len(sizes) != 1:
            raise SimError("the multi-job simulator needs domains of one size")
        size = sizes.pop()
        if pool < 0:
            raise SimError(f"the spare pool must be >= 0 domains, got {pool}")
        home: list[tuple[int, ...]] = []
        at = 0
        for e in jobs:
            e.job.validate()
            if e.job.tp > size:
                raise SimError(f"job {e.name}: tp {e.job.tp} is above the domain size {size}")
            if not 0.0 <= e.min_throughput <= 1.0:
                raise SimError(f"job {e.name}: min_throughput must be in [0, 1], got {e.min_throughput}")
            n = home_domains(e.job, size)
            home.append(tuple(range(at, at + n)))
            at += n
        total = len(cluster.domain_sizes)
        if at + pool > total:
            raise SimError(f"the jobs' home domains ({at}) and the pool ({pool}) need {at + pool} domains; "
                           f"the cluster has {total}")
        reserved = sum(reservation_domains(e.job, size) for e in jobs)
        if reserved > pool:
            raise SimError(f"the jobs reserve {reserved} spare domains; the pool holds {pool}")
        sim = SimSetup.create(cluster, replace(jobs[0].job, domains=()), model)
        return cls(cluster, tuple(jobs), model, pool, size, tuple(home), tuple(range(at, at + pool)), sim)

    @property
    def n_gpus(self) -> int:
        return self.sim.n_gpus

    def with_pool(self, pool: int) -> MultiSetup:
        """The same jobs and cluster with a pool of `pool` domains (the first after the homes)."""
        at = sum(len(h) for h in self.home)
        if pool < 0 or at + pool > len(self.cluster.domain_sizes):
            raise SimError(f"a pool of {pool} domains does not fit the cluster after the jobs' {at}")
        reserved = sum(reservation_domains(e.job, self.domain_size) for e in self.jobs)
        if reserved > pool:
            raise SimError(f"the jobs reserve {reserved} spare domains; a pool of {pool} cannot hold them")
        return replace(self, pool=pool, pool_domains=tuple(range(at, at + pool)))

    def private_split(self) -> list[int]:
        """Spare domains per job under the private policy: its reservation, then the rest of the
        pool in proportion to its home domains (largest remainder; ties: the earlier job)."""
        res = [reservation_domains(e.job, self.domain_size) for e in self.jobs]
        rest = self.pool - sum(res)
        weights = [len(h) for h in self.home]
        total = sum(weights)
        quotas = [rest * w / total for w in weights]
        split = [r + math.floor(q) for r, q in zip(res, quotas, strict=True)]
        left = self.pool - sum(split)
        order = sorted(range(len(quotas)), key=lambda k: (-(quotas[k] - math.floor(quotas[k])), k))
        for k in order[:left]:
            split[k] += 1
        return split


def home_domains(job: JobSpec, domain_size: int) -> int:
    """Domains that hold the job's primary groups (whole domains: ownership is by domain)."""
    per = domain_size // job.tp
    return -(-job.primary_groups // per)


def reservation_domains(job: JobSpec, domain_size: int) -> int:
    per = domain_size // job.tp
    return -(-job.spares // per)


@dataclass(frozen=True)
class JobResult:
    name: str
    effective: float  # time-averaged plan throughput, stalls counted as zero
    min_throughput: float  # the lowest it fell to
    below_share: float  # share of the time below the target batch
    spare_domains: int  # private: its spares; shared: its reservation
    peak_held: int  # most domains held at once beyond the home ones (shared)
    grants: int  # domains granted from the pool (shared)
    preempted: int  # replicas' worth of domains lost to preemption (shared)
    preempting: int  # preemptions this job made (shared)
    throughput: float = 0.0  # time-averaged plan throughput, stalls not counted
    changes: int = 0  # layout changes the stall model charged
    stalled_share: float = 0.0  # share of the time training stood still for them


@dataclass(frozen=True)
class MultiResult:
    policy: Policy
    pool: int
    hours: float
    jobs: tuple[JobResult, ...]
    replans: int
    unmet: int  # grants within a reservation that found no free domain

    def by_name(self) -> dict[str, JobResult]:
        return {j.name: j for j in self.jobs}


class _World:
    """Who holds what, the cluster snapshot, and each job's running plan, for one policy run."""

    def __init__(self, setup: MultiSetup, policy: Policy, audit: bool) -> None:
        self.setup, self.policy, self.audit = setup, policy, audit
        n_dom = len(setup.cluster.domain_sizes)
        self.ids = setup.cluster.domain_ids
        self.owner = [OUTSIDE] * n_dom
        self.failed = [0] * n_dom  # failed GPUs per domain
        self.held: list[list[int]] = []
        self.home_count: list[int] = []
        self.base = [len(h) for h in setup.home]
        self.res = [reservation_domains(e.job, setup.domain_size) for e in setup.jobs]
        self.per_domain = [setup.domain_size // e.job.tp for e in setup.jobs]
        pool = list(setup.pool_domains)
        split = setup.private_split() if policy == "private" else [0] * len(setup.jobs)
        for j, h in enumerate(setup.home):
            mine = list(h) + pool[:split[j]]
            pool = pool[split[j]:]
            self.held.append(mine)
            self.home_count.append(len(h))
            for d in mine:
                self.owner[d] = j
        for d in pool:
            self.owner[d] = FREE
        self.free: set[int] = set(pool)  # pool domains, healthy or not
        self.snap = setup.cluster
        self.plans: list[Plan | None] = [None] * len(setup.jobs)
        self.thr = [1.0] * len(setup.jobs)
        self.replans = 0
        self.unmet = 0
        self.repaired_jobs: set[int] = set()
        self.grants = [0] * len(setup.jobs)
        self.preempted = [0] * len(setup.jobs)
        self.preempting = [0] * len(setup.jobs)
        self.peak = [len(m) - len(h) for m, h in zip(self.held, setup.home, strict=True)]
        self.stuck: list[tuple[object, ...] | None] = [None] * len(setup.jobs)
        self.touched = [0] * len(setup.jobs)  # batches that changed each job's domains
        self.order = sorted(range(len(setup.jobs)), key=lambda j: (-setup.jobs[j].priority, j))
        for j in range(len(setup.jobs)):
            self.replan(j)

    # ---- planning ------------------------------------------------------------------------------
    def spec(self, j: int, held: Sequence[int]) -> JobSpec:
        job = self.setup.jobs[j].job
        spares = max(0, len(held) * self.per_domain[j] - job.primary_groups)
        return replace(job, domains=tuple(self.ids[d] for d in held), spares=spares)

    def trial(self, j: int, held: Sequence[int]) -> tuple[Plan | None, float]:
        """The job's plan and throughput on `held` (no plan and 0 when it holds nothing: an empty
        `JobSpec.domains` would mean the whole cluster)."""
        if not held:
            return None, 0.0
        job = self.spec(j, held)
        self.replans += 1
        plan = make_plan(self.snap, job, self.plans[j])
        return plan, plan_throughput(plan, job)

    def replan(self, j: int) -> None:
        self.plans[j], self.thr[j] = self.trial(j, self.held[j])

    # ---- events --------------------------------------------------------------------------------
    def apply(self, failed: Sequence[int], repaired: Sequence[int]) -> set[int]:
        """Apply one batch of GPU changes; return the jobs whose domains changed."""
        sim = self.setup.sim
        changes: dict[str, GpuState] = {}
        for g in repaired:
            changes[sim.uuids[g]] = GpuState.HEALTHY
            self.failed[sim.domain_of[g]] -= 1
        for g in failed:
            changes[sim.uuids[g]] = GpuState.FAILED
            self.failed[sim.domain_of[g]] += 1
        self.snap = self.snap.with_states(changes)
        touched = {sim.domain_of[g] for g in (*failed, *repaired)}
        self.repaired_jobs = {self.owner[sim.domain_of[g]] for g in repaired} - {FREE, OUTSIDE}
        return {self.owner[d] for d in touched if self.owner[d] >= 0}

    def step(self, affected: set[int]) -> None:
        for j in sorted(affected):
            self.replan(j)
        if self.policy == "shared":
            for j in sorted(affected):
                if j in self.repaired_jobs:
                    self.give_back(j)
                self.stuck[j] = None
                if self.setup.jobs[j].preemptible:
                    self.touched[j] += 1
            for j in self.order:
                if self.stuck[j] is None or self.stuck[j] != self.key():
                    self.ask(j)
        if self.audit:
            self.check()

    # ---- the pool ------------------------------------------------------------------------------
    def counted(self, j: int) -> int:
        """Domains held that count against the job's entitlement (broken spares do not)."""
        held, home = self.held[j], self.home_count[j]
        return home + sum(1 for d in held[home:] if self.failed[d] == 0)

    def outstanding(self, j: int) -> int:
        return max(0, self.base[j] + self.res[j] - self.counted(j))

    def healthy_free(self) -> list[int]:
        return sorted(d for d in self.free if self.failed[d] == 0)

    def give_back(self, j: int) -> None:
        """Return the domains beyond the home ones that the job's throughput does not need, the
        most recently granted first."""
        k = len(self.held[j]) - 1
        while k >= self.home_count[j]:
            if not self.maybe_unneeded(j, self.held[j][k]):
                k -= 1
                continue
            held = self.held[j][:k] + self.held[j][k + 1:]
            plan, thr = self.trial(j, held)
            if thr >= self.thr[j] - _EPS:
                d = self.held[j][k]
                self.held[j] = held
                self.plans[j], self.thr[j] = plan, thr
                self.owner[d] = FREE
                self.free.add(d)
            k -= 1

    def maybe_unneeded(self, j: int, d: int) -> bool:
        """False when losing domain `d` surely lowers the job's plan: the plan uses a group of `d`
        and leaves no usable group standing by, so a replica would be missing a group that nothing
        can replace. Otherwise only a replan can tell (saves most trial plans)."""
        plan = self.plans[j]
        if plan is None or plan.idle:
            return True
        return all(g.domain_pos != d for r in plan.replicas for g in r.groups)

    def take(self, j: int, d: int) -> None:
        self.free.discard(d)
        self.owner[d] = j
        self.held[j].append(d)
        self.grants[j] += 1
        self.replan(j)
        self.peak[j] = max(self.peak[j], len(self.held[j]) - self.home_count[j])

    def ask(self, j: int) -> None:
        """Grants (reserved, then pool) and, as a last resort, preemption, for job `j`. A job that
        stays below its target afterwards returns what did not raise its throughput (two spares
        may be needed before either helps: an NTP replica of reduced groups stays reduced until
        every one of them is replaced)."""
        entry = self.setup.jobs[j]
        took = False
        while self.thr[j] < 1.0 - _EPS:
            free = self.healthy_free()
            if self.counted(j) < self.base[j] + self.res[j]:
                if not free:
                    self.unmet += 1
                    break
                self.take(j, free[0])
                took = True
                continue
            if self.thr[j] >= entry.min_throughput - _EPS:
                break
            others = sum(self.outstanding(k) for k in range(len(self.held)) if k != j)
            if len(free) > others:
                self.take(j, free[0])
                took = True
                continue
            before = self.thr[j]
            if not self.preempt(j):
                break
            took = True
            if self.thr[j] <= before + _EPS:
                break
        if took and self.thr[j] < 1.0 - _EPS:
            self.give_back(j)
        self.stuck[j] = self.key() if self.thr[j] < 1.0 - _EPS else None

    def key(self) -> tuple[object, ...]:
        """What a job left below its target could get more from: the healthy free domains, the
        others' counted holdings (their outstanding reservations) and the preemptible jobs'
        domains. A job asks again only when it changed (or its own domains did)."""
        return (tuple(self.healthy_free()), tuple(self.counted(k) for k in range(len(self.held))),
                tuple(len(h) for h in self.held), tuple(self.touched))

    def short(self, j: int) -> bool:
        """Below target while holding less than its home domains and reservation (healthy)."""
        return self.thr[j] < 1.0 - _EPS and self.counted(j) < self.base[j] + self.res[j]

    def preempt(self, j: int) -> bool:
        """Take one replica's worth of healthy domains from the lowest-priority preemptible job
        below `j`'s priority; keep what `j` needs, free the rest. False if there is no victim."""
        jobs = self.setup.jobs
        victims = [v for v in range(len(jobs)) if jobs[v].preemptible and jobs[v].priority < jobs[j].priority
                   and any(self.failed[d] == 0 for d in self.held[v])]
        if not victims:
            return False
        v = min(victims, key=lambda k: (jobs[k].priority, -k))
        want = -(-jobs[v].job.groups_per_replica // self.per_domain[v])
        taken: list[int] = []
        for d in reversed(self.held[v]):
            if len(taken) == want:
                break
            if self.failed[d] == 0:
                taken.append(d)
        gone = set(taken)
        kept_home = [d for d in self.held[v][:self.home_count[v]] if d not in gone]
        self.held[v] = kept_home + [d for d in self.held[v][self.home_count[v]:] if d not in gone]
        self.home_count[v] = len(kept_home)
        self.preempted[v] += 1
        self.preempting[j] += 1
        for d in taken:
            self.owner[d] = FREE
            self.free.add(d)
        self.replan(v)
        for d in taken:
            if self.thr[j] >= jobs[j].min_throughput - _EPS:
                break
            self.take(j, d)
        return True

    # ---- the invariant -------------------------------------------------------------------------
    def check(self) -> None:
        """Every domain has one owner and every GPU a plan uses is in a domain its job holds; no GPU
        is in two jobs' plans. Raises AssertionError naming the domain or GPU."""
        seen: dict[int, int] = {}
        for j, held in enumerate(self.held):
            for d in held:
                if d in seen:
                    raise AssertionError(f"domain {self.ids[d]} held by jobs {seen[d]} and {j}")
                seen[d] = j
                if self.owner[d] != j:
                    raise AssertionError(f"domain {self.ids[d]} in job {j}'s list but owned by {self.owner[d]}")
        for d in self.free:
            if d in seen or self.owner[d] != FREE:
                raise AssertionError(f"free domain {self.ids[d]} is held")
        gpus: dict[int, int] = {}
        for j, plan in enumerate(self.plans):
            if plan is None:
                if self.held[j]:
                    raise AssertionError(f"job {j} holds domains but has no plan")
                continue
            mine = set(self.held[j])
            for r in plan.replicas:
                for g in r.groups:
                    if g.domain_pos not in mine:
                        raise AssertionError(f"job {j}'s plan uses domain {self.ids[g.domain_pos]} it does not hold")
                    for p in g.positions:
                        if p in gpus:
                            raise AssertionError(f"GPU {p} in the plans of jobs {gpus[p]} and {j}")
                        gpus[p] = j


class _Clock:
    """Per job: throughput and stalls integrated over time (the single-job trace mode's rules)."""

    def __init__(self, n: int, stall: StallModel | None, step_s: float) -> None:
        self.stall, self.step_s = stall, step_s
        self.acc, self.eff, self.below = [0.0] * n, [0.0] * n, [0.0] * n
        self.stalled, self.until, self.changes = [0.0] * n, [0.0] * n, [0] * n
        self.t = 0.0

    def advance(self, thr: Sequence[float], until: float) -> None:
        span = until - self.t
        for j, x in enumerate(thr):
            lost = min(span, max(0.0, self.until[j] - self.t))
            self.acc[j] += x * span
            self.eff[j] += x * (span - lost)
            self.stalled[j] += lost
            self.below[j] += span if x < 1.0 - _EPS else 0.0
        self.t = until

    def charge(self, j: int, job: JobSpec, plan: Plan | None, previous: Plan | None, forced: bool) -> None:
        """A layout change at the current time: stalls per the model (a change that follows only
        repairs and grants is free when the model's repairs are)."""
        if self.stall is None or plan is None or not (forced or self.stall.repairs == "stall"):
            return
        self.changes[j] += 1
        seconds = self.stall.stall_s(job, plan, previous, self.step_s)
        self.until[j] = max(self.until[j], self.t) + seconds / 3600.0


def run(
    setup: MultiSetup, trace: Trace, policy: Policy, progress: Progress = _noop, audit: bool = False,
    observe: Callable[[float, list[float], list[bool]], None] | None = None,
    stall: StallModel | None = None, step_s: float = 0.0,
) -> MultiResult:
    """Replay `trace` under `policy`; per job, effective time and what the pool did.

    `audit` checks the ownership invariant after every batch of events (tests); `observe` is
    called after every batch with (time, throughput per job, whether each job is short: below
    target without its full reservation because the pool had no healthy free domain). With a
    `stall` model every change of a job's layout stops it for the model's stall (`step_s`: the
    healthy step a redone step costs); a change is forced by a failure in the job's domains or a
    replica lost to preemption, and otherwise (repairs, grants, returns) free when the model's
    repairs are free. Models that defer repairs to the next restart are refused: here a repair
    can move a domain to another job, which cannot wait for this one's next failure."""
    if policy not in ("private", "shared"):
        raise SimError(f"policy must be 'private' or 'shared', got {policy!r}")
    if trace.n_gpus != setup.n_gpus:
        raise SimError(f"the trace is for {trace.n_gpus} GPUs, the cluster has {setup.n_gpus}")
    if stall is not None:
        stall.validate()
        if stall.repairs == "deferred":
            raise SimError(f"stall model {stall.name} takes repairs back only at the next restart; "
                           "the multi-job mode charges models that act on repairs (none, ft-hsdp, live)")
    w = _World(setup, policy, audit)
    if audit:
        w.check()
    n = len(setup.jobs)
    clock = _Clock(n, stall, step_s)
    low = [1.0] * n
    keys = [None if p is None else layout_key(p) for p in w.plans]
    i, events = 0, trace.events
    while i < len(events):
        at = events[i].at_h
        clock.advance(w.thr, at)
        failed: list[int] = []
        repaired: list[int] = []
        while i < len(events) and events[i].at_h == at:
            repaired.extend(events[i].repaired)
            failed.extend(events[i].failed)
            i += 1
        previous, lost = list(w.plans), list(w.preempted)
        hit = {w.owner[setup.sim.domain_of[g]] for g in failed}  # before anything moves
        w.step(w.apply(failed, repaired))
        for j in range(n):
            low[j] = min(low[j], w.thr[j])
            plan = w.plans[j]
            if plan is previous[j]:
                continue
            key = None if plan is None else layout_key(plan)
            if key != keys[j] and at > 0:
                clock.charge(j, w.spec(j, w.held[j]), plan, previous[j], j in hit or w.preempted[j] > lost[j])
            keys[j] = key
        if observe is not None:
            observe(at, list(w.thr), [w.short(j) for j in range(n)])
        progress(1)
    clock.advance(w.thr, trace.hours)
    split = setup.private_split() if policy == "private" else w.res
    h = trace.hours
    jobs = tuple(
        JobResult(e.name, clock.eff[j] / h, low[j], clock.below[j] / h, split[j], w.peak[j], w.grants[j],
                  w.preempted[j], w.preempting[j], clock.acc[j] / h, clock.changes[j], clock.stalled[j] / h)
        for j, e in enumerate(setup.jobs)
    )
    return MultiResult(policy, setup.pool, trace.hours, jobs, w.replans, w.unmet)


# ---- equal effective time: the searches ------------------------------------------------------------


def spare_order(setup: MultiSetup, j: int) -> list[int]:
    """Domains job `j` would draw private spares from, in order, when searching for how many it
    needs alone: its own private share of the pool, the rest of the pool, the domains after the
    pool, then the other jobs' home domains. The search replays one job at a time (under the
    private policy jobs do not interact), so borrowing a domain another job holds is a
    hypothetical that changes no one else; every domain fails as the trace says."""
    split = setup.private_split()
    start = sum(split[:j])
    pool = list(setup.pool_domains)
    own = pool[start:start + split[j]]
    rest = [d for d in pool if d not in set(own)]
    after = list(range(setup.pool_domains[-1] + 1 if pool else sum(len(h) for h in setup.home),
                       len(setup.cluster.domain_sizes)))
    others = [d for k, h in enumerate(setup.home) if k != j for d in h]
    return own + rest + after + others


def private_effective(setup: MultiSetup, trace: Trace, j: int, spares: int, progress: Progress = _noop) -> float:
    """Effective time of job `j` alone with `spares` private spare domains (`spare_order`)."""
    order = spare_order(setup, j)
    if spares > len(order):
        raise SimError(f"job {setup.jobs[j].name}: {spares} spare domains asked, {len(order)} exist")
    held = list(setup.home[j]) + order[:spares]
    mine = set(held)
    ids, sim = setup.cluster.domain_ids, setup.sim
    job = setup.jobs[j].job
    per = setup.domain_size // job.tp
    spec = replace(job, domains=tuple(ids[d] for d in held), spares=max(0, len(held) * per - job.primary_groups))
    snap = setup.cluster
    plan = make_plan(snap, spec)
    thr = plan_throughput(plan, spec)
    acc, t, i, events = 0.0, 0.0, 0, trace.events
    while i < len(events):
        at = events[i].at_h
        acc += thr * (at - t)
        t = at
        changes: dict[str, GpuState] = {}
        hit = False
        while i < len(events) and events[i].at_h == at:
            for g in events[i].repaired:
                changes[sim.uuids[g]] = GpuState.HEALTHY
                hit = hit or sim.domain_of[g] in mine
            for g in events[i].failed:
                changes[sim.uuids[g]] = GpuState.FAILED
                hit = hit or sim.domain_of[g] in mine
            i += 1
        snap = snap.with_states(changes)
        if hit:
            plan = make_plan(snap, spec, plan)
            thr = plan_throughput(plan, spec)
        progress(1)
    acc += thr * (trace.hours - t)
    return acc / trace.hours


def _smallest(lo: int, hi: int, ok: Callable[[int], bool], gallop: bool = False) -> int | None:
    """Smallest n in [lo, hi] with ok(n), by bisection: assumes ok is monotone (false, then true);
    None when ok(hi) is false. With `gallop` it first tries lo, lo + 1, lo + 3, lo + 7, ... (cheap
    when the answer is small and `hi` is only a generous cap)."""
    if gallop:
        step = 1
        while lo + step - 1 < hi and not ok(lo + step - 1):
            lo, step = lo + step, 2 * step
        hi = min(hi, lo + step - 1)
    if not ok(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def private_spares_needed(
    setup: MultiSetup, trace: Trace, j: int, goal: float, max_spares: int, progress: Progress = _noop,
    tol: float = EQUAL,
) -> int | None:
    """Fewest private spare domains with which job `j` alone reaches effective time `goal` less
    `tol` (None: not even with `max_spares`). More spares never lower a plan's global batch, so
    the effective time is monotone in the count and bisection finds the smallest."""
    limit = min(max_spares, len(spare_order(setup, j)))
    memo: dict[int, float] = {}

    def ok(n: int) -> bool:
        if n not in memo:
            memo[n] = private_effective(setup, trace, j, n, progress)
        return memo[n] >= goal - tol

    return _smallest(0, limit, ok, gallop=True)


@dataclass(frozen=True)
class PoolSearch:
    pool: int | None  # smallest pool (domains) giving every job its goal; None: not even `hi`
    tried: tuple[tuple[int, bool], ...]  # (pool, every job reached its goal) in the order tried


def pool_needed(
    setup: MultiSetup, trace: Trace, goals: Sequence[float | None], hi: int, progress: Progress = _noop,
    tol: float = EQUAL, cache: dict[int, MultiResult] | None = None,
) -> PoolSearch:
    """Smallest shared pool with which every job's effective time reaches its goal less `tol` (the
    goal: e.g. its private-spares effective time; None: that job does not count), between the
    jobs' reservations and `hi` domains. Bisection:
    it assumes a bigger pool never leaves a job worse off, which the pool's rules make likely but
    do not guarantee (a grant order can change), so the pool found and the one below it are both
    replayed, and `tried` says what each replay gave. `cache` (pool -> shared result on this
    setup and trace) saves replays across searches."""
    lo = sum(reservation_domains(e.job, setup.domain_size) for e in setup.jobs)
    tried: list[tuple[int, bool]] = []
    memo: dict[int, bool] = {}

    runs = {} if cache is None else cache

    def ok(k: int) -> bool:
        if k not in memo:
            if k not in runs:
                runs[k] = run(setup.with_pool(k), trace, "shared", progress)
            res = runs[k]
            memo[k] = all(g is None or r.effective >= g - tol for r, g in zip(res.jobs, goals, strict=True))
            tried.append((k, memo[k]))
        return memo[k]

    found = _smallest(lo, hi, ok)
    if found is not None and found > lo:
        ok(found - 1)
    return PoolSearch(found, tuple(tried))
