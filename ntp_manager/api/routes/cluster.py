"""Cluster reads: status, domains, nodes, GPUs."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query

from ntp_manager import __version__
from ntp_manager.api.edge import NOT_FOUND, Limit, Offset, require
from ntp_manager.auth import Principal
from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.manager import Manager


def router(manager: Manager) -> APIRouter:
    r = APIRouter(prefix="/v1", tags=["cluster"])
    Viewer = Annotated[Principal, Depends(require(manager, "read"))]
    q = manager.queries

    @r.get("/status")
    async def status(_: Viewer) -> dict[str, Any]:
        w = manager.world
        return {
            "version": __version__, "leader_epoch": manager.epoch, "gpus": len(w.gpus),
            "gpus_by_state": await manager.gpu_state_counts(),
            "nodes": len(w.nodes), "nodes_connected": sum(1 for n in w.nodes.values() if n.connected),
            "domains": len(w.domains), "jobs": len(w.jobs),
            "breaker": {"open": manager.breaker_open, "reason": manager.breaker_reason},
        }

    @r.get("/domains")
    async def domains(_: Viewer, limit: Limit = 100, offset: Offset = 0) -> dict[str, Any]:
        return await q.domains(limit, offset)

    @r.get("/cluster/allocation")
    async def allocation(_: Viewer, limit: Limit = 100, offset: Offset = 0) -> dict[str, Any]:
        """Which job owns which domain (a page of domains by id, with their GPUs by state), the free
        pool, each job's priority and planned throughput beside its `min_throughput` (a page of jobs
        by name), and the pending jobs in the order they will be placed."""
        return await manager.sharing.view(limit, offset)

    @r.get("/nodes")
    async def nodes(_: Viewer, domain: Annotated[str | None, Query(max_length=128)] = None, limit: Limit = 100,
                    offset: Offset = 0) -> dict[str, Any]:
        return await q.nodes(domain, limit, offset)

    @r.get("/nodes/{name}", responses=NOT_FOUND)
    async def node(name: Annotated[str, Path(max_length=256)], _: Viewer) -> dict[str, Any]:
        """One node: its domain, GPUs and connection (404 naming it when no agent registered it)."""
        return q.node(name)

    @r.get("/gpus")
    async def gpus(
        _: Viewer,
        state: GpuState | None = None,  # anything else: 422 naming the parameter, not an empty page
        node: Annotated[str | None, Query(max_length=256)] = None,
        domain: Annotated[str | None, Query(max_length=128)] = None,
        limit: Limit = 100,
        offset: Offset = 0,
    ) -> dict[str, Any]:
        return await q.gpus(state, node, domain, limit, offset)

    @r.get("/gpus/{uuid}", responses=NOT_FOUND)
    async def gpu(uuid: str, _: Viewer) -> dict[str, Any]:
        return q.gpu(uuid)

    return r
