"""One manager on SQLite runs the same design as managers sharing PostgreSQL (service/leadership/fleet.py):
its agents' hellos and reports go through the same ingest and consumer, the outbox handed over in
memory (service/ingest/port.py), and its watches are served by the same layout feed. Real gRPC on
loopback, real SQLite.

What the in-memory handover must keep: an ack only once the report is applied and committed (the
state is in the database file before the agent hears of it, so a SIGKILL of a real `ntp-manager
serve` loses nothing acknowledged), a row that cannot be applied is quarantined with its reason and
its payload (the audit row: the only durable copy of it) and its agent is told (never
acknowledged), a replayed report is acknowledged and not applied twice (even one re-sent while the
first is still on its way, or after a restart)."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
from pathlib import Path

import grpc
from sqlalchemy import select

from ntp_manager.contract.proto.ntp.v1 import common_pb2
from ntp_manager.service.ingest.port import MemoryOutbox
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store import db, outbox
from ntp_manager.store.models import AuditRow, GpuRow, HealthEventRow, NodeRow, OutboxQuarantineRow
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.fakes.procs import create_agent_tokens, start_manager, stop_process
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
    # a later run numbers its entries after the quarantined one: a new quarantine row is never lost.
    # Its refused hello is large (128 GPUs of long UUIDs): its audit row keeps the payload cut, and says so
    big = ["GPU-x", *(f"GPU-{'u' * 100}-{i:03d}" for i in range(1, 128))]
    async with running_service(_url(tmp_path), tmp_path) as svc:
        for n in ("node-3", "node-4"):
            await svc.agent_token(n)
        async with svc.manager.kernel.lock:
            a = await _agent(svc, "node-3", "nvl-3", ["GPU-x"])
            await eventually(lambda: svc.manager.fleet.ingest.queued() == 1)
            b = await _agent(svc, "node-4", "nvl-4", big)
            await eventually(lambda: svc.manager.fleet.ingest.queued() == 2)
        await b.wait_for(lambda: b.error is not None)
        async with svc.manager.sm() as s:
            seqs = (await s.scalars(select(OutboxQuarantineRow.seq).order_by(OutboxQuarantineRow.seq))).all()
        assert len(seqs) == 2 and seqs[1] > seqs[0]
        for x in (a, b):
            await x.close()
    # after the restarts, the database file alone says what was refused (the outbox was in memory)
    other = db.make_engine(_url(tmp_path))
    try:
        async with db.sessionmaker(other)() as s:
            audit = (await s.scalars(select(AuditRow).where(AuditRow.action == "outbox.quarantine")
                                     .order_by(AuditRow.id))).all()
    finally:
        await other.dispose()
    assert [r.after["seq"] for r in audit] == list(seqs) and [r.target for r in audit] == ["node-1", "node-4"]
    whole, cut = audit[0].after, audit[1].after
    assert whole["kind"] == "hello" and whole["node"] == "node-1" and whole["report_seq"] is None
    assert "payload_cut" not in whole and "payload_head" not in whole
    p = whole["payload"]
    assert p["domain"] == "nvl-1" and p["boot_id"] == "boot-1" and p["agent_version"] == "test"
    assert [g[0] for g in p["gpus"]] == ["GPU-shared", "GPU-node-1-1"]
    assert p["gpus"][0] == ["GPU-shared", 0, "FakeGPU", 0, 1_000_000, 200_000, 1_300_000]
    assert whole["payload_bytes"] == len(json.dumps(p, separators=(",", ":"), sort_keys=True))
    assert "payload" not in cut and cut["payload_cut"] is True and cut["kind"] == "hello"
    assert cut["payload_bytes"] > outbox.QUARANTINE_PAYLOAD_CAP == len(cut["payload_head"])
    head = cut["payload_head"]
    assert head.startswith('{"agent_version":"test","boot_id":"boot-1","domain":"nvl-4","gpus":[["GPU-x",0,')
    assert f'["{big[50]}",50,"FakeGPU"' in head and big[-1] not in head  # the start kept, the end cut


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


KILL_NODES, KILL_WINDOW, KILL_MAX = 4, 16, 2000  # agents; reports each keeps unacknowledged; seqs it may send


def kill_script(seq: int) -> tuple[int, str]:
    """Report `seq` of a node sets its GPU seq % 4 failed or healthy, in turns: every report changes state."""
    return seq % 4, ("failed" if (seq // 4) % 2 == 0 else "healthy")


def _stored(conn: sqlite3.Connection, node: str) -> list[tuple[int, str, str]]:
    """The reports of `node` the database holds, as its health events: (seq, GPU, state), in write
    order. Each event's old state is the one its GPU's previous event set (the GPUs start healthy):
    the states form one chain, no report applied twice or out of turn."""
    rows = conn.execute("SELECT seq, gpu_uuid, old_state, new_state FROM health_events "
                        "WHERE node = ? AND seq IS NOT NULL ORDER BY id", (node,)).fetchall()
    now: dict[str, str] = {}
    for seq, gpu, old, new in rows:
        assert old == now.get(gpu, "healthy"), f"{node}#{seq}: {gpu} went {old} -> {new} after {now.get(gpu)}"
        now[gpu] = new
    return [(int(s), str(g), str(h)) for s, g, _, h in rows]


async def test_sigkill_of_the_sqlite_manager_loses_no_acked_report_and_applies_resent_ones_once(
        tmp_path: Path) -> None:
    """`ntp-manager serve` on a SQLite file, a real process: four agents stream reports concurrently,
    each keeping KILL_WINDOW unacknowledged, and the manager is SIGKILLed while they are in flight.
    The file then holds every acknowledged report (the ack follows the commit of the transaction
    that applied it), each once, with no gap. Restarted on the same file, each agent's welcome
    says exactly what the file holds (at least its highest ack), and the agent re-sends everything
    it sent and was not acknowledged for, and a few it was: the ones applied already are
    acknowledged and not applied again, the rest are applied once each, each on the state the
    restarted manager loaded (the events' old states chain on from those written before the kill)."""
    data = tmp_path / "data"
    nodes = [f"node-{i}" for i in range(KILL_NODES)]
    tokens = create_agent_tokens(data, nodes)
    env = {"NTP_SUSPECT_AFTER_S": "60", "NTP_FAIL_AFTER_S": "120", "NTP_BREAKER_MIN_GPUS": "100000"}
    proc, info = start_manager(data, env=env)
    sent = dict.fromkeys(nodes, 0)  # each node's highest seq handed to its stream

    async def pump(a: ScriptedAgent) -> None:
        for seq in range(1, KILL_MAX + 1):
            await a.wait_for(lambda s=seq: s - max(a.acks, default=0) <= KILL_WINDOW or a.error is not None)
            if a.error is not None:
                return
            gpu, state = kill_script(seq)
            await a.report({f"GPU-{a.node}-{gpu}": state}, seq=seq, wait=False)
            sent[a.node] = seq

    try:
        agents = [ScriptedAgent(info["grpc"], tokens[n], n, f"nvl-{i // 2}", gpu_uuids(n, 4))
                  for i, n in enumerate(nodes)]
        for a in agents:
            await a.connect()
            await a.wait_for(lambda a=a: a.welcome is not None)
        pumps = [asyncio.create_task(pump(a)) for a in agents]
        await eventually(lambda: all(max(a.acks, default=0) >= 40 for a in agents), timeout=20)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        await asyncio.wait_for(asyncio.gather(*pumps), 15)  # each ends on its stream's error
        for a in agents:
            await a.close()  # every ack the manager sent before it died has been read
        acked = {a.node: max(a.acks) for a in agents}
        assert all(a.error is not None for a in agents)
        assert all(sent[n] < KILL_MAX for n in nodes), "the agents ran out of reports before the kill"
        assert sum(sent.values()) > sum(acked.values()), "nothing was in flight at the kill"

        # the file as the kill left it: every acked report, each once, in order, and the GPUs' state
        conn = sqlite3.connect(data / "ntp-manager.db")
        try:
            held = {}
            for n in nodes:
                rows = _stored(conn, n)
                seqs = [s for s, _, _ in rows]
                assert seqs == list(range(1, len(seqs) + 1)), f"{n}: stored reports have a gap or a duplicate"
                assert len(seqs) >= acked[n], f"{n}: acked up to {acked[n]}, stored {len(seqs)}"
                assert all((g, h) == (f"GPU-{n}-{kill_script(s)[0]}", kill_script(s)[1]) for s, g, h in rows)
                assert conn.execute("SELECT last_seq FROM nodes WHERE name = ?", (n,)).fetchone()[0] == len(seqs)
                held[n] = len(seqs)
        finally:
            conn.close()

        proc, info = start_manager(data, env=env)
        again = []
        for i, n in enumerate(nodes):
            a = ScriptedAgent(info["grpc"], tokens[n], n, f"nvl-{i // 2}", gpu_uuids(n, 4))
            await a.connect()
            await a.wait_for(lambda a=a: a.welcome is not None)
            assert a.welcome.last_applied_seq == held[n] >= acked[n]
            # all it was not acknowledged for, and the last few it was (an agent cannot tell a report
            # lost from an ack lost: these are reports applied and not acknowledged, as far as it knows)
            for seq in range(max(1, acked[n] - 3), sent[n] + 1):
                gpu, state = kill_script(seq)
                await a.report({f"GPU-{n}-{gpu}": state}, seq=seq, wait=False)
            again.append(a)
        for a in again:
            await a.wait_for(lambda a=a: (a.acks and a.acks[-1] == sent[a.node]) or a.error is not None)
            assert a.error is None and a.acks == sorted(a.acks)
            await a.close()
        conn = sqlite3.connect(data / "ntp-manager.db")
        try:
            for n in nodes:
                rows = _stored(conn, n)
                assert [s for s, _, _ in rows] == list(range(1, sent[n] + 1)), f"{n}: not each report once"
                assert all((g, h) == (f"GPU-{n}-{kill_script(s)[0]}", kill_script(s)[1]) for s, g, h in rows)
                assert conn.execute("SELECT last_seq FROM nodes WHERE name = ?", (n,)).fetchone()[0] == sent[n]
                for gpu in range(4):  # each GPU holds what its last report said
                    last = max(s for s in range(1, sent[n] + 1) if kill_script(s)[0] == gpu)
                    assert conn.execute("SELECT health FROM gpus WHERE uuid = ?", (f"GPU-{n}-{gpu}",)
                                        ).fetchone()[0] == kill_script(last)[1]
        finally:
            conn.close()
    finally:
        stop_process(proc)
