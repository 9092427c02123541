"""Power: owns the cap each GPU should hold (`desired_mw`) and getting it to the agents.

The caps come from the current layouts (boosted groups, planner/power.py) and, under a fleet base
cap, every other GPU's base limit. `stage()` writes the caps that differ into a transaction (the
layout that is being persisted is passed in, as it is not in memory yet); after any commit that
changed a GPU's desired cap, the agent of its node is sent the new cap (or told to release it).
Agents that are not connected get every cap when they reconnect (service/ingest/agents.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence

import structlog

from ntp_manager.contract.power import base_cap_w
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.core import offloop
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.state import GpuChange
from ntp_manager.service.ingest.agents import Agents, ReleasePower, SetPower
from ntp_manager.settings import Settings

log = structlog.get_logger("ntp.power")

STAGE_SLICE = 2000  # cap changes written into a transaction between two turns of the event loop


class Power:
    def __init__(self, kernel: Kernel, settings: Settings, agents: Agents) -> None:
        self.kernel = kernel
        self.base_cap = settings.power_base_cap
        self.agents = agents
        self._tasks: set[asyncio.Task[None]] = set()
        kernel.after_commit.append(self.react)

    async def stage(self, tx: Tx, pending: Mapping[str, LayoutDoc] | None = None,
                    capped_by: Sequence[LayoutDoc] | None = None) -> int:
        """Write every GPU's desired cap that differs from what it holds; `pending` maps a job to
        the layout being persisted in `tx`. With `capped_by`, only the GPUs those layouts cap are
        looked at (a new layout of one job and the one it replaces: every other GPU's cap is
        unchanged), else every GPU. Returns how many changed.

        Which caps differ is worked out in a worker thread (O(the GPUs looked at + every job's
        capped GPUs): 100K GPUs for a job's first layout or a recompute); the loop then writes the
        changes into `tx`, yielding every STAGE_SLICE of them. The caller holds `tx`, so nothing
        else changes a GPU's cap meanwhile."""
        w = self.kernel.world
        docs = []
        for job in list(w.jobs.values()):
            doc = (pending or {}).get(job.name) or (job.layout.doc if job.layout else None)
            if doc is not None:
                docs.append(doc)
        every = list(w.gpus) if capped_by is None else None  # a C-level copy of the keys
        changes = await offloop.run(self._differing, tx, docs, every, capped_by)
        for i, (u, want) in enumerate(changes):
            tx.change_gpu(u, GpuChange(desired_mw=want))
            if i % STAGE_SLICE == STAGE_SLICE - 1:
                await asyncio.sleep(0)
        return len(changes)

    def _differing(self, tx: Tx, docs: list[LayoutDoc], every: list[str] | None,
                   capped_by: Sequence[LayoutDoc] | None) -> list[tuple[str, int | None]]:
        """(GPU, the cap it should hold) for each GPU looked at (`every`, else those `capped_by`
        cap) that holds another."""
        looked_at: Iterable[str] = (every if every is not None
                                    else set().union(*(d.power_caps_w for d in capped_by or ())))
        caps: dict[str, int] = {}
        for doc in docs:
            for u, watts in doc.power_caps_w.items():
                caps[u] = int(watts * 1000)
        out: list[tuple[str, int | None]] = []
        for u in looked_at:
            rec = tx.gpu(u)
            want = caps.get(u)
            if want is None and self.base_cap is not None:  # under a base cap every other GPU runs at its base
                want = int(base_cap_w(rec.min_mw, rec.tdp_mw, rec.max_mw, self.base_cap))
            if want != rec.desired_mw:
                out.append((u, want))
        return out

    def react(self, tx: Tx) -> None:
        """After a commit: send the caps it changed; new GPUs under a base cap get theirs."""
        w = self.kernel.world
        for u, change in tx.gpu_changes():
            if "desired_mw" not in change:
                continue
            want = change["desired_mw"]
            node = w.gpus[u].node
            if want is None:
                self.agents.send(node, ReleasePower(u))
            else:
                self.agents.send(node, SetPower(u, want, "layout power cap"))
        if tx.shape_changed and self.base_cap is not None:
            self.recompute_later()

    def recompute_later(self) -> None:
        """Recompute every cap in a transaction of its own, soon (after a job is deleted, GPUs are
        added, or the base cap changed since the last start)."""
        async def run() -> None:
            try:
                async with self.kernel.exclusive("control-loop") as tx:
                    await self.stage(tx)
            except Exception:
                log.exception("power recompute failed")

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
