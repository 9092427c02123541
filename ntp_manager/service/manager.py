"""The manager: composes the kernel and the components, runs their loops, and is what the edges
(REST, gRPC, CLI) call.

Owns nothing of its own but the life cycle (start: migrate, then lead or stand by; leading: take the
lease and its epoch, load the world, give agents `takeover_grace_s` to reconnect, replan every job;
stop: stop taking work, commit what is queued, give the lease up, close the store). Who leads is
service/leadership/leader.py's: with PostgreSQL several managers run and one leads; every one takes
agents and watches (as one manager alone on SQLite does: one design, service/leadership/fleet.py),
and a standby keeps its world current from the leader's log (service/leadership/follow.py). Everything else lives in one
component each, around the kernel (service/core/kernel.py: the world, its lock, the transaction, the
dirty set):

    leader.py       the lease, the epoch and the fence    tokens.py       API tokens and the live table
    agents.py       agent sessions, hellos, reports       fleet.py        agent streams, watches, outbox
    operators.py    cordon, drain, mark-healthy           maintenance.py  windows and drain deadlines
    jobs.py         jobs, replanning, layout watchers     liveness.py     silence -> suspect -> failed
    ownership.py    who owns each domain, admission       sharing.py      the pool: grants, preemption
    failslow.py     fail-slow detectors, their verdicts   telemetry.py    agents' GPU counters
    power.py        desired caps and sending them         breaker.py      the circuit breaker
    gauges.py       Prometheus gauges of the world        worker_reports.py  acks and step reports
    policy.py       the pure decisions (tested like functions, with made-up times)
    slurm.py        drains and resumes Slurm nodes (off unless `slurm_drain`; slurm_policy.py decides)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import structlog

from ntp_manager.auth import Principal, TokenTable
from ntp_manager.clock import Clock, SystemClock
from ntp_manager.planner import JobSpec
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.core import offloop
from ntp_manager.service.core.idempotency import Outcome, idempotent
from ntp_manager.service.core.inputs import GpuInventory, GpuReport
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.metrics import Metrics
from ntp_manager.service.core.state import LayoutRec, World
from ntp_manager.service.core.steps import StepWindow
from ntp_manager.service.core.tasks import cancel_all
from ntp_manager.service.ingest.agents import Agents, AgentSession
from ntp_manager.service.ingest.doors import AgentDoor, FleetAgents, FleetWatches, WatchDoor
from ntp_manager.service.ingest.hello_view import reader_engine
from ntp_manager.service.ingest.liveness import Liveness
from ntp_manager.service.ingest.outbox import Ingest, StoreHelloView, WorldHelloView
from ntp_manager.service.ingest.port import MemoryOutbox, OutboxPort
from ntp_manager.service.ingest.telemetry import TelemetryStore
from ntp_manager.service.ingest.worker_reports import WorkerReports
from ntp_manager.service.leadership.fleet import Fleet
from ntp_manager.service.leadership.follow import Follower
from ntp_manager.service.leadership.leader import Leadership
from ntp_manager.service.leadership.loading import read_world
from ntp_manager.service.leadership.shared import SharedStore
from ntp_manager.service.operations.gauges import Gauges
from ntp_manager.service.operations.maintenance import Maintenance
from ntp_manager.service.operations.operators import Operators
from ntp_manager.service.operations.queries import Queries, gpu_view
from ntp_manager.service.operations.slurm import SlurmSync
from ntp_manager.service.operations.tokens import Tokens
from ntp_manager.service.operations.watchdog import LoopWatchdog
from ntp_manager.service.planning.breaker import Breaker
from ntp_manager.service.planning.checkpoints import Checkpoints
from ntp_manager.service.planning.failslow import FailSlow
from ntp_manager.service.planning.jobs import Jobs
from ntp_manager.service.planning.power import Power
from ntp_manager.service.planning.restores import RestoreReport, Restores
from ntp_manager.service.planning.sharing import Sharing
from ntp_manager.settings import Settings
from ntp_manager.store import db

__all__ = ["AgentSession", "GpuInventory", "GpuReport", "Manager", "Mut"]

log = structlog.get_logger("ntp.manager")

Mut = Tx  # what a mutation may do inside its transaction (the name the edges know)


class Manager:
    def __init__(self, settings: Settings, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        self.engine = db.make_engine(settings.effective_database_url, db.application_name(settings.leader_id),
                                     settings.lease_ttl_s)
        self.sm = db.sessionmaker(self.engine)
        self.kernel = Kernel(self.sm, self.clock, World(base_cap=settings.power_base_cap),
                             window_s=settings.group_commit_window_ms / 1000)
        self.workers = WorkerReports()
        self.telemetry = TelemetryStore()  # agents' GPU counters, latest per GPU (issue 21)
        self.metrics = Metrics(self._step_windows, lambda: (self.kernel.batches, self.kernel.batched))
        self.tokens = TokenTable()  # the live table (see service/operations/tokens.py)
        self.token_service = Tokens(self.sm, self.clock, self.tokens, self.mutation, settings.token_poll_s)
        self.watchdog = LoopWatchdog(self.metrics.registry, warn_s=settings.loop_warn_ms / 1000)
        self.epoch = 0
        self.leadership = Leadership(settings, self.engine)
        self.breaker = Breaker(self.kernel, settings, self.metrics)
        self.agents = Agents(self.kernel, settings, self.metrics)
        self.power = Power(self.kernel, settings, self.agents)
        self.ops = Operators(self.kernel, self.agents)
        self.maintenance = Maintenance(self.kernel, self.ops)
        self.liveness = Liveness(self.kernel, settings)
        self.agents.seen_earlier = lambda node: self.liveness.watch.touched((node,))
        self.gauges = Gauges(self.kernel, self.metrics)
        self.jobs = Jobs(self.kernel, settings, self.metrics, self.power, self.workers, lambda: self.epoch,
                         lambda: self.breaker.open)
        self.jobs.on_layout.append(self.gauges.mark_stale)
        self.restores = Restores(self.kernel, self.metrics)
        self.checkpoints = Checkpoints(self.kernel)
        self.jobs.known_checkpoint = self.checkpoints.newest_verified
        self.failslow = FailSlow(self.kernel, self.telemetry)
        self.queries = Queries(self.kernel, self.sm, self.workers, self.telemetry, self.restores)
        self.sharing = Sharing(self.jobs, lambda: self.acting)  # many jobs (issue 41): pool, grants, views
        self.slurm = SlurmSync(self.kernel, settings, lambda: self.breaker.open, self._rest_address)
        self.ready = False
        self._tasks: list[asyncio.Task[None]] = []
        self._standby: asyncio.Task[None] | None = None
        self._loaded = False  # the world is loaded (once leading)
        # one design on both stores (service/leadership/fleet.py); the outbox port and the hellos' view
        # are the store's, and what only shared PostgreSQL needs is service/leadership/shared.py
        s = settings
        window = s.group_commit_window_ms / 1000
        port: OutboxPort = (Ingest(self.sm, s.leader_id, self.clock, window, s.fleet_store_timeout_s, self.engine,
                                   s.fleet_apply_window_ms / 1000)
                            if s.shared_store else MemoryOutbox(self.sm, s.leader_id, window, s.fleet_store_timeout_s))
        # the hellos' checks read through connections of their own, planned for each read's values
        self._hello_engine = (reader_engine(s.effective_database_url, db.application_name(s.leader_id) + " hellos")
                              if s.shared_store else None)
        view = (StoreHelloView(self.sm, self._hello_engine) if s.shared_store else
                WorldHelloView(lambda: self.kernel.world, port.pending_seq, lambda: self.epoch))
        self.fleet = Fleet(self, port, view)
        self.agent_door: AgentDoor = FleetAgents(self.fleet)
        self.watch_door: WatchDoor = FleetWatches(self.fleet, self.jobs, self.restores, self.failslow,
                                                  lambda: self.acting)
        self.shared: SharedStore | None = None
        self.follower: Follower | None = None
        if s.shared_store:
            self.shared = SharedStore(self, self.fleet, self._read_world, self.jobs)
            self.follower = self.shared.follower

    # ---- life cycle -----------------------------------------------------------------------------
    async def start(self, migrate: bool = True) -> None:
        """Migrate, then lead at once when the lease is free (always with SQLite, whose second
        manager is refused: AnotherManager), else stand by until it is (`wait_leading`)."""
        if self.settings.effective_database_url.startswith("sqlite"):
            self.settings.data_dir.mkdir(parents=True, exist_ok=True)
        for line in self.settings.deprecations:
            log.warning("deprecated setting", detail=line)
        await offloop.warm()  # worker threads started now, not while serving (service/core/offloop.py)
        self.leadership.lock_sqlite()
        # from now on every write checks the lease (a Manager that is never started, the CLI's
        # token commands, writes unfenced: they touch no state a leader owns in memory)
        self.kernel.fence = self.leadership.fence
        if migrate:
            await db.upgrade(self.engine)
        if self.shared is not None:  # several managers: each takes streams from its start
            await self.shared.start()
        self.leadership.start_renewals()  # PostgreSQL: its thread waits, connected, until this manager leads
        if await self.leadership.try_acquire():
            await self._lead()
        else:
            await self.leadership.refresh()  # who leads, for the clients sent there from now on
            log.info("standing by", leader=self.leadership.leader)
            if self.follower is not None:
                await self.follower.start()  # the world, kept current from the leader's log
            self._standby = asyncio.create_task(self._stand_by(), name="standby")

    async def _stand_by(self) -> None:
        # the planner's process starts now rather than in the takeover's first replan
        warm = asyncio.create_task(self.jobs.planner.warm(), name="warm-planner")
        try:
            await self.leadership.wait_for_turn()
            try:
                await self._lead()
            except Exception:
                if self.leadership.lost.is_set():  # gave the lease up (logged): the process stops
                    return
                raise
        finally:
            if not warm.done():
                warm.cancel()

    async def wait_leading(self) -> None:
        """Until this manager leads (no poll while the standby task runs: it ends on leading or failing)."""
        while not self.ready:
            if self._standby is not None and not self._standby.done():
                await asyncio.wait({self._standby}, timeout=1.0)
            else:  # not standing by yet, or the task's error; else it gave the lease up (the process stops)
                _ = self._standby.result() if self._standby is not None else None
                await asyncio.sleep(0.02)

    @property
    def leading(self) -> bool:
        return self.leadership.leading

    @property
    def acting(self) -> bool:
        """Leading with the world loaded: the edges serve clients (else they send them to the leader)."""
        return self.leadership.leading and self._loaded

    @property
    def serves_clients(self) -> bool:
        """Takes agent streams and layout watches now: once its fleet is up (alone on SQLite, once
        it leads with its world loaded; sharing PostgreSQL, from its start), until it stops or
        loses its lease."""
        return self.fleet.ready and not self.jobs.stopping and not self.leadership.lost.is_set()

    def serving(self) -> tuple[bool, bool]:
        """(clients, leader): whether it takes agent streams and layout watches now and is in
        touch with the store; whether it leads with its world loaded (plans, applies the outbox,
        takes operators' writes). What gRPC health and /readyz report."""
        current = self.follower is None or not self.follower.behind
        return self.serves_clients and self.leadership.in_touch() and current, self.acting and not self.jobs.stopping

    def world_view(self) -> dict[str, Any] | None:
        """How current this manager's copy of the world is (None: it follows no log, alone on SQLite)."""
        return self.follower.view() if self.follower is not None else None

    @property
    def role(self) -> str:
        """leader | standby | lost (led, and lost the lease: the process is stopping)."""
        if self.leadership.lost.is_set():
            return "lost"
        return "leader" if self.leadership.leading else "standby"

    @property
    def lost(self) -> asyncio.Event:
        """Set when this manager led and lost its lease (it must stop: service/leadership/leader.py)."""
        return self.leadership.lost

    async def _lead(self) -> None:
        """Become the leader: load the world the database holds after the takeover, replan.

        The lease is renewed from the moment it is taken, not once the world is loaded: at 100,000
        GPUs on a loaded machine the load took 7 s, longer than the bench's 6 s lease, and the next
        standby took the lease over meanwhile (a second takeover, ~6 s more; bench/RESULTS.md).
        A lease lost while loading (the loop starved past it) ends the takeover before it acts."""
        self.epoch = self.leadership.epoch
        self.liveness.quiet_until = self.clock.monotonic() + self.settings.takeover_grace_s
        self._tasks = [asyncio.create_task(self.leadership.keep(), name="lease"),
                       asyncio.create_task(self._on_lost(), name="lease-lost")]
        try:
            await self._load()
        except Exception as e:
            # a leader that cannot load would hold the lease without ever acting (its renewals go on):
            # give it up now, so the next standby takes over at once, and exit as a lost lease does
            first = str(e).splitlines()[0][:200] if str(e) else ""
            reason = f"the takeover could not load the state: {type(e).__name__}: {first}"
            log.error("giving the lease up", epoch=self.epoch, reason=reason)
            await self.leadership.give_up(reason)
            raise  # at start-up the manager fails to start with this error, as before
        if self.leadership.lost.is_set():  # lost while loading: stopping (server.py), never acting
            log.error("the lease was lost while the state was loading; not taking over", epoch=self.epoch)
            return
        self.gauges.mark_stale()
        self.kernel.mark_all_dirty()
        self.kernel.start()
        self._tasks += [
            asyncio.create_task(self.jobs.control_loop(), name="control-loop"),
            asyncio.create_task(self._monitor_loop(), name="monitor"),
            asyncio.create_task(self.watchdog.run(), name="loop-watchdog"),
        ]
        await self.fleet.lead()  # alone, the fleet starts now (with the token table's poll)
        if self.shared is not None:
            await self.shared.lead()
        if self.slurm.enabled:
            self._tasks.append(asyncio.create_task(self.slurm.run_forever(lambda: self.jobs.stopping), name="slurm"))
        if self.settings.power_base_cap is not None or any(g.desired_mw is not None for g in self.world.gpus.values()):
            self.power.recompute_later()  # the base cap may have been set, changed or removed since
        self._loaded = True
        self.ready = True
        log.info("manager started", epoch=self.epoch, gpus=len(self.world.gpus), jobs=len(self.world.jobs))

    async def _load(self) -> None:
        """The world (current already on a standby that followed the world log, its rows left applied
        now: service/leadership/follow.py; else loaded), the breaker, fail-slow options and tokens."""
        if self.follower is None or not await self.follower.take_over():
            self.kernel.world = await self._read_world()
        async with self.sm() as s:
            await self.breaker.load(s)
            await self.failslow.load(s)
        await self.token_service.reload()

    async def _read_world(self) -> World:
        return await read_world(self.engine, self.sm, self.settings.power_base_cap, self.liveness.quiet_until)

    async def settled(self) -> None:
        """What this manager's agents and workers were told is durable is applied to the leader's
        world, once the leader's consumer has applied the outbox up to now (on the leader;
        NotLeader elsewhere). Alone (SQLite) an ack already means applied."""
        await self.fleet.settled()

    async def begin_shutdown(self) -> None:
        """Stop taking work: readiness off, agent streams and layout watches end."""
        self.jobs.stopping = True
        self.ready = False
        self.agents.close_all()
        self.fleet.feed.close()  # the layout watches this manager holds end
        async with self.jobs.layout_changed:
            self.jobs.layout_changed.notify_all()

    async def _on_lost(self) -> None:
        """The lease was taken over: stop acting at once (the fence refuses every write already);
        the edges end their streams and the process exits (server.py)."""
        await self.lost.wait()
        await self.begin_shutdown()

    async def stop(self) -> None:
        await self.begin_shutdown()
        if self.follower is not None:
            await self.follower.stop()
        await cancel_all([self._standby, *self._tasks])
        self.jobs.planner.stop()  # a plan still running in the planner process must not hold the exit
        if self.shared is not None:
            await self.shared.stop()
        await self.fleet.stop()
        await self.kernel.stop()
        await self.leadership.release()
        await self.leadership.close()
        await self.engine.dispose()
        if self._hello_engine is not None:
            await self._hello_engine.dispose()

    async def _monitor_loop(self) -> None:
        period = min(1.0, self.settings.heartbeat_interval_s / 2)
        while not self.jobs.stopping:
            await asyncio.sleep(period)
            try:
                await self.liveness.check()
                await self.maintenance.apply_windows()
                await self.maintenance.apply_drain_deadlines()
            except Exception:
                log.exception("monitor pass failed")

    def _rest_address(self) -> str:
        """This manager's REST base URL for links (the setting, else the advertised address)."""
        if self.settings.slurm_audit_url:
            return self.settings.slurm_audit_url
        return f"http://{self.leadership.http}" if self.leadership.http else ""

    # ---- state and transactions -----------------------------------------------------------------
    @property
    def world(self) -> World:
        return self.kernel.world

    @property
    def breaker_open(self) -> bool:
        return self.breaker.open

    @property
    def breaker_reason(self) -> str:
        return self.breaker.reason

    @property
    def layout_acks(self) -> dict[str, dict[int, dict[str, dict[str, Any]]]]:
        return self.workers.acks

    def mutation(self, actor: str, request_id: str = "") -> contextlib.AbstractAsyncContextManager[Tx]:
        """A transaction of its own (service/core/kernel.py): the edges' way to change state."""
        return self.kernel.exclusive(actor, request_id)

    async def idempotent(self, actor: str, request_id: str, key: str | None, fingerprint: str,
                         fn: Callable[[Tx], Awaitable[Any]], status: int = 200) -> Outcome:
        """`fn` in a mutation of its own, made once per idempotency key (service/core/idempotency.py)."""
        return await idempotent(lambda: self.mutation(actor, request_id), key, fingerprint, fn, status)

    # ---- tokens (service/operations/tokens.py) ------------------------------------------------------------
    async def create_token(self, name: str, scope: str, actor: str = "cli", node: str | None = None,
                           fingerprint: str | None = None) -> str:
        return await self.token_service.create(name, scope, actor, node, fingerprint)

    async def list_tokens(self) -> list[dict[str, Any]]:
        return await self.token_service.list()

    async def revoke_token(self, public_id: str, actor: str = "cli") -> None:
        await self.token_service.revoke(public_id, actor)

    # ---- agents (service/ingest/agents.py) ------------------------------------------------------------
    async def register_agent(
        self, node: str, domain: str, gpus: list[GpuInventory], boot_id: str, agent_version: str,
        principal: Principal | None = None, peer_fingerprint: str | None = None, peer: str = "",
    ) -> tuple[AgentSession, int]:
        return await self.agents.register(node, domain, gpus, boot_id, agent_version, principal, peer_fingerprint,
                                          peer)

    def disconnect_agent(self, session: AgentSession) -> None:
        self.agents.disconnect(session)

    def heartbeat(self, node: str, gpus: Any = ()) -> None:
        self.agent_door.heartbeat(node, gpus)

    def apply_report(self, node: str, seq: int, gpus: list[GpuReport]) -> asyncio.Future[int]:
        """A report on its way into the next group commit (service/ingest/agents.py): await it for the
        seq to acknowledge."""
        return self.agents.submit_report(node, seq, gpus)

    async def record_power_result(self, node: str, readings: list[tuple[str, int]]) -> None:
        await self.agents.record_power_result(node, readings)

    async def check_heartbeats(self) -> None:
        await self.liveness.check()

    # ---- operators (service/operations/operators.py, maintenance.py, breaker.py) --------------------------
    async def cordon(self, m: Tx, uuid: str, reason: str) -> dict[str, Any]:
        return await self.ops.cordon(m, uuid, reason)

    async def uncordon(self, m: Tx, uuid: str, reason: str) -> dict[str, Any]:
        return await self.ops.uncordon(m, uuid, reason)

    async def mark_healthy(self, m: Tx, uuid: str, reason: str) -> dict[str, Any]:
        return await self.ops.mark_healthy(m, uuid, reason)

    async def drain_node(self, m: Tx, node: str, deadline: datetime, reason: str) -> dict[str, Any]:
        return await self.ops.drain_node(m, node, deadline, reason)

    async def undrain_node(self, m: Tx, node: str, reason: str) -> dict[str, Any]:
        return await self.ops.undrain_node(m, node, reason)

    async def add_maintenance(self, m: Tx, kind: str, target: str, starts: datetime, ends: datetime,
                              reason: str) -> dict[str, Any]:
        return await self.maintenance.add(m, kind, target, starts, ends, reason)

    async def cancel_maintenance(self, m: Tx, window_id: int) -> dict[str, Any]:
        return await self.maintenance.cancel(m, window_id)

    async def reset_breaker(self, m: Tx, reason: str) -> dict[str, Any]:
        return await self.breaker.reset(m, reason)

    # ---- jobs (service/planning/jobs.py) ---------------------------------------------------------------
    def parse_job(self, spec: dict[str, Any]) -> JobSpec:
        return self.jobs.parse(spec)

    async def create_job(self, m: Tx, spec: dict[str, Any]) -> dict[str, Any]:
        return await self.jobs.create(m, spec)

    async def delete_job(self, m: Tx, name: str) -> dict[str, Any]:
        out = await self.jobs.delete(m, name)
        m.after.append(lambda: self.failslow.forget(name))
        return out

    # ---- fail-slow (service/planning/failslow.py) -------------------------------------------------------
    def failslow_view(self, job: str) -> dict[str, Any]:
        return self.failslow.view(job, self.world.jobs.get(job))

    def failslow_dashboard(self, job: str, limit: int) -> dict[str, Any] | None:
        """The dashboard's fail-slow part of a job: per-rank factor, compute and step time (from the
        newest reports of its current layout), the newest verdicts; None before any step."""
        rec = self.world.jobs.get(job)
        w = self.workers.steps.get(job)
        times = w.last_step_times(rec.layout.version, 4 * limit) if w is not None and rec and rec.layout else {}
        return self.failslow.dashboard(job, times, limit)

    async def set_failslow_options(self, m: Tx, scope: str, changes: dict[str, Any], reset: bool) -> dict[str, Any]:
        return await self.failslow.set_options(m, scope, changes, reset)

    async def dry_run(self, spec: JobSpec, fail: list[str]) -> LayoutDoc:
        return await self.jobs.dry_run(spec, fail)

    async def replan(self, name: str, actor: str, reason: str = "", m: Tx | None = None) -> LayoutRec | None:
        return await self.jobs.replan(name, actor, reason, m)

    def wake_watchers(self) -> None:
        self.jobs.wake_watchers()

    async def wait_layout(self, job: str, newer_than: tuple[int, int],
                          stop: Callable[[], bool] | None = None) -> LayoutRec | None:
        return await self.jobs.wait_layout(job, newer_than, stop)

    def ack_layout(self, job: str, worker: str, epoch: int, version: int, ok: bool) -> LayoutRec:
        return self.jobs.ack(job, worker, epoch, version, ok)

    async def record_restore(self, job: str, worker: str, epoch: int, version: int, report: RestoreReport) -> bool:
        """A restore from a checkpoint that workers made to apply (epoch, version) of `job`, recorded
        once per version (service/planning/restores.py). Call it after the worker's ack was accepted."""
        return await self.restores.record(job, worker, epoch, version, report)

    async def record_steps(self, job: str, worker_id: str, report: Any) -> None:
        await self.watch_door.report_steps(job, worker_id, report)

    def step_summary(self, job: str, recent: int) -> dict[str, Any]:
        return self.jobs.step_summary(job, recent)

    def _step_windows(self) -> list[tuple[str, int, StepWindow]]:
        return [(name, job.layout.version if job.layout else 0, self.workers.steps[name])
                for name, job in self.world.jobs.items() if name in self.workers.steps]

    # ---- views (service/operations/queries.py, gauges.py) --------------------------------------------------
    def gpu_view(self, uuid: str) -> dict[str, Any]:
        return gpu_view(self.ops.gpu(uuid))

    async def gpu_state_counts(self) -> dict[str, int]:
        return await self.gauges.state_counts()

    async def refresh_gauges_async(self) -> None:
        await self.gauges.refresh_async()
