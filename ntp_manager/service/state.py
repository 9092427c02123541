"""The in-memory mirror of the manager's durable state, and the typed changes made to it.

Records (`GpuRec`, `NodeRec`, `JobRec`, `LayoutRec`) are rebuilt from the database on start. Only
the kernel mutates them, after the transaction that wrote the same change has committed.

A change to a GPU or a node is one typed value (`GpuChange`, `NodeChange`) whose fields are named
after the columns they set. `values()` is the one place a change becomes data: the transaction
writes exactly those values to the row (service/kernel.py) and `apply()` sets exactly those values
on the record, so the row and the memory cannot drift apart (a field that is not a column of the
row or an attribute of the record fails the test that checks every field against both).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from datetime import datetime
from enum import StrEnum
from typing import Any, Final

from ntp_manager.planner import JobSpec
from ntp_manager.topology import Cluster, Domain, Gpu, GpuState, PowerLimits

HEALTH_STATES = frozenset({GpuState.HEALTHY, GpuState.SUSPECT, GpuState.DEGRADED, GpuState.FAILED})
ADMIN_STATES = frozenset({GpuState.CORDONED, GpuState.DRAINING, GpuState.MAINTENANCE})


class HealthSource(StrEnum):
    """What a GPU's health verdict rests on: a silence-only verdict is undone by a reconnect."""

    AGENT = "agent"  # the agent's report
    HEARTBEAT = "heartbeat"  # the node went silent
    INVENTORY = "inventory"  # the node's hello left the GPU out
    OPERATOR = "operator"  # mark-healthy
    REGISTERED = "registered"  # new, no report yet


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
    health: str = GpuState.HEALTHY
    health_reason: str = ""
    health_source: str = HealthSource.AGENT
    health_since: datetime | None = None
    admin: str | None = None
    admin_owner: str | None = None
    admin_reason: str | None = None
    desired_mw: int | None = None
    enforced_mw: int | None = None
    model: str = ""
    memory_bytes: int = 0

    @property
    def state(self) -> str:
        return self.admin or self.health


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


class _Keep:
    """The value of a change field that leaves its column as it is."""

    _instance: _Keep | None = None

    def __new__(cls) -> _Keep:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "KEEP"


KEEP: Final = _Keep()


class _Change:
    """Shared by the typed changes: the fields given, merged and applied by name. The values are
    collected once, when the change is made (changes are frozen)."""

    __slots__ = ()
    _names: tuple[str, ...] = ()  # the dataclass's field names (set below each class)
    _values: dict[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_values", {n: v for n in self._names if (v := getattr(self, n)) is not KEEP})

    def values(self) -> dict[str, Any]:
        """The columns this change sets, by name: what the row gets and what the record gets.
        (The same dict each time: do not change it.)"""
        return self._values

    def apply(self, target: Any) -> None:
        """Set this change's values on a record (or a row): the same values the row was written."""
        for name, value in self.values().items():
            setattr(target, name, value)

    def __bool__(self) -> bool:
        return bool(self.values())


@dataclass(frozen=True, slots=True)
class GpuChange(_Change):
    health: GpuState | _Keep = KEEP
    health_reason: str | _Keep = KEEP
    health_source: HealthSource | _Keep = KEEP
    health_since: datetime | _Keep = KEEP
    admin: GpuState | _Keep | None = KEEP
    admin_owner: str | _Keep | None = KEEP
    admin_reason: str | _Keep | None = KEEP
    desired_mw: int | _Keep | None = KEEP
    enforced_mw: int | _Keep | None = KEEP
    idx: int | _Keep = KEEP
    tdp_mw: int | _Keep = KEEP
    min_mw: int | _Keep = KEEP
    max_mw: int | _Keep = KEEP
    model: str | _Keep = KEEP
    memory_bytes: int | _Keep = KEEP
    _values: dict[str, Any] = field(init=False, repr=False, compare=False, default_factory=dict)

    @classmethod
    def health_to(cls, state: GpuState, reason: str, source: HealthSource, at: datetime) -> GpuChange:
        return cls(health=state, health_reason=reason, health_source=source, health_since=at)

    @classmethod
    def admin_to(cls, state: GpuState | None, owner: str | None, reason: str | None) -> GpuChange:
        """Set (or clear, `state=None`) the operator state; owner and reason go with it."""
        if state is None:
            return cls(admin=None, admin_owner=None, admin_reason=None)
        return cls(admin=state, admin_owner=owner, admin_reason=reason)

    def then(self, later: GpuChange) -> GpuChange:
        """This change followed by `later` (its fields win)."""
        return GpuChange(**{**self.values(), **later.values()})

    def differing(self, rec: GpuRec) -> GpuChange:
        """Only the fields whose value differs from what `rec` holds."""
        return GpuChange(**{k: v for k, v in self.values().items() if getattr(rec, k) != v})

    @property
    def touches_state(self) -> bool:
        return self.health is not KEEP or self.admin is not KEEP

    @property
    def touches_shape(self) -> bool:
        """Index or power limits: the planner's snapshot must be rebuilt."""
        return any(v is not KEEP for v in (self.idx, self.tdp_mw, self.min_mw, self.max_mw))


@dataclass(frozen=True, slots=True)
class NodeChange(_Change):
    last_seq: int | _Keep = KEEP
    boot_id: str | _Keep = KEEP
    agent_version: str | _Keep = KEEP
    drain_deadline: datetime | _Keep | None = KEEP
    drain_reason: str | _Keep | None = KEEP
    _values: dict[str, Any] = field(init=False, repr=False, compare=False, default_factory=dict)

    def then(self, later: NodeChange) -> NodeChange:
        return NodeChange(**{**self.values(), **later.values()})


GpuChange._names = tuple(f.name for f in fields(GpuChange) if f.init)
NodeChange._names = tuple(f.name for f in fields(NodeChange) if f.init)


@dataclass
class LayoutRec:
    job: str
    version: int
    leader_epoch: int
    plan: dict[str, Any]
    reason: str
    created_at: datetime
    created_mono: float = 0.0
    fingerprint: str = ""  # what a replan compares to decide whether anything changed


@dataclass
class JobRec:
    name: str
    spec: JobSpec
    raw: dict[str, Any]
    pending_reason: str | None = None  # why no layout could be made yet
    layout: LayoutRec | None = None


@dataclass
class World:
    gpus: dict[str, GpuRec] = field(default_factory=dict)
    nodes: dict[str, NodeRec] = field(default_factory=dict)
    domains: dict[str, float | None] = field(default_factory=dict)  # id -> power budget
    jobs: dict[str, JobRec] = field(default_factory=dict)
    base_cap: float | None = None  # fleet base power cap (settings.power_base_cap)
    _cluster: Cluster | None = None
    _shape_gen: int = 0  # bumped whenever GPUs are added or change place or limits
    _changed_while_building: set[str] | None = None
    _building: asyncio.Future[Cluster] | None = None

    def invalidate(self) -> None:
        self._cluster = None
        self._shape_gen += 1

    def cluster(self) -> Cluster:
        """Topology snapshot for the planner (rebuilt after registrations, else cached).

        Building it is O(GPUs) (about a second at 100K GPUs here): on the event loop, use
        `cluster_async`, which builds in a worker thread."""
        if self._cluster is None:
            self._cluster = _build_cluster(list(self.gpus.values()), dict(self.domains), self.base_cap)
        return self._cluster

    async def cluster_async(self) -> Cluster:
        """`cluster()` without holding the event loop: the snapshot is built in a worker thread
        from a copy of the record list, then the states that changed meanwhile are applied to it
        (every state change passes through `apply_states`, which records them). Concurrent callers
        share one build."""
        while self._cluster is None:
            if self._building is None:
                self._building = asyncio.get_running_loop().create_future()
                building = self._building
                gen = self._shape_gen
                self._changed_while_building = set()
                try:
                    built = await asyncio.to_thread(_build_cluster, list(self.gpus.values()), dict(self.domains),
                                                    self.base_cap)
                    changed, self._changed_while_building = self._changed_while_building, None
                    if gen == self._shape_gen:  # else GPUs were added meanwhile: build again
                        if changed:
                            built = built.with_states({u: GpuState(self.gpus[u].state) for u in changed})
                        self._cluster = built
                    building.set_result(built)
                except BaseException as e:
                    self._changed_while_building = None
                    building.set_exception(e)
                    raise
                finally:
                    self._building = None
            else:
                await asyncio.shield(self._building)
        return self._cluster

    def apply_states(self, uuids: Iterable[str]) -> None:
        """Bring the cached snapshot up to date after state changes of `uuids`."""
        uuids = list(uuids)
        if self._changed_while_building is not None:
            self._changed_while_building.update(uuids)
        if self._cluster is not None and uuids:
            self._cluster = self._cluster.with_states({u: GpuState(self.gpus[u].state) for u in uuids})


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
                    )
                    for r in group
                ),
                budgets.get(did),
            )
        )
    return Cluster.build("live", domains)
