"""The manager: durable truth, the control loop, and fan-out to agents and workers.

Everything runs on one asyncio loop. State-changing work goes through `mutation()`: it takes the
manager's write lock, opens one database transaction, and runs the in-memory updates and
notifications only after that transaction has committed. So what a client was told has happened
(an ack, a 2xx, a pushed layout) is always already durable.

Control loop: a GPU state change marks the jobs that use (or could use) that GPU dirty; the loop
replans dirty jobs with the pure planner, and when a plan differs from the current layout it
persists version+1 together with its audit record, pushes the layout to every watcher of the job,
and sends changed power caps to the agents. Missed heartbeats make a node's GPUs suspect, then
failed. A circuit breaker stops automatic replanning when too many GPUs fail inside a window.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import structlog
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from ntp_manager.auth import Principal, TokenTable
from ntp_manager.clock import Clock, SystemClock
from ntp_manager.planner import JobSpec, PlanError
from ntp_manager.service import planning
from ntp_manager.service.errors import (
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from ntp_manager.service.inputs import GpuInventory, GpuReport, check_hello, check_power_readings, check_report
from ntp_manager.service.metrics import Metrics
from ntp_manager.service.state import HEALTH_STATES, GpuRec, JobRec, LayoutRec, NodeRec, World
from ntp_manager.service.tokens import Tokens
from ntp_manager.service.watchdog import LoopWatchdog
from ntp_manager.service.worker_reports import WorkerReports
from ntp_manager.settings import Settings
from ntp_manager.specfile import SpecError, job_from_dict
from ntp_manager.store import db
from ntp_manager.store.models import (
    AuditRow,
    BreakerRow,
    DomainRow,
    GpuRow,
    HealthEventRow,
    JobRow,
    LayoutRow,
    LeaderRow,
    MaintenanceRow,
    NodeRow,
)
from ntp_manager.topology import GpuState, TopologyError, base_cap_w

__all__ = ["AgentSession", "GpuInventory", "GpuReport", "Manager", "Mut"]

log = structlog.get_logger("ntp.manager")


@dataclass
class Mut:
    """What a mutation may do inside its transaction."""

    session: AsyncSession
    actor: str
    request_id: str
    after: list[Callable[[], Any]] = field(default_factory=list)

    def audit(
        self, now: datetime, action: str, target: str, before: Any = None, after: Any = None, reason: str = ""
    ) -> None:
        self.session.add(
            AuditRow(
                at=now, actor=self.actor, action=action, target=target, before=before, after=after,
                reason=reason, request_id=self.request_id,
            )
        )


@dataclass
class AgentSession:
    node: str
    outbox: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    closed: bool = False


class Manager:
    def __init__(self, settings: Settings, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        self.engine = db.make_engine(settings.effective_database_url)
        self.sm = db.sessionmaker(self.engine)
        self.metrics = Metrics()
        self.tokens = TokenTable()  # the live table (see service/tokens.py)
        self.token_service = Tokens(self)
        self.watchdog = LoopWatchdog(self.metrics.registry, warn_s=settings.loop_warn_ms / 1000)
        self.workers = WorkerReports()
        self.world = World(base_cap=settings.power_base_cap)
        self.epoch = 0
        self.lock = asyncio.Lock()
        self.sessions: dict[str, AgentSession] = {}
        self.layout_changed = asyncio.Condition()
        self.breaker_open = False
        self.breaker_reason = ""
        self._fail_window: deque[tuple[float, str]] = deque()
        self._dirty: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self.ready = False
        self._gauges_stale = True
        self._state_counts: dict[str, int] = {}

    # ---- life cycle -----------------------------------------------------------------------------
    async def start(self, migrate: bool = True) -> None:
        if self.settings.effective_database_url.startswith("sqlite"):
            self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        if migrate:
            await db.upgrade(self.engine)
        async with db.transaction(self.sm) as s:
            row = await s.get(LeaderRow, 1)
            now = self.clock.now()
            if row is None:
                row = LeaderRow(id=1, epoch=1, holder=self.settings.leader_id, since=now)
                s.add(row)
            else:
                row.epoch += 1
                row.holder = self.settings.leader_id
                row.since = now
            self.epoch = row.epoch
        await self._load()
        self._mark_all_dirty()
        self._tasks = [
            asyncio.create_task(self._control_loop(), name="control-loop"),
            asyncio.create_task(self._monitor_loop(), name="monitor"),
            asyncio.create_task(self.token_service.poll_forever(), name="token-poll"),
            asyncio.create_task(self.watchdog.run(), name="loop-watchdog"),
        ]
        if self.settings.power_base_cap is not None or any(g.desired_mw is not None for g in self.world.gpus.values()):
            self._recompute_power_later()  # the base cap may have been set, changed or removed since
        self.ready = True
        log.info("manager started", epoch=self.epoch, gpus=len(self.world.gpus), jobs=len(self.world.jobs))

    async def begin_shutdown(self) -> None:
        """Stop taking work: readiness off, agent streams and layout watches end."""
        self._stopping = True
        self.ready = False
        for sess in list(self.sessions.values()):
            sess.closed = True
            sess.outbox.put_nowait(None)
        async with self.layout_changed:
            self.layout_changed.notify_all()

    async def stop(self) -> None:
        await self.begin_shutdown()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.engine.dispose()

    async def _load(self) -> None:
        w = World(base_cap=self.settings.power_base_cap)
        now_mono = self.clock.monotonic()
        async with self.sm() as s:
            for d in (await s.scalars(select(DomainRow))).all():
                w.domains[d.id] = d.power_budget_w
            for n in (await s.scalars(select(NodeRow))).all():
                # Nodes get a full grace period after a manager start before they count as silent.
                w.nodes[n.name] = NodeRec(
                    n.name, n.domain_id, [], n.last_seq, n.boot_id, now_mono, False, n.drain_deadline, n.drain_reason
                )
            for g in (await s.scalars(select(GpuRow))).all():
                w.gpus[g.uuid] = GpuRec(
                    g.uuid, g.node, g.domain_id, g.idx, g.tdp_mw, g.min_mw, g.max_mw, g.health, g.health_reason,
                    "agent", g.admin, g.admin_owner, g.admin_reason, g.desired_mw, g.enforced_mw,
                )
                w.nodes[g.node].gpus.append(g.uuid)
            for j in (await s.scalars(select(JobRow))).all():
                w.jobs[j.name] = JobRec(j.name, job_from_dict(j.spec), j.spec)
            for job in w.jobs.values():
                row = (
                    await s.scalars(
                        select(LayoutRow).where(LayoutRow.job == job.name).order_by(LayoutRow.version.desc()).limit(1)
                    )
                ).first()
                if row is not None:
                    job.layout = LayoutRec(
                        row.job, row.version, row.leader_epoch, row.plan, row.reason, row.created_at, now_mono
                    )
            b = await s.get(BreakerRow, 1)
            if b is not None:
                self.breaker_open, self.breaker_reason = b.open, b.reason if b.open else ""
                self.metrics.breaker.set(1 if b.open else 0)
        await self.token_service.reload()
        self.world = w
        self._update_gauges()

    @property
    def layout_acks(self) -> dict[str, dict[int, dict[str, dict[str, Any]]]]:
        return self.workers.acks

    # ---- transactions ---------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def mutation(self, actor: str, request_id: str = "") -> AsyncIterator[Mut]:
        async with self.lock:
            async with self.sm() as s, s.begin():
                m = Mut(s, actor, request_id)
                yield m
            for fn in m.after:
                fn()

    # ---- tokens (service/tokens.py) ------------------------------------------------------------
    async def create_token(self, name: str, scope: str, actor: str = "cli", node: str | None = None,
                           fingerprint: str | None = None) -> str:
        return await self.token_service.create(name, scope, actor, node, fingerprint)

    async def list_tokens(self) -> list[dict[str, Any]]:
        return await self.token_service.list()

    async def revoke_token(self, public_id: str, actor: str = "cli") -> None:
        await self.token_service.revoke(public_id, actor)

    # ---- agents -------------------------------------------------------------------------------
    async def check_agent_identity(self, principal: Principal, node: str, peer_fingerprint: str | None,
                                   peer: str = "") -> None:
        """An agent token speaks for the one node it names, over the certificate it names if any.
        A mismatch is audited and raises PermissionDenied."""
        problem = None
        if principal.node is None:
            problem = "this agent token is bound to no node; create one per node (token create --node)"
        elif principal.node != node:
            problem = f"this agent token speaks for node {principal.node!r}, not {node!r}"
        elif principal.fingerprint is not None and principal.fingerprint != peer_fingerprint:
            problem = (f"this agent token needs the client certificate {principal.fingerprint[:16]}...; "
                       f"the connection presented {'none' if peer_fingerprint is None else peer_fingerprint[:16]}")
        if problem is None:
            return
        log.warning("agent identity refused", token=principal.token_id, node=node[:64], problem=problem)
        async with self.mutation(f"token:{principal.token_id}") as m:
            m.audit(self.clock.now(), "agent.denied", node[:256], reason=problem,
                    after={"token": principal.token_id, "token_node": principal.node, "peer": peer[:200],
                           "peer_fingerprint": peer_fingerprint})
        raise PermissionDenied(problem)

    async def register_agent(
        self, node: str, domain: str, gpus: list[GpuInventory], boot_id: str, agent_version: str,
        principal: Principal | None = None, peer_fingerprint: str | None = None, peer: str = "",
    ) -> tuple[AgentSession, int]:
        """Register (or re-register) a node; returns its session and the last applied report seq.

        With a `principal` (always, from the gRPC edge) the hello must come from the node its token
        names (PermissionDenied, audited, otherwise). Raises InvalidArgument for a malformed
        inventory and ResourceExhausted past `max_cluster_gpus`; nothing is written then. Every
        registration is audited (`node.register`, then `node.rehello` with what changed)."""
        check_hello(node, domain, gpus, boot_id, agent_version)
        if principal is not None:
            await self.check_agent_identity(principal, node, peer_fingerprint, peer)
        uuids = [g.uuid for g in gpus]
        for g in gpus:
            other = self.world.gpus.get(g.uuid)
            if other is not None and other.node != node:
                raise InvalidArgument(f"hello.gpus: GPU {g.uuid} is already registered on node {other.node!r}")
        known = self.world.nodes.get(node)
        if known is not None and known.domain != domain:
            raise InvalidArgument(f"hello.domain: node {node!r} is registered in domain {known.domain!r}, "
                                  f"not {domain!r}")
        adding = sum(1 for u in uuids if u not in self.world.gpus)
        if len(self.world.gpus) + adding > self.settings.max_cluster_gpus:
            raise ResourceExhausted(
                f"hello.gpus: registering {adding} more GPUs would pass max_cluster_gpus="
                f"{self.settings.max_cluster_gpus} ({len(self.world.gpus)} registered)"
            )

        now = self.clock.now()
        recovered: list[str] = []
        reshaped: list[GpuInventory] = []  # known GPUs whose index or power limits changed
        listed = set(uuids)
        absent = [u for u in (known.gpus if known else []) if u not in listed]
        newly_absent = [u for u in absent if self.world.gpus[u].health != "failed"]
        async with self.mutation(f"agent:{node}") as m:
            s = m.session
            if domain not in self.world.domains and await s.get(DomainRow, domain) is None:
                s.add(DomainRow(id=domain, power_budget_w=None, created_at=now))
            nrow = await s.get(NodeRow, node)
            if nrow is None:
                nrow = NodeRow(name=node, domain_id=domain, boot_id=boot_id, agent_version=agent_version,
                               last_seq=0, registered_at=now)
                s.add(nrow)
                await s.flush()
                m.audit(now, "node.register", node, after={"domain": domain, "gpus": uuids})
            else:
                m.audit(now, "node.rehello", node,
                        before={"boot_id": nrow.boot_id, "agent_version": nrow.agent_version},
                        after={"boot_id": boot_id, "agent_version": agent_version,
                               "token": principal.token_id if principal else None, "peer": peer[:200],
                               "added": [u for u in uuids if u not in self.world.gpus], "absent": absent})
                nrow.boot_id, nrow.agent_version = boot_id, agent_version
            new_gpus = []
            for g in gpus:
                row = await s.get(GpuRow, g.uuid) if g.uuid in self.world.gpus else None
                if row is None:
                    row = GpuRow(
                        uuid=g.uuid, node=node, domain_id=domain, idx=g.index, model=g.model,
                        memory_bytes=g.memory_bytes, tdp_mw=g.default_mw, min_mw=g.min_mw, max_mw=g.max_mw,
                        health="healthy", health_reason="registered", health_since=now,
                    )
                    s.add(row)
                    new_gpus.append(g)
                else:
                    row.idx, row.model, row.memory_bytes = g.index, g.model, g.memory_bytes
                    row.tdp_mw, row.min_mw, row.max_mw = g.default_mw, g.min_mw, g.max_mw
                    rec = self.world.gpus.get(g.uuid)
                    if rec is not None and (rec.idx, rec.tdp_mw, rec.min_mw, rec.max_mw) != (
                            g.index, g.default_mw, g.min_mw, g.max_mw):
                        reshaped.append(g)
                    # Silence (or absence from the inventory) was the only evidence against it:
                    # the agent is back with it, so is the GPU.
                    if rec is not None and rec.health_source in ("heartbeat", "inventory") and rec.health != "healthy":
                        s.add(HealthEventRow(at=now, gpu_uuid=g.uuid, node=node, seq=None, source="heartbeat",
                                             old_state=rec.health, new_state="healthy",
                                             reasons=["agent reconnected"], xids=[]))
                        row.health, row.health_reason, row.health_since = "healthy", "agent reconnected", now
                        recovered.append(g.uuid)
            gone_reason = "absent from the node's inventory at its last hello"
            for u in newly_absent:
                row = await s.get(GpuRow, u)
                if row is not None:
                    s.add(HealthEventRow(at=now, gpu_uuid=u, node=node, seq=None, source="agent",
                                         old_state=row.health, new_state="failed", reasons=[gone_reason], xids=[]))
                    row.health, row.health_reason, row.health_since = "failed", gone_reason, now
            last_seq = nrow.last_seq

            def commit_memory() -> None:
                w = self.world
                w.domains.setdefault(domain, None)
                rec_node = w.nodes.get(node)
                if rec_node is None:
                    rec_node = NodeRec(node, domain, [], last_seq)
                    w.nodes[node] = rec_node
                rec_node.boot_id = boot_id
                rec_node.last_seen = self.clock.monotonic()
                rec_node.connected = True
                for g in new_gpus:
                    w.gpus[g.uuid] = GpuRec(g.uuid, node, domain, g.index, g.default_mw, g.min_mw, g.max_mw)
                    rec_node.gpus.append(g.uuid)
                for g in reshaped:
                    r = w.gpus[g.uuid]
                    r.idx, r.tdp_mw, r.min_mw, r.max_mw = g.index, g.default_mw, g.min_mw, g.max_mw
                for u in recovered:
                    r = w.gpus[u]
                    r.health, r.health_reason, r.health_source = "healthy", "agent reconnected", "agent"
                for u in newly_absent:
                    r = w.gpus[u]
                    self._note_transition(r, "failed")
                    r.health, r.health_reason, r.health_source = "failed", gone_reason, "inventory"
                if new_gpus or reshaped:
                    w.invalidate()
                    self._mark_all_dirty()
                    if self.settings.power_base_cap is not None:
                        self._recompute_power_later()  # new GPUs start at the base cap
                if recovered or newly_absent:
                    w.apply_states(recovered + newly_absent)
                    self._mark_dirty_for(recovered + newly_absent)
                self._update_gauges()

            m.after.append(commit_memory)
            await self._stage_breaker(m, len(newly_absent))

        old = self.sessions.get(node)
        if old is not None:
            old.closed = True
            old.outbox.put_nowait(None)
        session = AgentSession(node)
        self.sessions[node] = session
        self.metrics.agents.set(sum(1 for x in self.sessions.values() if not x.closed))
        # Tell the agent every cap it should hold right now.
        for u in self.world.nodes[node].gpus:
            rec = self.world.gpus[u]
            if rec.desired_mw is not None:
                session.outbox.put_nowait(("set_power", u, rec.desired_mw, "current layout"))
        return session, last_seq

    def disconnect_agent(self, session: AgentSession) -> None:
        session.closed = True
        if self.sessions.get(session.node) is session:
            del self.sessions[session.node]
            rec = self.world.nodes.get(session.node)
            if rec is not None:
                rec.connected = False
        self.metrics.agents.set(len(self.sessions))

    def heartbeat(self, node: str) -> None:
        rec = self.world.nodes.get(node)
        if rec is not None:
            rec.last_seen = self.clock.monotonic()
            self.metrics.heartbeats.inc()

    async def apply_report(self, node: str, seq: int, gpus: list[GpuReport]) -> int:
        """Apply one health report. Returns the seq to acknowledge.

        seq <= last applied: a replay, acknowledged and ignored. seq > last + 1: a gap, rejected.
        Unknown GPUs or states, or values past the limits, reject the whole report (InvalidArgument
        naming the field). Rejections write nothing."""
        check_report(seq, gpus)
        rec = self.world.nodes.get(node)
        if rec is None:
            raise FailedPrecondition(f"node {node!r} has not registered (send hello first)")
        if seq <= rec.last_seq:
            return seq
        if seq != rec.last_seq + 1:
            raise InvalidArgument(f"bad sequence number: expected {rec.last_seq + 1}, got {seq}")
        for g in gpus:
            gr = self.world.gpus.get(g.uuid)
            if gr is None or gr.node != node:
                raise InvalidArgument(f"report.gpus: report from {node!r} names unknown GPU {g.uuid!r}")
            if g.state not in HEALTH_STATES:
                raise InvalidArgument(
                    f"report.gpus.state: GPU {g.uuid}: agents may report {sorted(HEALTH_STATES)}, not {g.state!r}"
                )
        if len({g.uuid for g in gpus}) != len(gpus):
            raise InvalidArgument("report.gpus: a report names the same GPU twice")

        now = self.clock.now()
        changed: list[str] = []
        async with self.mutation(f"agent:{node}") as m:
            s = m.session
            nrow = await s.get(NodeRow, node)
            assert nrow is not None
            if seq <= nrow.last_seq:  # raced with a replay on another stream
                return seq
            nrow.last_seq = seq
            for g in gpus:
                gr = self.world.gpus[g.uuid]
                s.add(HealthEventRow(at=now, gpu_uuid=g.uuid, node=node, seq=seq, source="agent",
                                     old_state=gr.health, new_state=g.state, reasons=g.reasons, xids=g.xids))
                row = await s.get(GpuRow, g.uuid)
                assert row is not None
                if g.enforced_mw is not None:
                    row.enforced_mw = g.enforced_mw
                if g.state != gr.health:
                    row.health, row.health_reason, row.health_since = g.state, "; ".join(g.reasons), now
                    changed.append(g.uuid)
            newly_failed = sum(1 for g in gpus if g.state == "failed" and self.world.gpus[g.uuid].health != "failed")

            def commit_memory() -> None:
                rec.last_seq = seq
                rec.last_seen = self.clock.monotonic()
                for g in gpus:
                    gr = self.world.gpus[g.uuid]
                    if g.enforced_mw is not None:
                        gr.enforced_mw = g.enforced_mw
                    if g.state != gr.health:
                        self._note_transition(gr, g.state)
                        gr.health, gr.health_reason, gr.health_source = g.state, "; ".join(g.reasons), "agent"
                self._after_state_change(changed)

            m.after.append(commit_memory)
            await self._stage_breaker(m, newly_failed)
        self.metrics.reports.inc()
        return seq

    async def record_power_result(self, node: str, readings: list[tuple[str, int]]) -> None:
        check_power_readings(readings)
        known = [(u, mw) for u, mw in readings if u in self.world.gpus and self.world.gpus[u].node == node]
        if not known:
            return
        async with self.mutation(f"agent:{node}") as m:
            for u, mw in known:
                row = await m.session.get(GpuRow, u)
                if row is not None:
                    row.enforced_mw = mw

            def commit_memory() -> None:
                for u, mw in known:
                    self.world.gpus[u].enforced_mw = mw

            m.after.append(commit_memory)

    # ---- state changes ------------------------------------------------------------------------
    def _note_transition(self, gr: GpuRec, new_health: str) -> None:
        if new_health == "failed" and gr.health != "failed":
            self._fail_window.append((self.clock.monotonic(), gr.uuid))

    def _after_state_change(self, uuids: list[str]) -> None:
        if not uuids:
            return
        self.world.apply_states(uuids)
        self._mark_dirty_for(uuids)
        self._update_gauges()

    def _mark_dirty_for(self, uuids: list[str]) -> None:
        domains = {self.world.gpus[u].domain for u in uuids}
        for job in self.world.jobs.values():
            if not job.spec.domains or domains.intersection(job.spec.domains):
                self._dirty.add(job.name)
        self._wake.set()

    def _mark_all_dirty(self) -> None:
        self._dirty.update(self.world.jobs)
        self._wake.set()

    def _breaker_verdict(self, more_failures: int) -> str | None:
        """Why the breaker opens if `more_failures` GPUs fail now; None when it stays shut."""
        if self.breaker_open or more_failures <= 0:
            return None
        horizon = self.clock.monotonic() - self.settings.breaker_window_s
        while self._fail_window and self._fail_window[0][0] < horizon:
            self._fail_window.popleft()
        total = max(1, len(self.world.gpus))
        limit = max(self.settings.breaker_min_gpus, self.settings.breaker_share * total)
        n = len(self._fail_window) + more_failures
        if n <= limit:
            return None
        return (f"{n} GPUs failed within {self.settings.breaker_window_s:g}s (limit {limit:g} of {total}): "
                "a systemic fault is likely; automatic replanning stopped")

    async def _stage_breaker(self, m: Mut, more_failures: int) -> None:
        """Open the breaker in the same transaction as the failures that trip it, so its state and
        reason are durable exactly when those failures are (they survive any restart)."""
        reason = self._breaker_verdict(more_failures)
        if reason is None:
            return
        now = self.clock.now()
        row = await m.session.get(BreakerRow, 1)
        if row is None:
            m.session.add(BreakerRow(id=1, open=True, reason=reason, changed_at=now))
        else:
            row.open, row.reason, row.changed_at = True, reason, now
        m.audit(now, "breaker.open", "breaker", reason=reason)

        def commit_memory() -> None:
            self.breaker_open, self.breaker_reason = True, reason
            self.metrics.breaker.set(1)
            log.warning("circuit breaker open", reason=reason)

        m.after.append(commit_memory)

    async def reset_breaker(self, m: Mut, reason: str) -> dict[str, Any]:
        was = self.breaker_open
        now = self.clock.now()
        row = await m.session.get(BreakerRow, 1)
        if row is None:
            m.session.add(BreakerRow(id=1, open=False, reason=reason, changed_at=now))
        else:
            row.open, row.reason, row.changed_at = False, reason, now
        m.audit(now, "breaker.reset", "breaker", before={"open": was}, after={"open": False}, reason=reason)

        def commit_memory() -> None:
            self.breaker_open, self.breaker_reason = False, ""
            self._fail_window.clear()
            self.metrics.breaker.set(0)
            self._mark_all_dirty()

        m.after.append(commit_memory)
        return {"open": False, "was_open": was}

    # ---- operator actions on GPUs and nodes ---------------------------------------------------
    def _gpu(self, uuid: str) -> GpuRec:
        rec = self.world.gpus.get(uuid)
        if rec is None:
            raise NotFound(f"unknown GPU {uuid!r}")
        return rec

    async def set_admin(self, m: Mut, uuids: list[str], admin: str | None, reason: str,
                        only_if: str | None = None, action: str = "") -> list[str]:
        """Set (or clear, admin=None) the operator state of GPUs; returns those changed."""
        now = self.clock.now()
        changed = []
        for u in uuids:
            rec = self._gpu(u)
            if only_if is not None and rec.admin != only_if:
                continue
            if rec.admin == admin and (admin is None or rec.admin_reason == reason):
                continue
            row = await m.session.get(GpuRow, u)
            assert row is not None
            before = {"state": rec.state, "admin": rec.admin, "owner": rec.admin_owner, "reason": rec.admin_reason}
            row.admin = admin
            row.admin_owner = m.actor if admin else None
            row.admin_reason = reason if admin else None
            m.audit(now, action or f"gpu.{admin or 'clear'}", u, before=before,
                    after={"admin": admin, "owner": row.admin_owner, "reason": row.admin_reason}, reason=reason)
            changed.append(u)

        def commit_memory() -> None:
            for u in changed:
                rec = self.world.gpus[u]
                rec.admin = admin
                rec.admin_owner = m.actor if admin else None
                rec.admin_reason = reason if admin else None
            self._after_state_change(changed)

        m.after.append(commit_memory)
        return changed

    async def cordon(self, m: Mut, uuid: str, reason: str) -> dict[str, Any]:
        rec = self._gpu(uuid)
        if rec.admin not in (None, "cordoned"):
            raise FailedPrecondition(f"GPU {uuid} is {rec.admin}; clear that first")
        await self.set_admin(m, [uuid], "cordoned", reason, action="gpu.cordon")
        return self.gpu_view(uuid, override_admin="cordoned", owner=m.actor, reason=reason)

    async def uncordon(self, m: Mut, uuid: str, reason: str) -> dict[str, Any]:
        rec = self._gpu(uuid)
        if rec.admin != "cordoned":
            raise FailedPrecondition(f"GPU {uuid} is not cordoned (state {rec.state})")
        await self.set_admin(m, [uuid], None, reason, only_if="cordoned", action="gpu.uncordon")
        return self.gpu_view(uuid, override_admin=None)

    async def mark_healthy(self, m: Mut, uuid: str, reason: str) -> dict[str, Any]:
        rec = self._gpu(uuid)
        now = self.clock.now()
        before = rec.health
        if before != "healthy":
            row = await m.session.get(GpuRow, uuid)
            assert row is not None
            row.health, row.health_reason, row.health_since = "healthy", f"marked healthy: {reason}", now
            m.session.add(HealthEventRow(at=now, gpu_uuid=uuid, node=rec.node, seq=None, source="operator",
                                         old_state=before, new_state="healthy", reasons=[reason], xids=[]))
        m.audit(now, "gpu.mark_healthy", uuid, before={"health": before}, after={"health": "healthy"}, reason=reason)

        def commit_memory() -> None:
            if before != "healthy":
                rec.health, rec.health_reason, rec.health_source = "healthy", f"marked healthy: {reason}", "operator"
                self._after_state_change([uuid])

        m.after.append(commit_memory)
        out = self.gpu_view(uuid)
        out["health"] = "healthy"
        out["state"] = rec.admin or "healthy"
        return out

    async def drain_node(self, m: Mut, node: str, deadline: datetime, reason: str) -> dict[str, Any]:
        rec = self.world.nodes.get(node)
        if rec is None:
            raise NotFound(f"unknown node {node!r}")
        now = self.clock.now()
        if deadline <= now:
            raise InvalidArgument("drain deadline must be in the future")
        row = await m.session.get(NodeRow, node)
        assert row is not None
        row.drain_deadline, row.drain_reason = deadline, reason
        busy = [u for u in rec.gpus if self.world.gpus[u].admin not in ("cordoned", "maintenance")]
        await self.set_admin(m, busy, "draining", reason, action="gpu.drain")
        m.audit(now, "node.drain", node, after={"deadline": deadline.isoformat()}, reason=reason)

        def commit_memory() -> None:
            rec.drain_deadline, rec.drain_reason = deadline, reason
            sess = self.sessions.get(node)
            if sess is not None:
                sess.outbox.put_nowait(("drain", deadline, reason))

        m.after.append(commit_memory)
        return {"node": node, "drain_deadline": deadline.isoformat(), "reason": reason, "gpus": busy}

    async def undrain_node(self, m: Mut, node: str, reason: str) -> dict[str, Any]:
        rec = self.world.nodes.get(node)
        if rec is None:
            raise NotFound(f"unknown node {node!r}")
        row = await m.session.get(NodeRow, node)
        assert row is not None
        row.drain_deadline, row.drain_reason = None, None
        cleared = await self.set_admin(m, list(rec.gpus), None, reason, only_if="draining", action="gpu.undrain")
        cleared += await self.set_admin(m, list(rec.gpus), None, reason, only_if="maintenance",
                                        action="gpu.undrain")
        m.audit(self.clock.now(), "node.undrain", node, reason=reason)

        def commit_memory() -> None:
            rec.drain_deadline, rec.drain_reason = None, None

        m.after.append(commit_memory)
        return {"node": node, "cleared": cleared}

    async def add_maintenance(
        self, m: Mut, kind: str, target: str, starts: datetime, ends: datetime, reason: str
    ) -> dict[str, Any]:
        if kind not in ("gpu", "node", "domain"):
            raise InvalidArgument("target_kind must be gpu, node or domain")
        self._targets(kind, target)
        if ends <= starts:
            raise InvalidArgument("a maintenance window must end after it starts")
        row = MaintenanceRow(target_kind=kind, target=target, starts_at=starts, ends_at=ends, reason=reason,
                             owner=m.actor, cancelled=False)
        m.session.add(row)
        await m.session.flush()
        m.audit(self.clock.now(), "maintenance.create", f"{kind}:{target}",
                after={"id": row.id, "starts_at": starts.isoformat(), "ends_at": ends.isoformat()}, reason=reason)
        m.after.append(self._wake.set)
        return _maint_view(row)

    async def cancel_maintenance(self, m: Mut, window_id: int) -> dict[str, Any]:
        row = await m.session.get(MaintenanceRow, window_id)
        if row is None or row.cancelled:
            raise NotFound(f"no active maintenance window {window_id}")
        row.cancelled = True
        uuids = self._targets(row.target_kind, row.target)
        await self.set_admin(m, uuids, None, f"maintenance {window_id} cancelled", only_if="maintenance",
                             action="gpu.maintenance_end")
        m.audit(self.clock.now(), "maintenance.cancel", f"{row.target_kind}:{row.target}", before={"id": row.id})
        return _maint_view(row)

    def _targets(self, kind: str, target: str) -> list[str]:
        w = self.world
        if kind == "gpu":
            self._gpu(target)
            return [target]
        if kind == "node":
            if target not in w.nodes:
                raise NotFound(f"unknown node {target!r}")
            return list(w.nodes[target].gpus)
        if target not in w.domains:
            raise NotFound(f"unknown domain {target!r}")
        return [u for u, g in w.gpus.items() if g.domain == target]

    async def _apply_maintenance(self) -> None:
        now = self.clock.now()
        async with self.sm() as s:
            rows = (await s.scalars(select(MaintenanceRow).where(MaintenanceRow.cancelled.is_(False)))).all()
        for row in rows:
            try:
                uuids = self._targets(row.target_kind, row.target)
            except NotFound:
                continue
            starts, ends = _aware(row.starts_at), _aware(row.ends_at)
            if starts <= now < ends:
                todo = [u for u in uuids if self.world.gpus[u].admin is None]
                if todo:
                    async with self.mutation(f"maintenance:{row.id}") as m:
                        await self.set_admin(m, todo, "maintenance", row.reason or f"window {row.id}",
                                             action="gpu.maintenance_start")
            elif now >= ends:
                todo = [u for u in uuids if self.world.gpus[u].admin == "maintenance"]
                async with self.mutation(f"maintenance:{row.id}") as m:
                    if todo:
                        await self.set_admin(m, todo, None, f"window {row.id} ended", only_if="maintenance",
                                             action="gpu.maintenance_end")
                    r = await m.session.get(MaintenanceRow, row.id)
                    if r is not None:
                        r.cancelled = True

    async def _apply_drain_deadlines(self) -> None:
        now = self.clock.now()
        for node in list(self.world.nodes.values()):
            if node.drain_deadline is not None and _aware(node.drain_deadline) <= now:
                todo = [u for u in node.gpus if self.world.gpus[u].admin == "draining"]
                async with self.mutation("drain-deadline") as m:
                    await self.set_admin(m, todo, "maintenance", f"drain deadline passed: {node.drain_reason}",
                                         only_if="draining", action="gpu.drain_done")
                    row = await m.session.get(NodeRow, node.name)
                    if row is not None:
                        row.drain_deadline = None
                    m.audit(now, "node.drain_done", node.name, reason=node.drain_reason or "")
                    rec = node

                    def clear(rec: NodeRec = rec) -> None:
                        rec.drain_deadline = None

                    m.after.append(clear)

    # ---- jobs and plans -----------------------------------------------------------------------
    def parse_job(self, spec: dict[str, Any]) -> JobSpec:
        """A job spec, checked (InvalidArgument naming the field) and bounded by `max_cluster_gpus`."""
        try:
            job = job_from_dict(spec, "job")
        except SpecError as e:
            raise InvalidArgument(str(e)) from None
        asked = (job.replicas + job.spares) * job.groups_per_replica * job.tp
        if asked > self.settings.max_cluster_gpus:
            raise InvalidArgument(
                f"job: (replicas + spares) x groups_per_replica x tp = {asked:,} GPUs; this manager's "
                f"cluster holds at most {self.settings.max_cluster_gpus:,} (max_cluster_gpus)"
            )
        return job

    async def create_job(self, m: Mut, spec: dict[str, Any]) -> dict[str, Any]:
        job = self.parse_job(spec)
        if job.name in self.world.jobs or await m.session.get(JobRow, job.name) is not None:
            raise Conflict(f"job {job.name!r} already exists")
        now = self.clock.now()
        m.session.add(JobRow(name=job.name, spec=spec, created_at=now, created_by=m.actor))
        m.audit(now, "job.create", job.name, after=spec)

        def commit_memory() -> None:
            self.world.jobs[job.name] = JobRec(job.name, job, spec)
            self._dirty.add(job.name)
            self._wake.set()

        m.after.append(commit_memory)
        return {"name": job.name, "spec": spec, "created_at": now.isoformat()}

    async def delete_job(self, m: Mut, name: str) -> dict[str, Any]:
        rec = self.world.jobs.get(name)
        if rec is None:
            raise NotFound(f"unknown job {name!r}")
        row = await m.session.get(JobRow, name)
        assert row is not None
        await m.session.delete(row)
        m.audit(self.clock.now(), "job.delete", name, before=rec.raw)

        def commit_memory() -> None:
            self.world.jobs.pop(name, None)
            self.workers.forget(name)
            self._dirty.discard(name)
            self._recompute_power_later()

        m.after.append(commit_memory)
        return {"name": name, "deleted": True}

    async def dry_run(self, spec: JobSpec, fail: list[str]) -> dict[str, Any]:
        """The plan `spec` would get now, with the GPUs in `fail` failed; planned off the loop."""
        for u in fail:
            if u not in self.world.gpus:
                raise NotFound(f"fail: unknown GPU {u[:200]!r}")
        cluster = await self.world.cluster_async()
        try:
            d = await asyncio.to_thread(planning.draft, cluster, spec, tuple(fail))
        except PlanError as e:
            raise InvalidArgument(str(e)) from None
        except TopologyError as e:  # a GPU in `fail` registered after the snapshot was taken
            raise NotFound(f"fail: {e}") from None
        return d.doc

    async def _control_loop(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            if self.breaker_open:
                continue
            while self._dirty and not self.breaker_open:
                name = min(self._dirty)
                self._dirty.discard(name)
                try:
                    await self.replan(name, actor="control-loop")
                except Exception:  # keep the loop alive; the error is logged with its job
                    log.exception("replan failed", job=name)

    async def replan(self, name: str, actor: str, reason: str = "", m: Mut | None = None) -> LayoutRec | None:
        """Replan one job; persist and push a new version when the plan changed."""
        job = self.world.jobs.get(name)
        if job is None:
            return None
        t0 = time.perf_counter()
        try:
            # off the event loop: snapshot build, planning, document, fingerprint, JSON text
            previous = job.layout.plan if job.layout is not None else None
            d = await asyncio.to_thread(planning.draft, await self.world.cluster_async(), job.spec, (), previous)
        except PlanError as e:
            job.pending_reason = str(e)
            return None
        finally:
            self.metrics.plan_seconds.observe(time.perf_counter() - t0)
        if self.world.jobs.get(name) is not job:
            return None  # deleted or replaced while planning
        job.pending_reason = None
        doc, fp = d.doc, d.fingerprint
        if job.layout is not None:
            if not job.layout.fingerprint:
                job.layout.fingerprint = await asyncio.to_thread(planning.fingerprint, job.layout.plan)
            if job.layout.fingerprint == fp:
                return job.layout
        why = _why(job.layout.plan if job.layout else None, doc, reason)

        async def persist(mm: Mut) -> LayoutRec:
            now = self.clock.now()
            version = (job.layout.version if job.layout else 0) + 1
            mm.session.add(LayoutRow(job=name, version=version, leader_epoch=self.epoch, plan=doc, reason=why,
                                     created_at=now))
            mm.audit(now, "layout.update", name, before={"version": version - 1} if version > 1 else None,
                     after={"version": version, **d.summary}, reason=why)
            rec = LayoutRec(name, version, self.epoch, doc, why, now, self.clock.monotonic(), fp)
            power = await self._stage_power(mm)

            def commit_memory() -> None:
                job.layout = rec
                self._publish(rec)
                self._send_power(power)
                self._update_gauges()

            mm.after.append(commit_memory)
            return rec

        if m is not None:
            return await persist(m)
        async with self.mutation(actor) as mm:
            return await persist(mm)

    async def _stage_power(self, m: Mut) -> list[tuple[str, int | None]]:
        """Persist changed desired caps; return (uuid, mW or None=release) to send after commit."""
        # The layout being persisted is not in memory yet; read it from the session's pending rows.
        pending = {r.job: r.plan for r in m.session.new if isinstance(r, LayoutRow)}
        caps: dict[str, int] = {}
        for job in self.world.jobs.values():
            plan = pending.get(job.name) or (job.layout.plan if job.layout else None)
            if plan:
                for u, w in plan.get("power_caps_w", {}).items():
                    caps[u] = int(w * 1000)
        changes: list[tuple[str, int | None]] = []
        base = self.settings.power_base_cap
        for u, rec in self.world.gpus.items():
            want = caps.get(u)
            if want is None and base is not None:  # under a fleet base cap every other GPU runs at its base
                want = int(base_cap_w(rec.min_mw, rec.tdp_mw, rec.max_mw, base))
            if want != rec.desired_mw:
                row = await m.session.get(GpuRow, u)
                if row is not None:
                    row.desired_mw = want
                changes.append((u, want))

        def commit_memory() -> None:
            for u, want in changes:
                self.world.gpus[u].desired_mw = want

        m.after.append(commit_memory)
        return changes

    def _send_power(self, changes: list[tuple[str, int | None]]) -> None:
        for u, want in changes:
            sess = self.sessions.get(self.world.gpus[u].node)
            if sess is None:
                continue  # sent on reconnect
            if want is None:
                sess.outbox.put_nowait(("release_power", u))
            else:
                sess.outbox.put_nowait(("set_power", u, want, "layout power cap"))

    def _recompute_power_later(self) -> None:
        async def run() -> None:
            async with self.mutation("control-loop") as m:
                changes = await self._stage_power(m)
                m.after.append(lambda: self._send_power(changes))

        asyncio.get_running_loop().create_task(run())

    def _publish(self, rec: LayoutRec) -> None:
        self.wake_watchers()

    def wake_watchers(self) -> None:
        """Make every `wait_layout` look again (a new layout, or a watcher told to stop)."""
        async def notify() -> None:
            async with self.layout_changed:
                self.layout_changed.notify_all()

        asyncio.get_running_loop().create_task(notify())

    async def wait_layout(self, job: str, newer_than: tuple[int, int],
                          stop: Callable[[], bool] | None = None) -> LayoutRec | None:
        """Block until `job` has a layout with (epoch, version) > newer_than; None when stopping
        or when `stop()` says so (checked whenever the watchers are woken)."""
        async with self.layout_changed:
            while not self._stopping and not (stop is not None and stop()):
                rec = self.world.jobs.get(job)
                if rec is None:
                    raise NotFound(f"unknown job {job!r}")
                lay = rec.layout
                if lay is not None and (lay.leader_epoch, lay.version) > newer_than:
                    return lay
                await self.layout_changed.wait()
        return None

    def ack_layout(self, job: str, worker: str, epoch: int, version: int, ok: bool) -> LayoutRec:
        """Record a worker's ack of layout (epoch, version); see service/worker_reports.py."""
        self.workers.check_ids(job, worker)
        rec = self.world.jobs.get(job)
        if rec is None:
            raise NotFound(f"job: unknown job {job!r}")
        lay = rec.layout
        if lay is None:
            raise InvalidArgument(f"stamp: job {job!r} has no layout yet")
        # acks of the newest versions, in memory only (operators see who has applied what)
        self.workers.record_ack(job, lay, worker, epoch, version, ok, self.clock.now().isoformat())
        if ok and version == lay.version:
            self.metrics.ack_seconds.observe(max(0.0, self.clock.monotonic() - lay.created_mono))
        log.info("layout ack", job=job, worker=worker, version=version, ok=ok)
        return lay

    # ---- heartbeat monitor ----------------------------------------------------------------------
    async def _monitor_loop(self) -> None:
        period = min(1.0, self.settings.heartbeat_interval_s / 2)
        while not self._stopping:
            await asyncio.sleep(period)
            try:
                await self.refresh_gauges_async()
                await self.check_heartbeats()
                await self._apply_maintenance()
                await self._apply_drain_deadlines()
            except Exception:
                log.exception("monitor pass failed")

    async def check_heartbeats(self) -> None:
        now_mono = self.clock.monotonic()
        to_suspect: list[tuple[str, float]] = []
        to_fail: list[tuple[str, float]] = []
        for node in self.world.nodes.values():
            silent = now_mono - node.last_seen
            if silent <= self.settings.suspect_after_s:
                continue
            for u in node.gpus:
                g = self.world.gpus[u]
                if silent > self.settings.fail_after_s and g.health in ("healthy", "suspect", "degraded"):
                    to_fail.append((u, silent))
                elif g.health == "healthy" and silent <= self.settings.fail_after_s:
                    to_suspect.append((u, silent))
        if not to_suspect and not to_fail:
            return
        now = self.clock.now()
        changes = [(u, "suspect", s) for u, s in to_suspect] + [(u, "failed", s) for u, s in to_fail]
        async with self.mutation("heartbeat-monitor") as m:
            for u, new, silent in changes:
                g = self.world.gpus[u]
                reason = f"no heartbeat from {g.node} for {silent:.1f}s"
                row = await m.session.get(GpuRow, u)
                assert row is not None
                row.health, row.health_reason, row.health_since = new, reason, now
                m.session.add(HealthEventRow(at=now, gpu_uuid=u, node=g.node, seq=None, source="heartbeat",
                                             old_state=g.health, new_state=new, reasons=[reason], xids=[]))

            def commit_memory() -> None:
                for u, new, silent in changes:
                    g = self.world.gpus[u]
                    self._note_transition(g, new)
                    g.health, g.health_source = new, "heartbeat"
                    g.health_reason = f"no heartbeat from {g.node} for {silent:.1f}s"
                self._after_state_change([u for u, _, _ in changes])

            m.after.append(commit_memory)
            await self._stage_breaker(m, len(to_fail))

    # ---- views -------------------------------------------------------------------------------
    async def gpu_state_counts(self) -> dict[str, int]:
        """GPUs per effective state (states with none left out), recounted only after a change."""
        await self.refresh_gauges_async()
        return {k: v for k, v in self._state_counts.items() if v}

    def gpu_view(self, uuid: str, override_admin: Any = ..., owner: str | None = None,
                 reason: str | None = None) -> dict[str, Any]:
        g = self._gpu(uuid)
        admin = g.admin if override_admin is ... else override_admin
        return {
            "uuid": g.uuid, "node": g.node, "domain": g.domain, "index": g.idx,
            "state": admin or g.health, "health": g.health, "health_reason": g.health_reason,
            "admin": admin,
            "admin_owner": (owner if override_admin is not ... else g.admin_owner) if admin else None,
            "admin_reason": (reason if override_admin is not ... else g.admin_reason) if admin else None,
            "tdp_w": g.tdp_mw / 1000, "min_w": g.min_mw / 1000, "max_w": g.max_mw / 1000,
            "desired_w": None if g.desired_mw is None else g.desired_mw / 1000,
            "enforced_w": None if g.enforced_mw is None else g.enforced_mw / 1000,
        }

    def _update_gauges(self) -> None:
        """Mark the gauges stale; they are recomputed at most once per monitor tick and on scrape."""
        self._gauges_stale = True

    async def refresh_gauges_async(self) -> None:
        """`refresh_gauges` with the O(GPUs) count in a worker thread (over a copy of the record
        list; a state that changes meanwhile marks the gauges stale again)."""
        if not self._gauges_stale:
            return
        self._gauges_stale = False
        counts = await asyncio.to_thread(_count_states, list(self.world.gpus.values()))
        self._set_gauges(counts)

    def refresh_gauges(self) -> None:
        if not self._gauges_stale:
            return
        self._gauges_stale = False
        self._set_gauges(_count_states(list(self.world.gpus.values())))

    def _set_gauges(self, counts: dict[str, int]) -> None:
        self._state_counts = counts
        for state, n in counts.items():
            self.metrics.gpus.labels(state).set(n)
        for job in self.world.jobs.values():
            lay = job.layout
            if lay is None:
                continue
            reps = lay.plan["replicas"]
            self.metrics.replicas.labels(job.name).set(len(reps))
            self.metrics.throughput.labels(job.name).set(lay.plan["relative_throughput"])
            self.metrics.layout_version.labels(job.name).set(lay.version)
            by_tp: dict[int, int] = {}
            for r in reps:
                by_tp[r["tp"]] = by_tp.get(r["tp"], 0) + 1
            for tp, n in by_tp.items():
                self.metrics.replicas_by_tp.labels(job.name, str(tp)).set(n)


def _count_states(gpus: list[GpuRec]) -> dict[str, int]:
    counts: dict[str, int] = dict.fromkeys([s.value for s in GpuState], 0)
    for g in gpus:
        counts[g.state] = counts.get(g.state, 0) + 1
    return counts


def _why(old: dict[str, Any] | None, new: dict[str, Any], given: str = "") -> str:
    """A layout's reason: `given` (an operator's) or what changed, then what moved."""
    if given:
        why = given
    elif old is None:
        why = f"initial layout: {len(new['replicas'])} replicas, throughput {new['relative_throughput']:.4f}"
    else:
        old_tp = sorted(r["tp"] for r in old["replicas"])
        new_tp = sorted(r["tp"] for r in new["replicas"])
        why = (
            f"replanned: replicas {len(old['replicas'])} -> {len(new['replicas'])}, TP degrees {old_tp} -> "
            f"{new_tp}, throughput {old['relative_throughput']:.4f} -> {new['relative_throughput']:.4f}"
        )
    moves = planning.moves_text(new.get("moves"))
    return f"{why}; moves: {moves}" if moves else why


def _aware(t: datetime) -> datetime:
    from datetime import UTC

    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def _maint_view(row: MaintenanceRow) -> dict[str, Any]:
    return {
        "id": row.id, "target_kind": row.target_kind, "target": row.target,
        "starts_at": _aware(row.starts_at).isoformat(), "ends_at": _aware(row.ends_at).isoformat(),
        "reason": row.reason, "owner": row.owner, "cancelled": row.cancelled,
    }

