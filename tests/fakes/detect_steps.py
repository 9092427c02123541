"""A small step builder for the fail-slow detector tests: exact times from a known cost model.

Every TP group gets random (seeded) work each step; a rank's compute time is
    ((a * tokens + b * sumsq) / tp + c) * jitter * slow-factor / speed-boost
and its wait is (slowest member's compute - its own) + transfer, the transfer being
net * tokens * (tp - 1) / tp times the group's network factor. Stages, TP degree and replicas are
set per builder; `tp_of` gives a group its own degree (NTP: a reduced group).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import numpy as np

from ntp_manager.detect import GpuSignals, RankObservation, StepObservation

A = 2e-6
B = A / 8192
C = 0.003
NET = 0.2 * A
_NONE: Mapping[str, float] = MappingProxyType({})
_NO_SIGNALS: Mapping[str, GpuSignals] = MappingProxyType({})


def gpu(stage: int, replica: int, rank: int) -> str:
    return f"G{stage}.{replica}.{rank}"


def group(stage: int, replica: int) -> str:
    return f"s{stage}r{replica}"


@dataclass
class Steps:
    stages: int = 2
    tp: int = 4
    dp: int = 4
    jitter: float = 0.02
    seed: int = 0
    tp_of: dict[str, int] = field(default_factory=dict)
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)

    def work(self, heavy: float = 1.0) -> tuple[int, float]:
        """Tokens and sum(len^2) of 8 packed micro-batches; `heavy` scales the typical length."""
        lens = np.clip(self.rng.lognormal(np.log(600 * heavy), 1.2, (8, 64)), 16, 8192).round()
        fits = np.cumsum(lens, axis=1) <= 8192  # each micro-batch takes the prefix that fits
        fits[:, 0] = True
        return int((lens * fits).sum()), float((lens**2 * fits).sum())

    def make(
        self,
        step: int,
        *,
        slow: Mapping[str, float] = _NONE,  # gpu -> time factor (1.3: 30% slower)
        heavy: Mapping[str, float] = _NONE,  # group -> typical sequence length x this
        net: Mapping[str, float] = _NONE,  # group -> transfer time x this
        speed: Mapping[str, float] = _NONE,  # gpu -> speed the plan expects (boost)
        actual_speed: Mapping[str, float] = _NONE,  # gpu -> speed it really has (default: as expected)
        signals: Mapping[str, GpuSignals] = _NO_SIGNALS,
        absent: frozenset[str] = frozenset(),
    ) -> StepObservation:
        ranks: list[RankObservation] = []
        for s in range(self.stages):
            for r in range(self.dp):
                g = group(s, r)
                tp = self.tp_of.get(g, self.tp)
                tokens, sumsq = self.work(heavy.get(g, 1.0))
                base = (A * (1 + 0.1 * s) * tokens + B * sumsq) / tp + C
                jit = self.rng.lognormal(0, self.jitter, tp).tolist()
                times = []
                for k in range(tp):
                    u = gpu(s, r, k)
                    sp = actual_speed.get(u, speed.get(u, 1.0))
                    times.append(base * jit[k] * slow.get(u, 1.0) / sp)
                transfer = NET * tokens * (tp - 1) / tp * net.get(g, 1.0) * self.rng.lognormal(0, 0.03)
                top = max(times)
                for k in range(tp):
                    u = gpu(s, r, k)
                    if u in absent:
                        continue
                    ranks.append(
                        RankObservation(
                            gpu=u, stage=s, group=g, tp=tp, compute_s=times[k], comm_wait_s=top - times[k] + transfer,
                            tokens=tokens, sumsq=sumsq, speed=speed.get(u, 1.0), signals=signals.get(u),
                        )
                    )
        return StepObservation(step, tuple(ranks))
