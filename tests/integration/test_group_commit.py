"""The kernel on a real store: group commit, typed changes applied alike to rows and memory, and a
failing item that takes nothing else with it. Times come from a fake clock; nothing sleeps."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.errors import InvalidArgument
from ntp_manager.service.core.inputs import GpuInventory, GpuReport
from ntp_manager.service.core.kernel import Tx
from ntp_manager.service.core.state import GpuChange, GpuRec, NodeChange, NodeRec, admin_to
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store.models import AuditRow, GpuRow, HealthEventRow, NodeRow
from tests.fakes.clock import FakeClock
from tests.integration.conftest import database

NODES, PER_NODE = 40, 4


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.skipif(
    not __import__("os").environ.get("NTP_TEST_POSTGRES_URL"), reason="NTP_TEST_POSTGRES_URL is not set"))])
async def manager(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Manager]:
    async with database(request.param, tmp_path) as url:
        m = Manager(Settings(data_dir=tmp_path, database_url=url, breaker_min_gpus=10_000), FakeClock())
        await m.start()
        try:
            yield m
        finally:
            await m.stop()


def inventory(node: int) -> list[GpuInventory]:
    return [GpuInventory(f"G{node}-{i}", i, "FakeGPU", 80 << 30) for i in range(PER_NODE)]


async def rows_equal_memory(m: Manager) -> None:
    """Every GPU and node row holds what its record holds, column by column."""
    async with m.sm() as s:
        gpus = {r.uuid: r for r in (await s.scalars(select(GpuRow))).all()}
        nodes = {r.name: r for r in (await s.scalars(select(NodeRow))).all()}
    assert set(gpus) == set(m.world.gpus) and set(nodes) == set(m.world.nodes)
    for u, rec in m.world.gpus.items():
        for name in GpuChange.__annotations__:
            assert getattr(gpus[u], name) == getattr(rec, name), (u, name)
    for n, nrec in m.world.nodes.items():
        for name in NodeChange.__annotations__:
            assert getattr(nodes[n], name) == getattr(nrec, name), (n, name)


def test_every_change_key_is_a_column_of_the_row_and_an_attribute_of_the_record() -> None:
    for change, row, rec in ((GpuChange, GpuRow, GpuRec), (NodeChange, NodeRow, NodeRec)):
        columns = set(row.__table__.columns.keys())  # type: ignore[attr-defined]
        for name in change.__annotations__:
            assert name in columns, (change.__name__, name)
            assert name in {x.name for x in dataclasses.fields(rec)}, (rec.__name__, name)


async def test_concurrent_hellos_and_reports_commit_together_and_rows_match_memory(manager: Manager) -> None:
    m = manager
    await asyncio.gather(*(m.register_agent(f"n{i}", f"d{i // 2}", inventory(i), "b", "v1") for i in range(NODES)))
    hellos = m.kernel.batches
    assert hellos < NODES, "the hellos were not grouped"

    async def reports(i: int) -> list[int]:
        # each node: GPU 0 fails, recovers, fails again (3 reports, in order, without waiting)
        seqs = [asyncio.ensure_future(m.apply_report(f"n{i}", seq, [GpuReport(f"G{i}-0", state, ["r"], [79])]))
                for seq, state in ((1, "failed"), (2, "healthy"), (3, "failed"))]
        return list(await asyncio.gather(*seqs))

    before = m.kernel.batches
    acked = await asyncio.gather(*(reports(i) for i in range(NODES)))
    assert acked == [[1, 2, 3]] * NODES
    assert m.kernel.batches - before < 3 * NODES / 4, "the reports were not grouped"
    assert all(m.world.gpus[f"G{i}-0"].health == GpuState.FAILED for i in range(NODES))
    assert all(m.world.nodes[f"n{i}"].last_seq == 3 for i in range(NODES))
    async with m.sm() as s:
        events = await s.scalar(select(func.count()).select_from(HealthEventRow).where(HealthEventRow.seq.is_not(None)))
    assert events == 3 * NODES
    # A re-hello that changes the inventory (index, limits, model) reaches memory as it reaches the row.
    changed = [dataclasses.replace(g, index=g.index + 4, default_mw=900_000, model="Other") for g in inventory(0)]
    await m.register_agent("n0", "d0", changed, "b2", "v2")
    assert m.world.gpus["G0-1"].idx == 5 and m.world.gpus["G0-1"].tdp_mw == 900_000
    assert m.world.nodes["n0"].agent_version == "v2"
    await rows_equal_memory(m)


async def test_a_failing_item_takes_nothing_else_with_it(manager: Manager) -> None:
    m = manager
    await m.register_agent("n0", "d0", inventory(0), "b", "v")

    def cordon(u: str, fail: bool = False) -> Any:
        async def write(tx: Tx) -> str:
            tx.change_gpu(u, admin_to(GpuState.CORDONED, "t", "test"))
            tx.audit(tx.now, "test.cordon", u)
            if fail:  # refuses after it has written: its writes must not survive
                raise InvalidArgument(f"{u}: refused")
            return u
        return write

    split = m.kernel.split
    results = await asyncio.gather(
        m.kernel.submit("t", cordon("G0-0")), m.kernel.submit("t", cordon("G0-1", fail=True)),
        m.kernel.submit("t", cordon("G0-2")), return_exceptions=True)
    assert m.kernel.split == split + 1  # one group commit, rolled back and run again item by item
    assert results[0] == "G0-0" and results[2] == "G0-2"
    assert isinstance(results[1], InvalidArgument) and "refused" in str(results[1])
    assert [m.world.gpus[f"G0-{i}"].admin for i in range(3)] == [GpuState.CORDONED, None, GpuState.CORDONED]
    async with m.sm() as s:
        audited = (await s.scalars(select(AuditRow.target).where(AuditRow.action == "test.cordon"))).all()
    assert sorted(audited) == ["G0-0", "G0-2"]
    await rows_equal_memory(m)


async def test_a_report_gap_is_refused_inside_the_transaction_and_a_replay_acknowledged(manager: Manager) -> None:
    m = manager
    await m.register_agent("n0", "d0", inventory(0), "b", "v")
    assert await m.apply_report("n0", 1, [GpuReport("G0-0", "failed", [], [])]) == 1
    assert await m.apply_report("n0", 1, [GpuReport("G0-0", "healthy", [], [])]) == 1  # replay: ignored
    assert m.world.gpus["G0-0"].health == GpuState.FAILED
    with pytest.raises(InvalidArgument, match="expected 2, got 3"):
        await m.apply_report("n0", 3, [GpuReport("G0-0", "healthy", [], [])])
    assert m.world.nodes["n0"].last_seq == 1


async def test_silence_fails_gpus_and_a_restart_remembers_why(tmp_path: Path) -> None:
    """The health source is stored: a GPU failed by silence before a restart is healed when its
    agent returns after the restart (it was reset to "agent" before, and stayed failed)."""
    clock = FakeClock()
    settings = Settings(data_dir=tmp_path, suspect_after_s=6, fail_after_s=20, breaker_min_gpus=10_000)
    m = Manager(settings, clock)
    await m.start()
    await m.register_agent("n0", "d0", inventory(0), "b", "v")
    clock.advance(21)
    await m.check_heartbeats()
    assert m.world.gpus["G0-0"].health == GpuState.FAILED
    await m.stop()
    m2 = Manager(settings, clock)
    await m2.start()
    try:
        assert m2.world.gpus["G0-0"].health_source == "heartbeat"
        await m2.register_agent("n0", "d0", inventory(0), "b", "v")
        assert all(m2.world.gpus[f"G0-{i}"].health == GpuState.HEALTHY for i in range(PER_NODE))
        await rows_equal_memory(m2)
    finally:
        await m2.stop()
