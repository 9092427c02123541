"""What a hello is checked against on PostgreSQL, read for many hellos at once.

An agent's hello is checked against the database (service/ingest/outbox.py's `AgentIngest`): the
domain its node is registered in, the node each of its GPUs is registered on, the node's last
durable report seq (applied, or stored and not applied yet) and the leader epoch to welcome it
with. Read one hello at a time, a registration wave of thousands of agents took a pooled connection
per hello: past the pool's size each one was a new connection (TCP, TLS negotiation, asyncpg's type
introspection, every statement prepared again), the largest part of a hello's CPU on a standby
(bench/RESULTS.md). `HelloViews` reads for every hello waiting when the previous read ends, in one
statement on one connection: a hello alone is read at once, a wave in a few round trips, at most
MAX_READS at a time.

The statement is planned for each read's own arrays (`reader_engine`: its connections set
`plan_cache_mode = force_custom_plan`, store/db.py). A prepared statement is planned generically
after five runs, with the table sizes of that moment and without the arrays' values; planned at the
start of a registration wave, when the tables held a few rows, that plan scans every GPU row and
compares each with every one of the batch's GPUs, one after the other. At 100,000 GPUs that is
200 million comparisons for a batch of 256 hellos, seconds of PostgreSQL's CPU each, and the plan
stays while no ANALYZE replaces it (bench/RESULTS.md: a standby's SIGKILL at 12,500 agents, before
and after). Planned for the values, the GPUs are looked up by key on a large table, and on a small
one the scan tests each row against a hash of the batch's GPUs: linear either way.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from ntp_manager.store import db

MAX_HELLOS = 256  # hellos in one read (their GPUs are bounded by the hello's own checks)
MAX_READS = 4  # reads at once: a slow one does not hold every hello behind it (a connection each)

# $1: the nodes, $2: every GPU of their hellos (run through the driver: no SQLAlchemy around it)
VIEWS = (
    "SELECT (SELECT json_agg(json_build_array(q.n, nd.domain_id, nd.last_seq, "
    "(SELECT max(o.report_seq) FROM outbox o WHERE o.node = q.n)))::text "
    "FROM unnest($1::varchar[]) AS q(n) LEFT JOIN nodes nd ON nd.name = q.n), "
    "(SELECT json_object_agg(uuid, node)::text FROM gpus WHERE uuid = ANY($2::varchar[])), "
    "(SELECT epoch FROM leader WHERE id = 1)"
)


def reader_engine(url: str, application_name: str) -> AsyncEngine:
    """An engine for `HelloViews` to read through (in autocommit: `execution_options`): connections
    of its own, as many as it reads at once, each statement planned for its values."""
    return db.make_engine(url, application_name, pool_size=MAX_READS, custom_plans=True)


@dataclass(frozen=True, slots=True)
class HelloView:
    domain: str | None  # the node's registered domain (None: not registered)
    owners: dict[str, str]  # GPU -> the node it is registered on, for this hello's GPUs that are
    last_seq: int  # the node's last durable report seq
    epoch: int | None  # the leader epoch (None: nobody has led yet)


class HelloViews:
    """Up to MAX_READS reads at a time; the hellos that arrive meanwhile wait for the next one, all
    together. Each read is one statement through the driver on a connection kept for it
    (store/db.py `KeptConnection`: a session or a pool checkout around a small read cost more CPU
    than the read itself); `close` gives them back."""

    def __init__(self, reader: AsyncEngine, max_reads: int = MAX_READS, timeout_s: float = 10.0) -> None:
        self.max_reads = max_reads
        self.connections = [db.KeptConnection(reader, timeout_s) for _ in range(max_reads)]
        self._free = list(self.connections)  # a read takes one (no more reads run than there are)
        self.reads = 0  # statements run
        self.hellos = 0  # hellos answered by them
        self._waiting: list[tuple[str, list[str], asyncio.Future[HelloView]]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def view(self, node: str, uuids: list[str]) -> HelloView:
        """The view for one hello; raises OSError (the database could not be read) like a read of
        its own would (the caller answers UNAVAILABLE), or its caller's timeout."""
        fut: asyncio.Future[HelloView] = asyncio.get_running_loop().create_future()
        self._waiting.append((node, uuids, fut))
        if len(self._tasks) < self.max_reads:
            task = asyncio.get_running_loop().create_task(self._drain(), name="hello-views")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await fut

    async def _drain(self) -> None:
        while self._waiting:
            batch, self._waiting = self._waiting[:MAX_HELLOS], self._waiting[MAX_HELLOS:]
            batch = [b for b in batch if not b[2].done()]  # a caller that timed out is not read for
            if not batch:
                continue
            try:
                views = await self._read([b[0] for b in batch], [b[1] for b in batch])
            except asyncio.CancelledError:
                for *_, fut in batch:
                    fut.cancel()
                raise
            except Exception as e:  # each caller gets an error of its own, naming what went wrong
                reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
                for *_, fut in batch:
                    if not fut.done():
                        fut.set_exception(OSError(f"cannot read the hello checks: {reason}"))
                continue
            for (_, _, fut), v in zip(batch, views, strict=True):
                if not fut.done():
                    fut.set_result(v)

    async def close(self) -> None:
        for c in self.connections:
            await c.close()

    async def _read(self, nodes: list[str], uuids: Sequence[list[str]]) -> list[HelloView]:
        every = sorted({u for us in uuids for u in us})
        kept = self._free.pop()
        try:
            row = (await kept.fetch(VIEWS, nodes, every))[0]
        finally:
            self._free.append(kept)
        self.reads += 1
        self.hellos += len(nodes)
        per_node = {str(n): (d, max(int(applied or 0), int(stored or 0)))
                    for n, d, applied, stored in (json.loads(row[0]) if row[0] else [])}
        owners = {str(k): str(v) for k, v in (json.loads(row[1]) if row[1] else {}).items()}
        epoch = None if row[2] is None else int(row[2])
        out = []
        for node, us in zip(nodes, uuids, strict=True):
            domain, last = per_node.get(node, (None, 0))
            out.append(HelloView(None if domain is None else str(domain),
                                 {u: owners[u] for u in us if u in owners}, last, epoch))
        return out
