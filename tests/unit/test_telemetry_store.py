"""The manager's store of agents' GPU counters: bounded to the GPUs each node registered."""

from __future__ import annotations

from ntp_agent.backends.base import GpuSample
from ntp_agent.core import telemetry_pb
from ntp_manager.service.ingest.telemetry import TelemetryStore


def test_only_registered_gpus_are_kept_and_departed_ones_dropped() -> None:
    st = TelemetryStore()
    a = telemetry_pb(GpuSample("GPU-a", sbe_total=3, clock_event_reasons=0x4, sm_clock_mhz=1000,
                               sm_clock_max_mhz=2000, usage_mw=690_000, limit_mw=700_000, temperature_c=70))
    stray = telemetry_pb(GpuSample("GPU-x"))
    st.record("n1", ["GPU-a", "GPU-b"], [a, stray], at=1.0)
    assert set(st.latest) == {"GPU-a"} and st.ignored == 1
    t = st.get("GPU-a")
    assert t is not None and (t.ecc_corrected, t.nvlink_replay, t.sm_clock_mhz) == (3, None, 1000)
    sig = st.signals("GPU-a")
    assert sig is not None and "sw_power_cap" in sig.throttle_reasons and sig.power_limit_w == 700.0
    notes = " ".join(sig.notes())
    assert "SM clock at 50%" in notes and "power at 99%" in notes
    st.record("n1", ["GPU-b"], [], at=2.0)  # GPU-a left the node
    assert st.get("GPU-a") is None and st.latest == {}


def test_values_a_field_cannot_hold_are_left_unset() -> None:
    t = telemetry_pb(GpuSample("GPU-a", temperature_c=-5, usage_mw=2**33, nvlink_replay=-1))
    assert t.temperature_c == -5 and not t.HasField("usage_mw") and not t.HasField("nvlink_replay")
