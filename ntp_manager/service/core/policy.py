"""Pure policies of the service: `policy(now, state, options) -> decision with a reason`.

No clock is read, nothing is stored or sent: the components (liveness, breaker, maintenance)
gather the state, call a policy, and carry out its decision. Tests call these like functions, with
times made up on the spot.

- `liveness`: what a node's silence does to one of its GPUs (suspect, then failed).
- `reconnect`: what an agent's return does to a GPU whose verdict rested on silence.
- `breaker`: whether failures inside the window open the circuit breaker.
- `drain_due`: whether a node's drain deadline has passed.
- `maintenance`: what a maintenance window does to its GPUs now (start, end, nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.state import SILENCE_SOURCES, HealthSource


@dataclass(frozen=True, slots=True)
class LivenessOptions:
    suspect_after_s: float
    fail_after_s: float


@dataclass(frozen=True, slots=True)
class HealthDecision:
    """A new health state for a GPU (None: leave it) and why."""

    health: GpuState | None
    reason: str


KEEP_HEALTH = HealthDecision(None, "")


def liveness(now: float, last_seen: float, node: str, health: GpuState, options: LivenessOptions) -> HealthDecision:
    """A GPU of a node last heard from at `last_seen` (monotonic seconds, like `now`).

    Silent past `fail_after_s`: failed, unless it already is. Silent past `suspect_after_s` only:
    a healthy GPU becomes suspect (still placeable: no churn on a hiccup); degraded and failed stay
    as they are. Heard from within `suspect_after_s`: nothing changes."""
    silent = now - last_seen
    if silent <= options.suspect_after_s:
        return KEEP_HEALTH
    why = f"no heartbeat from {node} for {silent:.1f}s"
    if silent > options.fail_after_s:
        if health in (GpuState.HEALTHY, GpuState.SUSPECT, GpuState.DEGRADED):
            return HealthDecision(GpuState.FAILED, why)
        return KEEP_HEALTH
    if health == GpuState.HEALTHY:
        return HealthDecision(GpuState.SUSPECT, why)
    return KEEP_HEALTH


def reconnect(health: GpuState, source: HealthSource) -> HealthDecision:
    """An agent is back with a GPU. When silence (or absence from its inventory) was the only
    evidence against the GPU, it is healthy again; an agent's own verdict stands."""
    if source in SILENCE_SOURCES and health != GpuState.HEALTHY:
        return HealthDecision(GpuState.HEALTHY, "agent reconnected")
    return KEEP_HEALTH


@dataclass(frozen=True, slots=True)
class BreakerOptions:
    window_s: float
    share: float  # of all GPUs
    min_gpus: int


@dataclass(frozen=True, slots=True)
class BreakerDecision:
    open: bool  # the breaker opens now (with `reason`)
    reason: str


def breaker(is_open: bool, recent: int, more: int, gpus: int, options: BreakerOptions) -> BreakerDecision:
    """Whether `more` failures now, on top of `recent` failures inside the last `window_s` (the
    caller counts them: it keeps their times and forgets those older than now - window_s), open the
    breaker: more than max(min_gpus, share x gpus) failures inside the window do. An open breaker
    stays open (only an operator resets it), and no new failures decide nothing."""
    if is_open or more <= 0:
        return BreakerDecision(False, "")
    total = max(1, gpus)
    limit = max(options.min_gpus, options.share * total)
    n = recent + more
    if n <= limit:
        return BreakerDecision(False, f"{n} GPUs failed within {options.window_s:g}s, limit {limit:g}")
    return BreakerDecision(
        True,
        f"{n} GPUs failed within {options.window_s:g}s (limit {limit:g} of {total}): a systemic fault is likely; "
        "automatic replanning stopped",
    )


@dataclass(frozen=True, slots=True)
class DrainDecision:
    done: bool
    reason: str


def drain_due(now: datetime, deadline: datetime | None, why: str | None) -> DrainDecision:
    """A node's drain ends (its draining GPUs enter maintenance) once its deadline has passed."""
    if deadline is None or deadline > now:
        return DrainDecision(False, "")
    return DrainDecision(True, f"drain deadline passed: {why}")


class WindowAction(StrEnum):
    NONE = "none"
    START = "start"  # put the target's GPUs without an operator state into maintenance
    END = "end"  # release its GPUs still in maintenance, and close the window


@dataclass(frozen=True, slots=True)
class MaintenanceDecision:
    action: WindowAction
    gpus: tuple[str, ...]  # the GPUs the action applies to
    reason: str


def maintenance(now: datetime, starts: datetime, ends: datetime, window: int, why: str,
                admin_of: Sequence[tuple[str, str | None]]) -> MaintenanceDecision:
    """What window `window` ([starts, ends)) does now to its target's GPUs, given as (uuid, admin
    state). Inside the window, GPUs with no operator state enter maintenance (a cordon or a drain
    set by someone else is left alone); from its end on, GPUs still in maintenance are released and
    the window closes. Before it starts, nothing."""
    if starts <= now < ends:
        todo = tuple(u for u, admin in admin_of if admin is None)
        if not todo:
            return MaintenanceDecision(WindowAction.NONE, (), "")
        return MaintenanceDecision(WindowAction.START, todo, why or f"window {window}")
    if now >= ends:
        return MaintenanceDecision(WindowAction.END, tuple(u for u, admin in admin_of if admin == GpuState.MAINTENANCE),
                                   f"window {window} ended")
    return MaintenanceDecision(WindowAction.NONE, (), "")
