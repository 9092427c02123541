"""The kernel: the in-memory world, its write lock, the transaction, and the dirty set.

Every change to durable state is made inside a `Tx`. A component states what changes as typed
values (`GpuChange`, `NodeChange`, new nodes and GPUs, health events, audit records, ORM rows); the
transaction writes them (bulk statements, no row is read back) and, only after the database has
committed, the kernel applies the very same values to the in-memory records, marks the jobs whose
GPUs changed state dirty, and runs what the components asked to run after the commit (acks,
pushes, commands). So what a client is told has happened is already durable, and memory never
shows what the store does not hold. Inside a transaction, `tx.gpu()` / `tx.node()` give the record
as it will be once the transaction commits.

Two ways in:
- `exclusive()`: a transaction of its own (operator actions, replans: rare, may read and fail).
- `submit(fn)`: group commit. Agent reports, heartbeat-driven transitions and registrations are
  queued; the committer runs whatever is queued when the previous commit finishes (after a
  `window_s` pause when it was idle) as one transaction, then resolves every caller. A function
  given to `submit` checks what it needs before it writes; if one still raises, the batch is rolled
  back and each of its functions is run again in a transaction of its own, so one bad item never
  takes the others with it.

Fencing: every transaction first runs `fence` (service/leadership/leader.py), which reads the leader epoch in
that same transaction and refuses to commit unless this manager still leads at it; a group commit
refused that way fails all its callers at once (none of them could commit here).

The manager is the only writer of GPUs and nodes, so the in-memory world plus a transaction's
pending changes is exactly what the store holds: nothing on the hot paths reads rows back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol, TypeVar

import structlog
from sqlalchemy import Table, bindparam, insert, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ntp_manager.clock import Clock
from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.state import SHAPE_FIELDS, GpuChange, GpuRec, NodeChange, NodeRec, World, apply
from ntp_manager.service.leadership.leader import NotLeader
from ntp_manager.store import pgbulk
from ntp_manager.store.models import AuditRow, DomainRow, GpuRow, HealthEventRow, NodeRow

log = structlog.get_logger("ntp.kernel")
T = TypeVar("T")

MAX_BATCH = 4096  # items in one group commit


class Tx:
    """One transaction: its session, who acts, and the changes it will publish on commit."""

    def __init__(self, kernel: Kernel, session: AsyncSession, actor: str, request_id: str = "") -> None:
        self.kernel = kernel
        self.session = session
        self.actor = actor
        self.request_id = request_id
        self.now: datetime = kernel.clock.now()
        self.after: list[Callable[[], Any]] = []
        self.newly_failed: list[str] = []  # GPUs this transaction fails (health -> failed)
        self.state_changed: dict[str, None] = {}  # GPUs whose effective state changes (ordered set)
        self.shape_changed = False  # GPUs added, or their index or limits changed
        self.jobs_touched: dict[str, None] = {}  # jobs whose row, layout or domains this transaction writes
        self._gpus: dict[str, GpuChange] = {}
        self._views: dict[str, GpuRec] = {}
        self._nodes: dict[str, NodeChange] = {}
        self._node_views: dict[str, NodeRec] = {}
        self._new_domains: list[str] = []
        self._new_nodes: dict[str, NodeRec] = {}
        self._new_gpus: dict[str, GpuRec] = {}
        self._events: list[dict[str, Any]] = []
        self._audits: list[dict[str, Any]] = []

    def begin_item(self, actor: str) -> None:
        """Start the next caller's part of a group commit."""
        self.actor = actor
        self.now = self.kernel.clock.now()

    # ---- what the transaction sees ----------------------------------------------------------
    def gpu(self, uuid: str) -> GpuRec:
        """The GPU as it will be once this transaction commits. KeyError when unknown."""
        return self._new_gpus.get(uuid) or self._views.get(uuid) or self.kernel.world.gpus[uuid]

    def has_gpu(self, uuid: str) -> bool:
        return uuid in self.kernel.world.gpus or uuid in self._new_gpus

    def node(self, name: str) -> NodeRec | None:
        return self._new_nodes.get(name) or self._node_views.get(name) or self.kernel.world.nodes.get(name)

    @property
    def new_gpu_count(self) -> int:
        return len(self._new_gpus)

    def has_domain(self, domain: str) -> bool:
        return domain in self.kernel.world.domains or domain in self._new_domains

    def gpu_changes(self) -> Iterator[tuple[str, GpuChange]]:
        return iter(self._gpus.items())

    # ---- changes ----------------------------------------------------------------------------
    def touch_job(self, name: str) -> None:
        """This transaction writes `name`'s job row, a layout of it or what it holds: the other
        managers reload that job from the store once it commits (service/leadership/follow.py)."""
        self.jobs_touched[name] = None

    def change_gpu(self, uuid: str, change: GpuChange) -> None:
        if not change:
            return
        before = self.gpu(uuid)
        old_state, old_health, old_speed = before.state, before.health, before.planned_speed
        new = self._new_gpus.get(uuid)
        if new is not None:  # added in this transaction: the insert carries it
            apply(new, change)
            view = new
        else:
            view = self._views.get(uuid) or self.kernel.world.gpus[uuid].copy()
            apply(view, change)
            self._views[uuid] = view
            prior = self._gpus.get(uuid)
            self._gpus[uuid] = change if prior is None else {**prior, **change}
        if view.state != old_state or view.planned_speed != old_speed:  # what the planner sees changes
            self.state_changed[uuid] = None
        if view.health == GpuState.FAILED and old_health != GpuState.FAILED:
            self.newly_failed.append(uuid)
        if not SHAPE_FIELDS.isdisjoint(change):
            self.shape_changed = True

    def change_node(self, name: str, change: NodeChange) -> None:
        if not change:
            return
        new = self._new_nodes.get(name)
        if new is not None:
            apply(new, change)
            return
        view = self._node_views.get(name) or self.kernel.world.nodes[name].copy()
        apply(view, change)
        self._node_views[name] = view
        prior = self._nodes.get(name)
        self._nodes[name] = change if prior is None else {**prior, **change}

    def written(self) -> tuple[list[str], list[NodeRec], list[GpuRec]]:
        """What this transaction writes to the world, as it will be once it commits: the domains it
        adds, and every node and GPU it adds or changes (whole records)."""
        nodes = [*self._new_nodes.values(), *(self._node_views[n] for n in self._nodes)]
        gpus = [*self._new_gpus.values(), *(self._views[u] for u in self._gpus)]
        return list(self._new_domains), nodes, gpus

    def rows_written(self) -> int:
        """The rows committing this transaction writes through the kernel: domains, nodes and GPUs
        added, nodes and GPUs changed, health events and audit records (ORM rows a caller added to
        its session are not counted)."""
        return (len(self._new_domains) + len(self._new_nodes) + len(self._new_gpus) + len(self._nodes)
                + len(self._gpus) + len(self._events) + len(self._audits))

    @property
    def gpus_written(self) -> list[str]:
        """The GPUs this transaction adds or changes (any column, effective state or not)."""
        return [*self._new_gpus, *self._gpus]

    def add_domain(self, domain: str) -> None:
        if not self.has_domain(domain):
            self._new_domains.append(domain)

    def add_node(self, rec: NodeRec) -> None:
        self.add_domain(rec.domain)
        self._new_nodes[rec.name] = rec

    def add_gpu(self, rec: GpuRec) -> None:
        """A new GPU of a node known to this transaction; it gets its position here."""
        if rec.pos < 0:
            rec.pos = self.kernel.world.take_pos()
        self._new_gpus[rec.uuid] = rec
        self.shape_changed = True

    def event(self, gpu: GpuRec, new_state: GpuState, reasons: list[str], source: str, seq: int | None = None,
              xids: list[int] | None = None) -> None:
        """A health event of `gpu` (its state before this change is read from `gpu`)."""
        self._events.append({"at": self.now, "gpu_uuid": gpu.uuid, "node": gpu.node, "seq": seq, "source": source,
                             "old_state": gpu.health, "new_state": new_state, "reasons": reasons,
                             "xids": xids or []})

    def audit(self, now: datetime, action: str, target: str, before: Any = None, after: Any = None,
              reason: str = "") -> None:
        self._audits.append({"at": now, "actor": self.actor, "action": action, "target": target, "before": before,
                             "after": after, "reason": reason, "request_id": self.request_id})

    # ---- commit -----------------------------------------------------------------------------
    async def flush(self) -> None:
        """Write everything staged: inserts, then ORM rows, then updates, events and audits. On
        PostgreSQL through asyncpg each table's rows go as one statement with the rows as arrays
        (store/pgbulk.py: no per-row parameter processing in SQLAlchemy), elsewhere as an executemany."""
        s, now = self.session, self.now
        writer: _Writer = _PgWriter(s) if pgbulk.usable(s) else _OrmWriter(s)
        await writer.insert(DOMAINS, [{"id": d, "power_budget_w": None, "created_at": now} for d in self._new_domains])
        await writer.insert(NODES, [
            {"name": n.name, "domain_id": n.domain, "boot_id": n.boot_id, "agent_version": n.agent_version,
             "last_seq": n.last_seq, "drain_deadline": n.drain_deadline, "drain_reason": n.drain_reason,
             "registered_at": now} for n in self._new_nodes.values()])
        await writer.insert(GPUS, [_gpu_row(g, now) for g in self._new_gpus.values()])
        await s.flush()
        for table, key, every, changes, views in ((NODES, "name", NODE_COLUMNS, self._nodes, self._node_views),
                                                  (GPUS, "uuid", GPU_COLUMNS, self._gpus, self._views)):
            if changes:
                columns = _columns_set(table.name, every, changes.values())
                await writer.update(table, key, columns, [_update_row(columns, pk, views[pk]) for pk in changes])
        await writer.insert(EVENTS, self._events)
        await writer.insert(AUDIT, self._audits)

    def publish(self, world: World) -> None:
        """Apply the committed changes to memory (the same values the rows got)."""
        for d in self._new_domains:
            world.domains.setdefault(d, None)
        world.nodes.update(self._new_nodes)
        for name, nch in self._nodes.items():
            apply(world.nodes[name], nch)
        for uuid, rec in self._new_gpus.items():
            world.gpus[uuid] = rec
            world.by_pos[rec.pos] = uuid
            world.nodes[rec.node].gpus.append(uuid)
        for uuid, gch in self._gpus.items():
            apply(world.gpus[uuid], gch)


def _gpu_row(g: GpuRec, now: datetime) -> dict[str, Any]:
    return {"uuid": g.uuid, "pos": g.pos, "node": g.node, "domain_id": g.domain, "idx": g.idx, "model": g.model,
            "memory_bytes": g.memory_bytes, "tdp_mw": g.tdp_mw, "min_mw": g.min_mw, "max_mw": g.max_mw,
            "health": g.health, "health_reason": g.health_reason, "health_source": g.health_source,
            "health_since": g.health_since or now, "admin": g.admin, "admin_owner": g.admin_owner,
            "admin_reason": g.admin_reason, "desired_mw": g.desired_mw, "enforced_mw": g.enforced_mw,
            "speed": g.speed}


# Core tables: bulk statements with no ORM bookkeeping (the identity map never holds these rows).
def _table(model: Any) -> Table:
    table = model.__table__
    assert isinstance(table, Table)
    return table


DOMAINS, NODES, GPUS = _table(DomainRow), _table(NodeRow), _table(GpuRow)
EVENTS, AUDIT = _table(HealthEventRow), _table(AuditRow)


GPU_COLUMNS = tuple(GpuChange.__annotations__)  # every column a change may set
NODE_COLUMNS = tuple(NodeChange.__annotations__)
_UPDATES: dict[tuple[str, tuple[str, ...]], Any] = {}
_COLUMN_SETS: dict[str, set[tuple[str, ...]]] = {}  # the column sets each table's updates used so far
COLUMN_SETS_MAX = 32  # then every column: one prepared statement per set, and their number stays bounded


def _columns_set(table: str, every: tuple[str, ...], changes: Iterable[Mapping[str, Any]]) -> tuple[str, ...]:
    """The columns a transaction's updates of `table` write: those any of its changes set, in the
    order of `every`. Each row gets all of them from its record as it will be (`_update_row`), so a
    row whose change set fewer of them is written its current values there: one statement still,
    and a batch of health reports writes 4 of a GPU's 16 columns rather than all of them."""
    keys: set[str] = set()
    for ch in changes:
        keys.update(ch)
    columns = tuple(c for c in every if c in keys)
    if not columns:  # (a change sets at least one: Tx.change_gpu and change_node drop empty ones)
        return every
    seen = _COLUMN_SETS.setdefault(table, set())
    if columns not in seen:
        if len(seen) >= COLUMN_SETS_MAX:
            return every
        seen.add(columns)
    return columns


class _Writer(Protocol):
    """How a transaction's bulk rows reach the store (`Tx.flush`)."""

    async def insert(self, table: Table, rows: list[dict[str, Any]]) -> None: ...

    async def update(self, table: Table, key: str, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
        """Each row (its key under "pk_") gets every one of `columns`: the record as it is plus this
        transaction's changes, which is what the commit then applies to the record itself. (One
        statement however the changes vary, `columns` the union of what they set: a group commit's
        cost does not grow with their kinds, and a batch of reports writes only the health columns.)"""


class _OrmWriter:
    """SQLAlchemy Core executemany (SQLite, and PostgreSQL through another driver)."""

    def __init__(self, session: AsyncSession) -> None:
        self.s = session

    async def insert(self, table: Table, rows: list[dict[str, Any]]) -> None:
        if rows:
            await self.s.execute(insert(table), rows)

    async def update(self, table: Table, key: str, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
        stmt = _UPDATES.get((table.name, columns))
        if stmt is None:
            stmt = update(table).where(table.c[key] == bindparam("pk_")).values({c: bindparam(c) for c in columns})
            _UPDATES[(table.name, columns)] = stmt
        await self.s.execute(stmt, rows)


class _PgWriter:
    """One statement per table, the rows as arrays (store/pgbulk.py)."""

    def __init__(self, session: AsyncSession) -> None:
        self.s = session

    async def insert(self, table: Table, rows: list[dict[str, Any]]) -> None:
        await pgbulk.insert(self.s, table, rows)

    async def update(self, table: Table, key: str, columns: tuple[str, ...], rows: list[dict[str, Any]]) -> None:
        await pgbulk.update(self.s, table, key, columns, rows)


def _update_row(columns: tuple[str, ...], pk: str, view: Any) -> dict[str, Any]:
    row = {c: getattr(view, c) for c in columns}
    row["pk_"] = pk
    return row


@dataclass
class _Item:
    actor: str
    fn: Callable[[Tx], Awaitable[Any]]
    fut: asyncio.Future[Any]


Hook = Callable[[Tx], Awaitable[None]]
Reaction = Callable[[Tx], None]


class Kernel:
    """The world, its lock, transactions (exclusive and group-committed) and the dirty set."""

    def __init__(self, sm: async_sessionmaker[AsyncSession], clock: Clock, world: World | None = None,
                 window_s: float = 0.0) -> None:
        self.sm = sm
        self.clock = clock
        self.world = world or World()
        self.lock = asyncio.Lock()
        self.window_s = window_s
        self.dirty: set[str] = set()
        self.wake = asyncio.Event()
        self.before_commit: list[Hook] = []  # run inside every transaction, after its work
        self.after_commit: list[Reaction] = []  # run after every commit, once memory is updated
        # run first in every transaction's commit: refuses it (NotLeader) unless this manager leads
        # at the epoch the database holds (service/leadership/leader.py); None: no check (a CLI, a test)
        self.fence: Callable[[AsyncSession], Awaitable[None]] | None = None
        self.batches = 0  # group commits made (for tests and metrics)
        self.batched = 0  # items those group commits carried (batched / batches: how well they group)
        self.split = 0  # failed group commits whose items were run again one by one
        self._queue: deque[_Item] = deque()
        self._kick = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._alone: set[asyncio.Task[None]] = set()
        self._busy = False

    # ---- exclusive transactions ---------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def exclusive(self, actor: str, request_id: str = "") -> AsyncIterator[Tx]:
        """A transaction of its own, under the write lock; published when the block ends cleanly."""
        async with self.lock:
            async with self.sm() as s, s.begin():
                tx = Tx(self, s, actor, request_id)
                yield tx
                await self._finish(tx)
            self._publish(tx)

    # ---- group commit -------------------------------------------------------------------------
    async def submit(self, actor: str, fn: Callable[[Tx], Awaitable[T]]) -> T:
        """Run `fn` in the next group commit; returns its result once that commit is durable and
        published. `fn` must check before it writes (see the module docstring)."""
        return await self.enqueue(actor, fn)

    def enqueue(self, actor: str, fn: Callable[[Tx], Awaitable[T]]) -> asyncio.Future[T]:
        """`submit` without waiting: the future resolves once the commit is durable and published.
        Items are committed in the order they were enqueued."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        item = _Item(actor, fn, fut)
        if self._task is None:  # no committer (a CLI, or not started): a transaction of its own
            task = loop.create_task(self._run_alone(item))
            self._alone.add(task)
            task.add_done_callback(self._alone.discard)
        else:
            self._queue.append(item)
            self._kick.set()
        return fut

    async def _run_alone(self, item: _Item) -> None:
        await self._run([item])

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._committer(), name="group-commit")

    async def stop(self, timeout: float = 10.0) -> None:
        """Commit what is queued, then stop the committer."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while (self._queue or self._busy) and loop.time() < end:
            await asyncio.sleep(0.005)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        while self._queue:
            item = self._queue.popleft()
            if not item.fut.done():
                item.fut.cancel()

    async def _committer(self) -> None:
        while True:
            await self._kick.wait()
            self._kick.clear()
            if self.window_s > 0 and len(self._queue) < MAX_BATCH:
                await asyncio.sleep(self.window_s)  # idle until now: let a burst gather
            while self._queue:
                batch = [self._queue.popleft() for _ in range(min(len(self._queue), MAX_BATCH))]
                self._busy = True
                try:
                    await self._run(batch)
                finally:
                    self._busy = False

    async def _run(self, items: list[_Item]) -> None:
        results: list[Any] = []
        try:
            async with self.lock:
                async with self.sm() as s, s.begin():
                    tx = Tx(self, s, items[0].actor)
                    for item in items:
                        tx.begin_item(item.actor)
                        results.append(await item.fn(tx))
                    await self._finish(tx)
                self._publish(tx)
        except asyncio.CancelledError:
            for item in items:
                if not item.fut.done():
                    item.fut.cancel()
            raise
        except NotLeader as e:  # no item of it can commit here: none is tried again
            for item in items:
                if not item.fut.done():
                    item.fut.set_exception(e)
            return
        except Exception as e:
            if len(items) == 1:
                if not items[0].fut.done():
                    items[0].fut.set_exception(e)
                return
            log.info("group commit failed; running its items one by one", items=len(items), error=type(e).__name__)
            self.split += 1
            for item in items:
                await self._run([item])
            return
        self.batches += 1
        self.batched += len(items)
        for item, result in zip(items, results, strict=True):
            if not item.fut.done():
                item.fut.set_result(result)

    async def _finish(self, tx: Tx) -> None:
        if self.fence is not None:
            await self.fence(tx.session)
        for hook in self.before_commit:
            await hook(tx)
        await tx.flush()

    def _publish(self, tx: Tx) -> None:
        w = self.world
        tx.publish(w)
        if tx.shape_changed:
            w.invalidate()
            self.mark_all_dirty()
        elif tx.state_changed:
            w.apply_states(tx.state_changed)
            self.mark_dirty_for(tx.state_changed)
        for react in self.after_commit:
            react(tx)
        for fn in tx.after:
            fn()

    # ---- the dirty set ------------------------------------------------------------------------
    def mark_dirty_for(self, uuids: Any) -> None:
        """Jobs owning these GPUs' domains need a replan (a job plans only on the domains it owns:
        service/planning/ownership.py); no other job's layout can change."""
        domains = {self.world.gpus[u].domain for u in uuids}
        for job in self.world.jobs.values():
            if not domains.isdisjoint(job.held):
                self.dirty.add(job.name)
        self.wake.set()

    def mark_all_dirty(self) -> None:
        self.dirty.update(self.world.jobs)
        self.wake.set()
