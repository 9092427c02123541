"""Fail-slow in the simulator: a job's throughput with slow GPUs, doing nothing vs the planner's
decision (issue 21, item 4). Pure: the real planner on frozen snapshots, no clock, no I/O.

Throughput is samples per unit of time relative to the healthy job (1.0), with data-parallel
replicas in lockstep (every step ends with the gradient all-reduce):

- *nothing*: the layout stays as it was when all GPUs were healthy. A TP group computes at its
  slowest member's pace and a replica at its slowest group's, and every replica waits for the
  slowest one, so the job runs its healthy global batch at the pace of its slowest GPU in use:
  `global_batch / target x min pace`.
- *planner*: the slow GPUs are degraded at their speed and the job is replanned (the planner keeps,
  drops or replaces them: planner/slow.py). The planner sizes every replica's local batch so that
  no replica's step takes longer than a healthy one's (a kept slow GPU's replica runs fewer
  samples, or its group more power), so the plan's `relative_throughput` (global batch / target)
  is its throughput.
- *episode*: over `steps` training steps from the onset of the slowdown, the job runs as *nothing*
  until the detector has decided (`detect_steps`), loses `reshard_steps` of time to the reshard
  when the layout changes, and runs as *planner* afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec, Plan, make_plan
from ntp_manager.topology import Cluster


@dataclass(frozen=True, slots=True)
class SlowOutcome:
    nothing: float  # throughput doing nothing
    planner: float  # throughput of the planner's layout (steady state)
    episode: float  # over the episode: detection delay, then the reshard, then the new layout
    action: str  # what the planner did with the slow GPUs: keep / exclude / spare / mixed
    plan: Plan


def _pace_in_use(plan: Plan, speeds: Mapping[str, float]) -> float:
    pace = 1.0
    for r in plan.replicas:
        for g in r.groups:
            for u in g.gpus:
                pace = min(pace, speeds.get(u, 1.0))
    return pace


def slow_outcome(cluster: Cluster, job: JobSpec, speeds: Mapping[str, float], *, steps: int = 300,
                 detect_steps: int = 3, reshard_steps: int = 5) -> SlowOutcome:
    """Throughput of `job` on `cluster` (all GPUs healthy but those in `speeds`, which run at that
    speed), doing nothing vs replanned. Raises PlanError / TopologyError on bad input, ValueError
    for a bad episode."""
    if steps < 1 or detect_steps < 0 or reshard_steps < 0:
        raise ValueError("steps must be >= 1, detect_steps and reshard_steps >= 0")
    healthy = make_plan(cluster, job)
    nothing = healthy.relative_throughput * _pace_in_use(healthy, speeds)
    slow = cluster.with_states(dict.fromkeys(speeds, GpuState.DEGRADED), dict(speeds))
    plan = make_plan(slow, job, healthy)
    planner = plan.relative_throughput
    actions = set()
    for reason in plan.reasons:
        if "degraded" in reason and "stands by" in reason:
            actions = {"spare"}
            break
        if "degraded" in reason and ": keep (" in reason:
            actions.add("keep")
        elif "degraded" in reason and ": exclude (" in reason:
            actions.add("exclude")
    action = "+".join(sorted(actions)) or "none"
    changed = _changed(plan, healthy)
    d = min(detect_steps, steps)
    rs = min(reshard_steps if changed else 0, steps - d)
    episode = (d * nothing + (steps - d - rs) * planner) / steps
    return SlowOutcome(nothing, planner, episode, action, plan)


def _changed(a: Plan, b: Plan) -> bool:
    """Whether two plans run different layouts (groups, GPUs, batches or power)."""
    def shape(p: Plan) -> tuple[object, ...]:
        return (tuple((r.replica_id, r.local_batch, tuple((g.gpus, g.power_ratio) for g in r.groups))
                      for r in p.replicas), tuple(sorted(p.power_caps_w.items())))
    return shape(a) != shape(b)
