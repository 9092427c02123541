"""What only several managers sharing PostgreSQL need, beside the fleet (service/leadership/fleet.py).

Added by the composition root (service/manager.py) when the store is shared; one manager alone
on SQLite runs without it:

- the LISTEN connection: new outbox rows wake the leader's consumer, new layouts the layout feeds
  of every manager (service/feed/layouts.py, which also polls the layouts table), new world-log
  rows the standbys' followers (service/leadership/follow.py);
- commands for agents whose streams another manager holds: the leader writes them to
  `agent_commands` (service/ingest/agents.py's `remote`), every manager sends its own agents
  theirs (woken by NOTIFY ntp_agent_commands, polled every `fleet_poll_s`); the leader prunes them;
- the balance of agent streams and watches between managers (service/leadership/balance.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

import asyncpg
import structlog
from sqlalchemy.exc import SQLAlchemyError

from ntp_manager.service.core.state import World
from ntp_manager.service.core.tasks import cancel_all
from ntp_manager.service.ingest.agents import Ack, AgentCommand, Drain, ReleasePower, SetPower
from ntp_manager.service.leadership.balance import Balancer
from ntp_manager.service.leadership.fleet import Fleet, FleetHost
from ntp_manager.service.leadership.follow import Ahead, Follower, WorldLogWriter
from ntp_manager.service.leadership.leader import NotLeader
from ntp_manager.store import db, outbox, worldlog

log = structlog.get_logger("ntp.fleet")


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


class SharedStore:
    def __init__(self, manager: FleetHost, fleet: Fleet, load: Callable[[], Awaitable[World]],
                 ahead: Ahead | None = None) -> None:
        self.m = manager
        self.fleet = fleet
        # the leader logs what it changes, the others follow it (service/leadership/follow.py)
        m = manager
        self.follower = Follower(m.sm, m.engine, m.kernel, m.settings, m.clock, load, m.metrics.registry, ahead)
        fleet.lag_of_world = lambda: self.follower.lag
        m.kernel.before_commit.append(WorldLogWriter(lambda: manager.epoch))
        self.balance = Balancer(manager.sm, manager.settings, manager.leadership, fleet)
        self.delivered = 0  # commands of agent_commands sent to this manager's agents
        self.pruned = 0  # agent_commands rows this manager deleted as the leader
        self._tasks: list[asyncio.Task[None]] = []
        self._commands: list[tuple[str, dict[str, Any]]] = []  # the leader's, to write
        self._commands_kick = asyncio.Event()
        self._commands_wake = asyncio.Event()
        self._cursor = 0  # the last agent_commands id looked at
        self._listener: asyncpg.Connection | None = None
        # the deliver loop's own connection (PostgreSQL, which is where several managers run)
        self._reader = db.KeptConnection(m.engine, m.settings.fleet_store_timeout_s, "the agent commands") \
            if db.KeptConnection.usable(m.engine) else None

    async def start(self) -> None:
        """Every manager, from its start: the fleet takes agent streams and watches."""
        m = self.m
        async with m.sm() as s:
            self._cursor = await outbox.last_command_id(s)
        await self.fleet.start()
        m.agents.remote = self._remote
        self._tasks = [
            asyncio.create_task(self._listen(), name="fleet-listen"),
            asyncio.create_task(self._deliver_loop(), name="fleet-commands-in"),
            asyncio.create_task(self.fleet.feed.run(), name="fleet-layout-feed"),
            asyncio.create_task(self.balance.run(), name="fleet-balance"),
        ]

    async def lead(self) -> None:
        """The leader, besides: writes the commands for other managers' agents, and prunes them."""
        self._tasks += [asyncio.create_task(self._commands_loop(), name="fleet-commands-out"),
                        asyncio.create_task(self._prune_loop(), name="fleet-commands-prune")]

    async def stop(self) -> None:
        await cancel_all(self._tasks)
        self._tasks = []
        if self._reader is not None:
            await self._reader.close()
        await self.balance.leave()
        if self._listener is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._listener.close(), 2)
            self._listener = None

    async def _listen(self) -> None:
        """LISTEN for new outbox rows, agent commands, layouts and world-log rows (reconnecting when
        the connection ends); the loops poll anyway, so a notification lost meanwhile delays by one poll."""
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
        if self.fleet.consumer is not None:
            self.fleet.consumer.wake.set()

    def _on_world(self, _conn: Any, _pid: Any, _channel: Any, payload: Any) -> None:
        self.follower.notify(str(payload or ""))

    def _on_commands(self, *_: Any) -> None:
        self._commands_wake.set()

    def _on_layouts(self, _conn: Any, _pid: Any, _channel: Any, payload: Any) -> None:
        self.fleet.feed.notify(str(payload or ""))

    async def _deliver_loop(self) -> None:
        """Send this manager's agents the commands the leader wrote for them."""
        while True:
            self._commands_wake.clear()
            try:
                if self._reader is not None:  # PostgreSQL: 2 polls a second at idle, on every manager
                    rows = await outbox.commands_after_kept(self._reader, self._cursor)
                else:
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
            except (OSError, SQLAlchemyError) as e:  # the kept connection's errors are OSError
                log.warning("cannot read agent commands", error=(str(e).splitlines() or [type(e).__name__])[0][:200])
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
