"""Fleet mode (`fleet_ingest`, PostgreSQL): every manager takes agent streams; one plans.

Roles:
- every manager, standbys included: takes agents' hellos, reports, power read-backs and
  heartbeats (service/ingest/outbox.py: checked as the leader checks them, stored in the outbox,
  acknowledged once durable), and sends its agents the commands the leader writes for them
  (`agent_commands`, woken by NOTIFY ntp_agent_commands, polled every `fleet_poll_s`);
- the leader, besides: applies the outbox in sequence order (service/ingest/consumer.py), plans,
  writes layouts (fenced by its epoch), and writes the commands for agents whose streams other
  managers hold (service/ingest/agents.py's `remote`).

A leader change moves only the planner role: the agents' streams stay where they are; the new
leader loads the world and applies the outbox from the cursor the last one left. A manager that
dies drops only its own streams; their agents reconnect to another manager (the multi-address
lists they take) and re-send what was not acknowledged (stored once: idempotency keys).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any, Protocol

import asyncpg
import structlog
from sqlalchemy.exc import SQLAlchemyError

from ntp_manager.service.feed.layouts import LayoutFeed
from ntp_manager.service.feed.relay import TelemetryRelay
from ntp_manager.service.feed.workers import WorkerIngest
from ntp_manager.service.ingest.agents import Ack, AgentCommand, Drain, ReleasePower, SetPower
from ntp_manager.service.ingest.consumer import Consumer, ConsumerHost
from ntp_manager.service.ingest.outbox import AgentIngest, Ingest
from ntp_manager.service.leadership.balance import Balancer
from ntp_manager.service.leadership.leader import NotLeader
from ntp_manager.service.operations.tokens import Tokens
from ntp_manager.store import outbox, worldlog


class FleetHost(ConsumerHost, Protocol):
    """What the fleet's parts need of the manager (service/manager.py is one)."""

    @property
    def acting(self) -> bool: ...

    @property
    def leading(self) -> bool: ...

    @property
    def token_service(self) -> Tokens: ...

log = structlog.get_logger("ntp.fleet")

AGENT_SERVICE = "ntp.v1.AgentService"


def encode(cmd: AgentCommand) -> dict[str, Any]:
    if isinstance(cmd, SetPower):
        return {"set_power": [cmd.gpu, cmd.limit_mw, cmd.reason]}
    if isinstance(cmd, ReleasePower):
        return {"release_power": cmd.gpu}
    if isinstance(cmd, Drain):
        return {"drain": [cmd.deadline.isoformat(), cmd.reason]}
    raise TypeError(f"not a command for another manager's agent: {cmd!r}")


def decode(p: dict[str, Any]) -> AgentCommand:
    if "set_power" in p:
        gpu, mw, reason = p["set_power"]
        return SetPower(str(gpu), int(mw), str(reason))
    if "release_power" in p:
        return ReleasePower(str(p["release_power"]))
    deadline, reason = p["drain"]
    return Drain(datetime.fromisoformat(deadline), str(reason))


class Fleet:
    def __init__(self, manager: FleetHost) -> None:
        self.m = manager
        s = manager.settings
        self.ingest = Ingest(manager.sm, s.leader_id, manager.clock, s.group_commit_window_ms / 1000,
                             s.fleet_store_timeout_s)
        self.agents = AgentIngest(self.ingest, manager.sm, manager.clock, manager.agents.sessions,
                                  manager.metrics.agents.set, engine=manager.engine)
        self.consumer: Consumer | None = None
        # workers and telemetry on every manager (service/feed/)
        self.feed = LayoutFeed(manager.sm, s, manager.clock)
        self.workers = WorkerIngest(manager.clock, self.feed, self.ingest.submit)
        self.relay = TelemetryRelay(self.ingest.submit, s.leader_id)
        self.balance = Balancer(manager.sm, s, manager.leadership, self)
        self.ready = False  # taking agent streams (its token table is loaded)
        self.delivered = 0  # commands of agent_commands sent to this manager's agents
        self._tasks: list[asyncio.Task[None]] = []
        self._commands: list[tuple[str, dict[str, Any]]] = []  # the leader's, to write
        self._commands_kick = asyncio.Event()
        self._commands_wake = asyncio.Event()
        self._cursor = 0  # the last agent_commands id looked at
        self._listener: asyncpg.Connection | None = None
        self.pruned = 0  # agent_commands rows this manager deleted as the leader
        self.on_world: Callable[[str], None] | None = None  # NOTIFY ntp_world (service/leadership/follow.py)
        self.lag_of_world: Callable[[], int] = lambda: 0  # rows of it not applied here: part of the backlog

    # ---- every manager ----------------------------------------------------------------------
    async def start(self) -> None:
        m = self.m
        await m.token_service.reload()
        async with m.sm() as s:
            self._cursor = await outbox.last_command_id(s)
        self.ingest.start()
        m.agents.remote = self._remote
        self._tasks = [
            asyncio.create_task(m.token_service.poll_forever(), name="fleet-token-poll"),
            asyncio.create_task(self._listen(), name="fleet-listen"),
            asyncio.create_task(self._seen_loop(), name="fleet-seen"),
            asyncio.create_task(self._deliver_loop(), name="fleet-commands-in"),
            asyncio.create_task(self.feed.run(), name="fleet-layout-feed"),
            asyncio.create_task(self.balance.run(), name="fleet-balance"),
        ]
        self.ready = True
        log.info("fleet mode: taking agent streams", manager=m.settings.leader_id)

    async def lead(self) -> None:
        """The world is loaded: apply the outbox, write commands for other managers' agents."""
        self.consumer = Consumer(self.m)
        self.m.jobs.on_layout.append(self._offer_layouts)
        self._tasks += [asyncio.create_task(self.consumer.run(), name="fleet-consumer"),
                        asyncio.create_task(self._commands_loop(), name="fleet-commands-out"),
                        asyncio.create_task(self._prune_loop(), name="fleet-commands-prune")]

    async def settled(self, timeout_s: float = 30.0) -> None:
        """On the leader: every outbox row committed before this call is applied to the world
        (an agent's ack says its report is durable; this is read-your-writes for it). Raises
        TimeoutError, or NotLeader on a manager that does not lead."""
        if self.consumer is None:
            raise self.m.leadership.not_leader()
        async with self.m.sm() as s:
            head = await outbox.head(s)
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
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []
        await self.balance.leave()
        await self.ingest.stop()
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._listener.close(), 2)
            self._listener = None

    async def _listen(self) -> None:
        """LISTEN for new outbox rows and agent commands (reconnecting when the connection ends);
        the loops poll anyway, so a notification lost meanwhile delays by one poll."""
        url = self.m.settings.effective_database_url.replace("postgresql+asyncpg://", "postgresql://", 1)
        while True:
            try:
                conn = await asyncpg.connect(url, timeout=10, server_settings={
                    "application_name": f"ntp-manager {self.m.settings.leader_id} listen"[:63]})
                self._listener = conn
                await conn.add_listener(outbox.CHANNEL, self._on_outbox)
                await conn.add_listener(outbox.COMMANDS, self._on_commands)
                await conn.add_listener(outbox.LAYOUTS, self._on_layouts)
                await conn.add_listener(worldlog.CHANNEL, self._on_world)
                while not conn.is_closed():
                    await asyncio.sleep(self.m.settings.fleet_poll_s)
            except (OSError, asyncpg.PostgresError, TimeoutError) as e:
                log.warning("cannot listen for outbox notifications; polling", error=str(e).splitlines()[0][:200])
            await asyncio.sleep(self.m.settings.fleet_poll_s)

    def _on_outbox(self, *_: Any) -> None:
        if self.consumer is not None:
            self.consumer.wake.set()

    def _on_world(self, _conn: Any, _pid: Any, _channel: Any, payload: Any) -> None:
        if self.on_world is not None:
            self.on_world(str(payload or ""))

    def world_lag(self) -> int:
        return self.lag_of_world()

    def _on_commands(self, *_: Any) -> None:
        self._commands_wake.set()

    def disconnected(self, session: Any) -> None:
        """An agent stream this manager held ended (rpc/server.py)."""
        st = self.agents.streams.get(session.node)
        if st is not None and st.session is session:
            self.relay.forget(st.gpus)
        self.agents.disconnect(session)

    def _on_layouts(self, _conn: Any, _pid: Any, _channel: Any, payload: Any) -> None:
        self.feed.notify(str(payload or ""))

    def _offer_layouts(self) -> None:
        """The leader published a layout: its watchers here get it from the world, not a read back."""
        self.feed.offer(j.layout for j in self.m.world.jobs.values() if j.layout is not None)

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
            fut = self.agents.flush_seen()
            if fut is not None:
                with contextlib.suppress(Exception):  # a store hiccup: the next heartbeats are counted
                    await fut
            fut = None if self.m.acting else self.relay.flush()
            if fut is not None:
                with contextlib.suppress(Exception):  # lost: the next heartbeats carry newer samples
                    await fut

    async def _deliver_loop(self) -> None:
        """Send this manager's agents the commands the leader wrote for them."""
        while True:
            self._commands_wake.clear()
            try:
                async with self.m.sm() as s:
                    rows = await outbox.commands_after(s, self._cursor)
                for cid, node, payload in rows:
                    self._cursor = cid
                    sess = self.m.agents.sessions.get(node)
                    if sess is not None and not sess.closed:
                        sess.outbox.put_nowait(decode(payload))
                        self.delivered += 1
                if rows:
                    continue
            except (OSError, SQLAlchemyError) as e:
                log.warning("cannot read agent commands", error=str(e).splitlines()[0][:200])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._commands_wake.wait(), self.m.settings.fleet_poll_s)

    # ---- the leader -------------------------------------------------------------------------
    def _remote(self, node: str, cmd: AgentCommand) -> None:
        if not self.m.leading or isinstance(cmd, Ack):
            return
        self._commands.append((node, encode(cmd)))
        self._commands_kick.set()

    async def _commands_loop(self) -> None:
        m = self.m
        while True:
            await self._commands_kick.wait()
            self._commands_kick.clear()
            batch, self._commands = self._commands, []
            if not batch:
                continue
            try:
                async with m.sm() as s, s.begin():
                    await m.leadership.fence(s)
                    await outbox.push_commands(s, batch, m.epoch, m.clock.now())
            except NotLeader:
                return
            except (OSError, SQLAlchemyError) as e:
                log.warning("cannot write agent commands; trying again", commands=len(batch),
                            error=str(e).splitlines()[0][:200])
                self._commands = batch + self._commands
                await asyncio.sleep(m.settings.fleet_poll_s)
                self._commands_kick.set()

    async def prune_commands(self) -> int:
        """Delete the agent commands older than `fleet_command_retention_s` (fenced: a deposed
        leader deletes nothing). Raises NotLeader."""
        m = self.m
        before = m.clock.now() - timedelta(seconds=m.settings.fleet_command_retention_s)
        async with m.sm() as s, s.begin():
            await m.leadership.fence(s)
            n = await outbox.prune_commands(s, before)
        self.pruned += n
        return n

    async def _prune_loop(self) -> None:
        """`agent_commands` stays bounded: what the leader wrote in the last retention period."""
        every = min(60.0, self.m.settings.fleet_command_retention_s / 4)
        while True:
            await asyncio.sleep(every)
            try:
                n = await self.prune_commands()
            except NotLeader:
                return
            except (OSError, SQLAlchemyError) as e:
                log.warning("cannot prune agent commands", error=str(e).splitlines()[0][:200])
                continue
            if n:
                log.info("agent commands pruned", rows=n)
