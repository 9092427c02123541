"""Workers' acks and step reports taken by any manager, and what the leader does with them.

A manager that does not lead checks them as the leader would (ids, bounds, the stamp against the
layout it serves, the ranks' places), stores them as outbox rows (kinds `worker_ack`, `steps`)
and answers once they are durable (`WorkerIngest`); the leader applies them in sequence order
(service/ingest/consumer.py hands these kinds, and relay.py's `telemetry`, to `apply_row`), after
the transaction that moves its cursor: the ack table and the step windows are memory, as on the
leader's own path. The leader takes its own workers' calls directly (service/ingest/doors.py).
"""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from ntp_manager.clock import Clock
from ntp_manager.service.core import steps
from ntp_manager.service.core.errors import FailedPrecondition, InvalidArgument, ServiceError, Unavailable
from ntp_manager.service.core.kernel import Tx
from ntp_manager.service.core.state import LayoutRec, World
from ntp_manager.service.feed.layouts import LayoutFeed
from ntp_manager.service.feed.relay import TELEMETRY, GpuTelemetry
from ntp_manager.service.ingest.telemetry import TelemetryStore
from ntp_manager.service.ingest.worker_reports import WorkerReports
from ntp_manager.service.planning.failslow import FailSlow
from ntp_manager.service.planning.restores import RestoreReport
from ntp_manager.store import outbox

log = structlog.get_logger("ntp.watch")

WORKER_ACK, STEPS = "worker_ack", "steps"
KINDS = (WORKER_ACK, STEPS, TELEMETRY)


class Applier(Protocol):
    """What the leader's part of these rows needs of the manager."""

    @property
    def world(self) -> World: ...

    @property
    def workers(self) -> WorkerReports: ...

    @property
    def failslow(self) -> FailSlow: ...

    @property
    def telemetry(self) -> TelemetryStore: ...

    def ack_layout(self, job: str, worker: str, epoch: int, version: int, ok: bool) -> LayoutRec: ...

    async def record_restore(self, job: str, worker: str, epoch: int, version: int, report: RestoreReport) -> bool:
        ...


class WorkerIngest:
    """Acks and step reports taken by a manager that does not lead: checked, stored, answered."""

    def __init__(self, clock: Clock, feed: LayoutFeed, submit: Callable[[outbox.Entry], asyncio.Future[Any]]
                 ) -> None:
        self.clock = clock
        self.feed = feed
        self.submit = submit
        self.places = WorkerReports()  # only its places cache: the ranks' places are checked here
        self.acks = 0
        self.steps = 0

    async def _layout(self, job: str, stamp: tuple[int, int]) -> LayoutRec | None:
        rec = await self.feed.current(job)
        if rec is None or stamp > (rec.leader_epoch, rec.version):
            rec = await self.feed.refreshed(job)  # a newer layout than this manager has read yet
        return rec

    async def ack(self, job: str, worker: str, epoch: int, version: int, ok: bool,
                  restored: RestoreReport | None) -> LayoutRec:
        """Check an ack as Jobs.ack / WorkerReports.record_ack do, store it; the current layout."""
        self.places.check_ids(job, worker)
        rec = await self._layout(job, (epoch, version))
        if rec is None:
            raise InvalidArgument(f"stamp: job {job!r} has no layout yet")
        if epoch < rec.leader_epoch:
            raise FailedPrecondition(f"stamp.leader_epoch: layout epoch {epoch} was overtaken; the current layout "
                                     f"is ({rec.leader_epoch}, {rec.version})")
        if epoch > rec.leader_epoch or version > rec.version or version < 1:
            raise InvalidArgument(f"stamp: job {job!r} has no layout ({epoch}, {version})")
        payload: dict[str, Any] = {"job": job, "worker": worker, "epoch": epoch, "version": version, "ok": ok,
                                   "at": self.clock.now().isoformat()}
        if restored is not None:
            payload["restored"] = [restored.step, restored.checkpoint, restored.reason, list(restored.skipped)]
        await self._store(outbox.Entry(WORKER_ACK, "", payload,
                                       f"wack:{job}:{worker}:{epoch}:{version}:{int(ok)}:{uuid.uuid4().hex[:8]}"))
        self.acks += 1
        return rec

    async def report_steps(self, job: str, worker: str, report: Any) -> None:
        """Check a step report as WorkerReports.record_steps does (the ranks' places too), store it."""
        self.places.check_ids(job, worker)
        steps.check_report(report)
        stamp = (0, 0)
        if report.HasField("stamp"):
            stamp = (int(report.stamp.leader_epoch), int(report.stamp.version))
        rec = await (self._layout(job, stamp) if stamp != (0, 0) else self.feed.current(job))
        at = self.clock.now().timestamp()
        if stamp != (0, 0):
            if rec is None or stamp > (rec.leader_epoch, rec.version):
                raise InvalidArgument(f"stamp: job {job!r} has no layout {stamp}")
            if stamp == (rec.leader_epoch, rec.version):
                steps.samples_of(report, at, await self.places.places(job, rec))  # InvalidArgument: misplaced
        body = base64.b64encode(report.SerializeToString()).decode()
        await self._store(outbox.Entry(STEPS, "", {"job": job, "worker": worker, "at": at, "report": body},
                                       f"steps:{uuid.uuid4().hex}"))
        self.steps += 1

    async def _store(self, entry: outbox.Entry) -> None:
        try:
            await self.submit(entry)
        except ServiceError:
            raise
        except Exception as e:  # pragma: no cover - the ingest turns store errors into Unavailable
            raise Unavailable("this manager cannot store worker reports right now; try another manager") from e


def apply_row(m: Applier, tx: Tx, r: outbox.Stored) -> None:
    """The leader's part of a worker/telemetry outbox row (the consumer's transaction `tx`): what
    it changes is memory, so it runs after the commit that moves the cursor past it."""
    p = r.payload
    if r.kind == WORKER_ACK:
        tx.after.append(lambda: _ack(m, p))
    elif r.kind == STEPS:
        tx.after.append(lambda: _spawn(_steps(m, p)))
    elif r.kind == TELEMETRY:
        tx.after.append(lambda: _telemetry(m, p))
    else:
        raise ServiceError(f"unknown outbox row kind {r.kind!r}")


_background: set[asyncio.Task[None]] = set()


def _spawn(coro: Any) -> None:
    t = asyncio.get_running_loop().create_task(coro)
    _background.add(t)
    t.add_done_callback(_background.discard)


def _ack(m: Applier, p: dict[str, Any]) -> None:
    job, worker, epoch, version, ok = str(p["job"]), str(p["worker"]), int(p["epoch"]), int(p["version"]), \
        bool(p["ok"])
    try:
        m.ack_layout(job, worker, epoch, version, ok)
    except ServiceError as e:  # overtaken meanwhile (a newer leader's layout), or the job deleted
        log.info("a stored layout ack no longer applies", job=job, worker=worker, version=version, reason=e.message)
        return
    if p.get("restored") is not None:
        step, checkpoint, reason, skipped = p["restored"]
        report = RestoreReport(int(step), str(checkpoint), str(reason), tuple(str(x) for x in skipped))
        _spawn(_restore(m, job, worker, epoch, version, report))


async def _restore(m: Applier, job: str, worker: str, epoch: int, version: int, report: RestoreReport) -> None:
    try:
        await m.record_restore(job, worker, epoch, version, report)
    except ServiceError as e:
        log.info("a stored restore report no longer applies", job=job, version=version, reason=e.message)
    except Exception:
        log.exception("recording a stored restore report failed", job=job, version=version)


async def _steps(m: Applier, p: dict[str, Any]) -> None:
    from ntp_manager.contract.proto.ntp.v1 import worker_pb2

    job, worker = str(p["job"]), str(p["worker"])
    try:
        report = worker_pb2.StepReport.FromString(base64.b64decode(p["report"]))
        rec = m.world.jobs.get(job)
        if rec is None:
            return
        samples = await m.workers.record_steps(job, rec.layout, worker, report, float(p["at"]))
        if m.world.jobs.get(job) is not rec:
            m.workers.forget(job)
            return
        m.failslow.offer(job, rec, samples)
    except ServiceError as e:  # a newer layout meanwhile placed the ranks elsewhere
        log.info("a stored step report no longer applies", job=job, worker=worker, reason=e.message)
    except Exception:
        log.exception("applying a stored step report failed", job=job, worker=worker)


def _telemetry(m: Applier, p: dict[str, Any]) -> None:
    w = m.world
    for s in p["samples"]:
        *fields, gpu = s
        t = GpuTelemetry(*fields)
        g = w.gpus.get(str(gpu))
        if g is None or g.node != t.node:
            m.telemetry.ignored += 1
            continue
        m.telemetry.put(str(gpu), t)
