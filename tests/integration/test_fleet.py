"""Fleet mode (issue 30) on a real PostgreSQL: real `ntp-manager serve` processes with
`NTP_FLEET_INGEST=1`, real agents (fake GPU backend) over gRPC on loopback.

- A report a standby acknowledged is applied by the leader (and replans the job there).
- A leader change moves only the planner role: the agents' streams on the standby stay (no
  reconnect), the new leader applies the outbox from the cursor the old one left, and publishes.
- A leader paused past its lease applies nothing when it wakes (no row of the leader's tables,
  the outbox cursor included, from its sessions after the takeover) and exits.
- A report stored twice (re-sent to another manager) is applied once; a row that cannot be
  applied is quarantined with its reason and does not hold up the rows after it.
- A manager that dies drops only its own streams; their agents move, the others stay.
- A standby cut off from PostgreSQL acknowledges nothing it cannot store: it answers UNAVAILABLE,
  and the agent re-sends to another manager.
Each checks the counters: no report applied twice, none acknowledged and lost, nothing quarantined.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import pytest

from ntp_manager.agent.core import Agent
from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from ntp_manager.manager_process import ManagerProcess
from ntp_manager.store import write_log
from tests.fakes.partition import Partition
from tests.integration.conftest import PG, database
from tests.integration.test_ha import (
    LEASE,
    check_reports,
    eventually,
    get,
    job_on,
    lease_since,
    make_agent,
    prepare,
    stop_agents,
)

pytestmark = pytest.mark.skipif(not PG, reason="NTP_TEST_POSTGRES_URL is not set (no PostgreSQL server to test with)")

FLEET = {**LEASE, "NTP_FLEET_INGEST": "1", "NTP_FLEET_POLL_S": "0.2"}
LEADER_TABLES = (*write_log.TABLES, "outbox_state", "outbox_quarantine", "agent_commands")


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    async with database("postgres", tmp_path) as url:
        tokens = await prepare(url)
        await write_log.install(url, LEADER_TABLES)
        procs: list[ManagerProcess] = []

        def start(name: str, via: str | None = None, **extra: str) -> ManagerProcess:
            p = ManagerProcess(name, via or url, tmp_path / f"manager-{name}.log", {**FLEET, **extra})
            procs.append(p)
            return p

        try:
            yield {"url": url, "pg": url.replace("postgresql+asyncpg://", "postgresql://"), "tokens": tokens,
                   "start": start}
        finally:
            for p in procs:
                p.stop(graceful=False)


async def started(c: dict[str, Any], *names: str) -> list[ManagerProcess]:
    """Managers started one after the other: the first leads."""
    out = []
    for n in names:
        p = c["start"](n)
        await p.ready_async()
        out.append(p)
    assert out[0].info["role"] == "leader" and all(p.info["role"] == "standby" for p in out[1:])
    return out


async def agents_on(c: dict[str, Any], lists: list[list[str]]) -> tuple[list[Agent], list[Any], list[Any]]:
    agents, backends, tasks = [], [], []
    for i, managers in enumerate(lists):
        a, b = make_agent(f"node-{i}", f"nvl-{i}", c["tokens"][f"node-{i}"], managers)
        agents.append(a)
        backends.append(b)
        tasks.append(asyncio.create_task(a.run()))
    await eventually(lambda: all(a.connected.is_set() for a in agents), what="agents connected")
    return agents, backends, tasks


async def counters(pg: str) -> dict[str, int]:
    """The outbox's state: rows, the leader's cursor, quarantined rows."""
    conn = await asyncpg.connect(pg)
    try:
        head = await conn.fetchval("SELECT coalesce(max(seq), 0) FROM outbox")
        cursor = await conn.fetchval("SELECT coalesce(max(last_seq), 0) FROM outbox_state WHERE consumer = 'leader'")
        quarantined = await conn.fetchval("SELECT count(*) FROM outbox_quarantine")
        epoch = await conn.fetchval("SELECT coalesce(max(epoch), 0) FROM outbox_state")
    finally:
        await conn.close()
    return {"head": head, "cursor": cursor, "quarantined": quarantined, "epoch": epoch}


async def applied_all(pg: str) -> bool:
    c = await counters(pg)
    return bool(c["cursor"] == c["head"])


async def settled(pg: str, agent: Agent) -> bool:
    """Every report the agent has had acknowledged is applied: the node's stored seq caught up with
    it and the outbox is drained (an ack means durable, not yet applied by the leader)."""
    conn = await asyncpg.connect(pg)
    try:
        last_seq = await conn.fetchval("SELECT last_seq FROM nodes WHERE name = $1", agent.cfg.node)
    finally:
        await conn.close()
    return bool(last_seq == agent.last_acked) and await applied_all(pg)


async def layout(base: str, tok: str) -> dict[str, Any] | None:
    with contextlib.suppress(Exception):
        return dict(await get(base, tok, "/v1/jobs/llm/layout"))
    return None


async def failed_on(base: str, tok: str) -> set[str]:
    return {g["uuid"] for g in (await get(base, tok, "/v1/gpus?state=failed"))["items"]}


async def test_a_report_a_standby_acknowledged_is_applied_by_the_leader(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        a, b = await started(c, "a", "b")
        op = c["tokens"]["operator"]
        agents, backends, tasks = await agents_on(c, [[b.grpc, a.grpc], [b.grpc, a.grpc]])
        try:
            assert all(x.target == b.grpc for x in agents)  # the standby took them: no redirect
            await job_on(a.http, op, agents)

            async def two_replicas() -> bool:
                lay = await layout(a.http, op)
                return lay is not None and lay["counts"]["replicas"] == 2

            await eventually(two_replicas, what="a layout on both nodes (hellos applied by the leader)")
            backends[1].inject("xid", 0, xid=79)  # node-1 fails; its agent reports to b
            await eventually(lambda: agents[1].last_acked >= 1, what="report acknowledged by the standby")
            await eventually(lambda: failed_on(a.http, op), what="the leader applied it")
            assert await failed_on(a.http, op) == {g.uuid for g in agents[1].statics}

            async def one_replica() -> bool:
                lay = await layout(a.http, op)
                return lay is not None and lay["counts"]["replicas"] == 1

            await eventually(one_replica, what="the leader replanned")
            await eventually(lambda: applied_all(c["pg"]), what="the outbox applied")
            assert (await counters(c["pg"]))["quarantined"] == 0
            assert all(x.failovers == 0 for x in agents)
            await eventually(lambda: settled(c["pg"], agents[1]), what="acknowledged reports applied")
            await check_reports(c["pg"], agents[1])
        finally:
            await stop_agents(agents, tasks)


async def test_a_leader_change_moves_only_the_planner_role(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        a, b = await started(c, "a", "b")
        op = c["tokens"]["operator"]
        agents, backends, tasks = await agents_on(c, [[b.grpc, a.grpc], [b.grpc, a.grpc]])
        try:
            await job_on(a.http, op, agents)
            await eventually(lambda: layout(a.http, op), what="first layout")
            first = await layout(a.http, op)
            assert first is not None and first["counts"]["replicas"] == 2
            before = await counters(c["pg"])
            a.proc.kill()  # SIGKILL the leader: the agents' streams are on b and stay there
            backends[1].inject("xid", 0, xid=79)
            # b stores and acknowledges it while nobody leads
            await eventually(lambda: agents[1].last_acked >= 1, what="report acknowledged with no leader")
            took = await b.leading()
            assert took["epoch"] > first["leader_epoch"]

            async def new_layout() -> bool:
                lay = await layout(b.http, op)
                return lay is not None and lay["leader_epoch"] == took["epoch"] and lay["counts"]["replicas"] == 1

            await eventually(new_layout, what="a layout at the new epoch without the failed node")
            assert await failed_on(b.http, op) == {g.uuid for g in agents[1].statics}
            await eventually(lambda: applied_all(c["pg"]), what="the outbox applied")
            after = await counters(c["pg"])
            assert after["cursor"] > before["cursor"] and after["epoch"] == took["epoch"]  # replayed from the cursor
            assert after["quarantined"] == 0
            assert all(x.failovers == 0 and x.target == b.grpc for x in agents)  # no stream reconnected
            await eventually(lambda: settled(c["pg"], agents[1]), what="acknowledged reports applied")
            await check_reports(c["pg"], agents[1])
        finally:
            await stop_agents(agents, tasks)


async def test_a_deposed_leader_applies_nothing_when_it_wakes(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        a, b = await started(c, "a", "b")
        op = c["tokens"]["operator"]
        agents, backends, tasks = await agents_on(c, [[b.grpc, a.grpc], [b.grpc, a.grpc]])
        try:
            await job_on(a.http, op, agents)
            await eventually(lambda: layout(a.http, op), what="first layout")
            a.proc.send_signal(signal.SIGSTOP)
            took = await b.leading()
            backends[1].inject("xid", 0, xid=79)  # stored by b; a would apply it if it could
            await eventually(lambda: agents[1].last_acked >= 1, what="report acknowledged")
            a.proc.send_signal(signal.SIGCONT)
            rc = await asyncio.to_thread(a.proc.wait, 60)
            assert rc == 75, a.log.read_text()[-3000:]
            since = await lease_since(c["pg"], "b")
            assert await write_log.writes_since(c["url"], "a", since) == 0  # the cursor included

            async def new_layout() -> bool:
                lay = await layout(b.http, op)
                return lay is not None and lay["leader_epoch"] == took["epoch"] and lay["counts"]["replicas"] == 1

            await eventually(new_layout, what="b's layout")
            await eventually(lambda: applied_all(c["pg"]), what="the outbox applied")
            assert (await counters(c["pg"]))["quarantined"] == 0
            assert await write_log.writes_since(c["url"], "b", since) > 0  # the log counts
            await eventually(lambda: settled(c["pg"], agents[1]), what="acknowledged reports applied")
            await check_reports(c["pg"], agents[1])
        finally:
            await stop_agents(agents, tasks)


async def _stream(target: str, token: str, node: str, gpus: list[str], seq: int) -> tuple[int, int]:
    """One agent stream by hand: hello, one report of seq `seq` (the first GPU failed); the welcome's
    last applied seq and the seq acknowledged."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)  # type: ignore[no-untyped-call]
        q: asyncio.Queue[agent_pb2.AgentMessage | None] = asyncio.Queue()
        await q.put(agent_pb2.AgentMessage(hello=agent_pb2.Hello(
            node=node, domain="nvl-0", agent_version="t", boot_id="boot",
            gpus=[common_pb2.GpuInfo(uuid=u, index=i) for i, u in enumerate(gpus)])))

        async def requests() -> AsyncIterator[agent_pb2.AgentMessage]:
            while (m := await q.get()) is not None:
                yield m

        call = stub.Connect(requests(), metadata=(("authorization", f"Bearer {token}"),))
        welcome = await call.read()
        await q.put(agent_pb2.AgentMessage(report=agent_pb2.HealthReport(seq=seq, gpus=[agent_pb2.GpuHealth(
            uuid=gpus[0], state=common_pb2.GPU_STATE_FAILED, reasons=["test"])])))
        while True:
            msg = await call.read()
            if msg.WhichOneof("body") == "ack":
                await q.put(None)
                call.cancel()
                return int(welcome.welcome.last_applied_seq), int(msg.ack.seq)


async def test_a_report_stored_twice_is_applied_once(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        a, b = await started(c, "a", "b")
        tok = c["tokens"]["node-0"]
        gpus = ["GPU-dup-0", "GPU-dup-1"]
        assert await _stream(b.grpc, tok, "node-0", gpus, 1) == (0, 1)
        # the agent did not see that ack and re-sends report 1 to the leader: acknowledged, not stored
        # again (its welcome may say 1 already: then the agent would not even re-send)
        last, acked = await _stream(a.grpc, tok, "node-0", gpus, 1)
        assert acked == 1 and last in (0, 1)
        await eventually(lambda: applied_all(c["pg"]), what="the outbox applied")
        conn = await asyncpg.connect(c["pg"])
        try:
            assert await conn.fetchval("SELECT count(*) FROM outbox WHERE kind = 'report'") == 1
            assert await conn.fetchval("SELECT count(*) FROM health_events WHERE node = 'node-0' AND seq = 1") == 1
            assert await conn.fetchval("SELECT last_seq FROM nodes WHERE name = 'node-0'") == 1
            assert await conn.fetchval("SELECT health FROM gpus WHERE uuid = 'GPU-dup-0'") == "failed"
            assert await conn.fetchval("SELECT count(*) FROM outbox_quarantine") == 0
            # a row that cannot be applied (a report of a node that never said hello) is quarantined
            # with its reason and an audit row, and the rows after it are applied
            await conn.execute("INSERT INTO outbox (kind, node, report_seq, payload, idem_key, manager, created_at) "
                               "VALUES ('report', 'node-1', 1, '{\"gpus\": []}', 'bad-1', 'test', now())")
        finally:
            await conn.close()
        assert (await _stream(b.grpc, tok, "node-0", gpus, 2))[1] == 2
        await eventually(lambda: applied_all(c["pg"]), what="the outbox applied past the bad row")
        conn = await asyncpg.connect(c["pg"])
        try:
            reasons = [r["reason"] for r in await conn.fetch("SELECT reason FROM outbox_quarantine")]
            assert len(reasons) == 1 and "has not registered" in reasons[0], reasons
            assert await conn.fetchval("SELECT count(*) FROM audit_log WHERE action = 'outbox.quarantine'") == 1
            assert await conn.fetchval("SELECT last_seq FROM nodes WHERE name = 'node-0'") == 2
        finally:
            await conn.close()


async def test_a_manager_that_dies_drops_only_its_own_streams(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        a, b, s = await started(c, "a", "b", "c")
        op = c["tokens"]["operator"]
        agents, backends, tasks = await agents_on(c, [[b.grpc, s.grpc], [s.grpc, b.grpc]])
        try:
            assert [x.target for x in agents] == [b.grpc, s.grpc]
            await job_on(a.http, op, agents)
            await eventually(lambda: layout(a.http, op), what="first layout")
            b.proc.kill()  # a standby dies: node-0's stream moves to c, node-1's stays
            await eventually(lambda: agents[0].failovers >= 1 and agents[0].connected.is_set()
                             and agents[0].target == s.grpc, what="node-0 served by c")
            backends[0].inject("xid", 0, xid=79)
            await eventually(lambda: agents[0].last_acked >= 1, what="report acknowledged by c")
            await eventually(lambda: failed_on(a.http, op), what="the leader applied it")
            assert await failed_on(a.http, op) == {g.uuid for g in agents[0].statics}
            assert agents[1].failovers == 0 and agents[1].target == s.grpc
            assert a.proc.poll() is None and (await get(a.http, op, "/v1/status"))["leader_epoch"] == a.info["epoch"]
            await eventually(lambda: applied_all(c["pg"]), what="the outbox applied")
            assert (await counters(c["pg"]))["quarantined"] == 0
            await eventually(lambda: settled(c["pg"], agents[0]), what="acknowledged reports applied")
            await check_reports(c["pg"], agents[0])
        finally:
            await stop_agents(agents, tasks)


async def test_a_standby_cut_off_from_the_database_acknowledges_nothing(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        proxy = Partition.to(c["url"])
        await proxy.start()
        try:
            a = c["start"]("a")
            await a.ready_async()
            b = c["start"]("b", via=proxy.url(c["url"]), NTP_FLEET_STORE_TIMEOUT_S="1")
            assert (await b.ready_async())["role"] == "standby"
            op = c["tokens"]["operator"]
            agents, backends, tasks = await agents_on(c, [[a.grpc, b.grpc], [b.grpc, a.grpc]])
            try:
                assert [x.target for x in agents] == [a.grpc, b.grpc]
                await job_on(a.http, op, agents)
                await eventually(lambda: layout(a.http, op), what="first layout")
                proxy.cut()  # b cannot reach PostgreSQL; nobody is told, its calls hang
                backends[1].inject("xid", 0, xid=79)
                await eventually(lambda: agents[1].sent_upto >= 1, what="report sent to the cut-off standby")
                # b could not store it, so it answered UNAVAILABLE (never an ack); the agent went to a
                await eventually(lambda: agents[1].last_acked >= 1, what="report acknowledged by a")
                assert agents[1].failovers >= 1 and agents[1].target == a.grpc
                await eventually(lambda: failed_on(a.http, op), what="the leader applied it")
                assert await failed_on(a.http, op) == {g.uuid for g in agents[1].statics}
                assert agents[0].failovers == 0
                await eventually(lambda: applied_all(c["pg"]), what="the outbox applied")
                assert (await counters(c["pg"]))["quarantined"] == 0
                await eventually(lambda: settled(c["pg"], agents[1]), what="acknowledged reports applied")
                await check_reports(c["pg"], agents[1])
            finally:
                await stop_agents(agents, tasks)
        finally:
            await proxy.stop()
