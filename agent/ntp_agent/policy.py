"""Health policy: evidence in, a GPU health verdict with reasons out. Pure (time is a parameter).

The XID table (its sources: docs/references.md, "GPU health: NVML and the XID table") is data:
`XidPolicy.default()` ships it and a YAML/JSON mapping can replace any entry. Actions:

- ``ignore``     application-level fault (13, 31, 43, 45, 68): never condemns the GPU
- ``watch``      trend evidence (63, 92): counted; too many within the window -> degraded
- ``restart``    contained memory error (94): the application restarts, the GPU stays
- ``fail``       needs a reset, double-bit ECC, NVLink errors: the GPU is failed
- ``fail_node``  fallen off the bus (79): every GPU of the node is failed

Health is evidence, not a latch: `Verdict`s are recomputed from current evidence; a failed GPU comes
back only through explicit evidence (a reset/repair clears its sticky faults) or an operator's
mark-healthy on the manager.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from ntp_manager.contract.gpu import GpuState


class XidAction(StrEnum):
    IGNORE = "ignore"
    WATCH = "watch"
    RESTART = "restart"
    FAIL = "fail"
    FAIL_NODE = "fail_node"


_DEFAULT: dict[int, XidAction] = {
    **dict.fromkeys((13, 31, 43, 45, 68), XidAction.IGNORE),
    **dict.fromkeys((63, 92), XidAction.WATCH),
    94: XidAction.RESTART,
    **dict.fromkeys((46, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 156, 158), XidAction.FAIL),
    48: XidAction.FAIL,
    **dict.fromkeys((74, 144, 145, 146, 147, 148, 149, 150), XidAction.FAIL),
    79: XidAction.FAIL_NODE,
}


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class XidPolicy:
    actions: Mapping[int, XidAction]
    unknown: XidAction = XidAction.WATCH  # an XID not in the table is evidence, not a verdict

    @classmethod
    def default(cls) -> XidPolicy:
        return cls(dict(_DEFAULT))

    def with_overrides(self, overrides: Mapping[int, str] | Mapping[str, str]) -> XidPolicy:
        actions = dict(self.actions)
        for k, v in overrides.items():
            try:
                xid = int(k)
                actions[xid] = XidAction(v)
            except ValueError:
                raise PolicyError(
                    f"XID policy entry {k!r}: {v!r} (XIDs are integers; actions: "
                    f"{', '.join(a.value for a in XidAction)})"
                ) from None
        return XidPolicy(actions, self.unknown)

    def action(self, xid: int) -> XidAction:
        return self.actions.get(xid, self.unknown)


@dataclass(frozen=True)
class Thresholds:
    watch_xids: int = 3  # watch-class XIDs within the window -> degraded
    window_s: float = 3600.0
    sbe_per_hour: float = 100.0  # single-bit (corrected) ECC errors per hour -> degraded
    throttle_share: float = 0.5  # share of samples thermally/power throttled -> degraded
    throttle_min_samples: int = 10
    max_temperature_c: int = 95


@dataclass
class GpuEvidence:
    """Rolling evidence about one GPU, fed by the backend's readings and events."""

    uuid: str
    sticky: list[str] = field(default_factory=list)  # reasons that fail the GPU until cleared
    watch_times: deque[float] = field(default_factory=deque)
    sbe_samples: deque[tuple[float, int]] = field(default_factory=deque)
    throttle_samples: deque[bool] = field(default_factory=lambda: deque(maxlen=60))
    last_temp_c: int | None = None
    nvlink_down: int = 0
    lost: bool = False
    slow_reason: str | None = None


@dataclass(frozen=True)
class Verdict:
    state: GpuState  # HEALTHY, DEGRADED or FAILED: what an agent may report
    reasons: tuple[str, ...]


class HealthPolicy:
    def __init__(self, xids: XidPolicy | None = None, thresholds: Thresholds | None = None) -> None:
        self.xids = xids or XidPolicy.default()
        self.t = thresholds or Thresholds()

    def on_xid(self, ev: GpuEvidence, xid: int, now: float) -> XidAction:
        action = self.xids.action(xid)
        if action is XidAction.FAIL:
            ev.sticky.append(f"XID {xid}: needs a GPU reset or replacement")
        elif action is XidAction.FAIL_NODE:
            ev.sticky.append(f"XID {xid}: GPU fell off the bus")
        elif action is XidAction.WATCH:
            ev.watch_times.append(now)
        return action

    def on_sample(self, ev: GpuEvidence, now: float, *, sbe_total: int | None = None, dbe_total: int = 0,
                  throttled: bool | None = None, temp_c: int | None = None, nvlink_down: int = 0,
                  remap_failure: bool = False) -> None:
        if sbe_total is not None:
            ev.sbe_samples.append((now, sbe_total))
            while ev.sbe_samples and ev.sbe_samples[0][0] < now - self.t.window_s:
                ev.sbe_samples.popleft()
        if dbe_total and not any(r.startswith("uncorrectable ECC") for r in ev.sticky):
            ev.sticky.append(f"uncorrectable ECC errors: {dbe_total}")
        if remap_failure and "row remapping failed" not in ev.sticky:
            ev.sticky.append("row remapping failed")
        if throttled is not None:
            ev.throttle_samples.append(throttled)
        if temp_c is not None:
            ev.last_temp_c = temp_c
        ev.nvlink_down = nvlink_down

    def verdict(self, ev: GpuEvidence, now: float) -> Verdict:
        if ev.lost:
            return Verdict(GpuState.FAILED, ("GPU is lost (fell off the bus)",))
        failed = list(ev.sticky)
        if ev.nvlink_down:
            failed.append(f"{ev.nvlink_down} NVLink link(s) down")
        if failed:
            return Verdict(GpuState.FAILED, tuple(failed))
        degraded = []
        while ev.watch_times and ev.watch_times[0] < now - self.t.window_s:
            ev.watch_times.popleft()
        if len(ev.watch_times) >= self.t.watch_xids:
            degraded.append(f"{len(ev.watch_times)} ECC/row-remap XIDs within {self.t.window_s:g}s")
        if len(ev.sbe_samples) >= 2:
            (t0, c0), (t1, c1) = ev.sbe_samples[0], ev.sbe_samples[-1]
            if t1 > t0:
                rate = (c1 - c0) / ((t1 - t0) / 3600.0)
                if rate > self.t.sbe_per_hour:
                    degraded.append(f"single-bit ECC rate {rate:.0f}/h above {self.t.sbe_per_hour:g}/h")
        samples = ev.throttle_samples
        if len(samples) >= self.t.throttle_min_samples:
            share = sum(samples) / len(samples)
            if share > self.t.throttle_share:
                degraded.append(f"throttled in {100 * share:.0f}% of recent samples")
        if ev.last_temp_c is not None and ev.last_temp_c > self.t.max_temperature_c:
            degraded.append(f"temperature {ev.last_temp_c} C above {self.t.max_temperature_c} C")
        if ev.slow_reason:
            degraded.append(ev.slow_reason)
        if degraded:
            return Verdict(GpuState.DEGRADED, tuple(degraded))
        return Verdict(GpuState.HEALTHY, ())

    @staticmethod
    def clear(ev: GpuEvidence) -> None:
        """After a reset or repair: forget sticky faults and trends."""
        ev.sticky.clear()
        ev.watch_times.clear()
        ev.sbe_samples.clear()
        ev.throttle_samples.clear()
        ev.lost = False
        ev.slow_reason = None

