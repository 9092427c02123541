"""Which manager committed what: a trigger that logs, for every row written to the tables a
manager writes, the writing session's `application_name` (service/leadership/leader.py names a manager's
sessions "ntp-manager <leader id>") and the time. Rows of a transaction that is rolled back (the
fence refused it) go with it, so the log holds committed writes only.

For checking fencing on a real database (PostgreSQL only): the HA fault tests and bench/ha.py
install it in a database of their own and count the rows a deposed leader's sessions committed
after it lost the lease (goal: none). Not for production databases: it doubles every write.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from ntp_manager.store.db import application_name

# every table a manager writes on its hot paths and in operator actions
TABLES = ("nodes", "gpus", "domains", "health_events", "audit_log", "layouts", "jobs", "breaker", "idempotency_keys")

_SETUP = ("""CREATE TABLE IF NOT EXISTS ha_write_log (
               id bigserial PRIMARY KEY, app text NOT NULL, tbl text NOT NULL,
               at timestamptz NOT NULL DEFAULT clock_timestamp())""",
          """CREATE OR REPLACE FUNCTION ha_log_write() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
               INSERT INTO ha_write_log (app, tbl) VALUES (current_setting('application_name'), TG_TABLE_NAME);
               RETURN NULL;
             END $$""")


async def install(url: str, tables: tuple[str, ...] = TABLES) -> None:
    """Create the log and its trigger on `tables` (migrated already) of the PostgreSQL database at
    `url` (postgresql+asyncpg://...)."""
    engine = create_async_engine(url)
    try:
        async with engine.begin() as conn:
            for sql in _SETUP:
                await conn.execute(text(sql))
            for t in tables:
                await conn.execute(text(f"CREATE TRIGGER ha_log AFTER INSERT OR UPDATE OR DELETE ON {t} "
                                        "FOR EACH ROW EXECUTE FUNCTION ha_log_write()"))
    finally:
        await engine.dispose()


async def writes_since(url: str, leader_id: str, since: datetime) -> int:
    """Rows committed by the sessions of the manager `leader_id` at or after `since` (the database's
    clock)."""
    app = application_name(leader_id)  # its main pool; its lease pool's sessions add " lease"
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            n = (await conn.execute(text("SELECT count(*) FROM ha_write_log WHERE "
                                         "(app = :app OR starts_with(app, :pool)) AND at >= :since"),
                                    {"app": app, "pool": app + " ", "since": since})).scalar_one()
    finally:
        await engine.dispose()
    return int(n)
