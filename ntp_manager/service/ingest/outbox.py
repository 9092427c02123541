"""What any manager does with its agents' streams, on either store (service/leadership/fleet.py).

A hello is checked as the leader checks it (bounds, the token's node and certificate, a GPU of
another node, a node of another domain: the last two against `HelloView`, the database when several
managers share PostgreSQL, the leader's world when one manager runs alone) and handed to the outbox
(service/ingest/port.py); the welcome tells the agent the last report seq that is durable (applied,
or stored and not applied yet). A report is checked against the hello's inventory and the stream's
seq (a replay is acknowledged and not stored again, a gap refused) and handed over; it is
acknowledged once its entry is durable.

`Ingest` is the outbox port of PostgreSQL: rows are group-committed (whatever is queued when the
previous commit ends goes in one transaction), with the idempotency keys of store/outbox.py, so a
report that an agent re-sends to another manager after losing its ack is stored once. A manager
that cannot store (PostgreSQL unreachable, or slower than `fleet_store_timeout_s`) answers
UNAVAILABLE and never acknowledges: the agent goes to another manager and re-sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, cast

import asyncpg
import structlog
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from ntp_manager.auth import Principal
from ntp_manager.clock import Clock
from ntp_manager.service.core.errors import InvalidArgument, PermissionDenied, ServiceError, Unavailable
from ntp_manager.service.core.inputs import GpuInventory, GpuReport, check_hello, check_power_readings, check_report
from ntp_manager.service.core.state import HEALTH_STATES, World
from ntp_manager.service.ingest.agents import AgentSession, identity_problem
from ntp_manager.service.ingest.hello_view import HelloViews
from ntp_manager.service.ingest.port import OutboxPort
from ntp_manager.store import db, outbox, worldlog
from ntp_manager.store.models import AuditRow, LeaderRow

log = structlog.get_logger("ntp.ingest")

MAX_BATCH = 4096  # rows in one group commit


@dataclass
class _Item:
    entry: outbox.Entry
    fut: asyncio.Future[int | None]


class Ingest:
    """The outbox port of PostgreSQL (service/ingest/port.py): group commit of outbox rows (any
    manager; no fence: storing is not leading), and the leader's reads, cursor and quarantine."""

    def __init__(self, sm: async_sessionmaker[AsyncSession], me: str, clock: Clock, window_s: float,
                 timeout_s: float, engine: AsyncEngine | None = None, apply_window_s: float = 0.0) -> None:
        self.sm = sm
        self.me = me
        self.clock = clock
        self.window_s = window_s
        self.timeout_s = timeout_s
        self.apply_window_s = apply_window_s
        self.batch_rows, self.batch_weight = 2048, 2048  # service/ingest/consumer.py's BATCH and WEIGHT
        self.on_append: Callable[[], None] = lambda: None  # NOTIFY ntp_outbox wakes the consumer instead
        # the consumer reads in autocommit (one statement, no BEGIN and ROLLBACK around it)
        self._reader = engine.execution_options(isolation_level="AUTOCOMMIT") if engine is not None else None
        # group commits: one autocommit statement each, on a kept connection (store/outbox.py append_on_driver)
        # ... and the leader's reads of it on another (a read is one statement on the driver)
        self._appender: db.KeptConnection | None = None
        self._rows: db.KeptConnection | None = None
        if db.KeptConnection.usable(self._reader):
            self._appender = db.KeptConnection(self._reader, timeout_s)
            self._rows = db.KeptConnection(self._reader, timeout_s, "the outbox")
        self.stored = 0  # rows this manager stored
        self.duplicates = 0  # rows whose idempotency key was stored already
        self.batches = 0
        self.failed = 0  # group commits that did not get through (UNAVAILABLE to their callers)
        self.stuck_ended = 0  # sessions of managers stuck inside an append that this one ended
        self._queue: deque[_Item] = deque()
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._committer(), name="ingest")

    async def stop(self, timeout: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self._queue and loop.time() < end and self._task is not None and not self._task.done():
            await asyncio.sleep(0.005)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._drop_appender()
        rows, self._rows = self._rows, None  # a read after this one goes through the pool (never a new kept one)
        if rows is not None:
            await rows.close()
        while self._queue:
            item = self._queue.popleft()
            if not item.fut.done():
                item.fut.set_exception(Unavailable("this manager is stopping; try another"))

    def queued(self) -> int:
        """Rows waiting for a group commit (the one running is not counted)."""
        return len(self._queue)

    async def open(self) -> None:
        pass

    def pending_seq(self, node: str) -> int:
        return 0  # the rows stored and not applied are read with the rest (`HELLO_VIEW`)

    # ---- the leader's side (service/ingest/consumer.py) --------------------------------------
    async def bounds(self) -> tuple[int, int]:
        async with self.sm() as s:
            return await outbox.last_applied(s), await outbox.head(s)

    async def head(self) -> int:
        async with self.sm() as s:
            return await outbox.head(s)

    async def read(self, after: int, limit: int) -> list[outbox.Stored]:
        """The next rows after the cursor: one statement in autocommit (no BEGIN and ROLLBACK
        around it: two round trips of a batch's dozen; the rows it sees are committed ones), on a
        connection kept for it (a checkout and SQLAlchemy's result rows cost the leader more than
        the read)."""
        if self._rows is not None:
            return await outbox.read_after_kept(self._rows, after, limit)
        if self._reader is None:
            async with self.sm() as s:
                return await outbox.read_after(s, after, limit)
        async with self._reader.connect() as c:
            return await outbox.read_after(c, after, limit)

    async def record(self, session: AsyncSession, upto: int, bad: Sequence[tuple[int, str]], epoch: int,
                     now: datetime) -> None:
        await outbox.quarantine(session, bad, epoch, now)
        await outbox.set_applied(session, upto, epoch, now)

    def applied(self, upto: int, failed: Mapping[int, ServiceError]) -> None:
        pass  # acknowledged when stored already

    async def prune(self, session: AsyncSession, upto: int, before: datetime, epoch: int, now: datetime) -> int:
        n = await outbox.prune_applied(session, upto, before)
        return n + await worldlog.prune(session, before, epoch, now)  # service/leadership/follow.py

    def submit(self, entry: outbox.Entry) -> asyncio.Future[int | None]:
        """Store `entry` in the next group commit: the future resolves (to its report seq) once it is durable."""
        fut: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        if self._task is None:
            fut.set_exception(Unavailable("this manager is not taking agent reports (starting or stopping)"))
            return fut
        self._queue.append(_Item(entry, fut))
        self._kick.set()
        return fut

    async def _committer(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            if self.window_s > 0 and len(self._queue) < MAX_BATCH:
                await asyncio.sleep(self.window_s)
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_BATCH))]
                await self._run(batch)

    async def _run(self, items: list[_Item]) -> None:
        wait_ms = int(self.timeout_s * 500)  # for the append lock: half the store timeout
        try:
            async with asyncio.timeout(self.timeout_s):
                seqs = await self._append([i.entry for i in items], wait_ms)
        except (OSError, SQLAlchemyError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as e:
            await self._drop_appender()  # its state is unknown (a statement cut off, a lost server)
            self.failed += 1
            reason = "took too long" if isinstance(e, TimeoutError) else str(e).splitlines()[0][:200]
            if _lock_timeout(e):  # the lock's holder may be a manager stopped inside its append
                await self._end_stuck_appenders(wait_ms)
            log.warning("cannot store agent reports", rows=len(items), error=reason)
            err = Unavailable(f"this manager cannot store reports in its database right now ({reason}); "
                              "try another manager")
            for i in items:
                if not i.fut.done():
                    i.fut.set_exception(err)
            return
        self.batches += 1
        self.stored += len(seqs)
        self.duplicates += len(items) - len(seqs)
        for i in items:
            if not i.fut.done():
                i.fut.set_result(i.entry.report_seq)


    async def _append(self, entries: list[outbox.Entry], wait_ms: int) -> list[int]:
        """One group commit. With an engine, one statement on a connection this committer keeps, in
        autocommit (store/outbox.py: durable when it returns); else in a session's transaction."""
        if self._appender is None:
            async with self.sm() as s, s.begin():
                return await outbox.append(s, entries, self.me, self.clock.now(), lock_wait_ms=wait_ms)
        return await outbox.append_on_driver(await self._appender.driver(), entries, self.me, self.clock.now(),
                                             lock_wait_ms=wait_ms)

    async def _drop_appender(self) -> None:
        if self._appender is not None:
            await self._appender.close()

    async def _end_stuck_appenders(self, older_than_ms: int) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.sm() as s, s.begin():
                    ended = await outbox.end_stuck_appenders(s, older_than_ms)
        except (OSError, SQLAlchemyError, TimeoutError) as e:
            log.warning("cannot end a stuck outbox append", error=str(e).splitlines()[0][:200])
            return
        if ended:
            self.stuck_ended += ended
            log.warning("ended the session of a manager stuck inside an outbox append (it held every "
                        "manager's appends)", sessions=ended, held_ms_over=older_than_ms)


def _lock_timeout(e: BaseException) -> bool:
    orig = getattr(e, "orig", None)
    return "LockNotAvailable" in type(orig).__name__ or "lock timeout" in str(e).lower()


HelloFacts = tuple[str | None, dict[str, str], int, int | None]  # domain, GPUs' nodes, last seq, epoch


class HelloCheck(Protocol):
    """What a hello is checked against (`StoreHelloView` or `WorldHelloView`)."""

    async def __call__(self, node: str, uuids: list[str]) -> HelloFacts: ...

    async def close(self) -> None: ...


class StoreHelloView:
    """What a hello is checked against, read from the database (several managers share it): the
    node's domain, the node each of these GPUs is registered on, the node's last durable report seq
    (applied, or stored and not applied yet: store/outbox.py's node_last_seq) and the leader epoch.
    On PostgreSQL out of any transaction, in one statement shared by every hello waiting
    (service/ingest/hello_view.py: a registration wave took a pooled connection per hello), through
    `engine` (the manager gives it one of its own: hello_view.py's `reader_engine`)."""

    def __init__(self, sm: async_sessionmaker[AsyncSession], engine: AsyncEngine | None = None) -> None:
        self.sm = sm
        reader = (engine.execution_options(isolation_level="AUTOCOMMIT")
                  if engine is not None and engine.dialect.name == "postgresql" else None)
        self.views = HelloViews(reader) if reader is not None else None

    async def __call__(self, node: str, uuids: list[str]) -> HelloFacts:
        if self.views is None:
            async with self.sm() as s:
                return (await outbox.node_domain(s, node), await outbox.gpu_owners(s, uuids),
                        await outbox.node_last_seq(s, node),
                        (await s.execute(select(LeaderRow.epoch).where(LeaderRow.id == 1))).scalar_one_or_none())
        v = await self.views.view(node, uuids)
        return v.domain, v.owners, v.last_seq, v.epoch

    async def close(self) -> None:
        if self.views is not None:
            await self.views.close()


class WorldHelloView:
    """The same facts from the leader's world (one manager alone: it leads, and its world is what
    the store holds), the node's last seq including the reports its in-memory outbox holds."""

    def __init__(self, world: Callable[[], World], pending_seq: Callable[[str], int], epoch: Callable[[], int]
                 ) -> None:
        self.world, self.pending_seq, self.epoch = world, pending_seq, epoch

    async def __call__(self, node: str, uuids: list[str]) -> HelloFacts:
        w = self.world()
        rec = w.nodes.get(node)
        owners = {u: w.gpus[u].node for u in uuids if u in w.gpus}
        last = max(rec.last_seq if rec is not None else 0, self.pending_seq(node))
        return (rec.domain if rec is not None else None), owners, last, self.epoch()

    async def close(self) -> None:
        pass


@dataclass
class StreamState:
    """What this manager knows of one agent stream it holds."""

    node: str
    gpus: frozenset[str]
    last_seq: int  # the last report seq durable (stored or applied)
    session: AgentSession = field(default_factory=lambda: AgentSession(""))


class AgentIngest:
    """The agent edge of every manager: hellos, reports, power read-backs, liveness."""

    def __init__(self, port: OutboxPort, sm: async_sessionmaker[AsyncSession], clock: Clock,
                 sessions: dict[str, AgentSession], on_sessions: Callable[[int], None],
                 view: HelloCheck) -> None:
        self.port = port
        self.sm = sm
        self.view = view  # what hellos are checked against (chosen at composition)
        self.clock = clock
        self.sessions = sessions  # shared with service/ingest/agents.py: where commands go
        self.on_sessions = on_sessions
        self.streams: dict[str, StreamState] = {}
        self.seen: set[str] = set()  # nodes heard from since the last liveness row
        self.hellos = 0
        self.reports = 0  # reports handed to the outbox

    async def hello(self, node: str, domain: str, gpus: list[GpuInventory], boot_id: str, agent_version: str,
                    principal: Principal, peer_fingerprint: str | None, peer: str = ""
                    ) -> tuple[AgentSession, int, int]:
        """Check and store a hello; its session, the last durable report seq, and the leader epoch."""
        check_hello(node, domain, gpus, boot_id, agent_version)
        problem = identity_problem(principal, node, peer_fingerprint)
        try:
            async with asyncio.timeout(self.port.timeout_s):
                if problem is not None:
                    await self._deny(principal, node, peer_fingerprint, peer, problem)
                known_domain, owners, last_seq, epoch = await self.view(node, [g.uuid for g in gpus])
        except (OSError, SQLAlchemyError, TimeoutError) as e:
            raise Unavailable("this manager cannot reach its database right now; try another manager") from e
        if problem is not None:
            raise PermissionDenied(problem)
        if known_domain is not None and known_domain != domain:
            raise InvalidArgument(f"hello.domain: node {node!r} is registered in domain {known_domain!r}, "
                                  f"not {domain!r}")
        for g in gpus:
            other = owners.get(g.uuid)
            if other is not None and other != node:
                raise InvalidArgument(f"hello.gpus: GPU {g.uuid} is already registered on node {other!r}")
        payload: dict[str, Any] = {
            "domain": domain, "boot_id": boot_id, "agent_version": agent_version, "token": principal.token_id,
            "peer": peer[:200],
            "gpus": [[g.uuid, g.index, g.model, g.memory_bytes, g.default_mw, g.min_mw, g.max_mw] for g in gpus]}
        # the session first: applying the hello sends the agent its caps through it (at once when
        # this manager applies its own outbox in memory)
        old = self.sessions.get(node)
        session = AgentSession(node)
        self.sessions[node] = session
        try:
            await self.port.submit(outbox.Entry(outbox.HELLO, node, payload, f"hello:{node}:{uuid.uuid4().hex}"))
        except BaseException:
            if self.sessions.get(node) is session:
                if old is not None and not old.closed:
                    self.sessions[node] = old
                else:
                    del self.sessions[node]
            raise
        self.hellos += 1
        if old is not None:
            old.close()
        self.streams[node] = StreamState(node, frozenset(g.uuid for g in gpus), last_seq, session)
        self.seen.add(node)
        self.on_sessions(len(self.sessions))
        return session, last_seq, int(epoch or 0)

    async def _deny(self, principal: Principal, node: str, fp: str | None, peer: str, problem: str) -> None:
        log.warning("agent identity refused", token=principal.token_id, node=node[:64], problem=problem)
        async with self.sm() as s, s.begin():
            s.add(AuditRow(at=self.clock.now(), actor=f"token:{principal.token_id}", action="agent.denied",
                           target=node[:256], before=None, reason=problem, request_id="",
                           after={"token": principal.token_id, "token_node": principal.node, "peer": peer[:200],
                                  "peer_fingerprint": fp}))

    def report(self, session: AgentSession, seq: int, gpus: list[GpuReport]) -> asyncio.Future[int]:
        """Store a report: the future resolves to the seq to acknowledge once it is durable."""
        try:
            st = self._checked(session, seq, gpus)
        except ServiceError as e:
            fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
            fut.set_exception(e)
            return fut
        self.seen.add(session.node)
        if st is None:  # a replay: durable already
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(seq)
            return fut
        payload = {"gpus": [[g.uuid, g.state, g.reasons, g.xids, g.enforced_mw] for g in gpus]}
        self.reports += 1
        # resolves to `seq` once durable (the port's future, no second one: a report is the hot path)
        return cast("asyncio.Future[int]", self.port.submit(outbox.Entry(
            outbox.REPORT, session.node, payload, f"report:{session.node}:{seq}", report_seq=seq, decoded=gpus)))

    def _checked(self, session: AgentSession, seq: int, gpus: list[GpuReport]) -> StreamState | None:
        check_report(seq, gpus)
        st = self.streams.get(session.node)
        if st is None or st.session is not session:
            raise Unavailable("this stream was replaced by a newer one of the same node")
        if seq <= st.last_seq:
            return None
        if seq != st.last_seq + 1:
            raise InvalidArgument(f"bad sequence number: expected {st.last_seq + 1}, got {seq}")
        for g in gpus:
            if g.uuid not in st.gpus:
                raise InvalidArgument(f"report.gpus: report from {session.node!r} names unknown GPU {g.uuid!r}")
            if g.state not in HEALTH_STATES:
                raise InvalidArgument(
                    f"report.gpus.state: GPU {g.uuid}: agents may report {sorted(HEALTH_STATES)}, not {g.state!r}")
        if len({g.uuid for g in gpus}) != len(gpus):
            raise InvalidArgument("report.gpus: a report names the same GPU twice")
        st.last_seq = seq  # the next report follows it (a failed store ends the stream)
        return st

    async def power(self, node: str, readings: list[tuple[str, int]]) -> None:
        check_power_readings(readings)
        st = self.streams.get(node)
        known = [[u, mw] for u, mw in readings if st is not None and u in st.gpus]
        if known:
            await self.port.submit(outbox.Entry(outbox.POWER, node, {"readings": known},
                                                  f"power:{node}:{uuid.uuid4().hex}"))

    def heartbeat(self, node: str) -> None:
        self.seen.add(node)

    def disconnect(self, session: AgentSession) -> None:
        session.closed = True
        st = self.streams.get(session.node)
        if st is not None and st.session is session:
            del self.streams[session.node]
        if self.sessions.get(session.node) is session:
            del self.sessions[session.node]
        self.on_sessions(len(self.sessions))

    def flush_seen(self) -> asyncio.Future[int | None] | None:
        """Store the nodes heard from since the last call and those whose streams are open here
        (one row): the leader counts them as seen."""
        nodes = sorted(self.seen.union(n for n, st in self.streams.items() if st.session.heard is not None))
        if not nodes:
            return None
        self.seen.clear()
        return self.port.submit(outbox.Entry(outbox.SEEN, "", {"nodes": nodes},
                                               f"seen:{self.port.me}:{uuid.uuid4().hex}"))
