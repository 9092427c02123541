"""What a layout change costs: the stall model of the trace simulator.

Every time the plan changes (a failure or a repair that the job acts on), training stops for a
while. A `StallModel` says how long, and whether repairs are acted on at once, for free, or only at
the next failure. Three presets:

- `restart`: the NTP paper's way, restart the job from its last checkpoint on every failure. We
  charge 10 minutes per failure, the synchronous-training stall per failure that the FT-HSDP paper
  reports at ~100K GPUs (detection, restart, checkpoint load, lost work), and act on repairs only
  at the next restart (restarting for a repair would cost the same again).
- `ft-hsdp`: the FT-HSDP paper's reported stall per failure at ~100K GPUs, 3 minutes; repairs are
  free (a recovering replica catches up from a peer while the others train).
- `live`: this project's runtime (bench/RESULTS.md): detection 0.16 s (a killed rank noticed by
  its peers, the 118M failover benchmark), plan + push + regroup 0.27 s (the end-to-end benchmark:
  plan 0.02 s, push and new process groups 0.25 s), one step redone (the step in flight is
  abandoned: the healthy step time of the job's step model), and the reshard, scaled to the job's
  state from what the planner reports: a group that changes stage (`Plan.moves`: stage_changed,
  bytes) loads its stage's state, `bytes / stage_changed / tp` per GPU, from a DP peer over the
  scale-out network; a group that stays but changes degree from t to t' fetches the lost shards,
  `stage bytes x (1/t' - 1/t)` per GPU (t' < t), or a returning rank loads `stage bytes / t'`;
  groups reshard in parallel, so the slowest one counts. Repairs stall too (the runtime regroups
  at a step boundary to take them in). Communicator creation at 32K-100K ranks was not measured;
  `regroup_s` is where a slower one goes (docs/simulation.md shows 30 s as a pessimistic case).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ntp_manager.planner import JobSpec, Plan
from ntp_manager.sim.failures import SimError

Repairs = Literal["stall", "free", "deferred"]


@dataclass(frozen=True)
class StallModel:
    name: str
    fixed_s: float = 0.0  # per change, whatever it moves (detection + restart, or + regroup)
    detect_s: float = 0.0
    regroup_s: float = 0.0
    redo_steps: float = 0.0  # healthy steps lost per change
    reshard: bool = False  # add the reshard time from the bytes the plan moves
    net_bw: float = 40e9  # bytes/s per GPU for shards fetched from a DP peer (400 Gb/s at 80%)
    repairs: Repairs = "stall"

    def validate(self) -> None:
        for f in ("fixed_s", "detect_s", "regroup_s", "redo_steps"):
            if getattr(self, f) < 0:
                raise SimError(f"stall model {self.name}: {f} must be >= 0")
        if self.net_bw <= 0:
            raise SimError(f"stall model {self.name}: net_bw must be positive")
        if self.repairs not in ("stall", "free", "deferred"):
            raise SimError(f"stall model {self.name}: repairs must be 'stall', 'free' or 'deferred'")

    def stall_s(self, job: JobSpec, plan: Plan, previous: Plan | None, step_s: float) -> float:
        """Seconds training stops for the change from `previous` to `plan`."""
        s = self.fixed_s + self.detect_s + self.regroup_s + self.redo_steps * step_s
        if self.reshard:
            s += reshard_s(job, plan, previous, self.net_bw)
        return s


def reshard_s(job: JobSpec, plan: Plan, previous: Plan | None, net_bw: float) -> float:
    """The slowest group's reshard: a stage load for groups that change stage, the lost or new
    shards for groups that keep their stage but change degree (0 without stage sizes)."""
    sizes = job.stage_sizes()
    if sizes is None or previous is None:
        return 0.0
    before = {(g.domain_pos, g.local): g.tp for r in previous.replicas for g in r.groups}
    worst = 0.0
    for r in plan.replicas:
        for g in r.groups:
            stage = sizes[g.stage]
            if g.prev_stage is None or g.prev_stage != g.stage:
                per_gpu = stage / g.tp
            else:
                t_old = before.get((g.domain_pos, g.local), g.tp)
                per_gpu = stage * (1 / g.tp - 1 / t_old) if g.tp < t_old else (stage / g.tp if g.tp > t_old else 0.0)
            worst = max(worst, per_gpu / net_bw)
    return worst


STALL_PRESETS: dict[str, StallModel] = {
    "none": StallModel("none", repairs="free"),
    "restart": StallModel("restart", fixed_s=600.0, repairs="deferred"),
    "ft-hsdp": StallModel("ft-hsdp", fixed_s=180.0, repairs="free"),
    "live": StallModel("live", detect_s=0.16, regroup_s=0.27, redo_steps=1.0, reshard=True, repairs="stall"),
}


def stall_preset(name: str) -> StallModel:
    try:
        return STALL_PRESETS[name]
    except KeyError:
        raise SimError(f"unknown stall model {name!r}; choose one of: {', '.join(STALL_PRESETS)}") from None
