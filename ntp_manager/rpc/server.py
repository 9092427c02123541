"""gRPC: the agent and worker services, auth, health and reflection on one grpc.aio server.

Auth: `authorization: Bearer <token>` metadata; AgentService needs an `agent` token, WorkerService
a `worker` token; health and reflection are open. Missing/unknown token -> UNAUTHENTICATED, wrong
scope -> PERMISSION_DENIED. An agent token speaks for the one node it names (and over the client
certificate it names, if any): a hello for another node is PERMISSION_DENIED and audited.
Malformed requests -> INVALID_ARGUMENT naming the field (nothing written); anything unexpected ->
INTERNAL with a fixed sentence (rpc/guard.py). A revoked token's open streams are ended with
UNAUTHENTICATED.

Every manager that serves clients takes both services (rpc/agents.py, rpc/workers.py): alone on
SQLite, the manager once it leads; on PostgreSQL, every manager, standbys included
(`Manager.serves_clients`). One that does not (starting, stopping, lost its lease) answers
UNAVAILABLE naming the leader (`ClientGate`). gRPC health says the same, per service
(`RpcServer.health_now`).

TLS (rpc/tls.py): with a certificate and key the server also listens on a TLS port; with a client
CA that port requires client certificates (mTLS) and agents must connect through it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from ntp_manager.auth import parse_bearer
from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc, worker_pb2
from ntp_manager.rpc import tls
from ntp_manager.rpc.agents import AgentService
from ntp_manager.rpc.guard import GuardInterceptor, abort
from ntp_manager.rpc.workers import WorkerService, worker_handler
from ntp_manager.service.manager import Manager

SERVICE_PERMISSION = {"ntp.v1.AgentService": "agent", "ntp.v1.WorkerService": "worker"}
AGENT_SERVICE = "ntp.v1.AgentService"
WORKER_SERVICE = "ntp.v1.WorkerService"
LEADER_SERVICE = "ntp.leader"  # health only: SERVING on the manager that leads (plans, applies, takes writes)
LEADER_KEY = "ntp-leader"  # trailing metadata: host:port of the leader's gRPC server


class ClientGate(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """A manager that serves no clients now (starting, stopping, or one that lost its lease)
    answers every AgentService / WorkerService call with UNAVAILABLE naming the leader, in the
    message and in the trailing metadata `ntp-leader` (host:port), before authentication. Clients
    try another address (agent/core.py, worker/sources.py). Health and reflection are served as
    usual."""

    def __init__(self, manager: Manager) -> None:
        self.manager = manager

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        service = details.method.lstrip("/").split("/")[0]
        handler = await continuation(details)
        if handler is None or service not in SERVICE_PERMISSION or self.manager.serves_clients:
            return handler
        err = self.manager.leadership.not_leader()
        trailer = ((LEADER_KEY, err.leader.grpc),) if err.leader is not None and err.leader.grpc else ()
        return _deny(handler, grpc.StatusCode.UNAVAILABLE, err.message, trailer)


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, manager: Manager) -> None:
        self.manager = manager

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        service = details.method.lstrip("/").split("/")[0]
        perm = SERVICE_PERMISSION.get(service)
        if handler is None or perm is None:
            return handler
        header = dict(details.invocation_metadata or ()).get("authorization")
        token = parse_bearer(header)
        principal = self.manager.tokens.verify(token) if token else None
        if principal is None:
            code, msg = grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token"
        elif not principal.can(perm):
            code, msg = grpc.StatusCode.PERMISSION_DENIED, f"a {principal.scope!r} token may not call {service}"
        else:
            return handler
        return _deny(handler, code, msg)


def _deny(handler: Any, code: grpc.StatusCode, msg: str, trailer: tuple[tuple[str, str], ...] = ()) -> Any:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if trailer:
            context.set_trailing_metadata(trailer)
        await abort(context, code, msg)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if trailer:
            context.set_trailing_metadata(trailer)
        await abort(context, code, msg)
        yield None  # pragma: no cover

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


# Calls that have arrived but that the server has not taken up yet. grpc.aio takes up one new call
# per turn of the event loop, so while the loop is busy (a fleet saying hello at once, after a
# restart or a failover) the new calls queue in gRPC core; past its default backlog (1,000, then
# refused at random up to 3,000) it ends them with CANCELLED, before any handler sees them. Agents
# and workers would retry after a back-off, but the fleet's reconnection would then take rounds of
# back-offs, and a client that does not retry is simply dropped. A waiting call costs a few KB.
PENDING_CALLS_MAX = 200_000  # about two calls (an agent's stream, a worker's watch) per GPU at 100K GPUs
PENDING_CALL_WAIT_S = 60  # one that waits longer is ended (CANCELLED) for its client to retry

def keepalive(period_s: float) -> list[tuple[str, int]]:
    """The server's options. Every connection is pinged every `period_s` (the liveness period, at
    least 1 s), and one whose peer does not answer within as long (at least 2 s) is closed: an agent's stream
    whose process stopped, or whose node died or was cut off, ends here within about two periods,
    and its node stops being counted as heard from (service/leadership/fleet.py). The pings are
    gRPC core's, answered by the peer's: no Python runs for them on either side. Each still costs
    the manager ~35 us of gRPC core's CPU per connection (bench/idle_streams.py), where an agent's
    heartbeat message every period cost ~90 us on a shared connection and ~0.5 ms on its own. A ping needs its
    own timeout too (`ping_timeout_ms`): a ping already in flight when the peer stopped would
    otherwise wait a minute, holding every keepalive ping back (seen with grpcio 1.85)."""
    every, within = max(1_000, int(period_s * 1000)), max(2_000, int(period_s * 1000))
    return [("grpc.keepalive_time_ms", every), ("grpc.keepalive_timeout_ms", within),
            ("grpc.http2.ping_timeout_ms", within), *KEEPALIVE]


KEEPALIVE = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_concurrent_streams", 10_000),
    ("grpc.server.max_pending_requests", PENDING_CALLS_MAX),
    ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS_MAX),
    ("grpc.server_max_unrequested_time_in_server", PENDING_CALL_WAIT_S),
]


HEALTH_SERVICES = ("", AGENT_SERVICE, WORKER_SERVICE, LEADER_SERVICE)
HEALTH_POLL_S = 0.2  # how often health looks at the manager's role and its contact with the store


class RpcServer:
    def __init__(self, manager: Manager) -> None:
        self.manager = manager
        interceptors = [ClientGate(manager), GuardInterceptor(), AuthInterceptor(manager)]
        self.server = grpc.aio.server(interceptors=interceptors,
                                      options=keepalive(manager.settings.heartbeat_interval_s))
        self.health = health_aio.HealthServicer()
        agents = AgentService(manager.agent_door, manager.token_service, manager.settings)
        agent_pb2_grpc.add_AgentServiceServicer_to_server(agents, self.server)  # type: ignore[no-untyped-call]
        workers = WorkerService(manager.watch_door, manager.token_service, manager.workers, manager.metrics)
        self.server.add_generic_rpc_handlers((worker_handler(workers),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [
            agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
            worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, self.server)
        self.port = 0
        self.tls_port: int | None = None
        self._role: asyncio.Task[None] | None = None
        self._said: dict[str, bool] = {}

    async def start(self, host: str, port: int, tls_port: int | None = None) -> int:
        """Listen on `port` (plaintext) and, when the settings carry a certificate, on `tls_port`
        (TLS; mTLS with a client CA). Returns the plaintext port; `self.tls_port` has the other."""
        try:  # grpcio reports a port it cannot bind as 0, or (newer) as RuntimeError
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot bind gRPC to {host}:{port}")
        creds = tls.server_credentials(self.manager.settings)
        if creds is not None:
            want = self.manager.settings.grpc_tls_port if tls_port is None else tls_port
            tls_host = self.manager.settings.grpc_tls_host or host
            try:
                self.tls_port = self.server.add_secure_port(f"{tls_host}:{want}", creds)
            except RuntimeError:
                self.tls_port = 0
            if self.tls_port == 0:
                raise OSError(f"cannot bind gRPC TLS to {tls_host}:{want}")
        await self.server.start()
        await self.refresh_health()
        self._role = asyncio.create_task(self._follow(), name="grpc-health")
        return self.port

    def health_now(self) -> dict[str, bool]:
        """SERVING or not, per health name: the agent and worker services wherever this manager
        takes them and is in touch with the store (`Manager.serving`); `ntp.leader` only on
        the leader with its world loaded; the server as a whole ("") while it serves either."""
        clients, leads = self.manager.serving()
        return {"": clients or leads, AGENT_SERVICE: clients, WORKER_SERVICE: clients, LEADER_SERVICE: leads}

    async def refresh_health(self) -> None:
        for svc, on in self.health_now().items():
            if self._said.get(svc) != on:
                self._said[svc] = on
                await self.health.set(svc, health_pb2.HealthCheckResponse.SERVING if on
                                      else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _follow(self) -> None:
        """Health follows the role and the store: a standby that takes over adds the leader's part;
        one that loses touch with the store, or its lease, stops serving."""
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            await self.refresh_health()

    async def not_serving(self) -> None:
        """Shutting down: every name NOT_SERVING from now on (server.py)."""
        if self._role is not None:
            self._role.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._role
            self._role = None
        for svc in HEALTH_SERVICES:
            self._said[svc] = False
            await self.health.set(svc, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float = 5.0) -> None:
        await self.not_serving()
        await self.server.stop(grace)
