"""Named simulation set-ups.

paper-32k     the NTP paper's evaluation (docs/references.md): 32,768 GPUs in 1,024 NVL32
              domains, healthy TP32 (reduced down to TP28), 8 TP groups per replica -> 128 replicas,
              128 heads, 81,920 MLP columns, 1,024 sequences per step (local batch 8), Llama 3 failure
              rates, 3-day hardware repair (5 with --repair-days 5), 3-hour software repair.
paper-100k    the same job scaled to 100,000 GPUs: 3,125 NVL32 domains, 390 replicas of 8 TP32 groups.
nvl72-tp64    32,760 GPUs in 455 NVL72 domains (GB200-like, 4 GPUs per tray), one TP64 group per
              domain and replica: each domain's 8 leftover GPUs fill failed slots of its group.
uniform-tp64  32,768 GPUs in NVL64 domains, one TP64 group per replica: the paper's availability
              example for uniform TP64.
small         4 NVL8 domains, TP8, 2 groups per replica, for tests and quick looks.

Multi-job presets (`MULTI_PRESETS`, sim/multijob.py): jobs-32k and jobs-100k, eight jobs of the
paper's shape with mixed priorities on 32,768 and 100,000 GPUs; jobs-small for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from ntp_manager.planner import PAPER_POWER_CURVE, JobSpec, PowerModel, Scheme
from ntp_manager.planner.steptime import Hardware, Layout, ModelShape, StepModel
from ntp_manager.sim.failures import FailureModel, SimError
from ntp_manager.sim.multijob import JobEntry, MultiSetup
from ntp_manager.topology import DEFAULT_POWER, Cluster, PowerLimits, generate_cluster


@dataclass(frozen=True)
class Preset:
    name: str
    domains: int
    domain_size: int
    gpus_per_node: int
    job: JobSpec
    model: FailureModel
    description: str
    step_s: float | None = None  # healthy step seconds (what a redone step costs in a stall)


# Every preset states its power model: the paper's measured speed curve (flat beyond 1.2x), a rack
# budget of 1.15 x its GPUs' nominal sum, at most 1.3x per GPU. NTP-PW's result rests on the budget;
# docs/simulation.md has the loss as a function of it.
PAPER_POWER = PowerModel(max_boost=1.3, rack_headroom=1.15, curve=PAPER_POWER_CURVE)

# The paper's 480B model on B200s in the paper's layout: TP32 x 8 stages x 128 replicas, 8 sequences
# of 16K tokens per replica, 12 interleaved chunks per stage (planner/steptime.py states the model).
PAPER_STEP = StepModel(ModelShape(), Hardware(), Layout(tp=32, pp=8, dp=128, domain=32, interleave=12))
PAPER_STEP_S = PAPER_STEP.breakdown(8).total  # ~1.75 s
PAPER_PARAMS = ModelShape().params  # 503e9 (the paper's "480B"): 16 bytes each -> ~1 TB of state per stage

PRESETS: dict[str, Preset] = {
    "paper-32k": Preset(
        "paper-32k", 1024, 32, 4,
        JobSpec(
            name="paper-480b", tp=32, groups_per_replica=8, replicas=128, local_batch=8, min_tp=28,
            heads=128, mlp_columns=81_920, attention_share=0.4, scheme=Scheme.NTP, power=PAPER_POWER,
            parameters=PAPER_PARAMS,
        ),
        FailureModel(hardware_repair_h=72.0),
        "32,768 GPUs, NVL32, TP32, 8 groups/replica, 128 replicas, Llama 3 rates",
        PAPER_STEP_S,
    ),
    "paper-100k": Preset(
        "paper-100k", 3125, 32, 4,
        JobSpec(
            name="paper-480b-100k", tp=32, groups_per_replica=8, replicas=390, local_batch=8, min_tp=28,
            heads=128, mlp_columns=81_920, attention_share=0.4, scheme=Scheme.NTP, power=PAPER_POWER,
            parameters=PAPER_PARAMS,
        ),
        FailureModel(hardware_repair_h=72.0),
        "100,000 GPUs, NVL32, the paper's job scaled: TP32, 8 groups/replica, 390 replicas (3,120 domains)",
        PAPER_STEP_S,
    ),
    "nvl72-tp64": Preset(
        "nvl72-tp64", 455, 72, 4,
        JobSpec(
            name="tp64-nvl72", tp=64, groups_per_replica=1, replicas=455, local_batch=2, min_tp=56,
            heads=128, mlp_columns=81_920, scheme=Scheme.DP_DROP, power=PAPER_POWER,
        ),
        FailureModel(hardware_repair_h=72.0),
        "32,760 GPUs in NVL72 domains, TP64 per domain: 8 leftover GPUs per domain act as in-domain spares",
    ),
    "uniform-tp64": Preset(
        "uniform-tp64", 512, 64, 4,
        JobSpec(
            name="tp64", tp=64, groups_per_replica=1, replicas=512, local_batch=2, min_tp=64,
            heads=128, mlp_columns=81_920, scheme=Scheme.DP_DROP, power=PAPER_POWER,
        ),
        FailureModel(hardware_repair_h=72.0),
        "32,768 GPUs, NVL64, uniform TP64, one group per replica",
    ),
    "small": Preset(
        "small", 4, 8, 4,
        JobSpec(
            name="small", tp=8, groups_per_replica=2, replicas=2, local_batch=8, min_tp=4,
            heads=32, mlp_columns=4096, scheme=Scheme.NTP, power=PAPER_POWER,
        ),
        FailureModel(),
        "32 GPUs, NVL8, TP8, 2 groups/replica",
    ),
}


def preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise SimError(f"unknown preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}") from None


def preset_cluster(p: Preset, spare_domains: int = 0, power: PowerLimits = DEFAULT_POWER) -> Cluster:
    """The preset's cluster with `spare_domains` extra domains after the job's own; every GPU has the
    power limits `power` (default 1000 W, 200-1300 W; a base cap in `power.base_w` applies)."""
    return generate_cluster(p.domains + spare_domains, p.domain_size, p.gpus_per_node, name=p.name, power=power)


# ---- multi-job presets (sim/multijob.py) -----------------------------------------------------------


@dataclass(frozen=True)
class MultiPreset:
    name: str
    domains: int
    domain_size: int
    gpus_per_node: int
    jobs: tuple[JobEntry, ...]
    pool: int  # spare domains after the jobs' home domains
    model: FailureModel
    description: str
    step_s: float | None = None  # healthy step seconds (what a redone step costs in a stall)


def _paper_job(name: str, replicas: int, spares: int) -> JobSpec:
    """The paper's job shape (TP32, 8 groups per replica, 8 sequences each) at another size."""
    return JobSpec(
        name=name, tp=32, groups_per_replica=8, replicas=replicas, local_batch=8, min_tp=28, heads=128,
        mlp_columns=81_920, attention_share=0.4, scheme=Scheme.NTP, power=PAPER_POWER, spares=spares,
        parameters=PAPER_PARAMS,
    )


def _eight_jobs(replicas: tuple[int, ...], spares: tuple[int, ...]) -> tuple[JobEntry, ...]:
    """Eight jobs A-H, biggest first: priorities 3, 3, 2, 2, 1, 1, 0, 0; G and H preemptible; every
    job asks the pool for more when it runs below its full throughput (min_throughput 1.0)."""
    priorities = (3, 3, 2, 2, 1, 1, 0, 0)
    return tuple(
        JobEntry(_paper_job(name, r, s), priority=p, preemptible=p == 0, min_throughput=1.0)
        for name, r, s, p in zip("ABCDEFGH", replicas, spares, priorities, strict=True)
    )


MULTI_PRESETS: dict[str, MultiPreset] = {
    "jobs-32k": MultiPreset(
        "jobs-32k", 1024, 32, 4,
        _eight_jobs((32, 24, 16, 16, 12, 10, 8, 5), (2, 2, 1, 1, 1, 1, 0, 0)),
        40, FailureModel(hardware_repair_h=72.0),
        "32,768 GPUs in 1,024 NVL32 domains: 8 jobs of the paper's shape (TP32 x 8 groups, 5-32 replicas, "
        "984 home domains), 40 spare domains, mixed priorities, Llama 3 rates",
        PAPER_STEP_S,
    ),
    "jobs-100k": MultiPreset(
        "jobs-100k", 3125, 32, 4,
        _eight_jobs((96, 72, 52, 48, 40, 32, 24, 14), (6, 4, 3, 3, 2, 2, 1, 1)),
        101, FailureModel(hardware_repair_h=72.0),
        "100,000 GPUs in 3,125 NVL32 domains: 8 jobs of the paper's shape (14-96 replicas, 3,024 home "
        "domains), 101 spare domains, mixed priorities, Llama 3 rates",
        PAPER_STEP_S,
    ),
    "jobs-small": MultiPreset(
        "jobs-small", 16, 8, 4,
        tuple(
            JobEntry(JobSpec(name=n, tp=8, groups_per_replica=2, replicas=r, local_batch=8, min_tp=4, heads=32,
                             mlp_columns=4096, scheme=Scheme.NTP, power=PAPER_POWER, spares=s),
                     priority=p, preemptible=p == 0, min_throughput=1.0)
            for n, r, s, p in (("A", 2, 1, 2), ("B", 2, 0, 1), ("C", 2, 0, 0))
        ),
        3, FailureModel(rate_multiplier=50.0),
        "16 NVL8 domains: 3 jobs of 2 replicas x 2 TP8 groups, 3 spare domains, 50x Llama 3 rates (tests)",
    ),
}


def multi_preset(name: str) -> MultiPreset:
    try:
        return MULTI_PRESETS[name]
    except KeyError:
        raise SimError(f"unknown multi-job preset {name!r}; choose one of: {', '.join(MULTI_PRESETS)}") from None


def multi_setup(p: MultiPreset, pool: int | None = None) -> MultiSetup:
    """The preset's cluster, jobs and failure model (`pool` overrides its spare domains)."""
    cluster = generate_cluster(p.domains, p.domain_size, p.gpus_per_node, name=p.name)
    return MultiSetup.create(cluster, p.jobs, p.model, p.pool if pool is None else pool)
