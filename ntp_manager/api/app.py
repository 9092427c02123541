"""Operator REST API (FastAPI) under /v1, plus /healthz, /readyz and /metrics.

Every mutation accepts `Idempotency-Key`: a replay with the same key and the same request returns
the first response; the same key with a different request is a 409. The mutation, its audit
record and the idempotency record commit in one transaction.

The edge: a body is read only after its bearer token checks out and only up to
`max_request_bytes` (api/guard.py: 401 / 413); every string is bounded and free of control
characters, every number finite and in range, every time zone-aware (limits.py), so bad input is
a 4xx naming the field and never reaches the store. The OpenAPI document declares every error
status and its body (`Error`), and schemathesis checks responses against it.
"""


import asyncio
import hashlib
import uuid as uuidlib
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import structlog
from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import AfterValidator, AwareDatetime, BaseModel, ConfigDict, Field, StringConstraints
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ntp_manager import __version__, limits
from ntp_manager.api.dashboard import DASHBOARD_HTML, dashboard_snapshot, snapshot_events
from ntp_manager.api.guard import AuthFirst
from ntp_manager.api.tickets import Tickets
from ntp_manager.auth import Principal, parse_bearer
from ntp_manager.service.errors import FailedPrecondition, InvalidArgument, NotFound, ServiceError
from ntp_manager.service.manager import Manager, Mut
from ntp_manager.service.queries import maintenance_view
from ntp_manager.specfile import JobFile
from ntp_manager.store.db import StoredJson, dumps_in_pieces
from ntp_manager.store.models import AuditRow, HealthEventRow, IdempotencyRow, LayoutRow, MaintenanceRow
from ntp_manager.topology import GpuState

log = structlog.get_logger("ntp.api")

Limit = Annotated[int, Query(ge=1, le=1000, description="page size")]
Offset = Annotated[int, Query(ge=0, le=10_000_000, description="items to skip")]


def _encodable(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("is not valid Unicode (a lone surrogate)") from None
    return v


def _to_utc(v: datetime) -> datetime:
    try:
        u = v.astimezone(UTC)
    except OverflowError:
        raise ValueError("is out of range once converted to UTC") from None
    if not 1970 <= u.year <= 9000:
        raise ValueError("must lie between the years 1970 and 9000")
    return u


Reason = Annotated[str, StringConstraints(min_length=1, max_length=limits.REASON_MAX, pattern=limits.TEXT_PATTERN),
                   AfterValidator(_encodable)]
OptReason = Annotated[str, StringConstraints(max_length=limits.REASON_MAX, pattern=limits.TEXT_PATTERN),
                      AfterValidator(_encodable)]
When = Annotated[AwareDatetime, AfterValidator(_to_utc)]  # any offset in, UTC kept and returned
GpuId = Annotated[str, StringConstraints(min_length=1, max_length=limits.GPU_ID_MAX, pattern=limits.IDENT_PATTERN)]


def _ident(n: int, desc: str) -> Any:
    return Query(max_length=n, pattern=limits.IDENT_PATTERN, description=desc)


class ErrorItem(BaseModel):
    loc: list[str]
    msg: str
    type: str


class Error(BaseModel):
    """Every error: `detail` says what is wrong and names the field; a 422 from request
    validation also lists up to 20 `errors`."""

    detail: str
    errors: list[ErrorItem] | None = None


class ReasonBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Reason


class DrainBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    deadline: When
    reason: Reason


class MaintenanceBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target_kind: Literal["gpu", "node", "domain"]
    target: str = Field(min_length=1, max_length=limits.NODE_MAX, pattern=limits.IDENT_PATTERN)
    starts_at: When
    ends_at: When
    reason: OptReason = ""


class TokenBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=limits.TOKEN_NAME_MAX, pattern=limits.TEXT_PATTERN)
    scope: Literal["viewer", "operator", "admin", "agent", "worker"]
    node: str | None = Field(None, min_length=1, max_length=limits.NODE_MAX, pattern=limits.NODE_PATTERN,
                             description="agent tokens: the one node the token may speak for (required)")
    fingerprint: str | None = Field(None, pattern=r"^([0-9a-fA-F]{2}:?){31}[0-9a-fA-F]{2}$",
                                    description="agent tokens: SHA-256 of the client certificate it needs (mTLS)")


class PlanBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job: str | None = Field(None, description="plan an existing job by name ...", max_length=limits.JOB_NAME_MAX,
                            pattern=limits.JOB_NAME_PATTERN)
    spec: JobFile | None = Field(None, description="... or this job spec")
    dry_run: bool = True
    fail: list[GpuId] = Field(default_factory=list, max_length=100_000, description="GPUs to treat as failed")


def page(items: list[Any], total: int, limit: int, offset: int) -> dict[str, Any]:
    return {"items": items, "total": total, "limit": limit, "offset": offset}


def _dumps(obj: Any) -> bytes:
    if isinstance(obj, StoredJson):
        return obj.text.encode()
    return dumps_in_pieces(obj).encode()


async def json_reply(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """JSON made in a worker thread: for answers that grow with the cluster (layouts, plans, the
    dashboard), whose encoding would otherwise hold the event loop. `obj` must not change meanwhile
    (plans never do; views are built for the answer)."""
    body = _dumps(obj) if isinstance(obj, StoredJson) else await asyncio.to_thread(_dumps, obj)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def create_app(manager: Manager) -> FastAPI:
    app = FastAPI(
        title="ntp-manager",
        version=__version__,
        description="Operator API of ntp-manager. Authenticate with `Authorization: Bearer <token>`.",
        responses={400: {"model": Error}, 413: {"model": Error}, 422: {"model": Error}},
    )
    app.add_middleware(AuthFirst, verify=manager.tokens.verify, max_bytes=manager.settings.max_request_bytes)
    tickets = Tickets(manager.clock.monotonic)

    # ---- errors: always 4xx with a message for bad input ------------------------------------------
    @app.exception_handler(ServiceError)
    async def _service_error(request: Request, exc: ServiceError) -> JSONResponse:
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
            log.error("request failed", path=request.url.path[:200], request_id=request.state.request_id,
                      error=type(exc).__name__, exc_info=exc)
            response = JSONResponse({"detail": "internal error; the manager's log has the details"}, 500)
        response.headers["x-request-id"] = request.state.request_id
        return response

    # ---- auth ---------------------------------------------------------------------------------
    def require(permission: str) -> Callable[..., Awaitable[Principal]]:
        async def dep(authorization: Annotated[str | None, Header()] = None) -> Principal:
            token = parse_bearer(authorization)
            if token is None:
                raise StarletteHTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
            principal = manager.tokens.verify(token)
            if principal is None:
                raise StarletteHTTPException(401, "unknown or revoked token", headers={"WWW-Authenticate": "Bearer"})
            if not principal.can(permission):
                verb = {"write": "change", "read": "read", "admin": "manage tokens with"}.get(permission, "use")
                raise StarletteHTTPException(403, f"a {principal.scope!r} token may not {verb} this")
            return principal

        return dep

    Viewer = Annotated[Principal, Depends(require("read"))]
    Operator = Annotated[Principal, Depends(require("write"))]
    Admin = Annotated[Principal, Depends(require("admin"))]
    IdemKey = Annotated[str | None, Header(alias="Idempotency-Key", max_length=256)]

    async def mutate(
        request: Request, principal: Principal, key: str | None, fn: Callable[[Mut], Awaitable[Any]], status: int = 200
    ) -> Response:
        body = await request.body()
        fp = hashlib.sha256(
            f"{request.method} {request.url.path}?{request.url.query}\n".encode() + body
        ).hexdigest()
        try:
            async with manager.mutation(principal.name, request.state.request_id) as m:
                if key:
                    row = await m.session.get(IdempotencyRow, key)
                    if row is not None:
                        if row.fingerprint != fp or row.actor != principal.name:
                            return JSONResponse(
                                {"detail": "Idempotency-Key was already used for a different request"}, 409
                            )
                        return await json_reply(row.response, row.status, headers={"Idempotent-Replay": "true"})
                payload = await fn(m)
                if key:
                    m.session.add(IdempotencyRow(key=key, actor=principal.name, fingerprint=fp, status=status,
                                                 response=payload, created_at=manager.clock.now()))
        except IntegrityError:
            return JSONResponse({"detail": "a concurrent request used the same Idempotency-Key"}, 409)
        return await json_reply(payload, status)

    # ---- probes and metrics ---------------------------------------------------------------------
    @app.get("/healthz", tags=["probes"])
    async def healthz() -> dict[str, Any]:
        return {"ok": True}

    @app.get("/readyz", tags=["probes"], responses={503: {"model": Error}})
    async def readyz() -> JSONResponse:
        if manager.ready:
            return JSONResponse({"ready": True, "epoch": manager.epoch})
        return JSONResponse({"ready": False, "detail": "starting or shutting down"}, 503)

    @app.get("/metrics", tags=["probes"], response_class=PlainTextResponse)
    async def metrics() -> Response:
        await manager.refresh_gauges_async()
        return Response(generate_latest(manager.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ---- read side ------------------------------------------------------------------------------
    @app.get("/v1/status", tags=["cluster"])
    async def status(_: Viewer) -> dict[str, Any]:
        w = manager.world
        return {
            "version": __version__, "leader_epoch": manager.epoch, "gpus": len(w.gpus),
            "gpus_by_state": await manager.gpu_state_counts(),
            "nodes": len(w.nodes), "nodes_connected": sum(1 for n in w.nodes.values() if n.connected),
            "domains": len(w.domains), "jobs": len(w.jobs),
            "breaker": {"open": manager.breaker_open, "reason": manager.breaker_reason},
        }

    @app.get("/v1/domains", tags=["cluster"])
    async def domains(_: Viewer, limit: Limit = 100, offset: Offset = 0) -> dict[str, Any]:
        w = manager.world
        ids = sorted(w.domains)
        shown = ids[offset : offset + limit]
        wanted = set(shown)
        members: dict[str, list[Any]] = {d: [] for d in shown}
        for g in w.gpus.values():  # one pass, not one per domain
            if g.domain in wanted:
                members[g.domain].append(g)
        items = []
        for did in shown:
            gpus = members[did]
            items.append({
                "id": did, "power_budget_w": w.domains[did], "gpus": len(gpus),
                "nodes": sorted({g.node for g in gpus}),
                "unusable": sum(1 for g in gpus if not GpuState(g.state).placeable),
            })
        return page(items, len(ids), limit, offset)

    @app.get("/v1/nodes", tags=["cluster"])
    async def nodes(
        _: Viewer, domain: Annotated[str | None, Query(max_length=128)] = None, limit: Limit = 100,
        offset: Offset = 0,
    ) -> dict[str, Any]:
        w = manager.world
        names = sorted(n for n, rec in w.nodes.items() if domain is None or rec.domain == domain)
        items = []
        for n in names[offset : offset + limit]:
            rec = w.nodes[n]
            items.append({
                "name": n, "domain": rec.domain, "gpus": list(rec.gpus), "connected": rec.connected,
                "last_seq": rec.last_seq,
                "drain_deadline": rec.drain_deadline.isoformat() if rec.drain_deadline else None,
                "drain_reason": rec.drain_reason,
            })
        return page(items, len(names), limit, offset)

    @app.get("/v1/gpus", tags=["cluster"])
    async def gpus(
        _: Viewer,
        state: Annotated[str | None, Query(max_length=32)] = None,
        node: Annotated[str | None, Query(max_length=256)] = None,
        domain: Annotated[str | None, Query(max_length=128)] = None,
        limit: Limit = 100,
        offset: Offset = 0,
    ) -> dict[str, Any]:
        w = manager.world
        sel = sorted(
            u for u, g in w.gpus.items()
            if (state is None or g.state == state) and (node is None or g.node == node)
            and (domain is None or g.domain == domain)
        )
        return page([manager.gpu_view(u) for u in sel[offset : offset + limit]], len(sel), limit, offset)

    @app.get("/v1/gpus/{uuid}", tags=["cluster"], responses={404: {"model": Error}})
    async def gpu(uuid: str, _: Viewer) -> dict[str, Any]:
        t = manager.telemetry.get(uuid)  # the agent's latest counters (issue 21), with the heartbeats
        return {**manager.gpu_view(uuid), "telemetry": None if t is None else t.view()}

    @app.get("/v1/jobs", tags=["jobs"], response_model=dict[str, Any])
    async def jobs(_: Viewer, limit: Limit = 100, offset: Offset = 0) -> Response:
        names = sorted(manager.world.jobs)
        return await json_reply(page([_job_view(manager, n) for n in names[offset : offset + limit]], len(names),
                                     limit, offset))

    @app.get("/v1/jobs/{name}", tags=["jobs"], responses={404: {"model": Error}}, response_model=dict[str, Any])
    async def job(name: str, _: Viewer) -> Response:
        return await json_reply(_job_view(manager, name))

    @app.get("/v1/jobs/{name}/layout", tags=["jobs"], responses={404: {"model": Error}, 409: {"model": Error}},
             response_model=dict[str, Any])
    async def layout(name: str, _: Viewer) -> Response:
        rec = manager.world.jobs.get(name)
        if rec is None:
            raise NotFound(f"unknown job {name!r}")
        if rec.layout is None:
            raise FailedPrecondition(f"job {name!r} has no layout yet: {rec.pending_reason or 'planning'}")
        lay = rec.layout
        return await json_reply({"job": name, "version": lay.version, "leader_epoch": lay.leader_epoch,
                                 "created_at": lay.created_at.isoformat(), "reason": lay.reason, "plan": lay.plan})

    @app.get("/v1/jobs/{name}/steps", tags=["jobs"], responses={404: {"model": Error}})
    async def steps(
        name: str, _: Viewer, recent: Annotated[int, Query(ge=0, le=1000, description="newest samples listed")] = 100,
    ) -> dict[str, Any]:
        """Workers' step reports: step time, compute and TP communication wait per replica and per
        stage of the current layout, over the job's bounded window, and the newest samples."""
        return manager.step_summary(name, recent)

    @app.get("/v1/jobs/{name}/layouts", tags=["jobs"], responses={404: {"model": Error}})
    async def layouts(name: str, _: Viewer, limit: Limit = 100, offset: Offset = 0) -> dict[str, Any]:
        if name not in manager.world.jobs:
            raise NotFound(f"unknown job {name!r}")
        async with manager.sm() as s:
            total = await s.scalar(select(func.count()).select_from(LayoutRow).where(LayoutRow.job == name))
            rows = (await s.scalars(select(LayoutRow).where(LayoutRow.job == name)
                                    .order_by(LayoutRow.version.desc()).limit(limit).offset(offset))).all()
        items = [
            {"version": r.version, "leader_epoch": r.leader_epoch, "created_at": _iso(r.created_at),
             "reason": r.reason, "relative_throughput": r.plan["relative_throughput"],
             "replicas": [_replica_summary(x) for x in r.plan["replicas"]], "moves": r.plan.get("moves")}
            for r in rows
        ]
        return page(items, total or 0, limit, offset)

    @app.get("/v1/events", tags=["audit"])
    async def events(
        _: Viewer, gpu: Annotated[str | None, _ident(limits.GPU_ID_MAX, "GPU UUID")] = None,
        node: Annotated[str | None, _ident(limits.NODE_MAX, "node name")] = None, limit: Limit = 100,
        offset: Offset = 0,
    ) -> dict[str, Any]:
        q = select(HealthEventRow)
        cq = select(func.count()).select_from(HealthEventRow)
        if gpu:
            q, cq = q.where(HealthEventRow.gpu_uuid == gpu), cq.where(HealthEventRow.gpu_uuid == gpu)
        if node:
            q, cq = q.where(HealthEventRow.node == node), cq.where(HealthEventRow.node == node)
        async with manager.sm() as s:
            total = await s.scalar(cq)
            rows = (await s.scalars(q.order_by(HealthEventRow.id.desc()).limit(limit).offset(offset))).all()
        items = [
            {"id": r.id, "at": _iso(r.at), "gpu": r.gpu_uuid, "node": r.node, "seq": r.seq, "source": r.source,
             "old_state": r.old_state, "new_state": r.new_state, "reasons": r.reasons, "xids": r.xids}
            for r in rows
        ]
        return page(items, total or 0, limit, offset)

    @app.get("/v1/audit", tags=["audit"])
    async def audit(
        _: Viewer, action: Annotated[str | None, _ident(64, "e.g. gpu.cordon")] = None,
        target: Annotated[str | None, _ident(256, "GPU, node, job, token id, ...")] = None, limit: Limit = 100,
        offset: Offset = 0,
    ) -> dict[str, Any]:
        q = select(AuditRow)
        cq = select(func.count()).select_from(AuditRow)
        if action:
            q, cq = q.where(AuditRow.action == action), cq.where(AuditRow.action == action)
        if target:
            q, cq = q.where(AuditRow.target == target), cq.where(AuditRow.target == target)
        async with manager.sm() as s:
            total = await s.scalar(cq)
            rows = (await s.scalars(q.order_by(AuditRow.id.desc()).limit(limit).offset(offset))).all()
        items = [
            {"id": r.id, "at": _iso(r.at), "actor": r.actor, "action": r.action, "target": r.target,
             "before": r.before, "after": r.after, "reason": r.reason, "request_id": r.request_id}
            for r in rows
        ]
        return page(items, total or 0, limit, offset)

    @app.get("/v1/maintenance", tags=["operations"])
    async def maintenance_list(_: Viewer, limit: Limit = 100, offset: Offset = 0) -> dict[str, Any]:
        async with manager.sm() as s:
            total = await s.scalar(select(func.count()).select_from(MaintenanceRow))
            rows = (await s.scalars(select(MaintenanceRow).order_by(MaintenanceRow.id.desc())
                                    .limit(limit).offset(offset))).all()
        return page([maintenance_view(r) for r in rows], total or 0, limit, offset)

    @app.get("/v1/breaker", tags=["operations"])
    async def breaker(_: Viewer) -> dict[str, Any]:
        return {"open": manager.breaker_open, "reason": manager.breaker_reason}

    # ---- mutations ------------------------------------------------------------------------------
    E4 = {404: {"model": Error}, 409: {"model": Error}, 422: {"model": Error}}

    @app.post("/v1/jobs", tags=["jobs"], status_code=201, responses=E4)
    async def create_job(request: Request, body: JobFile, who: Operator, key: IdemKey = None) -> JSONResponse:
        spec = body.model_dump(mode="json")
        return await mutate(request, who, key, lambda m: manager.create_job(m, spec), 201)

    @app.delete("/v1/jobs/{name}", tags=["jobs"], responses=E4)
    async def delete_job(request: Request, name: str, who: Operator, key: IdemKey = None) -> JSONResponse:
        return await mutate(request, who, key, lambda m: manager.delete_job(m, name))

    @app.post("/v1/plans", tags=["jobs"], responses=E4)
    async def plan(request: Request, body: PlanBody, who: Operator, key: IdemKey = None) -> JSONResponse:
        if (body.job is None) == (body.spec is None):
            raise InvalidArgument("job: give exactly one of 'job' (a name) or 'spec'")
        if body.job is not None:
            rec = manager.world.jobs.get(body.job)
            if rec is None:
                raise NotFound(f"job: unknown job {body.job!r}")
            spec = rec.spec
        else:
            assert body.spec is not None
            spec = manager.parse_job(body.spec.model_dump(mode="json"))
        if not body.dry_run and (body.job is None or body.fail):
            raise InvalidArgument("dry_run: a real replan needs an existing job and no simulated failures")
        # planned and encoded off the event loop, before the transaction (which then holds only the audit)
        planned = await manager.dry_run(spec, body.fail) if body.dry_run else None
        answer = await asyncio.to_thread(StoredJson, {"dry_run": True, "plan": planned}) if planned else None

        async def run(m: Mut) -> Any:
            if planned is not None:
                m.audit(manager.clock.now(), "plan.dry_run", spec.name,
                        after={"relative_throughput": planned["relative_throughput"], "fail": body.fail[:100]})
                return answer
            assert body.job is not None
            if manager.breaker_open:
                raise FailedPrecondition(f"circuit breaker is open ({manager.breaker_reason}); reset it first")
            lay = await manager.replan(body.job, who.name, reason=f"operator replan by {who.name}", m=m)
            if lay is None:
                why = manager.world.jobs[body.job].pending_reason
                raise InvalidArgument(f"job {body.job!r} cannot be planned: {why}")
            return await asyncio.to_thread(StoredJson, {"dry_run": False, "version": lay.version, "plan": lay.plan})

        return await mutate(request, who, key, run)

    @app.post("/v1/gpus/{uuid}/cordon", tags=["operations"], responses=E4)
    async def cordon(request: Request, uuid: str, body: ReasonBody, who: Operator, key: IdemKey = None) -> JSONResponse:
        return await mutate(request, who, key, lambda m: manager.cordon(m, uuid, body.reason))

    @app.post("/v1/gpus/{uuid}/uncordon", tags=["operations"], responses=E4)
    async def uncordon(
        request: Request, uuid: str, body: ReasonBody, who: Operator, key: IdemKey = None
    ) -> JSONResponse:
        return await mutate(request, who, key, lambda m: manager.uncordon(m, uuid, body.reason))

    @app.post("/v1/gpus/{uuid}/mark-healthy", tags=["operations"], responses=E4)
    async def mark_healthy(
        request: Request, uuid: str, body: ReasonBody, who: Operator, key: IdemKey = None
    ) -> JSONResponse:
        return await mutate(request, who, key, lambda m: manager.mark_healthy(m, uuid, body.reason))

    @app.post("/v1/nodes/{name}/drain", tags=["operations"], responses=E4)
    async def drain(request: Request, name: str, body: DrainBody, who: Operator, key: IdemKey = None) -> JSONResponse:
        return await mutate(request, who, key, lambda m: manager.drain_node(m, name, body.deadline, body.reason))

    @app.post("/v1/nodes/{name}/undrain", tags=["operations"], responses=E4)
    async def undrain(
        request: Request, name: str, body: ReasonBody, who: Operator, key: IdemKey = None
    ) -> JSONResponse:
        return await mutate(request, who, key, lambda m: manager.undrain_node(m, name, body.reason))

    @app.post("/v1/maintenance", tags=["operations"], status_code=201, responses=E4)
    async def maintenance(
        request: Request, body: MaintenanceBody, who: Operator, key: IdemKey = None
    ) -> JSONResponse:
        return await mutate(
            request, who, key,
            lambda m: manager.add_maintenance(m, body.target_kind, body.target, body.starts_at, body.ends_at,
                                              body.reason),
            201,
        )

    @app.delete("/v1/maintenance/{window_id}", tags=["operations"], responses=E4)
    async def cancel_maintenance(
        request: Request, window_id: Annotated[int, Path(ge=1, le=2**31 - 1)], who: Operator,
        key: IdemKey = None,
    ) -> JSONResponse:
        return await mutate(request, who, key, lambda m: manager.cancel_maintenance(m, window_id))

    @app.post("/v1/breaker/reset", tags=["operations"], responses=E4)
    async def breaker_reset(
        request: Request, body: ReasonBody, who: Operator, key: IdemKey = None
    ) -> JSONResponse:
        return await mutate(request, who, key, lambda m: manager.reset_breaker(m, body.reason))

    # ---- tokens (admin scope) ---------------------------------------------------------------------
    @app.get("/v1/tokens", tags=["tokens"])
    async def list_tokens(who: Admin) -> dict[str, Any]:
        items = await manager.list_tokens()
        return page(items, len(items), len(items), 0)

    @app.post("/v1/tokens", tags=["tokens"], status_code=201, responses=E4)
    async def create_token(body: TokenBody, who: Admin) -> dict[str, Any]:
        token = await manager.create_token(body.name, body.scope, actor=who.name, node=body.node,
                                           fingerprint=body.fingerprint)
        return {"id": token.split("_")[1], "name": body.name, "scope": body.scope, "node": body.node,
                "token": token}

    @app.delete("/v1/tokens/{token_id}", tags=["tokens"], responses=E4)
    async def revoke_token(token_id: Annotated[str, Path(pattern="^[0-9a-f]{8}$")], who: Admin) -> dict[str, Any]:
        await manager.revoke_token(token_id, actor=who.name)
        return {"id": token_id, "revoked": True}

    # ---- dashboard ---------------------------------------------------------------------------------
    @app.get("/v1/snapshot", tags=["cluster"], response_model=dict[str, Any])
    async def snapshot(who: Viewer) -> Response:
        return await json_reply(await dashboard_snapshot(manager))

    @app.post("/v1/stream/tickets", tags=["cluster"], status_code=201)
    async def stream_ticket(who: Viewer) -> dict[str, Any]:
        """A one-time ticket (30 s) that opens `/v1/stream?ticket=...`: EventSource cannot send an
        Authorization header, and a token in a URL would end up in history and logs."""
        from ntp_manager.api.tickets import TTL_S

        return {"ticket": tickets.issue(who), "expires_in_s": TTL_S}

    @app.get("/v1/stream", tags=["cluster"], response_class=StreamingResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
    async def stream(
        request: Request,
        ticket: Annotated[str | None, Query(max_length=64, pattern="^[A-Za-z0-9_-]+$")] = None,
        authorization: Annotated[str | None, Header()] = None,
    ) -> StreamingResponse:
        """Server-sent events: a `snapshot` event with the whole dashboard state whenever it changes.
        Authenticate with the header, or with a ticket from `POST /v1/stream/tickets`. The stream
        ends when its token is revoked."""
        if ticket is not None and authorization is None:
            who = tickets.redeem(ticket)
            if who is None or not manager.tokens.active(who.token_id):
                raise StarletteHTTPException(401, "unknown, used or expired ticket",
                                             headers={"WWW-Authenticate": "Bearer"})
        else:
            who = await require("read")(authorization)
        return StreamingResponse(snapshot_events(manager, request, who.token_id), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/", include_in_schema=False, response_class=HTMLResponse)
    async def root() -> HTMLResponse:
        return HTMLResponse(DASHBOARD_HTML)

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
    return app


def _plain(e: dict[str, Any]) -> dict[str, Any]:
    return {"loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}


def _iso(t: datetime) -> str:
    return (t if t.tzinfo else t.replace(tzinfo=UTC)).isoformat()


def _replica_summary(r: dict[str, Any]) -> dict[str, Any]:
    """A replica in a layout's history: its TP degree (the lowest stage's), batch, each stage's TP
    degree, and the groups that moved into it (replica or stage changed) with where they were."""
    groups = sorted(r["groups"], key=lambda g: g["stage"])
    moved = [{"group": g["group"], "stage": g["stage"], "from_replica": g.get("prev_replica"),
              "from_stage": g.get("prev_stage")}
             for g in groups if "prev_replica" in g and (g["prev_replica"], g["prev_stage"]) != (r["id"], g["stage"])]
    return {"id": r["id"], "tp": r["tp"], "local_batch": r["local_batch"], "stage_tp": [g["tp"] for g in groups],
            "moved": moved}


def _job_view(manager: Manager, name: str) -> dict[str, Any]:
    rec = manager.world.jobs.get(name)
    if rec is None:
        raise NotFound(f"unknown job {name!r}")
    lay = rec.layout
    return {
        "name": name, "spec": rec.raw, "pending_reason": rec.pending_reason,
        "layout_version": lay.version if lay else None,
        "acks": {str(v): a for v, a in manager.layout_acks.get(name, {}).items()},
        "replicas": [{"id": r["id"], "tp": r["tp"], "local_batch": r["local_batch"]} for r in lay.plan["replicas"]]
        if lay else [],
        "relative_throughput": lay.plan["relative_throughput"] if lay else None,
    }
