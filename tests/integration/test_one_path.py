"""One manager on SQLite runs the same design as managers sharing PostgreSQL (service/leadership/fleet.py):
its agents' hellos and reports go through the same ingest and consumer, the outbox handed over in
memory (service/ingest/port.py), and its watches are served by the same layout feed. Real gRPC on
loopback, real SQLite.

What the in-memory handover must keep: an ack only once the report is applied and committed (the
state is in the database file before the agent hears of it), a row that cannot be applied is
quarantined with its reason and its agent is told (never acknowledged), a replayed report is
acknowledged and not applied twice (even one re-sent while the first is still on its way)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from sqlalchemy import select

from ntp_manager.contract.proto.ntp.v1 import common_pb2
from ntp_manager.service.ingest.port import MemoryOutbox
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store import db
from ntp_manager.store.models import AuditRow, GpuRow, HealthEventRow, NodeRow, OutboxQuarantineRow
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.integration.conftest import Service, eventually, running_service
from tests.integration.test_service import JOB, start_agents, watch


def _url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'ntp.db'}"


async def _agent(svc: Service, node: str, domain: str, gpus: list[str]) -> ScriptedAgent:
    a = ScriptedAgent(svc.grpc, await svc.agent_token(node), node, domain, gpus)
    await a.connect()
    return a


async def test_sqlite_runs_the_fleet_with_the_in_memory_outbox(tmp_path: Path) -> None:
    async with running_service(_url(tmp_path), tmp_path) as svc:
        m = svc.manager
        assert isinstance(m.fleet.ingest, MemoryOutbox) and m.shared is None and m.follower is None
        agents = await start_agents(svc)
        assert m.fleet.consumer is not None and m.fleet.consumer.applied >= 2  # the two hellos
        applied = m.fleet.consumer.applied
        await agents[0].report({"GPU-node-0-1": "failed"})
        assert m.fleet.consumer.applied == applied + 1  # the report went through the consumer
        for a in agents:
            await a.close()


async def test_an_ack_comes_once_the_report_is_applied_and_in_the_database(tmp_path: Path) -> None:
    """No `settled()`: the ack alone says the world and the database file hold the report. The file
    is read by another engine (another connection sees only what was committed), and again by a new
    manager after a restart."""
    url = _url(tmp_path)
    other = db.make_engine(url)
    try:
        async with running_service(url, tmp_path) as svc:
            a = await _agent(svc, "node-0", "nvl-0", gpu_uuids("node-0", 4))
            await a.wait_for(lambda: a.welcome is not None)
            assert a.welcome.last_applied_seq == 0
            for i in range(5):  # the state flips: each ack must follow its own report's commit
                state = "failed" if i % 2 == 0 else "healthy"
                seq = await a.report({"GPU-node-0-2": state})
                assert a.acks[-1] == seq and a.error is None
                assert svc.manager.world.gpus["GPU-node-0-2"].health == state
                assert svc.manager.world.nodes["node-0"].last_seq == seq
                async with db.sessionmaker(other)() as s:
                    assert await s.scalar(select(GpuRow.health).where(GpuRow.uuid == "GPU-node-0-2")) == state
                    assert await s.scalar(select(NodeRow.last_seq).where(NodeRow.name == "node-0")) == seq
            await a.close()
        m = Manager(Settings(data_dir=tmp_path, database_url=url))
        await m.start()
        try:
            assert m.world.gpus["GPU-node-0-2"].health == "failed" and m.world.nodes["node-0"].last_seq == 5
        finally:
            await m.stop()
    finally:
        await other.dispose()


async def test_a_row_that_cannot_be_applied_is_quarantined_and_its_agent_told(tmp_path: Path) -> None:
    """Two nodes say hello with the same GPU while neither is applied yet (the consumer is held):
    both pass the hello checks against the world, the first applied wins, the second is
    quarantined with its reason (outbox_quarantine and an audit row) and its agent gets
    INVALID_ARGUMENT, not a welcome."""
    async with running_service(_url(tmp_path), tmp_path) as svc:
        m = svc.manager
        for n in ("node-0", "node-1"):
            await svc.agent_token(n)  # made before the lock is held (a token is written under it)
        async with m.kernel.lock:  # the consumer's transaction waits
            first = await _agent(svc, "node-0", "nvl-0", ["GPU-shared", "GPU-node-0-1"])
            await eventually(lambda: m.fleet.ingest.queued() == 1)
            second = await _agent(svc, "node-1", "nvl-1", ["GPU-shared", "GPU-node-1-1"])
            await eventually(lambda: m.fleet.ingest.queued() == 2)
            assert first.welcome is None and second.welcome is None  # nothing is applied yet
        await first.wait_for(lambda: first.welcome is not None)
        await second.wait_for(lambda: second.error is not None)
        assert second.error is not None and second.welcome is None
        assert second.error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "already registered on node 'node-0'" in (second.error.details() or "")
        assert m.world.gpus["GPU-shared"].node == "node-0" and "node-1" not in m.world.nodes
        async with m.sm() as s:
            rows = (await s.execute(select(OutboxQuarantineRow.seq, OutboxQuarantineRow.reason))).all()
            audit = (await s.scalars(select(AuditRow).where(AuditRow.action == "outbox.quarantine"))).all()
        assert len(rows) == 1 and "already registered on node 'node-0'" in rows[0][1]
        assert len(audit) == 1 and audit[0].target == "node-1" and audit[0].after["seq"] == rows[0][0]
        assert m.fleet.consumer is not None and m.fleet.consumer.quarantined == 1
        await first.close()
        await second.close()
    # a later run numbers its entries after the quarantined one: a new quarantine row is never lost
    async with running_service(_url(tmp_path), tmp_path) as svc:
        for n in ("node-3", "node-4"):
            await svc.agent_token(n)
        async with svc.manager.kernel.lock:
            a = await _agent(svc, "node-3", "nvl-3", ["GPU-x"])
            await eventually(lambda: svc.manager.fleet.ingest.queued() == 1)
            b = await _agent(svc, "node-4", "nvl-4", ["GPU-x"])
            await eventually(lambda: svc.manager.fleet.ingest.queued() == 2)
        await b.wait_for(lambda: b.error is not None)
        async with svc.manager.sm() as s:
            seqs = (await s.scalars(select(OutboxQuarantineRow.seq).order_by(OutboxQuarantineRow.seq))).all()
        assert len(seqs) == 2 and seqs[1] > seqs[0]
        for x in (a, b):
            await x.close()


async def test_a_replayed_report_is_acked_and_not_applied_twice(tmp_path: Path) -> None:
    async with running_service(_url(tmp_path), tmp_path) as svc:
        m = svc.manager
        a = await _agent(svc, "node-0", "nvl-0", gpu_uuids("node-0", 4))
        await a.wait_for(lambda: a.welcome is not None)
        assert await a.report({"GPU-node-0-0": "failed"}) == 1
        # the same seq again on the same stream, saying something else: acknowledged, ignored
        await a.report({"GPU-node-0-0": "healthy"}, seq=1)
        assert a.acks == [1, 1] and m.world.gpus["GPU-node-0-0"].health == "failed"
        # seq 2 taken while the consumer is held; the agent loses its stream before the ack and
        # reconnects: the welcome counts seq 2 (still on its way), the re-sent seq 2 is not applied twice
        async with m.kernel.lock:
            await a.report({"GPU-node-0-1": "failed"}, wait=False)
            await eventually(lambda: m.fleet.ingest.queued() == 1)
            b = await _agent(svc, "node-0", "nvl-0", gpu_uuids("node-0", 4))
            await eventually(lambda: m.fleet.ingest.queued() == 2)  # its hello, behind the report
        await b.wait_for(lambda: b.welcome is not None)
        assert b.welcome.last_applied_seq == 2
        await b.report({"GPU-node-0-1": "failed"}, seq=2)
        assert b.acks == [2]
        assert await b.report({"GPU-node-0-3": "failed"}) == 3
        assert m.world.nodes["node-0"].last_seq == 3
        async with m.sm() as s:
            events = (await s.execute(select(HealthEventRow.gpu_uuid, HealthEventRow.seq)
                                      .where(HealthEventRow.seq.is_not(None)).order_by(HealthEventRow.id))).all()
        assert [tuple(e) for e in events] == [("GPU-node-0-0", 1), ("GPU-node-0-1", 2), ("GPU-node-0-3", 3)]
        await a.close()
        await b.close()


async def test_watches_get_layouts_through_the_layout_feed(tmp_path: Path) -> None:
    """The leader offers what it publishes to the feed its watches wait on (no poll, no
    notification with one manager); a deleted job ends its watches with NOT_FOUND."""
    async with running_service(_url(tmp_path), tmp_path) as svc:
        m = svc.manager
        agents = await start_agents(svc)
        async with svc.client() as c:
            assert (await c.post("/v1/jobs", json=JOB)).status_code == 201
            await eventually(lambda: m.world.jobs["llm"].layout is not None, timeout=30)
            seen: list[common_pb2.Layout] = []
            task = await watch(svc, "llm", "GPU-node-1-2", seen)
            await eventually(lambda: len(seen) == 1)
            assert "llm" in m.fleet.feed.jobs and m.fleet.feed.held() == 1
            offered = m.fleet.feed.offered
            await agents[1].report({"GPU-node-1-2": "failed"})
            await eventually(lambda: len(seen) == 2, timeout=30)
            assert seen[1].stamp.version == m.world.jobs["llm"].layout.version
            assert m.fleet.feed.offered > offered  # from the leader's world, not read back
            assert (await c.delete("/v1/jobs/llm")).status_code == 200
            done = await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 10)
        err = done[0]
        assert isinstance(err, grpc.aio.AioRpcError) and err.code() == grpc.StatusCode.NOT_FOUND
        for a in agents:
            await a.close()


async def test_reports_taken_as_the_manager_stops_are_applied_before_it_ends(tmp_path: Path) -> None:
    """A stop ends the streams, then lets the consumer apply what the in-memory outbox still holds
    (the kernel's queue was committed at stop the same way before): nothing an agent sent and the
    manager took is lost by a clean stop, and what was acknowledged is in the database."""
    url = _url(tmp_path)
    async with running_service(url, tmp_path) as svc:
        m = svc.manager
        a = await _agent(svc, "node-0", "nvl-0", gpu_uuids("node-0", 4))
        await a.wait_for(lambda: a.welcome is not None)
        async with m.kernel.lock:  # three reports taken, none applied yet
            for i in range(3):
                await a.report({f"GPU-node-0-{i}": "failed"}, wait=False)
            await eventually(lambda: m.fleet.ingest.queued() == 3)
            stopping = asyncio.create_task(m.fleet.stop())
            await asyncio.sleep(0.05)
            assert not stopping.done()  # it waits for the consumer, held by the lock
        await asyncio.wait_for(stopping, 10)
        assert m.fleet.ingest.queued() == 0 and m.world.nodes["node-0"].last_seq == 3
        await a.close()
    m2 = Manager(Settings(data_dir=tmp_path, database_url=url))
    await m2.start()
    try:
        assert m2.world.nodes["node-0"].last_seq == 3
        assert all(m2.world.gpus[f"GPU-node-0-{i}"].health == "failed" for i in range(3))
    finally:
        await m2.stop()
