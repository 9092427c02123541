"""Jobs: listing, layouts and their history, step reports, plans (dry runs and replans), create and
delete."""

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from ntp_manager.api.edge import E4, NOT_FOUND, Error, GpuId, IdemKey, Limit, Offset, json_reply, mutate, require
from ntp_manager.auth import Principal
from ntp_manager.contract import limits
from ntp_manager.jsontext import StoredJson
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.core import offloop
from ntp_manager.service.core.errors import FailedPrecondition, InvalidArgument
from ntp_manager.service.manager import Manager, Mut
from ntp_manager.service.planning import layout_views as views
from ntp_manager.specfile import PRIORITY_MAX, JobFile


class PlanBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job: str | None = Field(None, description="plan an existing job by name ...", max_length=limits.JOB_NAME_MAX,
                            pattern=limits.JOB_NAME_PATTERN)
    spec: JobFile | None = Field(None, description="... or this job spec")
    dry_run: bool = True
    fail: list[GpuId] = Field(default_factory=list, max_length=100_000, description="GPUs to treat as failed")
    limit: int = Field(views.REPLICAS_DEFAULT, ge=1, le=views.REPLICAS_MAX,
                       description="replicas of the plan listed (a page; `counts` has the totals)")
    offset: int = Field(0, ge=0, le=10_000_000, description="replicas of the plan skipped (in id order)")


class PolicyBody(BaseModel):
    """A job's sharing policy (docs/specs.md, "Many jobs"): the fields given change, the rest stay."""

    model_config = ConfigDict(extra="forbid")
    priority: int | None = Field(None, ge=0, le=PRIORITY_MAX, strict=True)
    preemptible: bool | None = Field(None, strict=True)
    min_throughput: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    queue: bool | None = Field(None, strict=True)


class FailSlowBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    options: dict[str, bool | int | float] = Field(
        default_factory=dict, max_length=64,
        description="detector options to change (docs/failslow.md), e.g. {\"enter_margin\": 0.15, \"dry_run\": true}")
    reset: bool = Field(False, description="start from the defaults; with no options, drop the job's own options")


ReplicaPage = Annotated[int, Query(ge=1, le=views.REPLICAS_MAX, description="replicas listed (a page; `counts` "
                                                                            "has the totals)")]
ReplicaOffset = Annotated[int, Query(ge=0, le=10_000_000, description="replicas skipped (in id order)")]
ReplicasLimit = Annotated[int, Query(ge=0, le=views.REPLICAS_MAX,
                                     description="replicas listed per item (limit x replicas_limit <= "
                                                 f"{views.SUMMARY_ENTRIES_MAX:,})")]


def router(manager: Manager) -> APIRouter:
    r = APIRouter(prefix="/v1", tags=["jobs"])
    _job_reads(r, manager)
    _failslow(r, manager)
    _layout_history(r, manager)
    _job_writes(r, manager)
    return r


def _job_reads(r: APIRouter, manager: Manager) -> None:
    """A job, its current layout, its step reports and its checkpoints."""
    Viewer = Annotated[Principal, Depends(require(manager, "read"))]
    q = manager.queries

    @r.get("/jobs", response_model=dict[str, Any])
    async def jobs(_: Viewer, limit: Limit = 100, offset: Offset = 0,
                   replicas_limit: ReplicasLimit = views.SUMMARY_REPLICAS) -> Response:
        """Jobs by name; each lists its first `replicas_limit` replicas (`counts` has the totals)."""
        return await json_reply(await q.jobs(limit, offset, replicas_limit))

    @r.get("/jobs/{name}", responses=NOT_FOUND, response_model=dict[str, Any])
    async def job(name: str, _: Viewer, limit: ReplicaPage = views.REPLICAS_DEFAULT,
                  offset: ReplicaOffset = 0) -> Response:
        """A job: spec, layout version, `counts` (replicas per TP degree, GPUs, ...), a page of its
        replicas summarised, and per layout version how many workers acked it."""
        return await json_reply(await q.job(name, limit, offset))

    @r.get("/jobs/{name}/layout", responses={404: {"model": Error}, 409: {"model": Error}},
           response_model=dict[str, Any])
    async def layout(name: str, _: Viewer, limit: ReplicaPage = views.REPLICAS_DEFAULT,
                     offset: ReplicaOffset = 0) -> Response:
        """The current layout: the plan JSON (docs/plan-json.md) with a page of its replicas (and
        their GPUs' power caps), and `counts` with every total."""
        return await json_reply(await q.layout(name, limit, offset))

    @r.get("/jobs/{name}/steps", responses=NOT_FOUND)
    async def steps(
        name: str, _: Viewer, recent: Annotated[int, Query(ge=0, le=1000, description="newest samples listed")] = 100,
    ) -> dict[str, Any]:
        """Workers' step reports: step time, compute and TP communication wait per replica and per
        stage of the current layout, over the job's bounded window, and the newest samples."""
        return manager.step_summary(name, recent)

    @r.get("/jobs/{name}/checkpoints", responses={404: {"model": Error}, 409: {"model": Error}})
    async def checkpoints(
        name: str, _: Viewer, limit: Annotated[int, Query(ge=1, le=1000, description="newest N listed")] = 100,
    ) -> dict[str, Any]:
        """The job's checkpoints, newest first (step, completion time, complete, verified, bytes),
        read from its spec's checkpoint.dir off the event loop; 409 when the job has no checkpoint
        block or the directory cannot be read in time."""
        return await manager.checkpoints.list(name, limit)



def _failslow(r: APIRouter, manager: Manager) -> None:
    """The fail-slow detector's view of a job, and its options (per job and the defaults)."""
    Viewer = Annotated[Principal, Depends(require(manager, "read"))]
    Operator = Annotated[Principal, Depends(require(manager, "write"))]

    @r.get("/jobs/{name}/slow", responses=NOT_FOUND)
    async def slow(name: str, _: Viewer) -> dict[str, Any]:
        """Fail-slow: the job's detector options, each GPU's step factor and verdict, the groups
        called imbalanced or network-slow, and the newest verdicts (docs/failslow.md)."""
        return manager.failslow_view(name)

    @r.patch("/jobs/{name}/slow/options", responses=E4)
    async def slow_options(request: Request, name: str, body: FailSlowBody, who: Operator,
                           key: IdemKey = None) -> Response:
        """Change the job's fail-slow thresholds, windows or dry run; they apply from the next step."""
        return await mutate(manager, request, who, key,
                            lambda m: manager.set_failslow_options(m, name, dict(body.options), body.reset))

    @r.get("/failslow/options")
    async def slow_defaults(_: Viewer) -> dict[str, Any]:
        """The fail-slow options of jobs without options of their own, and the jobs with some."""
        fs = manager.failslow
        return {"defaults": fs.options_for("*").as_dict(),
                "jobs": {k: v.as_dict() for k, v in sorted(fs.options.items()) if k != "*"}}

    @r.patch("/failslow/options", responses=E4)
    async def slow_defaults_set(request: Request, body: FailSlowBody, who: Operator, key: IdemKey = None) -> Response:
        """Change the fail-slow options of every job without options of its own."""
        return await mutate(manager, request, who, key,
                            lambda m: manager.set_failslow_options(m, "*", dict(body.options), body.reset))



def _layout_history(r: APIRouter, manager: Manager) -> None:
    """A job's stored layout versions."""
    Viewer = Annotated[Principal, Depends(require(manager, "read"))]
    q = manager.queries

    @r.get("/jobs/{name}/layouts", responses=NOT_FOUND, response_model=dict[str, Any])
    async def layouts(name: str, _: Viewer, limit: Limit = 100, offset: Offset = 0,
                      replicas_limit: ReplicasLimit = views.SUMMARY_REPLICAS) -> Response:
        """A job's layout versions, newest first, summarised: throughput, batch, `moves`, `counts`
        (replicas per TP degree, GPUs, ...), and its first `replicas_limit` replicas: TP degree,
        batch, stage degrees (`stage_tp`) and the groups that moved into it (`moved`). Every
        replica of one version: `GET /v1/jobs/{name}/layouts/{version}`, a page at a time."""
        return await json_reply(await q.layouts(name, limit, offset, replicas_limit))

    @r.get("/jobs/{name}/layouts/{version}", responses=NOT_FOUND, response_model=dict[str, Any])
    async def layout_version(name: str, version: Annotated[int, Path(ge=1, le=limits.INT64_MAX)], _: Viewer,
                             limit: ReplicaPage = views.REPLICAS_DEFAULT, offset: ReplicaOffset = 0) -> Response:
        """One stored version of the layout, as `GET /v1/jobs/{name}/layout` shows the current one."""
        return await json_reply(await q.layout_version(name, version, limit, offset))



def _job_writes(r: APIRouter, manager: Manager) -> None:
    """Create and delete jobs; plans (dry runs and replans)."""
    Operator = Annotated[Principal, Depends(require(manager, "write"))]

    @r.post("/jobs", status_code=201, responses=E4)
    async def create_job(request: Request, body: JobFile, who: Operator, key: IdemKey = None) -> Response:
        spec = body.model_dump(mode="json")
        return await mutate(manager, request, who, key, lambda m: manager.create_job(m, spec), 201)

    @r.patch("/jobs/{name}", responses=E4)
    async def set_policy(request: Request, name: str, body: PolicyBody, who: Operator, key: IdemKey = None) -> Response:
        """Change a job's priority, preemptible, min_throughput or queue; the pool follows."""
        changes = body.model_dump(exclude_none=True)
        return await mutate(manager, request, who, key, lambda m: manager.sharing.set_policy(m, name, changes))

    @r.delete("/jobs/{name}", responses=E4)
    async def delete_job(request: Request, name: str, who: Operator, key: IdemKey = None) -> Response:
        return await mutate(manager, request, who, key, lambda m: manager.delete_job(m, name))

    @r.post("/plans", responses=E4)
    async def plan(request: Request, body: PlanBody, who: Operator, key: IdemKey = None) -> Response:
        if (body.job is None) == (body.spec is None):
            raise InvalidArgument("job: give exactly one of 'job' (a name) or 'spec'")
        if body.job is not None:
            spec = manager.sharing.planned_spec(body.job)  # on the domains the job owns
        else:
            assert body.spec is not None
            spec = manager.parse_job(body.spec.model_dump(mode="json"))
        if not body.dry_run and (body.job is None or body.fail):
            raise InvalidArgument("dry_run: a real replan needs an existing job and no simulated failures")
        # planned and encoded off the event loop, before the transaction (which then holds only the audit)
        planned = await manager.dry_run(spec, body.fail) if body.dry_run else None
        answer = await offloop.run(_answer, planned, {"dry_run": True}, body.limit, body.offset) if planned else None

        async def run(m: Mut) -> Any:
            if planned is not None:
                m.audit(m.now, "plan.dry_run", spec.name,
                        after={"relative_throughput": planned.relative_throughput, "fail": body.fail[:100]})
                return answer
            assert body.job is not None
            if manager.breaker_open:
                raise FailedPrecondition(f"circuit breaker is open ({manager.breaker_reason}); reset it first")
            lay = await manager.replan(body.job, who.name, reason=f"operator replan by {who.name}", m=m)
            if lay is None:
                why = manager.world.jobs[body.job].pending_reason
                raise InvalidArgument(f"job {body.job!r} cannot be planned: {why}")
            return await offloop.run(_answer, lay.doc, {"dry_run": False, "version": lay.version}, body.limit,
                                     body.offset)

        return await mutate(manager, request, who, key, run)


def _answer(doc: LayoutDoc, head: dict[str, Any], limit: int, offset: int) -> StoredJson:
    """A plan answer (a page of its replicas, service/planning/layout_views.py) with its JSON text made
    here, in a worker thread."""
    return StoredJson({**head, **views.plan_page(doc, limit, offset)})
