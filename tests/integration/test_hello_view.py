"""service/ingest/hello_view.py: the checks of many hellos read in one statement give each hello
what reading it alone gives (store/outbox.py's per-node reads, the brute force beside it), and a
database that cannot be read fails every waiting hello, each with an error of its own. On a real
PostgreSQL database: one manager leading it, nodes registered and reports stored through its outbox.
"""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import select

from ntp_manager.service.ingest.hello_view import HelloViews
from ntp_manager.service.ingest.outbox import StoreHelloView
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store import outbox
from ntp_manager.store.db import make_engine
from ntp_manager.store.models import LeaderRow
from tests.integration.conftest import PG, database

pytestmark = pytest.mark.skipif(not PG, reason="NTP_TEST_POSTGRES_URL is not set (no PostgreSQL server to test with)")


def hello(node: str, domain: str, gpus: int) -> outbox.Entry:
    return outbox.Entry(outbox.HELLO, node, {
        "domain": domain, "boot_id": "b", "agent_version": "test", "token": None, "peer": "",
        "gpus": [[f"GPU-{node}-{k}", k, "H100", 80 << 30, 700_000, 200_000, 700_000] for k in range(gpus)]},
        f"hello:{node}")


def report(node: str, seq: int) -> outbox.Entry:
    return outbox.Entry(outbox.REPORT, node, {"gpus": [[f"GPU-{node}-0", "degraded", ["x"], [], None]]},
                        f"report:{node}:{seq}", report_seq=seq)


async def test_many_hellos_read_together_get_what_each_read_alone_gets(tmp_path: Path) -> None:
    rng = random.Random(11)
    async with database("postgres", tmp_path) as url:
        m = Manager(Settings(database_url=url, fleet_poll_s=0.05))
        try:
            await m.start()
            await m.wait_leading()
            assert m.fleet is not None
            # 40 nodes registered (applied); some with reports applied, some with reports stored
            # after the consumer is stopped (durable, not applied yet)
            async with m.sm() as s, s.begin():
                await outbox.append(s, [hello(f"n{i}", f"d{i // 4}", 4) for i in range(40)], "test",
                                    datetime.now(UTC))
                await outbox.append(s, [report(f"n{i}", 1) for i in range(0, 40, 3)], "test", datetime.now(UTC))
            await m.fleet.settled()
            assert len(m.world.nodes) == 40
            for t in m.fleet._tasks:
                if t.get_name() == "fleet-consumer":
                    t.cancel()
            async with m.sm() as s, s.begin():
                await outbox.append(s, [report(f"n{i}", 2 if i % 3 == 0 else 1) for i in range(0, 40, 5)], "test",
                                    datetime.now(UTC))

            views = HelloViews(m.engine.execution_options(isolation_level="AUTOCOMMIT"))
            asks = []
            for _ in range(300):  # known and unknown nodes, their own GPUs, others', unknown ones
                node = f"n{rng.randrange(50)}"
                uuids = rng.sample([f"GPU-n{rng.randrange(50)}-{k}" for k in range(6)], rng.randrange(0, 6))
                asks.append((node, uuids))
            got = await asyncio.gather(*(views.view(n, us) for n, us in asks))
            await views.close()
            assert views.hellos == len(asks) and views.reads < len(asks) / 10  # together, not one by one

            async with m.sm() as s:
                epoch = (await s.execute(select(LeaderRow.epoch).where(LeaderRow.id == 1))).scalar_one()
                for (node, uuids), v in zip(asks, got, strict=True):
                    assert v.domain == await outbox.node_domain(s, node)
                    assert v.owners == await outbox.gpu_owners(s, uuids)
                    assert v.last_seq == await outbox.node_last_seq(s, node)
                    assert v.epoch == epoch == m.epoch
            assert any(v.last_seq == 2 for v in got) and any(v.domain is None for v in got)
        finally:
            await m.stop()


async def test_a_database_that_cannot_be_read_fails_every_waiting_hello(tmp_path: Path) -> None:
    assert PG is not None
    engine = make_engine(PG.rsplit("/", 1)[0] + "/ntp_no_such_database_here")
    views = HelloViews(engine.execution_options(isolation_level="AUTOCOMMIT"))
    try:
        got = await asyncio.gather(*(views.view(f"n{i}", [f"GPU-{i}"]) for i in range(20)), return_exceptions=True)
    finally:
        await views.close()
        await engine.dispose()
    assert all(isinstance(e, OSError) and "cannot read the hello checks" in str(e) for e in got)
    assert len({id(e) for e in got}) == len(got)  # each its own


async def test_a_hello_whose_caller_gave_up_is_not_waited_for(tmp_path: Path) -> None:
    async with database("postgres", tmp_path) as url:
        m = Manager(Settings(database_url=url, fleet_poll_s=0.05))
        try:
            await m.start()
            await m.wait_leading()
            views = HelloViews(m.engine.execution_options(isolation_level="AUTOCOMMIT"))
            gone = asyncio.ensure_future(views.view("n0", []))
            await asyncio.sleep(0)
            gone.cancel()
            v = await asyncio.wait_for(views.view("n1", ["GPU-x"]), 10)
            await views.close()
            assert v.domain is None and v.owners == {} and v.last_seq == 0 and v.epoch == m.epoch
        finally:
            await m.stop()


async def test_the_check_is_planned_for_each_reads_own_gpus(tmp_path: Path) -> None:
    """A generic plan made while the tables are small scans every GPU row against each of a batch's
    GPUs in turn (quadratic: seconds a batch at 100,000 GPUs); the manager's hello checks never use
    one. PostgreSQL counts a prepared statement's plans of each kind (`pg_prepared_statements`).
    (Whether a default engine goes generic after the fifth run depends on the costs PostgreSQL
    estimates for both kinds, so this does not assert that it would.)"""
    async with database("postgres", tmp_path) as url:
        m = Manager(Settings(database_url=url, fleet_poll_s=0.05))
        try:
            await m.start()
            await m.wait_leading()
            check = m.fleet.agents.view  # what the manager's agent hellos are checked with
            for i in range(8):  # one at a time: one connection, the same prepared statement
                assert await check(f"n{i}", [f"GPU-n{i}-{k}" for k in range(8)]) == (None, {}, 0, m.epoch)
            assert m._hello_engine is not None and m._hello_engine is not m.engine
            assert isinstance(check, StoreHelloView) and check.views is not None
            # the reads one at a time all ran on the same kept connection: ask it (its session's statements)
            (kept,) = [c for c in check.views.connections if c._driver is not None]
            plans = await kept.fetch("SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE "
                                     "statement LIKE '%json_object_agg%' AND statement NOT LIKE '%pg_prepared%'")
            mode = (await kept.fetch("SHOW plan_cache_mode"))[0][0]
            assert [tuple(p) for p in plans] == [(0, 8)] and mode == "force_custom_plan"
        finally:
            await m.stop()
