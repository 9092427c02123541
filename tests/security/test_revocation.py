"""Revocation and creation are live, whichever way they are made: `ntp-manager token` on the server's
host (writing the database under a running manager) or REST. A revoked token's open streams end:
the agent stream, a layout watch and the dashboard's event stream.

Timeouts here are generous (machines are loaded in CI); the manager's bound is `token_poll_s`
(0.25 s) plus one query, and bench/RESULTS.md has the measured figure.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import grpc
import httpx

from ntp_manager.contract.proto.ntp.v1 import worker_pb2, worker_pb2_grpc
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.integration.conftest import Service, eventually

JOB = {"name": "llm", "tp": 2, "replicas": 1, "local_batch": 2, "heads": 4}


async def cli(url: str, data: Path, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ntp_manager.cli", "token", *args, "--database-url", url, "--data-dir", str(data),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def _status(svc: Service, token: str) -> int:
    async with httpx.AsyncClient(base_url=svc.http, headers={"Authorization": f"Bearer {token}"}) as c:
        return (await c.get("/v1/status")).status_code


async def test_cli_and_rest_changes_are_live_and_revoking_ends_the_open_streams(
    service: Service, db_url: str, tmp_path: Path
) -> None:
    svc = service
    # created by the CLI under the running manager: usable without a restart
    made = json.loads(await cli(db_url, tmp_path, "create", "--scope", "viewer", "--name", "ops-bot", "--json"))
    cli_token = made["token"]

    async def accepted() -> bool:
        return await _status(svc, cli_token) == 200

    await eventually(accepted, timeout=5)
    agent_token = await svc.agent_token("node-0")
    worker_token = await svc.manager.create_token("w", "worker")
    viewer_token = await svc.manager.create_token("v", "viewer")
    a = ScriptedAgent(svc.grpc, agent_token, "node-0", "nvl-0", gpu_uuids("node-0", 2))
    await a.connect()
    await a.wait_for(lambda: a.welcome is not None)
    # on PostgreSQL the welcome means the hello is durable, not yet applied by the leader: a job
    # submitted before it is refused (409, no GPUs in nvl-0; seen once in a clean-clone run)
    await eventually(lambda: "node-0" in svc.manager.world.nodes, timeout=10)
    async with svc.client() as c:
        assert (await c.post("/v1/jobs", json=JOB)).status_code == 201
    await eventually(lambda: svc.manager.world.jobs["llm"].layout is not None)

    # a worker watching its layout
    channel = grpc.aio.insecure_channel(svc.grpc)
    watch = worker_pb2_grpc.WorkerServiceStub(channel).WatchLayout(
        worker_pb2.WatchLayoutRequest(job="llm", worker_id="w0"),
        metadata=(("authorization", f"Bearer {worker_token}"),))
    assert (await watch.read()).stamp.version == 1

    # the dashboard's event stream, opened with a ticket
    async with httpx.AsyncClient(base_url=svc.http, timeout=20) as c:
        ticket = (await c.post("/v1/stream/tickets", headers={"Authorization": f"Bearer {viewer_token}"})).json()
        async with c.stream("GET", "/v1/stream", params={"ticket": ticket["ticket"]}) as sse:
            lines = sse.aiter_lines()
            while (await anext(lines)) != "event: snapshot":
                pass
            # the CLI revokes the agent's, the worker's and its own viewer token, REST the stream's
            await cli(db_url, tmp_path, "revoke", *(t.split("_")[1] for t in (agent_token, worker_token, cli_token)))
            async with svc.client("admin") as admin:
                assert (await admin.delete(f"/v1/tokens/{viewer_token.split('_')[1]}")).status_code == 200
            events = [line async for line in lines if line.startswith("event: ")]
            assert events[-1] == "event: revoked"  # and the stream ended: the loop above finished

    await a.wait_for(lambda: a.error is not None, timeout=10)
    assert a.error is not None
    # the stream ended with UNAUTHENTICATED; grpcio's asyncio client replaces that status by INTERNAL
    # ('Failed "execute_batch"') when one of its own writes loses the race with it (seen once in a
    # clean-clone run; tests/security/test_auth_matrix.py `_call`): then the ending is all it shows
    if not (a.error.code() == grpc.StatusCode.INTERNAL and "execute_batch" in (a.error.debug_error_string() or "")):
        assert a.error.code() == grpc.StatusCode.UNAUTHENTICATED
    try:
        await asyncio.wait_for(watch.read(), 10)
        raise AssertionError("the watch stream outlived its token")
    except grpc.aio.AioRpcError as e:
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in e.details()
    await channel.close()
    # and nothing new opens with them
    again = ScriptedAgent(svc.grpc, agent_token, "node-0", "nvl-0", gpu_uuids("node-0", 2))
    await again.connect()
    await again.wait_for(lambda: again.error is not None)
    assert again.error is not None and again.error.code() == grpc.StatusCode.UNAUTHENTICATED
    await again.close()
    await a.close()

    async def refused() -> bool:
        return await _status(svc, cli_token) == 401

    await eventually(refused, timeout=5)


async def test_a_ticket_opens_one_stream_once(sqlite_service: Service) -> None:
    svc = sqlite_service
    async with svc.client("viewer") as c:
        ticket = (await c.post("/v1/stream/tickets")).json()["ticket"]
    async with httpx.AsyncClient(base_url=svc.http, timeout=20) as c:
        async with c.stream("GET", "/v1/stream", params={"ticket": ticket}) as r:
            assert r.status_code == 200
        r2 = await c.get("/v1/stream", params={"ticket": ticket})
        assert r2.status_code == 401 and "ticket" in r2.json()["detail"]
        r3 = await c.get("/v1/stream", params={"token": svc.tokens["viewer"]})
        assert r3.status_code == 401  # a token in the URL is not accepted any more


async def test_the_polls_own_statement_reads_what_a_session_reads(service: Service) -> None:
    """On PostgreSQL the token poll reads its marker through the driver on a connection of its own
    (tokens.py `MARKER_SQL`): the same count, revoked count and newest id as the session's query,
    before and after a token is made and one revoked (on SQLite both are the session's)."""
    tokens = service.manager.token_service

    async def both() -> tuple[tuple[object, ...], tuple[object, ...]]:
        async with tokens.sm() as s:
            want = await tokens._read_marker(s)
        return await tokens._poll_marker(), want

    got, want = await both()
    assert got == want
    await service.manager.create_token("marker-a", "viewer")
    await service.manager.create_token("marker-b", "viewer")
    victim = next(t["id"] for t in await tokens.list() if t["name"] == "marker-a")
    await tokens.revoke(victim, "test")
    got2, want2 = await both()
    assert got2 == want2 and got2 != got and got2[1] == int(got[1]) + 1, (got, got2)
    assert await tokens.poll_once() is False  # the revoke reloaded already: nothing new since
