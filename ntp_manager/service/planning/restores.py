"""Restores from checkpoints that workers report: recorded once per layout version.

When no surviving rank holds some unit of the model (or the job resumes), the workers load the
newest verified checkpoint into the new layout (worker/checkpoint/) and say so in their ack of
that layout (`AckLayoutRequest.restored`). Every rank of the layout acks, so the manager sees the
same restore many times; the first report of a layout version (leader epoch, version) is recorded
and the rest are counted as seen:

- an audit row `job.restore` (actor: the reporting worker) with the step, the checkpoint, the
  newer checkpoints passed over and the layout version;
- the layout's reason, in the store and in memory, gets "; workers restored from step S (name)",
  so the layout history says it next to why the layout was made;
- the counter `ntp_checkpoint_restores_total{job}`;
- the job's newest restore, in memory, for the job view and the dashboard.

A report whose step differs from the one recorded for the same version is logged and not recorded
twice (the ranks agree on a checkpoint before loading it, so that is a worker bug, not a second
restore). Memory: the newest `VERSIONS_KEPT` versions per job, dropped with the job (a job
made again under the same name starts afresh).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
from sqlalchemy import update

from ntp_manager.contract import limits
from ntp_manager.service.core.errors import InvalidArgument, NotFound
from ntp_manager.service.core.kernel import Kernel
from ntp_manager.service.core.metrics import Metrics
from ntp_manager.service.core.state import JobRec
from ntp_manager.store.models import LayoutRow

log = structlog.get_logger("ntp.restores")

VERSIONS_KEPT = 4
SKIPPED_MAX = 16  # newer checkpoints a report may list as passed over
STEP_MAX = 2**63 - 1  # what the store's JSON and BIGINT columns hold
CHECKPOINT_NAME_MAX = 64


@dataclass(frozen=True)
class RestoreReport:
    """What a worker says about a restore: the checkpoint's step (training goes on from it), its
    directory name, why the state came from a checkpoint ("" when the job resumed), and the newer
    checkpoints it passed over ("name: why")."""

    step: int
    checkpoint: str
    reason: str = ""
    skipped: tuple[str, ...] = ()

    def check(self) -> RestoreReport:
        """Itself, or InvalidArgument naming the field (`restored.<field>`)."""
        try:
            limits.integer("restored.step", self.step, 0, STEP_MAX)
            limits.ident("restored.checkpoint", self.checkpoint, CHECKPOINT_NAME_MAX)
            limits.text("restored.reason", self.reason)
            if len(self.skipped) > SKIPPED_MAX:
                raise limits.LimitError("restored.skipped", f"lists {len(self.skipped)} checkpoints; the limit is "
                                        f"{SKIPPED_MAX}")
            for i, s in enumerate(self.skipped):
                limits.text(f"restored.skipped[{i}]", s)
        except limits.LimitError as e:
            raise InvalidArgument(str(e)) from None
        return self

    def summary(self) -> str:
        return f"workers restored from step {self.step} ({self.checkpoint})"


class Restores:
    def __init__(self, kernel: Kernel, metrics: Metrics) -> None:
        self.kernel = kernel
        self.metrics = metrics
        # job -> (its record: a job deleted and made again starts afresh, (epoch, version) -> the
        # restore recorded for that version, or being recorded)
        self.recorded: dict[str, tuple[JobRec, dict[tuple[int, int], dict[str, Any]]]] = {}

    def _of(self, job: str) -> dict[tuple[int, int], dict[str, Any]] | None:
        rec = self.kernel.world.jobs.get(job)
        cur = self.recorded.get(job)
        if cur is None or rec is None or cur[0] is not rec:
            return None
        return cur[1]

    def newest(self, job: str) -> dict[str, Any] | None:
        """The newest restore recorded for `job` since this manager started, or None."""
        per_job = self._of(job)
        if not per_job:
            return None
        done = [v for v in per_job.values() if v["recorded"]]
        if not done:
            return None
        newest = max(done, key=lambda v: (v["leader_epoch"], v["version"]))
        return {k: v for k, v in newest.items() if k != "recorded"}

    async def record(self, job: str, worker: str, epoch: int, version: int, report: RestoreReport) -> bool:
        """Record `report` (checked), made by `worker` applying layout (epoch, version) of `job`
        (its ack was accepted, so the version exists). Returns
        True when this call recorded it, False when the version's restore was recorded already."""
        report.check()
        jobs = self.kernel.world.jobs
        for gone in [j for j, (rec, _) in self.recorded.items() if jobs.get(j) is not rec]:
            del self.recorded[gone]
        rec = jobs.get(job)
        if rec is None:
            raise NotFound(f"job: unknown job {job!r}")
        per_job = self.recorded.setdefault(job, (rec, {}))[1]
        key = (epoch, version)
        seen = per_job.get(key)
        if seen is not None:
            if seen["step"] != report.step:
                log.warning("restore reports disagree", job=job, version=version, recorded=seen["step"],
                            reported=report.step, worker=worker)
            return False
        view: dict[str, Any] = {"leader_epoch": epoch, "version": version, "step": report.step,
                                "checkpoint": report.checkpoint, "reason": report.reason,
                                "skipped": list(report.skipped), "worker": worker, "recorded": False}
        per_job[key] = view  # claimed before the first await: concurrent acks of the version stop above
        for old in sorted(per_job)[:-VERSIONS_KEPT]:
            del per_job[old]
        try:
            async with self.kernel.exclusive(f"worker:{worker}" if worker else "worker") as t:
                row = (await t.session.execute(
                    update(LayoutRow)
                    .where(LayoutRow.job == job, LayoutRow.version == version, LayoutRow.leader_epoch == epoch)
                    .values(reason=LayoutRow.reason + "; " + report.summary())
                    .returning(LayoutRow.reason))).scalar_one_or_none()
                t.audit(t.now, "job.restore", job, after={k: view[k] for k in (
                    "leader_epoch", "version", "step", "checkpoint", "skipped")},
                    reason=report.reason or "the job resumed from its newest checkpoint")
                view["at"] = t.now.isoformat()

                def recorded() -> None:
                    view["recorded"] = True
                    cur = self.kernel.world.jobs.get(job)
                    if row is not None and cur is not None and cur.layout is not None \
                            and (cur.layout.leader_epoch, cur.layout.version) == key:
                        cur.layout.reason = row
                    self.metrics.restores.labels(job=job).inc()

                t.after.append(recorded)
        except BaseException:
            if per_job.get(key) is view:  # a later ack of the version may try again
                del per_job[key]
            raise
        log.info("checkpoint restore recorded", job=job, version=version, step=report.step,
                 checkpoint=report.checkpoint, worker=worker)
        return True
