"""Gauges: owns the Prometheus gauges that summarise the world (GPUs per state, each job's
replicas, throughput and layout version) and the GPU state counts the API shows.

Counting is O(GPUs), so a change only marks the gauges stale; they are recounted at most once per
monitor tick and on a scrape, in a worker thread over a copy of the record list.
"""

from __future__ import annotations

import asyncio

from ntp_manager.service.kernel import Kernel, Tx
from ntp_manager.service.metrics import Metrics
from ntp_manager.service.state import GpuRec
from ntp_manager.topology import GpuState


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
        self._set(await asyncio.to_thread(count_states, list(self.kernel.world.gpus.values())))

    def refresh(self) -> None:
        if not self.stale:
            return
        self.stale = False
        self._set(count_states(list(self.kernel.world.gpus.values())))

    async def state_counts(self) -> dict[str, int]:
        """GPUs per effective state (states with none left out)."""
        await self.refresh_async()
        return {k: v for k, v in self.counts.items() if v}

    def _set(self, counts: dict[str, int]) -> None:
        m = self.metrics
        self.counts = counts
        for state, n in counts.items():
            m.gpus.labels(state).set(n)
        for job in self.kernel.world.jobs.values():
            lay = job.layout
            if lay is None:
                continue
            reps = lay.plan["replicas"]
            m.replicas.labels(job.name).set(len(reps))
            m.throughput.labels(job.name).set(lay.plan["relative_throughput"])
            m.layout_version.labels(job.name).set(lay.version)
            by_tp: dict[int, int] = {}
            for r in reps:
                by_tp[r["tp"]] = by_tp.get(r["tp"], 0) + 1
            for tp, n in by_tp.items():
                m.replicas_by_tp.labels(job.name, str(tp)).set(n)


def count_states(gpus: list[GpuRec]) -> dict[str, int]:
    counts: dict[str, int] = dict.fromkeys([s.value for s in GpuState], 0)
    for g in gpus:
        counts[g.state] = counts.get(g.state, 0) + 1
    return counts
