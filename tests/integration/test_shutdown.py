"""SIGTERM: gRPC health flips to NOT_SERVING, streams end, the process exits 0, nothing is lost."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.fakes.procs import create_token, start_manager


async def test_sigterm_is_graceful(tmp_path: Path):
    data = tmp_path / "d"
    agent_token = create_token(data, "agent", node="node-0")
    proc, info = start_manager(data)
    try:
        agent = ScriptedAgent(info["grpc"], agent_token, "node-0", "nvl-0", gpu_uuids("node-0", 2))
        await agent.connect()
        await agent.wait_for(lambda: agent.welcome is not None)
        await agent.report({"GPU-node-0-1": "failed"})

        statuses: list[int] = []
        async with grpc.aio.insecure_channel(info["grpc"]) as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""))

            async def follow() -> None:
                try:
                    async for resp in call:
                        statuses.append(resp.status)
                except grpc.aio.AioRpcError:
                    pass

            follower = asyncio.create_task(follow())
            for _ in range(200):
                if statuses:
                    break
                await asyncio.sleep(0.02)
            assert statuses[:1] == [health_pb2.HealthCheckResponse.SERVING]
            proc.send_signal(signal.SIGTERM)
            rc = await asyncio.to_thread(proc.wait, 20)
            await asyncio.wait_for(follower, 10)
    finally:
        if proc.poll() is None:  # the test failed before the SIGTERM, or the manager ignored it
            proc.kill()
            proc.wait()
    assert rc == 0
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
    # the agent's stream was closed by the server, not left hanging
    await asyncio.wait_for(agent._reader, 10)  # type: ignore[arg-type]
    await agent.close()
    conn = sqlite3.connect(data / "ntp-manager.db")
    assert conn.execute("select health from gpus where uuid='GPU-node-0-1'").fetchone()[0] == "failed"
    conn.close()
