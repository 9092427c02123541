"""What the fail-slow detectors read: one training step's per-rank observations, plus GPU signals.

A worker measures, per rank and step, the time its GPU spent computing (kernels of the step's
micro-batches, waits excluded), the time it spent blocked in its TP group's collectives, and the
work it was given: tokens and the sum of squared sequence lengths of its micro-batches. Those two
numbers are what a transformer's step costs: linear layers scale with tokens, attention with
sum(len^2). The agent's per-GPU signals (throttle reasons, clocks, power, temperature) are joined in
by the caller when it has them; detectors use them as evidence only, never as a verdict on their own
(clocks drop on a healthy GPU whose power cap was lowered on purpose).

Everything here is plain frozen data; `StepObservation.validate()` is what a detector calls before
touching its state, so bad input raises `DetectError` and changes nothing.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

_MAX_INDEX = 1_000_000  # stages, TP degree
_MAX_TOKENS = 2**53  # tokens of one step: far beyond any real step, exact as a float


class DetectError(ValueError):
    """An observation a detector cannot use; the message names the field and the rank."""


# NVML clock-event reason bits (nvmlClocksEventReason*), named the way operators read them.
THROTTLE_BITS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Reasons that mean the GPU runs slower than it could (idle and settings do not).
SLOWING_REASONS = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
)


def throttle_names(mask: int) -> frozenset[str]:
    """Names of the reason bits set in an NVML clock-event mask (unknown bits as `bit0x...`)."""
    names = {name for bit, name in THROTTLE_BITS.items() if mask & bit}
    rest = mask & ~sum(THROTTLE_BITS)
    bit = 1
    while rest:
        if rest & bit:
            names.add(f"bit{bit:#x}")
            rest &= ~bit
        bit <<= 1
    return frozenset(names)


@dataclass(frozen=True, slots=True)
class GpuSignals:
    """The agent's latest read-only sample for one GPU; every field is optional (None: not read)."""

    throttle_reasons: frozenset[str] = frozenset()
    sm_clock_mhz: float | None = None
    sm_clock_max_mhz: float | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    temperature_c: float | None = None

    def validate(self, where: str) -> None:
        for name in ("sm_clock_mhz", "sm_clock_max_mhz", "power_w", "power_limit_w", "temperature_c"):
            v = getattr(self, name)
            if v is not None and not math.isfinite(v):
                raise DetectError(f"{where}: signals.{name} must be finite, got {v}")
        for name in ("sm_clock_max_mhz", "power_limit_w"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise DetectError(f"{where}: signals.{name} must be > 0, got {v}")

    def notes(self) -> tuple[str, ...]:
        """Human-readable remarks on what in this sample could slow the GPU."""
        out: list[str] = []
        slowing = sorted(self.throttle_reasons & SLOWING_REASONS)
        if slowing:
            out.append("throttled: " + ", ".join(slowing))
        if self.sm_clock_mhz is not None and self.sm_clock_max_mhz:
            ratio = self.sm_clock_mhz / self.sm_clock_max_mhz
            if ratio < 0.9:
                out.append(f"SM clock at {ratio:.0%} of max ({self.sm_clock_mhz:.0f}/{self.sm_clock_max_mhz:.0f} MHz)")
        if self.power_w is not None and self.power_limit_w:
            ratio = self.power_w / self.power_limit_w
            if ratio >= 0.97:
                out.append(f"power at {ratio:.0%} of limit ({self.power_w:.0f}/{self.power_limit_w:.0f} W)")
        if self.temperature_c is not None and self.temperature_c >= 85:
            out.append(f"temperature {self.temperature_c:.0f} C")
        return tuple(out)


@dataclass(frozen=True, slots=True)
class RankObservation:
    """One rank's step.

    - `gpu`: the GPU's UUID (a detector's state is keyed by it).
    - `stage`: pipeline stage (ranks of one stage run the same layers and are peers).
    - `group`: id of its TP group (members run the same micro-batches, shard by shard).
    - `tp`: that group's TP degree; a rank's share of the work is 1/tp of the group's.
    - `compute_s`: seconds the GPU computed this step (waits excluded).
    - `comm_wait_s`: seconds blocked in the TP group's collectives (waiting for slower members
      plus the transfers); pipeline and data-parallel waits are not part of it.
    - `tokens`, `sumsq`: tokens of the step's micro-batches and the sum over their sequences of
      length^2 (the whole group's work, not divided by tp).
    - `speed`: the speed the plan expects of this GPU relative to a healthy one at TDP (e.g. 1.2
      when power-boosted); the prediction is divided by it. 1.0 when unknown.
    - `signals`: the agent's latest sample for the GPU, when the caller has one.
    """

    gpu: str
    stage: int
    group: str
    tp: int
    compute_s: float
    comm_wait_s: float
    tokens: int
    sumsq: float
    speed: float = 1.0
    signals: GpuSignals | None = field(default=None, compare=False)

    def validate(self, where: str) -> None:
        if not self.gpu:
            raise DetectError(f"{where}: gpu must be a non-empty UUID")
        if not self.group:
            raise DetectError(f"{where} ({self.gpu}): group must be a non-empty id")
        if self.stage < 0:
            raise DetectError(f"{where} ({self.gpu}): stage must be >= 0, got {self.stage}")
        if self.stage > _MAX_INDEX:
            raise DetectError(f"{where} ({self.gpu}): stage must be <= {_MAX_INDEX}, got {self.stage}")
        if not 1 <= self.tp <= _MAX_INDEX:
            raise DetectError(f"{where} ({self.gpu}): tp must be in 1..{_MAX_INDEX}, got {self.tp}")
        for name in ("compute_s", "comm_wait_s", "sumsq"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise DetectError(f"{where} ({self.gpu}): {name} must be finite and >= 0, got {v}")
        if not 0 <= self.tokens <= _MAX_TOKENS:
            raise DetectError(f"{where} ({self.gpu}): tokens must be in 0..{_MAX_TOKENS}, got {self.tokens}")
        if self.tokens > 0 and self.sumsq > float(self.tokens) ** 2:
            # sum(len^2) <= (sum len)^2: anything above means the fields were mixed up.
            raise DetectError(
                f"{where} ({self.gpu}): sumsq {self.sumsq:g} exceeds tokens^2 = {float(self.tokens) ** 2:g}"
            )
        if not (math.isfinite(self.speed) and self.speed > 0):
            raise DetectError(f"{where} ({self.gpu}): speed must be finite and > 0, got {self.speed}")
        if self.signals is not None:
            self.signals.validate(f"{where} ({self.gpu})")


@dataclass(frozen=True, slots=True)
class Columns:
    """A validated step as arrays: the ranks that had work (tokens > 0 and compute > 0), and their
    TP groups in order of first appearance. What detectors compute on."""

    step: int
    ranks: tuple[RankObservation, ...]
    gpus: list[str]
    compute: npt.NDArray[np.float64]
    wait: npt.NDArray[np.float64]
    speed: npt.NDArray[np.float64]
    gidx: npt.NDArray[np.int64]  # group index of each rank
    groups: list[str]
    g_stage: npt.NDArray[np.int64]
    g_tp: npt.NDArray[np.float64]
    g_tokens: npt.NDArray[np.float64]
    g_sumsq: npt.NDArray[np.float64]
    g_members: npt.NDArray[np.int64]  # members reporting this step


@dataclass(frozen=True, slots=True)
class StepObservation:
    """All ranks' observations of one training step (a missing rank is simply absent)."""

    step: int
    ranks: tuple[RankObservation, ...]

    def validate(self, max_ranks: int) -> None:
        """Raise DetectError on the first bad field: negative step, too many ranks, a GPU twice,
        a group whose members disagree on stage, tp or work, or a bad rank."""
        self.columns(max_ranks)

    def columns(self, max_ranks: int) -> Columns:
        """Validate (as `validate`) and return the ranks with work as arrays. Checks are vectorised;
        on a failure the offending rank's own `validate` names the field."""
        step = self.step
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise DetectError(f"step must be an integer >= 0, got {step!r}")
        ranks = self.ranks
        n = len(ranks)
        if n > max_ranks:
            raise DetectError(f"step {step}: {n} ranks exceed max_ranks={max_ranks}")
        # one pass for what needs Python: types, names, groups, which ranks carry signals
        gpus: list[str] = []
        gid: dict[str, int] = {}
        first: list[int] = []
        gix: list[int] = []
        with_signals: list[int] = []
        bad: int | None = -1
        for i, r in enumerate(ranks):
            if r.__class__ is not RankObservation:
                bad = None
                break
            g, grp = r.gpu, r.group
            if g.__class__ is not str or grp.__class__ is not str or not g or not grp:
                bad = None
                break
            gpus.append(g)
            k = gid.get(grp)
            if k is None:
                k = gid[grp] = len(first)
                first.append(i)
            gix.append(k)
            if r.signals is not None:
                with_signals.append(i)
        if bad is not None:
            try:
                compute = np.array([r.compute_s for r in ranks], dtype=np.float64)
                wait = np.array([r.comm_wait_s for r in ranks], dtype=np.float64)
                sumsq = np.array([r.sumsq for r in ranks], dtype=np.float64)
                speed = np.array([r.speed for r in ranks], dtype=np.float64)
                tokens = np.array([r.tokens for r in ranks], dtype=np.int64)
                stage = np.array([r.stage for r in ranks], dtype=np.int64)
                tp = np.array([r.tp for r in ranks], dtype=np.int64)
            except (TypeError, ValueError, OverflowError):
                bad = None
            else:
                with np.errstate(invalid="ignore", over="ignore"):
                    tok_f = tokens.astype(np.float64)
                    bad_mask = ~(
                        np.isfinite(compute) & (compute >= 0) & np.isfinite(wait) & (wait >= 0)
                        & np.isfinite(sumsq) & (sumsq >= 0) & np.isfinite(speed) & (speed > 0)
                        & (tokens >= 0) & (tokens <= _MAX_TOKENS) & (stage >= 0) & (stage <= _MAX_INDEX)
                        & (tp >= 1) & (tp <= _MAX_INDEX) & ((tokens == 0) | (sumsq <= tok_f * tok_f))
                    )
                bad = int(np.argmax(bad_mask)) if bad_mask.any() else -1
        if bad is None or bad >= 0:
            for i, r in enumerate(ranks):
                if not isinstance(r, RankObservation):
                    raise DetectError(f"step {step} rank[{i}]: expected RankObservation, got {type(r).__name__}")
                for name in ("gpu", "group"):
                    v = getattr(r, name)
                    if not isinstance(v, str):
                        raise DetectError(f"step {step} rank[{i}]: {name} must be a string, got {v!r}")
                for name in ("stage", "tp", "tokens"):
                    v = getattr(r, name)
                    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                        raise DetectError(f"step {step} rank[{i}] ({r.gpu}): {name} must be an integer, got {v!r}")
                for name in ("compute_s", "comm_wait_s", "sumsq", "speed"):
                    v = getattr(r, name)
                    if isinstance(v, bool) or not isinstance(v, numbers.Real):
                        raise DetectError(f"step {step} rank[{i}] ({r.gpu}): {name} must be a number, got {v!r}")
                r.validate(f"step {step} rank[{i}]")
            raise DetectError(f"step {step}: the ranks' fields could not be read as numbers")  # pragma: no cover
        if len(set(gpus)) != n:
            seen: set[str] = set()
            for g in gpus:
                if g in seen:
                    raise DetectError(f"step {step}: gpu {g} reported twice")
                seen.add(g)
        gidx = np.array(gix, dtype=np.int64)
        lead = np.array(first, dtype=np.int64)[gidx]
        differ = (stage != stage[lead]) | (tp != tp[lead]) | (tokens != tokens[lead]) | (sumsq != sumsq[lead])
        if differ.any():
            i = int(np.argmax(differ))
            a, b = ranks[int(lead[i])], ranks[i]
            raise DetectError(
                f"step {step}: members of group {b.group} disagree on stage/tp/tokens/sumsq "
                f"({a.gpu}: {a.stage}/{a.tp}/{a.tokens}/{a.sumsq:g}, {b.gpu}: {b.stage}/{b.tp}/{b.tokens}/{b.sumsq:g})"
            )
        for i in with_signals:
            r = ranks[i]
            assert r.signals is not None
            r.signals.validate(f"step {step} rank[{i}] ({r.gpu})")
        # keep the ranks with work
        work = (tokens > 0) & (compute > 0)
        if not work.all():
            keep = np.nonzero(work)[0]
            ranks = tuple(ranks[i] for i in keep.tolist())
            gpus = [gpus[i] for i in keep.tolist()]
            compute, wait, speed, old_g = compute[keep], wait[keep], speed[keep], gidx[keep]
            used, gidx = np.unique(old_g, return_inverse=True)
            first = [first[g] for g in used.tolist()]
        firsts = np.array(first, dtype=np.int64)
        orig = self.ranks
        return Columns(
            step=step, ranks=ranks, gpus=gpus, compute=compute, wait=wait, speed=speed,
            gidx=gidx.astype(np.int64), groups=[orig[i].group for i in first],
            g_stage=stage[firsts] if len(firsts) else np.empty(0, np.int64),
            g_tp=tp[firsts].astype(np.float64) if len(firsts) else np.empty(0),
            g_tokens=tokens[firsts].astype(np.float64) if len(firsts) else np.empty(0),
            g_sumsq=sumsq[firsts] if len(firsts) else np.empty(0),
            g_members=np.bincount(gidx, minlength=len(first)).astype(np.int64),
        )
