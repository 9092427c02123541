"""Scoring a detector on a simulated trace against its ground truth.

Counting rules (per trace, then summed over traces):
- Each (GPU, injected slowdown) pair is one positive. It is *detected* when the detector issues a
  first `Slow` for that GPU between the slowdown's start and its end plus a grace of
  `grace` steps; the delay is the verdict's step minus the start.
- A first `Slow` for a GPU anywhere else is a *false alarm*, attributed to what was going on:
  an injected data imbalance or network slowness covering the GPU, or nothing (noise, transients).
- A `Slow` for a GPU that is already detected for the same slowdown (after it let go too early) is
  a *re-flag* and counted with the flaps, not as a new detection; a `Recovered` while the GPU is
  still slow is a *flap*.
- Precision = detections / (detections + false alarms); recall = detections / positives; false
  alarms per 1,000 steps over all steps of all traces.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from ntp_manager.detect.simulate import Episode, Trace
from ntp_manager.detect.types import StepObservation
from ntp_manager.detect.verdicts import Cleared, Imbalance, NetworkSlow, Recovered, Slow, Verdict


class Observer(Protocol):
    def observe(self, obs: StepObservation) -> list[Verdict]: ...


@dataclass(slots=True)
class Score:
    steps: int = 0
    positives: int = 0
    detected: int = 0
    false_alarms: int = 0
    false_by_cause: dict[str, int] = field(default_factory=dict)
    delays: list[int] = field(default_factory=list)
    flaps: int = 0
    reflags: int = 0
    group_scope_right: int = 0  # detected GPUs whose verdict scope matched the injected scope
    imbalance_injected: int = 0
    imbalance_found: int = 0
    imbalance_verdicts: int = 0
    network_injected: int = 0
    network_found: int = 0
    network_verdicts: int = 0

    def add(self, o: Score) -> None:
        for name in (
            "steps", "positives", "detected", "false_alarms", "flaps", "reflags", "group_scope_right",
            "imbalance_injected", "imbalance_found", "imbalance_verdicts", "network_injected", "network_found",
            "network_verdicts",
        ):
            setattr(self, name, getattr(self, name) + getattr(o, name))
        for k, v in o.false_by_cause.items():
            self.false_by_cause[k] = self.false_by_cause.get(k, 0) + v
        self.delays.extend(o.delays)

    @property
    def precision(self) -> float:
        total = self.detected + self.false_alarms
        return self.detected / total if total else 1.0

    @property
    def recall(self) -> float:
        return self.detected / self.positives if self.positives else 1.0

    @property
    def false_per_1k(self) -> float:
        return 1000.0 * self.false_alarms / self.steps if self.steps else 0.0

    def delay_quantile(self, q: float) -> float:
        if not self.delays:
            return math.nan
        d = sorted(self.delays)
        return float(d[min(len(d) - 1, math.ceil(q * len(d)) - 1)])


def score(detector: Observer, trace: Trace, *, grace: int = 20) -> Score:
    """Run `detector` over the trace and count (see the module docstring)."""
    slow_eps = [e for e in trace.episodes if e.kind == "slow"]
    other = [e for e in trace.episodes if e.kind != "slow"]
    by_gpu: dict[str, list[Episode]] = {}
    for e in slow_eps:
        for g in e.gpus:
            by_gpu.setdefault(g, []).append(e)
    sc = Score(steps=trace.spec.steps, positives=sum(len(e.gpus) for e in slow_eps))
    sc.imbalance_injected = sum(1 for e in other if e.kind == "imbalance")
    sc.network_injected = sum(1 for e in other if e.kind == "network")
    found: set[tuple[str, int]] = set()  # (gpu, episode start)
    found_other: set[int] = set()
    for obs in trace.observations():
        for v in detector.observe(obs):
            if isinstance(v, Slow) and not v.update:
                ep = _match(by_gpu.get(v.gpu, ()), v.step, grace)
                if ep is None:
                    sc.false_alarms += 1
                    cause = _cause(other, v.gpu, v.step)
                    sc.false_by_cause[cause] = sc.false_by_cause.get(cause, 0) + 1
                elif (v.gpu, ep.start) in found:
                    sc.reflags += 1
                else:
                    found.add((v.gpu, ep.start))
                    sc.detected += 1
                    sc.delays.append(v.step - ep.start)
                    if str(v.scope) == ep.scope:
                        sc.group_scope_right += 1
            elif isinstance(v, Recovered):
                ep = _match(by_gpu.get(v.gpu, ()), v.step, 0)
                if ep is not None and v.step < ep.end:
                    sc.flaps += 1
            elif isinstance(v, Imbalance | NetworkSlow):
                kind = "imbalance" if isinstance(v, Imbalance) else "network"
                if kind == "imbalance":
                    sc.imbalance_verdicts += 1
                else:
                    sc.network_verdicts += 1
                for i, e in enumerate(other):
                    hit = e.kind == kind and v.group in e.groups and e.start <= v.step <= e.end + grace
                    if hit and i not in found_other:
                        found_other.add(i)
                        if kind == "imbalance":
                            sc.imbalance_found += 1
                        else:
                            sc.network_found += 1
            elif isinstance(v, Cleared):
                pass
    return sc


def _match(eps: Iterable[Episode], step: int, grace: int) -> Episode | None:
    for e in eps:
        if e.start <= step <= e.end + grace:
            return e
    return None


def _cause(other: list[Episode], gpu: str, step: int) -> str:
    for e in other:
        if gpu in e.gpus and e.start <= step <= e.end + 20:
            return e.kind
    return "noise"
