"""A stand-in for nvidia-ml-py's `pynvml` module: same function names, signatures, constants and
NVMLError subclasses, backed by in-memory devices. `make()` returns a fresh module."""

from __future__ import annotations

import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 4: "Insufficient Permissions", 10: "Timeout", 15: "GPU is lost"}.get(
            self.value, f"NVML error {self.value}")


class NVMLError_NotSupported(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_NOT_SUPPORTED)


class NVMLError_NoPermission(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_NO_PERMISSION)


class NVMLError_Timeout(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_TIMEOUT)


class NVMLError_GpuIsLost(NVMLError):
    def __init__(self) -> None:
        super().__init__(NVML_ERROR_GPU_IS_LOST)


@dataclass
class Device:
    uuid: str
    name: str = "NVIDIA B200"
    limit_mw: int = 1_000_000
    min_mw: int = 200_000
    max_mw: int = 1_300_000
    default_mw: int = 1_000_000
    sbe: int = 0
    dbe: int = 0
    lost: bool = False
    refuse_set: bool = False
    remap_supported: bool = True
    clocks_reasons: int = 0
    links: list[int] = field(default_factory=lambda: [1] * 18)
    cluster_uuid: bytes = b""
    clique: int = 0


class _Handle:
    def __init__(self, dev: Device) -> None:
        self.dev = dev


class _Struct:
    pass


def make(devices: list[Device]) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    events: deque[tuple[Device, int]] = deque()
    state = {"init": 0}

    def check(h: _Handle) -> Device:
        if h.dev.lost:
            raise NVMLError_GpuIsLost()
        return h.dev

    def nvmlInit() -> None:
        state["init"] += 1

    def nvmlShutdown() -> None:
        state["init"] -= 1

    def nvmlDeviceGetCount() -> int:
        return len(devices)

    def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
        return _Handle(devices[index])

    def nvmlDeviceGetUUID(handle: _Handle) -> str:
        return check(handle).uuid

    def nvmlDeviceGetName(handle: _Handle) -> str:
        return check(handle).name

    def nvmlDeviceGetMemoryInfo(handle: _Handle) -> Any:
        s = _Struct()
        s.total = 192 << 30  # type: ignore[attr-defined]
        return s

    def nvmlDeviceGetPciInfo(handle: _Handle) -> Any:
        s = _Struct()
        s.busId = b"00000000:1B:00.0"  # type: ignore[attr-defined]
        return s

    def nvmlDeviceGetPowerManagementLimitConstraints(handle: _Handle) -> list[int]:
        d = check(handle)
        return [d.min_mw, d.max_mw]

    def nvmlDeviceGetPowerManagementDefaultLimit(handle: _Handle) -> int:
        return check(handle).default_mw

    def nvmlDeviceGetEnforcedPowerLimit(handle: _Handle) -> int:
        return check(handle).limit_mw

    def nvmlDeviceGetPowerUsage(handle: _Handle) -> int:
        return int(check(handle).limit_mw * 0.8)

    def nvmlDeviceSetPowerManagementLimit(handle: _Handle, limit: int) -> None:
        d = check(handle)
        if d.refuse_set:
            raise NVMLError_NoPermission()
        if not d.min_mw <= limit <= d.max_mw:
            raise NVMLError(2)  # invalid argument
        d.limit_mw = limit

    def nvmlDeviceGetTotalEccErrors(handle: _Handle, errorType: int, counterType: int) -> int:
        d = check(handle)
        return d.sbe if errorType == 0 else d.dbe

    def nvmlDeviceGetRemappedRows(device: _Handle) -> tuple[int, int, int, int]:
        d = check(device)
        if not d.remap_supported:
            raise NVMLError_NotSupported()
        return (0, 0, 0, 0)

    def nvmlDeviceGetCurrentClocksEventReasons(handle: _Handle) -> int:
        return check(handle).clocks_reasons

    def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:
        check(handle)
        return 60

    def nvmlDeviceGetNvLinkState(device: _Handle, link: int) -> int:
        d = check(device)
        if link >= len(d.links):
            raise NVMLError_NotSupported()
        return d.links[link]

    class c_nvmlGpuFabricInfoV_t:
        def __init__(self) -> None:
            self.version = 0x02000024
            self.clusterUuid = bytes(16)
            self.cliqueId = 0
            self.state = 0

    def nvmlDeviceGetGpuFabricInfoV(device: _Handle, gpuFabricInfo: Any) -> int:
        d = check(device)
        if not d.cluster_uuid:
            raise NVMLError_NotSupported()
        gpuFabricInfo.clusterUuid = d.cluster_uuid
        gpuFabricInfo.cliqueId = d.clique
        return 0

    def nvmlEventSetCreate() -> object:
        return object()

    def nvmlDeviceRegisterEvents(handle: _Handle, eventTypes: int, eventSet: object) -> None:
        check(handle)

    def nvmlEventSetWait_v2(eventSet: object, timeoutms: int) -> Any:
        if not events:
            raise NVMLError_Timeout()
        dev, xid = events.popleft()
        s = _Struct()
        s.device, s.eventType, s.eventData = _Handle(dev), 0x8, xid  # type: ignore[attr-defined]
        return s

    def nvmlEventSetFree(eventSet: object) -> None:
        return None

    for name, value in list(locals().items()):
        if name.startswith(("nvml", "c_nvml")):
            setattr(m, name, value)
    for cls in (NVMLError, NVMLError_NotSupported, NVMLError_NoPermission, NVMLError_Timeout, NVMLError_GpuIsLost):
        setattr(m, cls.__name__, cls)
    m.NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    m.NVML_VOLATILE_ECC = 0
    m.NVML_TEMPERATURE_GPU = 0
    m.NVML_FEATURE_ENABLED = 1
    m.NVML_NVLINK_MAX_LINKS = 36
    m.nvmlEventTypeXidCriticalError = 0x8
    m.nvmlClocksEventReasonSwThermalSlowdown = 0x20
    m.nvmlClocksEventReasonHwThermalSlowdown = 0x40
    m.nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
    m.nvmlClocksEventReasonHwSlowdown = 0x8
    m.inject_xid = lambda dev, xid: events.append((dev, xid))  # test hook
    m.state = state
    return m
