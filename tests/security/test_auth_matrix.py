"""The auth matrix: every REST route the app serves and every gRPC method of our services, for every
kind of caller (no token, a made-up token, a revoked one, and each scope).

The routes and methods are enumerated from the app and the proto descriptors, and each must have a
row in the expectation tables below: a route added without deciding who may call it fails here.
"""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import message_factory
from starlette.routing import Route

from ntp_manager.api.app import create_app
from ntp_manager.contract.proto.ntp.v1 import agent_pb2, common_pb2, worker_pb2
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.integration.conftest import Service, eventually

CALLERS = [None, "bogus", "revoked", "viewer", "operator", "admin", "agent", "worker"]
# who may do what (auth.PERMISSIONS, restated here on purpose: the test is the second opinion)
MAY = {
    "open": set(CALLERS),
    "read": {"viewer", "operator", "admin"},
    "write": {"operator", "admin"},
    "admin": {"admin"},
}
JOB = {"name": "llm", "tp": 2, "replicas": 1, "local_batch": 2, "heads": 4}
FUTURE = {"starts_at": "2099-01-01T00:00:00+05:30", "ends_at": "2099-01-02T00:00:00Z"}

# (method, path template) -> (permission, concrete path, body)
REST: dict[tuple[str, str], tuple[str, str, Any]] = {
    ("GET", "/healthz"): ("open", "/healthz", None),
    ("GET", "/readyz"): ("open", "/readyz", None),
    ("GET", "/metrics"): ("open", "/metrics", None),
    ("GET", "/"): ("open", "/", None),
    ("GET", "/openapi.json"): ("open", "/openapi.json", None),
    ("GET", "/docs"): ("open", "/docs", None),
    ("GET", "/docs/oauth2-redirect"): ("open", "/docs/oauth2-redirect", None),
    ("GET", "/redoc"): ("open", "/redoc", None),
    ("GET", "/v1/status"): ("read", "/v1/status", None),
    ("GET", "/v1/domains"): ("read", "/v1/domains", None),
    ("GET", "/v1/cluster/allocation"): ("read", "/v1/cluster/allocation", None),
    ("GET", "/v1/nodes"): ("read", "/v1/nodes", None),
    ("GET", "/v1/nodes/{name}"): ("read", "/v1/nodes/node-0", None),
    ("GET", "/v1/gpus"): ("read", "/v1/gpus", None),
    ("GET", "/v1/gpus/{uuid}"): ("read", "/v1/gpus/GPU-node-0-0", None),
    ("GET", "/v1/jobs"): ("read", "/v1/jobs", None),
    ("GET", "/v1/jobs/{name}"): ("read", "/v1/jobs/llm", None),
    ("GET", "/v1/jobs/{name}/layout"): ("read", "/v1/jobs/llm/layout", None),
    ("GET", "/v1/jobs/{name}/layouts"): ("read", "/v1/jobs/llm/layouts", None),
    ("GET", "/v1/jobs/{name}/layouts/{version}"): ("read", "/v1/jobs/llm/layouts/1", None),
    ("GET", "/v1/jobs/{name}/steps"): ("read", "/v1/jobs/llm/steps", None),
    ("GET", "/v1/jobs/{name}/checkpoints"): ("read", "/v1/jobs/llm/checkpoints", None),
    ("GET", "/v1/jobs/{name}/slow"): ("read", "/v1/jobs/llm/slow", None),
    ("GET", "/v1/failslow/options"): ("read", "/v1/failslow/options", None),
    ("PATCH", "/v1/jobs/{name}/slow/options"): ("write", "/v1/jobs/llm/slow/options", {"options": {}}),
    ("PATCH", "/v1/failslow/options"): ("write", "/v1/failslow/options", {"options": {}}),
    ("GET", "/v1/events"): ("read", "/v1/events", None),
    ("GET", "/v1/audit"): ("read", "/v1/audit", None),
    ("GET", "/v1/audit/{audit_id}"): ("read", "/v1/audit/1", None),
    ("GET", "/v1/maintenance"): ("read", "/v1/maintenance", None),
    ("GET", "/v1/breaker"): ("read", "/v1/breaker", None),
    ("GET", "/v1/slurm"): ("read", "/v1/slurm", None),
    ("GET", "/v1/snapshot"): ("read", "/v1/snapshot", None),
    ("GET", "/v1/stream"): ("read", "/v1/stream", None),
    ("POST", "/v1/stream/tickets"): ("read", "/v1/stream/tickets", None),
    ("POST", "/v1/jobs"): ("write", "/v1/jobs", dict(JOB, name="other")),
    ("DELETE", "/v1/jobs/{name}"): ("write", "/v1/jobs/none", None),
    ("PATCH", "/v1/jobs/{name}"): ("write", "/v1/jobs/llm", {"priority": 1}),
    ("POST", "/v1/plans"): ("write", "/v1/plans", {"job": "llm"}),
    ("POST", "/v1/gpus/{uuid}/cordon"): ("write", "/v1/gpus/GPU-node-0-0/cordon", {"reason": "r"}),
    ("POST", "/v1/gpus/{uuid}/uncordon"): ("write", "/v1/gpus/GPU-node-0-0/uncordon", {"reason": "r"}),
    ("POST", "/v1/gpus/{uuid}/mark-healthy"): ("write", "/v1/gpus/GPU-node-0-0/mark-healthy", {"reason": "r"}),
    ("POST", "/v1/nodes/{name}/drain"): ("write", "/v1/nodes/none/drain",
                                         {"deadline": "2099-01-01T00:00:00Z", "reason": "r"}),
    ("POST", "/v1/nodes/{name}/undrain"): ("write", "/v1/nodes/none/undrain", {"reason": "r"}),
    ("POST", "/v1/maintenance"): ("write", "/v1/maintenance", {"target_kind": "gpu", "target": "GPU-x", **FUTURE}),
    ("DELETE", "/v1/maintenance/{window_id}"): ("write", "/v1/maintenance/999", None),
    ("POST", "/v1/breaker/reset"): ("write", "/v1/breaker/reset", {"reason": "r"}),
    ("GET", "/v1/tokens"): ("admin", "/v1/tokens", None),
    ("POST", "/v1/tokens"): ("admin", "/v1/tokens", {"name": "made-by-test", "scope": "viewer"}),
    ("DELETE", "/v1/tokens/{token_id}"): ("admin", "/v1/tokens/00000000", None),
}
GRPC = {"ntp.v1.AgentService": "agent", "ntp.v1.WorkerService": "worker"}


async def _callers(svc: Service) -> dict[str | None, str | None]:
    revoked = await svc.manager.create_token("to-revoke", "viewer")
    await svc.manager.revoke_token(revoked.split("_")[1])
    return {None: None, "bogus": "ntp_00000000_not-a-real-token", "revoked": revoked,
            **{s: svc.tokens[s] for s in ("viewer", "operator", "admin", "agent", "worker")}}


def _routes(routes: list[Any]) -> list[Any]:
    """Every route, the ones of included routers too (FastAPI keeps those behind their router)."""
    out = []
    for r in routes:
        inner = getattr(r, "original_router", None)
        out.extend(_routes(inner.routes) if inner is not None else [r])
    return out


def _served_routes(svc: Service) -> set[tuple[str, str]]:
    out = set()
    for r in _routes(create_app(svc.manager).routes):
        if isinstance(r, Route):
            for m in r.methods or ():
                if m != "HEAD":
                    out.add((m, r.path))
    return out


async def test_every_rest_route_for_every_caller(sqlite_service: Service) -> None:
    svc = sqlite_service
    served = _served_routes(svc)
    assert served == set(REST), f"routes without an auth expectation: {served ^ set(REST)}"
    a = ScriptedAgent(svc.grpc, svc.tokens["agent"], "node-0", "nvl-0", gpu_uuids("node-0", 2))
    await a.connect()
    await a.wait_for(lambda: a.welcome is not None)
    async with svc.client() as c:
        assert (await c.post("/v1/jobs", json=JOB)).status_code == 201
    callers = await _callers(svc)
    async with httpx.AsyncClient(base_url=svc.http, timeout=20) as c:
        for who, token in callers.items():
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            for (method, template), (perm, path, body) in sorted(REST.items()):
                if template == "/v1/stream":
                    async with c.stream(method, path, headers=headers) as r:
                        status = r.status_code
                else:
                    r = await c.request(method, path, json=body, headers=headers)
                    status = r.status_code
                where = (who, method, template, status)
                if who in MAY[perm]:
                    assert status not in (401, 403) and status < 500, where
                elif who in (None, "bogus", "revoked"):
                    assert status == 401, where
                    assert r.headers.get("www-authenticate") == "Bearer", where
                else:
                    assert status == 403, where
                if status >= 400 and template != "/v1/stream":
                    assert isinstance(r.json()["detail"], str), where
    await a.close()


def _methods() -> list[tuple[str, str, Any, bool, bool]]:
    out = []
    for pb in (agent_pb2, worker_pb2):
        for svc in pb.DESCRIPTOR.services_by_name.values():
            for m in svc.methods:
                out.append((svc.full_name, m.name, message_factory.GetMessageClass(m.input_type),
                            m.client_streaming, m.server_streaming))
    return out


async def _call(ch: grpc.aio.Channel, service: str, name: str, req_cls: Any, cs: bool, ss: bool,
                md: tuple[tuple[str, str], ...], request: Any) -> grpc.StatusCode:
    """The status the manager answers the call with. A request stream's write that loses the race
    with the server's refusal (sent before it reads anything) makes grpcio's asyncio client replace
    the server's status by INTERNAL ('Failed "execute_batch"', a client-side defect of grpcio): that
    answer says nothing about the manager, so the call is made again (a refusal is then seen first
    as a rule; a status that is not this client race is returned at once)."""
    for _ in range(10):
        code = await _call_once(ch, service, name, cs, ss, md, request)
        if code is not None:
            return code
    raise AssertionError(f"{service}/{name}: grpcio's client lost every one of 10 races with the status")


async def _call_once(ch: grpc.aio.Channel, service: str, name: str, cs: bool, ss: bool,
                     md: tuple[tuple[str, str], ...], request: Any) -> grpc.StatusCode | None:
    path = f"/{service}/{name}"
    try:
        if cs and ss:
            call = ch.stream_stream(path, request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=bytes)

            async def msgs():  # type: ignore[no-untyped-def]
                yield request

            stream = call(msgs(), metadata=md, timeout=5)
            async for _ in stream:
                stream.cancel()  # reached the service: the first answer is enough
                return grpc.StatusCode.OK
        elif ss:
            stream = ch.unary_stream(path, request_serializer=lambda m: m.SerializeToString(),
                                     response_deserializer=bytes)(request, metadata=md, timeout=5)
            async for _ in stream:
                stream.cancel()
                return grpc.StatusCode.OK
        else:
            await ch.unary_unary(path, request_serializer=lambda m: m.SerializeToString(),
                                 response_deserializer=bytes)(request, metadata=md, timeout=5)
        return grpc.StatusCode.OK
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.INTERNAL and ("execute_batch" in (e.debug_error_string() or "")
                                                    or "Internal error from Core" in (e.details() or "")):
            return None  # the client race above, not the manager's answer
        return e.code()


async def test_every_grpc_method_for_every_caller(sqlite_service: Service) -> None:
    svc = sqlite_service
    methods = _methods()
    assert {s for s, *_ in methods} == set(GRPC)
    assert len(methods) == 4  # Connect, WatchLayout, AckLayout, ReportSteps: a new one needs a row below
    a = ScriptedAgent(svc.grpc, await svc.agent_token("node-1"), "node-1", "nvl-1", gpu_uuids("node-1", 2))
    await a.connect()
    await a.wait_for(lambda: a.welcome is not None)
    async with svc.client() as c:
        assert (await c.post("/v1/jobs", json=JOB)).status_code == 201
    await eventually(lambda: svc.manager.world.jobs["llm"].layout is not None)
    epoch = svc.manager.world.jobs["llm"].layout.leader_epoch
    hello = ScriptedAgent("", "", "node-0", "nvl-0", gpu_uuids("node-0", 2)).hello()
    requests = {
        "Connect": hello,
        "WatchLayout": worker_pb2.WatchLayoutRequest(job="llm", worker_id="w"),
        "AckLayout": worker_pb2.AckLayoutRequest(job="llm", worker_id="w",
                                                 stamp=common_pb2.LayoutStamp(leader_epoch=epoch, version=1)),
        "ReportSteps": worker_pb2.StepReport(job="llm", worker_id="w"),
    }
    callers = await _callers(svc)
    async with grpc.aio.insecure_channel(svc.grpc) as ch:
        for who, token in callers.items():
            md = (("authorization", f"Bearer {token}"),) if token else ()
            for service, name, cls, cs, ss in methods:
                code = await _call(ch, service, name, cls, cs, ss, md, requests[name])
                where = (who, service, name, code)
                if who == GRPC[service]:
                    assert code == grpc.StatusCode.OK, where
                elif who in (None, "bogus", "revoked"):
                    assert code == grpc.StatusCode.UNAUTHENTICATED, where
                else:
                    assert code == grpc.StatusCode.PERMISSION_DENIED, where
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        # health is open to everyone
        h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert h.status == health_pb2.HealthCheckResponse.SERVING
    await a.close()


@pytest.mark.parametrize("scope", ["viewer", "operator", "worker", "admin"])
async def test_only_agent_tokens_name_a_node(sqlite_service: Service, scope: str) -> None:
    svc = sqlite_service
    async with svc.client("admin") as c:
        r = await c.post("/v1/tokens", json={"name": "x", "scope": scope, "node": "node-0"})
        assert r.status_code == 422 and "node" in r.json()["detail"]
        r = await c.post("/v1/tokens", json={"name": "x", "scope": "agent"})
        assert r.status_code == 422 and "node" in r.json()["detail"]
