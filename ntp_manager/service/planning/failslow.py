"""Fail-slow in the service (issue 21): one detector per job, fed from workers' step reports; its
verdicts reported, audited and (unless in dry run) acted on.

What it owns:
- per job, a `WorkloadDetector` (ntp_manager/detect/) and a `StepAssembler` that turns the job's
  step samples (service/core/steps.py) into whole steps. Steps are observed in order by one task per
  job, in a worker thread (a step of many ranks costs milliseconds of numpy), never on the loop;
- the options: defaults for every job (scope "*") and per-job overrides, set at runtime by an
  operator (validated: `OptionsError` becomes a 422 naming the field; audited; stored in
  `failslow_options`, so they survive a restart). A detector keeps its state when they change;
- the newest verdicts per job (bounded) for the API and the dashboard.

What a verdict does (never in dry run: then it is only reported and audited):
- `Slow`: the GPU's health becomes `degraded` with its measured speed factor (1 / factor), source
  "detector"; a later `Slow` update moves the speed. The kernel marks its job dirty, and the
  planner decides keep / exclude / spare (planner/plan.py). A GPU that failed, or that an agent
  called degraded on its own evidence, is left as it is.
- `Recovered`: a GPU the detector made degraded is healthy again.
- `Imbalance`, `NetworkSlow`, `Cleared`: reported and audited only (the data or the links, not a
  GPU). An agent's report of "healthy" does not undo the detector's verdict (service/ingest/agents.py);
  an operator's mark-healthy does.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from ntp_manager.contract.gpu import GpuState
from ntp_manager.detect import (
    DetectError,
    DetectorOptions,
    OptionsError,
    Recovered,
    Slow,
    Verdict,
    WorkloadDetector,
    verdict_dict,
)
from ntp_manager.service.core.errors import InvalidArgument, NotFound
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.state import GpuChange, HealthSource, JobRec, health_to
from ntp_manager.service.core.steps import StepSample
from ntp_manager.service.ingest.telemetry import TelemetryStore
from ntp_manager.service.planning.step_assembly import StepAssembler, observation
from ntp_manager.store.models import FailSlowOptionsRow

log = structlog.get_logger("ntp.failslow")

ALL_JOBS = "*"
VERDICTS_KEPT = 200  # per job, newest first out
MIN_SPEED = 0.05  # a measured speed is clamped to [MIN_SPEED, 1]


def speed_of(factor: float) -> float:
    """The speed factor a time factor means, rounded to 3 digits, in [MIN_SPEED, 1]."""
    if not math.isfinite(factor) or factor <= 0:
        return 1.0
    return round(min(1.0, max(MIN_SPEED, 1.0 / factor)), 3)


@dataclass
class _Job:
    detector: WorkloadDetector
    assembler: StepAssembler = field(default_factory=StepAssembler)
    queue: deque[tuple[int, list[StepSample]]] = field(default_factory=deque)
    verdicts: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=VERDICTS_KEPT))
    speeds: dict[str, float] = field(default_factory=dict)  # TP group -> planned speed (power)
    task: asyncio.Task[None] | None = None
    observed: int = 0
    refused: int = 0  # steps the detector refused (DetectError: workers disagreeing)
    last_error: str = ""
    forget: set[str] = field(default_factory=set)  # GPUs to start afresh before the next step


class FailSlow:
    def __init__(self, kernel: Kernel, telemetry: TelemetryStore) -> None:
        self.kernel = kernel
        self.telemetry = telemetry
        self.options: dict[str, DetectorOptions] = {ALL_JOBS: DetectorOptions()}
        self.jobs: dict[str, _Job] = {}
        kernel.after_commit.append(self._health_changed)

    def _health_changed(self, tx: Tx) -> None:
        """A GPU made healthy by anything but the detector (an operator's mark-healthy, an agent's
        return) is judged afresh: the detector forgets it, so that if it is still slow it is found
        again (4 of 6 slow steps) instead of staying flagged with no verdict to come."""
        for u, ch in tx.gpu_changes():
            if ch.get("health") == GpuState.HEALTHY and ch.get("health_source") != HealthSource.DETECTOR:
                for j in self.jobs.values():
                    j.forget.add(u)

    async def load(self, session: AsyncSession) -> None:
        """Options operators set before a restart (a stored set that no longer validates is
        skipped with a warning: the defaults apply)."""
        for row in (await session.scalars(select(FailSlowOptionsRow))).all():
            try:
                self.options[row.scope] = DetectorOptions().updated(dict(row.options))
            except OptionsError as e:
                log.warning("stored fail-slow options ignored", scope=row.scope, error=str(e))

    def options_for(self, job: str) -> DetectorOptions:
        return self.options.get(job) or self.options[ALL_JOBS]

    # ---- feeding ------------------------------------------------------------------------------
    def offer(self, job: str, rec: JobRec, samples: list[StepSample]) -> None:
        """New samples of `job` (already in its step window). Steps they complete are queued for
        the job's detector task; nothing here waits."""
        lay = rec.layout
        if lay is None or not samples:
            return
        j = self.jobs.get(job)
        if j is None:
            j = self.jobs[job] = _Job(WorkloadDetector(self.options_for(job)))
        a = j.assembler
        if a.version != lay.version:
            groups = [g for r in lay.doc.replicas for g in r.groups]
            rec_power = rec.spec.power
            j.speeds = {g.group: rec_power.speed(g.power_ratio) for g in groups}
            a.reset(lay.version, sum(len(g.gpus) for g in groups))
        ready = a.add(samples)
        if not ready:
            return
        j.queue.extend(ready)
        if j.task is None or j.task.done():
            j.task = asyncio.get_running_loop().create_task(self._consume(job, j), name=f"failslow:{job}")

    async def _consume(self, job: str, j: _Job) -> None:
        while j.queue and self.jobs.get(job) is j:
            step, samples = j.queue.popleft()
            obs = observation(step, samples, j.speeds, self.telemetry.signals)
            forget, j.forget = j.forget, set()
            if forget:
                j.detector.forget(forget)  # cheap; between observations, never during one
            try:
                verdicts = await asyncio.to_thread(j.detector.observe, obs)
            except DetectError as e:
                j.refused += 1
                j.last_error = str(e)
                log.warning("fail-slow step refused", job=job, step=step, error=str(e))
                continue
            j.observed += 1
            if verdicts:
                try:
                    await self._act(job, j, verdicts)
                except Exception:  # keep observing; the verdicts are logged with the error
                    log.exception("fail-slow verdicts not applied", job=job, step=step)

    async def drain(self, job: str) -> None:
        """Wait until the job's queued steps are observed (tests, shutdown)."""
        j = self.jobs.get(job)
        while j is not None and j.task is not None and not j.task.done():
            await asyncio.shield(j.task)

    def forget(self, job: str) -> None:
        j = self.jobs.pop(job, None)
        if j is not None and j.task is not None:
            j.task.cancel()

    # ---- acting -------------------------------------------------------------------------------
    async def _act(self, job: str, j: _Job, verdicts: list[Verdict]) -> None:
        docs = [{"job": job, **verdict_dict(v)} for v in verdicts]
        for d, v in zip(docs, verdicts, strict=True):
            log.info("fail-slow verdict", job=job, kind=v.kind, dry_run=v.dry_run, reason=v.reason)
            j.verdicts.append(_brief(d))

        async def write(tx: Tx) -> None:
            for d, v in zip(docs, verdicts, strict=True):
                target = getattr(v, "gpu", None) or f"{job}/{getattr(v, 'group', '')}"
                action = None if v.dry_run else self._apply(tx, v)
                d = {**_brief(d), "action": action or "none"}
                tx.audit(tx.now, f"failslow.{v.kind}", target, after=d, reason=v.reason)

        await self.kernel.submit("failslow", write)

    def _apply(self, tx: Tx, v: Verdict) -> str | None:
        """The GPU change a verdict makes, inside `tx`; returns what was done (None: nothing)."""
        if not isinstance(v, Slow | Recovered) or not tx.has_gpu(v.gpu):
            return None
        rec = tx.gpu(v.gpu)
        mine = rec.health == GpuState.DEGRADED and rec.health_source == HealthSource.DETECTOR
        if isinstance(v, Slow):
            speed = speed_of(v.factor)
            if mine:
                if rec.speed == speed:
                    return None
                tx.change_gpu(v.gpu, GpuChange(speed=speed))
                return f"speed {rec.speed} -> {speed}"
            if rec.health not in (GpuState.HEALTHY, GpuState.SUSPECT):
                return None  # failed, or degraded on an agent's evidence: that verdict stands
            tx.event(rec, GpuState.DEGRADED, [v.reason], source="detector")
            tx.change_gpu(v.gpu, GpuChange(**health_to(GpuState.DEGRADED, v.reason, HealthSource.DETECTOR, tx.now),
                                           speed=speed))
            return f"degraded at speed {speed}"
        if not mine:
            return None
        tx.event(rec, GpuState.HEALTHY, [v.reason], source="detector")
        tx.change_gpu(v.gpu, GpuChange(**health_to(GpuState.HEALTHY, v.reason, HealthSource.DETECTOR, tx.now),
                                       speed=None))
        return "healthy"

    # ---- options ------------------------------------------------------------------------------
    async def set_options(self, tx: Tx, scope: str, changes: Mapping[str, Any], reset: bool = False) -> dict[str, Any]:
        """Change the options of one job (`scope` = its name) or the defaults of every job without
        options of its own (`scope` = "*"), in the caller's transaction; stored whole and audited.
        `reset`: start from the defaults (a job's: the "*" options; "*": the built-in ones), so
        `reset` with no changes drops a job's own options. InvalidArgument naming the field,
        NotFound for an unknown job; nothing changes then."""
        if scope != ALL_JOBS and scope not in self.kernel.world.jobs:
            raise NotFound(f"job: unknown job {scope!r}")
        if reset:
            start = DetectorOptions() if scope == ALL_JOBS else self.options[ALL_JOBS]
        else:
            start = self.options_for(scope)
        try:
            new = start.updated(dict(changes))
        except OptionsError as e:
            raise InvalidArgument(f"options: {e}") from None
        before = self.options_for(scope).as_dict()
        drop = scope != ALL_JOBS and reset and not changes
        row = await tx.session.get(FailSlowOptionsRow, scope)
        if drop:
            if row is not None:
                await tx.session.delete(row)
        elif row is None:
            tx.session.add(FailSlowOptionsRow(scope=scope, options=new.as_dict(), updated_at=tx.now,
                                              updated_by=tx.actor))
        else:
            row.options, row.updated_at, row.updated_by = new.as_dict(), tx.now, tx.actor
        changed = {k: v for k, v in new.as_dict().items() if before[k] != v}
        tx.audit(tx.now, "failslow.options", scope, before={k: before[k] for k in changed},
                 after={**changed, "own_options": not drop})

        def published() -> None:
            if drop:
                self.options.pop(scope, None)
            else:
                self.options[scope] = new
            for name, j in self.jobs.items():
                if scope in (name, ALL_JOBS):
                    j.detector.set_options(self.options_for(name))

        tx.after.append(published)
        return {"scope": scope, "options": new.as_dict(), "changed": changed}

    # ---- views --------------------------------------------------------------------------------
    def view(self, job: str, rec: JobRec | None) -> dict[str, Any]:
        if rec is None:
            raise NotFound(f"unknown job {job!r}")
        j = self.jobs.get(job)
        opts = self.options_for(job)
        out: dict[str, Any] = {"job": job, "options": opts.as_dict(), "dry_run": opts.dry_run,
                               "overridden": job in self.options}
        if j is None:
            return {**out, "observed_steps": 0, "step": None, "ranks": [], "flagged": [], "verdicts": []}
        snap = j.detector.snapshot()
        a = j.assembler
        return {
            **out, "observed_steps": j.observed, "refused_steps": j.refused, "last_error": j.last_error,
            "step": snap.step, "late_samples": a.late, "pending_steps": len(a.pending) + len(j.queue),
            "ranks": [{"gpu": r.gpu, "stage": r.stage, "tp_group": r.group, "factor": r.factor, "slow": r.slow,
                       "since_step": r.since_step, "last_step": r.last_step, "compute_s": r.compute_s,
                       "predicted_s": r.predicted_s} for r in snap.ranks],
            "flagged": sorted(r.gpu for r in snap.ranks if r.slow),
            "imbalanced_groups": list(snap.imbalanced_groups), "network_slow_groups": list(snap.network_slow_groups),
            "ready_stages": list(snap.ready_stages),
            "ready_degrees": [{"stage": s, "tp": t} for s, t in snap.ready_degrees],
            "verdicts": list(reversed(j.verdicts)),
        }


    def dashboard(self, job: str, step_times: Mapping[str, float], limit: int) -> dict[str, Any] | None:
        """The dashboard's part for `job` (None until its detector has seen a step): at most `limit`
        ranks, flagged first, then the highest factors, each with its last step time from
        `step_times` (GPU -> seconds, the workers' reports); the 5 newest verdicts without
        evidence. O(the job's ranks)."""
        j = self.jobs.get(job)
        if j is None:
            return None
        snap = j.detector.snapshot()
        ranks = sorted(snap.ranks, key=lambda r: (not r.slow, -(r.factor or 0.0), r.gpu))
        keys = ("kind", "gpu", "group", "factor", "step", "since_step", "dry_run", "reason")
        return {
            "step": snap.step, "observed_steps": j.observed, "dry_run": self.options_for(job).dry_run,
            "flagged": sorted(r.gpu for r in snap.ranks if r.slow), "ranks_total": len(snap.ranks),
            "ranks": [{"gpu": r.gpu, "stage": r.stage, "tp_group": r.group, "factor": r.factor, "slow": r.slow,
                       "compute_s": r.compute_s, "predicted_s": r.predicted_s, "step_time_s": step_times.get(r.gpu)}
                      for r in ranks[:limit]],
            "verdicts": [{k: v[k] for k in keys if k in v} for v in list(reversed(j.verdicts))[:5]],
        }


def _brief(d: dict[str, Any]) -> dict[str, Any]:
    """A verdict for the API and the audit log: the evidence without the agent's raw sample."""
    ev = d.get("evidence")
    if isinstance(ev, dict):
        d = {**d, "evidence": {k: v for k, v in ev.items() if k != "signals"}}
    return d
