"""Bulk writes straight to asyncpg (PostgreSQL only): one statement per table, its rows as arrays.

The kernel's group commits write many rows of a few tables (service/core/kernel.py `Tx.flush`): GPU and
node updates, health events, audit records. Through SQLAlchemy an executemany builds and processes
every row's parameters in Python (most of the fleet leader's cost per report it applies,
bench/fleet_consumer.py); here each column's values go as one array parameter of a prepared
statement, and PostgreSQL expands them with `unnest`:

    UPDATE gpus AS t SET health = v.health, ... FROM unnest($1::varchar[], $2::varchar[], ...)
        AS v(pk_, health, ...) WHERE t.uuid = v.pk_
    INSERT INTO health_events (at, ...) SELECT * FROM unnest($1::timestamptz[], ...)

Values are converted as the models' column types would convert them (store/models.py): timestamps
to UTC (a naive one is refused, as `UtcDateTime` refuses it), JSON with the store's serializer
(`db.json_text`; Python None as JSON `null`, as SQLAlchemy's JSON type writes it), everything else
as it is. The statements are built once per table from its metadata, so a column added to a model
is written here too. tests/integration/test_pgbulk.py checks that both ways write the same rows.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, Column, Table
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncSession

from ntp_manager.store.db import json_text
from ntp_manager.store.models import UtcDateTime

_DIALECT = postgresql.dialect()  # type: ignore[no-untyped-call]


def _utc(v: datetime | None) -> datetime | None:
    if v is None:
        return None
    if v.tzinfo is None:
        raise ValueError("naive datetime: give a time zone (the store keeps UTC)")
    return v.astimezone(UTC)


def _json(v: Any) -> str:
    return "null" if v is None else json_text(v)


def _converter(col: Column[Any]) -> Callable[[Any], Any] | None:
    if isinstance(col.type, UtcDateTime):
        return _utc
    if isinstance(col.type, JSON):
        return _json
    return None


def _array_type(col: Column[Any]) -> str:
    base = "timestamptz" if isinstance(col.type, UtcDateTime) else col.type.compile(dialect=_DIALECT)
    return f"{base}[]"


def usable(session: AsyncSession) -> bool:
    """Whether `session` talks to PostgreSQL through asyncpg."""
    bind = session.bind
    return bind is not None and bind.dialect.name == "postgresql" and bind.dialect.driver == "asyncpg"


async def _driver(session: AsyncSession) -> Any:
    """The asyncpg connection under `session`'s transaction."""
    conn = await session.connection()
    driver: Any = (await conn.get_raw_connection()).driver_connection
    if not driver.is_in_transaction():
        # SQLAlchemy's asyncpg adapter opens the transaction at its first statement: make it
        await conn.exec_driver_sql("SELECT 1")
    assert driver.is_in_transaction()
    return driver


class _Statement:
    def __init__(self, sql: str, columns: Sequence[Column[Any]]) -> None:
        self.sql = sql
        self.columns = [c.name for c in columns]
        self.convert = [_converter(c) for c in columns]

    def arrays(self, rows: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
        out = []
        for name, conv in zip(self.columns, self.convert, strict=True):
            values = [r[name] for r in rows]
            out.append(values if conv is None else [conv(v) for v in values])
        return out


_UPDATES: dict[tuple[str, str, tuple[str, ...]], _Statement] = {}
_INSERTS: dict[tuple[str, tuple[str, ...]], _Statement] = {}


def _update_statement(table: Table, key: str, columns: tuple[str, ...]) -> _Statement:
    st = _UPDATES.get((table.name, key, columns))
    if st is None:
        cols = [table.c[key], *(table.c[c] for c in columns)]
        names = ["pk_", *columns]
        sets = ", ".join(f'"{c}" = v."{c}"' for c in columns)
        params = ", ".join(f"${i + 1}::{_array_type(c)}" for i, c in enumerate(cols))
        alias = ", ".join(f'"{n}"' for n in names)
        sql = f'UPDATE "{table.name}" AS t SET {sets} FROM unnest({params}) AS v({alias}) WHERE t."{key}" = v.pk_'
        st = _UPDATES[(table.name, key, columns)] = _Statement(sql, cols)
        st.columns = names  # the rows carry the key as "pk_"
    return st


def _insert_statement(table: Table, columns: tuple[str, ...]) -> _Statement:
    st = _INSERTS.get((table.name, columns))
    if st is None:
        cols = [table.c[c] for c in columns]
        params = ", ".join(f"${i + 1}::{_array_type(c)}" for i, c in enumerate(cols))
        names = ", ".join(f'"{c}"' for c in columns)
        sql = f'INSERT INTO "{table.name}" ({names}) SELECT * FROM unnest({params})'
        st = _INSERTS[(table.name, columns)] = _Statement(sql, cols)
    return st


async def update(session: AsyncSession, table: Table, key: str, columns: tuple[str, ...],
                 rows: Sequence[Mapping[str, Any]]) -> None:
    """UPDATE each row (its key under "pk_", every one of `columns` given) in one statement."""
    if not rows:
        return
    st = _update_statement(table, key, columns)
    await (await _driver(session)).execute(st.sql, *st.arrays(rows))


async def insert(session: AsyncSession, table: Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """INSERT `rows` (every row with the same keys, those of the first) in one statement."""
    if not rows:
        return
    st = _insert_statement(table, tuple(rows[0]))
    await (await _driver(session)).execute(st.sql, *st.arrays(rows))
