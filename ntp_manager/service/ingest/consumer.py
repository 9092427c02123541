"""The leader applies the outbox in sequence order, on either store (service/ingest/port.py).

It reads the entries after its cursor (woken by the port: NOTIFY ntp_outbox on PostgreSQL, with a
poll every `fleet_poll_s` as a fallback; directly by the in-memory port of one manager on SQLite)
and applies a batch in one kernel transaction (service/core/kernel.py), which also moves the
cursor on PostgreSQL: the fence (the leader epoch) covers both, so each row is applied exactly
once, whichever manager leads, and a deposed leader applies nothing. A new leader loads the world
and starts from the cursor the last one left. In memory, the port resolves each entry's future
(the agent's ack) once that transaction has committed.

Each row is checked against the transaction's view before anything is written for it (the same
checks the leader's own path runs: service/ingest/agents.py); a row that fails them is quarantined
(`outbox_quarantine`, with its reason, and an `outbox.quarantine` audit row that keeps the entry
itself, its payload capped: store/outbox.py's quarantine_evidence) and the cursor moves past it;
the in-memory port fails its future with the reason (the agent is told, not acknowledged).
A batch that fails in any other way is applied again one row per transaction, and the row that
still fails is quarantined with the error's name: it never blocks the rest.

Batching: a batch costs about a dozen round trips to PostgreSQL (the read, the fence, the updates,
the cursor, the commit) whatever its size, several times what one row costs on its own
(bench/fleet_consumer.py). The outbox notifies on every append, so a consumer that read on every
notification would apply a few rows per transaction under a steady stream of reports. After a
batch smaller than a full one, it waits `fleet_apply_window_ms` before reading again: under load
one transaction per window; the first row after an idle period is still applied at once, and a
backlog (full batches: a takeover's replay) is read without waiting. A new leader's first
transaction carries at most FIRST rows: what was stored first is planned for while the rest is
applied. Rows are weighed by what they write (`weight`): a re-hello that changes nothing writes
its audit row only, so the re-hellos a failover moved are replayed in one transaction.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import timedelta
from typing import Any, Protocol

import structlog
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from ntp_manager.clock import Clock
from ntp_manager.service.core import policy
from ntp_manager.service.core.errors import ServiceError
from ntp_manager.service.core.inputs import GpuInventory, GpuReport
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.metrics import Metrics
from ntp_manager.service.core.state import GpuChange, World
from ntp_manager.service.feed.workers import KINDS as WORKER_KINDS
from ntp_manager.service.feed.workers import Applier
from ntp_manager.service.feed.workers import apply_row as apply_worker_row
from ntp_manager.service.ingest.agents import Agents, SetPower
from ntp_manager.service.ingest.outbox import Ingest
from ntp_manager.service.ingest.port import OutboxPort
from ntp_manager.service.leadership.leader import Leadership, NotLeader
from ntp_manager.service.planning.jobs import Jobs
from ntp_manager.settings import Settings
from ntp_manager.store import outbox


class ConsumerHost(Applier, Protocol):
    """What applying the outbox needs of the manager (service/manager.py is one)."""

    @property
    def epoch(self) -> int: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def clock(self) -> Clock: ...

    @property
    def sm(self) -> async_sessionmaker[AsyncSession]: ...

    @property
    def engine(self) -> AsyncEngine: ...

    @property
    def kernel(self) -> Kernel: ...

    @property
    def agents(self) -> Agents: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def leadership(self) -> Leadership: ...

    @property
    def jobs(self) -> Jobs: ...

log = structlog.get_logger("ntp.consumer")

BATCH = 2048  # rows applied in one transaction, at most
WEIGHT = 2048  # and at most this many rows written for them (below)
# The first transaction after this manager starts leading applies at most this many rows: what was
# stored first (a failure reported as the old leader died) is applied and planned for while the
# rest (the re-hellos of the agents the failover moved) is applied, not after it.
FIRST = 64


def weight(r: outbox.Stored, world: World | None = None) -> int:
    """About how many rows applying `r` writes: a hello one per GPU and the node and its audit row,
    a report one per GPU reported (its event) and the node; liveness rows write nothing. With the
    world it will be applied to: a re-hello that changes nothing there writes its audit row and at
    most its node's row (`unchanged_hello`), so a new leader's replay of the re-hellos that a
    failover moved goes in one transaction, not one per couple of hundred."""
    if r.kind == outbox.HELLO:
        gpus = r.payload.get("gpus", ())
        if world is not None and unchanged_hello(r.node, gpus, world):
            return 2
        return len(gpus) + 2
    if r.kind == outbox.REPORT:
        return len(r.payload.get("gpus", ())) + 1
    if r.kind == outbox.POWER:
        return len(r.payload.get("readings", ())) or 1
    return 1


def unchanged_hello(node: str, gpus: Any, world: World) -> bool:
    """Whether a hello of `node` with `gpus` (its stored payload's inventory rows) would change no
    GPU of `world`: the node is known with exactly these GPUs, each with the same inventory, and
    none to be brought back from silence (service/ingest/agents.py `_write_hello`). False for a
    payload it cannot read (its apply quarantines it)."""
    rec = world.nodes.get(node)
    try:
        if rec is None or len(gpus) != len(rec.gpus) or {str(g[0]) for g in gpus} != set(rec.gpus):
            return False
        for u, i, mo, mem, d, lo, hi in gpus:
            g = world.gpus.get(str(u))
            if g is None or g.node != node or (g.idx, g.model, g.memory_bytes, g.tdp_mw, g.min_mw, g.max_mw) != (
                    int(i), str(mo), int(mem), int(d), int(lo), int(hi)):
                return False
            if policy.reconnect(g.health, g.health_source).health is not None:
                return False
    except (TypeError, ValueError):
        return False
    return True


def batch_end(rows: list[outbox.Stored], budget: int = WEIGHT, world: World | None = None) -> int:
    """How many of `rows` (at least one) go into one transaction. Its fence holds the lease row
    `FOR KEY SHARE` until it commits, and a takeover waits for that (store/lease.py): a transaction
    of 2,048 hellos (16,000 GPU rows and more) took seconds on a loaded machine. (When the fence took
    `FOR SHARE`, the leader's own renewals waited as well, and it deposed itself.) Capped by what
    they write, a backlog of hellos goes a few hundred at a time, each transaction short."""
    total = 0
    for i, r in enumerate(rows):
        total += weight(r, world)
        if total > budget and i > 0:
            return i
    return len(rows)


class Consumer:
    def __init__(self, manager: ConsumerHost, port: OutboxPort | None = None) -> None:
        self.m = manager
        # the outbox it applies (service/ingest/port.py); by default the PostgreSQL table's
        self.port: OutboxPort = port if port is not None else Ingest(
            manager.sm, manager.settings.leader_id, manager.clock, 0.0, manager.settings.fleet_store_timeout_s,
            manager.engine, manager.settings.fleet_apply_window_ms / 1000)
        self.last = 0  # the cursor: the last row applied
        self.applied = 0  # rows applied by this manager
        self.quarantined = 0
        self.replays = 0  # reports whose seq was applied already (re-sent through another manager)
        self.started_at = 0  # the cursor when this manager started leading
        self.wake = asyncio.Event()
        self.caught_up = asyncio.Event()  # set once the rows stored before it started are applied
        self.apply_s = 0.0  # CPU-ish (wall) seconds spent inside apply, for the bench
        self.batches = 0  # transactions that applied rows
        self.pruned = 0  # applied rows this manager deleted (older than fleet_outbox_retention_s)
        self._next_prune = 0.0
        self._pending: list[outbox.Stored] = []  # read, not applied yet (batch_end cut them off)

    def _caught_up(self) -> None:
        if not self.caught_up.is_set():
            self.caught_up.set()
            log.info("outbox caught up", applied=self.applied, cursor=self.last, epoch=self.m.epoch,
                     batches=self.batches, apply_s=round(self.apply_s, 3))

    async def run(self) -> None:
        m = self.m
        self.last, head = await self.port.bounds()
        self.started_at = self.last
        log.info("applying the outbox", after=self.last, head=head, epoch=m.epoch)
        window = self.port.apply_window_s
        # the first prune a while after taking over, not in the way of the replay
        self._next_prune = time.monotonic() + min(60.0, m.settings.fleet_outbox_retention_s / 4)
        # stopping, it still applies what the port holds (in memory: entries whose agents wait for
        # their acks; Fleet.stop gives them a few seconds), then ends
        while not m.jobs.stopping or self.port.queued():
            try:
                if time.monotonic() >= self._next_prune:
                    self._next_prune = time.monotonic() + min(60.0, m.settings.fleet_outbox_retention_s / 4)
                    await self.prune()
                # rows read and not applied yet (a cut batch's rest) first: they follow the cursor
                backlog = bool(self._pending)
                if not backlog:  # cleared before the read: a notification during it is not lost
                    self.wake.clear()
                rows = self._pending or await self.read(self.port.batch_rows)
                if rows:
                    cut = batch_end(rows, self.port.batch_weight, m.kernel.world)
                    if self.batches == 0:
                        cut = min(cut, FIRST)
                    await self.apply(rows[:cut])
                    self._pending = rows[cut:]
                    if rows[cut - 1].seq >= head:
                        self._caught_up()
                    backlog = backlog or len(rows) == self.port.batch_rows or cut < len(rows)
                    if not backlog and window > 0:
                        await asyncio.sleep(window)  # let the next appends' rows gather into one batch
                    continue
                self._caught_up()
            except NotLeader:
                return  # the lease is gone: the process stops (service/leadership/leader.py)
            except (OSError, SQLAlchemyError) as e:
                log.warning("cannot read the outbox", error=str(e).splitlines()[0][:200])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), m.settings.fleet_poll_s)

    async def prune(self) -> int:
        """Delete the applied rows older than `fleet_outbox_retention_s`, a bounded number per call,
        fenced (a deposed leader deletes nothing: NotLeader), so the outbox holds what the managers
        stored in that period and what is not applied yet."""
        m = self.m
        before = m.clock.now() - timedelta(seconds=m.settings.fleet_outbox_retention_s)
        async with m.sm() as s, s.begin():
            await m.leadership.fence(s)
            n = await self.port.prune(s, self.last, before, m.epoch, m.clock.now())
        self.pruned += n
        if n:
            log.info("applied outbox rows pruned", rows=n, upto=self.last)
        return n

    async def read(self, limit: int) -> list[outbox.Stored]:
        """The next entries after the cursor."""
        return await self.port.read(self.last, limit)

    async def apply(self, rows: list[outbox.Stored]) -> None:
        t0 = time.perf_counter()
        try:
            await self._apply(rows)
        except (NotLeader, asyncio.CancelledError):
            raise
        except (OSError, SQLAlchemyError):
            raise  # the database: the caller tries again later, nothing moved
        except Exception as e:
            if len(rows) > 1:
                log.warning("an outbox batch failed; applying its rows one by one", rows=len(rows),
                            error=type(e).__name__)
                for r in rows:
                    await self.apply([r])
                return
            log.exception("an outbox row cannot be applied; quarantined", seq=rows[0].seq, kind=rows[0].kind)
            await self._quarantine_alone(rows[0], f"internal error applying it: {type(e).__name__}")
        finally:
            self.apply_s += time.perf_counter() - t0

    async def _apply(self, rows: list[outbox.Stored]) -> None:
        m = self.m
        bad: list[tuple[int, str]] = []
        failed: dict[int, ServiceError] = {}
        async with m.kernel.exclusive("outbox") as tx:
            for r in rows:
                tx.begin_item(f"agent:{r.node}" if r.node else f"manager:{r.manager}")
                try:
                    self._one(tx, r)
                except ServiceError as e:
                    bad.append((r.seq, e.message))
                    failed[r.seq] = e
                    tx.audit(tx.now, "outbox.quarantine", (r.node or r.kind)[:256], reason=e.message,
                             after=outbox.quarantine_evidence(r))
            tx.actor = "outbox"
            await self.port.record(tx.session, rows[-1].seq, bad, m.epoch, tx.now)
        self.last = rows[-1].seq
        self.port.applied(self.last, failed)
        self.batches += 1
        self.applied += len(rows) - len(bad)
        self.quarantined += len(bad)
        if bad:
            log.warning("outbox rows quarantined", rows=len(bad), first=bad[0][0], reason=bad[0][1][:200])

    async def _quarantine_alone(self, r: outbox.Stored, reason: str) -> None:
        async with self.m.kernel.exclusive("outbox") as tx:
            tx.audit(tx.now, "outbox.quarantine", (r.node or r.kind)[:256], reason=reason,
                     after=outbox.quarantine_evidence(r))
            await self.port.record(tx.session, r.seq, [(r.seq, reason)], self.m.epoch, tx.now)
        self.last = r.seq
        self.port.applied(r.seq, {r.seq: ServiceError(reason)})
        self.quarantined += 1

    def _one(self, tx: Tx, r: outbox.Stored) -> None:
        """Apply one row in `tx`; raises ServiceError (nothing written for it) when it cannot be."""
        agents = self.m.agents
        p = r.payload
        if r.kind == outbox.REPORT:
            assert r.report_seq is not None
            gpus: list[GpuReport] = r.decoded if r.decoded is not None else [
                GpuReport(str(u), str(st), [str(x) for x in rs], [int(x) for x in xs], None if mw is None else int(mw))
                for u, st, rs, xs, mw in p["gpus"]]
            n = tx.node(r.node)
            if n is not None and r.report_seq <= n.last_seq:
                self.replays += 1
                return
            agents.write_report(tx, r.node, r.report_seq, gpus)
            tx.after.append(self.m.metrics.reports.inc)
        elif r.kind == outbox.HELLO:
            inv = [GpuInventory(str(u), int(i), str(mo), int(mem), int(d), int(lo), int(hi))
                   for u, i, mo, mem, d, lo, hi in p["gpus"]]
            agents.write_hello(tx, r.node, str(p["domain"]), inv, str(p["boot_id"]), str(p["agent_version"]),
                               p.get("token"), str(p.get("peer", "")))
            tx.after.append(lambda: self._hello_applied(r.node))
        elif r.kind == outbox.POWER:
            for u, mw in p["readings"]:
                if tx.has_gpu(str(u)) and tx.gpu(str(u)).node == r.node:
                    tx.change_gpu(str(u), GpuChange(enforced_mw=int(mw)))
        elif r.kind == outbox.SEEN:
            nodes = [str(n) for n in p["nodes"]]
            tx.after.append(lambda: self._seen(nodes))
        elif r.kind in WORKER_KINDS:  # workers' acks and step reports, agents' telemetry
            apply_worker_row(self.m, tx, r)
        else:
            raise ServiceError(f"unknown outbox row kind {r.kind!r}")

    def _hello_applied(self, node: str) -> None:
        """As after a hello on the leader's own path: the node is seen and connected, and its agent
        is sent every cap it should hold (through whichever manager holds its stream)."""
        w = self.m.kernel.world
        rec = w.nodes.get(node)
        if rec is None:
            return
        self.m.agents.heartbeat(node)
        rec.connected = True
        for u in rec.gpus:
            mw = w.gpus[u].desired_mw
            if mw is not None:
                self.m.agents.send(node, SetPower(u, mw, "current layout"))

    def _seen(self, nodes: list[str]) -> None:
        """Another manager's liveness row: the nodes whose streams are open there (or that sent
        anything) are heard from now, and connected."""
        w = self.m.kernel.world
        self.m.agents.mark_open(nodes)
        for n in nodes:
            rec = w.nodes.get(n)
            if rec is not None:
                rec.connected = True
