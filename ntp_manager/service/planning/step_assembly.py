"""Assembling workers' step samples into whole steps for the fail-slow detector (issue 21).

Workers report their own ranks, one report per step each; the detector needs a step's ranks
together (it compares peers). `StepAssembler` buffers samples by step and releases a step, in
increasing order, once every rank the layout places has reported it, or once `max_pending` newer
steps are waiting (a rank that stopped reporting must not hold the detector back). A sample for a
step already released is late and dropped (counted). Only samples placed by the job's current
layout are kept (stage, TP group and degree known); a new layout version starts afresh.

`observation(step, samples, speeds, signals)` turns a released step into the detector's
`StepObservation`. Pure apart from memory; no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ntp_manager.detect import GpuSignals, RankObservation, StepObservation
from ntp_manager.service.core.steps import StepSample

MAX_PENDING = 8  # steps waiting for missing ranks before the oldest is released anyway


@dataclass
class StepAssembler:
    version: int = 0  # layout version the buffered samples belong to
    expected: int = 0  # ranks that layout places
    max_pending: int = MAX_PENDING
    pending: dict[int, dict[str, StepSample]] = field(default_factory=dict)
    released: int = -1  # newest step released
    late: int = 0  # samples dropped: their step was released already
    foreign: int = 0  # samples dropped: another layout version, or not placed

    def reset(self, version: int, expected: int) -> None:
        """A new layout: drop what is buffered; steps restart their count from the next one seen."""
        self.version, self.expected = version, expected
        self.pending.clear()

    def add(self, samples: list[StepSample]) -> list[tuple[int, list[StepSample]]]:
        """Buffer samples; return the steps now complete (or pushed out), oldest first."""
        for s in samples:
            if s.version != self.version or s.stage is None or not s.group or s.tp < 1:
                self.foreign += 1
                continue
            if s.step <= self.released:
                self.late += 1
                continue
            self.pending.setdefault(s.step, {})[s.gpu] = s  # a repeated report of a rank: the newest
        out: list[tuple[int, list[StepSample]]] = []
        complete = [st for st, got in self.pending.items() if self.expected and len(got) >= self.expected]
        upto = max(complete, default=-1)
        for st in sorted(self.pending):
            if st <= upto or len(self.pending) > self.max_pending:
                out.append((st, list(self.pending.pop(st).values())))
                self.released = max(self.released, st)
        return out


def observation(step: int, samples: list[StepSample], speeds: Mapping[str, float],
                signals: Callable[[str], GpuSignals | None]) -> StepObservation:
    """The detector's view of one step. `speeds`: TP group id -> the speed the plan expects of its
    GPUs (power boost), 1.0 when absent. Ranks that measured no compute time or reported no tokens
    are passed on as they are (the detector skips ranks without work)."""
    ranks = tuple(
        RankObservation(
            gpu=s.gpu, stage=int(s.stage or 0), group=s.group, tp=s.tp, compute_s=s.compute_s,
            comm_wait_s=s.comm_wait_s, tokens=s.tokens, sumsq=float(s.sequence_sq_sum),
            speed=speeds.get(s.group, 1.0), signals=signals(s.gpu),
        )
        for s in sorted(samples, key=lambda x: x.rank)
    )
    return StepObservation(step, ranks)
