"""Fault tests of high availability: real `ntp-manager serve` processes on one PostgreSQL database,
real agents (fake GPU backend) and a real worker layout source that know both managers.

- Two managers started at the same moment: exactly one leads. SIGKILL it: the standby takes
  over, the agents move to it and re-send what was not acknowledged, a GPU failure reported
  meanwhile is applied exactly once, and the new leader pushes a new layout at its epoch to the
  worker's watch; the breaker stays closed.
- SIGSTOP the leader for longer than its lease, then SIGCONT: it commits nothing (a trigger in
  the database records which manager's session wrote each row: none of the old leader's after the
  takeover), it exits with status 75, and the report it was holding lands on the new leader.
- A partition between the leader and the database (a proxy that stops moving bytes): the leader
  stops acting at the end of its lease and exits 75 by itself; the standby takes over and acts on
  the report sent meanwhile; once the partition heals nothing the old leader had in flight
  commits; reports neither lost nor applied twice, the breaker closed.

Leases are short (3 s) to keep the time small; bench/ha.py runs the heavy version.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import signal
import time
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from ntp_agent.backends.fake import FakeBackend, parse_scenario
from ntp_agent.core import Agent, AgentConfig
from ntp_manager.manager_process import ManagerProcess
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store import db, write_log
from ntp_manager.worker.sources import GrpcLayoutSource
from tests.fakes.partition import Partition
from tests.integration.conftest import PG, database

pytestmark = pytest.mark.skipif(not PG, reason="NTP_TEST_POSTGRES_URL is not set (no PostgreSQL server to test with)")

LEASE = {"NTP_LEASE_TTL_S": "3", "NTP_LEASE_RENEW_S": "0.5", "NTP_TAKEOVER_GRACE_S": "10",
         "NTP_HEARTBEAT_INTERVAL_S": "0.5", "NTP_SUSPECT_AFTER_S": "30", "NTP_FAIL_AFTER_S": "60",
         "NTP_LOG_FORMAT": "json"}
JOB = {"name": "llm", "tp": 4, "replicas": 2, "local_batch": 8, "min_tp": 2, "heads": 16, "mlp_columns": 64}


async def prepare(url: str) -> dict[str, str]:
    """Migrate and make the tokens, as `ntp-manager db upgrade` and `token create` do (in process:
    five CLI start-ups cost more than the rest of a test on a loaded machine)."""
    m = Manager(Settings(database_url=url))
    try:
        await db.upgrade(m.engine)
        tokens = {s: await m.create_token(f"test-{s}", s) for s in ("operator", "worker")}
        for n in ("node-0", "node-1"):
            tokens[n] = await m.create_token(f"agent-{n}", "agent", node=n)
        return tokens
    finally:
        await m.engine.dispose()


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path, env: dict[str, str] | None = None,
                  logged: tuple[str, ...] = write_log.TABLES) -> AsyncIterator[dict[str, Any]]:
    """A fresh database, migrated, with the write log (on `logged`) and tokens; managers are started
    by the test (`start(name)`, with `env`, default LEASE) and all killed at the end."""
    async with database("postgres", tmp_path) as url:
        tokens = await prepare(url)
        await write_log.install(url, logged)
        procs: list[ManagerProcess] = []

        def start(name: str, via: str | None = None, **extra: str) -> ManagerProcess:
            """Manager `name` on the database (`via`: the database's URL through a proxy)."""
            base = LEASE if env is None else env
            p = ManagerProcess(name, via or url, tmp_path / f"manager-{name}.log", {**base, **extra})
            procs.append(p)
            return p

        try:
            yield {"url": url, "pg": url.replace("postgresql+asyncpg://", "postgresql://"), "tokens": tokens,
                   "start": start}
        finally:
            for p in procs:
                p.stop(graceful=False)


def make_agent(node: str, domain: str, tok: str, managers: list[str]) -> tuple[Agent, FakeBackend]:
    backend = FakeBackend(parse_scenario({"seed": 3, "node": node, "domain": domain, "gpus": 4}), node=node)
    cfg = AgentConfig(manager=",".join(managers), token=tok, node=node, domain=domain, heartbeat_interval_s=0.5,
                      sample_interval_s=0.5, backoff_initial_s=0.1, backoff_max_s=1.0)
    return Agent(backend, cfg), backend


async def eventually(cond: Callable[[], Any], timeout: float = 60, what: str = "condition") -> None:
    """Until `cond()` (or what it returns, awaited) is true."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{what} not met in {timeout} s")


async def job_on(base: str, op: str, agents: list[Any]) -> None:
    """Once every agent is connected and the leader at `base` has applied their hellos (a welcome
    says the hello is durable; the leader applies it from the outbox), submit JOB there."""
    await eventually(lambda: all(x.connected.is_set() for x in agents), what="agents connected to a")

    async def applied() -> bool:
        return bool((await get(base, op, "/v1/status"))["nodes_connected"] >= len(agents))
    await eventually(applied, what="the agents' hellos applied by the leader")
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {op}"}) as h:
        assert (await h.post("/v1/jobs", json=JOB)).status_code == 201


async def has_layout(base: str, tok: str) -> bool:
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {tok}"}, timeout=10) as c:
        return (await c.get("/v1/jobs/llm/layout")).status_code == 200


async def get(base: str, tok: str, path: str) -> Any:
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {tok}"}, timeout=10) as c:
        r = await c.get(path)
        r.raise_for_status()
        return r.json()


async def lease_since(pg: str, holder: str) -> datetime:
    """When `holder` took the lease it holds now (the database's clock)."""
    conn = await asyncpg.connect(pg)
    try:
        since = await conn.fetchval("SELECT since FROM leader WHERE id = 1 AND holder = $1", holder)
    finally:
        await conn.close()
    assert isinstance(since, datetime), f"{holder} does not hold the lease"
    return since


async def run_agents(c: dict[str, Any], managers: list[str]) -> tuple[list[Agent], list[FakeBackend], list[Any]]:
    agents, backends, tasks = [], [], []
    for i in range(2):
        a, b = make_agent(f"node-{i}", f"nvl-{i}", c["tokens"][f"node-{i}"], managers)
        agents.append(a)
        backends.append(b)
        tasks.append(asyncio.create_task(a.run()))
    return agents, backends, tasks


async def stop_agents(agents: list[Agent], tasks: list[Any]) -> None:
    for a in agents:
        a.stopping.set()
    for t in tasks:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(t, 10)


async def check_reports(pg: str, agent: Agent) -> None:
    """Nothing lost, nothing applied twice: no report seq of the agent's node applied twice to a GPU,
    every GPU of the node failed by a report, and the node's stored seq is exactly what the agent
    had acknowledged."""
    for _ in range(100):  # a report acknowledged after the caller's check is applied within moments
        conn = await asyncpg.connect(pg)
        try:
            events = await conn.fetch("SELECT gpu_uuid, seq, old_state, new_state FROM health_events "
                                      "WHERE node = $1 AND source = 'agent' ORDER BY id", agent.cfg.node)
            last_seq = await conn.fetchval("SELECT last_seq FROM nodes WHERE name = $1", agent.cfg.node)
        finally:
            await conn.close()
        if last_seq == agent.last_acked:
            break
        await asyncio.sleep(0.1)
    applied = [(e["gpu_uuid"], e["seq"]) for e in events]
    assert len(applied) == len(set(applied)), events
    assert {e["gpu_uuid"] for e in events if e["new_state"] == "failed"} == {g.uuid for g in agent.statics}
    assert last_seq == agent.last_acked >= max(seq for _, seq in applied)


async def test_started_together_one_leads_and_when_it_is_killed_the_other_takes_over(tmp_path: Path) -> None:
    async with cluster(tmp_path) as c:
        procs = [c["start"](n) for n in ("a", "b")]  # both at the same moment: exactly one leads
        roles = {p.name: (await p.ready_async())["role"] for p in procs}
        assert sorted(roles.values()) == ["leader", "standby"]
        a, b = sorted(procs, key=lambda p: roles[p.name] != "leader")  # a: the leader
        conn = await asyncpg.connect(c["pg"])
        try:
            assert tuple(await conn.fetchrow("SELECT epoch, holder FROM leader WHERE id = 1")) == (a.info["epoch"],
                                                                                                   a.name)
        finally:
            await conn.close()
        op, wtok = c["tokens"]["operator"], c["tokens"]["worker"]
        agents, backends, tasks = await run_agents(c, [a.grpc, b.grpc])
        try:
            await job_on(a.http, op, agents)
            gpu = agents[0].statics[0].uuid
            source = await asyncio.to_thread(GrpcLayoutSource, [a.grpc, b.grpc], wtok, "llm", gpu, "w0")
            try:
                first = source.latest()
                assert first is not None and len(first.replicas) == 2
                a.proc.kill()  # SIGKILL: no release, the standby waits for the lease to expire
                backends[1].inject("xid", 0, xid=79)  # meanwhile node-1 loses a GPU (fails the node)
                took = await b.leading()
                assert took["epoch"] > first.epoch
                # the new leader applies the buffered report and pushes a layout at its epoch
                await eventually(lambda: (source.latest() or first).version > first.version, what="new layout")
                lay = source.latest()
                assert lay is not None and lay.epoch == took["epoch"] and len(lay.replicas) == 1
                assert source.failovers >= 1 and all(x.failovers >= 1 for x in agents)
                status = await get(b.http, op, "/v1/status")
                assert status["leader_epoch"] == took["epoch"] and status["breaker"]["open"] is False
                failed = await get(b.http, op, "/v1/gpus?state=failed")
                assert {g["uuid"] for g in failed["items"]} == {g.uuid for g in agents[1].statics}
                # issue 41: the new leader loaded who owns what; a second job over llm's domains is refused
                alloc = await get(b.http, op, "/v1/cluster/allocation")
                assert {d["job"] for d in alloc["items"]} == {"llm"} and alloc["pool"]["domains"] == 0
                async with httpx.AsyncClient(base_url=b.http, headers={"Authorization": f"Bearer {op}"}) as h:
                    r = await h.post("/v1/jobs", json=dict(JOB, name="other", replicas=1))
                    assert r.status_code == 409 and "0 free GPUs" in r.json()["detail"], r.text
            finally:
                await asyncio.to_thread(source.close)
            await check_reports(c["pg"], agents[1])
        finally:
            await stop_agents(agents, tasks)


async def test_a_leader_paused_past_its_lease_commits_nothing_when_it_wakes(tmp_path: Path) -> None:
    async with cluster(tmp_path) as c:
        a = c["start"]("a")
        await a.ready_async()
        b = c["start"]("b")
        await b.ready_async()
        op = c["tokens"]["operator"]
        agents, backends, tasks = await run_agents(c, [a.grpc, b.grpc])
        try:
            await job_on(a.http, op, agents)
            await eventually(lambda: has_layout(a.http, op), what="first layout")
            a.proc.send_signal(signal.SIGSTOP)
            took = await b.leading()
            # the agents' streams to a hang (it is stopped, its sockets open): this report waits
            # in a's socket buffer, and a would apply it first when it wakes
            backends[1].inject("xid", 0, xid=79)
            await eventually(lambda: agents[1].sent_upto >= 1, what="report sent to the paused leader")
            a.proc.send_signal(signal.SIGCONT)
            rc = await asyncio.to_thread(a.proc.wait, 60)
            assert rc == 75, a.log.read_text()[-3000:]  # it found its lease gone and exited for a restart
            assert "lost the lease" in a.log.read_text()
            # a committed nothing once b had taken over: no row of any table came from its sessions
            assert await write_log.writes_since(c["url"], "a", await lease_since(c["pg"], "b")) == 0
            # and b has the report (the agent re-sent it there) and acted on it at its epoch
            await eventually(lambda: agents[1].connected.is_set() and agents[1].last_acked >= 1,
                             what="report acknowledged by b")
            failed = await get(b.http, op, "/v1/gpus?state=failed")
            assert {g["uuid"] for g in failed["items"]} == {g.uuid for g in agents[1].statics}
            # the replan that failure causes is debounced: wait for b's layout rather than race it
            async def layout_of_b() -> bool:
                lay = await get(b.http, op, "/v1/jobs/llm/layout")
                return bool(lay["leader_epoch"] == took["epoch"])

            await eventually(layout_of_b, what="a layout stamped with b's epoch")
            assert await write_log.writes_since(c["url"], "b", await lease_since(c["pg"], "b")) > 0  # it counts
        finally:
            await stop_agents(agents, tasks)


async def test_a_leader_cut_off_from_the_database_stops_leading_and_the_standby_takes_over(tmp_path: Path) -> None:
    """A partition between the leader and PostgreSQL that drops everything (a proxy stops moving
    bytes; nobody is told, calls hang): the leader cannot renew, and it must stop acting as leader
    by the end of its lease (its agents' streams and watches end, so they move) and exit 75 on its
    own, partition or not; the standby takes over once the lease has expired, gets the report sent
    meanwhile from the agent (the cut-off leader could not commit it, so never acknowledged it) and
    pushes a layout at its epoch. Then the partition heals, letting through whatever the old
    leader's connections had in flight: nothing of it commits after its lease had ended."""
    async with cluster(tmp_path) as c:
        proxy = Partition.to(c["url"])
        await proxy.start()
        try:
            a = c["start"]("a", via=proxy.url(c["url"]))
            assert (await a.ready_async())["role"] == "leader"
            b = c["start"]("b")
            await b.ready_async()
            op, wtok = c["tokens"]["operator"], c["tokens"]["worker"]
            agents, backends, tasks = await run_agents(c, [a.grpc, b.grpc])
            try:
                await job_on(a.http, op, agents)
                source = await asyncio.to_thread(GrpcLayoutSource, [a.grpc, b.grpc], wtok, "llm",
                                                 agents[0].statics[0].uuid, "w0")
                try:
                    first = source.latest()
                    assert first is not None and len(first.replicas) == 2
                    proxy.cut()
                    await asyncio.sleep(0.3)  # what crossed before the cut has landed; nothing crosses now
                    conn = await asyncpg.connect(c["pg"])
                    try:  # the end of a's lease: no renewal of a's gets through from now on
                        row = await conn.fetchrow("SELECT holder, expires_at FROM leader WHERE id = 1")
                    finally:
                        await conn.close()
                    assert row["holder"] == "a"
                    backends[1].inject("xid", 0, xid=79)  # node-1 fails: a takes the report, cannot commit it
                    await eventually(lambda: agents[1].sent_upto >= 1, what="report sent to the cut-off leader")
                    took = await b.leading()
                    # a stopped leading and exits by itself, still cut off from its database
                    rc = await asyncio.to_thread(a.proc.wait, 60)
                    assert rc == 75, a.log.read_text()[-3000:]
                    assert "no renewal got through" in a.log.read_text()
                    # b acts on the report at its epoch; the agents and the watch moved to b
                    await eventually(lambda: (source.latest() or first).version > first.version, what="new layout")
                    lay = source.latest()
                    assert lay is not None and lay.epoch == took["epoch"] > first.epoch and len(lay.replicas) == 1
                    assert source.failovers >= 1 and all(x.failovers >= 1 for x in agents)
                    await eventually(lambda: agents[1].connected.is_set() and agents[1].last_acked >= 1,
                                     what="report acknowledged by b")
                    status = await get(b.http, op, "/v1/status")
                    assert status["leader_epoch"] == took["epoch"] and status["breaker"]["open"] is False
                finally:
                    await asyncio.to_thread(source.close)
                proxy.heal()  # what a's connections held reaches the database now
                await asyncio.sleep(1.0)
                assert await write_log.writes_since(c["url"], "a", row["expires_at"]) == 0
                assert await write_log.writes_since(c["url"], "b", await lease_since(c["pg"], "b")) > 0
                await check_reports(c["pg"], agents[1])
            finally:
                await stop_agents(agents, tasks)
        finally:
            await proxy.stop()
