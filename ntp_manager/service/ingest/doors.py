"""The doors the gRPC edge comes in by: what an agent stream and a layout watch ask of a manager.

rpc/ (agents.py, workers.py) speaks to two narrow interfaces, `AgentDoor` and `WatchDoor`, and
never asks which store or role the manager has. One pair serves both stores, every manager
(standbys included), through the fleet (service/leadership/fleet.py): hellos and reports are
checked and handed to the outbox for the leader to apply (service/ingest/outbox.py; the outbox
port, service/ingest/port.py, is the table several managers share on PostgreSQL, or memory for one
manager alone on SQLite), watches follow the layouts of the layout feed (service/feed/layouts.py),
and acks and step reports are applied at once on the leader, stored for it by any other manager.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ntp_manager.auth import Principal
from ntp_manager.service.core.errors import InvalidArgument
from ntp_manager.service.core.inputs import GpuInventory, GpuReport
from ntp_manager.service.core.state import LayoutRec
from ntp_manager.service.ingest.agents import AgentSession
from ntp_manager.service.planning.restores import RestoreReport, Restores

if TYPE_CHECKING:
    from ntp_manager.service.feed.layouts import Held
    from ntp_manager.service.leadership.fleet import Fleet
    from ntp_manager.service.planning.failslow import FailSlow
    from ntp_manager.service.planning.jobs import Jobs


class AgentDoor(Protocol):
    """An agent's stream: its hello, heartbeats, reports, power read-backs and its end."""

    async def hello(self, node: str, domain: str, gpus: list[GpuInventory], boot_id: str, agent_version: str,
                    principal: Principal, fingerprint: str | None, peer: str
                    ) -> tuple[AgentSession, int, int]:
        """The session, the last report seq that is durable, and the leader epoch to welcome it with."""
        ...

    def heartbeat(self, node: str, gpus: Any) -> None: ...

    def report(self, session: AgentSession, seq: int, gpus: list[GpuReport]) -> asyncio.Future[int]:
        """Resolves to the seq to acknowledge once the report is durable."""
        ...

    async def power(self, node: str, readings: list[tuple[str, int]]) -> None: ...

    def disconnected(self, session: AgentSession) -> None: ...


class WatchDoor(Protocol):
    """A worker's layout watch, its acks and its step reports."""

    async def check(self, job: str, gpu: str) -> None:
        """NotFound for an unknown job, InvalidArgument for a GPU this cluster does not have."""
        ...

    async def wait(self, job: str, newer_than: tuple[int, int], stop: Callable[[], bool]) -> LayoutRec | None:
        """A layout of `job` newer than `newer_than`; None when closing or `stop()`."""
        ...

    def hold(self) -> Held | None:
        """A watch's place in the balance (None where nothing balances watches)."""
        ...

    def release(self, held: Held | None) -> None: ...

    def wake_all(self) -> None:
        """Every waiting watch looks at its `stop` again (a token was revoked)."""
        ...

    async def ack(self, job: str, worker: str, epoch: int, version: int, ok: bool,
                  restored: RestoreReport | None) -> LayoutRec:
        """Record a worker's ack (and the restore it made); the job's current layout."""
        ...

    async def report_steps(self, job: str, worker: str, report: Any) -> None: ...


def _unknown_gpu(gpu: str) -> InvalidArgument:
    return InvalidArgument(f"gpu_uuid: unknown GPU {gpu[:200]!r}")


class FleetAgents:
    """Every manager hands its agents' news to the outbox (the leader applies it)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def hello(self, node: str, domain: str, gpus: list[GpuInventory], boot_id: str, agent_version: str,
                    principal: Principal, fingerprint: str | None, peer: str
                    ) -> tuple[AgentSession, int, int]:
        return await self.fleet.agents.hello(node, domain, gpus, boot_id, agent_version, principal, fingerprint,
                                             peer)

    def heartbeat(self, node: str, gpus: Any) -> None:
        self.fleet.heartbeat(node)
        if gpus:
            self.fleet.telemetry(node, gpus)

    def report(self, session: AgentSession, seq: int, gpus: list[GpuReport]) -> asyncio.Future[int]:
        return self.fleet.agents.report(session, seq, gpus)

    async def power(self, node: str, readings: list[tuple[str, int]]) -> None:
        await self.fleet.agents.power(node, readings)

    def disconnected(self, session: AgentSession) -> None:
        self.fleet.disconnected(session)


class FleetWatches:
    """Watches follow the layout feed on every manager; acks and step reports are applied at once
    on the leader (with its world loaded), stored for it by any other manager."""

    def __init__(self, fleet: Fleet, jobs: Jobs, restores: Restores, failslow: FailSlow,
                 acting: Callable[[], bool]) -> None:
        self.fleet, self.jobs, self.restores, self.failslow, self.acting = fleet, jobs, restores, failslow, acting

    async def check(self, job: str, gpu: str) -> None:
        feed = self.fleet.feed
        await feed.current(job)  # NotFound for an unknown job
        if gpu and not await feed.known_gpu(gpu):
            raise _unknown_gpu(gpu)

    async def wait(self, job: str, newer_than: tuple[int, int], stop: Callable[[], bool]) -> LayoutRec | None:
        return await self.fleet.feed.wait(job, newer_than, stop)

    def hold(self) -> Held | None:
        return self.fleet.feed.hold()

    def release(self, held: Held | None) -> None:
        if held is not None:
            self.fleet.feed.release(held)

    def wake_all(self) -> None:
        self.jobs.wake_watchers()
        self.fleet.feed.wake_all()

    async def ack(self, job: str, worker: str, epoch: int, version: int, ok: bool,
                  restored: RestoreReport | None) -> LayoutRec:
        if not self.acting():
            return await self.fleet.workers.ack(job, worker, epoch, version, ok, restored)
        rec = self.jobs.ack(job, worker, epoch, version, ok)
        if restored is not None:
            await self.restores.record(job, worker, epoch, version, restored)
        return rec

    async def report_steps(self, job: str, worker: str, report: Any) -> None:
        if not self.acting():
            await self.fleet.workers.report_steps(job, worker, report)
            return
        rec, samples = await self.jobs.record_steps(job, worker, report)
        self.failslow.offer(job, rec, samples)  # the fail-slow detector's steps (service/planning/failslow.py)
