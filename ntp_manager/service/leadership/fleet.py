"""The fleet: what every manager does with agents' streams and layout watches, on either store.

One design runs both stores. Every manager takes agents' hellos, reports, power read-backs and
heartbeats (service/ingest/outbox.py: checked as the leader checks them, handed to the outbox,
acknowledged once durable) and layout watches (service/feed/layouts.py); the leader, besides,
applies the outbox in sequence order (service/ingest/consumer.py), plans, and offers the layouts
it publishes to the watches it holds. The outbox is a port (service/ingest/port.py) chosen by the
composition root (service/manager.py): one manager alone (SQLite) hands its entries to its consumer
in memory (acknowledged once applied); managers sharing PostgreSQL store them in the outbox table.

What only several managers sharing PostgreSQL need is a separate component,
service/leadership/shared.py: the LISTEN connection, the commands for agents whose streams other
managers hold, the balance between managers, the layout feed's poll. A leader change moves only
the planner role: the agents' streams stay where they are; the new leader loads the world and
applies the outbox from the cursor the last one left.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from ntp_manager.service.core.tasks import cancel_all
from ntp_manager.service.feed.layouts import LayoutFeed
from ntp_manager.service.feed.relay import TelemetryRelay
from ntp_manager.service.feed.workers import WorkerIngest
from ntp_manager.service.ingest.agents import AgentSession, EndStream
from ntp_manager.service.ingest.consumer import Consumer, ConsumerHost
from ntp_manager.service.ingest.outbox import AgentIngest, HelloCheck
from ntp_manager.service.ingest.port import OutboxPort
from ntp_manager.service.operations.tokens import Tokens


class FleetHost(ConsumerHost, Protocol):
    """What the fleet's parts need of the manager (service/manager.py is one)."""

    @property
    def acting(self) -> bool: ...

    @property
    def leading(self) -> bool: ...

    @property
    def token_service(self) -> Tokens: ...

log = structlog.get_logger("ntp.fleet")


class Fleet:
    def __init__(self, manager: FleetHost, port: OutboxPort, view: HelloCheck) -> None:
        self.m = manager
        s = manager.settings
        self.ingest = port  # the outbox port (service/ingest/port.py)
        self.agents = AgentIngest(port, manager.sm, manager.clock, manager.agents.sessions,
                                  manager.metrics.agents.set, view)
        self.consumer: Consumer | None = None
        # workers and telemetry on every manager (service/feed/)
        self.feed = LayoutFeed(manager.sm, s, manager.clock)
        self.workers = WorkerIngest(manager.clock, self.feed, port.submit)
        self.relay = TelemetryRelay(port.submit, s.leader_id)
        self.ready = False  # taking agent streams (its token table is loaded)
        self._tasks: list[asyncio.Task[None]] = []
        self.lag_of_world: Callable[[], int] = lambda: 0  # world-log rows not applied here: part of the backlog

    # ---- every manager ----------------------------------------------------------------------
    async def start(self) -> None:
        """Take agent streams and watches (once; on PostgreSQL at start, alone once leading)."""
        if self.ready:
            return
        m = self.m
        await m.token_service.reload()
        await self.ingest.open()
        self.ingest.start()
        self._tasks = [asyncio.create_task(m.token_service.poll_forever(), name="fleet-token-poll"),
                       asyncio.create_task(self._seen_loop(), name="fleet-seen")]
        self.ready = True
        log.info("taking agent streams", manager=m.settings.leader_id)

    async def lead(self) -> None:
        """The world is loaded: apply the outbox, offer the layouts published to the watches."""
        await self.start()
        self.consumer = Consumer(self.m, self.ingest)
        self.ingest.on_append = self.consumer.wake.set
        self.m.jobs.on_layout.append(self._offer_layouts)
        self._tasks.append(asyncio.create_task(self.consumer.run(), name="fleet-consumer"))

    async def settled(self, timeout_s: float = 30.0) -> None:
        """On the leader: every outbox row committed before this call is applied to the world
        (an agent's ack says its report is durable; this is read-your-writes for it). Raises
        TimeoutError, or NotLeader on a manager that does not lead."""
        if self.consumer is None:
            raise self.m.leadership.not_leader()
        head = await self.ingest.head()
        consumer = self.consumer
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout_s
        while consumer.last < head:
            if loop.time() > end:
                raise TimeoutError(f"the outbox was not applied up to {head} within {timeout_s} s")
            consumer.wake.set()
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        self.ready = False
        self.feed.close()
        await self.ingest.stop()  # what it took becomes durable first (in memory: the consumer applies it)
        await cancel_all(self._tasks)
        self._tasks = []
        await self.agents.view.close()  # the connections its hello checks keep

    def world_lag(self) -> int:
        return self.lag_of_world()

    def disconnected(self, session: AgentSession) -> None:
        """An agent stream this manager held ended (rpc/server.py)."""
        st = self.agents.streams.get(session.node)
        if st is not None and st.session is session:
            self.relay.forget(st.gpus)
        if self.m.acting and self.m.agents.sessions.get(session.node) is session:
            rec = self.m.world.nodes.get(session.node)
            if rec is not None:  # the leader's own agent: not connected any more
                rec.connected = False
        self.agents.disconnect(session)

    def end_stuck_streams(self) -> int:
        """End the streams that brought nothing for three times the longest quiet an agent keeps
        (`heartbeat_max_quiet_s`): their connections answer pings, but the agent sends nothing (its
        loop is stuck). Ended, they are not counted as heard from, and the node goes silent (suspect,
        then failed) unless its agent comes back. How many."""
        limit = 3 * self.m.settings.heartbeat_max_quiet_s
        now = asyncio.get_running_loop().time()
        stuck = [s for s in self.agents.sessions.values() if s.heard is not None and now - s.heard > limit]
        for s in stuck:
            log.warning("agent stream ended: nothing from its agent", node=s.node,
                        silent_s=round(now - (s.heard or now), 1))
            s.outbox.put_nowait(EndStream("UNAVAILABLE", f"nothing from this agent for {limit:g} s (its "
                                          f"heartbeats are due every {self.m.settings.heartbeat_max_quiet_s:g} s)"))
        return len(stuck)

    def heartbeat(self, node: str) -> None:
        """The leader marks its own agents seen at once; another manager reports them in a row."""
        if self.m.acting:
            self.m.agents.heartbeat(node)
        else:
            self.agents.heartbeat(node)

    def _offer_layouts(self) -> None:
        """The leader published a layout (or deleted a job): its watchers here get it from the
        world, not a read back."""
        jobs = self.m.world.jobs
        self.feed.offer((j.layout for j in jobs.values() if j.layout is not None), alive=jobs)

    def telemetry(self, node: str, gpus: Any) -> None:
        """A heartbeat's GPU counters: the leader keeps its own agents'; another manager relays them."""
        m = self.m
        now = m.clock.now().timestamp()
        if m.acting:
            rec = m.world.nodes.get(node)
            if rec is not None:
                m.telemetry.record(node, rec.gpus, gpus, now)
            return
        st = self.agents.streams.get(node)
        if st is not None:
            self.relay.record(node, st.gpus, gpus, now)

    async def _seen_loop(self) -> None:
        while True:
            await asyncio.sleep(self.m.settings.heartbeat_interval_s)
            self.end_stuck_streams()
            if self.m.acting:  # the leader marks its own agents seen itself (hello, report, beat, open stream)
                self.agents.seen.clear()
                self.m.agents.mark_open([n for n, s in self.agents.sessions.items() if s.heard is not None])
            fut = None if self.m.acting else self.agents.flush_seen()
            if fut is not None:
                with contextlib.suppress(Exception):  # a store hiccup: the next heartbeats are counted
                    await fut
            fut = None if self.m.acting else self.relay.flush()
            if fut is not None:
                with contextlib.suppress(Exception):  # lost: the next heartbeats carry newer samples
                    await fut
