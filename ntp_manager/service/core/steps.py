"""Workers' step reports, kept: a bounded window of recent per-rank samples per job, and the step
time per replica and per stage over that window.

What it owns: for each job, the newest samples (one per rank and reported step) up to
`STEP_BYTES_PER_JOB` bytes of them (oldest dropped first), and running sums per (layout version,
replica) and per (layout version, stage) of the samples in the window, kept exact as samples come
and go (O(1) per sample, nothing recomputed on a read). Replica ids and stages belong to one layout
version, so a summary shows the samples of the version asked for (the current one).

Where a sample's replica and stage come from: when the report's stamp is the job's current layout,
from that layout (the manager's truth; a report that names another stage or replica for the GPU is
refused as mixed up); for an older stamp, from the report's own `stage` / `replica_id`, if given.
The fail-slow detector (issue 21) reads `StepWindow.samples`.
"""

from __future__ import annotations

import math
import sys
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ntp_manager.contract import limits
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.core.errors import InvalidArgument

STEP_BYTES_PER_JOB = 16 * 2**20
STEP_TIME_MAX_S = 1e6
STAGE_MAX = limits.TP_MAX  # stages of a replica: groups_per_replica is bounded the same way
REPLICA_MAX = limits.JOB_GPUS_MAX


@dataclass(frozen=True, slots=True)
class Place:
    """Where a GPU serves in one layout version."""

    replica: int
    stage: int
    group: str
    tp: int


def places_of(doc: LayoutDoc) -> dict[str, Place]:
    """GPU UUID -> its place in a layout. O(the layout's GPUs): call it off the event loop."""
    out: dict[str, Place] = {}
    for r in doc.replicas:
        for g in r.groups:
            place = Place(r.id, g.stage, g.group, g.tp)
            for u in g.gpus:
                out[u] = place
    return out


@dataclass(slots=True)
class StepSample:
    """One rank's step as the manager keeps it. `at` is the manager's clock (seconds since the
    epoch) when the report arrived; `version` the layout version the worker ran (0: not given)."""

    at: float
    version: int
    step: int
    worker: str
    rank: int
    gpu: str
    replica: int | None
    stage: int | None
    group: str
    tp: int
    step_time_s: float
    compute_s: float
    comm_wait_s: float
    tokens: int
    sequence_sq_sum: int
    cost: int = 0  # bytes this sample holds (estimate, strings counted as unshared)

    def view(self) -> dict[str, Any]:
        return {
            "at": self.at, "layout_version": self.version, "step": self.step, "worker": self.worker,
            "rank": self.rank, "gpu": self.gpu, "replica": self.replica, "stage": self.stage,
            "tp_group": self.group, "tp": self.tp, "step_time_s": self.step_time_s, "compute_s": self.compute_s,
            "comm_wait_s": self.comm_wait_s, "tokens": self.tokens, "sequence_sq_sum": self.sequence_sq_sum,
        }


_FLOAT = sys.getsizeof(1.5)
_INT = sys.getsizeof(2**40)


def _cost(s: StepSample) -> int:
    strings = sum(sys.getsizeof(x) for x in (s.worker, s.gpu, s.group))
    return sys.getsizeof(s) + 4 * _FLOAT + 8 * _INT + strings + 16  # + the window's slot for it


@dataclass(slots=True)
class _Sums:
    samples: int = 0
    step_s: float = 0.0
    compute_s: float = 0.0
    comm_wait_s: float = 0.0
    last_step_s: float = 0.0
    last_at: float = 0.0

    def add(self, s: StepSample, sign: int) -> None:
        self.samples += sign
        self.step_s += sign * s.step_time_s
        self.compute_s += sign * s.compute_s
        self.comm_wait_s += sign * s.comm_wait_s
        if sign > 0 and s.at >= self.last_at:
            self.last_step_s, self.last_at = s.step_time_s, s.at

    def view(self) -> dict[str, Any]:
        n = max(1, self.samples)
        return {"samples": self.samples, "mean_step_s": self.step_s / n, "mean_compute_s": self.compute_s / n,
                "mean_comm_wait_s": self.comm_wait_s / n, "last_step_s": self.last_step_s}


@dataclass
class StepWindow:
    """One job's recent step samples, at most `bytes_cap` bytes of them."""

    bytes_cap: int = STEP_BYTES_PER_JOB
    samples: deque[StepSample] = field(default_factory=deque)
    used: int = 0
    dropped: int = 0  # samples pushed out by newer ones, since the window was made
    by_replica: dict[tuple[int, int], _Sums] = field(default_factory=dict)
    by_stage: dict[tuple[int, int], _Sums] = field(default_factory=dict)

    def add(self, items: Iterable[StepSample]) -> None:
        for s in items:
            s.cost = _cost(s)
            while self.samples and self.used + s.cost > self.bytes_cap:
                self._drop(self.samples.popleft())
            self.samples.append(s)
            self.used += s.cost
            self._account(s, +1)

    def _drop(self, s: StepSample) -> None:
        self.used -= s.cost
        self.dropped += 1
        self._account(s, -1)

    def _account(self, s: StepSample, sign: int) -> None:
        for table, key in ((self.by_replica, s.replica), (self.by_stage, s.stage)):
            if key is None:
                continue
            k = (s.version, key)
            sums = table.get(k)
            if sums is None:
                sums = table[k] = _Sums()
            sums.add(s, sign)
            if sums.samples == 0:
                del table[k]  # exact zero again: nothing left of that key in the window

    def per_replica(self, version: int) -> dict[int, dict[str, Any]]:
        return {r: v.view() for (ver, r), v in sorted(self.by_replica.items()) if ver == version}

    def per_stage(self, version: int) -> dict[int, dict[str, Any]]:
        return {st: v.view() for (ver, st), v in sorted(self.by_stage.items()) if ver == version}

    def last_step_times(self, version: int, limit: int) -> dict[str, float]:
        """GPU -> step time of its newest sample at layout `version`, reading at most `limit` of the
        newest samples (the dashboard's per-rank step time; bounded whatever the window holds)."""
        out: dict[str, float] = {}
        for i, s in enumerate(reversed(self.samples)):
            if i >= limit:
                break
            if s.version == version and s.gpu not in out:
                out[s.gpu] = s.step_time_s
        return out

    def summary(self, version: int, recent: int) -> dict[str, Any]:
        newest = list(self.samples)[-recent:] if recent > 0 else []
        return {
            "layout_version": version,
            "window": {"samples": len(self.samples), "bytes": self.used, "bytes_cap": self.bytes_cap,
                       "dropped": self.dropped},
            "replicas": [{"replica": r, **v} for r, v in self.per_replica(version).items()],
            "stages": [{"stage": st, **v} for st, v in self.per_stage(version).items()],
            "recent": [s.view() for s in reversed(newest)],
        }


def check_report(report: Any) -> None:
    """Bounds of an ntp.v1.StepReport: InvalidArgument naming the first bad field."""
    try:
        limits.integer("ranks (count)", len(report.ranks), 0, limits.RANKS_PER_STEP_REPORT)
        for i, r in enumerate(report.ranks):
            for name in ("step_time_s", "compute_s", "comm_wait_s"):
                v = getattr(r, name)
                if not (math.isfinite(v) and 0 <= v <= STEP_TIME_MAX_S):
                    raise InvalidArgument(
                        f"ranks[{i}].{name}: must be a finite number in [0, {STEP_TIME_MAX_S:g}], got {v}"
                    )
            if r.gpu_uuid:
                limits.ident(f"ranks[{i}].gpu_uuid", r.gpu_uuid, limits.GPU_ID_MAX)
            if r.tp_group_id:
                limits.ident(f"ranks[{i}].tp_group_id", r.tp_group_id, limits.DOMAIN_MAX + 16)
            limits.integer(f"ranks[{i}].tp", r.tp, 0, limits.TP_MAX)
            if r.HasField("stage"):
                limits.integer(f"ranks[{i}].stage", r.stage, 0, STAGE_MAX)
            if r.HasField("replica_id"):
                limits.integer(f"ranks[{i}].replica_id", r.replica_id, 0, REPLICA_MAX)
            limits.integer(f"ranks[{i}].sequence_lengths (count)", len(r.sequence_lengths), 0,
                           limits.SEQUENCES_PER_RANK)
            if r.tokens > 0 and r.sequence_sq_sum > r.tokens * r.tokens:
                # sum(len^2) <= (sum len)^2: anything above means the fields were mixed up
                raise InvalidArgument(f"ranks[{i}].sequence_sq_sum: {r.sequence_sq_sum} exceeds tokens^2 "
                                      f"({r.tokens}^2)")
    except limits.LimitError as e:
        raise InvalidArgument(str(e)) from None


def samples_of(report: Any, at: float, places: Mapping[str, Place] | None) -> list[StepSample]:
    """The samples of a checked report. `places` is the layout of the report's stamp when that is
    the current one (else None: the report's own stage and replica are used). InvalidArgument when
    the report places a GPU elsewhere than the layout does."""
    out = []
    version = int(report.stamp.version) if report.HasField("stamp") else 0
    for i, r in enumerate(report.ranks):
        stage = r.stage if r.HasField("stage") else None
        replica = r.replica_id if r.HasField("replica_id") else None
        group, tp = r.tp_group_id, r.tp
        place = places.get(r.gpu_uuid) if places is not None else None
        if place is not None:
            for name, said, truth in (("stage", stage, place.stage), ("replica_id", replica, place.replica),
                                      ("tp_group_id", group or None, place.group),
                                      ("tp", tp or None, place.tp)):
                if said is not None and said != truth:
                    raise InvalidArgument(
                        f"ranks[{i}].{name}: GPU {r.gpu_uuid} has {name} {truth!r} in layout {version}, "
                        f"the report says {said!r}"
                    )
            stage, replica, group, tp = place.stage, place.replica, place.group, place.tp
        out.append(StepSample(at, version, int(report.step), report.worker_id, r.rank, r.gpu_uuid, replica, stage,
                              group, tp, r.step_time_s, r.compute_s, r.comm_wait_s, r.tokens, r.sequence_sq_sum))
    return out
