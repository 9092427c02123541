"""The outbox table (PostgreSQL, several managers): agents' state changes that any manager took,
for the leader to apply in commit order; the cursor the leader keeps; the quarantine (used by
both stores); agent commands. One manager on SQLite hands its entries over in memory instead
(service/ingest/port.py).

Commit order is sequence order. A `bigserial` alone does not give it: two transactions draw 10 and
11, the one with 11 commits first, the leader reads it and moves its cursor past 10, which commits
a moment later and would never be applied. So every append takes one transaction-scoped advisory
lock before it draws its sequence numbers and holds it until it commits: appends commit one after
the other, in the order of their numbers, and a reader that sees `seq` n has seen every row below
it that will ever exist. The lock is held for one multi-row INSERT and its commit (a whole group
commit of a manager's agents), so it costs one commit's latency per batch, not per report.

The same transaction sends `NOTIFY ntp_outbox` (delivered on commit) to wake the leader; it also
polls, so a lost notification delays a row by one poll at most.

The leader's cursor (`outbox_state`, consumer "leader") moves in the transaction that applies the
rows, under the fence (the leader epoch, service/leadership/leader.py): a row is applied exactly once, by
whichever manager leads, and a deposed leader moves nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Table, Text, bindparam, cast, delete, func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from ntp_manager.jsontext import parse
from ntp_manager.store.db import KeptConnection, json_text
from ntp_manager.store.models import (
    AgentCommandRow,
    GpuRow,
    NodeRow,
    OutboxQuarantineRow,
    OutboxRow,
    OutboxStateRow,
)

CHANNEL = "ntp_outbox"  # NOTIFY on every append: the leader's consumer wakes
COMMANDS = "ntp_agent_commands"  # NOTIFY on every command: the manager holding the agent's stream sends it
LAYOUTS = "ntp_layouts"  # NOTIFY on every layout the leader writes: every manager pushes it to its watchers
LEADER = "leader"  # the consumer name of the leader's cursor
APPEND_LOCK = 0x6E74706F7574  # the advisory lock key that orders appends ("ntpout")

HELLO, REPORT, POWER, SEEN = "hello", "report", "power", "seen"
KINDS = (HELLO, REPORT, POWER, SEEN)


@dataclass(slots=True)
class Entry:
    """One state change to append."""

    kind: str
    node: str
    payload: dict[str, Any]
    idem_key: str
    report_seq: int | None = None
    # what the payload says, as the manager that took it built it: handed over with the entry where
    # the outbox is memory (one manager alone), so that the consumer need not build it again
    decoded: Any = None


@dataclass(slots=True)
class Stored:
    """One appended row, as the consumer reads it."""

    seq: int
    kind: str
    node: str
    report_seq: int | None
    payload: dict[str, Any]
    manager: str
    decoded: Any = None  # Entry.decoded, in memory only (never stored)


_OUTBOX = OutboxRow.__table__
assert isinstance(_OUTBOX, Table)

# One statement takes the append lock, stores the rows and notifies the leader, so that a group
# commit is one round trip when it runs on its own (autocommit: the lock is released when the
# statement's transaction commits) and one statement inside a caller's transaction. It was six
# (BEGIN, SET LOCAL lock_timeout, the lock, the INSERT, NOTIFY, COMMIT) and cost a manager 1.4 ms
# of CPU per batch however small, most of a standby's CPU per report (bench/RESULTS.md).
# The lock comes first: the CTE is materialized (it calls volatile functions) and the rows are
# drawn from a join with it, so no sequence number is drawn before the lock is held. Rows keep
# their order (WITH ORDINALITY), so sequence numbers follow the entries' order.
_APPEND_SQL = (
    "WITH lk AS MATERIALIZED (SELECT set_config('lock_timeout', "
    "COALESCE(CAST(:lock_wait AS text), current_setting('lock_timeout')), true) AS t, "
    "pg_advisory_xact_lock(:lock) AS l), "
    "ins AS (INSERT INTO outbox (kind, node, report_seq, payload, idem_key, manager, created_at) "
    "SELECT u.k, u.n, u.r, CAST(u.p AS json), u.i, :manager, :now FROM lk, "
    "unnest(CAST(:kinds AS text[]), CAST(:nodes AS text[]), CAST(:report_seqs AS bigint[]), "
    "CAST(:payloads AS text[]), CAST(:idem_keys AS text[])) WITH ORDINALITY AS u(k, n, r, p, i, o) "
    "ORDER BY u.o ON CONFLICT ON CONSTRAINT uq_outbox_idem_key DO NOTHING RETURNING seq) "
    f"SELECT seq, pg_notify('{CHANNEL}', '') FROM ins ORDER BY seq")
_APPEND_PARAMS = ("lock_wait", "lock", "manager", "now", "kinds", "nodes", "report_seqs", "payloads", "idem_keys")
_APPEND = text(_APPEND_SQL)
# the same statement for the driver itself ($1, $2, ... in _APPEND_PARAMS' order): a manager's
# committer runs it on the asyncpg connection it keeps, without SQLAlchemy's layers (a third of
# the statement's CPU: 154 against 243 us for one row)
_APPEND_DRIVER = _APPEND_SQL
for _i, _name in sorted(enumerate(_APPEND_PARAMS, 1), key=lambda p: -len(p[1])):
    _APPEND_DRIVER = _APPEND_DRIVER.replace(f":{_name}", f"${_i}")


def _append_args(entries: Sequence[Entry], manager: str, now: datetime, lock_wait_ms: int | None) -> list[Any]:
    return [None if lock_wait_ms is None else str(max(1, int(lock_wait_ms))), APPEND_LOCK, manager, now,
            [e.kind for e in entries], [e.node for e in entries], [e.report_seq for e in entries],
            [json_text(e.payload) for e in entries], [e.idem_key for e in entries]]


async def append(conn: AsyncConnection | AsyncSession, entries: Sequence[Entry], manager: str, now: datetime,
                 lock_wait_ms: int | None = None) -> list[int]:
    """Append `entries` (in their order); the sequence numbers of those stored. An entry whose
    idempotency key is already stored is skipped (a report re-sent to another manager): it is
    durable already. Takes the append lock until the transaction ends: in a session's transaction,
    until it commits; on a connection in autocommit the statement is its own transaction, and the
    rows are durable when this returns. With `lock_wait_ms`, waits that long at most for the lock
    (then a lock-timeout error: see `end_stuck_appenders`); without, as long as the session's
    `lock_timeout` allows."""
    if not entries:
        return []
    args = _append_args(entries, manager, now, lock_wait_ms)
    rows = (await conn.execute(_APPEND, dict(zip(_APPEND_PARAMS, args, strict=True)))).all()
    return [int(r[0]) for r in rows]


async def append_on_driver(driver: Any, entries: Sequence[Entry], manager: str, now: datetime,
                           lock_wait_ms: int | None = None) -> list[int]:
    """`append` on an asyncpg connection in autocommit (the statement is its own transaction)."""
    if not entries:
        return []
    rows = await driver.fetch(_APPEND_DRIVER, *_append_args(entries, manager, now, lock_wait_ms))
    return [int(r[0]) for r in rows]


async def end_stuck_appenders(conn: AsyncConnection | AsyncSession, older_than_ms: int) -> int:
    """End the sessions that have held the append lock in a transaction older than `older_than_ms`;
    how many. An append holds it for one INSERT and its commit, so such a holder is a manager that
    stopped inside its append (SIGSTOP, a frozen VM): its connection stays open, and every
    manager's appends, the whole fleet's ingest, would wait for as long as it is stopped. The
    server's idle-in-transaction timeout does not always end it (seen at 2,000 agents: ingest held
    for minutes after a SIGSTOP, with that timeout at 2 s; the likely way: a manager stopped halfway
    through sending a large multi-row INSERT leaves its session waiting for the rest of the
    message, which the server does not count as idle). Ending it is safe: its rows were not
    committed, so nothing of them was acknowledged, and its agents re-send them to another manager."""
    rows = (await conn.execute(text(
        "SELECT pg_terminate_backend(l.pid) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.classid = :hi AND l.objid = :lo AND l.objsubid = 1 "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND a.xact_start < clock_timestamp() - make_interval(secs => :s) AND l.pid <> pg_backend_pid()"),
        {"hi": APPEND_LOCK >> 32, "lo": APPEND_LOCK & 0xFFFFFFFF, "s": older_than_ms / 1000})).all()
    return sum(1 for r in rows if r[0])


# the payload as text, parsed here by orjson (jsontext.parse): the leader reads every row of the
# fleet's outbox, and the driver's json.loads was about 5 % of its apply's samples
_READ_AFTER = (select(_OUTBOX.c.seq, _OUTBOX.c.kind, _OUTBOX.c.node, _OUTBOX.c.report_seq,
                      cast(_OUTBOX.c.payload, Text), _OUTBOX.c.manager)
               .where(_OUTBOX.c.seq > bindparam("after")).order_by(_OUTBOX.c.seq).limit(bindparam("lim")))


async def read_after(conn: AsyncConnection | AsyncSession, after: int, limit: int) -> list[Stored]:
    """Up to `limit` rows after `after`, in sequence order."""
    rows = (await conn.execute(_READ_AFTER, {"after": after, "lim": limit})).all()
    return [Stored(int(r[0]), str(r[1]), str(r[2]), None if r[3] is None else int(r[3]), dict(parse(r[4])), str(r[5]))
            for r in rows]


READ_AFTER_SQL = ("SELECT seq, kind, node, report_seq, CAST(payload AS text), manager FROM outbox WHERE seq > $1 "
                  "ORDER BY seq LIMIT $2")


async def read_after_kept(reader: KeptConnection, after: int, limit: int) -> list[Stored]:
    """`read_after` through the leader's kept connection (PostgreSQL): one statement on the driver."""
    rows = await reader.fetch(READ_AFTER_SQL, after, limit)
    return [Stored(int(r[0]), str(r[1]), str(r[2]), None if r[3] is None else int(r[3]), dict(parse(r[4])), str(r[5]))
            for r in rows]


async def head(conn: AsyncConnection | AsyncSession) -> int:
    """The newest row's sequence number (0 for an empty outbox)."""
    v = (await conn.execute(select(func.max(OutboxRow.seq)))).scalar_one_or_none()
    return int(v or 0)


async def last_applied(conn: AsyncConnection | AsyncSession, consumer: str = LEADER) -> int:
    """The last sequence number `consumer` applied (0: none yet)."""
    v = (await conn.execute(select(OutboxStateRow.last_seq).where(OutboxStateRow.consumer == consumer))
         ).scalar_one_or_none()
    return 0 if v is None else int(v)


def _set_applied_stmt() -> Any:
    t = OutboxStateRow.__table__
    assert isinstance(t, Table)
    ins = pg_insert(t).values({c: bindparam(c) for c in ("consumer", "last_seq", "epoch", "applied_at")})
    return ins.on_conflict_do_update(
        index_elements=[t.c.consumer],
        set_={"last_seq": func.greatest(t.c.last_seq, ins.excluded.last_seq),
              "epoch": ins.excluded.epoch, "applied_at": ins.excluded.applied_at})


_SET_APPLIED = _set_applied_stmt()  # built once: the leader moves its cursor in every batch


async def set_applied(session: AsyncSession, seq: int, epoch: int, now: datetime, consumer: str = LEADER) -> None:
    """Move the cursor to `seq` in this (fenced) transaction; it never moves back."""
    await session.execute(_SET_APPLIED, {"consumer": consumer, "last_seq": seq, "epoch": epoch, "applied_at": now})


async def quarantine(session: AsyncSession, items: Iterable[tuple[int, str]], epoch: int, now: datetime) -> None:
    """Record why these rows were not applied (either store: one manager on SQLite quarantines the
    entries of its in-memory outbox here too, service/ingest/port.py)."""
    rows = [{"seq": seq, "reason": reason[:4000], "epoch": epoch, "at": now} for seq, reason in items]
    if rows:
        ins = sqlite_insert if session.get_bind().dialect.name == "sqlite" else pg_insert
        await session.execute(ins(OutboxQuarantineRow).values(rows).on_conflict_do_nothing())


QUARANTINE_PAYLOAD_CAP = 16_384  # bytes of an entry's payload (compact JSON) its quarantine audit row keeps


def quarantine_evidence(r: Stored, cap: int = QUARANTINE_PAYLOAD_CAP) -> dict[str, Any]:
    """What the `outbox.quarantine` audit row keeps of an entry that was not applied: its seq,
    kind, report seq, the manager that took it, and the payload itself, so that an operator can
    see what was refused on either store (with the in-memory outbox of one manager alone, this row
    is the only durable copy of it). A payload longer than `cap` bytes as compact JSON is kept as
    the first `cap` bytes of that text (`payload_head`, `payload_cut: true`), never silently cut;
    `payload_bytes` is its whole length either way."""
    text_ = json.dumps(r.payload, separators=(",", ":"), ensure_ascii=True, sort_keys=True, default=str)
    out: dict[str, Any] = {"seq": r.seq, "kind": r.kind, "node": r.node, "report_seq": r.report_seq,
                           "manager": r.manager, "payload_bytes": len(text_)}
    if len(text_) <= cap:
        out["payload"] = json.loads(text_)  # a copy as stored (what `default=str` made of odd values)
    else:
        out["payload_cut"] = True
        out["payload_head"] = text_[:cap]
    return out


async def quarantined(conn: AsyncConnection | AsyncSession) -> list[tuple[int, str]]:
    rows = (await conn.execute(select(OutboxQuarantineRow.seq, OutboxQuarantineRow.reason)
                               .order_by(OutboxQuarantineRow.seq))).all()
    return [(int(r[0]), str(r[1])) for r in rows]


async def node_last_seq(conn: AsyncConnection | AsyncSession, node: str) -> int:
    """The last report seq of `node` that is durable: applied (nodes.last_seq) or stored in the
    outbox and not applied yet. What a hello on any manager tells the agent."""
    applied = (await conn.execute(select(NodeRow.last_seq).where(NodeRow.name == node))).scalar_one_or_none()
    stored = (await conn.execute(select(func.max(OutboxRow.report_seq)).where(OutboxRow.node == node))
              ).scalar_one_or_none()
    return max(int(applied or 0), int(stored or 0))


async def gpu_owners(conn: AsyncConnection | AsyncSession, uuids: Sequence[str]) -> dict[str, str]:
    """The node each of these GPUs is registered on (those registered)."""
    if not uuids:
        return {}
    rows = (await conn.execute(select(GpuRow.uuid, GpuRow.node).where(GpuRow.uuid.in_(list(uuids))))).all()
    return {str(r[0]): str(r[1]) for r in rows}


async def node_domain(conn: AsyncConnection | AsyncSession, node: str) -> str | None:
    return (await conn.execute(select(NodeRow.domain_id).where(NodeRow.name == node))).scalar_one_or_none()


# ---- commands to agents whose streams other managers hold --------------------------------------
async def push_commands(session: AsyncSession, commands: Sequence[tuple[str, dict[str, Any]]], epoch: int,
                        now: datetime) -> None:
    if not commands:
        return
    await session.execute(pg_insert(AgentCommandRow).values(
        [{"node": n, "payload": p, "epoch": epoch, "created_at": now} for n, p in commands]))
    await session.execute(text("SELECT pg_notify(:c, '')"), {"c": COMMANDS})


async def commands_after(conn: AsyncConnection | AsyncSession, after: int, limit: int = 10_000
                         ) -> list[tuple[int, str, dict[str, Any]]]:
    rows = (await conn.execute(select(AgentCommandRow.id, AgentCommandRow.node, AgentCommandRow.payload)
                               .where(AgentCommandRow.id > after).order_by(AgentCommandRow.id).limit(limit))).all()
    return [(int(r[0]), str(r[1]), dict(r[2])) for r in rows]


# `commands_after` as one statement for the driver (store/db.py `KeptConnection`; tests compare the two)
COMMANDS_AFTER_SQL = "SELECT id, node, CAST(payload AS text) FROM agent_commands WHERE id > $1 ORDER BY id LIMIT $2"


async def commands_after_kept(reader: KeptConnection, after: int, limit: int = 10_000
                              ) -> list[tuple[int, str, dict[str, Any]]]:
    """`commands_after` through a manager's kept connection (PostgreSQL)."""
    rows = await reader.fetch(COMMANDS_AFTER_SQL, after, limit)
    return [(int(r[0]), str(r[1]), dict(parse(r[2]))) for r in rows]


async def last_command_id(conn: AsyncConnection | AsyncSession) -> int:
    v = (await conn.execute(select(func.max(AgentCommandRow.id)))).scalar_one_or_none()
    return int(v or 0)


async def prune_commands(session: AsyncSession, before: datetime) -> int:
    """Delete the agent commands written before `before` (in the leader's fenced transaction): every
    manager has read them by then (it reads new ones within a poll; one that starts skips the older
    ones anyway). How many were deleted."""
    res = await session.execute(delete(AgentCommandRow).where(AgentCommandRow.created_at < before))
    return int(getattr(res, "rowcount", 0) or 0)


async def prune_applied(session: AsyncSession, upto: int, before: datetime, limit: int = 10_000) -> int:
    """Delete up to `limit` rows the leader has applied (seq <= `upto`, its cursor) that were stored
    before `before`; quarantined ones stay (their payload is the evidence). Safe for what the rows
    are still read for: a report re-sent after its row is gone is stored again and found a replay
    (nodes.last_seq), and what a hello is told is max(applied, stored). How many were deleted."""
    old = (select(OutboxRow.seq)
           .where(OutboxRow.seq <= upto, OutboxRow.created_at < before,
                  ~select(OutboxQuarantineRow.seq).where(OutboxQuarantineRow.seq == OutboxRow.seq).exists())
           .order_by(OutboxRow.seq).limit(limit))
    res = await session.execute(delete(OutboxRow).where(OutboxRow.seq.in_(old.scalar_subquery())))
    return int(getattr(res, "rowcount", 0) or 0)
