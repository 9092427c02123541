"""Cluster topology: GPUs keyed by UUID, nodes, scale-up (NVLink) domains and GPU states.

This module is pure: frozen dataclasses, no I/O and no clock. A `Cluster` is an immutable snapshot;
`Cluster.with_states` returns a new snapshot that shares every untouched domain with the old one,
so replanning after one failure costs O(domains + changes), not O(GPUs).

Decisions made here:
- A GPU is *placeable* (may hold TP work) when it is healthy or suspect, or degraded with a
  measured speed factor. Suspect means "its node went silent, still within grace": we do not cry wolf,
  so it keeps its work until it is declared failed. A degraded GPU with a `speed` (the fail-slow
  detector measured it, e.g. 0.8) is usable at that speed: the planner decides whether its group
  keeps it, drops it or gives way to a spare. Degraded without a speed (an agent's trend verdict),
  failed, cordoned, draining and maintenance GPUs take no new work.
- GPUs inside a domain are ordered by (node, local index); that order defines the domain's home TP
  groups, so plans are deterministic and stable across replans.
"""

from __future__ import annotations

import uuid as _uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

from ntp_manager.contract.gpu import GpuState
from ntp_manager.contract.power import base_cap_w


class TopologyError(ValueError):
    """A cluster description is inconsistent (duplicate UUID, unknown GPU, bad sizes)."""


DEFAULT_TDP_W = 1000.0
_UUID_NAMESPACE = _uuid.UUID("6f1c4b1e-2f0a-4d55-9a43-6a0c8d7e5b21")


def synthetic_gpu_uuid(cluster: str, domain: str, node: str, index: int) -> str:
    """Deterministic NVML-style UUID for generated clusters (same names -> same UUID)."""
    return "GPU-" + str(_uuid.uuid5(_UUID_NAMESPACE, f"{cluster}/{domain}/{node}/{index}"))


@dataclass(frozen=True, slots=True)
class PowerLimits:
    """Power envelope of one GPU, in watts.

    `tdp_w` is the GPU's default limit. `base_w`, when set, is the fleet base cap: the limit a
    healthy GPU runs at, between `min_w` and the default, so that a reduced TP group has headroom
    up to `max_w` even where the default already is the maximum (H100: 700 W, GB300: 1,400 W).
    `nominal_w` is what a healthy GPU runs at (the base cap, else the default); the planner's power
    ratios and speeds are relative to it."""

    tdp_w: float = DEFAULT_TDP_W
    min_w: float = DEFAULT_TDP_W * 0.2
    max_w: float = DEFAULT_TDP_W * 1.3
    base_w: float | None = None
    # The limit a healthy GPU runs at: the base cap if one is set, else the default (derived; a
    # field rather than a property because the planner reads it for every GPU of a reduced rack).
    nominal_w: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nominal_w", self.tdp_w if self.base_w is None else self.base_w)
        if not (0 < self.min_w <= self.tdp_w <= self.max_w):
            raise TopologyError(
                f"power limits must satisfy 0 < min <= tdp <= max, got min={self.min_w} "
                f"tdp={self.tdp_w} max={self.max_w}"
            )
        if self.base_w is not None and not (self.min_w <= self.base_w <= self.tdp_w):
            raise TopologyError(
                f"a base power cap must lie between the minimum and the default limit, got base={self.base_w} "
                f"min={self.min_w} default={self.tdp_w}"
            )

    def with_base_cap(self, ratio: float | None) -> PowerLimits:
        """These limits under a fleet base cap of `ratio` x the maximum (None: no base cap)."""
        if ratio is None:
            return PowerLimits(self.tdp_w, self.min_w, self.max_w)
        try:  # the contract's arithmetic: the agent's power-reset computes the same base
            base = base_cap_w(self.min_w, self.tdp_w, self.max_w, ratio)
        except ValueError as e:
            raise TopologyError(str(e)) from None
        return PowerLimits(self.tdp_w, self.min_w, self.max_w, base)


DEFAULT_POWER = PowerLimits()


@dataclass(frozen=True, slots=True)
class Gpu:
    uuid: str
    node: str
    domain: str
    index: int
    state: GpuState = GpuState.HEALTHY
    power: PowerLimits = DEFAULT_POWER
    speed: float | None = None  # measured speed factor of a degraded GPU, in (0, 1]; None: full speed

    def __post_init__(self) -> None:
        if self.speed is not None and not 0 < self.speed <= 1:
            raise TopologyError(f"GPU {self.uuid}: speed must be in (0, 1], got {self.speed}")

    @property
    def placeable(self) -> bool:
        return self.state.placeable or (self.state is GpuState.DEGRADED and self.speed is not None)

    @property
    def pace(self) -> float:
        """The speed it computes at when placed (1.0 unless degraded with a measured speed)."""
        return self.speed if self.speed is not None and self.state is GpuState.DEGRADED else 1.0


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    domain: str
    gpus: tuple[str, ...]  # UUIDs in local-index order


@dataclass(frozen=True)
class Domain:
    """A scale-up domain (NVLink domain / rack). GPUs are in (node, index) order."""

    id: str
    gpus: tuple[Gpu, ...]
    power_budget_w: float | None = None  # None: the job's power model derives one

    def __post_init__(self) -> None:
        for g in self.gpus:
            if g.domain != self.id:
                raise TopologyError(f"GPU {g.uuid} claims domain {g.domain!r} but is listed in {self.id!r}")
        if self.power_budget_w is not None and self.power_budget_w <= 0:
            raise TopologyError(f"domain {self.id}: power budget must be positive")

    @property
    def size(self) -> int:
        return len(self.gpus)

    @cached_property
    def uuids(self) -> tuple[str, ...]:
        return tuple(g.uuid for g in self.gpus)

    @cached_property
    def unplaceable(self) -> frozenset[int]:
        """Positions (within the domain) of GPUs that may not take TP work."""
        return frozenset(i for i, g in enumerate(self.gpus) if not g.placeable)

    @cached_property
    def slow(self) -> Mapping[int, float]:
        """Positions of placeable GPUs running below full speed (degraded), and their speed."""
        return {i: g.pace for i, g in enumerate(self.gpus) if g.placeable and g.pace < 1.0}

    @cached_property
    def nominal_sum_w(self) -> float:
        """Sum of the limits its GPUs run at when healthy (base caps where set)."""
        return sum(g.power.nominal_w for g in self.gpus)

    @cached_property
    def nodes(self) -> tuple[Node, ...]:
        order: dict[str, list[str]] = {}
        for g in self.gpus:
            order.setdefault(g.node, []).append(g.uuid)
        return tuple(Node(name, self.id, tuple(u)) for name, u in order.items())


@dataclass(frozen=True)
class Cluster:
    """Immutable snapshot of the whole cluster."""

    name: str
    domains: tuple[Domain, ...]
    # Derived look-ups. `with_states` passes them on (GPU positions never change), so a snapshot
    # derived from another costs O(changes); see _Shape.
    _shape: _Shape | None = field(default=None, repr=False, compare=False)
    _unhealthy: frozenset[int] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self._shape is None:
            object.__setattr__(self, "_shape", _Shape.of(self.domains))
        if self._unhealthy is None:
            object.__setattr__(
                self, "_unhealthy", frozenset(i for i, d in enumerate(self.domains) if d.unplaceable or d.slow)
            )

    @property
    def _index(self) -> Mapping[str, tuple[int, int]]:
        assert self._shape is not None
        return self._shape.index

    @property
    def domain_sizes(self) -> tuple[int, ...]:
        """GPUs per domain, in domain order (no domain object is touched)."""
        assert self._shape is not None
        return self._shape.sizes

    @property
    def domain_offsets(self) -> tuple[int, ...]:
        """Position of each domain's first GPU in `flat_uuids`."""
        assert self._shape is not None
        return self._shape.offsets

    @property
    def flat_uuids(self) -> tuple[str, ...]:
        """Every GPU's UUID in domain order (shared by all snapshots of this cluster)."""
        assert self._shape is not None
        return self._shape.flat_uuids

    @property
    def flat_index(self) -> Mapping[str, int]:
        """GPU UUID -> its position in `flat_uuids` (shared by all snapshots of this cluster)."""
        assert self._shape is not None
        return self._shape.flat_index

    @property
    def domain_ids(self) -> tuple[str, ...]:
        assert self._shape is not None
        return self._shape.ids

    @property
    def unhealthy_domains(self) -> frozenset[int]:
        """Positions of the domains that hold at least one unplaceable or slow (degraded) GPU."""
        assert self._unhealthy is not None
        return self._unhealthy

    @classmethod
    def build(cls, name: str, domains: Iterable[Domain]) -> Cluster:
        return cls(name, tuple(domains))

    # ---- look-ups -------------------------------------------------------------------------
    @property
    def domain_index(self) -> Mapping[str, int]:
        assert self._shape is not None
        return self._shape.domain_index

    def domain(self, domain_id: str) -> Domain:
        try:
            return self.domains[self.domain_index[domain_id]]
        except KeyError:
            raise TopologyError(f"unknown domain {domain_id!r}") from None

    def gpu(self, uuid: str) -> Gpu:
        try:
            d, i = self._index[uuid]
        except KeyError:
            raise TopologyError(f"unknown GPU {uuid!r}") from None
        return self.domains[d].gpus[i]

    def __contains__(self, uuid: object) -> bool:
        return uuid in self._index

    def gpus(self) -> Iterator[Gpu]:
        for d in self.domains:
            yield from d.gpus

    @property
    def gpu_count(self) -> int:
        return len(self._index)

    def nodes(self) -> Iterator[Node]:
        for d in self.domains:
            yield from d.nodes

    def count_by_state(self) -> dict[GpuState, int]:
        counts = dict.fromkeys(GpuState, 0)
        for d in self.domains:
            if not d.unplaceable:
                counts[GpuState.HEALTHY] += d.size
                continue
            for g in d.gpus:
                counts[g.state] += 1
        return counts

    # ---- changes ----------------------------------------------------------------------------
    def with_states(self, changes: Mapping[str, GpuState],
                    speeds: Mapping[str, float | None] | None = None) -> Cluster:
        """Return a snapshot with some GPUs' states changed. Untouched domains are shared.
        With `speeds`, the changed GPUs' speed factors are set too (absent from it: None).

        Raises TopologyError for an unknown UUID or a bad speed (and changes nothing)."""
        by_domain: dict[int, dict[int, tuple[GpuState, float | None, bool]]] = {}
        for uuid, state in changes.items():
            try:
                d, i = self._index[uuid]
            except KeyError:
                raise TopologyError(f"unknown GPU {uuid!r}") from None
            sp = None if speeds is None else speeds.get(uuid)
            if sp is not None and not 0 < sp <= 1:
                raise TopologyError(f"GPU {uuid}: speed must be in (0, 1], got {sp}")
            by_domain.setdefault(d, {})[i] = (GpuState(state), sp, speeds is not None)
        if not by_domain:
            return self
        domains = list(self.domains)
        unhealthy = set(self.unhealthy_domains)
        for d, edits in by_domain.items():
            old = domains[d]
            gpus = list(old.gpus)
            for i, (state, sp, set_speed) in edits.items():
                gpus[i] = replace(gpus[i], state=state, speed=sp) if set_speed else replace(gpus[i], state=state)
            domains[d] = Domain(old.id, tuple(gpus), old.power_budget_w)
            if domains[d].unplaceable or domains[d].slow:
                unhealthy.add(d)
            else:
                unhealthy.discard(d)
        # GPU positions are unchanged, so the derived look-ups are shared.
        return Cluster(self.name, tuple(domains), self._shape, frozenset(unhealthy))


@dataclass(frozen=True)
class _Shape:
    """What a snapshot's structure implies (shared by every snapshot with the same GPUs)."""

    index: Mapping[str, tuple[int, int]]
    domain_index: Mapping[str, int]
    sizes: tuple[int, ...]
    ids: tuple[str, ...]
    offsets: tuple[int, ...]  # position of each domain's first GPU in `flat_uuids`
    flat_uuids: tuple[str, ...]  # every GPU's UUID, domain after domain

    @classmethod
    def of(cls, domains: tuple[Domain, ...]) -> _Shape:
        sizes = tuple(len(d.gpus) for d in domains)
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += n
        return cls(
            _build_index(domains),
            {d.id: i for i, d in enumerate(domains)},
            sizes,
            tuple(d.id for d in domains),
            tuple(offsets),
            tuple(u for d in domains for u in d.uuids),
        )

    @cached_property
    def flat_index(self) -> Mapping[str, int]:
        """GPU UUID -> its position in `flat_uuids` (made on first use: ~5 MB at 100K GPUs)."""
        return {u: k for k, u in enumerate(self.flat_uuids)}


def _build_index(domains: tuple[Domain, ...]) -> dict[str, tuple[int, int]]:
    index: dict[str, tuple[int, int]] = {}
    seen_domains: set[str] = set()
    for d_pos, d in enumerate(domains):
        if d.id in seen_domains:
            raise TopologyError(f"duplicate domain id {d.id!r}")
        seen_domains.add(d.id)
        for i, g in enumerate(d.gpus):
            if g.uuid in index:
                raise TopologyError(f"duplicate GPU UUID {g.uuid!r}")
            index[g.uuid] = (d_pos, i)
    return index


def generate_cluster(
    domains: int,
    domain_size: int,
    gpus_per_node: int,
    *,
    name: str = "generated",
    power: PowerLimits = DEFAULT_POWER,
    power_budget_w: float | None = None,
) -> Cluster:
    """A regular cluster: `domains` domains of `domain_size` GPUs, `gpus_per_node` GPUs per node.

    UUIDs are deterministic (uuid5 of the names), so the same arguments give the same cluster."""
    if domains < 1:
        raise TopologyError("need at least one domain")
    if domain_size < 1 or gpus_per_node < 1:
        raise TopologyError("domain size and GPUs per node must be positive")
    if domain_size % gpus_per_node:
        raise TopologyError(
            f"domain size {domain_size} is not a multiple of GPUs per node {gpus_per_node}"
        )
    width = len(str(domains - 1))
    out = []
    for d in range(domains):
        did = f"nvl-{d:0{width}d}"
        gpus = []
        for n in range(domain_size // gpus_per_node):
            node = f"{did}-n{n:02d}"
            for i in range(gpus_per_node):
                uuid = synthetic_gpu_uuid(name, did, node, i)
                gpus.append(Gpu(uuid, node, did, i, GpuState.HEALTHY, power))
        out.append(Domain(did, tuple(gpus), power_budget_w))
    return Cluster(name, tuple(out))
