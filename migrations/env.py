"""Alembic environment: runs on a connection handed in by ntp_manager.store.db, or opens one.

Run from a checkout (`alembic upgrade head`, the root's alembic.ini), the database is
NTP_DATABASE_URL when set, else the ini's URL (the manager's default SQLite file under data/, whose
directory is made when missing).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

from ntp_manager.store.models import Base

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url") or ""
    if config.config_file_name is not None:  # alembic.ini: the command line, as the manager would be configured
        url = os.environ.get("NTP_DATABASE_URL") or url
        if url.startswith("sqlite") and ":///" in url and ":memory:" not in url:
            Path(url.split(":///", 1)[1]).parent.mkdir(parents=True, exist_ok=True)
    return url


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


async def _run_async() -> None:
    engine = create_async_engine(_url())
    async with engine.begin() as conn:
        await conn.run_sync(_run)
    await engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    conn = config.attributes.get("connection")
    if conn is not None:
        _run(conn)
    else:
        asyncio.run(_run_async())
