"""Fault tests of high availability: real `ntp-manager serve` processes on one PostgreSQL database,
real agents (fake GPU backend) and a real worker layout source that know both managers.

- Two managers started at the same moment: exactly one leads. SIGKILL it: the standby takes
  over, the agents move to it and re-send what was not acknowledged, a GPU failure reported
  meanwhile is applied exactly once, and the new leader pushes a new layout at its epoch to the
  worker's watch; the breaker stays closed.
- SIGSTOP the leader for longer than its lease, then SIGCONT: it commits nothing (a trigger in
  the database records which manager's session wrote each row: none of the old leader's after the
  takeover), it exits with status 75, and the report it was holding lands on the new leader.

Leases are short (3 s) to keep the time small; bench/ha.py runs the heavy version.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from agent.backends.fake import FakeBackend, parse_scenario
from agent.core import Agent, AgentConfig
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store import db
from ntp_manager.worker.sources import GrpcLayoutSource
from tests.integration.conftest import PG, database

pytestmark = pytest.mark.skipif(not PG, reason="NTP_TEST_POSTGRES_URL is not set (no PostgreSQL server to test with)")

LEASE = {"NTP_LEASE_TTL_S": "3", "NTP_LEASE_RENEW_S": "0.5", "NTP_TAKEOVER_GRACE_S": "10",
         "NTP_HEARTBEAT_INTERVAL_S": "0.5", "NTP_SUSPECT_AFTER_S": "30", "NTP_FAIL_AFTER_S": "60",
         "NTP_LOG_FORMAT": "json"}
JOB = {"name": "llm", "tp": 4, "replicas": 2, "local_batch": 8, "min_tp": 2, "heads": 16, "mlp_columns": 64}

# Which manager's session committed each row: a trigger on every table the manager writes records
# the session's application_name (service/leader.py names them "ntp-manager <leader id>"). Rows of
# a refused transaction roll back with it, so this counts committed writes only.
WRITE_LOG = """
CREATE TABLE ha_write_log (id bigserial PRIMARY KEY, app text NOT NULL, tbl text NOT NULL,
                           at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION ha_log_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO ha_write_log (app, tbl) VALUES (current_setting('application_name'), TG_TABLE_NAME);
  RETURN NULL;
END $$;
"""
LOGGED = ("nodes", "gpus", "domains", "health_events", "audit_log", "layouts", "jobs", "breaker", "idempotency_keys")


class ManagerProc:
    """One `ntp-manager serve` process; its stdout lines are collected by a thread."""

    def __init__(self, name: str, url: str, log_dir: Path, extra: dict[str, str] | None = None) -> None:
        env = dict(os.environ, NTP_DATABASE_URL=url, NTP_LEADER_ID=name, **LEASE, **(extra or {}))
        self.name = name
        self.log = log_dir / f"manager-{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ntp_manager.cli", "serve", "--http-port", "0", "--grpc-port", "0"],
            stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True, env=env)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.info: dict[str, Any] = {}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_line(self, prefix: str, timeout: float = 60) -> dict[str, Any]:
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return dict(json.loads(line[len(prefix):].strip()))
                left = end - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"manager {self.name}: no {prefix!r} line (rc={self.proc.poll()}); "
                                         f"log: {self.log.read_text()[-3000:]}")
                self._cond.wait(min(left, 0.1))

    async def ready(self) -> dict[str, Any]:
        self.info = await asyncio.to_thread(self.wait_line, "NTP-MANAGER READY")
        return self.info

    async def leading(self, timeout: float = 60) -> dict[str, Any]:
        return await asyncio.to_thread(self.wait_line, "NTP-MANAGER LEADING", timeout)

    @property
    def http(self) -> str:
        return f"http://{self.info['http']}"

    @property
    def grpc(self) -> str:
        return str(self.info["grpc"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.kill()
        self.proc.wait(30)


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
async def cluster(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """A fresh database, migrated, with the write log and tokens; managers are started by the test
    (`start(name)`) and all killed at the end."""
    async with database("postgres", tmp_path) as url:
        tokens = await prepare(url)
        plain = url.replace("postgresql+asyncpg://", "postgresql://")
        conn = await asyncpg.connect(plain)
        try:
            await conn.execute(WRITE_LOG)
            for t in LOGGED:
                await conn.execute(f"CREATE TRIGGER ha_log AFTER INSERT OR UPDATE OR DELETE ON {t} "
                                   "FOR EACH ROW EXECUTE FUNCTION ha_log_write()")
        finally:
            await conn.close()
        procs: list[ManagerProc] = []

        def start(name: str, **extra: str) -> ManagerProc:
            p = ManagerProc(name, url, tmp_path, extra)
            procs.append(p)
            return p

        try:
            yield {"url": url, "pg": plain, "tokens": tokens, "start": start}
        finally:
            for p in procs:
                p.stop()


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


async def has_layout(base: str, tok: str) -> bool:
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {tok}"}, timeout=10) as c:
        return (await c.get("/v1/jobs/llm/layout")).status_code == 200


async def get(base: str, tok: str, path: str) -> Any:
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {tok}"}, timeout=10) as c:
        r = await c.get(path)
        r.raise_for_status()
        return r.json()


async def writes_by(pg: str, app_prefix: str, since_epoch_of: str) -> int:
    """Rows committed by sessions of `app_prefix` after the manager `since_epoch_of` took the lease."""
    conn = await asyncpg.connect(pg)
    try:
        return int(await conn.fetchval(
            "SELECT count(*) FROM ha_write_log WHERE app LIKE $1 AND at >= "
            "(SELECT since FROM leader WHERE id = 1 AND holder = $2)", app_prefix + "%", since_epoch_of))
    finally:
        await conn.close()


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


async def test_started_together_one_leads_and_when_it_is_killed_the_other_takes_over(tmp_path: Path) -> None:
    async with cluster(tmp_path) as c:
        procs = [c["start"](n) for n in ("a", "b")]  # both at the same moment: exactly one leads
        roles = {p.name: (await p.ready())["role"] for p in procs}
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
            await eventually(lambda: all(x.connected.is_set() for x in agents), what="agents connected to a")
            async with httpx.AsyncClient(base_url=a.http, headers={"Authorization": f"Bearer {op}"}) as h:
                assert (await h.post("/v1/jobs", json=JOB)).status_code == 201
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
            finally:
                await asyncio.to_thread(source.close)
            # nothing double-applied: no report seq of the node applied twice to a GPU, every GPU
            # failed by a report, and the node's seq is exactly what the agent had acknowledged
            conn = await asyncpg.connect(c["pg"])
            try:
                events = await conn.fetch("SELECT gpu_uuid, seq, old_state, new_state FROM health_events "
                                          "WHERE node = 'node-1' AND source = 'agent' ORDER BY id")
                last_seq = await conn.fetchval("SELECT last_seq FROM nodes WHERE name = 'node-1'")
            finally:
                await conn.close()
            applied = [(e["gpu_uuid"], e["seq"]) for e in events]
            assert len(applied) == len(set(applied)), events
            assert {e["gpu_uuid"] for e in events if e["new_state"] == "failed"} == {g.uuid for g in agents[1].statics}
            assert last_seq == agents[1].last_acked >= max(seq for _, seq in applied)
        finally:
            await stop_agents(agents, tasks)


async def test_a_leader_paused_past_its_lease_commits_nothing_when_it_wakes(tmp_path: Path) -> None:
    async with cluster(tmp_path) as c:
        a = c["start"]("a")
        await a.ready()
        b = c["start"]("b")
        await b.ready()
        op = c["tokens"]["operator"]
        agents, backends, tasks = await run_agents(c, [a.grpc, b.grpc])
        try:
            await eventually(lambda: all(x.connected.is_set() for x in agents), what="agents connected to a")
            async with httpx.AsyncClient(base_url=a.http, headers={"Authorization": f"Bearer {op}"}) as h:
                assert (await h.post("/v1/jobs", json=JOB)).status_code == 201
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
            assert await writes_by(c["pg"], "ntp-manager a", "b") == 0
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
            assert await writes_by(c["pg"], "ntp-manager b", "b") > 0  # the counter does see writes
        finally:
            await stop_agents(agents, tasks)
