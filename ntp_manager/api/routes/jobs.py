"""Jobs: listing, layouts and their history, step reports, plans (dry runs and replans), create and
delete."""

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from ntp_manager import limits
from ntp_manager.api.edge import E4, NOT_FOUND, Error, GpuId, IdemKey, Limit, Offset, json_reply, mutate, require
from ntp_manager.auth import Principal
from ntp_manager.service.errors import FailedPrecondition, InvalidArgument, NotFound
from ntp_manager.service.manager import Manager, Mut
from ntp_manager.specfile import JobFile
from ntp_manager.store.db import StoredJson


class PlanBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job: str | None = Field(None, description="plan an existing job by name ...", max_length=limits.JOB_NAME_MAX,
                            pattern=limits.JOB_NAME_PATTERN)
    spec: JobFile | None = Field(None, description="... or this job spec")
    dry_run: bool = True
    fail: list[GpuId] = Field(default_factory=list, max_length=100_000, description="GPUs to treat as failed")


def router(manager: Manager) -> APIRouter:
    r = APIRouter(prefix="/v1", tags=["jobs"])
    Viewer = Annotated[Principal, Depends(require(manager, "read"))]
    Operator = Annotated[Principal, Depends(require(manager, "write"))]
    q = manager.queries

    @r.get("/jobs", response_model=dict[str, Any])
    async def jobs(_: Viewer, limit: Limit = 100, offset: Offset = 0) -> Response:
        return await json_reply(q.jobs(limit, offset))

    @r.get("/jobs/{name}", responses=NOT_FOUND, response_model=dict[str, Any])
    async def job(name: str, _: Viewer) -> Response:
        return await json_reply(q.job(name))

    @r.get("/jobs/{name}/layout", responses={404: {"model": Error}, 409: {"model": Error}},
           response_model=dict[str, Any])
    async def layout(name: str, _: Viewer) -> Response:
        return await json_reply(q.layout(name))

    @r.get("/jobs/{name}/steps", responses=NOT_FOUND)
    async def steps(
        name: str, _: Viewer, recent: Annotated[int, Query(ge=0, le=1000, description="newest samples listed")] = 100,
    ) -> dict[str, Any]:
        """Workers' step reports: step time, compute and TP communication wait per replica and per
        stage of the current layout, over the job's bounded window, and the newest samples."""
        return manager.step_summary(name, recent)

    @r.get("/jobs/{name}/layouts", responses=NOT_FOUND)
    async def layouts(name: str, _: Viewer, limit: Limit = 100, offset: Offset = 0) -> dict[str, Any]:
        return await q.layouts(name, limit, offset)

    @r.post("/jobs", status_code=201, responses=E4)
    async def create_job(request: Request, body: JobFile, who: Operator, key: IdemKey = None) -> Response:
        spec = body.model_dump(mode="json")
        return await mutate(manager, request, who, key, lambda m: manager.create_job(m, spec), 201)

    @r.delete("/jobs/{name}", responses=E4)
    async def delete_job(request: Request, name: str, who: Operator, key: IdemKey = None) -> Response:
        return await mutate(manager, request, who, key, lambda m: manager.delete_job(m, name))

    @r.post("/plans", responses=E4)
    async def plan(request: Request, body: PlanBody, who: Operator, key: IdemKey = None) -> Response:
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
                m.audit(m.now, "plan.dry_run", spec.name,
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

        return await mutate(manager, request, who, key, run)

    return r
