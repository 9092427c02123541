"""The database schema for the command line: `ntp-manager db upgrade|downgrade`, and the commands
that open a manager on a database migrate it first. cli/ reaches the store through here, never
store/db.py itself (issue 35)."""

from __future__ import annotations

from ntp_manager.store import db


async def migrate(url: str, revision: str = "head", *, down: bool = False) -> str | None:
    """Migrate the database at `url` up (or, with `down`, down) to `revision`; returns the revision
    it is at afterwards (None: an empty schema). Alembic's and SQLAlchemy's errors pass through."""
    engine = db.make_engine(url)
    try:
        if down:
            await db.downgrade(engine, revision)
        else:
            await db.upgrade(engine, revision)
        return await db.current_revision(engine)
    finally:
        await engine.dispose()
