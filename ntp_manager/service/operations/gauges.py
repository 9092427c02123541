"""Gauges: owns the Prometheus gauges that summarise the world (GPUs per state, each job's
replicas, throughput and layout version) and the GPU state counts the API shows.

Counting is O(GPUs + replicas), so a change only marks the gauges stale; they are recounted when
read (a scrape of /metrics, the state counts the API shows), once per read at most and only when
something changed since the last count, in a worker thread over a copy of the record list. Nothing
recounts them on a timer: at 100,000 GPUs a count is 20-30 ms of CPU, and while reports change GPU
states every second a count per monitor tick cost the leader about 8 us per report it applied,
for gauges nobody had read (bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.metrics import Metrics
from ntp_manager.service.core.state import GpuRec, LayoutRec


class Gauges:
    def __init__(self, kernel: Kernel, metrics: Metrics) -> None:
        self.kernel = kernel
        self.metrics = metrics
        self.stale = True
        self.counts: dict[str, int] = {}
        kernel.after_commit.append(self.react)

    def react(self, tx: Tx) -> None:
        if tx.state_changed or tx.shape_changed:
            self.stale = True

    def mark_stale(self) -> None:
        self.stale = True

    async def refresh_async(self) -> None:
        """Recount, in a worker thread, when something changed since the last count."""
        if not self.stale:
            return
        self.stale = False
        self._set(*await asyncio.to_thread(count, list(self.kernel.world.gpus.values()), self._layouts()))

    async def state_counts(self) -> dict[str, int]:
        """GPUs per effective state (states with none left out)."""
        await self.refresh_async()
        return {k: v for k, v in self.counts.items() if v}

    def _layouts(self) -> list[tuple[str, LayoutRec]]:
        return [(j.name, j.layout) for j in self.kernel.world.jobs.values() if j.layout is not None]

    def _set(self, counts: dict[str, int], jobs: list[JobStats]) -> None:
        m = self.metrics
        self.counts = counts
        for state, n in counts.items():
            m.gpus.labels(state).set(n)
        for st in jobs:
            m.replicas.labels(st.job).set(st.replicas)
            m.throughput.labels(st.job).set(st.relative_throughput)
            m.layout_version.labels(st.job).set(st.version)
            for tp, n in st.by_tp.items():
                m.replicas_by_tp.labels(st.job, str(tp)).set(n)


@dataclass(frozen=True)
class JobStats:
    job: str
    version: int
    replicas: int
    relative_throughput: float
    by_tp: dict[int, int]


def count(gpus: list[GpuRec], layouts: list[tuple[str, LayoutRec]]) -> tuple[dict[str, int], list[JobStats]]:
    """GPUs per state and each job's replicas per TP degree: O(GPUs + replicas), for a thread."""
    jobs = []
    for name, lay in layouts:
        by_tp = dict(Counter(lay.doc.replica_tps))
        jobs.append(JobStats(name, lay.version, len(lay.doc.replica_ids), lay.doc.relative_throughput, by_tp))
    return count_states(gpus), jobs


def count_states(gpus: list[GpuRec]) -> dict[str, int]:
    counts: dict[str, int] = dict.fromkeys([s.value for s in GpuState], 0)
    for g in gpus:
        counts[g.state] = counts.get(g.state, 0) + 1
    return counts
