"""Jobs and replanning: owns the jobs, their layouts (versioned, fenced by the leader epoch), the
control loop that replans dirty jobs, and the watchers waiting for a new version.

A replan plans off the event loop (service/planning/planning.py) with the layout running now as the
previous one, and persists version+1 (with its audit record and the power caps it implies) only
when the layout itself changed. Watchers are woken after the commit; workers' acks and step
reports are kept by service/ingest/worker_reports.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from sqlalchemy import text

from ntp_manager.planner import JobSpec, PlanError
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.core import offloop
from ntp_manager.service.core.errors import Conflict, InvalidArgument, NotFound
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.metrics import Metrics
from ntp_manager.service.core.state import JobRec, LayoutRec
from ntp_manager.service.core.steps import StepSample
from ntp_manager.service.ingest.worker_reports import WorkerReports
from ntp_manager.service.planning import planning, planproc
from ntp_manager.service.planning.ownership import OWN, Ownership, check_owned
from ntp_manager.service.planning.power import Power
from ntp_manager.settings import Settings
from ntp_manager.specfile import JobPolicy, SpecError, job_and_policy_from_dict
from ntp_manager.store import outbox
from ntp_manager.store.models import JobRow, LayoutRow
from ntp_manager.topology import Cluster, TopologyError

log = structlog.get_logger("ntp.jobs")
LISTED_DOMAINS = 64  # domains a create answer lists one by one


class Jobs:
    def __init__(self, kernel: Kernel, settings: Settings, metrics: Metrics, power: Power,
                 workers: WorkerReports, epoch: Callable[[], int], breaker_open: Callable[[], bool]) -> None:
        self.kernel = kernel
        self.settings = settings
        self.metrics = metrics
        self.power = power
        self.workers = workers
        self.epoch = epoch
        self.breaker_open = breaker_open
        self.ownership = Ownership(kernel, metrics)
        self.layout_changed = asyncio.Condition()
        self.stopping = False
        self.replanning: str | None = None  # the job the control loop is replanning now (None: none)
        self.on_layout: list[Callable[[], None]] = []  # told after a new version is in memory, a job deleted
        # told when a replan of a job holding domains beyond its own found its layout unchanged (a
        # repair its layout does not follow may leave one idle: service/planning/sharing.py)
        self.on_unchanged: list[Callable[[], None]] = []
        self.planner = planproc.shared(settings.plan_process)  # planning off the loop, in a process
        # the newest verified checkpoint step of a job, read when a new plan leaves some unit with no
        # surviving holder (service/planning/checkpoints.py; None: unknown)
        self.known_checkpoint: Callable[[str], Awaitable[int | None]] | None = None
        # job -> the inputs of its last replan that found its running layout unchanged (snapshot,
        # layout, spec): planning is deterministic, so a replan on the very same inputs (the
        # same snapshot object: no GPU changed state since) is answered from here. A warm standby
        # fills it ahead of a takeover (`verify`), whose replan of every job is then free.
        self._unchanged: dict[str, tuple[Cluster, LayoutRec, JobSpec]] = {}

    # ---- jobs ---------------------------------------------------------------------------------
    def parse(self, spec: dict[str, Any]) -> JobSpec:
        """A job spec, checked (InvalidArgument naming the field) and bounded by `max_cluster_gpus`."""
        return self.parse_with_policy(spec)[0]

    def parse_with_policy(self, spec: dict[str, Any]) -> tuple[JobSpec, JobPolicy]:
        """`parse`, and the job's sharing policy (priority, preemptible, min_throughput, queue)."""
        try:
            job, policy = job_and_policy_from_dict(spec, "job")
        except SpecError as e:
            raise InvalidArgument(str(e)) from None
        asked = (job.replicas + job.spares) * job.groups_per_replica * job.tp
        if asked > self.settings.max_cluster_gpus:
            raise InvalidArgument(
                f"job: (replicas + spares) x groups_per_replica x tp = {asked:,} GPUs; this manager's "
                f"cluster holds at most {self.settings.max_cluster_gpus:,} (max_cluster_gpus)"
            )
        return job, policy

    async def create(self, tx: Tx, spec: dict[str, Any]) -> dict[str, Any]:
        """Create a job and give it its domains (service/planning/ownership.py) in `tx`: Conflict when
        it cannot be placed and does not queue (nothing is created then), pending when it queues."""
        job, policy = self.parse_with_policy(spec)
        if job.name in self.kernel.world.jobs or await tx.session.get(JobRow, job.name) is not None:
            raise Conflict(f"job {job.name!r} already exists")
        tx.session.add(JobRow(name=job.name, spec=spec, created_at=tx.now, created_by=tx.actor))
        placed = await self.ownership.admit(tx, job.name, job, policy)
        tx.audit(tx.now, "job.create", job.name, after=spec)
        tx.touch_job(job.name)

        def created() -> None:
            rec = JobRec(job.name, job, spec, policy=policy, held=placed.held, created_at=tx.now,
                         next_seq=len(placed.held))
            rec.pending_reason = placed.pending or None
            self.kernel.world.jobs[job.name] = rec
            if rec.held:
                self.kernel.dirty.add(job.name)
                self.kernel.wake.set()

        tx.after.append(created)
        return {"name": job.name, "spec": spec, "created_at": tx.now.isoformat(),
                "state": "placed" if placed.held else "pending", "domains": list(placed.held)[:LISTED_DOMAINS],
                "domain_count": len(placed.held), **({"pending_reason": placed.pending} if placed.pending else {})}

    async def delete(self, tx: Tx, name: str) -> dict[str, Any]:
        rec = self.kernel.world.jobs.get(name)
        if rec is None:
            raise NotFound(f"unknown job {name!r}")
        row = await tx.session.get(JobRow, name)
        assert row is not None
        await self.ownership.release(tx, rec)  # its domains go back to the pool in this transaction
        await tx.session.delete(row)
        tx.audit(tx.now, "job.delete", name, before=rec.raw)
        tx.touch_job(name)

        def deleted() -> None:
            self.kernel.world.jobs.pop(name, None)
            self.workers.forget(name)
            self.kernel.dirty.discard(name)
            self.power.recompute_later()
            for fn in self.on_layout:  # the layout feeds learn it is gone (service/feed/layouts.py)
                fn()
            self.wake_watchers()  # its workers' watches end (the job is gone)

        tx.after.append(deleted)
        return {"name": name, "deleted": True}

    def planned_spec(self, name: str) -> JobSpec:
        """What a job's planner gets: its spec on the domains it owns (a pending job: its own spec)."""
        rec = self.kernel.world.jobs.get(name)
        if rec is None:
            raise NotFound(f"job: unknown job {name!r}")
        return self.ownership.planned_spec(rec) if rec.held else rec.spec

    async def dry_run(self, spec: JobSpec, fail: list[str]) -> LayoutDoc:
        """The layout `spec` would get now, with the GPUs in `fail` failed; planned off the loop."""
        w = self.kernel.world
        if fail:  # up to 100K names: looked up in a thread
            unknown = await offloop.run(lambda: next((u for u in fail if u not in w.gpus), None))
            if unknown is not None:
                raise NotFound(f"fail: unknown GPU {unknown[:200]!r}")
        cluster = await w.cluster_async()
        try:
            return await self.planner.plan(cluster, spec, w.pos_of, tuple(fail))
        except PlanError as e:
            raise InvalidArgument(str(e)) from None
        except TopologyError as e:  # a GPU in `fail` registered after the snapshot was taken
            raise NotFound(f"fail: {e}") from None

    # ---- replanning ---------------------------------------------------------------------------
    async def control_loop(self) -> None:
        k = self.kernel
        self.ownership.freed()  # jobs the store holds pending (or from before ownership): place them
        while not self.stopping:
            await k.wake.wait()
            k.wake.clear()
            if self.breaker_open():
                continue
            while k.dirty and not self.breaker_open():
                name = min(k.dirty)
                k.dirty.discard(name)
                self.replanning = name
                try:
                    await self.replan(name, actor="control-loop")
                except Exception:  # keep the loop alive; the error is logged with its job
                    log.exception("replan failed", job=name)
                finally:
                    self.replanning = None

    async def replan(self, name: str, actor: str, reason: str = "", tx: Tx | None = None) -> LayoutRec | None:
        """Replan one job; persist and push a new version when the layout changed. Planning,
        comparing and encoding run in a worker thread (service/planning/planning.py)."""
        w = self.kernel.world
        job = w.jobs.get(name)
        if job is None:
            return None
        if not job.held:  # pending: it owns no domain to plan on (service/planning/ownership.py)
            job.pending_reason = job.pending_reason or "pending: it owns no domain yet"
            return None
        t0 = time.perf_counter()
        base = job.layout
        try:
            cluster = await w.cluster_async()
            self.ownership.sized(cluster)
            spec = self.ownership.planned_spec(job)  # only the domains it owns
            if self._known_unchanged(name, cluster, base, spec):
                job.pending_reason = None
                if any(k != OWN for k in job.held.values()):
                    for fn in self.on_unchanged:
                        fn()
                return base
            d = await self.planner.draft(cluster, spec, base, w.pos_of, reason)
            if d.restore and self.known_checkpoint is not None:  # rare: no survivor holds some unit: read
                step = await self.known_checkpoint(name)  # the checkpoints (issue 22), plan again with the step
                if step is not None:
                    d = await self.planner.draft(cluster, spec, base, w.pos_of, reason, step)
        except PlanError as e:
            job.pending_reason = str(e)
            return None
        finally:
            self.metrics.plan_seconds.observe(time.perf_counter() - t0)
        job.pending_reason = None
        while w.jobs.get(name) is job:  # else deleted or replaced while planning
            if job.layout is not base:  # another replan published meanwhile: follow that one
                base = job.layout
                d = await offloop.run(planning.follow, d.doc, base, w.pos_of, reason)
            if d.unchanged:
                if base is not None and job.layout is base:
                    self._unchanged[name] = (cluster, base, spec)
                if any(k != OWN for k in job.held.values()):
                    for fn in self.on_unchanged:
                        fn()
                return base
            if tuple(job.held) != spec.domains:  # its domains changed while planning: plan again
                return await self.replan(name, actor, reason, tx)
            if tx is not None:  # the caller's transaction holds the write lock: nothing publishes meanwhile
                return await self._persist(tx, job, d, base, t0)
            async with self.kernel.exclusive(actor) as t:
                if job.layout is base and w.jobs.get(name) is job and tuple(job.held) == spec.domains:
                    return await self._persist(t, job, d, base, t0)
        return None

    def _known_unchanged(self, name: str, cluster: Cluster, base: LayoutRec | None, spec: JobSpec) -> bool:
        memo = self._unchanged.pop(name, None)
        if memo is None or base is None or memo[0] is not cluster or memo[1] is not base or memo[2] != spec:
            return False
        self._unchanged[name] = memo
        return True

    async def prime(self, cluster: Cluster, docs: list[LayoutDoc]) -> int:
        """Send this manager's planner process `cluster`'s shape and `docs` ahead of any plan."""
        return await self.planner.prime(cluster, self.kernel.world.pos_of, docs)

    async def verify(self) -> int:
        """On a standby: plan every job with a layout on this manager's world, publishing nothing,
        and remember those whose plan is their running layout (the first replan of a takeover
        is then answered without planning, as long as no GPU changed state meanwhile). How many
        were found unchanged. A plan that fails here is left to the takeover's replan."""
        w = self.kernel.world
        found = 0
        for name in [n for n, j in w.jobs.items() if j.layout is not None and j.held]:
            job = w.jobs.get(name)
            if job is None or job.layout is None or not job.held:
                continue
            base = job.layout
            cluster = await w.cluster_async()
            self.ownership.sized(cluster)
            spec = self.ownership.planned_spec(job)
            if self._known_unchanged(name, cluster, base, spec):
                found += 1
                continue
            try:
                d = await self.planner.draft(cluster, spec, base, w.pos_of, "")
            except PlanError:
                continue
            if d.unchanged and w.jobs.get(name) is job and job.layout is base:
                self._unchanged[name] = (cluster, base, spec)
                found += 1
        for name in [n for n in self._unchanged if n not in w.jobs]:
            del self._unchanged[name]
        return found

    async def _persist(self, t: Tx, job: JobRec, d: planning.Draft, base: LayoutRec | None,
                       t0: float | None = None) -> LayoutRec:
        """Write version+1 of `job` (its body, audit record and power caps) in `t`; it is published
        (memory, watchers) after the commit. `t0`: when its replan began (perf_counter), logged."""
        assert d.encoded is not None
        await check_owned(d.doc, job, self.kernel.world)  # OwnershipError: never a GPU it does not own
        version = (base.version if base else 0) + 1
        t.session.add(LayoutRow(job=job.name, version=version, leader_epoch=self.epoch(), plan=None,
                                body=d.encoded.body, base_version=d.encoded.base_version, reason=d.why,
                                created_at=t.now))
        t.touch_job(job.name)
        if self.settings.shared_store:  # every manager's watchers (service/feed/layouts.py); sent on commit
            await t.session.execute(text("SELECT pg_notify(:c, :p)"),
                                    {"c": outbox.LAYOUTS, "p": f"{self.epoch()}:{version}:{job.name}"})
        t.audit(t.now, "layout.update", job.name, before={"version": version - 1} if version > 1 else None,
                after={"version": version, **d.summary}, reason=d.why)
        rec = LayoutRec(job.name, version, self.epoch(), d.doc, d.why, t.now, self.kernel.clock.monotonic(),
                        d.encoded.chain)
        # only GPUs capped by the old or the new layout can change cap
        await self.power.stage(t, {job.name: d.doc}, (d.doc, base.doc) if base else None)

        def published() -> None:
            job.layout = rec
            log.info("layout published", job=job.name, version=version, epoch=rec.leader_epoch,
                     gpus=len(d.doc.gpus), reason=d.why[:200],
                     replan_s=None if t0 is None else round(time.perf_counter() - t0, 3))
            for fn in self.on_layout:
                fn()
            self.wake_watchers()

        t.after.append(published)
        return rec

    # ---- watchers -----------------------------------------------------------------------------
    def wake_watchers(self) -> None:
        """Make every `wait_layout` look again (a new layout, or a watcher told to stop)."""
        async def notify() -> None:
            async with self.layout_changed:
                self.layout_changed.notify_all()

        asyncio.get_running_loop().create_task(notify())

    async def wait_layout(self, job: str, newer_than: tuple[int, int],
                          stop: Callable[[], bool] | None = None) -> LayoutRec | None:
        """Block until `job` has a layout with (epoch, version) > newer_than; None when stopping
        or when `stop()` says so (checked whenever the watchers are woken)."""
        async with self.layout_changed:
            while not self.stopping and not (stop is not None and stop()):
                rec = self.kernel.world.jobs.get(job)
                if rec is None:
                    raise NotFound(f"unknown job {job!r}")
                lay = rec.layout
                if lay is not None and (lay.leader_epoch, lay.version) > newer_than:
                    return lay
                await self.layout_changed.wait()
        return None

    def ack(self, job: str, worker: str, epoch: int, version: int, ok: bool) -> LayoutRec:
        """Record a worker's ack of layout (epoch, version); see service/ingest/worker_reports.py."""
        self.workers.check_ids(job, worker)
        rec = self.kernel.world.jobs.get(job)
        if rec is None:
            raise NotFound(f"job: unknown job {job!r}")
        lay = rec.layout
        if lay is None:
            raise InvalidArgument(f"stamp: job {job!r} has no layout yet")
        # acks of the newest versions, in memory only (operators see who has applied what)
        self.workers.record_ack(job, lay, worker, epoch, version, ok, self.kernel.clock.now().isoformat())
        if ok and version == lay.version:
            self.metrics.ack_seconds.observe(max(0.0, self.kernel.clock.monotonic() - lay.created_mono))
        log.info("layout ack", job=job, worker=worker, version=version, ok=ok)
        return lay

    async def record_steps(self, job: str, worker_id: str, report: Any) -> tuple[JobRec, list[StepSample]]:
        """Keep a worker's step report (an ntp.v1.StepReport) in its job's window
        (service/core/steps.py); returns the job and the samples kept (none if the job was deleted
        meanwhile). NotFound for an unknown job, InvalidArgument for a bad field."""
        self.workers.check_ids(job, worker_id)
        rec = self.kernel.world.jobs.get(job)
        if rec is None:
            raise NotFound(f"job: unknown job {job!r}")
        samples = await self.workers.record_steps(job, rec.layout, worker_id, report,
                                                  self.kernel.clock.now().timestamp())
        if self.kernel.world.jobs.get(job) is not rec:  # deleted while the layout's places were built
            self.workers.forget(job)
            return rec, []
        return rec, samples

    def step_summary(self, job: str, recent: int) -> dict[str, Any]:
        """Step times of `job` per replica and per stage over its window (current layout), and the
        newest `recent` samples."""
        rec = self.kernel.world.jobs.get(job)
        if rec is None:
            raise NotFound(f"unknown job {job!r}")
        version = rec.layout.version if rec.layout is not None else 0
        return {"job": job, **self.workers.window(job).summary(version, recent)}
