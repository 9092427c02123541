"""Fleet mode: managers that hold more than their share of streams tell some clients to move.

Every manager writes its row of `fleet_members` every heartbeat period (its gRPC address, the
agent streams and layout watches it holds, its backlog; the database's clock). Every
`fleet_balance_s` it reads the rows seen within `MEMBER_TTL_BEATS` heartbeat periods (the managers
alive) and, per kind of stream, compares what it holds with the fair share (the kind's total over
the managers alive, rounded up). Holding more than the share plus `fleet_balance_tolerance` of it, it ends streams
down to the share, at most `fleet_balance_max` per kind and pass, each with UNAVAILABLE and the
trailing metadata `ntp-move-to` naming the manager holding the fewest (counting the moves already
told); the agent and the worker go there at once (contract/client.py). A move that would not make
the target hold fewer than this manager is not made, so two managers never trade clients back and
forth. Clients that ignore the key move to the next address of their list.

A manager that is behind is sent nothing: one whose backlog (the rows waiting for its group commit;
on the leader, besides, the outbox rows stored and not applied yet) exceeds
`fleet_balance_busy_rows` counts for the share but is no target until it has caught up. At 12,500
agents on a 2-core VM the standbys kept telling agents to move to the leader while it was applying
their hellos; it welcomed few of them in time, and the rest came back, over and over.

Agents and workers start anywhere in their lists (they take the first address), so without moves
a manager added to a running fleet would hold nothing until others die; and one that comes back
after a restart would too.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import structlog
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ntp_manager.service.feed.layouts import LayoutFeed
from ntp_manager.service.ingest.agents import EndStream
from ntp_manager.service.ingest.consumer import Consumer
from ntp_manager.service.ingest.outbox import AgentIngest
from ntp_manager.service.ingest.port import OutboxPort
from ntp_manager.service.leadership.leader import Leadership
from ntp_manager.settings import Settings


class Streams(Protocol):
    """What a balance pass counts and moves (service/leadership/fleet.py's `Fleet` is one)."""

    @property
    def agents(self) -> AgentIngest: ...

    @property
    def feed(self) -> LayoutFeed: ...

    @property
    def ingest(self) -> OutboxPort: ...

    @property
    def consumer(self) -> Consumer | None: ...

    def world_lag(self) -> int:
        """World-log rows this manager has not applied yet (service/leadership/follow.py)."""
        ...

log = structlog.get_logger("ntp.balance")

MOVE_KEY = "ntp-move-to"  # trailing metadata: host:port of the manager the client should go to
MEMBER_TTL_BEATS = 3  # a manager whose row is older than this many heartbeat periods is gone
MOVE_MESSAGE = "this manager holds more than its share of the fleet's streams; move to {target}"


def moves(mine: int, me: str, loads: Mapping[str, int], tolerance: float, limit: int,
          closed: frozenset[str] | set[str] = frozenset()) -> dict[str, int]:
    """How many of this manager's `mine` streams of one kind to send to each other manager, given
    every live manager's load (`loads`: address -> streams, this one at `me` included). Pure.
    Nothing while `mine` is within the fair share (ceil(total / managers)) plus `tolerance` of it;
    else down to the share, `limit` at most, each to the manager holding the fewest at that point,
    and only while that one would still hold fewer than this one. Managers in `closed` count for
    the share but are sent nothing (the last moves toward them have not landed: `Landing`)."""
    others = {a: n for a, n in loads.items() if a and a != me}
    if not others or mine <= 0:
        return {}
    total = mine + sum(others.values())
    fair = math.ceil(total / (len(others) + 1))
    if mine <= fair + math.floor(fair * tolerance):
        return {}
    others = {a: n for a, n in others.items() if a not in closed}
    if not others:
        return {}
    out: Counter[str] = Counter()
    left = mine
    for _ in range(min(mine - fair, limit)):
        target = min(others, key=lambda a: (others[a], a))
        if others[target] + 1 >= left:
            break
        others[target] += 1
        left -= 1
        out[target] += 1
    return dict(out)


class Landing:
    """Whether the streams told to move toward a manager arrived there. Pure.

    A manager that cannot take more (its hellos queue for longer than the clients wait, it is
    starved of CPU) does not grow however many are sent to it: the clients come back to their
    other addresses, and the managers over their share, seeing it still hold the fewest, would send
    it the same clients every pass. Found at 12,500 agents on a 2-core VM: two managers told ~300
    agents each every 30 s to move to the third for 15 minutes, its count stayed near 1,950, and
    only 7,200 of the agents held a stream at any time. So after telling clients to move toward a
    target, the next pass sends it nothing more unless its load grew by at least half of them; a
    target whose moves did not land stays closed for `hold` passes, then is tried again."""

    def __init__(self, hold: int = 4) -> None:
        self.hold = hold
        self._sent: dict[str, tuple[int, int, int]] = {}  # target -> (its load when told, told, passes left)

    def closed(self, loads: Mapping[str, int]) -> set[str]:
        """At the start of a pass: the targets not to send to now (given every manager's load)."""
        out = set()
        for target, (base, told, left) in list(self._sent.items()):
            now = loads.get(target)
            if now is None or now >= base + (told + 1) // 2:
                del self._sent[target]  # landed (or the target is gone)
            elif left <= 0:
                del self._sent[target]  # held long enough: try again
            else:
                self._sent[target] = (base, told, left - 1)
                out.add(target)
        return out

    def told(self, target: str, load: int, n: int) -> None:
        """`n` clients were told to move to `target`, which held `load` at the time."""
        if n > 0:
            base, before, _ = self._sent.get(target, (load, 0, 0))
            self._sent[target] = (base, before + n, self.hold)


@dataclass(frozen=True)
class Member:
    """A manager's row of `fleet_members`: its gRPC address, the streams it holds, its backlog."""

    address: str
    agents: int
    watchers: int
    backlog: int


class Balancer:
    def __init__(self, sm: async_sessionmaker[AsyncSession], settings: Settings, leadership: Leadership,
                 fleet: Streams) -> None:
        self.sm, self.settings, self.leadership = sm, settings, leadership
        self.fleet = fleet
        self.moved_agents = 0  # agents this manager told to move
        self.moved_watchers = 0  # layout watches this manager told to move
        self._told: set[int] = set()  # ids of the agent sessions told already (their streams are ending)
        self.landing = {"agents": Landing(), "watchers": Landing()}
        self.busy_passes = 0  # passes that found a manager behind (sent it nothing)

    def held(self) -> tuple[int, int]:
        """(agent streams, layout watches) this manager holds."""
        return len(self.fleet.agents.sessions), self.fleet.feed.held()

    async def run(self) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        next_pass = loop.time() + s.fleet_balance_s
        while True:
            try:
                await self.publish()
                if s.fleet_balance_s > 0 and loop.time() >= next_pass:
                    next_pass = loop.time() + s.fleet_balance_s
                    await self.balance()
            except (OSError, SQLAlchemyError) as e:
                log.warning("cannot write or read the fleet's members", error=str(e).splitlines()[0][:200])
            await asyncio.sleep(s.heartbeat_interval_s)

    async def publish(self) -> None:
        """Write this manager's row: address, streams held, backlog. The leader's backlog counts the
        outbox rows after its cursor, read in the same statement (the outbox's head by its key)."""
        agents, watchers = self.held()
        consumer = self.fleet.consumer if self.leadership.leading else None
        async with self.sm() as session, session.begin():
            await session.execute(text(
                "INSERT INTO fleet_members (manager, grpc_address, agents, watchers, backlog, seen_at) "
                "VALUES (:m, :g, :a, :w, :q + CASE WHEN :lead THEN "
                "GREATEST(0, (SELECT coalesce(max(seq), 0) FROM outbox) - :applied) ELSE 0 END, now()) "
                "ON CONFLICT (manager) DO UPDATE SET grpc_address = excluded.grpc_address, "
                "agents = excluded.agents, watchers = excluded.watchers, backlog = excluded.backlog, "
                "seen_at = excluded.seen_at"),
                {"m": self.settings.leader_id, "g": self.leadership.grpc, "a": agents, "w": watchers,
                 "q": self.fleet.ingest.queued() + self.fleet.world_lag(), "lead": consumer is not None,
                 "applied": consumer.last if consumer is not None else 0})

    async def members(self) -> list[Member]:
        """Every manager seen lately, this one included."""
        ttl = MEMBER_TTL_BEATS * self.settings.heartbeat_interval_s
        async with self.sm() as session:
            rows = (await session.execute(text(
                "SELECT grpc_address, agents, watchers, backlog FROM fleet_members "
                "WHERE seen_at > now() - make_interval(secs => :ttl)"), {"ttl": ttl})).all()
        return [Member(str(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in rows]

    async def leave(self) -> None:
        """This manager stops: its row goes (the others stop counting it at once)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2), self.sm() as session, session.begin():
                await session.execute(text("DELETE FROM fleet_members WHERE manager = :m"),
                                      {"m": self.settings.leader_id})

    async def balance(self) -> None:
        """One pass: read who is alive, tell the streams over this manager's share to move."""
        me = self.leadership.grpc
        if not me:
            return
        rows = await self.members()
        agents, watchers = self.held()
        agent_loads = {r.address: r.agents for r in rows}
        agent_loads[me] = agents
        watch_loads = {r.address: r.watchers for r in rows}
        watch_loads[me] = watchers
        busy = {r.address for r in rows if r.backlog > self.settings.fleet_balance_busy_rows} - {me}
        if busy:
            self.busy_passes += 1
            log.info("managers behind on their work are sent no clients this pass",
                     managers=sorted(busy)[:8], backlog=max(r.backlog for r in rows))
        self.moved_agents += self._pass(agents, me, agent_loads, self.landing["agents"], busy, self._move_agents)
        self.moved_watchers += self._pass(watchers, me, watch_loads, self.landing["watchers"], busy,
                                          self.fleet.feed.move)

    def _pass(self, mine: int, me: str, loads: dict[str, int], land: Landing, busy: set[str],
              move: Callable[[str, int], int]) -> int:
        """One kind's moves of a pass (`move(target, n)` tells them), none toward a manager in
        `busy`; how many were told."""
        s = self.settings
        total = 0
        for target, n in moves(mine, me, loads, s.fleet_balance_tolerance, s.fleet_balance_max,
                               land.closed(loads) | busy).items():
            told = move(target, n)
            land.told(target, loads[target], told)
            total += told
        return total

    def _move_agents(self, target: str, n: int) -> int:
        """End `n` agent streams (the newest) with a move to `target`; how many were told."""
        told = 0
        sessions = list(self.fleet.agents.sessions.values())
        self._told &= {id(x) for x in sessions}
        for sess in reversed(sessions):
            if told >= n:
                break
            if sess.closed or id(sess) in self._told:
                continue
            sess.outbox.put_nowait(EndStream("UNAVAILABLE", MOVE_MESSAGE.format(target=target), target))
            self._told.add(id(sess))
            told += 1
        if told:
            log.info("agents told to move for balance", agents=told, to=target)
        return told
