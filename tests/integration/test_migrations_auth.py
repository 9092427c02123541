"""Migrations up and down on both stores; the auth matrix on REST and gRPC."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from sqlalchemy import inspect

from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc, worker_pb2, worker_pb2_grpc
from ntp_manager.store import db
from ntp_manager.store.models import Base
from tests.integration.conftest import Service


async def tables(url: str) -> set[str]:
    engine = db.make_engine(url)
    try:
        async with engine.connect() as conn:
            return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))
    finally:
        await engine.dispose()


async def test_migrations_up_and_down(db_url: str, tmp_path: Path):
    engine = db.make_engine(db_url)
    try:
        await db.upgrade(engine)
        assert await db.current_revision(engine) == "0011"  # the head (0005 follows 0006: see its docstring)
        assert set(Base.metadata.tables) <= await tables(db_url)
        await db.downgrade(engine, "base")
        assert await db.current_revision(engine) is None
        assert not (set(Base.metadata.tables) & await tables(db_url))
        await db.upgrade(engine)
        assert set(Base.metadata.tables) <= await tables(db_url)
    finally:
        await engine.dispose()


GET_ROUTES = [
    "/v1/status", "/v1/domains", "/v1/nodes", "/v1/gpus", "/v1/gpus/GPU-x", "/v1/jobs", "/v1/jobs/x",
    "/v1/jobs/x/layout", "/v1/jobs/x/layouts", "/v1/events", "/v1/audit", "/v1/maintenance", "/v1/breaker",
]
MUTATIONS = [
    ("POST", "/v1/jobs", {"name": "m", "tp": 1, "replicas": 1, "local_batch": 1, "heads": 1}),
    ("DELETE", "/v1/jobs/x", None),
    ("POST", "/v1/plans", {"spec": {"name": "p", "tp": 1, "replicas": 1, "local_batch": 1, "heads": 1}}),
    ("POST", "/v1/gpus/GPU-x/cordon", {"reason": "r"}),
    ("POST", "/v1/gpus/GPU-x/uncordon", {"reason": "r"}),
    ("POST", "/v1/gpus/GPU-x/mark-healthy", {"reason": "r"}),
    ("POST", "/v1/nodes/n/drain", {"deadline": "2099-01-01T00:00:00Z", "reason": "r"}),
    ("POST", "/v1/nodes/n/undrain", {"reason": "r"}),
    ("POST", "/v1/maintenance", {"target_kind": "gpu", "target": "GPU-x", "starts_at": "2099-01-01T00:00:00Z",
                                 "ends_at": "2099-01-02T00:00:00Z"}),
    ("DELETE", "/v1/maintenance/1", None),
    ("POST", "/v1/breaker/reset", {"reason": "r"}),
]


@pytest.mark.parametrize("scope", [None, "bogus", "viewer", "operator", "agent", "worker"])
async def test_rest_auth_matrix(sqlite_service: Service, scope: str | None):
    svc = sqlite_service
    import httpx

    headers = {}
    if scope == "bogus":
        headers = {"Authorization": "Bearer ntp_00000000_not-a-real-token"}
    elif scope:
        headers = {"Authorization": f"Bearer {svc.tokens[scope]}"}
    async with httpx.AsyncClient(base_url=svc.http, headers=headers, timeout=60) as c:
        for path in GET_ROUTES:
            r = await c.get(path)
            if scope in (None, "bogus"):
                assert r.status_code == 401, (path, r.text)
                assert r.headers.get("www-authenticate") == "Bearer"
            elif scope in ("agent", "worker"):
                assert r.status_code == 403, (path, r.text)
            else:
                assert r.status_code in (200, 404, 409), (path, r.status_code, r.text)
            assert "detail" in r.json() or r.status_code == 200
        for method, path, body in MUTATIONS:
            r = await c.request(method, path, json=body)
            if scope in (None, "bogus"):
                assert r.status_code == 401, (path, r.text)
            elif scope in ("viewer", "agent", "worker"):
                assert r.status_code == 403, (path, r.text)
                assert "may not" in r.json()["detail"]
            else:
                assert r.status_code < 500 and r.status_code not in (401, 403), (path, r.status_code, r.text)
        for path in ("/healthz", "/readyz", "/metrics"):
            assert (await c.get(path)).status_code == 200


@pytest.mark.parametrize(
    ("scope", "agent_code", "worker_code"),
    [
        (None, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED),
        ("bogus", grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED),
        ("viewer", grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.PERMISSION_DENIED),
        ("operator", grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.PERMISSION_DENIED),
        ("agent", None, grpc.StatusCode.PERMISSION_DENIED),
        ("worker", grpc.StatusCode.PERMISSION_DENIED, None),
    ],
)
async def test_grpc_auth_matrix(sqlite_service: Service, scope, agent_code, worker_code):
    svc = sqlite_service
    md: tuple[tuple[str, str], ...] = ()
    if scope == "bogus":
        md = (("authorization", "Bearer ntp_00000000_nope"),)
    elif scope:
        md = (("authorization", f"Bearer {svc.tokens[scope]}"),)
    async with grpc.aio.insecure_channel(svc.grpc) as ch:
        worker = worker_pb2_grpc.WorkerServiceStub(ch)
        try:
            await worker.AckLayout(worker_pb2.AckLayoutRequest(job="none"), metadata=md, timeout=5)
            got = None
        except grpc.aio.AioRpcError as e:
            got = e.code()
        # an authorised worker reaches the service, which answers NOT_FOUND for the unknown job
        assert got == (worker_code or grpc.StatusCode.NOT_FOUND)

        agent = agent_pb2_grpc.AgentServiceStub(ch)

        async def msgs():  # type: ignore[no-untyped-def]
            yield agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat())

        try:
            async for _ in agent.Connect(msgs(), metadata=md, timeout=5):
                pass
            got = None
        except grpc.aio.AioRpcError as e:
            got = e.code()
        # an authorised agent reaches the service, which rejects a stream not opened by a hello
        assert got == (agent_code or grpc.StatusCode.INVALID_ARGUMENT)

        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
