"""Real servers on loopback port 0, on SQLite always and on PostgreSQL when NTP_TEST_POSTGRES_URL is set."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from sqlalchemy import select

from ntp_manager.api.app import create_app
from ntp_manager.clock import Clock
from ntp_manager.rpc.server import RpcServer
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store.models import AuditRow

PG = os.environ.get("NTP_TEST_POSTGRES_URL")
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.skipif(
    not PG, reason="NTP_TEST_POSTGRES_URL is not set (no PostgreSQL server to test against)"))]


@contextlib.asynccontextmanager
async def database(kind: str, tmp_path: Path) -> AsyncIterator[str]:
    if kind == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'ntp.db'}"
        return
    import asyncpg

    assert PG is not None
    admin = PG.replace("postgresql+asyncpg://", "postgresql://")
    name = f"ntp_t_{secrets.token_hex(6)}"
    conn = await asyncpg.connect(admin)
    await conn.execute(f'CREATE DATABASE "{name}"')
    await conn.close()
    base = PG.rsplit("/", 1)[0]
    try:
        yield f"{base}/{name}"
    finally:
        conn = await asyncpg.connect(admin)
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await conn.close()


@pytest.fixture(params=BACKENDS)
async def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    async with database(request.param, tmp_path) as url:
        yield url


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def]
        yield


@dataclass
class Service:
    manager: Manager
    http: str
    grpc: str
    tokens: dict[str, str]  # one per scope; tokens["agent"] speaks for node-0 only
    agent_tokens: dict[str, str] = field(default_factory=dict)
    grpc_tls: str | None = None  # the TLS listener, when the settings carry a certificate

    def client(self, scope: str | None = "operator") -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {self.tokens[scope]}"} if scope else {}
        return httpx.AsyncClient(base_url=self.http, headers=headers, timeout=20)

    async def agent_token(self, node: str) -> str:
        """An agent token bound to `node` (made once per node)."""
        if node not in self.agent_tokens:
            self.agent_tokens[node] = await self.manager.create_token(f"agent-{node}", "agent", node=node)
        return self.agent_tokens[node]


@contextlib.asynccontextmanager
async def running_service(url: str, tmp_path: Path, clock: Clock | None = None,
                          **overrides: Any) -> AsyncIterator[Service]:
    """A manager (with `clock`, default the system's) serving REST and gRPC on loopback."""
    opts: dict[str, Any] = {
        "data_dir": tmp_path, "database_url": url, "http_port": 0, "grpc_port": 0,
        "heartbeat_interval_s": 0.2, "suspect_after_s": 60.0, "fail_after_s": 120.0,
    }
    opts.update(overrides)
    settings = Settings(**opts)
    manager = Manager(settings, clock)
    await manager.start()
    rpc = RpcServer(manager)
    gport = await rpc.start("127.0.0.1", int(opts.get("grpc_port", 0)))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    hport = sock.getsockname()[1]
    server = _Server(uvicorn.Config(create_app(manager), log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    tokens = {s: await manager.create_token(f"test-{s}", s) for s in ("viewer", "operator", "admin", "worker")}
    tokens["agent"] = await manager.create_token("agent-node-0", "agent", node="node-0")
    try:
        yield Service(manager, f"http://127.0.0.1:{hport}", f"127.0.0.1:{gport}", tokens, {"node-0": tokens["agent"]},
                      f"127.0.0.1:{rpc.tls_port}" if rpc.tls_port is not None else None)
    finally:
        await manager.begin_shutdown()
        await rpc.stop(0.5)
        server.should_exit = True
        await task
        await manager.stop()


@pytest.fixture
async def service(db_url: str, tmp_path: Path) -> AsyncIterator[Service]:
    async with running_service(db_url, tmp_path) as svc:
        yield svc


@pytest.fixture
async def sqlite_service(tmp_path: Path) -> AsyncIterator[Service]:
    async with running_service(f"sqlite+aiosqlite:///{tmp_path / 'ntp.db'}", tmp_path) as svc:
        yield svc


async def eventually(pred: Any, timeout: float = 10.0, interval: float = 0.02) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        res = pred()
        if asyncio.iscoroutine(res):
            res = await res
        if res:
            return
        if loop.time() > end:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(interval)


async def submit_job(svc: Service, job: dict[str, Any]) -> None:
    """Submits `job` as the operator (201 expected) and waits until its first layout is made."""
    async with svc.client() as c:
        assert (await c.post("/v1/jobs", json=job)).status_code == 201
    await eventually(lambda: svc.manager.world.jobs[job["name"]].layout is not None)


async def audit_rows(svc: Service, prefix: str) -> list[AuditRow]:
    """The audit records whose action starts with `prefix`, oldest first."""
    async with svc.manager.sm() as s:
        return list((await s.scalars(select(AuditRow).where(AuditRow.action.startswith(prefix))
                                     .order_by(AuditRow.id))).all())
