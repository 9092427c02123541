"""Mutual TLS for agents, with certificates made here (the `cryptography` package): a CA, the
manager's server certificate, two node certificates, and a certificate from a CA nobody trusts.

With a client CA configured, agents must come through the TLS listener with a certificate the CA
signed; an agent token bound to one certificate's fingerprint is refused with any other. Workers
may still use the plaintext listener (their mTLS: test_worker_mtls.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from sqlalchemy import select

from ntp_agent.backends.fake import FakeBackend, parse_scenario
from ntp_agent.core import Agent, AgentConfig
from ntp_manager.contract.proto.ntp.v1 import worker_pb2, worker_pb2_grpc
from ntp_manager.store.models import AuditRow
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.fakes.pki import Pki, make_pki
from tests.integration.conftest import Service, eventually, running_service


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def mtls_service(pki: Pki, tmp_path: Path):  # type: ignore[no-untyped-def]
    async with running_service(f"sqlite+aiosqlite:///{tmp_path / 'ntp.db'}", tmp_path, grpc_tls_port=0,
                               grpc_tls_cert=pki.server_cert, grpc_tls_key=pki.server_key,
                               grpc_tls_client_ca=pki.ca) as svc:
        yield svc


async def _error_of(a: ScriptedAgent) -> grpc.aio.AioRpcError:
    await a.connect()
    await a.wait_for(lambda: a.error is not None, timeout=15)
    await a.close()
    assert a.error is not None
    return a.error


async def test_mtls_agent_with_its_own_certificate_registers(mtls_service: Service, pki: Pki) -> None:
    svc = mtls_service
    assert svc.grpc_tls is not None
    token = await svc.manager.create_token("node-a", "agent", node="node-a", fingerprint=pki.fingerprint("node-a"))
    cert, key = pki.clients["node-a"]
    cfg = AgentConfig(manager=svc.grpc_tls, token=token, node="node-a", domain="nvl-0", tls_ca=pki.ca,
                      tls_cert=cert, tls_key=key, backoff_initial_s=0.05, backoff_max_s=0.5)
    agent = Agent(FakeBackend(parse_scenario({"seed": 1, "gpus": 2, "faults": []}), node="node-a"), cfg)
    task = asyncio.create_task(agent.run())
    try:
        await eventually(lambda: agent.registered.is_set(), timeout=15)
        assert svc.manager.world.nodes["node-a"].connected
    finally:
        agent.stopping.set()
        await asyncio.wait_for(task, 10)

    # workers may still use the plaintext listener
    async with svc.client() as c:
        assert (await c.post("/v1/jobs", json={"name": "j", "tp": 2, "replicas": 1, "local_batch": 1,
                                               "heads": 2})).status_code == 201
    await eventually(lambda: svc.manager.world.jobs["j"].layout is not None)
    async with grpc.aio.insecure_channel(svc.grpc) as ch:
        call = worker_pb2_grpc.WorkerServiceStub(ch).WatchLayout(
            worker_pb2.WatchLayoutRequest(job="j"), metadata=(("authorization", f"Bearer {svc.tokens['worker']}"),))
        assert (await call.read()).stamp.version == 1
        call.cancel()


async def test_a_token_bound_to_one_certificate_is_refused_with_another(mtls_service: Service, pki: Pki) -> None:
    svc = mtls_service
    token = await svc.manager.create_token("node-a", "agent", node="node-a", fingerprint=pki.fingerprint("node-a"))
    assert svc.grpc_tls is not None
    # node-b's certificate (the CA signed it) with node-a's token: the token names node-a's certificate
    err = await _error_of(ScriptedAgent(svc.grpc_tls, token, "node-a", "nvl-0", gpu_uuids("node-a", 2),
                                        credentials=pki.creds("node-b")))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "certificate" in err.details()
    async with svc.manager.sm() as s:
        rows = (await s.scalars(select(AuditRow).where(AuditRow.action == "agent.denied"))).all()
    assert rows and rows[-1].after["peer_fingerprint"] == pki.fingerprint("node-b")
    assert "node-a" not in svc.manager.world.nodes


@pytest.mark.parametrize("client", [None, "rogue"])
async def test_no_certificate_or_one_from_an_unknown_ca_gets_no_connection(mtls_service: Service, pki: Pki,
                                                                           client: str | None) -> None:
    svc = mtls_service
    assert svc.grpc_tls is not None
    token = await svc.manager.create_token("node-a", "agent", node="node-a")
    err = await _error_of(ScriptedAgent(svc.grpc_tls, token, "node-a", "nvl-0", gpu_uuids("node-a", 2),
                                        credentials=pki.creds(client)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails: no RPC ever runs
    assert "node-a" not in svc.manager.world.nodes


async def test_with_a_client_ca_agents_may_not_use_the_plaintext_listener(mtls_service: Service) -> None:
    svc = mtls_service
    token = await svc.manager.create_token("node-a", "agent", node="node-a")
    err = await _error_of(ScriptedAgent(svc.grpc, token, "node-a", "nvl-0", gpu_uuids("node-a", 2)))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "mTLS" in err.details()


def test_tls_settings_are_checked_at_start(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from ntp_manager.settings import Settings

    with pytest.raises(ValidationError, match="go together"):
        Settings(data_dir=tmp_path, grpc_tls_cert=tmp_path / "c.pem")
    with pytest.raises(ValidationError, match="mTLS runs over TLS"):
        Settings(data_dir=tmp_path, grpc_tls_client_ca=tmp_path / "ca.pem")
