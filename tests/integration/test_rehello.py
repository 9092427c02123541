"""A re-hello whose inventory the store already holds (the whole fleet, after a failover): it is
audited, and it writes nothing else; one that changes something still changes row and memory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, select

from ntp_manager.service.core.inputs import GpuInventory
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store import pgbulk
from ntp_manager.store.models import AuditRow, NodeRow
from tests.fakes.clock import FakeClock


@pytest.fixture
async def manager(db_url: str, tmp_path: Path) -> AsyncIterator[Manager]:
    m = Manager(Settings(data_dir=tmp_path, database_url=db_url), FakeClock())
    await m.start()
    try:
        yield m
    finally:
        await m.stop()


def inventory(n: int = 4) -> list[GpuInventory]:
    return [GpuInventory(f"G-{i}", i, "FakeGPU", 80 << 30) for i in range(n)]


class Statements:
    """The INSERT/UPDATE statements the manager sends, by table: through the engine, and on
    PostgreSQL the kernel's bulk statements that go straight to asyncpg (store/pgbulk.py)."""

    def __init__(self, m: Manager) -> None:
        self.seen: list[str] = []
        self.engine = m.engine.sync_engine
        event.listen(self.engine, "before_cursor_execute", self._on)
        self._real = (pgbulk.insert, pgbulk.update)
        real_insert, real_update = self._real

        async def bulk_insert(session: Any, table: Any, rows: Any) -> None:
            if rows:
                self.seen.append(f"INSERT {table.name}")
            await real_insert(session, table, rows)

        async def bulk_update(session: Any, table: Any, key: str, columns: Any, rows: Any) -> None:
            if rows:
                self.seen.append(f"UPDATE {table.name}")
            await real_update(session, table, key, columns, rows)

        pgbulk.insert, pgbulk.update = bulk_insert, bulk_update  # type: ignore[assignment]

    def _on(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        words = statement.split()
        if words and words[0].upper() in ("INSERT", "UPDATE"):
            verb = words[0].upper()
            table = (words[2] if verb == "INSERT" else words[1]).strip('"')
            self.seen.append(f"{verb} {table}")

    def close(self) -> None:
        event.remove(self.engine, "before_cursor_execute", self._on)
        pgbulk.insert, pgbulk.update = self._real  # type: ignore[assignment]


async def _audits(m: Manager, action: str) -> list[AuditRow]:
    async with m.sm() as s:
        return list((await s.scalars(select(AuditRow).where(AuditRow.action == action))).all())


async def test_an_unchanged_rehello_is_audited_and_writes_nothing_else(manager: Manager) -> None:
    m = manager
    s1, _ = await m.register_agent("n0", "d0", inventory(), "boot-1", "v1")
    m.disconnect_agent(s1)
    seen = Statements(m)
    try:
        s2, last = await m.register_agent("n0", "d0", inventory(), "boot-1", "v1")
    finally:
        seen.close()
    assert last == 0
    # the audit row only: no node row (same boot and version), no GPU rows (same inventory)
    assert seen.seen == ["INSERT audit_log"], seen.seen
    (row,) = await _audits(m, "node.rehello")
    assert row.target == "n0" and row.after is not None and row.after["added"] == row.after["absent"] == []
    assert m.world.nodes["n0"].connected

    # a new boot is still written, to the row and to memory
    m.disconnect_agent(s2)
    seen = Statements(m)
    try:
        await m.register_agent("n0", "d0", inventory(), "boot-2", "v1")
    finally:
        seen.close()
    assert sorted(seen.seen) == ["INSERT audit_log", "UPDATE nodes"], seen.seen
    assert m.world.nodes["n0"].boot_id == "boot-2"
    async with m.sm() as s:
        node = await s.get(NodeRow, "n0")
        assert node is not None and node.boot_id == "boot-2" and node.agent_version == "v1"
    assert len(await _audits(m, "node.rehello")) == 2
