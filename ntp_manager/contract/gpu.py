"""GPU states: what an agent reports for each GPU and the manager plans with (issue 35: it crosses the
agent/manager boundary, so it lives in the contract). Standard library only (topology imports it)."""

from __future__ import annotations

from enum import StrEnum


class GpuState(StrEnum):
    HEALTHY = "healthy"
    SUSPECT = "suspect"
    DEGRADED = "degraded"
    FAILED = "failed"
    CORDONED = "cordoned"
    DRAINING = "draining"
    MAINTENANCE = "maintenance"

    @property
    def placeable(self) -> bool:
        """True when the planner may give this GPU TP work."""
        return self in _PLACEABLE

    @property
    def operator_state(self) -> bool:
        """States that only an operator sets and clears (automation never undoes them)."""
        return self in _OPERATOR_STATES


_PLACEABLE = frozenset({GpuState.HEALTHY, GpuState.SUSPECT})
_OPERATOR_STATES = frozenset({GpuState.CORDONED, GpuState.DRAINING, GpuState.MAINTENANCE})
