"""The GpuBackend protocol: what the agent needs from a GPU driver, and nothing more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class BackendError(Exception):
    """A backend call failed for a reason the agent reports (not a crash)."""


class GpuLost(BackendError):
    """The GPU fell off the bus (NVML: GPU is lost)."""


class NotSupported(BackendError):
    """The GPU does not support this query or setting; the agent ignores it."""


class NoPermission(BackendError):
    """The agent lacks the privilege (e.g. setting power limits needs root): a deployment error."""


@dataclass(frozen=True)
class GpuStatic:
    uuid: str
    index: int
    model: str
    memory_bytes: int
    min_mw: int
    max_mw: int
    default_mw: int
    pci_bus_id: str = ""
    domain: str | None = None  # from NVML fabric info (clusterUuid/cliqueId) when present
    # the device file's number (/dev/nvidia<minor>): how Slurm's gres.conf and SLURM_STEP_GPUS name
    # the GPU, which NVML's index need not match; None: unknown
    minor: int | None = None


@dataclass(frozen=True)
class GpuSample:
    uuid: str
    sbe_total: int | None = None  # corrected (single-bit) ECC errors, volatile
    dbe_total: int = 0  # uncorrected ECC errors, volatile
    remap_pending: bool = False
    remap_failure: bool = False
    throttled: bool | None = None  # thermal or power-brake clock events active
    temperature_c: int | None = None
    nvlink_down: int = 0
    limit_mw: int | None = None  # enforced power limit
    usage_mw: int | None = None
    slow_factor: float = 1.0  # fake backend only: a fail-slow GPU
    # fail-slow evidence (issue 21), read-only; None: not supported or not read
    clock_event_reasons: int | None = None  # NVML clocks-event (throttle) bitmask
    sm_clock_mhz: int | None = None
    sm_clock_max_mhz: int | None = None
    nvlink_replay: int | None = None  # summed over the GPU's links: DL replays
    nvlink_recovery: int | None = None  # DL recoveries
    nvlink_crc: int | None = None  # CRC errors (flit + data)


@dataclass(frozen=True)
class XidEvent:
    uuid: str
    xid: int
    detail: str = ""


@dataclass(frozen=True)
class GpuRepaired:
    """The GPU was serviced: the evidence gathered against it so far no longer holds (NVML has no
    such event; the fake backend's `repair` fault sends it)."""

    uuid: str
    detail: str = ""


BackendEvent = XidEvent | GpuRepaired


class GpuBackend(Protocol):
    name: str

    def gpus(self) -> list[GpuStatic]: ...

    def sample(self, uuid: str) -> GpuSample:
        """Current counters of one GPU. Raises GpuLost, NotSupported or BackendError."""
        ...

    def wait_xids(self, timeout_s: float) -> list[BackendEvent]:
        """Block up to timeout_s for XID events (or repairs; run in a thread); [] when nothing happened."""
        ...

    def get_limit_mw(self, uuid: str) -> int: ...

    def set_limit_mw(self, uuid: str, mw: int) -> None:
        """Raises NoPermission, NotSupported or GpuLost."""
        ...

    def close(self) -> None: ...
