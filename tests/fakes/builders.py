"""Small builders for clusters and jobs used across the tests."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec, Scheme
from ntp_manager.topology import Cluster, Domain, Gpu, PowerLimits


def cluster_from_counts(
    domain_sizes: Sequence[int],
    failed: Iterable[tuple[int, int]] = (),
    *,
    gpus_per_node: int = 4,
    power: PowerLimits = PowerLimits(),
    budget_w: float | None = None,
) -> Cluster:
    """Domains d0, d1, ... of the given sizes; `failed` lists (domain, position) pairs."""
    bad = set(failed)
    domains = []
    for d, size in enumerate(domain_sizes):
        gpus = tuple(
            Gpu(
                f"GPU-{d}-{i}", f"d{d}-n{i // gpus_per_node}", f"d{d}", i % gpus_per_node,
                GpuState.FAILED if (d, i) in bad else GpuState.HEALTHY, power,
            )
            for i in range(size)
        )
        domains.append(Domain(f"d{d}", gpus, budget_w))
    return Cluster.build("test", domains)


def cluster_with_usable(tp: int, usable: Sequence[int]) -> Cluster:
    """One domain of size `tp` per entry, whose last `tp - usable[i]` GPUs are failed."""
    failed = [(d, p) for d, u in enumerate(usable) for p in range(u, tp)]
    return cluster_from_counts([tp] * len(usable), failed)


def job(
    *,
    tp: int = 4,
    pp: int = 1,
    replicas: int = 2,
    batch: int = 8,
    min_tp: int = 1,
    scheme: Scheme = Scheme.NTP,
    spares: int = 0,
    heads: int = 16,
    mlp: int = 64,
    **kw: object,
) -> JobSpec:
    return JobSpec(
        name="t", tp=tp, groups_per_replica=pp, replicas=replicas, local_batch=batch, min_tp=min_tp,
        heads=heads, mlp_columns=mlp, scheme=scheme, spares=spares, **kw,  # type: ignore[arg-type]
    )
