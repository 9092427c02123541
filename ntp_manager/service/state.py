"""In-memory mirror of the manager's durable state (rebuilt from the database on start).

Only the manager mutates it, after the matching transaction has committed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ntp_manager.planner import JobSpec
from ntp_manager.topology import Cluster, Domain, Gpu, GpuState, PowerLimits

HEALTH_STATES = frozenset({"healthy", "suspect", "degraded", "failed"})
ADMIN_STATES = frozenset({"cordoned", "draining", "maintenance"})


@dataclass
class GpuRec:
    uuid: str
    node: str
    domain: str
    idx: int
    tdp_mw: int
    min_mw: int
    max_mw: int
    health: str = "healthy"
    health_reason: str = ""
    health_source: str = "agent"
    admin: str | None = None
    admin_owner: str | None = None
    admin_reason: str | None = None
    desired_mw: int | None = None
    enforced_mw: int | None = None

    @property
    def state(self) -> str:
        return self.admin or self.health


@dataclass
class NodeRec:
    name: str
    domain: str
    gpus: list[str]
    last_seq: int = 0
    boot_id: str = ""
    last_seen: float = 0.0  # monotonic
    connected: bool = False
    drain_deadline: datetime | None = None
    drain_reason: str | None = None


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

    def apply_states(self, uuids: list[str]) -> None:
        """Bring the cached snapshot up to date after state changes of `uuids`."""
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
