"""Queries: the read side of the service, for the edges (REST, dashboard, CLI). Plain dicts and
lists, built from memory or read from the store; nothing here changes anything, and nothing
outside the service reads the store's tables."""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from datetime import UTC, datetime
from operator import itemgetter
from typing import Any

from sqlalchemy import Select, func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.core import offloop
from ntp_manager.service.core.errors import FailedPrecondition, NotFound
from ntp_manager.service.core.kernel import Kernel
from ntp_manager.service.core.state import GpuRec, JobRec, NodeRec
from ntp_manager.service.ingest.telemetry import TelemetryStore
from ntp_manager.service.ingest.worker_reports import WorkerReports
from ntp_manager.service.planning import layout_views as views
from ntp_manager.service.planning.restores import Restores
from ntp_manager.store.layout_codec import UuidAt
from ntp_manager.store.layouts import decode_rows, rows_for
from ntp_manager.store.models import AuditRow, HealthEventRow, LayoutRow, MaintenanceRow


def page(items: list[Any], total: int, limit: int, offset: int) -> dict[str, Any]:
    return {"items": items, "total": total, "limit": limit, "offset": offset}


def iso(t: datetime) -> str:
    return aware(t).isoformat()


def aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def gpu_view(g: GpuRec) -> dict[str, Any]:
    return {
        "uuid": g.uuid, "node": g.node, "domain": g.domain, "index": g.idx,
        "state": g.state, "health": g.health, "health_reason": g.health_reason,
        "health_since": iso(g.health_since) if g.health_since is not None else None,
        "speed": g.planned_speed,  # measured speed factor while degraded by the fail-slow detector
        "admin": g.admin, "admin_owner": g.admin_owner if g.admin else None,
        "admin_reason": g.admin_reason if g.admin else None,
        "tdp_w": g.tdp_mw / 1000, "min_w": g.min_mw / 1000, "max_w": g.max_mw / 1000,
        "desired_w": None if g.desired_mw is None else g.desired_mw / 1000,
        "enforced_w": None if g.enforced_mw is None else g.enforced_mw / 1000,
    }


def maintenance_view(row: MaintenanceRow) -> dict[str, Any]:
    return {
        "id": row.id, "target_kind": row.target_kind, "target": row.target,
        "starts_at": aware(row.starts_at).isoformat(), "ends_at": aware(row.ends_at).isoformat(),
        "reason": row.reason, "owner": row.owner, "cancelled": row.cancelled,
    }


def history(rows: Sequence[LayoutRow], shown: Container[int], uuid_at: UuidAt,
            replicas_limit: int) -> list[dict[str, Any]]:
    """The versions of `rows` whose number is in `shown`, newest first, summarised with their
    first `replicas_limit` replicas (service/planning/layout_views.py). `rows` start at a keyframe
    (store/layouts.py). O(their GPUs): call it in a worker thread."""
    out = []
    for row, doc in zip(rows, decode_rows(rows, uuid_at), strict=True):
        if row.version in shown:
            out.append({"version": row.version, "leader_epoch": row.leader_epoch, "created_at": iso(row.created_at),
                        "reason": row.reason, **views.summary(doc, replicas_limit)})
    return out[::-1]


def acks_view(acks: Sequence[tuple[int, Sequence[tuple[str, dict[str, Any]]]]]) -> dict[str, Any]:
    """Per layout version, how many workers acked it and how many of those failed to apply it,
    with the first ACKS_LISTED failed workers named (a job may have 100K workers), and when the
    newest ack came (`last_at`, RFC 3339; None before any)."""
    out = {}
    for version, per in acks:
        failed = [w for w, a in per if not a["ok"]]
        out[str(version)] = {"workers": len(per), "ok": len(per) - len(failed), "failed": len(failed),
                             "failed_workers": failed[:ACKS_LISTED],
                             "last_at": max((str(a["at"]) for _, a in per), default=None)}
    return out


ACKS_LISTED = 16


def job_part(doc: LayoutDoc | None, limit: int, offset: int, acks: Any) -> dict[str, Any]:
    """The parts of a job's view that grow with it: a page of its replicas, its counts, its acks."""
    return {"counts": views.counts(doc) if doc is not None else None,
            "replicas": views.replica_summaries(doc, offset, offset + limit) if doc is not None else [],
            "acks": acks_view(acks)}


class Queries:
    def __init__(self, kernel: Kernel, sm: async_sessionmaker[AsyncSession], workers: WorkerReports,
                 telemetry: TelemetryStore, restores: Restores | None = None) -> None:
        self.kernel = kernel
        self.restores = restores
        self.sm = sm
        self.workers = workers
        self.telemetry = telemetry

    # ---- from memory --------------------------------------------------------------------------
    # Listings of domains, nodes and GPUs look at every one of them (100K GPUs): they are made in
    # a worker thread from C-level copies of the world's tables (records are only read there).
    async def domains(self, limit: int, offset: int) -> dict[str, Any]:
        w = self.kernel.world
        return await offloop.run(_domains, dict(w.domains), list(w.gpus.values()), limit, offset)

    async def nodes(self, domain: str | None, limit: int, offset: int) -> dict[str, Any]:
        return await offloop.run(_nodes, list(self.kernel.world.nodes.items()), domain, limit, offset)

    async def gpus(self, state: GpuState | None, node: str | None, domain: str | None, limit: int,
                   offset: int) -> dict[str, Any]:
        return await offloop.run(_gpus, list(self.kernel.world.gpus.items()), state, node, domain, limit, offset)

    def gpu(self, uuid: str) -> dict[str, Any]:
        """One GPU, with its agent's latest counters (issue 21), which come with the heartbeats."""
        rec = self.kernel.world.gpus.get(uuid)
        if rec is None:
            raise NotFound(f"unknown GPU {uuid!r}")
        t = self.telemetry.get(uuid)
        return {**gpu_view(rec), "telemetry": None if t is None else t.view()}

    def job_rec(self, name: str) -> JobRec:
        rec = self.kernel.world.jobs.get(name)
        if rec is None:
            raise NotFound(f"unknown job {name!r}")
        return rec

    async def job(self, name: str, limit: int = views.REPLICAS_DEFAULT, offset: int = 0) -> dict[str, Any]:
        """A job: its spec, its current layout's counts and the replicas at indices offset ..
        offset + limit - 1 summarised, and per version how many workers acked it (made in a worker
        thread: O(the page + the acks kept))."""
        rec = self.job_rec(name)
        lay = rec.layout
        # the acks as they are now: C-level copies (a few versions of up to 2 x GPUs each), as the
        # loop may add some while the thread counts them
        acks = [(v, list(per.items())) for v, per in list(self.workers.acks.get(name, {}).items())]
        part = await offloop.run(job_part, lay.doc if lay else None, limit, offset, acks)
        return {
            "name": name, "spec": rec.raw, "pending_reason": rec.pending_reason,
            "layout_version": lay.version if lay else None,
            "global_batch": lay.doc.global_batch if lay else None,
            "relative_throughput": lay.doc.relative_throughput if lay else None,
            **part,
            "restored": self.restores.newest(name) if self.restores is not None else None,  # issue 22
        }

    async def jobs(self, limit: int, offset: int, replicas_limit: int = views.SUMMARY_REPLICAS) -> dict[str, Any]:
        """Jobs by name, each with its first `replicas_limit` replicas (InvalidArgument when the
        page could list more than layout_views.SUMMARY_ENTRIES_MAX of them)."""
        views.check_summary_page(limit, replicas_limit)
        names = sorted(self.kernel.world.jobs)
        return page([await self.job(n, replicas_limit, 0) for n in names[offset : offset + limit]], len(names),
                    limit, offset)

    async def layout(self, name: str, limit: int = views.REPLICAS_DEFAULT, offset: int = 0) -> dict[str, Any]:
        """The current layout of a job: its plan in the documented JSON shape (docs/plan-json.md)
        with a page of its replicas, and its counts (service/planning/layout_views.py; made in a worker
        thread); FailedPrecondition while it has none."""
        rec = self.job_rec(name)
        lay = rec.layout
        if lay is None:
            raise FailedPrecondition(f"job {name!r} has no layout yet: {rec.pending_reason or 'planning'}")
        return {"job": name, "version": lay.version, "leader_epoch": lay.leader_epoch,
                "created_at": lay.created_at.isoformat(), "reason": lay.reason,
                **await offloop.run(views.plan_page, lay.doc, limit, offset)}

    # ---- from the store -----------------------------------------------------------------------
    async def _page(self, q: Select[Any], count: Select[Any], view: Callable[[Any], dict[str, Any]],
                    limit: int, offset: int) -> dict[str, Any]:
        async with self.sm() as s:
            total = await s.scalar(count)
            rows = (await s.scalars(q.limit(limit).offset(offset))).all()
        return page([view(r) for r in rows], int(total or 0), limit, offset)

    async def layouts(self, name: str, limit: int, offset: int,
                      replicas_limit: int = views.SUMMARY_REPLICAS) -> dict[str, Any]:
        """A job's layout history, newest first: a summary of each version with its first
        `replicas_limit` replicas (InvalidArgument when the page could list more than
        layout_views.SUMMARY_ENTRIES_MAX). The versions of the page are read from their keyframe
        on and decoded in a worker thread."""
        self.job_rec(name)
        views.check_summary_page(limit, replicas_limit)
        where = LayoutRow.job == name
        async with self.sm() as s:
            total = int(await s.scalar(select(func.count()).select_from(LayoutRow).where(where)) or 0)
            shown = list((await s.scalars(select(LayoutRow.version).where(where).order_by(LayoutRow.version.desc())
                                          .limit(limit).offset(offset))).all())
            rows = await rows_for(s, name, min(shown), max(shown)) if shown else []
        items = await offloop.run(history, rows, set(shown), self.kernel.world.uuid_at, replicas_limit)
        return page(items, total, limit, offset)

    async def layout_version(self, name: str, version: int, limit: int = views.REPLICAS_DEFAULT,
                             offset: int = 0) -> dict[str, Any]:
        """One stored version of a job's layout, as `layout` shows the current one (a page of its
        replicas, its counts). NotFound for an unknown job or version."""
        self.job_rec(name)
        async with self.sm() as s:
            rows = await rows_for(s, name, version, version)
        if not rows or rows[-1].version != version:
            raise NotFound(f"version: job {name!r} has no layout version {version}")
        row = rows[-1]

        def read() -> dict[str, Any]:
            doc = decode_rows(rows, self.kernel.world.uuid_at)[-1]
            return views.plan_page(doc, limit, offset)

        return {"job": name, "version": row.version, "leader_epoch": row.leader_epoch,
                "created_at": iso(row.created_at), "reason": row.reason, **await offloop.run(read)}

    async def events(self, gpu: str | None, node: str | None, limit: int, offset: int) -> dict[str, Any]:
        """Health events, newest first, optionally of one GPU or node."""
        q, cq = select(HealthEventRow), select(func.count()).select_from(HealthEventRow)
        if gpu:
            q, cq = q.where(HealthEventRow.gpu_uuid == gpu), cq.where(HealthEventRow.gpu_uuid == gpu)
        if node:
            q, cq = q.where(HealthEventRow.node == node), cq.where(HealthEventRow.node == node)
        return await self._page(q.order_by(HealthEventRow.id.desc()), cq, _event_view, limit, offset)

    async def recent_events(self, n: int) -> list[dict[str, Any]]:
        async with self.sm() as s:
            rows = (await s.scalars(select(HealthEventRow).order_by(HealthEventRow.id.desc()).limit(n))).all()
        return [_event_view(r) for r in rows]

    async def audit(self, action: str | None, target: str | None, limit: int, offset: int) -> dict[str, Any]:
        q, cq = select(AuditRow), select(func.count()).select_from(AuditRow)
        if action:
            q, cq = q.where(AuditRow.action == action), cq.where(AuditRow.action == action)
        if target:
            q, cq = q.where(AuditRow.target == target), cq.where(AuditRow.target == target)
        return await self._page(
            q.order_by(AuditRow.id.desc()), cq,
            _audit_view, limit, offset)

    async def audit_record(self, audit_id: int) -> dict[str, Any]:
        async with self.sm() as s:
            r = await s.get(AuditRow, audit_id)
        if r is None:
            raise NotFound(f"no audit record {audit_id}")
        return _audit_view(r)

    def node(self, name: str) -> dict[str, Any]:
        """One node; NotFound naming it when the manager does not know it (no agent registered it)."""
        rec = self.kernel.world.nodes.get(name)
        if rec is None:
            raise NotFound(f"unknown node {name!r}: no agent has registered it")
        return _node_view(name, rec)

    async def maintenance(self, limit: int, offset: int) -> dict[str, Any]:
        return await self._page(select(MaintenanceRow).order_by(MaintenanceRow.id.desc()),
                                select(func.count()).select_from(MaintenanceRow), maintenance_view, limit, offset)


def _domains(budgets: dict[str, float | None], gpus: list[GpuRec], limit: int, offset: int) -> dict[str, Any]:
    ids = sorted(budgets)
    shown = ids[offset : offset + limit]
    members: dict[str, list[GpuRec]] = {d: [] for d in shown}
    for g in gpus:  # one pass, not one per domain
        if g.domain in members:
            members[g.domain].append(g)
    items = [{"id": did, "power_budget_w": budgets[did], "gpus": len(members[did]),
              "nodes": sorted({g.node for g in members[did]}),
              "unusable": sum(1 for g in members[did] if not GpuState(g.state).placeable)} for did in shown]
    return page(items, len(ids), limit, offset)


def _audit_view(r: AuditRow) -> dict[str, Any]:
    return {"id": r.id, "at": iso(r.at), "actor": r.actor, "action": r.action, "target": r.target,
            "before": r.before, "after": r.after, "reason": r.reason, "request_id": r.request_id}


def _node_view(n: str, rec: NodeRec) -> dict[str, Any]:
    return {"name": n, "domain": rec.domain, "gpus": list(rec.gpus), "connected": rec.connected,
            "last_seq": rec.last_seq, "drain_deadline": rec.drain_deadline.isoformat() if rec.drain_deadline else None,
            "drain_reason": rec.drain_reason}


def _nodes(nodes: list[tuple[str, NodeRec]], domain: str | None, limit: int, offset: int) -> dict[str, Any]:
    chosen = sorted(((n, rec) for n, rec in nodes if domain is None or rec.domain == domain), key=itemgetter(0))
    return page([_node_view(n, rec) for n, rec in chosen[offset : offset + limit]], len(chosen), limit, offset)


def _gpus(gpus: list[tuple[str, GpuRec]], state: GpuState | None, node: str | None, domain: str | None,
          limit: int, offset: int) -> dict[str, Any]:
    sel = sorted(((u, g) for u, g in gpus if (state is None or g.state == state) and (node is None or g.node == node)
                  and (domain is None or g.domain == domain)), key=itemgetter(0))
    return page([gpu_view(g) for _, g in sel[offset : offset + limit]], len(sel), limit, offset)


def _event_view(r: HealthEventRow) -> dict[str, Any]:
    return {"id": r.id, "at": iso(r.at), "gpu": r.gpu_uuid, "node": r.node, "seq": r.seq, "source": r.source,
            "old_state": r.old_state, "new_state": r.new_state, "reasons": r.reasons, "xids": r.xids}
