"""store/pgbulk.py writes exactly what SQLAlchemy writes: the same manager work on two PostgreSQL
databases, one through each path, leaves the same rows (compared as PostgreSQL's own text)."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.changes import _GPU_VALUES, _NODE_VALUES
from ntp_manager.service.core.inputs import GpuInventory, GpuReport
from ntp_manager.service.core.state import NodeChange, admin_to
from ntp_manager.service.leadership.loading import load_world
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store import pgbulk
from tests.fakes.clock import FakeClock
from tests.integration.conftest import database

pytestmark = pytest.mark.skipif(not os.environ.get("NTP_TEST_POSTGRES_URL"),
                                reason="NTP_TEST_POSTGRES_URL is not set (no PostgreSQL server to test against)")

# every table the kernel writes, its columns as text (JSON as PostgreSQL holds it, NULL apart from
# JSON null), ids left out (sequences)
DUMPS = {
    "domains": "SELECT id, power_budget_w::text, created_at::text FROM domains ORDER BY id",
    "nodes": "SELECT name, domain_id, boot_id, agent_version, last_seq, drain_deadline::text, drain_reason, "
             "registered_at::text FROM nodes ORDER BY name",
    "gpus": "SELECT uuid, pos, node, domain_id, idx, model, memory_bytes, tdp_mw, min_mw, max_mw, health, "
            "health_reason, health_source, health_since::text, admin, admin_owner, admin_reason, desired_mw, "
            "enforced_mw, speed FROM gpus ORDER BY uuid",
    "health_events": "SELECT at::text, gpu_uuid, node, seq, source, old_state, new_state, reasons::text, "
                     "xids::text FROM health_events ORDER BY id",
    "audit_log": "SELECT at::text, actor, action, target, before::text, before IS NULL, after::text, "
                 "after IS NULL, reason, request_id FROM audit_log ORDER BY id",
}


async def work(m: Manager) -> None:
    """Registrations (new domains, nodes, GPUs), reports (events with reasons and XIDs), a re-hello
    that changes the inventory, GPU and node changes of every kind, and audits with None and JSON."""
    for n in range(3):
        await m.register_agent(f"n{n}", f"d{n // 2}", [GpuInventory(f"G{n}-{i}", i, "FakeGPU", 80 << 30)
                                                      for i in range(4)], "boot", "v1")
    await m.apply_report("n0", 1, [GpuReport("G0-0", "failed", ["fell off the bus", "é \"quoted\""], [79])])
    await m.apply_report("n1", 1, [GpuReport("G1-1", "degraded", [], [], 650_000)])
    await m.apply_report("n1", 2, [GpuReport("G1-1", "healthy", ["recovered"], [13, 48])])
    await m.register_agent("n2", "d1", [GpuInventory(f"G2-{i}", i + 4, "Other", 40 << 30, 900_000)
                                        for i in range(4)], "boot2", "v2")
    ist = timezone(timedelta(hours=5, minutes=30))
    async with m.kernel.exclusive("operator:t", "req-1") as tx:
        tx.change_gpu("G0-1", admin_to(GpuState.CORDONED, "alice", "maintenance"))
        tx.change_gpu("G0-2", {"desired_mw": 1_100_000, "enforced_mw": None, "speed": 0.8125})
        tx.change_gpu("G0-3", {"speed": None, "health_reason": "", "model": "M"})
        tx.change_node("n0", NodeChange(drain_deadline=datetime(2026, 11, 28, 23, 0, tzinfo=ist),
                                        drain_reason="rack swap"))
        tx.change_node("n1", NodeChange(drain_deadline=None, drain_reason=None, last_seq=7))
        tx.audit(tx.now, "gpu.cordon", "G0-1", before=None, after={"admin": "cordoned", "list": [1, 2.5, None]},
                 reason="why")
        tx.audit(tx.now, "node.drain", "n0", before={"a": None}, after=None)


async def dump(url: str) -> dict[str, list[Any]]:
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        return {t: [tuple(r) for r in await conn.fetch(q)] for t, q in DUMPS.items()}
    finally:
        await conn.close()


async def run_on(url: str, tmp_path: Path) -> dict[str, list[Any]]:
    m = Manager(Settings(data_dir=tmp_path, database_url=url, breaker_min_gpus=10_000),
                FakeClock(wall=datetime(2026, 11, 28, 20, 0, tzinfo=UTC)))
    await m.start()
    try:
        await work(m)
        # what the store holds is the world as the manager holds it, every field of every record (as
        # values: a time is the same instant, in UTC)
        # (a transaction's update writes only the columns its changes set: kernel._columns_set)
        async with m.sm() as s:
            stored = await load_world(s, None, 0.0)
        w = m.kernel.world
        assert {u: _GPU_VALUES(g) for u, g in stored.gpus.items()} == {u: _GPU_VALUES(g) for u, g in w.gpus.items()}
        assert {n: _NODE_VALUES(r) for n, r in stored.nodes.items()} == {n: _NODE_VALUES(r) for n, r in w.nodes.items()}
    finally:
        await m.stop()
    return await dump(url)


async def test_the_asyncpg_bulk_path_writes_what_sqlalchemy_writes(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Three ways: the rows as one JSON document (what the kernel sends), as arrays (what it sends
    when JSON would not be exact), and SQLAlchemy's executemany."""
    written: list[str] = []
    real_driver, real_document = pgbulk._driver, pgbulk._Statement.document

    async def counting(session: Any) -> Any:
        written.append("raw")
        return await real_driver(session)

    def documents(self: pgbulk._Statement, rows: Any) -> str | None:
        doc = real_document(self, rows)
        written.append("json" if doc is not None else "arrays")
        return doc

    monkeypatch.setattr(pgbulk, "_driver", counting)
    monkeypatch.setattr(pgbulk._Statement, "document", documents)
    async with database("postgres", tmp_path) as url:
        as_json = await run_on(url, tmp_path / "a")
    assert "json" in written and "arrays" not in written, "the JSON form was not taken"
    written.clear()
    monkeypatch.setattr(pgbulk._Statement, "document", lambda self, rows: written.append("arrays"))
    async with database("postgres", tmp_path) as url:
        as_arrays = await run_on(url, tmp_path / "c")
    assert "arrays" in written, "the arrays were not taken"
    monkeypatch.setattr(pgbulk, "usable", lambda session: False)
    written.clear()
    async with database("postgres", tmp_path) as url:
        orm = await run_on(url, tmp_path / "b")
    assert not written
    assert len(orm["gpus"]) == 12 and len(orm["health_events"]) >= 3 and len(orm["audit_log"]) >= 2
    for table in DUMPS:
        assert as_json[table] == orm[table], table
        assert as_arrays[table] == orm[table], table


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), 2**70, object()])
def test_a_batch_json_would_not_carry_exactly_goes_as_arrays(value: object) -> None:
    """orjson writes a non-finite float as null and cannot write an integer beyond 64 bits or an
    object it does not know: such a batch has no document (it goes as arrays, which carry it, or
    fail loudly as they would have)."""
    from ntp_manager.store.models import GpuRow

    st = pgbulk._update_statement(GpuRow.__table__, "uuid", ("speed", "memory_bytes", "health_since"))  # type: ignore[arg-type]
    ok = {"pk_": "G0", "speed": 0.8125, "memory_bytes": 80 << 30, "health_since": datetime(2026, 1, 1, tzinfo=UTC)}
    assert st.document([ok]) == ('[{"pk_":"G0","speed":0.8125,"memory_bytes":85899345920,'
                                 '"health_since":"2026-01-01T00:00:00+00:00"}]')
    column = "speed" if isinstance(value, float) else "memory_bytes"
    assert st.document([ok, {**ok, column: value}]) is None
    with pytest.raises(ValueError, match="naive"):  # refused, as the model refuses it, in either form
        st.document([{**ok, "health_since": datetime(2026, 1, 1)}])


def test_a_naive_timestamp_is_refused_as_the_model_refuses_it() -> None:
    with pytest.raises(ValueError, match="naive"):
        pgbulk._utc(datetime(2026, 1, 1))
    assert pgbulk._json(None) == "null" and pgbulk._json(["a"]) == '["a"]'

