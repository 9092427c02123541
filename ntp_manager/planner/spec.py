"""What a job asks of the planner: the job spec, the scheme, and the power model.

Pure data with validation. `JobSpec.validate()` raises `PlanError` with one clear sentence for the
first problem found; the planner calls it, so library users get the same checks as the CLI.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from ntp_manager.contract.ntp_map import max_units_per_rank
from ntp_manager.planner.steptime import StepModel, StepModelError


class PlanError(ValueError):
    """The planner's input is invalid; the message says what and how to fix it."""


# The NTP paper's measured power points for a GPU under a training load: 1.1x power costs 2.8% of
# perf/W and 1.2x power 6.5%, i.e. speed 1.1 x 0.972 = 1.069x and 1.2 x 0.935 = 1.122x
# (docs/references.md, "NTP: the power curve"). Beyond 1.2x nothing was measured, so a curve ending here credits no
# speed for more power (the allocator never grants power past the last point).
PAPER_POWER_CURVE: tuple[tuple[float, float], ...] = ((1.0, 1.0), (1.1, 1.069), (1.2, 1.122))


class Scheme(StrEnum):
    DP_DROP = "dp-drop"  # uniform TP: a TP group with any unusable GPU is dropped
    NTP = "ntp"  # packed replicas run at their lowest TP degree with a smaller local batch
    NTP_PW = "ntp-pw"  # only the reduced group runs at lower TP; its GPUs get more power


@dataclass(frozen=True)
class PowerModel:
    """Per-GPU speed as a function of its power limit, and the rack budget.

    Ratios are relative to a GPU's *nominal* limit: the cluster's base power cap where one is set
    (topology.PowerLimits.base_w), else its default limit (TDP). Speed 1.0 is a GPU at its nominal
    limit, which is what the job's healthy step time is measured at.

    - speed(p) = p ** exponent for p = limit / nominal, unless `curve` gives measured
      (power ratio, speed ratio) points, which are interpolated linearly (monotone, since the
      points are) and extrapolated flat: no speed is credited beyond the last measured point
      (`PAPER_POWER_CURVE` holds the NTP paper's points).
    - A GPU may be raised to at most `max_boost` x nominal (and never above its own max limit).
    - A domain's budget is its configured `power_budget_w`, else `rack_headroom` x the sum of its
      GPUs' nominal limits. The default headroom of 1.15 models the paper's co-designed rack, whose
      power delivery can move the budget of failed GPUs to survivors and carry a boost on a few racks.
    - Unusable GPUs are assumed to draw `unusable_draw_ratio` x nominal (0: powered down); idle
      usable GPUs are counted at nominal, so the budget holds even if they start working.
    """

    max_boost: float = 1.3
    exponent: float = 0.7
    rack_headroom: float = 1.15
    unusable_draw_ratio: float = 0.0
    curve: tuple[tuple[float, float], ...] = ()

    def validate(self) -> None:
        if self.max_boost < 1.0:
            raise PlanError(f"power.max_boost must be >= 1.0, got {self.max_boost}")
        if not 0 < self.exponent <= 2:
            raise PlanError(f"power.exponent must be in (0, 2], got {self.exponent}")
        if self.rack_headroom <= 0:
            raise PlanError(f"power.rack_headroom must be positive, got {self.rack_headroom}")
        if not 0 <= self.unusable_draw_ratio <= self.max_boost:
            raise PlanError("power.unusable_draw_ratio must be between 0 and max_boost")
        if self.curve:
            ps = [p for p, _ in self.curve]
            ss = [s for _, s in self.curve]
            if len(self.curve) < 2 or ps != sorted(set(ps)) or ss != sorted(ss) or min(ss) <= 0:
                raise PlanError(
                    "power.curve needs >= 2 points with strictly increasing power and "
                    "non-decreasing positive speed"
                )

    def speed(self, power_ratio: float) -> float:
        if not self.curve:
            return float(power_ratio**self.exponent)
        return _interp(self.curve, power_ratio, 0)

    @property
    def max_speed(self) -> float:
        """Highest speed the model credits (inf for a power law)."""
        return self.curve[-1][1] if self.curve else float("inf")

    def useful_power(self, speed_ratio: float) -> float:
        """Power ratio worth granting towards `speed_ratio`: what reaches it, or, where the curve
        cannot, what reaches the curve's highest speed (more power would buy nothing)."""
        return self.power_for_speed(min(speed_ratio, self.max_speed))

    def describe(self) -> str:
        """One line naming the speed curve and the rack budget (for reports)."""
        if self.curve:
            pts = ", ".join(f"{p:g}x->{s:g}x" for p, s in self.curve)
            law = f"measured curve {pts} (flat beyond)"
        else:
            law = f"speed = power^{self.exponent:g}"
        return f"{law}; rack budget {self.rack_headroom:g} x nominal sum; per-GPU boost <= {self.max_boost:g}x"

    def power_for_speed(self, speed_ratio: float) -> float:
        """Smallest power ratio that reaches `speed_ratio` (may exceed max_boost)."""
        if not self.curve:
            return float(speed_ratio ** (1.0 / self.exponent))
        if speed_ratio > self.curve[-1][1] + 1e-12:
            return float("inf")
        return _interp(self.curve, speed_ratio, 1)


def _interp(points: Sequence[tuple[float, float]], x: float, axis: int) -> float:
    xs = [p[axis] for p in points]
    ys = [p[1 - axis] for p in points]
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    j = bisect.bisect_left(xs, x)
    if xs[j] == x:
        return ys[j]
    x0, x1, y0, y1 = xs[j - 1], xs[j], ys[j - 1], ys[j]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


CHECKPOINT_DIR_MAX = 4096  # characters (Linux PATH_MAX)
CHECKPOINT_INTERVAL_MAX = 2**31 - 1
CHECKPOINT_KEEP_MAX = 10_000


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where and how often a job's workers write unit-addressed checkpoints (worker/checkpoint/:
    any layout loads them, so the workers fall back to one when no survivor holds some unit). The
    manager records and hands on the policy; the workers write and verify the checkpoints.

    dir             absolute path of a directory every rank of the job sees (a shared filesystem)
    interval_steps  optimizer steps between checkpoints
    keep_last       the newest good checkpoints kept
    keep_every      also keep checkpoints whose step is a multiple of this (0: none)
    """

    dir: str
    interval_steps: int
    keep_last: int = 3
    keep_every: int = 0

    def validate(self) -> None:
        d = self.dir
        if not isinstance(d, str) or not d.startswith("/"):
            raise PlanError(f"checkpoint.dir must be an absolute path, got {d!r}")
        if len(d) > CHECKPOINT_DIR_MAX:
            raise PlanError(f"checkpoint.dir is {len(d)} characters long; the limit is {CHECKPOINT_DIR_MAX}")
        if any(ord(c) < 32 or ord(c) == 127 for c in d):
            raise PlanError("checkpoint.dir contains a control character")
        parts = d.split("/")
        if ".." in parts or "." in parts:
            raise PlanError(f"checkpoint.dir must not contain '.' or '..' components, got {d!r}")
        if d.rstrip("/") == "":
            raise PlanError("checkpoint.dir must not be the root directory")
        for name, v, lo, hi in (("interval_steps", self.interval_steps, 1, CHECKPOINT_INTERVAL_MAX),
                                ("keep_last", self.keep_last, 1, CHECKPOINT_KEEP_MAX),
                                ("keep_every", self.keep_every, 0, CHECKPOINT_INTERVAL_MAX)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise PlanError(f"checkpoint.{name} must be an integer in [{lo}, {hi}], got {v!r}")


@dataclass(frozen=True)
class JobSpec:
    """A training job as the planner sees it.

    tp                 healthy TP degree (<= domain size; a domain may hold several TP groups)
    groups_per_replica TP groups per DP replica (the pipeline depth)
    replicas           DP replicas when everything is healthy; target global batch is
                       replicas x local_batch samples
    min_tp             lowest TP degree the job tolerates (groups below it are dropped)
    heads, mlp_columns unit counts (attention heads or KV groups; MLP intermediate columns)
    attention_share    share of a rank's step time spent on attention units (rest: MLP units)
    local_batch        samples per replica per step when healthy
    spares             TP groups beyond replicas x groups_per_replica the job may draw on
    domains            domain ids the job may use, in order (empty: every domain of the cluster)
    balance            "layer" (default): every layer splits its units the same way, so a rank's
                       work is the most units any rank holds (ceil(U / t)); "stage": the extra
                       units rotate over the layers of a stage, so work is even, T / t (what the
                       NTP paper assumes: a replica contributes in proportion to its GPUs)
    step_model         optional `StepModel` (planner/steptime.py): when given, the reduced-batch
                       rule and the speed a boost must restore come from the step time (compute,
                       TP communication, pipeline fill and drain) instead of the work ratio alone;
                       its layout's tp and pp must be the job's tp and groups_per_replica, its
                       model's heads and ffn the job's units, one sequence per microbatch
    stage_bytes        optional: bytes of parameters + optimizer state one pipeline stage holds
                       (one value for every stage, or one per stage); what a TP group loads when it
                       changes stage. Used only to report and break ties between equal packings.
    parameters         optional model-size estimate used when stage_bytes is not given: the
                       model's parameter count, split evenly over the stages at
                       `bytes_per_parameter` each (16: bf16 weights and gradients, fp32 master
                       weights and two Adam moments)
    checkpoint         optional `CheckpointPolicy`: where and how often the workers checkpoint
    """

    name: str
    tp: int
    groups_per_replica: int
    replicas: int
    local_batch: int
    min_tp: int = 1
    heads: int = 0
    mlp_columns: int = 0
    attention_share: float = 0.4
    scheme: Scheme = Scheme.NTP
    spares: int = 0
    domains: tuple[str, ...] = ()
    power: PowerModel = field(default_factory=PowerModel)
    balance: str = "layer"
    step_model: StepModel | None = None
    stage_bytes: tuple[int, ...] = ()
    parameters: int = 0
    bytes_per_parameter: float = 16.0
    checkpoint: CheckpointPolicy | None = None

    @property
    def target_batch(self) -> int:
        return self.replicas * self.local_batch

    @property
    def primary_groups(self) -> int:
        return self.replicas * self.groups_per_replica

    def validate(self) -> None:
        if not self.name:
            raise PlanError("job name must not be empty")
        for attr in ("tp", "groups_per_replica", "replicas", "local_batch", "min_tp"):
            v = getattr(self, attr)
            if not isinstance(v, int) or v < 1:
                raise PlanError(f"{attr} must be a positive integer, got {v!r}")
        if self.min_tp > self.tp:
            raise PlanError(f"min_tp {self.min_tp} is above the healthy TP degree {self.tp}")
        if self.spares < 0:
            raise PlanError(f"spares must be >= 0, got {self.spares}")
        if self.heads < 0 or self.mlp_columns < 0:
            raise PlanError("unit counts (heads, mlp_columns) must be >= 0")
        if self.heads == 0 and self.mlp_columns == 0:
            raise PlanError("a job needs unit counts: heads and/or mlp_columns")
        for label, units in (("heads", self.heads), ("mlp_columns", self.mlp_columns)):
            if units and units < self.tp:
                raise PlanError(f"{label}={units} is smaller than tp={self.tp}: some rank would hold no unit")
        if not 0.0 <= self.attention_share <= 1.0:
            raise PlanError(f"attention_share must be in [0, 1], got {self.attention_share}")
        if len(set(self.domains)) != len(self.domains):
            raise PlanError("job domains contain duplicates")
        if self.stage_bytes and len(self.stage_bytes) not in (1, self.groups_per_replica):
            raise PlanError(
                f"stage_bytes needs one value or one per stage ({self.groups_per_replica}), got {len(self.stage_bytes)}"
            )
        if any(not isinstance(b, int) or b < 0 for b in self.stage_bytes):
            raise PlanError("stage_bytes must be non-negative integers (bytes)")
        if not isinstance(self.parameters, int) or self.parameters < 0:
            raise PlanError(f"parameters must be a non-negative integer, got {self.parameters!r}")
        if not self.bytes_per_parameter > 0:
            raise PlanError(f"bytes_per_parameter must be positive, got {self.bytes_per_parameter}")
        self.power.validate()
        if self.balance not in ("layer", "stage"):
            raise PlanError(f"balance must be 'layer' or 'stage', got {self.balance!r}")
        if self.step_model is not None:
            sm = self.step_model
            try:
                sm.validate()
            except StepModelError as e:
                raise PlanError(f"step_model: {e}") from None
            if (sm.layout.tp, sm.layout.pp) != (self.tp, self.groups_per_replica):
                raise PlanError(
                    f"step_model layout TP{sm.layout.tp} x PP{sm.layout.pp} is not the job's "
                    f"TP{self.tp} x {self.groups_per_replica} groups per replica"
                )
            if (sm.model.heads, sm.model.ffn) != (self.heads, self.mlp_columns):
                raise PlanError(
                    f"step_model units ({sm.model.heads} heads, {sm.model.ffn} MLP columns) are not the job's "
                    f"({self.heads}, {self.mlp_columns})"
                )
            if sm.balance != self.balance:
                raise PlanError(f"step_model balance {sm.balance!r} is not the job's {self.balance!r}")
        if self.checkpoint is not None:
            self.checkpoint.validate()

    def stage_sizes(self) -> dict[int, int] | None:
        """Bytes of state per pipeline stage (see stage_bytes / parameters), None when unknown."""
        P = self.groups_per_replica
        if self.stage_bytes:
            return {s: self.stage_bytes[s if len(self.stage_bytes) > 1 else 0] for s in range(P)}
        if self.parameters:
            per = int(self.parameters * self.bytes_per_parameter / P)
            return dict.fromkeys(range(P), per)
        return None

    # ---- the work model -----------------------------------------------------------------------
    def work(self, tp: int) -> float:
        """Per-sample step time of a rank at TP degree `tp`, relative to the healthy degree.

        A rank's time is set by the most units it holds of each kind (ceil(U / tp)); attention and
        MLP are weighted by `attention_share`. work(self.tp) == 1.0.
        Example: 128 heads, 81,920 columns, tp 32 -> 31, share 0.4:
        0.4 * 5/4 + 0.6 * 2643/2560 = 1.1195. With balance "stage": T / t."""
        if self.balance == "stage":
            return self.tp / tp
        parts = []
        if self.heads:
            parts.append((self.attention_share if self.mlp_columns else 1.0, self.heads))
        if self.mlp_columns:
            parts.append((1.0 - self.attention_share if self.heads else 1.0, self.mlp_columns))
        return sum(
            w * max_units_per_rank(u, tp) / max_units_per_rank(u, self.tp) for w, u in parts
        )

    def speed_needed(self, tp: int) -> float:
        """Relative compute speed at which a replica at degree `tp` keeps the healthy step time with
        the full local batch: work(tp), or from the step model (only compute speeds up, so it may be
        inf when communication alone is too slow)."""
        sm = self.step_model
        if sm is None:
            return self.work(tp)
        target = sm.pipeline_time(self.tp, self.local_batch) * (1.0 + 1e-9)
        if sm.pipeline_time(tp, self.local_batch) <= target:
            return 1.0
        hi = 2.0
        while sm.pipeline_time(tp, self.local_batch, hi) > target:
            hi *= 2.0
            if hi > 64.0:
                return float("inf")
        lo = 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            if sm.pipeline_time(tp, self.local_batch, mid) <= target:
                hi = mid
            else:
                lo = mid
        return hi

    def reduced_batch(self, tp: int, speed: float = 1.0) -> int:
        """Largest local batch at degree `tp` (GPUs at relative `speed`) whose step time does not
        exceed a healthy replica's: floor(local_batch * speed / work(tp)), or, with a step model,
        the largest number of sequences whose pipeline time does not exceed the healthy one."""
        if self.step_model is not None:
            return self.step_model.reduced_batch(tp, self.local_batch, speed)
        ratio = speed / self.work(tp)
        # Power ratios are rounded down to 1e-6 so caps stay within budget; a shortfall that small
        # is not worth a sample.
        if ratio >= 1.0 - 1e-6:
            return self.local_batch
        return int(self.local_batch * ratio + 1e-9)
