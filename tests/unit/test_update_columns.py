"""A transaction's updates write the columns its changes set (service/core/kernel.py `_columns_set`),
and the number of column sets, each its own prepared statement, stays bounded. That the rows
written are the world's records is checked on both stores by tests/integration/test_pgbulk.py and
the SQLite test below."""

from __future__ import annotations

from pathlib import Path

import pytest

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core import kernel
from ntp_manager.service.core.changes import _GPU_VALUES, _NODE_VALUES
from ntp_manager.service.core.inputs import GpuInventory, GpuReport
from ntp_manager.service.core.state import NodeChange, admin_to
from ntp_manager.service.leadership.loading import load_world
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings

HEALTH = ("health", "health_reason", "health_source", "health_since")


def test_a_batch_writes_the_union_of_its_changes_columns_in_the_tables_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "_COLUMN_SETS", {})
    reports = [dict.fromkeys(HEALTH, 0)] * 3
    assert kernel._columns_set("gpus", kernel.GPU_COLUMNS, reports) == HEALTH
    assert kernel._columns_set("gpus", kernel.GPU_COLUMNS, [{"speed": 1.0}, {"desired_mw": 1, "admin": None}]) == (
        "admin", "desired_mw", "speed")
    assert kernel._columns_set("nodes", kernel.NODE_COLUMNS, [{"last_seq": 3}]) == ("last_seq",)


def test_past_the_bound_a_new_column_set_writes_every_column(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "_COLUMN_SETS", {})
    monkeypatch.setattr(kernel, "COLUMN_SETS_MAX", 2)
    cols = kernel.GPU_COLUMNS
    assert kernel._columns_set("gpus", cols, [{cols[0]: 1}]) == cols[:1]
    assert kernel._columns_set("gpus", cols, [{cols[1]: 1}]) == cols[1:2]
    assert kernel._columns_set("gpus", cols, [{cols[2]: 1}]) == cols  # a third set: all of them
    assert kernel._columns_set("gpus", cols, [{cols[0]: 1}]) == cols[:1]  # one seen before: still its own
    assert kernel._columns_set("nodes", kernel.NODE_COLUMNS, [{"boot_id": "b"}]) == ("boot_id",)  # per table
    assert len(kernel._COLUMN_SETS["gpus"]) == 2


async def test_sqlite_holds_the_world_after_updates_of_mixed_columns(tmp_path: Path) -> None:
    m = Manager(Settings(data_dir=tmp_path, database_url=f"sqlite+aiosqlite:///{tmp_path}/s.db",
                         breaker_min_gpus=10_000))
    await m.start()
    try:
        for n in range(2):
            await m.register_agent(f"n{n}", "d0", [GpuInventory(f"G{n}-{i}", i, "FakeGPU", 80 << 30)
                                                   for i in range(4)], "boot", "v1")
        await m.apply_report("n0", 1, [GpuReport("G0-0", "failed", ["fell off the bus"], [79])])
        async with m.kernel.exclusive("operator:t") as tx:
            tx.change_gpu("G0-1", admin_to(GpuState.CORDONED, "alice", "maintenance"))
            tx.change_gpu("G0-2", {"desired_mw": 1_100_000, "speed": 0.8125})
            tx.change_gpu("G1-3", {"health_reason": "", "model": "M"})
            tx.change_node("n1", NodeChange(drain_reason="rack swap", last_seq=7))
        async with m.sm() as s:
            stored = await load_world(s, None, 0.0)
        w = m.kernel.world
        assert {u: _GPU_VALUES(g) for u, g in stored.gpus.items()} == {u: _GPU_VALUES(g) for u, g in w.gpus.items()}
        assert {n: _NODE_VALUES(r) for n, r in stored.nodes.items()} == {n: _NODE_VALUES(r) for n, r in w.nodes.items()}
        assert w.gpus["G0-2"].desired_mw == 1_100_000 and w.nodes["n1"].last_seq == 7
    finally:
        await m.stop()
