"""Simulator: failure models and traces that drive the real planner (no second policy model)."""

from ntp_manager.sim.engine import (
    Event,
    SimSetup,
    StaticPoint,
    Trace,
    TraceStats,
    make_trace,
    min_spares_never_pause,
    plan_throughput,
    replay,
    static_sweep,
)
from ntp_manager.sim.failures import LLAMA3_RATE_PER_GPU_HOUR, FailureModel, SimError
from ntp_manager.sim.multijob import JobEntry, MultiResult, MultiSetup
from ntp_manager.sim.presets import (
    MULTI_PRESETS,
    PRESETS,
    MultiPreset,
    Preset,
    multi_preset,
    multi_setup,
    preset,
    preset_cluster,
)
from ntp_manager.sim.stall import STALL_PRESETS, StallModel, stall_preset

__all__ = [
    "LLAMA3_RATE_PER_GPU_HOUR",
    "MULTI_PRESETS",
    "PRESETS",
    "STALL_PRESETS",
    "Event",
    "FailureModel",
    "JobEntry",
    "MultiPreset",
    "MultiResult",
    "MultiSetup",
    "Preset",
    "SimError",
    "SimSetup",
    "StallModel",
    "StaticPoint",
    "Trace",
    "TraceStats",
    "make_trace",
    "min_spares_never_pause",
    "multi_preset",
    "multi_setup",
    "plan_throughput",
    "preset",
    "preset_cluster",
    "replay",
    "stall_preset",
    "static_sweep",
]
