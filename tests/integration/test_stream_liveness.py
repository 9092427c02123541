"""Liveness from the agent's stream: a manager pings every open connection (rpc/server.py
`keepalive`) and counts the nodes whose streams are open as heard from every liveness period
(service/leadership/fleet.py); heartbeats only carry counters, at least every
`heartbeat_max_quiet_s` (agent/ntp_agent/core.py `beat_due`). So a quiet agent keeps its GPUs
healthy, a stopped one's stream ends within about two periods and its GPUs go suspect, and an
open stream that brings nothing for three times the longest quiet is ended as stuck. Real gRPC on
loopback; the stopped agent is a real process; the standby case runs two managers on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.integration.conftest import PG, Service, database, eventually, running_service

ROOT = Path(__file__).resolve().parents[2]


def _sqlite(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'ntp.db'}"


async def _agent(svc: Service, node: str) -> ScriptedAgent:
    a = ScriptedAgent(svc.grpc, await svc.agent_token(node), node, f"d-{node}", gpu_uuids(node, 2))
    await a.connect()
    await a.wait_for(lambda: a.welcome is not None or a.error is not None)
    assert a.error is None
    return a


def _health(svc: Service, node: str) -> set[str]:
    return {svc.manager.world.gpus[u].health for u in gpu_uuids(node, 2)}


async def test_a_quiet_agent_with_its_stream_open_stays_healthy(tmp_path: Path) -> None:
    async with running_service(_sqlite(tmp_path), tmp_path, heartbeat_interval_s=0.25, heartbeat_max_quiet_s=30,
                               suspect_after_s=1.0, fail_after_s=2.0) as svc:
        quiet = await _agent(svc, "n0")
        assert quiet.welcome.heartbeat_interval_ms == 250 and quiet.welcome.heartbeat_max_quiet_ms == 30_000
        gone = await _agent(svc, "n1")
        await gone.close()  # the control: a node whose stream ended goes silent
        await eventually(lambda: _health(svc, "n1") == {"failed"}, 15)
        assert _health(svc, "n0") == {"healthy"}  # not one heartbeat sent, for longer than fail_after_s
        assert quiet.error is None
        await quiet.close()


async def test_a_stream_that_brings_nothing_for_three_quiets_is_ended(tmp_path: Path) -> None:
    async with running_service(_sqlite(tmp_path), tmp_path, heartbeat_interval_s=0.25, heartbeat_max_quiet_s=0.5,
                               suspect_after_s=60, fail_after_s=120) as svc:
        stuck, beating = await _agent(svc, "n0"), await _agent(svc, "n1")

        async def beat() -> None:
            while True:
                await beating.heartbeat()
                await asyncio.sleep(0.3)

        t = asyncio.create_task(beat())
        try:
            await stuck.wait_for(lambda: stuck.error is not None, 15)
            assert stuck.error is not None and stuck.error.code() == grpc.StatusCode.UNAVAILABLE
            assert "nothing from this agent for 1.5 s" in (stuck.error.details() or "")
            assert "n0" not in svc.manager.agents.sessions
            await asyncio.sleep(1.0)
            assert beating.error is None and "n1" in svc.manager.agents.sessions  # heartbeats keep it
        finally:
            t.cancel()
        await beating.close()
        await stuck.close()


AGENT = """
import asyncio, sys
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
async def main():
    a = ScriptedAgent(sys.argv[1], sys.argv[2], "n0", "d-n0", gpu_uuids("n0", 2))
    await a.connect()
    await a.wait_for(lambda: a.welcome is not None)
    print("welcomed", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_a_stopped_agents_stream_ends_and_its_gpus_go_suspect(tmp_path: Path) -> None:
    async with running_service(_sqlite(tmp_path), tmp_path, heartbeat_interval_s=1.0, heartbeat_max_quiet_s=600,
                               suspect_after_s=1.0, fail_after_s=600) as svc:
        proc = subprocess.Popen([sys.executable, "-c", AGENT, svc.grpc, await svc.agent_token("n0")], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert proc.stdout is not None
            assert await asyncio.to_thread(proc.stdout.readline) == "welcomed\n"
            await asyncio.sleep(3)  # quiet (no heartbeat), stream open: healthy
            assert "n0" in svc.manager.agents.sessions and _health(svc, "n0") == {"healthy"}
            os.kill(proc.pid, signal.SIGSTOP)  # its connection answers no ping any more
            await eventually(lambda: "n0" not in svc.manager.agents.sessions, 20)
            await eventually(lambda: _health(svc, "n0") == {"suspect"}, 10)
        finally:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.skipif(not PG, reason="NTP_TEST_POSTGRES_URL is not set (no PostgreSQL server to test with)")
async def test_a_quiet_stream_on_a_standby_keeps_its_node_healthy_on_the_leader(tmp_path: Path) -> None:
    from ntp_manager.rpc.server import RpcServer
    from ntp_manager.service.manager import Manager
    from ntp_manager.settings import Settings

    opts = {"heartbeat_interval_s": 0.25, "heartbeat_max_quiet_s": 30, "suspect_after_s": 1.5, "fail_after_s": 3.0,
            "takeover_grace_s": 0.0}
    async with database("postgres", tmp_path) as url, running_service(url, tmp_path / "a", **opts) as lead:
        await lead.manager.wait_leading()
        tokens = {n: await lead.agent_token(n) for n in ("n0", "n1")}
        standby = Manager(Settings(data_dir=tmp_path / "b", database_url=url, http_port=0, grpc_port=0, **opts))
        await standby.start()
        rpc = RpcServer(standby)
        port = await rpc.start("127.0.0.1", 0)
        try:
            await eventually(lambda: standby.fleet.ready, 15)
            assert not standby.acting
            agents = {}
            for n in ("n0", "n1"):
                agents[n] = ScriptedAgent(f"127.0.0.1:{port}", tokens[n], n, f"d-{n}", gpu_uuids(n, 2))
                await agents[n].connect()
                await agents[n].wait_for(lambda a=agents[n]: a.welcome is not None or a.error is not None)
                assert agents[n].error is None
            await eventually(lambda: {"n0", "n1"} <= lead.manager.world.nodes.keys(), 15)
            await agents["n1"].close()  # the control: its node goes silent on the leader
            await eventually(lambda: _health(lead, "n1") == {"failed"}, 20)
            assert _health(lead, "n0") == {"healthy"} and agents["n0"].error is None
            await agents["n0"].close()
        finally:
            await standby.begin_shutdown()
            await rpc.stop(0.5)
            await standby.stop()
