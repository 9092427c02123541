"""What workers tell the manager besides watching: layout acks and step reports, in bounded memory.

- Acks: per job, the newest `ACK_VERSIONS_KEPT` versions, and per version at most
  `workers_cap(job)` distinct worker ids (twice the GPUs the layout places, at least 64): a worker
  token cannot grow the table by inventing ids. An ack must carry the stamp of the layout it
  applied: an older leader epoch is FAILED_PRECONDITION (that layout was overtaken by a restart or
  a failover), a version that never existed is INVALID_ARGUMENT.
- Step reports: the newest report per (job, worker), at most `STEP_BYTES_PER_JOB` bytes of them per
  job; the least recently updated worker's report goes first. Every number must be finite and
  non-negative, and each list is bounded (`ntp_manager.limits`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from ntp_manager import limits
from ntp_manager.service.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from ntp_manager.service.state import LayoutRec

ACK_VERSIONS_KEPT = 4
STEP_BYTES_PER_JOB = 16 * 2**20
STEP_TIME_MAX_S = 1e6


def workers_cap(layout: LayoutRec) -> int:
    gpus = sum(len(g["gpus"]) for r in layout.plan["replicas"] for g in r["groups"])
    return max(64, 2 * gpus)


class WorkerReports:
    def __init__(self) -> None:
        self.acks: dict[str, dict[int, dict[str, dict[str, Any]]]] = {}
        self.steps: dict[str, OrderedDict[str, tuple[int, Any]]] = {}
        self._step_bytes: dict[str, int] = {}
        self._caps: dict[str, tuple[int, int]] = {}  # job -> (layout version, cap)

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

    def record_steps(self, job: str, worker_id: str, report: Any) -> None:
        """Keep `report` (an ntp.v1.StepReport) as the newest of this worker. Raises InvalidArgument."""
        self.check_ids(job, worker_id)
        try:
            limits.integer("ranks (count)", len(report.ranks), 0, limits.RANKS_PER_STEP_REPORT)
            for i, r in enumerate(report.ranks):
                if not (math.isfinite(r.step_time_s) and 0 <= r.step_time_s <= STEP_TIME_MAX_S):
                    raise InvalidArgument(
                        f"ranks[{i}].step_time_s: must be a finite number in [0, {STEP_TIME_MAX_S:g}], "
                        f"got {r.step_time_s}"
                    )
                if r.gpu_uuid:
                    limits.ident(f"ranks[{i}].gpu_uuid", r.gpu_uuid, limits.GPU_ID_MAX)
                limits.integer(f"ranks[{i}].sequence_lengths (count)", len(r.sequence_lengths), 0,
                               limits.SEQUENCES_PER_RANK)
        except limits.LimitError as e:
            raise InvalidArgument(str(e)) from None
        size = report.ByteSize()
        window = self.steps.setdefault(job, OrderedDict())
        used = self._step_bytes.get(job, 0)
        old = window.pop(worker_id, None)
        if old is not None:
            used -= old[0]
        while window and used + size > STEP_BYTES_PER_JOB:
            _, (n, _) = window.popitem(last=False)
            used -= n
        window[worker_id] = (size, report)
        self._step_bytes[job] = used + size

    def forget(self, job: str) -> None:
        self.acks.pop(job, None)
        self.steps.pop(job, None)
        self._step_bytes.pop(job, None)
        self._caps.pop(job, None)

    def _cap(self, job: str, layout: LayoutRec) -> int:
        cached = self._caps.get(job)
        if cached is None or cached[0] != layout.version:
            cached = (layout.version, workers_cap(layout))
            self._caps[job] = cached
        return cached[1]
