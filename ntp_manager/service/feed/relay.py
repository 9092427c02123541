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

from ntp_manager.contract.telemetry import material as counters_material
from ntp_manager.service.ingest.telemetry import GpuTelemetry, TelemetryStore
from ntp_manager.store import outbox

TELEMETRY = "telemetry"
__all__ = ["TELEMETRY", "GpuTelemetry", "TelemetryRelay", "material"]


TELEMETRY_REFRESH_S = 30.0  # a sample that did not change materially is relayed again after this


def material(old: GpuTelemetry, new: GpuTelemetry) -> bool:
    """Whether `new` says something `old` did not (contract/telemetry.py), or comes from another node."""
    return old.node != new.node or counters_material(old, new)


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


