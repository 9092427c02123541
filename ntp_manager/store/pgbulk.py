"""Bulk writes straight to asyncpg (PostgreSQL only): one statement per table, its rows as one JSON parameter.

The kernel's group commits write many rows of a few tables (service/core/kernel.py `Tx.flush`): GPU and
node updates, health events, audit records. Through SQLAlchemy an executemany builds and processes
every row's parameters in Python (most of the fleet leader's cost per report it applies,
bench/fleet_consumer.py); here the rows go as one JSON array of objects (orjson: one call in C for
the batch) that PostgreSQL expands with `json_to_recordset`:

    UPDATE gpus AS t SET health = v.health, ... FROM json_to_recordset($1::json)
        AS v(pk_ varchar, health varchar, ...) WHERE t.uuid = v.pk_
    INSERT INTO health_events (at, ...) SELECT v.at, ... FROM json_to_recordset($1::json) AS v(at timestamptz, ...)

Values are converted as the models' column types would convert them (store/models.py): timestamps
to UTC (a naive one is refused, as `UtcDateTime` refuses it), JSON with the store's serializer
(`db.json_text`; Python None as JSON `null`, as SQLAlchemy's JSON type writes it: such a column
travels as its text and is cast), everything else as it is. A batch orjson cannot write exactly (an
integer beyond 64 bits, a value of a type it does not know, a non-finite float, which it would
write as null) goes as one array parameter per column instead, expanded with `unnest`: the way
these writes went before, when asyncpg's per-element array checks were a tenth of the leader's
CPU per report applied (bench/RESULTS.md). The statements are built once per table from its
metadata, so a column added to a model is written here too. tests/integration/test_pgbulk.py checks
that every way writes the same rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import JSON, Column, Float, Table
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
    return f"{_sql_type(col)}[]"


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


class _NotExact(Exception):
    """A value the JSON form would not carry exactly (the batch goes as arrays)."""


def _finite(v: float | None) -> float | None:
    if v is not None and not math.isfinite(v):
        raise _NotExact
    return v


def _json_converter(col: Column[Any]) -> Callable[[Any], Any] | None:
    if isinstance(col.type, Float):
        return _finite
    return _converter(col)


def _sql_type(col: Column[Any]) -> str:
    return "timestamptz" if isinstance(col.type, UtcDateTime) else col.type.compile(dialect=_DIALECT)


def _record_columns(cols: Sequence[Column[Any]], names: Sequence[str]) -> tuple[str, list[str]]:
    """The `json_to_recordset` column list, and each column as it is read from it (JSON as its
    text, cast)."""
    decl, reads = [], []
    for c, n in zip(cols, names, strict=True):
        if isinstance(c.type, JSON):
            decl.append(f'"{n}" text')
            reads.append(f'v."{n}"::{_sql_type(c)}')
        else:
            decl.append(f'"{n}" {_sql_type(c)}')
            reads.append(f'v."{n}"')
    return ", ".join(decl), reads


class _Statement:
    def __init__(self, sql: str, json_sql: str, columns: Sequence[Column[Any]], names: Sequence[str]) -> None:
        self.sql, self.json_sql = sql, json_sql  # arrays (`unnest`), one JSON parameter (`json_to_recordset`)
        self.columns = list(names)
        self.convert = [_converter(c) for c in columns]
        self.json_convert = [(n, f) for n, c in zip(names, columns, strict=True) if (f := _json_converter(c))]

    def arrays(self, rows: Sequence[Mapping[str, Any]]) -> list[list[Any]]:
        out = []
        for name, conv in zip(self.columns, self.convert, strict=True):
            values = [r[name] for r in rows]
            out.append(values if conv is None else [conv(v) for v in values])
        return out

    def document(self, rows: Sequence[Mapping[str, Any]]) -> str | None:
        """The rows as one JSON array of objects, or None where that would not be exact."""
        names, conv = self.columns, self.json_convert
        try:
            out = []
            for r in rows:
                d = {n: r[n] for n in names}
                for n, f in conv:
                    d[n] = f(d[n])
                out.append(d)
            return orjson.dumps(out).decode()
        except (_NotExact, orjson.JSONEncodeError):
            return None

    async def run(self, driver: Any, rows: Sequence[Mapping[str, Any]]) -> None:
        doc = self.document(rows)
        if doc is not None:
            await driver.execute(self.json_sql, doc)
        else:
            await driver.execute(self.sql, *self.arrays(rows))


_UPDATES: dict[tuple[str, str, tuple[str, ...]], _Statement] = {}
_INSERTS: dict[tuple[str, tuple[str, ...]], _Statement] = {}


def _update_statement(table: Table, key: str, columns: tuple[str, ...]) -> _Statement:
    st = _UPDATES.get((table.name, key, columns))
    if st is None:
        cols = [table.c[key], *(table.c[c] for c in columns)]
        names = ["pk_", *columns]  # the rows carry the key as "pk_"
        sets = ", ".join(f'"{c}" = v."{c}"' for c in columns)
        params = ", ".join(f"${i + 1}::{_array_type(c)}" for i, c in enumerate(cols))
        alias = ", ".join(f'"{n}"' for n in names)
        sql = f'UPDATE "{table.name}" AS t SET {sets} FROM unnest({params}) AS v({alias}) WHERE t."{key}" = v.pk_'
        decl, reads = _record_columns(cols, names)
        json_sets = ", ".join(f'"{c}" = {r}' for c, r in zip(columns, reads[1:], strict=True))
        json_sql = (f'UPDATE "{table.name}" AS t SET {json_sets} FROM json_to_recordset($1::json) AS v({decl}) '
                    f'WHERE t."{key}" = v.pk_')
        st = _UPDATES[(table.name, key, columns)] = _Statement(sql, json_sql, cols, names)
    return st


def _insert_statement(table: Table, columns: tuple[str, ...]) -> _Statement:
    st = _INSERTS.get((table.name, columns))
    if st is None:
        cols = [table.c[c] for c in columns]
        params = ", ".join(f"${i + 1}::{_array_type(c)}" for i, c in enumerate(cols))
        names = ", ".join(f'"{c}"' for c in columns)
        sql = f'INSERT INTO "{table.name}" ({names}) SELECT * FROM unnest({params})'
        decl, reads = _record_columns(cols, columns)
        json_sql = (f'INSERT INTO "{table.name}" ({names}) SELECT {", ".join(reads)} '
                    f"FROM json_to_recordset($1::json) AS v({decl})")
        st = _INSERTS[(table.name, columns)] = _Statement(sql, json_sql, cols, columns)
    return st


async def update(session: AsyncSession, table: Table, key: str, columns: tuple[str, ...],
                 rows: Sequence[Mapping[str, Any]]) -> None:
    """UPDATE each row (its key under "pk_", every one of `columns` given) in one statement."""
    if not rows:
        return
    await _update_statement(table, key, columns).run(await _driver(session), rows)


async def insert(session: AsyncSession, table: Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """INSERT `rows` (every row with the same keys, those of the first) in one statement."""
    if not rows:
        return
    await _insert_statement(table, tuple(rows[0])).run(await _driver(session), rows)
