"""Operator REST API (FastAPI) under /v1, plus /healthz, /readyz and /metrics.

Routes live in one APIRouter per area (api/routes/) and read through the service's queries
(service/operations/queries.py); none touches the store. Every mutation accepts `Idempotency-Key`: a replay
with the same key and the same request returns the first response; the same key with a different
request is a 409. The mutation, its audit record and the idempotency record commit in one
transaction (service/core/idempotency.py).

The edge (api/edge.py, api/guard.py): a body is read only after its bearer token checks out and
only up to `max_request_bytes` (401 / 413); bad input is a 4xx naming the field. The OpenAPI
document declares every error status and its body (`Error`), and schemathesis checks responses
against it.
"""

import uuid as uuidlib
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Literal

import structlog
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ntp_manager import __version__
from ntp_manager.api.edge import Error
from ntp_manager.api.guard import AuthFirst
from ntp_manager.api.routes import audit, cluster, dashboard, jobs, operations, tokens
from ntp_manager.api.standby import LEADER_HEADER, StandbyEdge, leader_doc
from ntp_manager.service.core.errors import ServiceError, database_unreachable
from ntp_manager.service.leadership.leader import NotLeader
from ntp_manager.service.manager import Manager

log = structlog.get_logger("ntp.api")


def create_app(manager: Manager) -> FastAPI:
    app = FastAPI(
        title="ntp-manager",
        version=__version__,
        description="Operator API of ntp-manager. Authenticate with `Authorization: Bearer <token>`.",
        responses={400: {"model": Error}, 413: {"model": Error}, 422: {"model": Error}},
    )
    app.add_middleware(AuthFirst, verify=manager.tokens.verify, max_bytes=manager.settings.max_request_bytes)
    # added last, so it runs first: a manager that does not lead sends clients to the one that does
    app.add_middleware(StandbyEdge, acting=lambda: manager.acting, leader=lambda: manager.leadership.leader)

    # ---- errors: always 4xx with a message for bad input ------------------------------------------
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
        if isinstance(exc, NotLeader):  # lost the lease while the request ran: name the new leader
            headers = {LEADER_HEADER: f"http://{exc.leader.http}"} if exc.leader and exc.leader.http else None
            return JSONResponse({"detail": exc.message, "leader": leader_doc(exc.leader)}, exc.http_status, headers)
        return JSONResponse({"detail": exc.message}, status_code=exc.http_status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"detail": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(x) for x in first.get("loc", ()))
        return JSONResponse(
            {"detail": f"{where}: {first.get('msg')}", "errors": [_plain(e) for e in errs[:20]]}, status_code=422
        )

    @app.middleware("http")
    async def _request_id(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        rid = request.headers.get("x-request-id") or uuidlib.uuid4().hex
        request.state.request_id = rid[:64]
        try:
            response = await call_next(request)
        except Exception as exc:
            # never the exception's text (SQL, paths, values) to a client; the log has it all
            unreachable = database_unreachable(exc)
            if unreachable is not None:
                log.warning("request failed: the database is out of reach", path=request.url.path[:200],
                            request_id=request.state.request_id, error=type(exc).__name__)
                response = JSONResponse({"detail": unreachable.message}, unreachable.http_status,
                                        headers={"Retry-After": "1"})
            else:
                log.error("request failed", path=request.url.path[:200], request_id=request.state.request_id,
                          error=type(exc).__name__, exc_info=exc)
                response = JSONResponse({"detail": "internal error; the manager's log has the details"}, 500)
        response.headers["x-request-id"] = request.state.request_id
        return response

    # ---- probes and metrics ---------------------------------------------------------------------
    @app.get("/healthz", tags=["probes"], responses={503: {"model": Error}})
    async def healthz() -> JSONResponse:
        """The process is alive and doing its part: leading, or standing by. A manager that lost
        its lease is not (it is exiting)."""
        role = manager.role
        body = {"ok": role != "lost", "role": role, "epoch": manager.epoch,
                "leader": leader_doc(manager.leadership.leader)}
        return JSONResponse(body, 200 if role != "lost" else 503)

    @app.get("/readyz", tags=["probes"], responses={503: {"model": Error}})
    async def readyz(part: Literal["clients", "leader"] = "clients") -> JSONResponse:
        """Ready for `part`: `clients` (the default), this manager takes agent streams and layout
        watches now and is in touch with the store (on PostgreSQL every manager, standbys
        included; point the agents' and workers' load balancer here); `leader`, it leads with its
        world loaded (planning, operators' writes: point the REST load balancer here)."""
        clients, leads = manager.serving()
        role = manager.role
        serves = [name for name, on in (("clients", clients), ("leader", leads)) if on]
        body: dict[str, Any] = {"ready": clients if part == "clients" else leads, "role": role,
                                "epoch": manager.epoch, "serves": serves,
                                "leader": leader_doc(manager.leadership.leader)}
        world = manager.world_view()  # how current this manager's copy of the world is, where it follows one
        if world is not None:
            body["world"] = world
        if body["ready"]:
            return JSONResponse(body)
        body["detail"] = {"standby": "a standby: another manager leads", "lost": "lost its lease; exiting",
                          "leader": "starting or shutting down"}[role]
        if part == "clients" and role == "standby" and not manager.leadership.in_touch():
            body["detail"] = "a standby out of touch with the store"
        elif part == "clients" and role == "standby" and body.get("world", {}).get("behind"):
            body["detail"] = "a standby whose world is behind the leader's log (fleet_follow_max_lag_rows)"
        return JSONResponse(body, 503)

    @app.get("/metrics", tags=["probes"], response_class=PlainTextResponse)
    async def metrics() -> Response:
        await manager.refresh_gauges_async()
        return Response(generate_latest(manager.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    for area in (cluster, jobs, audit, operations, tokens, dashboard):
        app.include_router(area.router(manager))

    plain_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        """The generated document, plus 401/403 on every route that needs a token (all of /v1)."""
        if app.openapi_schema is None:
            doc = plain_openapi()
            ref = {"description": "missing, unknown or insufficient token",
                   "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for path, ops in doc["paths"].items():
                if path.startswith("/v1/"):
                    for op in ops.values():
                        op["responses"].setdefault("401", ref)
                        op["responses"].setdefault("403", ref)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    _build_routes_now(app.router.routes)
    return app


def _build_routes_now(routes: Iterable[Any]) -> None:
    """FastAPI (0.16x) builds an included router's request handlers (each endpoint's dependencies,
    parameters and response fields) when the first request reaches that router: 50-100 ms of the
    event loop, seen as the first dashboard snapshot's stall at any cluster size (issue 17). Build
    them while nothing is served (server.py makes the app before taking the lease). Uses FastAPI's
    `_IncludedRouter.effective_candidates` where it exists; does nothing on versions without it."""
    for route in routes:
        build = getattr(route, "effective_candidates", None)
        low = getattr(route, "effective_low_priority_routes", None)
        if callable(build):
            _build_routes_now(build())
        if callable(low):
            low()


def _plain(e: dict[str, Any]) -> dict[str, Any]:
    return {"loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
