"""The world log (PostgreSQL): what each of the leader's transactions changed in the world, in
commit order, for the managers that do not lead to follow (service/leadership/follow.py).

Only the leader appends, from inside its transactions, which its write lock runs one at a time
(service/core/kernel.py) and its fence keeps to one leader at a time: a row's `seq` is drawn in a
transaction that commits before the next one begins, so sequence order is commit order and a
reader that sees row n has seen every row below it that will ever exist (a rolled-back
transaction leaves a gap, nothing more). The same statement sends `NOTIFY ntp_world` with the new
row's number (delivered on commit): followers wake and learn how far behind they are.

The leader prunes rows older than `fleet_outbox_retention_s` with the outbox's, and records the
newest number it pruned (`outbox_state`, consumer "world-pruned"): a follower whose cursor is
below it has missed rows and loads the world again.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, func, select, text
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from ntp_manager.store.db import KeptConnection
from ntp_manager.store.models import OutboxStateRow, WorldLogRow

CHANNEL = "ntp_world"  # NOTIFY on every append, with the row's seq
PRUNED = "world-pruned"  # the outbox_state consumer that records the newest pruned seq

_APPEND = text(
    "WITH r AS (INSERT INTO world_log (epoch, body, created_at) VALUES (:epoch, CAST(:body AS json), :at) "
    "RETURNING seq) SELECT pg_notify(:channel, seq::text) FROM r")
_READ_AFTER = text("SELECT seq, CAST(body AS text) FROM world_log WHERE seq > :after ORDER BY seq LIMIT :lim")


async def append(session: AsyncSession, body_json: str, epoch: int, now: datetime) -> None:
    """Append one row (its body already JSON text) in the caller's transaction."""
    await session.execute(_APPEND, {"epoch": epoch, "body": body_json, "at": now, "channel": CHANNEL})


async def read_after(conn: AsyncConnection | AsyncSession, after: int, limit: int) -> list[tuple[int, str]]:
    """Up to `limit` rows after `after`, in sequence order: (seq, the body as JSON text: the caller
    parses it, off the event loop where it is large)."""
    return [(int(r[0]), str(r[1])) for r in (await conn.execute(_READ_AFTER, {"after": after, "lim": limit}))]


# the same two reads as one statement each for the driver, on a follower's kept connection
# (store/db.py `KeptConnection`; tests/integration/test_follow.py compares them with the session's)
READ_AFTER_SQL = "SELECT seq, CAST(body AS text) FROM world_log WHERE seq > $1 ORDER BY seq LIMIT $2"
PRUNED_SQL = "SELECT last_seq FROM outbox_state WHERE consumer = $1"


async def read_after_kept(reader: KeptConnection, after: int, limit: int) -> list[tuple[int, str]]:
    """`read_after` through a kept connection."""
    return [(int(r[0]), str(r[1])) for r in await reader.fetch(READ_AFTER_SQL, after, limit)]


async def pruned_upto_kept(reader: KeptConnection) -> int:
    """`pruned_upto` through a kept connection."""
    rows = await reader.fetch(PRUNED_SQL, PRUNED)
    return int(rows[0][0] or 0) if rows else 0


async def head(conn: AsyncConnection | AsyncSession) -> int:
    """The newest row's number (0 when the log is empty)."""
    v = (await conn.execute(select(func.max(WorldLogRow.seq)))).scalar_one_or_none()
    return int(v or 0)


async def pruned_upto(conn: AsyncConnection | AsyncSession) -> int:
    """The newest row number the leader has pruned (0: none)."""
    v = (await conn.execute(select(OutboxStateRow.last_seq).where(OutboxStateRow.consumer == PRUNED))
         ).scalar_one_or_none()
    return int(v or 0)


async def prune(session: AsyncSession, before: datetime, epoch: int, now: datetime, limit: int = 10_000) -> int:
    """Delete up to `limit` of the oldest rows written before `before`, and record the newest number
    deleted. How many were deleted."""
    old = (select(WorldLogRow.seq).where(WorldLogRow.created_at < before).order_by(WorldLogRow.seq).limit(limit))
    gone = (await session.execute(delete(WorldLogRow).where(WorldLogRow.seq.in_(old.scalar_subquery()))
                                  .returning(WorldLogRow.seq))).scalars().all()
    if gone:
        stmt = pg_insert(OutboxStateRow).values(consumer=PRUNED, last_seq=max(gone), epoch=epoch, applied_at=now)
        await session.execute(stmt.on_conflict_do_update(
            index_elements=[OutboxStateRow.consumer],
            set_={"last_seq": func.greatest(OutboxStateRow.last_seq, stmt.excluded.last_seq),
                  "epoch": stmt.excluded.epoch, "applied_at": stmt.excluded.applied_at}))
    return len(gone)
