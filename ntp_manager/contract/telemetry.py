"""When a GPU's counters say something new (`material`): the rule an agent uses to decide whether a
heartbeat is due before its longest quiet (agent/ntp_agent/core.py), and a manager that does not
lead to decide whether to relay a sample to the leader (service/feed/relay.py). Both read the
counters of ntp.v1.GpuTelemetry by name; a counter not read is None."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

# a change in any of these is news, however small
EXACT = ("clock_event_reasons", "limit_mw", "ecc_corrected", "ecc_uncorrected", "nvlink_replay", "nvlink_recovery",
         "nvlink_crc", "nvlink_down")
RELATIVE = (("sm_clock_mhz", 0.05), ("usage_mw", 0.10))  # news past this share of the old value
TEMPERATURE_C = 3  # news at this many degrees
OPTIONAL = ("clock_event_reasons", "sm_clock_mhz", "sm_clock_max_mhz", "usage_mw", "limit_mw", "temperature_c",
            "ecc_corrected", "nvlink_replay", "nvlink_recovery", "nvlink_crc")


def material(old: Any, new: Any) -> bool:
    """Whether `new` tells the detector (or an operator) something `old` did not: a throttle
    reason, an error counter or the limit changed, the SM clock by 5 %, the power by 10 %, the
    temperature by 3 degrees."""
    if any(getattr(old, f) != getattr(new, f) for f in EXACT):
        return True
    for f, rel in RELATIVE:
        a, b = getattr(old, f), getattr(new, f)
        if (a is None) != (b is None) or (a is not None and b is not None and abs(a - b) > rel * max(abs(a), 1)):
            return True
    t0, t1 = old.temperature_c, new.temperature_c
    return (t0 is None) != (t1 is None) or (t0 is not None and t1 is not None and abs(t0 - t1) >= TEMPERATURE_C)


def counters(t: Any) -> SimpleNamespace:
    """An ntp.v1.GpuTelemetry's counters by name, None where the agent did not read one (the
    message's optional fields read 0 when unset)."""
    v = {f: (getattr(t, f) if t.HasField(f) else None) for f in OPTIONAL}
    return SimpleNamespace(ecc_uncorrected=t.ecc_uncorrected, nvlink_down=t.nvlink_down, **v)
