"""The in-memory mirror of the manager's durable state, and the typed changes made to it.

Records (`GpuRec`, `NodeRec`, `JobRec`, `LayoutRec`) are rebuilt from the database on start. Only
the kernel mutates them, after the transaction that wrote the same change has committed.

A change to a GPU or a node is one typed value (`GpuChange`, `NodeChange`: typed dicts whose keys
are the columns they set). The transaction writes the change itself as the row's UPDATE
parameters (service/core/kernel.py) and `apply()` sets the same values on the record, so the row and
the memory cannot drift apart (a key that is not a column of the row and an attribute of the record
fails the test that checks every key against both; records have slots, so a misspelt one raises).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, TypedDict, cast

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.core import offloop
from ntp_manager.specfile import JobPolicy
from ntp_manager.topology import Cluster, Domain, Gpu, PowerLimits, TopologyError

HEALTH_STATES = frozenset({GpuState.HEALTHY, GpuState.SUSPECT, GpuState.DEGRADED, GpuState.FAILED})


class HealthSource(StrEnum):
    """What a GPU's health verdict rests on: a silence-only verdict is undone by a reconnect."""

    AGENT = "agent"  # the agent's report
    HEARTBEAT = "heartbeat"  # the node went silent
    INVENTORY = "inventory"  # the node's hello left the GPU out
    OPERATOR = "operator"  # mark-healthy
    DETECTOR = "detector"  # the fail-slow detector (degraded at a measured speed, or recovered)


SILENCE_SOURCES = frozenset({HealthSource.HEARTBEAT, HealthSource.INVENTORY})


@dataclass(slots=True)
class GpuRec:
    uuid: str
    node: str
    domain: str
    idx: int
    tdp_mw: int
    min_mw: int
    max_mw: int
    health: GpuState = GpuState.HEALTHY  # one of HEALTH_STATES
    health_reason: str = ""
    health_source: HealthSource = HealthSource.AGENT
    health_since: datetime | None = None
    admin: GpuState | None = None  # CORDONED, DRAINING or MAINTENANCE (operator states)
    admin_owner: str | None = None
    admin_reason: str | None = None
    desired_mw: int | None = None
    enforced_mw: int | None = None
    model: str = ""
    memory_bytes: int = 0
    pos: int = -1  # the GPU's stable number (gpus.pos), given when it is added; layouts name GPUs by it
    speed: float | None = None  # measured speed factor while degraded by the fail-slow detector

    @property
    def state(self) -> GpuState:
        return self.admin or self.health

    @property
    def planned_speed(self) -> float | None:
        """The speed the planner runs this GPU at: its measured factor while degraded, else None."""
        return self.speed if self.health == GpuState.DEGRADED else None

    def copy(self) -> GpuRec:
        return GpuRec(self.uuid, self.node, self.domain, self.idx, self.tdp_mw, self.min_mw, self.max_mw, self.health,
                      self.health_reason, self.health_source, self.health_since, self.admin, self.admin_owner,
                      self.admin_reason, self.desired_mw, self.enforced_mw, self.model, self.memory_bytes, self.pos,
                      self.speed)


@dataclass(slots=True)
class NodeRec:
    name: str
    domain: str
    gpus: list[str]
    last_seq: int = 0
    boot_id: str = ""
    last_seen: float = 0.0  # monotonic; memory only (heartbeats are never written)
    connected: bool = False
    drain_deadline: datetime | None = None
    drain_reason: str | None = None
    agent_version: str = ""

    def copy(self) -> NodeRec:
        return NodeRec(self.name, self.domain, self.gpus, self.last_seq, self.boot_id, self.last_seen, self.connected,
                       self.drain_deadline, self.drain_reason, self.agent_version)


class GpuChange(TypedDict, total=False):
    """A change to one GPU: the columns it sets (a key left out keeps its column as it is)."""

    health: GpuState
    health_reason: str
    health_source: HealthSource
    health_since: datetime
    admin: GpuState | None
    admin_owner: str | None
    admin_reason: str | None
    desired_mw: int | None
    enforced_mw: int | None
    idx: int
    tdp_mw: int
    min_mw: int
    max_mw: int
    model: str
    memory_bytes: int
    speed: float | None


class NodeChange(TypedDict, total=False):
    """A change to one node: the columns it sets."""

    last_seq: int
    boot_id: str
    agent_version: str
    drain_deadline: datetime | None
    drain_reason: str | None


SHAPE_FIELDS = frozenset({"idx", "tdp_mw", "min_mw", "max_mw"})  # the planner's snapshot must be rebuilt


def apply(target: Any, change: GpuChange | NodeChange) -> None:
    """Set a change's values on a record: the same values, by the same names, its row was written
    (service/core/kernel.py writes `change` itself as the row's UPDATE parameters)."""
    for name, value in change.items():
        setattr(target, name, value)


def health_to(state: GpuState, reason: str, source: HealthSource, at: datetime) -> GpuChange:
    return GpuChange(health=state, health_reason=reason, health_source=source, health_since=at)


def admin_to(state: GpuState | None, owner: str | None, reason: str | None) -> GpuChange:
    """Set (or clear, `state=None`) the operator state; owner and reason go with it."""
    if state is None:
        return GpuChange(admin=None, admin_owner=None, admin_reason=None)
    return GpuChange(admin=state, admin_owner=owner, admin_reason=reason)


def differing(change: GpuChange, rec: GpuRec) -> GpuChange:
    """Only the values of `change` that differ from what `rec` holds."""
    return cast(GpuChange, {k: v for k, v in change.items() if getattr(rec, k) != v})


@dataclass
class LayoutRec:
    """A job's current layout version: the typed layout, its stamp, and how many deltas its
    stored body is from a keyframe (store/layout_codec.py)."""

    job: str
    version: int
    leader_epoch: int
    doc: LayoutDoc
    reason: str
    created_at: datetime
    created_mono: float = 0.0
    chain: int = 0


@dataclass
class JobRec:
    """A job: its spec and sharing policy, the domains it owns (domain -> how it came to own it:
    `own`, `grant`, `reserved` or `borrowed`; in the order its planner fills them) and its current layout.
    A job owning no domain is pending: it waits for capacity (service/planning/ownership.py)."""

    name: str
    spec: JobSpec
    raw: dict[str, Any]
    pending_reason: str | None = None  # why no layout could be made yet
    layout: LayoutRec | None = None
    policy: JobPolicy = field(default_factory=JobPolicy)
    held: dict[str, str] = field(default_factory=dict)
    created_at: datetime | None = None  # arrival order of pending jobs
    next_seq: int = 0  # the `seq` the next domain it is given gets (allocations rows keep the order)

    def planned_spec(self, domains: Iterable[str], spares: int) -> JobSpec:
        """The job's spec restricted to `domains` (in order) with `spares` spare groups: what its
        planner gets (service/planning/ownership.py decides both)."""
        return dataclasses.replace(self.spec, domains=tuple(domains), spares=spares)


INLINE_STATES = 512  # deferred state changes applied to the snapshot on the loop; more: in a worker thread


@dataclass
class World:
    gpus: dict[str, GpuRec] = field(default_factory=dict)
    nodes: dict[str, NodeRec] = field(default_factory=dict)
    domains: dict[str, float | None] = field(default_factory=dict)  # id -> power budget
    jobs: dict[str, JobRec] = field(default_factory=dict)
    base_cap: float | None = None  # fleet base power cap (settings.power_base_cap)
    by_pos: dict[int, str] = field(default_factory=dict)  # gpus.pos -> UUID
    next_pos: int = 0  # the position the next new GPU gets (never reused, gaps allowed)
    _cluster: Cluster | None = None
    _shape_gen: int = 0  # bumped whenever GPUs are added or change place or limits
    _changed_while_building: set[str] | None = None
    _building: asyncio.Future[Cluster] | None = None
    _catching_up: asyncio.Future[None] | None = None
    _deferred: set[str] = field(default_factory=set)  # state changes not applied to `_cluster` yet
    _domain_gpus: dict[str, list[str]] | None = None  # domain -> its GPUs, as of `_domain_gen`
    _domain_gen: int = -1

    def owners(self) -> dict[str, str]:
        """Domain -> the job owning it (a domain missing here is in the free pool): O(owned domains)."""
        return {d: j.name for j in self.jobs.values() for d in j.held}

    def take_pos(self) -> int:
        """A position for a new GPU. One that a rolled-back transaction took is not given again."""
        self.next_pos += 1
        return self.next_pos - 1

    def pos_of(self, uuid: str) -> int:
        """The position of a known GPU (KeyError otherwise); safe to call from a worker thread."""
        return self.gpus[uuid].pos

    def uuid_at(self, pos: int) -> str:
        """The GPU at a position (KeyError when none); safe to call from a worker thread."""
        return self.by_pos[pos]

    def gpus_of_domain(self, domain: str) -> list[str]:
        """The GPUs of a domain, in the order they were added: O(the domain's GPUs). The index
        behind it is rebuilt, O(GPUs), when GPUs were added or changed place since."""
        if self._domain_gpus is None or self._domain_gen != self._shape_gen:
            index: dict[str, list[str]] = {}
            for u, g in self.gpus.items():
                index.setdefault(g.domain, []).append(u)
            self._domain_gpus, self._domain_gen = index, self._shape_gen
        return list(self._domain_gpus.get(domain, ()))

    def invalidate(self) -> None:
        self._cluster = None
        self._deferred.clear()  # the rebuild reads the records as they are
        self._shape_gen += 1

    def cluster(self) -> Cluster:
        """Topology snapshot for the planner (rebuilt after registrations, else cached).

        Building it is O(GPUs) (about a second at 100K GPUs here): on the event loop, use
        `cluster_async`, which builds in a worker thread."""
        while True:
            if self._cluster is None:
                self._cluster = _build_cluster(list(self.gpus.values()), dict(self.domains), self.base_cap)
            current = self._current()
            if current is not None:
                return current

    async def cluster_async(self) -> Cluster:
        """`cluster()` without holding the event loop: the snapshot is built in a worker thread
        from a copy of the record list (the states that change meanwhile are recorded by
        `apply_states` and applied after), and a backlog of more than INLINE_STATES state changes
        is applied in a worker thread too (a silent rack of agents is 30,000 GPUs changing state
        at once: applied on the loop, with the collections its allocations set off, that held a
        leader's loop past its lease). Concurrent callers share one build and one catch-up."""
        while True:
            if self._cluster is None:
                if self._building is None:
                    await self._build()
                else:
                    await asyncio.shield(self._building)
                continue
            if self._catching_up is not None:
                await asyncio.shield(self._catching_up)
                continue
            if len(self._deferred) > INLINE_STATES:
                await self._catch_up()
                continue
            current = self._current()
            if current is not None:
                return current

    async def _build(self) -> None:
        self._building = building = asyncio.get_running_loop().create_future()
        gen = self._shape_gen
        self._changed_while_building = set()
        try:
            built = await asyncio.to_thread(_build_cluster, list(self.gpus.values()), dict(self.domains),
                                            self.base_cap)
            changed, self._changed_while_building = self._changed_while_building, None
            if gen == self._shape_gen:  # else GPUs were added meanwhile: build again
                self._cluster = built
                self._deferred = set(changed)  # what changed while it was built: applied next
                if len(self.gpus) >= 10_000:  # 2 objects per GPU, kept until GPUs are added
                    offloop.keep_out_of_gc()
            building.set_result(built)
        except BaseException as e:
            self._changed_while_building = None
            building.set_exception(e)
            raise
        finally:
            self._building = None

    async def _catch_up(self) -> None:
        """Apply the deferred state changes to the snapshot in a worker thread. What changes
        meanwhile is deferred again; if the snapshot was replaced meanwhile (rebuilt, or brought up
        to date by `cluster()`), these changes are deferred again for the new one."""
        base, gen = self._cluster, self._shape_gen
        assert base is not None
        changed, self._deferred = self._deferred, set()
        self._catching_up = done = asyncio.get_running_loop().create_future()
        try:
            try:
                states = {u: GpuState(self.gpus[u].state) for u in changed}
                speeds = {u: self.gpus[u].planned_speed for u in changed}
                caught = await offloop.run(base.with_states, states, speeds)
            except (KeyError, TopologyError):  # a GPU that changed is gone: rebuilt from the records
                self.invalidate()
                return
            if self._cluster is base and self._shape_gen == gen:
                self._cluster = caught
            elif self._cluster is not None:
                self._deferred |= changed
        finally:
            self._catching_up = None
            done.set_result(None)

    def apply_states(self, uuids: Iterable[str]) -> None:
        """The cached snapshot is out of date for the states of `uuids`: it is brought up to date
        when it is next asked for (`cluster`, `cluster_async`), all the changes since in one copy.
        (A copy costs O(domains): made per transaction, it was a good part of applying one agent
        report on the leader, and of following one on a standby, at 12,500 domains.)"""
        uuids = list(uuids)
        if self._changed_while_building is not None:
            self._changed_while_building.update(uuids)
        if self._cluster is not None:
            self._deferred.update(uuids)

    def _current(self) -> Cluster | None:
        """The cached snapshot with the deferred state changes applied; None when there is none (or
        it no longer has a GPU that changed: rebuilt, as after GPUs are added)."""
        if self._cluster is None or not self._deferred:
            return self._cluster
        changed, self._deferred = self._deferred, set()
        try:
            self._cluster = self._cluster.with_states({u: GpuState(self.gpus[u].state) for u in changed},
                                                      {u: self.gpus[u].planned_speed for u in changed})
        except (KeyError, TopologyError):
            self.invalidate()
        return self._cluster


def _build_cluster(recs: Iterable[GpuRec], budgets: dict[str, float | None], base_cap: float | None) -> Cluster:
    by_domain: dict[str, list[GpuRec]] = {}
    for g in recs:
        by_domain.setdefault(g.domain, []).append(g)
    domains = []
    for did in sorted(by_domain):
        group = sorted(by_domain[did], key=lambda r: (r.node, r.idx))
        domains.append(
            Domain(
                did,
                tuple(
                    Gpu(
                        r.uuid, r.node, did, r.idx, GpuState(r.state),
                        PowerLimits(r.tdp_mw / 1000, r.min_mw / 1000, r.max_mw / 1000).with_base_cap(base_cap),
                        r.planned_speed,
                    )
                    for r in group
                ),
                budgets.get(did),
            )
        )
    return Cluster.build("live", domains)
