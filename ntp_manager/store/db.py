"""Engine, sessions and migrations.

SQLite (aiosqlite) is the embedded default: WAL journal, synchronous=FULL (an acknowledged write
survives a SIGKILL or power loss), foreign keys on. PostgreSQL (asyncpg) is the production store.
Migrations are Alembic's, in `migrations/` at the top of the repository (where Alembic users look;
`alembic upgrade head` works from a checkout with the root's alembic.ini). The manager's wheel
carries them as the package `ntp_manager.migrations` (setup.py maps it onto that directory; an
editable install does too), found here through importlib.resources; `upgrade()` runs them on an
open async connection so it works both from the CLI and inside the running manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any, TypeGuard

import asyncpg
from alembic import command
from alembic.config import Config
from sqlalchemy import event, exc, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from ntp_manager.jsontext import StoredJson

# a directory on disk (Alembic reads env.py and versions/ from it): the package is installed unzipped
MIGRATIONS = Path(str(resources.files("ntp_manager.migrations")))


_ENCODER = json.JSONEncoder(allow_nan=False)  # one for all (json.dumps builds one per call given allow_nan)


def json_text(obj: Any) -> str:
    """The store's JSON serializer. Non-finite numbers are refused (PostgreSQL cannot hold them
    and JSON has no spelling for them); the edge rejects them first, this is the last guard."""
    if isinstance(obj, StoredJson):
        return obj.text
    if type(obj) is list and all(type(x) is str for x in obj):  # a health event's reasons (or no XIDs)
        return "[" + ", ".join(map(encode_basestring_ascii, obj)) + "]"  # as json.dumps spells it
    return _ENCODER.encode(obj)


def application_name(leader_id: str) -> str:
    """The name a manager's database sessions carry (PostgreSQL's `application_name`): a new
    leader ends its predecessor's sessions by it, and tests tell whose session wrote a row."""
    return f"ntp-manager {leader_id}"[:63]


def make_engine(url: str, application_name: str | None = None, idle_tx_timeout_s: float | None = None,
                pool_size: int = 10, custom_plans: bool = False) -> AsyncEngine:
    """An engine for `url`. PostgreSQL sessions can be named (`application_name`: a new leader ends
    the sessions of the one it replaced by that name) and given an idle-in-transaction timeout (a
    manager paused in the middle of a transaction loses it and its row locks). `custom_plans`:
    every statement is planned for the values it is given (`plan_cache_mode`), never with a cached
    generic plan (service/ingest/hello_view.py says why its statement needs that)."""
    if url.startswith("sqlite"):
        engine = create_async_engine(url, connect_args={"timeout": 30}, json_serializer=json_text)

        @event.listens_for(engine.sync_engine, "connect")
        def _pragmas(dbapi_conn: Any, _: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    server_settings: dict[str, str] = {}
    if application_name:
        server_settings["application_name"] = application_name[:63]
    if idle_tx_timeout_s is not None:
        server_settings["idle_in_transaction_session_timeout"] = str(max(1, int(idle_tx_timeout_s * 1000)))
    if custom_plans:
        server_settings["plan_cache_mode"] = "force_custom_plan"
    connect_args: dict[str, Any] = {"server_settings": server_settings} if server_settings else {}
    engine = create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, json_serializer=json_text,
                                 connect_args=connect_args)
    event.listen(engine.sync_engine, "checkout", _closed_is_stale)
    return engine


def _closed_is_stale(_dbapi: Any, record: Any, _proxy: Any) -> None:
    """A pooled PostgreSQL connection whose socket the server has closed (a restart, a backend
    ended by a new leader) is replaced at checkout, without a round trip: asyncpg learns of the
    close as soon as the event loop reads it. SQLAlchemy's `pool_pre_ping` would send BEGIN, a
    query and ROLLBACK on every checkout (three round trips; 15-19 % of a manager's profile samples
    while 12,500 agents registered, bench/RESULTS.md). A connection that hangs without being closed (a
    partition) is found by the statement's own timeout, as it would be by a ping's."""
    driver = record.driver_connection
    if driver is not None and driver.is_closed():
        raise exc.DisconnectionError("the database closed this connection")


def closed(conn: AsyncConnection) -> bool:
    """Whether the server has closed this kept connection (as `_closed_is_stale` at a checkout)."""
    sync = conn.sync_connection
    if sync is None or sync.closed or sync.invalidated:
        return True
    driver = sync.connection.driver_connection
    return driver is not None and bool(driver.is_closed())


class KeptConnection:
    """A PostgreSQL connection kept for one job and used through the driver: one statement, no
    session, pool checkout or transaction around it. The outbox's group commits write through one
    (service/ingest/outbox.py); the polls every manager runs several times a second at idle (the
    token marker, the agent commands) read through one each (`fetch`): about a tenth of a session's
    CPU for a small query (70 against 840 us on the 2-core VM), and through sessions those polls were
    most of an idle manager's CPU. It holds one of `engine`'s pooled connections while it lives. A
    connection the server closed is replaced when next asked for; one whose statement failed is
    dropped by `close` (its state is unknown) and the next use connects again. A read the
    database did not answer is an OSError naming `what` (the driver's and SQLAlchemy's own errors
    included), as its callers retry every store error.
    `usable(engine)`: PostgreSQL only; elsewhere use a session."""

    def __init__(self, engine: AsyncEngine, timeout_s: float, what: str = "the database") -> None:
        self.engine, self.timeout_s, self.what = engine, timeout_s, what
        self._conn: AsyncConnection | None = None
        self._driver: Any = None
        self._lock = asyncio.Lock()

    @staticmethod
    def usable(engine: object) -> TypeGuard[AsyncEngine]:
        return isinstance(engine, AsyncEngine) and engine.dialect.name == "postgresql"

    async def driver(self) -> Any:
        """The driver's (asyncpg's) connection, connected now if there is none or the server closed it."""
        if self._conn is not None and closed(self._conn):  # a restarted server: a new one
            await self.close()
        if self._conn is None:
            self._conn = await self.engine.connect()
            self._driver = (await self._conn.get_raw_connection()).driver_connection
        return self._driver

    async def fetch(self, sql: str, *args: Any) -> list[Any]:
        """The rows of one statement, one read at a time (a caller besides the poll waits its turn)."""
        async with self._lock:
            try:
                return list(await (await self.driver()).fetch(sql, *args, timeout=self.timeout_s))
            except (asyncpg.PostgresError, asyncpg.InterfaceError, exc.SQLAlchemyError) as e:
                await self.close()
                first = (str(e).splitlines() or [type(e).__name__])[0][:200]
                raise OSError(f"cannot read {self.what}: {first}") from e
            except BaseException:
                await self.close()
                raise

    async def close(self) -> None:
        conn, self._conn, self._driver = self._conn, None, None
        if conn is not None:
            for end in (conn.invalidate, conn.close):
                with contextlib.suppress(Exception):
                    await end()


def sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def _run(conn: Connection, url: str, target: str, down: bool) -> None:
    cfg = alembic_config(url)
    cfg.attributes["connection"] = conn
    if down:
        command.downgrade(cfg, target)
    else:
        command.upgrade(cfg, target)


MIGRATION_LOCK = 0x6E74706D  # PostgreSQL advisory lock key: one migration at a time ("ntpm")


async def upgrade(engine: AsyncEngine, target: str = "head") -> None:
    """Migrate to `target`. On PostgreSQL under a transaction-scoped advisory lock: managers that
    start together migrate one after the other (the later ones find nothing left to do)."""
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
        await conn.run_sync(_run, str(engine.url), target, False)


async def downgrade(engine: AsyncEngine, target: str = "base") -> None:
    async with engine.begin() as conn:
        await conn.run_sync(_run, str(engine.url), target, True)


async def current_revision(engine: AsyncEngine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    def _rev(conn: Connection) -> str | None:
        return MigrationContext.configure(conn).get_current_revision()

    async with engine.connect() as conn:
        return await conn.run_sync(_rev)


@asynccontextmanager
async def transaction(sm: async_sessionmaker[AsyncSession]) -> AsyncIterator[AsyncSession]:
    async with sm() as session, session.begin():
        yield session
