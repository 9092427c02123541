"""The outbox port: how agents' and workers' news reaches the leader's consumer, on either store.

One design runs both stores (docs/design.md): every manager checks what its agents and workers
say (service/ingest/outbox.py's `AgentIngest`, service/feed/workers.py) and hands it to the
outbox; the leader's consumer (service/ingest/consumer.py) applies it in sequence order in kernel
transactions. They speak to the outbox only through `OutboxPort`, which has two implementations,
chosen once by the composition root (service/manager.py):

- `Ingest` (service/ingest/outbox.py): the PostgreSQL table several managers share. An entry is
  durable once its row has committed (group-committed); the consumer reads the rows after its
  cursor and moves the cursor in the transaction that applies them.
- `MemoryOutbox` (here): one manager alone (SQLite). Entries are handed to the consumer in memory,
  so "stored" is not durable by itself: an entry's future resolves only once the consumer's
  kernel transaction that applied it has committed (durable = applied). The consumer is woken
  directly. A row that cannot be applied is still quarantined durably (`outbox_quarantine`, and
  the consumer's `outbox.quarantine` audit row, which keeps the entry's payload, capped: the only
  durable copy of it here) and its future fails with the reason, so the agent is told, never
  acknowledged.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from itertools import islice
from typing import Protocol

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ntp_manager.service.core.errors import ServiceError, Unavailable
from ntp_manager.store import outbox
from ntp_manager.store.models import OutboxQuarantineRow


class OutboxPort(Protocol):
    """What the ingest (storing side) and the consumer (applying side) need of an outbox."""

    me: str  # this manager (the rows' `manager`)
    timeout_s: float  # a store slower than this answers UNAVAILABLE
    apply_window_s: float  # the consumer's pause after a small batch, to let the next ones gather
    batch_rows: int  # entries the consumer reads at once, at most
    batch_weight: int  # and about how many rows one transaction of it writes, at most (consumer.batch_end)
    on_append: Callable[[], None]  # wakes the consumer (set when it runs)

    async def open(self) -> None:
        """Before the first entry: whatever the port reads from the store to number its entries."""
        ...

    def start(self) -> None: ...

    async def stop(self, timeout: float = 5.0) -> None:
        """Take no more entries; what is queued is given `timeout` to become durable."""
        ...

    def queued(self) -> int:
        """Entries taken and not durable yet (the one being stored is not counted)."""
        ...

    def submit(self, entry: outbox.Entry) -> asyncio.Future[int | None]:
        """Take `entry`: the future resolves to its `report_seq` once it is durable, or fails
        (Unavailable; with the in-memory port, also the reason it was quarantined)."""
        ...

    def pending_seq(self, node: str) -> int:
        """The newest report seq of `node` taken and not applied yet (0: none) that the store
        itself does not show (the in-memory port's; the table's are in its rows)."""
        ...

    async def bounds(self) -> tuple[int, int]:
        """(the cursor: the last entry applied, the head: the newest entry taken)."""
        ...

    async def head(self) -> int: ...

    async def read(self, after: int, limit: int) -> list[outbox.Stored]:
        """Up to `limit` entries after `after`, in sequence order."""
        ...

    async def record(self, session: AsyncSession, upto: int, bad: Sequence[tuple[int, str]], epoch: int,
                     now: datetime) -> None:
        """In the consumer's (fenced) transaction: the quarantined entries and the cursor."""
        ...

    def applied(self, upto: int, failed: Mapping[int, ServiceError]) -> None:
        """After that transaction committed: entries up to `upto` are applied (`failed`: those
        quarantined, with why)."""
        ...

    async def prune(self, session: AsyncSession, upto: int, before: datetime, epoch: int, now: datetime) -> int:
        """Delete applied entries stored before `before` (in the consumer's fenced transaction)."""
        ...


class _Taken:
    __slots__ = ("fut", "row")

    def __init__(self, row: outbox.Stored, fut: asyncio.Future[int | None]) -> None:
        self.row, self.fut = row, fut


class MemoryOutbox:
    """One manager alone (SQLite): the outbox handed to the consumer in memory (module docstring).

    Sequence numbers continue after the highest one quarantined so far (`open`), so that a
    quarantine row of this run never collides with one of an earlier run."""

    def __init__(self, sm: async_sessionmaker[AsyncSession], me: str, window_s: float, timeout_s: float) -> None:
        self.sm, self.me = sm, me
        self.apply_window_s = window_s
        self.timeout_s = timeout_s
        # no lease row held by a batch here (one manager): as large as the kernel's group commits
        self.batch_rows, self.batch_weight = 4096, 8192
        self.on_append: Callable[[], None] = lambda: None
        self._rows: deque[_Taken] = deque()  # taken, not applied yet, in sequence order
        self._seq = 0  # the newest entry taken
        self._applied = 0  # the cursor
        self._reports: dict[str, int] = {}  # node -> its newest report seq taken, not applied yet
        self._open = False
        self.taken = 0
        self.quarantined = 0

    async def open(self) -> None:
        async with self.sm() as s:
            top = (await s.execute(select(func.max(OutboxQuarantineRow.seq)))).scalar_one_or_none()
        if not self._rows:
            self._seq = self._applied = max(self._seq, int(top or 0))
        self._open = True

    def start(self) -> None:
        pass

    async def stop(self, timeout: float = 5.0) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        self._open = False
        while self._rows and loop.time() < end:
            self.on_append()
            await asyncio.sleep(0.005)
        err = Unavailable("this manager is stopping; try again")
        while self._rows:
            t = self._rows.popleft()
            if not t.fut.done():
                t.fut.set_exception(err)
        self._reports.clear()

    def queued(self) -> int:
        return len(self._rows)

    def submit(self, entry: outbox.Entry) -> asyncio.Future[int | None]:
        fut: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        if not self._open:
            fut.set_exception(Unavailable("this manager is not taking agent reports (starting or stopping)"))
            return fut
        self._seq += 1
        self._rows.append(_Taken(outbox.Stored(self._seq, entry.kind, entry.node, entry.report_seq, entry.payload,
                                               self.me, entry.decoded), fut))
        if entry.report_seq is not None:
            self._reports[entry.node] = max(self._reports.get(entry.node, 0), entry.report_seq)
        self.taken += 1
        self.on_append()
        return fut

    def pending_seq(self, node: str) -> int:
        return self._reports.get(node, 0)

    async def bounds(self) -> tuple[int, int]:
        return self._applied, self._seq

    async def head(self) -> int:
        return self._seq

    async def read(self, after: int, limit: int) -> list[outbox.Stored]:
        rows = self._rows
        start = 0
        while start < len(rows) and rows[start].row.seq <= after:  # applied already (not the case in order)
            start += 1
        return [t.row for t in islice(rows, start, start + limit)]

    async def record(self, session: AsyncSession, upto: int, bad: Sequence[tuple[int, str]], epoch: int,
                     now: datetime) -> None:
        await outbox.quarantine(session, bad, epoch, now)  # durable with the batch; nothing else to move

    def applied(self, upto: int, failed: Mapping[int, ServiceError]) -> None:
        self._applied = max(self._applied, upto)
        rows = self._rows
        while rows and rows[0].row.seq <= upto:
            t = rows.popleft()
            r = t.row
            if r.report_seq is not None and self._reports.get(r.node, 0) <= r.report_seq:
                self._reports.pop(r.node, None)
            if t.fut.done():
                continue
            err = failed.get(r.seq)
            if err is not None:
                self.quarantined += 1
                t.fut.set_exception(err)
            else:
                t.fut.set_result(r.report_seq)

    async def prune(self, session: AsyncSession, upto: int, before: datetime, epoch: int, now: datetime) -> int:
        return 0  # nothing applied is kept
