"""Ownership: the manager owns the cluster's GPUs and gives each whole scale-up domain to at most
one job (issue 41).

- **The invariant.** An `allocations` row per owned domain, the domain its primary key: two jobs
  cannot own one domain in the database, whichever managers race. A job's layout names only GPUs
  of the domains it owns: the planner is handed only those (`JobRec.planned_spec`), and the
  layout commit refuses any other (`check_layout`, in the transaction that writes the version).
- **Admission** (`admit`, in the job's create transaction). A job naming `domains` gets exactly
  those, when no other job owns any of them (their groups beyond its replicas' are its spares); a
  job leaving them out gets whole free domains with room for replicas x groups_per_replica TP
  groups: the fewest domains, then the smallest that fit, kept in id order (neighbouring domain ids
  are neighbouring racks), and its `spares` are reserved in the pool, not owned
  (service/planning/reservations.py). Either way the free domains left must still cover every
  outstanding reservation. A job that cannot be placed is refused (409, naming the owner or the
  reservations, the domains and the free GPUs) unless it asked to wait (`queue: true`): it is then
  created pending, owning nothing, and placed by `place_pending` in priority then arrival order
  whenever domains are freed or registered.
- **Release.** Deleting a job frees its domains and its reservation in the same transaction; the
  pool is every domain no job owns.
- **Grants and preemption** (service/planning/sharing.py): a job below full throughput gets free
  domains against its reservation, one below its `min_throughput` unreserved free domains beyond
  it (highest priority first); when the pool has none, a preemptible job of lower priority gives up
  a domain (its layout without it written in the same transaction as the move), and the receiver
  replans (a live switch for both).

Every change is written in a kernel transaction (fenced by the leader epoch) with an audit row, and
touches the jobs whose holdings change (other managers reload them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from sqlalchemy import delete
from sqlalchemy.exc import IntegrityError

from ntp_manager.planner import JobSpec
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.core import offloop
from ntp_manager.service.core.errors import Conflict, FailedPrecondition, InvalidArgument
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.metrics import Metrics
from ntp_manager.service.core.state import JobRec, World
from ntp_manager.service.core.tasks import Coalesced
from ntp_manager.service.planning.reservations import (
    RESERVED,
    Need,
    describe,
    earmark,
    granted_groups,
    needs,
    order,
    reserved_groups,
)
from ntp_manager.specfile import JobPolicy
from ntp_manager.store.models import AllocationRow
from ntp_manager.topology import Cluster

log = structlog.get_logger("ntp.ownership")

OWN, GRANT, BORROWED = "own", "grant", "borrowed"
NAMED_IN_MESSAGE = 8  # domains or jobs a refusal lists one by one


class OwnershipError(FailedPrecondition):
    """A layout naming a GPU its job does not own: never committed."""


def groups_needed(spec: JobSpec) -> int:
    """TP groups a job owns when admitted without named domains: its replicas' groups (its spares
    are reserved in the pool: service/planning/reservations.py)."""
    return spec.primary_groups


def choose_domains(free: Iterable[tuple[str, int]], need: int) -> list[str] | None:
    """Whole domains (id, TP groups it holds) giving at least `need` groups: the fewest domains,
    the last one the smallest that completes the need (so a small job does not take a large
    domain), returned in id order; None when all of them together are not enough. Pure."""
    cands = sorted(((d, g) for d, g in free if g > 0), key=lambda x: (-x[1], x[0]))
    if sum(g for _, g in cands) < need or need <= 0:
        return None if need > 0 else []
    chosen: list[str] = []
    left = need
    i = 0
    while left > 0:
        # the smallest remaining domain that completes the need, if one does; else the largest
        fits = [c for c in cands[i:] if c[1] >= left]
        if fits:
            best = min(fits, key=lambda x: (x[1], x[0]))
            chosen.append(best[0])
            break
        chosen.append(cands[i][0])
        left -= cands[i][1]
        i += 1
    return sorted(chosen)


def check_layout(doc: LayoutDoc, held: Iterable[str], domain_of: Callable[[str], str]) -> None:
    """Raise OwnershipError when `doc` names a group or a GPU outside the domains in `held`.
    O(GPUs of the layout): call it off the loop for a large one."""
    owned = set(held)
    outside = sorted({d for d in doc.group_domains if d not in owned})
    if not outside:
        outside = sorted({d for u in doc.gpus if (d := domain_of(u)) not in owned})
    if outside:
        raise OwnershipError(f"layout of job {doc.job!r} names GPUs of domain(s) {outside[:NAMED_IN_MESSAGE]} "
                             f"it does not own (it owns {sorted(owned)[:NAMED_IN_MESSAGE]}); not committed")


@dataclass
class Placement:
    """Where admission put a job: the domains it owns now (empty: pending) and why it waits."""

    held: dict[str, str]
    pending: str = ""


class Ownership:
    def __init__(self, kernel: Kernel, metrics: Metrics | None = None) -> None:
        self.kernel = kernel
        if metrics is not None:  # computed when scraped: O(owned domains)
            metrics.pool_gpus.set_function(lambda: float(self.pool_gpus()))
            metrics.pending_jobs.set_function(lambda: float(len(self.pending())))
            metrics.pool_reserved_gpus.set_function(lambda: float(self.reserved_gpus()))
        self.placing = Coalesced(self.place_pending, "place-pending")  # one placer at a time
        self._freed = False  # a commit freed domains: look at the pending jobs after it
        self.on_freed: list[Callable[[], None]] = []
        self._sizes: dict[str, int] = {}  # domain -> GPUs, from `_sized_for`
        self._sized_for: tuple[int, ...] | None = None  # the snapshot's sizes `_sizes` was made from
        # job -> (its spec, the sizes `_sizes` came from, its domains, the planned spec made of them)
        self._specs: dict[str, tuple[JobSpec, tuple[int, ...] | None, tuple[str, ...], JobSpec]] = {}
        kernel.after_commit.append(self._react)

    @property
    def world(self) -> World:
        return self.kernel.world

    # ---- reading --------------------------------------------------------------------------------
    def sized(self, cluster: Cluster) -> None:
        """Take the domains' sizes from the planner's snapshot (built off the loop: a domain index
        built here would hold the loop for O(GPUs) after every registration)."""
        sizes = cluster.domain_sizes  # shared by every snapshot of the same GPUs (a state change keeps it)
        if sizes is not self._sized_for:
            self._sizes = dict(zip(cluster.domain_ids, sizes, strict=True))
            self._sized_for = sizes

    async def refresh(self) -> None:
        self.sized(await self.world.cluster_async())

    def size(self, domain: str) -> int:
        return self._sizes.get(domain, 0)

    def groups_in(self, domain: str, tp: int) -> int:
        return self.size(domain) // tp

    def planned_spec(self, rec: JobRec, domains: Iterable[str] | None = None) -> JobSpec:
        """The spec `rec`'s planner gets: restricted to the domains it owns (or `domains`), in order,
        and with every TP group of them beyond its replicas' counted as a spare (it owns the whole
        domain: a granted domain's groups, or a domain's groups past its replicas', stand in for
        reduced groups with the planner's minimal-movement packing)."""
        ds = tuple(rec.held if domains is None else domains)
        memo = self._specs.get(rec.name)
        if memo is not None and memo[0] is rec.spec and memo[1] is self._sized_for and memo[2] == ds:
            return memo[3]  # the same spec, sizes and domains: the same answer (O(domains) to make)
        sizes, tp = self._sizes, rec.spec.tp
        groups = sum(sizes.get(d, 0) // tp for d in ds)
        # a job naming its domains has its spares among them; one that does not holds only what
        # it owns and was granted (its reservation's outstanding rest is in the pool, not here)
        floor = rec.spec.spares if rec.spec.domains else 0
        spec = rec.planned_spec(ds, max(floor, groups - rec.spec.primary_groups))
        if domains is None:
            if len(self._specs) > 4 * len(self.world.jobs) + 16:  # deleted jobs' entries go
                self._specs = {n: m for n, m in self._specs.items() if n in self.world.jobs}
            self._specs[rec.name] = (rec.spec, self._sized_for, ds, spec)
        return spec

    def free_domains(self, taken: Iterable[str] = ()) -> list[str]:
        owners = self.world.owners()
        owners.update(dict.fromkeys(taken, ""))
        return sorted(d for d in self.world.domains if d not in owners)

    def pending(self) -> list[JobRec]:
        """Jobs owning nothing, in the order they are placed: priority, then arrival."""
        return sorted((j for j in self.world.jobs.values() if not j.held), key=order)

    def outstanding(self, extra: Iterable[Need] = ()) -> list[Need]:
        """Every placed job's outstanding reservation (then `extra`), in the order they are served."""
        return needs(self.world.jobs.values(), self.groups_in, order) + list(extra)

    def earmarks(self, taken: Iterable[str] = (), extra: Iterable[Need] = ()) -> tuple[dict[str, list[str]],
                                                                                       list[Need]]:
        """The free domains each outstanding reservation would take, and those left uncovered."""
        return earmark([(d, self.size(d)) for d in self.free_domains(taken)], self.outstanding(extra),
                       choose_domains)

    def _covered(self, free: list[str], wanted: list[Need]) -> list[str] | None:
        """The domains of `free` that `wanted` would take, or None when they cannot all be covered."""
        if not wanted:
            return []
        marks, short = earmark([(d, self.size(d)) for d in free], wanted, choose_domains)
        return None if short else [d for ds in marks.values() for d in ds]

    def _refusal(self, name: str, spec: JobSpec, holders: dict[str, str], free: list[str],
                 wanted: list[Need] | None = None) -> str:
        gpus_free = sum(self.size(d) for d in free)
        asked = groups_needed(spec) * spec.tp
        if wanted is not None:
            own = "" if spec.domains else f" and reserves {spec.spares} spare group(s) of tp={spec.tp}"
            what = (f"job {name!r} needs {asked if not spec.domains else 'its named domains'} "
                    f"{'GPUs ' if not spec.domains else ''}for its replicas{own}, and the free pool "
                    f"left after its domains would not cover the outstanding reservations ({describe(wanted)})")
        elif holders:
            by_job: dict[str, list[str]] = {}
            for d, j in holders.items():
                by_job.setdefault(j, []).append(d)
            held = "; ".join(f"job {j!r} owns {sorted(ds)[:NAMED_IN_MESSAGE]}" for j, ds in sorted(by_job.items()))
            what = f"domains: the domains it names are owned by other jobs ({held})"
        else:
            what = (f"job {name!r} asks for {asked:,} GPUs (replicas x groups_per_replica x tp, whole "
                    f"domains of at least tp={spec.tp}) and no set of free domains holds them")
        return (f"{what}; the pool has {gpus_free:,} free GPUs in {len(free)} domain(s) "
                f"{free[:NAMED_IN_MESSAGE]}; give `queue: true` to wait for capacity")

    def _place(self, tx: Tx, name: str, spec: JobSpec, taken: set[str], running: LayoutDoc | None = None,
               extra: Iterable[Need] = ()) -> tuple[list[str] | None, str]:
        """The domains `spec` would own now (None: it cannot be placed, with why). InvalidArgument
        for a domain the cluster does not have. A job that has a layout but owns nothing (one
        created before ownership existed: its store had no allocation rows) adopts the domains its
        layout runs on when they are all free, so an upgrade moves no running job. Whatever it takes,
        the free domains left must still cover every outstanding reservation (its own included:
        placed jobs', those of `extra`, placed earlier in the same pass, and its spares)."""
        owners = self.world.owners()
        free = [d for d in self.free_domains(taken) if d in self.world.domains]
        wanted = self.outstanding(extra)
        if running is not None and not spec.domains:
            adopt = list(dict.fromkeys(running.group_domains))
            if adopt and all(d in free for d in adopt):
                return adopt, ""
        if spec.domains:
            for d in spec.domains:
                if not tx.has_domain(d):
                    raise InvalidArgument(f"domains: unknown domain {d!r} (no agent registered it)")
            holders = {d: owners[d] for d in spec.domains if d in owners}
            holders.update({d: "(being placed)" for d in spec.domains if d in taken and d not in owners})
            if holders:
                return None, self._refusal(name, spec, holders, free)
            named = set(spec.domains)
            if self._covered([d for d in free if d not in named], wanted) is None:
                return None, self._refusal(name, spec, {}, free, wanted)
            return list(spec.domains), ""
        if spec.spares:
            wanted = [*wanted, Need(name, spec.tp, spec.spares, spec.spares)]
        groups = {d: self.groups_in(d, spec.tp) for d in free}
        chosen = choose_domains(groups.items(), groups_needed(spec))
        if chosen is None:
            return None, self._refusal(name, spec, {}, free)
        # its domains first, then the reservations on the rest; else the reservations first
        mine = set(chosen)
        if self._covered([d for d in free if d not in mine], wanted) is not None:
            return chosen, ""
        marked = self._covered(free, wanted)
        if marked is not None:
            rest = set(marked)
            chosen = choose_domains(((d, g) for d, g in groups.items() if d not in rest), groups_needed(spec))
            if chosen is not None:
                return chosen, ""
        return None, self._refusal(name, spec, {}, free, wanted)

    async def view(self, limit: int, offset: int) -> dict[str, Any]:
        cluster = await self.world.cluster_async()
        self.sized(cluster)
        return allocation_view(self.world, cluster, self.pending(), limit, offset, self.reserved_gpus())

    def pool_gpus(self) -> int:
        """GPUs of the free domains (as of the newest snapshot: a scrape never builds one)."""
        return sum(self.size(d) for d in self.free_domains())

    def reserved_gpus(self) -> int:
        """GPUs of the free domains that outstanding reservations would take (`earmarks`)."""
        marks, _ = self.earmarks()
        return sum(self.size(d) for ds in marks.values() for d in ds)

    # ---- writing --------------------------------------------------------------------------------
    async def _own(self, tx: Tx, name: str, domains: list[str], kind: str, first_seq: int = 0) -> None:
        """Write the rows that give `domains` to `name` (IntegrityError -> Conflict naming who won)."""
        for i, d in enumerate(domains):
            tx.session.add(AllocationRow(domain_id=d, job=name, kind=kind, seq=first_seq + i, at=tx.now))
        try:
            await tx.session.flush()
        except IntegrityError:
            raise Conflict(f"domains: {domains[:NAMED_IN_MESSAGE]} were given to another job meanwhile (another "
                           f"manager's write won); nothing was created") from None
        tx.touch_job(name)

    async def take(self, tx: Tx, rec: JobRec, domains: list[str], kind: str) -> None:
        """Give more free `domains` to a placed job (a grant) in `tx`; memory follows on commit."""
        first = rec.next_seq
        await self._own(tx, rec.name, domains, kind, first)

        def taken() -> None:
            rec.next_seq = max(rec.next_seq, first + len(domains))

        tx.after.append(taken)

    def freed(self) -> None:
        """Domains went back to the pool or were added (after a commit): place pending jobs, and
        tell whoever waits for free capacity (service/planning/sharing.py)."""
        if any(not j.held for j in self.world.jobs.values()):
            self.placing.later()
        for fn in self.on_freed:
            fn()

    async def admit(self, tx: Tx, name: str, spec: JobSpec, policy: JobPolicy) -> Placement:
        """Give a new job its domains in `tx` (its job row is already added). Conflict (409) when it
        cannot be placed and does not queue; a pending Placement when it queues."""
        await self.refresh()
        chosen, why = self._place(tx, name, spec, set())
        if chosen is None:
            if not policy.queue:
                raise Conflict(why)
            tx.audit(tx.now, "alloc.pending", name, reason=why)
            return Placement({}, f"pending: {why}")
        await tx.session.flush()  # the job row first: the allocation rows refer to it
        await self._own(tx, name, chosen, OWN)
        tx.audit(tx.now, "alloc.own", name, after={"domains": chosen[:AUDITED], "count": len(chosen),
                                                   "reserved_groups": 0 if spec.domains else spec.spares})
        return Placement(dict.fromkeys(chosen, OWN))

    async def release(self, tx: Tx, rec: JobRec) -> None:
        """Free every domain of `rec` (its job is being deleted) in `tx`."""
        await tx.session.execute(delete(AllocationRow).where(AllocationRow.job == rec.name))
        tx.touch_job(rec.name)
        if rec.held:
            tx.audit(tx.now, "alloc.release", rec.name,
                     before={"domains": list(rec.held)[:AUDITED], "count": len(rec.held)}, reason="job deleted")
            self._freed = True

    # ---- pending jobs ---------------------------------------------------------------------------
    def _react(self, tx: Tx) -> None:
        """After a commit that freed or added domains, place pending jobs (one placer at a time)."""
        if not (tx.shape_changed or self._freed):
            return
        self._freed = False
        self.freed()

    async def place_pending(self) -> list[str]:
        """Place pending jobs in priority then arrival order, each on free domains, stopping at the
        first that still does not fit (no job overtakes one that waits longer at its priority).
        Returns the jobs placed."""
        placed: list[str] = []
        if not any(not j.held for j in self.world.jobs.values()):
            return placed
        await self.refresh()
        async with self.kernel.exclusive("allocator") as tx:
            taken: set[str] = set()
            placed_needs: list[Need] = []  # reservations of the jobs placed in this pass
            for rec in self.pending():
                try:
                    chosen, why = self._place(tx, rec.name, rec.spec, taken,
                                              rec.layout.doc if rec.layout is not None else None, placed_needs)
                except InvalidArgument as e:  # a named domain not registered yet
                    chosen, why = None, e.message
                if chosen is None:
                    rec.pending_reason = f"pending: {why}"
                    break
                await self._own(tx, rec.name, chosen, OWN)
                tx.audit(tx.now, "alloc.own", rec.name, after={"domains": chosen[:AUDITED], "count": len(chosen),
                                                               "reserved_groups": reserved_groups(rec)},
                         reason="placed from the queue")
                taken.update(chosen)
                placed.append(rec.name)
                if reserved_groups(rec):
                    placed_needs.append(Need(rec.name, rec.spec.tp, reserved_groups(rec), reserved_groups(rec)))

                def publish(rec: JobRec = rec, chosen: list[str] = chosen) -> None:
                    if self.world.jobs.get(rec.name) is rec:
                        rec.held = dict.fromkeys(chosen, OWN)
                        rec.next_seq = len(chosen)
                        rec.pending_reason = None
                        self.kernel.dirty.add(rec.name)
                        self.kernel.wake.set()

                tx.after.append(publish)
        if placed:
            log.info("pending jobs placed", jobs=placed)
        return placed


AUDITED = 64  # domains an audit row lists one by one


def job_view(rec: JobRec, groups_in: Callable[[str, int], int]) -> dict[str, Any]:
    """One job's share of the cluster: its policy, what it owns, its reservation in the pool (TP
    groups reserved, and granted against it) and its throughput beside what it asks."""
    lay = rec.layout
    got = granted_groups(rec, groups_in)
    return {"name": rec.name, "state": "placed" if rec.held else "pending", "priority": rec.policy.priority,
            "preemptible": rec.policy.preemptible, "min_throughput": rec.policy.min_throughput,
            "queue": rec.policy.queue, "domains": len(rec.held),
            "granted": sum(1 for k in rec.held.values() if k != OWN),
            "reservation": {"groups": reserved_groups(rec), "granted_groups": got,
                            "domains": sum(1 for k in rec.held.values() if k == RESERVED)},
            "relative_throughput": lay.doc.relative_throughput if lay is not None else None,
            "meets_min_throughput": lay is not None and lay.doc.relative_throughput >= rec.policy.min_throughput,
            "pending_reason": rec.pending_reason if not rec.held else None,
            "created_at": rec.created_at.isoformat() if rec.created_at else None}


def allocation_view(world: World, cluster: Cluster, pending: list[JobRec], limit: int,
                    offset: int, reserved_gpus: int = 0) -> dict[str, Any]:
    """`GET /v1/cluster/allocation`: a page of domains (by id) with the job owning each (None: the
    pool), how it came to own it and its GPUs by state; the pool's totals; every job's share (a page
    of jobs by name, the same `limit` and `offset`, each with its reservation); the pending jobs in
    the order they are placed. The pool's `reserved_gpus` are those of the free domains that the
    outstanding reservations would take (`Ownership.earmarks`), `unreserved_gpus` the rest.
    O(owned domains + the page's GPUs), read from the planner's snapshot `cluster`."""
    owners: dict[str, tuple[str, str]] = {d: (j.name, k) for j in world.jobs.values() for d, k in j.held.items()}
    sizes = dict(zip(cluster.domain_ids, cluster.domain_sizes, strict=True))
    ids = sorted(world.domains)
    items = []
    for d in ids[offset:offset + limit]:
        job, kind = owners.get(d, (None, None))
        states: dict[str, int] = {}
        gpus = cluster.domain(d).gpus if d in cluster.domain_index else ()
        for g in gpus:
            states[str(g.state)] = states.get(str(g.state), 0) + 1
        items.append({"domain": d, "job": job, "kind": kind, "gpus": len(gpus), "gpus_by_state": states})
    free = [d for d in ids if d not in owners]
    names = sorted(world.jobs)
    pool_gpus = sum(sizes.get(d, 0) for d in free)

    def groups_in(d: str, tp: int) -> int:
        return sizes.get(d, 0) // tp

    return {
        "items": items, "total": len(ids), "limit": limit, "offset": offset,
        "pool": {"domains": len(free), "gpus": pool_gpus, "reserved_gpus": reserved_gpus,
                 "unreserved_gpus": pool_gpus - reserved_gpus, "first_domains": free[:NAMED_IN_MESSAGE]},
        "owned": {"domains": len(owners), "gpus": sum(sizes.get(d, 0) for d in owners)},
        "jobs": {"items": [job_view(world.jobs[n], groups_in) for n in names[offset:offset + limit]],
                 "total": len(names)},
        "pending": [j.name for j in pending][:limit],
    }


async def check_owned(doc: LayoutDoc, rec: JobRec, world: World) -> None:
    """`check_layout` for `rec`'s layout, off the loop when it is large."""
    def domain_of(u: str) -> str:
        return world.gpus[u].domain

    if len(doc.gpus) > 4096:
        await offloop.run(check_layout, doc, list(rec.held), domain_of)
    else:
        check_layout(doc, rec.held, domain_of)
