"""The leader lease in the `leader` row: read it, take it over, renew it, give it up, and the
fence every write transaction runs.

Time is the database's: on PostgreSQL every expiry is computed and compared with the server's
`clock_timestamp()`, so managers whose clocks disagree still agree on who leads (the SkyPilot
pattern). SQLite holds one manager at a time (service/leadership/leader.py keeps a second one out with a lock
file), so there the manager's own clock is used and `acquire` always succeeds.

- `acquire`: locks the row `FOR UPDATE` while the lease is free (never held, released or expired),
  then bumps the epoch; two managers racing for it are serialized by the row lock, and the second
  finds the lease live and gets nothing.
- `renew`: extends the lease only while the row still carries this manager's epoch and name.
- `fence`: run inside a write transaction; reads the epoch with `FOR KEY SHARE` (PostgreSQL), so a
  takeover (its `FOR UPDATE`) waits until that transaction has ended: either the write commits
  before the new epoch exists (and the new leader, which loads after its takeover, sees it), or
  the fence sees the new epoch and the transaction is rolled back. Nothing commits under an old
  epoch after a takeover.

The two lock modes are chosen so that a renewal never waits for the leader's own writes: a plain
UPDATE of a column that is not a key takes `FOR NO KEY UPDATE`, which does not conflict with
`FOR KEY SHARE`, while `FOR UPDATE` conflicts with every other lock on the row. With `FOR SHARE`
in the fence (as before), each renewal queued behind whichever of the leader's transactions was
open, and a leader with long ones (a backlog of hellos on a loaded machine) could fail to renew
and depose itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from ntp_manager.store.models import LeaderRow


@dataclass(frozen=True)
class LeaseView:
    """The lease as the database holds it now."""

    epoch: int
    holder: str  # "" when never held
    http: str
    grpc: str
    remaining_s: float | None  # seconds until it expires (<= 0: expired); None: never held or released
    expires_at: float | None = None  # when it expires, the database's clock (epoch seconds): moves on each renewal

    @property
    def live(self) -> bool:
        return bool(self.holder) and self.remaining_s is not None and self.remaining_s > 0


def _pg(conn: AsyncConnection | AsyncSession) -> bool:
    bind = conn.get_bind() if isinstance(conn, AsyncSession) else conn
    return bind.dialect.name == "postgresql"


_READ_PG = text("SELECT epoch, holder, http_address, grpc_address, "
                "EXTRACT(EPOCH FROM (expires_at - clock_timestamp()))::float8, "
                "EXTRACT(EPOCH FROM expires_at)::float8 FROM leader WHERE id = 1")
_FREE = "(expires_at IS NULL OR expires_at <= clock_timestamp())"
_LOCK_FREE_PG = text(f"SELECT epoch FROM leader WHERE id = 1 AND {_FREE} FOR UPDATE")
_ACQUIRE_PG = text(
    "UPDATE leader SET epoch = epoch + 1, holder = :me, since = clock_timestamp(), "
    "expires_at = clock_timestamp() + make_interval(secs => :ttl), http_address = :http, grpc_address = :grpc "
    f"WHERE id = 1 AND {_FREE} RETURNING epoch")
_RENEW_PG = text("UPDATE leader SET expires_at = clock_timestamp() + make_interval(secs => :ttl) "
                 "WHERE id = 1 AND epoch = :epoch AND holder = :me RETURNING epoch")
_RELEASE_PG = text("UPDATE leader SET expires_at = clock_timestamp() WHERE id = 1 AND epoch = :epoch AND holder = :me")
_FENCE_PG = text("SELECT epoch FROM leader WHERE id = 1 FOR KEY SHARE")


async def read(conn: AsyncConnection) -> LeaseView | None:
    """The lease row (None before the migration that creates it ran)."""
    if _pg(conn):
        row = (await conn.execute(_READ_PG)).first()
        if row is None:
            return None
        return LeaseView(int(row[0]), str(row[1]), str(row[2]), str(row[3]), None if row[4] is None else float(row[4]),
                         None if row[5] is None else float(row[5]))
    r = (await conn.execute(select(LeaderRow.epoch, LeaderRow.holder, LeaderRow.http_address, LeaderRow.grpc_address,
                                   LeaderRow.expires_at).where(LeaderRow.id == 1))).first()
    if r is None:
        return None
    expires = r[4]
    if expires is not None and expires.tzinfo is None:
        expires = expires.replace(tzinfo=UTC)
    remaining = None if expires is None else (expires - datetime.now(UTC)).total_seconds()
    return LeaseView(int(r[0]), str(r[1]), str(r[2]), str(r[3]), remaining,
                     None if expires is None else expires.timestamp())


async def acquire(conn: AsyncConnection, me: str, ttl_s: float, http: str, grpc: str) -> int | None:
    """Take the lease when it is free; the new epoch, or None when another manager holds it."""
    if _pg(conn):
        # the lock first: it waits for every fenced transaction of the old leader (the UPDATE alone
        # would not: FOR NO KEY UPDATE and the fence's FOR KEY SHARE do not conflict)
        if (await conn.execute(_LOCK_FREE_PG)).first() is None:
            return None
        row = (await conn.execute(_ACQUIRE_PG, {"me": me, "ttl": ttl_s, "http": http, "grpc": grpc})).first()
        return None if row is None else int(row[0])
    # SQLite: the caller holds the database's lock file, so no other manager can run; the lease is
    # taken whatever it says (a manager killed a moment ago left it live).
    now = datetime.now(UTC)
    row = (await conn.execute(
        update(LeaderRow).where(LeaderRow.id == 1)
        .values(epoch=LeaderRow.epoch + 1, holder=me, since=now, expires_at=now + timedelta(seconds=ttl_s),
                http_address=http, grpc_address=grpc)
        .returning(LeaderRow.epoch))).first()
    if row is None:
        raise RuntimeError("the leader row is missing: run `ntp-manager db upgrade`")
    return int(row[0])


async def renew(conn: AsyncConnection, me: str, epoch: int, ttl_s: float) -> bool:
    """Extend this manager's lease; False when the row no longer carries its epoch (taken over)."""
    if _pg(conn):
        return (await conn.execute(_RENEW_PG, {"me": me, "epoch": epoch, "ttl": ttl_s})).first() is not None
    now = datetime.now(UTC)
    row = (await conn.execute(
        update(LeaderRow).where(LeaderRow.id == 1, LeaderRow.epoch == epoch, LeaderRow.holder == me)
        .values(expires_at=now + timedelta(seconds=ttl_s)).returning(LeaderRow.epoch))).first()
    return row is not None


async def release(conn: AsyncConnection, me: str, epoch: int) -> None:
    """End this manager's lease now (a clean stop), so a standby need not wait for it to expire."""
    if _pg(conn):
        await conn.execute(_RELEASE_PG, {"me": me, "epoch": epoch})
        return
    await conn.execute(update(LeaderRow).where(LeaderRow.id == 1, LeaderRow.epoch == epoch, LeaderRow.holder == me)
                       .values(expires_at=datetime.now(UTC)))


async def fence(session: AsyncSession) -> int:
    """The epoch as this transaction sees it, key-share-locked until the transaction ends, which
    holds off a takeover but not a renewal (PostgreSQL; SQLite's single writer serializes
    transactions anyway)."""
    if _pg(session):
        epoch = (await session.execute(_FENCE_PG)).scalar_one_or_none()
    else:
        epoch = (await session.execute(select(LeaderRow.epoch).where(LeaderRow.id == 1))).scalar_one_or_none()
    return -1 if epoch is None else int(epoch)


async def terminate_sessions(conn: AsyncConnection, application_name: str) -> int:
    """End the database sessions of a manager that lost its lease but may still hold a row lock
    (paused in the middle of a transaction): PostgreSQL only; how many were ended."""
    if not _pg(conn) or not application_name:
        return 0
    rows = (await conn.execute(text(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE (application_name = :app OR starts_with(application_name, :pool)) AND pid <> pg_backend_pid()"),
        {"app": application_name, "pool": application_name + " "})).all()  # its lease pool's too
    return sum(1 for r in rows if r[0])
