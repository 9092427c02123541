"""In-memory mirror of the manager's durable state (rebuilt from the database on start).

Only the manager mutates it, after the matching transaction has committed.
"""

from __future__ import annotations

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

    def invalidate(self) -> None:
        self._cluster = None

    def cluster(self) -> Cluster:
        """Topology snapshot for the planner (rebuilt after registrations, else cached)."""
        if self._cluster is None:
            by_domain: dict[str, list[GpuRec]] = {}
            for g in self.gpus.values():
                by_domain.setdefault(g.domain, []).append(g)
            domains = []
            for did in sorted(by_domain):
                recs = sorted(by_domain[did], key=lambda r: (r.node, r.idx))
                domains.append(
                    Domain(
                        did,
                        tuple(
                            Gpu(
                                r.uuid, r.node, did, r.idx, GpuState(r.state),
                                PowerLimits(r.tdp_mw / 1000, r.min_mw / 1000, r.max_mw / 1000).with_base_cap(
                                    self.base_cap),
                            )
                            for r in recs
                        ),
                        self.domains.get(did),
                    )
                )
            self._cluster = Cluster.build("live", domains)
        return self._cluster

    def apply_states(self, uuids: list[str]) -> None:
        """Bring the cached snapshot up to date after state changes of `uuids`."""
        if self._cluster is not None and uuids:
            self._cluster = self._cluster.with_states({u: GpuState(self.gpus[u].state) for u in uuids})
