"""Sharing: the free pool helps jobs that fall below what they ask, by priority (issue 41).

A job's `spares` are a reservation in the pool (service/planning/reservations.py), and it may ask
for a planned throughput of at least its `min_throughput` (default 0: nothing beyond its own
domains and its reservation). After every new layout this part looks at the jobs that need help,
highest `priority` first (then arrival):

1. **Grant against the reservation.** A job planned below full throughput whose reservation is
   not all granted gets a free domain (kind `reserved`): one the reservations' plan sets aside for
   it, else one no reservation needs, the smallest that holds one of its TP groups. Its planner
   counts the domain's groups as spares and, with its minimal-movement packing, swaps them for
   reduced groups (a live switch, no restart).
2. **Grant beyond it.** A job below its `min_throughput` with its reservation all granted gets a
   free domain that no outstanding reservation needs (kind `grant`), the same way.
3. **Preempt.** When the pool has no such domain, a `preemptible` job of lower priority that owns
   more than one domain gives one up: in one transaction its new layout without that domain (planned
   first, checked like every layout) and the allocation row's move to the receiver (`borrowed`).
   The victim loses a replica through the same live switch; a job that is not preemptible, or one
   owning a single domain, is never taken from.
4. **Return.** A granted or borrowed domain that its job's layout no longer uses (its GPUs were
   repaired) while the job needs no help goes back to the pool, where pending jobs and the next
   needy job find it; a `reserved` one makes its reservation outstanding again.

Each change is one fenced kernel transaction with its audit row (`alloc.grant`, `alloc.preempt`,
`alloc.return`) that touches the jobs whose holdings change.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
from sqlalchemy import delete, update

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec, PlanError
from ntp_manager.service.core.errors import InvalidArgument, NotFound
from ntp_manager.service.core.kernel import Tx
from ntp_manager.service.core.state import JobRec
from ntp_manager.service.core.tasks import Coalesced
from ntp_manager.service.planning.jobs import Jobs
from ntp_manager.service.planning.ownership import BORROWED, GRANT, OWN
from ntp_manager.service.planning.reservations import RESERVED, need_of, order
from ntp_manager.specfile import SpecError, job_and_policy_from_dict
from ntp_manager.store.models import AllocationRow, JobRow

log = structlog.get_logger("ntp.sharing")

POLICY_FIELDS = ("priority", "preemptible", "min_throughput", "queue")


FULL = 1.0  # the planned throughput of a job with every replica at full speed


def below(rec: JobRec) -> bool:
    """Whether `rec` runs below its `min_throughput` (a job without a layout is not judged)."""
    lay = rec.layout
    return bool(rec.held) and lay is not None and lay.doc.relative_throughput < rec.policy.min_throughput


def degraded(rec: JobRec) -> bool:
    """Whether `rec` is planned below full throughput (a job without a layout is not judged)."""
    lay = rec.layout
    return bool(rec.held) and lay is not None and lay.doc.relative_throughput < FULL


class Sharing:
    def __init__(self, jobs: Jobs, leading: Callable[[], bool] = lambda: True) -> None:
        self.jobs = jobs
        self.leading = leading  # only the leader grants (a standby that follows it sees new layouts too)
        self.own = jobs.ownership
        self.kernel = jobs.kernel
        self.grants = 0
        self.preemptions = 0
        self.returns = 0
        self.passes = Coalesced(self._pass, "sharing")  # one pass at a time (service/core/tasks.py)
        # job -> its layout when it was last helped: judged again only once it has replanned with
        # what it was given (else one failure would take a domain per pass before the first replan)
        self._helped: dict[str, object] = {}
        jobs.on_layout.append(self.later)
        jobs.on_unchanged.append(self.later)
        self.own.on_freed.append(self.later)

    # ---- when -----------------------------------------------------------------------------------
    def later(self) -> None:
        """Look at the jobs soon (once at a time; again if asked meanwhile)."""
        if self.leading():
            self.passes.later()

    async def _pass(self) -> None:
        for _ in range(1 + len(self.kernel.world.domains)):  # each step moves one domain at most
            if self.jobs.stopping or not await self.step():
                return

    # ---- what -----------------------------------------------------------------------------------
    async def step(self) -> bool:
        """Return one unused grant, or help the neediest job by one domain; False when nothing to do."""
        w = self.kernel.world
        for name in [n for n in self._helped if n not in w.jobs]:
            del self._helped[name]
        if not any(rec.layout is not None and rec.held for rec in w.jobs.values()):
            return False  # nothing to return or help (and no snapshot rebuilt for it: O(GPUs) per registration)
        await self.own.refresh()
        for rec in sorted(w.jobs.values(), key=order):
            lay = rec.layout
            if lay is None or below(rec):
                continue
            used = set(lay.doc.group_domains)
            # a domain held against the reservation stays while the job is degraded (it is the job's
            # own spare capacity; giving it back would only have it granted again)
            spare = [d for d, kind in rec.held.items() if kind != OWN and d not in used
                     and not (kind == RESERVED and degraded(rec))]
            if spare:
                await self._return(rec, spare[-1])
                return True
            swap = self._idle_own(rec, used)
            if swap is not None:
                await self._return(rec, swap[0], promote=swap[1])
                return True
        for rec in sorted((j for j in w.jobs.values() if degraded(j)), key=order):
            if self._helped.get(rec.name) is rec.layout:
                continue  # not replanned since it was helped
            if need_of(rec, self.own.groups_in).groups > 0 and await self._grant(rec, RESERVED):
                return True
            if below(rec) and (await self._grant(rec, GRANT) or await self._preempt(rec)):
                return True
        return False

    def _idle_own(self, rec: JobRec, used: set[str]) -> tuple[str, str] | None:
        """After a repair the planner's minimal movement keeps a replica on the domain granted against
        the reservation and leaves one of the job's own domains idle: (that idle domain, repaired,
        and the reserved one in use that takes its place as owned, holding at least as many of its
        TP groups), or None. Only for a job back at full throughput; an idle domain with a GPU not
        healthy stays (it is what the reserved domain stands in for)."""
        if degraded(rec):
            return None
        tp, w = rec.spec.tp, self.kernel.world
        idle = [d for d, k in rec.held.items() if k == OWN and d not in used
                and all(w.gpus[u].state == GpuState.HEALTHY for u in w.gpus_of_domain(d))]
        busy = [d for d, k in rec.held.items() if k == RESERVED and d in used]
        for d in idle:
            for r in busy:
                if self.own.groups_in(r, tp) >= self.own.groups_in(d, tp):
                    return d, r
        return None

    async def _return(self, rec: JobRec, domain: str, promote: str | None = None) -> None:
        """Give `domain` back to the pool; with `promote`, the job owns that reserved domain instead
        of `domain` (its own, idle), so its reservation is outstanding again the same way."""
        async with self.kernel.exclusive("allocator") as tx:
            kind = rec.held.get(domain)
            if (kind is None or (kind == OWN) != (promote is not None)
                    or self.kernel.world.jobs.get(rec.name) is not rec
                    or (promote is not None and rec.held.get(promote) != RESERVED)):
                return
            await tx.session.execute(delete(AllocationRow).where(AllocationRow.domain_id == domain,
                                                                 AllocationRow.job == rec.name))
            if promote is not None:
                await tx.session.execute(update(AllocationRow).where(
                    AllocationRow.domain_id == promote, AllocationRow.job == rec.name).values(kind=OWN))
            tx.touch_job(rec.name)
            again = kind == RESERVED or promote is not None
            tx.audit(tx.now, "alloc.return", rec.name, before={"domain": domain, "kind": kind},
                     after={"owns": promote} if promote is not None else None,
                     reason="its layout no longer uses the domain and it meets its min_throughput"
                     + (f"; it owns {promote} (granted against its reservation) in its place" if promote else "")
                     + ("; its reservation is outstanding again" if again else ""))

            def returned() -> None:
                if promote is not None:
                    rec.held[promote] = OWN
                rec.held.pop(domain, None)
                self.returns += 1
                self.own.freed()
                self._dirty(rec.name)

            tx.after.append(returned)

    def _candidates(self, rec: JobRec, kind: str) -> list[str]:
        """Free domains `rec` may be granted as `kind`, preferred first: against its reservation, those
        the reservations' plan sets aside for it, then those no reservation needs; beyond it, only
        the latter. Each the smallest first that holds one of its TP groups."""
        marks, _ = self.own.earmarks()
        marked = {d for ds in marks.values() for d in ds}
        tp = rec.spec.tp
        mine = marks.get(rec.name, []) if kind == RESERVED else []
        unreserved = [d for d in self.own.free_domains() if d not in marked]
        pick = [sorted((self.own.groups_in(d, tp), d) for d in ds if self.own.groups_in(d, tp) >= 1)
                for ds in (mine, unreserved)]
        return [d for group in pick for _, d in group]

    async def _grant(self, rec: JobRec, kind: str) -> bool:
        fit = self._candidates(rec, kind)
        if not fit:
            return False
        domain = fit[0]
        async with self.kernel.exclusive("allocator") as tx:
            if self.kernel.world.jobs.get(rec.name) is not rec or domain in self.kernel.world.owners():
                return True  # the world moved meanwhile: look again
            await self.own.take(tx, rec, [domain], kind)
            tx.audit(tx.now, "alloc.grant", rec.name, after={"domain": domain, "priority": rec.policy.priority,
                                                             "kind": kind}, reason=self._why(rec, kind))

            def granted() -> None:
                self._helped[rec.name] = rec.layout
                rec.held[domain] = kind
                self.grants += 1
                self._dirty(rec.name)

            tx.after.append(granted)
        log.info("domain granted from the pool", job=rec.name, domain=domain, kind=kind)
        return True

    def _victims(self, rec: JobRec) -> list[JobRec]:
        w = self.kernel.world
        return sorted((v for v in w.jobs.values() if v is not rec and v.policy.preemptible
                       and v.policy.priority < rec.policy.priority and len(v.held) >= 2 and v.layout is not None),
                      key=lambda v: (v.policy.priority, -len(v.held), v.name))

    async def _preempt(self, rec: JobRec) -> bool:
        w = self.kernel.world
        for victim in self._victims(rec):
            domain = next((d for d in reversed(victim.held) if self.own.groups_in(d, rec.spec.tp) >= 1), None)
            if domain is None:
                continue
            base, held = victim.layout, dict(victim.held)
            rest = {d: k for d, k in held.items() if d != domain}
            spec = self.own.planned_spec(victim, rest)
            why = f"preempted: domain {domain} given to job {rec.name!r} (priority {rec.policy.priority})"
            try:
                draft = await self.jobs.planner.draft(await w.cluster_async(), spec, base, w.pos_of, why)
            except PlanError:
                continue  # it cannot run without that domain: not a victim
            async with self.kernel.exclusive("allocator") as tx:
                if (w.jobs.get(victim.name) is not victim or w.jobs.get(rec.name) is not rec
                        or victim.layout is not base or victim.held != held or not below(rec)):
                    return True  # the world moved meanwhile: look again
                if not draft.unchanged:
                    await self.jobs._persist(tx, victim, draft, base)
                moved = await tx.session.execute(
                    update(AllocationRow).where(AllocationRow.domain_id == domain, AllocationRow.job == victim.name)
                    .values(job=rec.name, kind=BORROWED, seq=rec.next_seq, at=tx.now))
                if getattr(moved, "rowcount", 1) != 1:
                    raise InvalidArgument(f"domain {domain}: not owned by {victim.name!r} in the store")
                tx.touch_job(victim.name)
                tx.touch_job(rec.name)
                tx.audit(tx.now, "alloc.preempt", rec.name, before={"job": victim.name, "domain": domain},
                         after={"job": rec.name, "domain": domain}, reason=why)

                def moved_over(victim: JobRec = victim, domain: str = domain) -> None:
                    victim.held.pop(domain, None)
                    self._helped[rec.name] = rec.layout
                    rec.held[domain] = BORROWED
                    rec.next_seq += 1
                    self.preemptions += 1
                    self._dirty(rec.name)
                    self._dirty(victim.name)

                tx.after.append(moved_over)
            log.info("replica preempted", job=rec.name, victim=victim.name, domain=domain)
            return True
        return False

    def _why(self, rec: JobRec, kind: str = GRANT) -> str:
        lay = rec.layout
        thr = lay.doc.relative_throughput if lay is not None else 0.0
        if kind == RESERVED:
            n = need_of(rec, self.own.groups_in)
            return (f"planned throughput {thr:.4f} is below full; against its reservation of {n.reserved} spare "
                    f"group(s) of tp={rec.spec.tp} ({n.groups} outstanding)")
        return f"planned throughput {thr:.4f} is below its min_throughput {rec.policy.min_throughput:.4f}"

    def _dirty(self, name: str) -> None:
        self.kernel.dirty.add(name)
        self.kernel.wake.set()

    # ---- seen and steered (the edges' calls) ---------------------------------------------------
    async def view(self, limit: int, offset: int) -> dict[str, Any]:
        """`GET /v1/cluster/allocation` (service/planning/ownership.py `allocation_view`)."""
        return await self.own.view(limit, offset)

    def planned_spec(self, name: str) -> JobSpec:
        """What a job's planner gets: its spec on the domains it owns (NotFound naming it)."""
        return self.jobs.planned_spec(name)

    # ---- steering -------------------------------------------------------------------------------
    async def set_policy(self, tx: Tx, name: str, changes: dict[str, Any]) -> dict[str, Any]:
        """Change a job's priority, preemptible, min_throughput or queue (InvalidArgument naming the
        field); pending placement and the pool follow the new values."""
        rec = self.kernel.world.jobs.get(name)
        if rec is None:
            raise NotFound(f"unknown job {name!r}")
        unknown = sorted(set(changes) - set(POLICY_FIELDS))
        if unknown:
            raise InvalidArgument(f"{unknown[0]}: not a policy field (one of {', '.join(POLICY_FIELDS)})")
        raw = {**rec.raw, **changes}
        try:
            _, policy = job_and_policy_from_dict(raw, "job")
        except SpecError as e:
            raise InvalidArgument(str(e)) from None
        row = await tx.session.get(JobRow, name)
        assert row is not None
        row.spec = raw
        tx.touch_job(name)
        tx.audit(tx.now, "job.policy", name, before={k: rec.raw.get(k) for k in changes}, after=changes)

        def changed() -> None:
            rec.raw, rec.policy = raw, policy
            self.own.placing.later()
            self.later()

        tx.after.append(changed)
        return {"name": name, **{k: getattr(policy, k) for k in POLICY_FIELDS}}
