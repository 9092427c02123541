"""What workers tell the manager besides watching: layout acks and step reports, in bounded memory.

- Acks: per job, the newest `ACK_VERSIONS_KEPT` versions, and per version at most
  `workers_cap(job)` distinct worker ids (twice the GPUs the layout places, at least 64): a worker
  token cannot grow the table by inventing ids. An ack must carry the stamp of the layout it
  applied: an older leader epoch is FAILED_PRECONDITION (that layout was overtaken by a restart or
  a failover), a version that never existed is INVALID_ARGUMENT.
- Step reports: each rank's step goes into its job's `StepWindow` (service/core/steps.py: at most
  `STEP_BYTES_PER_JOB` bytes of samples per job, oldest first out), placed by the current layout
  when the report's stamp is that layout. Every number must be finite and non-negative, and each
  list is bounded (`ntp_manager.contract.limits`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from ntp_manager.contract import limits
from ntp_manager.service.core import steps
from ntp_manager.service.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from ntp_manager.service.core.state import LayoutRec
from ntp_manager.service.core.steps import STEP_BYTES_PER_JOB, Place, StepSample, StepWindow

__all__ = ["ACK_VERSIONS_KEPT", "STEP_BYTES_PER_JOB", "WorkerReports", "workers_cap"]

ACK_VERSIONS_KEPT = 4


def workers_cap(layout: LayoutRec) -> int:
    gpus = layout.doc.world_size
    return max(64, 2 * gpus)


class WorkerReports:
    def __init__(self) -> None:
        self.acks: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
        self.steps: dict[str, StepWindow] = {}
        self._caps: dict[str, tuple[int, int]] = {}  # job -> (layout version, cap)
        # job -> ((epoch, version), GPU places in that layout), built off the loop once per version
        self._places: dict[str, tuple[tuple[int, int], asyncio.Future[dict[str, Place]]]] = {}

    def check_ids(self, job: str, worker_id: str) -> None:
        try:
            limits.job_name("job", job)
            if worker_id:
                limits.ident("worker_id", worker_id, limits.WORKER_ID_MAX)
        except limits.LimitError as e:
            raise InvalidArgument(str(e)) from None

    def record_ack(self, job: str, layout: LayoutRec, worker_id: str, epoch: int, version: int, ok: bool,
                   at: str) -> None:
        """Record an ack of (epoch, version) of `job` whose current layout is `layout`."""
        self.check_ids(job, worker_id)
        if epoch < layout.leader_epoch:
            raise FailedPrecondition(
                f"stamp.leader_epoch: layout epoch {epoch} was overtaken; the current layout is "
                f"({layout.leader_epoch}, {layout.version})"
            )
        if epoch > layout.leader_epoch or version > layout.version or version < 1:
            raise InvalidArgument(f"stamp: job {job!r} has no layout ({epoch}, {version})")
        per_job = self.acks.setdefault(job, {})
        per_version = per_job.setdefault(version, {})
        if worker_id not in per_version and len(per_version) >= self._cap(job, layout):
            raise ResourceExhausted(
                f"worker_id: layout {version} of job {job!r} already has acks from "
                f"{len(per_version)} workers, the most it keeps"
            )
        per_version[worker_id] = {"ok": ok, "at": at}
        for old in sorted(per_job)[:-ACK_VERSIONS_KEPT]:
            del per_job[old]

    async def record_steps(self, job: str, layout: LayoutRec | None, worker_id: str, report: Any,
                           now: float) -> list[StepSample]:
        """Keep the ranks of `report` (an ntp.v1.StepReport of `job`, whose current layout is
        `layout`) in the job's window; returns the samples kept. Raises InvalidArgument
        (nothing kept) for a bad field or a stamp newer than the current layout."""
        self.check_ids(job, worker_id)
        steps.check_report(report)
        places = None
        if report.HasField("stamp") and (report.stamp.leader_epoch, report.stamp.version) != (0, 0):
            stamp = (report.stamp.leader_epoch, report.stamp.version)
            if layout is None or stamp > (layout.leader_epoch, layout.version):
                raise InvalidArgument(f"stamp: job {job!r} has no layout {stamp}")
            if stamp == (layout.leader_epoch, layout.version):
                places = await self.places(job, layout)
        samples = steps.samples_of(report, now, places)
        self.window(job).add(samples)
        return samples

    def window(self, job: str) -> StepWindow:
        w = self.steps.get(job)
        if w is None:
            w = self.steps[job] = StepWindow()
        return w

    async def places(self, job: str, layout: LayoutRec) -> dict[str, Place]:
        """Where each GPU serves in `layout`, built once per version in a worker thread."""
        key = (layout.leader_epoch, layout.version)
        cached = self._places.get(job)
        if cached is None or cached[0] != key:
            cached = (key, asyncio.ensure_future(asyncio.to_thread(steps.places_of, layout.doc)))
            self._places[job] = cached
        return await asyncio.shield(cached[1])

    def forget(self, job: str) -> None:
        self.acks.pop(job, None)
        self.steps.pop(job, None)
        self._caps.pop(job, None)
        self._places.pop(job, None)

    def _cap(self, job: str, layout: LayoutRec) -> int:
        cached = self._caps.get(job)
        if cached is None or cached[0] != layout.version:
            cached = (layout.version, workers_cap(layout))
            self._caps[job] = cached
        return cached[1]
