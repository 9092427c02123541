"""The record: health events and the audit log, newest first."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path

from ntp_manager.api.edge import NOT_FOUND, Limit, Offset, ident, require
from ntp_manager.auth import Principal
from ntp_manager.contract import limits
from ntp_manager.service.manager import Manager


def router(manager: Manager) -> APIRouter:
    r = APIRouter(prefix="/v1", tags=["audit"])
    Viewer = Annotated[Principal, Depends(require(manager, "read"))]

    @r.get("/events")
    async def events(
        _: Viewer, gpu: Annotated[str | None, ident(limits.GPU_ID_MAX, "GPU UUID")] = None,
        node: Annotated[str | None, ident(limits.NODE_MAX, "node name")] = None, limit: Limit = 100,
        offset: Offset = 0,
    ) -> dict[str, Any]:
        return await manager.queries.events(gpu, node, limit, offset)

    @r.get("/audit")
    async def audit(
        _: Viewer, action: Annotated[str | None, ident(64, "e.g. gpu.cordon")] = None,
        target: Annotated[str | None, ident(256, "GPU, node, job, token id, ...")] = None, limit: Limit = 100,
        offset: Offset = 0,
    ) -> dict[str, Any]:
        return await manager.queries.audit(action, target, limit, offset)

    @r.get("/audit/{audit_id}", responses=NOT_FOUND)
    async def audit_record(_: Viewer, audit_id: Annotated[int, Path(ge=1, le=2**63 - 1)]) -> dict[str, Any]:
        """One audit record (the link in a Slurm drain's reason points here)."""
        return await manager.queries.audit_record(audit_id)

    return r
