"""Operator actions: cordon, uncordon, mark-healthy, drains, maintenance windows, the breaker."""

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from ntp_manager.api.edge import E4, IdemKey, Limit, Offset, OptReason, Reason, When, mutate, require
from ntp_manager.auth import Principal
from ntp_manager.contract import limits
from ntp_manager.service.manager import Manager


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


def router(manager: Manager) -> APIRouter:
    r = APIRouter(prefix="/v1", tags=["operations"])
    Viewer = Annotated[Principal, Depends(require(manager, "read"))]
    Operator = Annotated[Principal, Depends(require(manager, "write"))]
    m = manager

    @r.post("/gpus/{uuid}/cordon", responses=E4)
    async def cordon(request: Request, uuid: str, body: ReasonBody, who: Operator, key: IdemKey = None) -> Response:
        return await mutate(m, request, who, key, lambda tx: m.cordon(tx, uuid, body.reason))

    @r.post("/gpus/{uuid}/uncordon", responses=E4)
    async def uncordon(request: Request, uuid: str, body: ReasonBody, who: Operator,
                       key: IdemKey = None) -> Response:
        return await mutate(m, request, who, key, lambda tx: m.uncordon(tx, uuid, body.reason))

    @r.post("/gpus/{uuid}/mark-healthy", responses=E4)
    async def mark_healthy(request: Request, uuid: str, body: ReasonBody, who: Operator,
                           key: IdemKey = None) -> Response:
        return await mutate(m, request, who, key, lambda tx: m.mark_healthy(tx, uuid, body.reason))

    @r.post("/nodes/{name}/drain", responses=E4)
    async def drain(request: Request, name: str, body: DrainBody, who: Operator, key: IdemKey = None) -> Response:
        return await mutate(m, request, who, key, lambda tx: m.drain_node(tx, name, body.deadline, body.reason))

    @r.post("/nodes/{name}/undrain", responses=E4)
    async def undrain(request: Request, name: str, body: ReasonBody, who: Operator, key: IdemKey = None) -> Response:
        return await mutate(m, request, who, key, lambda tx: m.undrain_node(tx, name, body.reason))

    @r.get("/maintenance")
    async def maintenance_list(_: Viewer, limit: Limit = 100, offset: Offset = 0) -> dict[str, Any]:
        return await m.queries.maintenance(limit, offset)

    @r.post("/maintenance", status_code=201, responses=E4)
    async def maintenance(request: Request, body: MaintenanceBody, who: Operator, key: IdemKey = None) -> Response:
        return await mutate(
            m, request, who, key,
            lambda tx: m.add_maintenance(tx, body.target_kind, body.target, body.starts_at, body.ends_at, body.reason),
            201,
        )

    @r.delete("/maintenance/{window_id}", responses=E4)
    async def cancel_maintenance(request: Request, window_id: Annotated[int, Path(ge=1, le=2**31 - 1)],
                                 who: Operator, key: IdemKey = None) -> Response:
        return await mutate(m, request, who, key, lambda tx: m.cancel_maintenance(tx, window_id))

    @r.get("/breaker")
    async def breaker(_: Viewer) -> dict[str, Any]:
        return {"open": m.breaker_open, "reason": m.breaker_reason}

    @r.get("/slurm")
    async def slurm(_: Viewer, limit: Limit = 100) -> dict[str, Any]:
        """What ntp-manager does to Slurm (docs/slurm.md): the nodes it wants drained and why, those
        it drained, those it holds back (and why), the last error; at most `limit` of each, with
        `counts` of all."""
        return m.slurm.status(limit)

    @r.post("/breaker/reset", responses=E4)
    async def breaker_reset(request: Request, body: ReasonBody, who: Operator, key: IdemKey = None) -> Response:
        return await mutate(m, request, who, key, lambda tx: m.reset_breaker(tx, body.reason))

    return r
