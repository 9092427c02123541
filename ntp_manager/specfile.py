"""Cluster and job spec files (YAML) -> topology and planner objects.

File formats (documented in docs/specs.md):

cluster.yaml
    name: sample
    defaults: {tdp_w: 1000, min_w: 200, max_w: 1300}     # optional per-GPU power limits
                                                        # (+ base_cap: 0.85, a fleet base cap)
    generate: {domains: 4, domain_size: 8, gpus_per_node: 4}   # either this ...
    domains:                                            # ... or explicit domains
      - id: nvl-0
        power_budget_w: 9200                            # optional rack budget
        nodes:
          - name: node-a
            gpus: 4                                     # a count (UUIDs derived) or a list of UUIDs
    states: {GPU-...: failed}                           # optional GPU state overrides

job.yaml
    name: demo
    tp: 8
    groups_per_replica: 1
    replicas: 3
    local_batch: 8
    min_tp: 4
    heads: 32
    mlp_columns: 4096
    scheme: ntp-pw
    spares: 1
    power: {max_boost: 1.3, exponent: 0.7, rack_headroom: 1.15}   # or curve: [[1.0, 1.0], [1.1, 1.069], ...]
    balance: layer                                    # or stage: units rotate over a stage's layers
    parameters: 480000000000                          # optional model size (or stage_bytes: [...])
    checkpoint: {dir: /shared/ckpt/demo, interval_steps: 500, keep_last: 3, keep_every: 5000}   # optional
    priority: 0                                       # the manager's sharing policy (JobPolicy)
    preemptible: false
    min_throughput: 0.0
    queue: false

Errors come out as `SpecError` with one readable line (file, field, problem).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    model_validator,
)

from ntp_manager.contract import limits
from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner.spec import (
    CHECKPOINT_DIR_MAX,
    CHECKPOINT_INTERVAL_MAX,
    CHECKPOINT_KEEP_MAX,
    CheckpointPolicy,
    JobSpec,
    PlanError,
    PowerModel,
    Scheme,
)
from ntp_manager.topology import Cluster, Domain, Gpu, PowerLimits, TopologyError, generate_cluster, synthetic_gpu_uuid


class SpecError(ValueError):
    """A spec file is missing, malformed or inconsistent."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# Strict scalars: `tp: true` or `tp: "8"` is an error, not 1 or 8; numbers are finite.
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Count = Annotated[StrictInt, Field(ge=1, le=limits.JOB_GPUS_MAX)]
DomainId = Annotated[
    str, Field(min_length=1, max_length=limits.DOMAIN_MAX, pattern=limits.IDENT_PATTERN),
]
PRIORITY_MAX = 1_000_000  # a job's highest priority
JobName = Annotated[
    str, Field(min_length=1, max_length=limits.JOB_NAME_MAX, pattern=limits.JOB_NAME_PATTERN),
]


def _curve_ok(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    for p, v in points:
        limits.finite("power.curve", p, 0.0, 100.0)
        limits.finite("power.curve", v, 0.0, 100.0)
    return points


class PowerDefaults(_Strict):
    tdp_w: Finite = Field(default=1000.0, gt=0, le=100_000)
    min_w: Finite | None = Field(default=None, gt=0, le=100_000)
    max_w: Finite | None = Field(default=None, gt=0, le=100_000)
    base_cap: Finite | None = Field(default=None, gt=0, le=1)  # fleet base cap, a share of max_w

    def limits(self) -> PowerLimits:
        return PowerLimits(
            self.tdp_w,
            self.min_w if self.min_w is not None else 0.2 * self.tdp_w,
            self.max_w if self.max_w is not None else 1.3 * self.tdp_w,
        ).with_base_cap(self.base_cap)


class GenerateSpec(_Strict):
    domains: StrictInt = Field(gt=0, le=limits.JOB_GPUS_MAX)
    domain_size: StrictInt = Field(gt=0, le=limits.TP_MAX)
    gpus_per_node: StrictInt = Field(gt=0, le=limits.GPUS_PER_NODE_MAX)
    power_budget_w: Finite | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _bounded(self) -> GenerateSpec:
        if self.domains * self.domain_size > 4 * limits.JOB_GPUS_MAX:
            raise ValueError(f"domains x domain_size is above {4 * limits.JOB_GPUS_MAX:,} GPUs")
        return self


class NodeSpec(_Strict):
    name: str = Field(min_length=1, max_length=limits.NODE_MAX)
    gpus: Annotated[StrictInt, Field(le=limits.GPUS_PER_NODE_MAX)] | list[str]


class DomainSpec(_Strict):
    id: str = Field(min_length=1, max_length=limits.DOMAIN_MAX)
    power_budget_w: Finite | None = Field(default=None, gt=0)
    nodes: list[NodeSpec] = Field(min_length=1)


class ClusterFile(_Strict):
    name: str = "cluster"
    defaults: PowerDefaults = PowerDefaults()
    generate: GenerateSpec | None = None
    domains: list[DomainSpec] | None = None
    states: dict[str, GpuState] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_source(self) -> ClusterFile:
        if (self.generate is None) == (self.domains is None):
            raise ValueError("give exactly one of 'generate' or 'domains'")
        return self

    def to_cluster(self) -> Cluster:
        power = self.defaults.limits()
        if self.generate is not None:
            g = self.generate
            cluster = generate_cluster(
                g.domains, g.domain_size, g.gpus_per_node, name=self.name, power=power,
                power_budget_w=g.power_budget_w,
            )
        else:
            doms = []
            for d in self.domains or []:
                gpus: list[Gpu] = []
                for n in d.nodes:
                    ids = (
                        [synthetic_gpu_uuid(self.name, d.id, n.name, i) for i in range(n.gpus)]
                        if isinstance(n.gpus, int)
                        else n.gpus
                    )
                    if isinstance(n.gpus, int) and n.gpus < 1:
                        raise TopologyError(f"node {n.name}: gpus must be positive")
                    gpus.extend(Gpu(u, n.name, d.id, i, GpuState.HEALTHY, power) for i, u in enumerate(ids))
                doms.append(Domain(d.id, tuple(gpus), d.power_budget_w))
            cluster = Cluster.build(self.name, doms)
        return cluster.with_states(self.states)


class PowerSpec(_Strict):
    max_boost: Finite = Field(default=1.3, ge=1.0, le=10.0)
    exponent: Finite = Field(default=0.7, gt=0.0, le=2.0)
    rack_headroom: Finite = Field(default=1.15, gt=0.0, le=100.0)
    unusable_draw_ratio: Finite = Field(default=0.0, ge=0.0, le=10.0)
    curve: Annotated[list[tuple[Finite, Finite]], AfterValidator(_curve_ok)] = Field(
        default_factory=list, max_length=limits.POWER_CURVE_POINTS_MAX
    )

    def model(self) -> PowerModel:
        return PowerModel(
            self.max_boost, self.exponent, self.rack_headroom, self.unusable_draw_ratio, tuple(self.curve)
        )


class CheckpointFile(_Strict):
    """Where and how often the job's workers checkpoint (planner.spec.CheckpointPolicy)."""

    dir: Annotated[str, Field(min_length=2, max_length=CHECKPOINT_DIR_MAX, pattern=r"^/[^\x00-\x1f\x7f]*$")]
    interval_steps: Annotated[StrictInt, Field(ge=1, le=CHECKPOINT_INTERVAL_MAX)]
    keep_last: Annotated[StrictInt, Field(ge=1, le=CHECKPOINT_KEEP_MAX)] = 3
    keep_every: Annotated[StrictInt, Field(ge=0, le=CHECKPOINT_INTERVAL_MAX)] = 0

    def policy(self) -> CheckpointPolicy:
        return CheckpointPolicy(self.dir, self.interval_steps, self.keep_last, self.keep_every)


class JobFile(_Strict):
    """A job spec. Every number is bounded: the GPUs it asks for ((replicas + spares) x
    groups_per_replica x tp) by `limits.JOB_GPUS_MAX` (the manager bounds them further by its
    `max_cluster_gpus`), its target batch by what the wire carries (uint32)."""

    name: JobName
    tp: Annotated[StrictInt, Field(ge=1, le=limits.TP_MAX)]
    groups_per_replica: Annotated[StrictInt, Field(ge=1, le=limits.TP_MAX)] = 1
    replicas: Count
    local_batch: Annotated[StrictInt, Field(ge=1, le=limits.INT32_MAX)]
    min_tp: Annotated[StrictInt, Field(ge=1, le=limits.TP_MAX)] = 1
    heads: Annotated[StrictInt, Field(ge=0, le=limits.UNIT_COUNT_MAX)] = 0
    mlp_columns: Annotated[StrictInt, Field(ge=0, le=limits.UNIT_COUNT_MAX)] = 0
    attention_share: Finite = Field(default=0.4, ge=0.0, le=1.0)
    scheme: Literal["dp-drop", "ntp", "ntp-pw"] = "ntp"
    spares: Annotated[StrictInt, Field(ge=0, le=limits.JOB_GPUS_MAX)] = 0
    domains: list[DomainId] = Field(default_factory=list, max_length=limits.JOB_DOMAINS_MAX)
    power: PowerSpec = PowerSpec()
    # how a reduced group's units are split: the same way in every layer, or rotated over a stage
    balance: Literal["layer", "stage"] = "layer"
    # state per pipeline stage (one, or one per stage)
    stage_bytes: list[Annotated[StrictInt, Field(ge=0, le=2**62)]] = Field(
        default_factory=list, max_length=limits.TP_MAX)
    parameters: Annotated[StrictInt, Field(ge=0, le=2**62)] = 0  # model size estimate when stage_bytes is not given
    bytes_per_parameter: Finite = Field(default=16.0, gt=0, le=1024)
    checkpoint: CheckpointFile | None = None
    # how the manager shares the cluster between jobs (docs/specs.md, "Many jobs"); not the planner's
    priority: Annotated[StrictInt, Field(ge=0, le=PRIORITY_MAX)] = 0
    preemptible: StrictBool = False
    min_throughput: Finite = Field(default=0.0, ge=0.0, le=1.0)
    queue: StrictBool = False

    @model_validator(mode="after")
    def _bounded(self) -> JobFile:
        gpus = (self.replicas + self.spares) * self.groups_per_replica * self.tp
        if gpus > limits.JOB_GPUS_MAX:
            raise ValueError(
                f"the job asks for (replicas + spares) x groups_per_replica x tp = {gpus:,} GPUs; "
                f"the limit is {limits.JOB_GPUS_MAX:,}"
            )
        if self.replicas * self.local_batch > 2**32 - 1:
            raise ValueError("replicas x local_batch (the global batch) must fit in 32 bits")
        return self

    def to_job(self) -> JobSpec:
        job = JobSpec(
            name=self.name, tp=self.tp, groups_per_replica=self.groups_per_replica,
            replicas=self.replicas, local_batch=self.local_batch, min_tp=self.min_tp,
            heads=self.heads, mlp_columns=self.mlp_columns, attention_share=self.attention_share,
            scheme=Scheme(self.scheme), spares=self.spares, domains=tuple(self.domains),
            power=self.power.model(), balance=self.balance, stage_bytes=tuple(self.stage_bytes),
            parameters=self.parameters,
            bytes_per_parameter=self.bytes_per_parameter,
            checkpoint=self.checkpoint.policy() if self.checkpoint is not None else None,
        )
        job.validate()
        return job

    def policy(self) -> JobPolicy:
        return JobPolicy(self.priority, self.preemptible, self.min_throughput, self.queue)


@dataclass(frozen=True)
class JobPolicy:
    """What a job asks of the cluster beside its layout: its `priority` (higher first for free
    capacity and pending placement), whether a higher-priority job may take a replica of it
    (`preemptible`), the planned throughput below which the manager grants it free domains
    (`min_throughput`, 0: never) and whether it waits for capacity (`queue`) instead of being refused."""

    priority: int = 0
    preemptible: bool = False
    min_throughput: float = 0.0
    queue: bool = False


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a text file (not UTF-8)") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SpecError(f"{path}: malformed YAML{where}: {getattr(e, 'problem', e)}") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path}: expected a mapping at the top level")
    return data


def _fmt_validation(path: Path | str, err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
    more = f" (and {err.error_count() - 1} more problem(s))" if err.error_count() > 1 else ""
    return f"{path}: {loc}: {first['msg']}{more}"


def cluster_from_dict(data: dict[str, Any], source: str = "cluster") -> Cluster:
    try:
        return ClusterFile.model_validate(data.get("cluster", data)).to_cluster()
    except ValidationError as e:
        raise SpecError(_fmt_validation(source, e)) from None
    except TopologyError as e:
        raise SpecError(f"{source}: {e}") from None


def job_from_dict(data: dict[str, Any], source: str = "job") -> JobSpec:
    try:
        return JobFile.model_validate(data.get("job", data)).to_job()
    except ValidationError as e:
        raise SpecError(_fmt_validation(source, e)) from None
    except PlanError as e:
        raise SpecError(f"{source}: {e}") from None


def job_and_policy_from_dict(data: dict[str, Any], source: str = "job") -> tuple[JobSpec, JobPolicy]:
    """The planner's spec and the manager's policy of one job spec (SpecError naming the field)."""
    try:
        f = JobFile.model_validate(data.get("job", data))
        return f.to_job(), f.policy()
    except ValidationError as e:
        raise SpecError(_fmt_validation(source, e)) from None
    except PlanError as e:
        raise SpecError(f"{source}: {e}") from None


def load_cluster(path: str | Path) -> Cluster:
    p = Path(path)
    return cluster_from_dict(_read_yaml(p), str(p))


def load_job(path: str | Path) -> JobSpec:
    p = Path(path)
    return job_from_dict(_read_yaml(p), str(p))
