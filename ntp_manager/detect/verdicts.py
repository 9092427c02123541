"""What the fail-slow detectors conclude, with the evidence behind it.

Verdicts are events, issued when something changes, not every step:
- `Slow`: a GPU became slow (`update=False`), or a flagged GPU's factor moved by more than the
  `factor_update` option (`update=True`, same `since_step`).
- `Recovered`: a flagged GPU is back under the exit threshold.
- `Imbalance` / `NetworkSlow`: a TP group is given persistently more work than its stage's peers
  (the data, not the GPU), or its own collectives are persistently slower than predicted (the
  links, not the GPU). `Cleared` ends either.

`factor` is a time factor: 1.25 means the GPU takes 25% longer than a healthy one for the same
work; its speed factor (what the planner wants) is 1 / factor. Every verdict carries `dry_run`, the
mode it was made under: a consumer logs dry-run verdicts and acts on none of them.
`verdict_dict` gives a JSON-ready view for the audit log and the API.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from ntp_manager.detect.types import GpuSignals


class Scope(StrEnum):
    GPU = "gpu"  # the GPU is slower than its own TP peers doing the same work
    GROUP = "group"  # every member of its TP group is slow alike (a node-level cause is likely)


@dataclass(frozen=True, slots=True)
class SlowEvidence:
    """Why the workload-aware detector called a GPU slow (values of the deciding step unless noted)."""

    observed_s: float  # compute seconds
    predicted_s: float  # healthy prediction for the same work, after peer normalisation
    factors: tuple[float, ...]  # the step factors the verdict rests on, oldest first
    baseline: float  # the GPU's own usual pace relative to its peers before it turned (1 +- limit)
    vs_tp_peers: float | None  # median over those steps of compute / its TP group's median (None: tp 1)
    vs_stage_raw: float  # compute / median compute of the job (what a time-only detector sees)
    comm_wait_s: float
    peers_comm_wait_s: float | None  # median wait of the other TP members: they wait for a slow GPU
    tokens: int
    sumsq: float
    signals: GpuSignals | None
    notes: tuple[str, ...]  # the signals read as causes (throttling, clocks, power, temperature)


@dataclass(frozen=True, slots=True)
class ZScoreEvidence:
    """Why the time-only baseline called a GPU slow."""

    observed_s: float
    stage_median_s: float
    z: tuple[float, ...]  # robust z-scores the verdict rests on, oldest first


@dataclass(frozen=True, slots=True)
class Slow:
    kind: ClassVar[str] = "slow"
    gpu: str
    stage: int
    group: str
    factor: float
    since_step: int  # estimated onset: first step above the threshold in the deciding window
    step: int  # the step at which the verdict was made
    scope: Scope
    update: bool
    dry_run: bool
    reason: str
    evidence: SlowEvidence | ZScoreEvidence

    @property
    def speed(self) -> float:
        return 1.0 / self.factor


@dataclass(frozen=True, slots=True)
class Recovered:
    kind: ClassVar[str] = "recovered"
    gpu: str
    stage: int
    group: str
    factor: float  # median factor over the exit window
    since_step: int  # when the slowdown it recovered from began
    step: int
    dry_run: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Imbalance:
    kind: ClassVar[str] = "imbalance"
    group: str
    stage: int
    work_factor: float  # the group's predicted time / its stage's median predicted time
    time_factor: float  # its observed time / its stage's median observed time
    model_factor: float  # observed / predicted for its members (about 1: the work explains the time)
    since_step: int
    step: int
    dry_run: bool
    reason: str


@dataclass(frozen=True, slots=True)
class NetworkSlow:
    kind: ClassVar[str] = "network"
    group: str
    stage: int
    factor: float  # the group's own transfer time / prediction, relative to its peers
    since_step: int
    step: int
    comm_s: float  # the group's transfer time this step (least wait among its members)
    predicted_s: float
    dry_run: bool
    reason: str


@dataclass(frozen=True, slots=True)
class Cleared:
    kind: ClassVar[str] = "cleared"
    what: str  # "imbalance" or "network"
    group: str
    stage: int
    factor: float
    since_step: int
    step: int
    dry_run: bool
    reason: str


Verdict = Slow | Recovered | Imbalance | NetworkSlow | Cleared


def verdict_dict(v: Verdict) -> dict[str, object]:
    """JSON-ready: the fields plus `kind`; frozensets become sorted lists."""

    def clean(x: object) -> object:
        if isinstance(x, dict):
            return {k: clean(val) for k, val in x.items()}
        if isinstance(x, list | tuple):
            return [clean(i) for i in x]
        if isinstance(x, frozenset | set):
            return sorted(str(i) for i in x)
        if isinstance(x, StrEnum):
            return str(x)
        return x

    out = clean(dataclasses.asdict(v))
    assert isinstance(out, dict)
    return {"kind": v.kind, **out}
