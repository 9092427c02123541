"""The agents' read-only GPU counters (issue 21: fail-slow evidence), latest sample per GPU.

Agents send them with heartbeats (ntp.v1.GpuTelemetry: throttle reasons, SM clock vs max, power vs
the enforced limit, temperature, ECC and NVLink error/replay counters). They are evidence for the
fail-slow detector and the operator, never a verdict on their own, and are not written to the
database. Memory is bounded: one entry per GPU its node registered (a sample for a GPU the node did
not register is ignored and counted, and entries of GPUs the node no longer has are dropped).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ntp_manager.detect import GpuSignals, throttle_names


@dataclass(frozen=True, slots=True)
class GpuTelemetry:
    """One GPU's latest counters as the manager keeps them; None: the agent did not read it."""

    node: str
    at: float  # manager clock (seconds since the epoch) when the heartbeat arrived
    clock_event_reasons: int | None
    sm_clock_mhz: int | None
    sm_clock_max_mhz: int | None
    usage_mw: int | None
    limit_mw: int | None
    temperature_c: int | None
    ecc_corrected: int | None
    ecc_uncorrected: int
    nvlink_replay: int | None
    nvlink_recovery: int | None
    nvlink_crc: int | None
    nvlink_down: int

    def signals(self) -> GpuSignals:
        """What the detector reads (evidence in its verdicts' notes)."""
        return GpuSignals(
            throttle_reasons=throttle_names(self.clock_event_reasons or 0),
            sm_clock_mhz=None if self.sm_clock_mhz is None else float(self.sm_clock_mhz),
            sm_clock_max_mhz=float(self.sm_clock_max_mhz) if self.sm_clock_max_mhz else None,
            power_w=None if self.usage_mw is None else self.usage_mw / 1000,
            power_limit_w=self.limit_mw / 1000 if self.limit_mw else None,
            temperature_c=None if self.temperature_c is None else float(self.temperature_c),
        )

    def view(self) -> dict[str, Any]:
        out = asdict(self)
        out["throttle_reasons"] = sorted(throttle_names(self.clock_event_reasons or 0))
        return out


def _opt(msg: Any, name: str) -> int | None:
    return int(getattr(msg, name)) if msg.HasField(name) else None


class TelemetryStore:
    def __init__(self) -> None:
        self.latest: dict[str, GpuTelemetry] = {}
        self.by_node: dict[str, set[str]] = {}
        self.ignored = 0  # samples for GPUs their node did not register

    def record(self, node: str, registered: Sequence[str], gpus: Iterable[Any], at: float) -> None:
        """Keep the samples (ntp.v1.GpuTelemetry) of one heartbeat from `node`, whose registered
        GPUs are `registered`."""
        mine = set(registered)
        for u in self.by_node.get(node, set()) - mine:
            self.latest.pop(u, None)
        self.by_node[node] = {u for u in self.by_node.get(node, set()) if u in mine}
        for g in gpus:
            if g.uuid not in mine:
                self.ignored += 1
                continue
            self.latest[g.uuid] = GpuTelemetry(
                node, at, _opt(g, "clock_event_reasons"), _opt(g, "sm_clock_mhz"), _opt(g, "sm_clock_max_mhz"),
                _opt(g, "usage_mw"), _opt(g, "limit_mw"), _opt(g, "temperature_c"), _opt(g, "ecc_corrected"),
                int(g.ecc_uncorrected), _opt(g, "nvlink_replay"), _opt(g, "nvlink_recovery"), _opt(g, "nvlink_crc"),
                int(g.nvlink_down),
            )
            self.by_node[node].add(g.uuid)

    def put(self, uuid: str, t: GpuTelemetry) -> None:
        """Keep a sample another manager took (fleet mode: service/feed/relay.py); the caller checked
        that the GPU is registered on `t.node`."""
        old = self.latest.get(uuid)
        if old is not None and old.node != t.node:
            self.by_node.get(old.node, set()).discard(uuid)
        if old is None or old.at <= t.at:
            self.latest[uuid] = t
            self.by_node.setdefault(t.node, set()).add(uuid)

    def get(self, uuid: str) -> GpuTelemetry | None:
        return self.latest.get(uuid)

    def signals(self, uuid: str) -> GpuSignals | None:
        t = self.latest.get(uuid)
        return None if t is None else t.signals()
