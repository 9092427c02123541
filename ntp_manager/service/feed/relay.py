"""Agents' GPU counters on their way to the leader (`TelemetryRelay`).

The counters agents send with heartbeats are the fail-slow detector's evidence. A manager that
does not lead keeps the newest sample of each GPU of its agents and stores those that changed
materially (or are 30 s old) as one `telemetry` outbox row every heartbeat period; the leader puts
them in its telemetry store (service/feed/workers.py's `apply_row`). The leader records its own
agents' samples directly.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterable
from dataclasses import astuple
from typing import Any

from ntp_manager.service.ingest.telemetry import GpuTelemetry, TelemetryStore
from ntp_manager.store import outbox

TELEMETRY = "telemetry"
__all__ = ["TELEMETRY", "GpuTelemetry", "TelemetryRelay", "material"]


TELEMETRY_REFRESH_S = 30.0  # a sample that did not change materially is relayed again after this


def material(old: GpuTelemetry, new: GpuTelemetry) -> bool:
    """Whether `new` tells the detector (or an operator) something `old` did not: a throttle
    reason, an error counter or the limit changed, the SM clock by 5 %, the power by 10 %, the
    temperature by 3 degrees."""
    exact = ("clock_event_reasons", "limit_mw", "ecc_corrected", "ecc_uncorrected", "nvlink_replay",
             "nvlink_recovery", "nvlink_crc", "nvlink_down", "node")
    if any(getattr(old, f) != getattr(new, f) for f in exact):
        return True
    for f, rel in (("sm_clock_mhz", 0.05), ("usage_mw", 0.10)):
        a, b = getattr(old, f), getattr(new, f)
        if (a is None) != (b is None) or (a is not None and b is not None and abs(a - b) > rel * max(abs(a), 1)):
            return True
    t0, t1 = old.temperature_c, new.temperature_c
    return (t0 is None) != (t1 is None) or (t0 is not None and t1 is not None and abs(t0 - t1) >= 3)


class TelemetryRelay:
    """GPU counters from a non-leader manager's agents, stored for the leader every heartbeat
    period: of each GPU the newest sample, when it changed materially since the one relayed last
    (`material`) or that one is `TELEMETRY_REFRESH_S` old, so a steady fleet costs the outbox (and
    the leader) little."""

    def __init__(self, submit: Callable[[outbox.Entry], asyncio.Future[Any]], me: str) -> None:
        self.submit = submit
        self.me = me
        self.pending = TelemetryStore()
        self.relayed: dict[str, GpuTelemetry] = {}  # per GPU, the sample relayed last
        self.sent = 0  # samples stored
        self.skipped = 0  # samples not relayed: no material change since the last one

    def record(self, node: str, registered: Iterable[str], gpus: Any, at: float) -> None:
        self.pending.record(node, list(registered), gpus, at)

    def forget(self, gpus: Iterable[str]) -> None:
        """GPUs whose agent left this manager: their next samples come from elsewhere."""
        for u in gpus:
            self.relayed.pop(u, None)

    def flush(self) -> asyncio.Future[Any] | None:
        fresh = self.pending.latest
        self.pending = TelemetryStore()
        samples = []
        for u, t in fresh.items():
            last = self.relayed.get(u)
            if last is not None and t.at - last.at < TELEMETRY_REFRESH_S and not material(last, t):
                self.skipped += 1
                continue
            self.relayed[u] = t
            samples.append([*astuple(t), u])
        if not samples:
            return None
        self.sent += len(samples)
        return self.submit(outbox.Entry(TELEMETRY, "", {"samples": samples},
                                        f"telemetry:{self.me}:{uuid.uuid4().hex}"))


