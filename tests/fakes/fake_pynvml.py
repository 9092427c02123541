"""A stand-in for nvidia-ml-py's `pynvml` module, as strict as the real one: same function names
and signatures (tests/unit/test_nvml_backend.py compares them with the installed nvidia-ml-py),
constants, versioned ctypes structs and NVMLError subclasses, backed by in-memory devices.
`make()` returns a fresh module.

Where the real library would hand a bad argument straight to the C function (undefined behaviour:
on a real H100 a versioned struct passed by value crashed the process), the fake raises
`FakeNvmlMisuse` -- deliberately *not* an NVMLError, so that code which catches NVML errors cannot
swallow it -- and records it in `module.state["misuse"]`. What the fake checks:

- handles are the device handles it returned; event sets the ones it created;
- integer arguments are ints (ctypes raises TypeError for a float) and not negative (ctypes would
  wrap a negative number into a huge unsigned one);
- versioned structs (`c_nvmlGpuFabricInfoV_t`) are passed by reference (`ctypes.byref` or a
  pointer) and carry the version the function expects, else NVML's own answer
  (NVMLError_ArgumentVersionMismatch). Unlike nvidia-ml-py 13, whose constructor fills in the
  version, the fake's struct starts at version 0, as older bindings did: callers must set it.

Devices model what a real H100 answered (issue 15): the fabric query succeeds with state
NOT_SUPPORTED and zero ids when there is no NVLink fabric; retired-pages status is NotSupported
(row remapping replaced it). `Device.h100()` is that GPU.
"""

from __future__ import annotations

import ctypes
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25

_ERROR_TEXT = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_TIMEOUT: "Timeout",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH: "Argument Version Mismatch",
}


class FakeNvmlMisuse(Exception):
    """A call the real library would pass to C unchecked (a crash or garbage on a real GPU)."""


class NVMLError(Exception):
    """As in nvidia-ml-py: NVMLError(code) builds the subclass registered for that code."""

    _by_code: dict[int, type[NVMLError]] = {}
    value: int

    def __new__(cls, value: int = NVML_ERROR_INVALID_ARGUMENT) -> NVMLError:
        if cls is NVMLError:
            cls = NVMLError._by_code.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value: int = NVML_ERROR_INVALID_ARGUMENT) -> None:
        super().__init__(self.value)

    def __str__(self) -> str:
        return _ERROR_TEXT.get(self.value, f"NVML error {self.value}")


def _error_class(name: str, code: int) -> type[NVMLError]:
    def new(cls: type[NVMLError], *args: Any) -> NVMLError:
        obj = Exception.__new__(cls)
        obj.value = code
        return obj

    def init(self: NVMLError, *args: Any) -> None:
        Exception.__init__(self, code)

    cls = type(name, (NVMLError,), {"__new__": new, "__init__": init})
    NVMLError._by_code[code] = cls
    return cls


NVMLError_Uninitialized = _error_class("NVMLError_Uninitialized", NVML_ERROR_UNINITIALIZED)
NVMLError_InvalidArgument = _error_class("NVMLError_InvalidArgument", NVML_ERROR_INVALID_ARGUMENT)
NVMLError_NotSupported = _error_class("NVMLError_NotSupported", NVML_ERROR_NOT_SUPPORTED)
NVMLError_NoPermission = _error_class("NVMLError_NoPermission", NVML_ERROR_NO_PERMISSION)
NVMLError_Timeout = _error_class("NVMLError_Timeout", NVML_ERROR_TIMEOUT)
NVMLError_GpuIsLost = _error_class("NVMLError_GpuIsLost", NVML_ERROR_GPU_IS_LOST)
NVMLError_ArgumentVersionMismatch = _error_class(
    "NVMLError_ArgumentVersionMismatch", NVML_ERROR_ARGUMENT_VERSION_MISMATCH
)
ERROR_CLASSES = (
    NVMLError, NVMLError_Uninitialized, NVMLError_InvalidArgument, NVMLError_NotSupported,
    NVMLError_NoPermission, NVMLError_Timeout, NVMLError_GpuIsLost, NVMLError_ArgumentVersionMismatch,
)

# ---- versioned structs, laid out as nvidia-ml-py 13 lays them out -------------------------------

NVML_GPU_FABRIC_UUID_LEN = 16
NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = 0
NVML_GPU_FABRIC_STATE_NOT_STARTED = 1
NVML_GPU_FABRIC_STATE_IN_PROGRESS = 2
NVML_GPU_FABRIC_STATE_COMPLETED = 3


class c_nvmlGpuFabricInfo_v2_t(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * NVML_GPU_FABRIC_UUID_LEN),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
        ("healthMask", ctypes.c_uint32),
    ]


nvmlGpuFabricInfo_v2 = 0x02000024  # (2 << 24) | sizeof(struct) == 36
assert ctypes.sizeof(c_nvmlGpuFabricInfo_v2_t) == nvmlGpuFabricInfo_v2 & 0xFFFFFF


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
    retired_pages_supported: bool = False  # pre-Ampere GPUs; NotSupported on A100/H100/B200
    retired_pending: bool = False
    constraints_supported: bool = True
    clocks_reasons: int = 0
    links: list[int] = field(default_factory=lambda: [1] * 18)
    nvlink_supported: bool = True
    cluster_uuid: bytes = b""  # non-empty: an NVLink fabric registered the GPU (state COMPLETED)
    clique: int = 0
    enforce_ceiling_mw: int | None = None  # another limit in force: enforced = min(set, ceiling)
    sm_clock_mhz: int = 1980
    sm_clock_max_mhz: int = 1980
    temperature_c: int = 60
    minor: int | None = None  # /dev/nvidia<minor>; None: the device's position
    # (link, counter) -> value of nvmlDeviceGetNvLinkErrorCounter; counters absent answer 0
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)
    nvlink_errors_supported: bool = True
    throttle_name_only: bool = False  # an old binding: only ...ClocksThrottleReasons exists

    @classmethod
    def h100(cls, uuid: str) -> Device:
        """What the NVIDIA H100 80GB HBM3 of issue 15 reported: 200-700 W, default = max = 700 W,
        no NVLink fabric, retired-pages status not supported."""
        return cls(uuid, name="NVIDIA H100 80GB HBM3", limit_mw=700_000, min_mw=200_000, max_mw=700_000,
                   default_mw=700_000)


class _Handle:
    """Stands for `c_nvmlDevice_t` (an opaque pointer in the real library)."""

    def __init__(self, dev: Device) -> None:
        self.dev = dev


class _EventSet:
    """Stands for `c_nvmlEventSet_t`."""


class _Struct:
    pass


def make(devices: list[Device]) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    events: deque[tuple[Device, int]] = deque()
    state: dict[str, Any] = {"init": 0, "misuse": [], "set_calls": 0, "calls": {}}
    handles = [_Handle(d) for d in devices]
    live_sets: set[int] = set()

    def misuse(msg: str) -> FakeNvmlMisuse:
        state["misuse"].append(msg)
        return FakeNvmlMisuse(msg)

    def count(fn: str) -> None:
        state["calls"][fn] = state["calls"].get(fn, 0) + 1

    def initialised(fn: str) -> None:
        count(fn)
        if state["init"] <= 0:
            raise NVMLError_Uninitialized()

    def dev(h: object, fn: str) -> Device:
        initialised(fn)
        if not isinstance(h, _Handle):
            raise misuse(f"{fn}: the handle is {type(h).__name__}, not a device handle from NVML")
        if h.dev.lost:
            raise NVMLError_GpuIsLost()
        return h.dev

    def uint(v: object, fn: str, what: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{fn}: {what}: int expected instead of {type(v).__name__}")
        if v < 0:
            raise misuse(f"{fn}: {what} = {v} would wrap around as an unsigned C integer")
        return v

    def by_ref(arg: object, cls: type[ctypes.Structure], fn: str) -> Any:
        if isinstance(arg, ctypes.Structure):
            raise misuse(f"{fn}: {type(arg).__name__} passed by value; the C function takes a pointer "
                         f"(pass ctypes.byref(struct))")
        target = getattr(arg, "_obj", None)  # ctypes.byref(x)
        if target is None and isinstance(arg, ctypes._Pointer):
            target = arg.contents
        if not isinstance(target, cls):
            raise misuse(f"{fn}: expected a pointer to {cls.__name__}, got {type(arg).__name__}")
        return target

    def nvmlInit() -> None:
        state["init"] += 1

    def nvmlShutdown() -> None:
        initialised("nvmlShutdown")
        state["init"] -= 1

    def nvmlSystemGetDriverVersion() -> str:
        initialised("nvmlSystemGetDriverVersion")
        return "580.00.00-fake"

    def nvmlSystemGetNVMLVersion() -> bytes:
        initialised("nvmlSystemGetNVMLVersion")
        return b"13.580.00-fake"

    def nvmlDeviceGetCount() -> int:
        initialised("nvmlDeviceGetCount")
        return len(devices)

    def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
        initialised("nvmlDeviceGetHandleByIndex")
        i = uint(index, "nvmlDeviceGetHandleByIndex", "index")
        if i >= len(handles):
            raise NVMLError_InvalidArgument()
        return handles[i]

    def nvmlDeviceGetUUID(handle: _Handle) -> str:
        return dev(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetName(handle: _Handle) -> str:
        return dev(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetMemoryInfo(handle: _Handle, version: int | None = None) -> Any:
        dev(handle, "nvmlDeviceGetMemoryInfo")
        if version is not None:
            uint(version, "nvmlDeviceGetMemoryInfo", "version")
        s = _Struct()
        s.total, s.free, s.used = 192 << 30, 190 << 30, 2 << 30  # type: ignore[attr-defined]
        return s

    def nvmlDeviceGetPciInfo(handle: _Handle) -> Any:
        dev(handle, "nvmlDeviceGetPciInfo")
        s = _Struct()
        s.busId = "00000000:1B:00.0"  # type: ignore[attr-defined]  # str: nvidia-ml-py decodes char arrays
        return s

    def nvmlDeviceGetMinorNumber(handle: _Handle) -> int:
        d = dev(handle, "nvmlDeviceGetMinorNumber")
        return next(i for i, x in enumerate(devices) if x is d) if d.minor is None else d.minor

    def nvmlDeviceGetPowerManagementLimitConstraints(handle: _Handle) -> list[int]:
        d = dev(handle, "nvmlDeviceGetPowerManagementLimitConstraints")
        if not d.constraints_supported:
            raise NVMLError_NotSupported()
        return [d.min_mw, d.max_mw]

    def nvmlDeviceGetPowerManagementDefaultLimit(handle: _Handle) -> int:
        d = dev(handle, "nvmlDeviceGetPowerManagementDefaultLimit")
        if not d.constraints_supported:
            raise NVMLError_NotSupported()
        return d.default_mw

    def nvmlDeviceGetEnforcedPowerLimit(handle: _Handle) -> int:
        return dev(handle, "nvmlDeviceGetEnforcedPowerLimit").limit_mw

    def nvmlDeviceGetPowerUsage(handle: _Handle) -> int:
        return int(dev(handle, "nvmlDeviceGetPowerUsage").limit_mw * 0.8)

    def nvmlDeviceSetPowerManagementLimit(handle: _Handle, limit: int) -> None:
        d = dev(handle, "nvmlDeviceSetPowerManagementLimit")
        state["set_calls"] += 1
        mw = uint(limit, "nvmlDeviceSetPowerManagementLimit", "limit")
        if d.refuse_set:
            raise NVMLError_NoPermission()
        if not d.constraints_supported:
            raise NVMLError_NotSupported()
        if not d.min_mw <= mw <= d.max_mw:
            raise NVMLError_InvalidArgument()
        d.limit_mw = mw if d.enforce_ceiling_mw is None else min(mw, d.enforce_ceiling_mw)

    def nvmlDeviceGetTotalEccErrors(handle: _Handle, errorType: int, counterType: int) -> int:
        d = dev(handle, "nvmlDeviceGetTotalEccErrors")
        kind = uint(errorType, "nvmlDeviceGetTotalEccErrors", "errorType")
        uint(counterType, "nvmlDeviceGetTotalEccErrors", "counterType")
        if kind > 1:
            raise NVMLError_InvalidArgument()
        return d.sbe if kind == 0 else d.dbe

    def nvmlDeviceGetRemappedRows(device: _Handle) -> tuple[int, int, int, int]:
        d = dev(device, "nvmlDeviceGetRemappedRows")
        if not d.remap_supported:
            raise NVMLError_NotSupported()
        return (0, 0, 0, 0)

    def nvmlDeviceGetRetiredPagesPendingStatus(device: _Handle) -> int:
        d = dev(device, "nvmlDeviceGetRetiredPagesPendingStatus")
        if not d.retired_pages_supported:
            raise NVMLError_NotSupported()
        return int(d.retired_pending)

    def nvmlDeviceGetCurrentClocksEventReasons(handle: _Handle) -> int:
        return dev(handle, "nvmlDeviceGetCurrentClocksEventReasons").clocks_reasons

    def nvmlDeviceGetCurrentClocksThrottleReasons(handle: _Handle) -> int:
        return dev(handle, "nvmlDeviceGetCurrentClocksThrottleReasons").clocks_reasons

    def clock(handle: _Handle, type: int, fn: str, maximum: bool) -> int:
        d = dev(handle, fn)
        kind = uint(type, fn, "type")
        if kind >= 4:  # NVML_CLOCK_COUNT
            raise NVMLError_InvalidArgument()
        if kind != 1:  # only SM clocks are modelled
            raise NVMLError_NotSupported()
        return d.sm_clock_max_mhz if maximum else d.sm_clock_mhz

    def nvmlDeviceGetClockInfo(handle: _Handle, type: int) -> int:
        return clock(handle, type, "nvmlDeviceGetClockInfo", False)

    def nvmlDeviceGetMaxClockInfo(handle: _Handle, type: int) -> int:
        return clock(handle, type, "nvmlDeviceGetMaxClockInfo", True)

    def nvmlDeviceGetNvLinkErrorCounter(device: _Handle, link: int, counter: int) -> int:
        d = dev(device, "nvmlDeviceGetNvLinkErrorCounter")
        i = uint(link, "nvmlDeviceGetNvLinkErrorCounter", "link")
        c = uint(counter, "nvmlDeviceGetNvLinkErrorCounter", "counter")
        if not d.nvlink_supported or not d.nvlink_errors_supported:
            raise NVMLError_NotSupported()
        if i >= len(d.links) or c >= 5:  # NVML_NVLINK_ERROR_COUNT
            raise NVMLError_InvalidArgument()
        return d.nvlink_errors.get((i, c), 0)

    def nvmlDeviceGetTemperature(handle: _Handle, sensor: int) -> int:
        d = dev(handle, "nvmlDeviceGetTemperature")
        if uint(sensor, "nvmlDeviceGetTemperature", "sensor") != 0:
            raise NVMLError_InvalidArgument()
        return d.temperature_c

    def nvmlDeviceGetNvLinkState(device: _Handle, link: int) -> int:
        d = dev(device, "nvmlDeviceGetNvLinkState")
        i = uint(link, "nvmlDeviceGetNvLinkState", "link")
        if not d.nvlink_supported:
            raise NVMLError_NotSupported()
        if i >= len(d.links):
            raise NVMLError_InvalidArgument()
        return d.links[i]

    def nvmlDeviceGetGpuFabricInfoV(device: _Handle, gpuFabricInfo: Any) -> int:
        d = dev(device, "nvmlDeviceGetGpuFabricInfoV")
        info = by_ref(gpuFabricInfo, c_nvmlGpuFabricInfo_v2_t, "nvmlDeviceGetGpuFabricInfoV")
        if info.version != nvmlGpuFabricInfo_v2:
            raise NVMLError_ArgumentVersionMismatch()
        ctypes.memset(ctypes.addressof(info) + 4, 0, ctypes.sizeof(info) - 4)
        if d.cluster_uuid:
            raw = d.cluster_uuid[:NVML_GPU_FABRIC_UUID_LEN].ljust(NVML_GPU_FABRIC_UUID_LEN, b"\0")
            info.clusterUuid[:] = list(raw)
            info.cliqueId = d.clique
            info.state = NVML_GPU_FABRIC_STATE_COMPLETED
        else:
            info.state = NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
        return NVML_SUCCESS

    def nvmlEventSetCreate() -> _EventSet:
        initialised("nvmlEventSetCreate")
        es = _EventSet()
        live_sets.add(id(es))
        return es

    def event_set(es: object, fn: str) -> None:
        if not isinstance(es, _EventSet) or id(es) not in live_sets:
            raise misuse(f"{fn}: not an event set from nvmlEventSetCreate (or already freed)")

    def nvmlDeviceRegisterEvents(handle: _Handle, eventTypes: int, eventSet: _EventSet) -> None:
        dev(handle, "nvmlDeviceRegisterEvents")
        uint(eventTypes, "nvmlDeviceRegisterEvents", "eventTypes")
        event_set(eventSet, "nvmlDeviceRegisterEvents")

    def nvmlEventSetWait_v2(eventSet: _EventSet, timeoutms: int) -> Any:
        initialised("nvmlEventSetWait_v2")
        event_set(eventSet, "nvmlEventSetWait_v2")
        uint(timeoutms, "nvmlEventSetWait_v2", "timeoutms")
        if not events:
            raise NVMLError_Timeout()
        d, xid = events.popleft()
        s = _Struct()
        s.device, s.eventType, s.eventData = handles[devices.index(d)], 0x8, xid  # type: ignore[attr-defined]
        s.gpuInstanceId = s.computeInstanceId = 0xFFFFFFFF  # type: ignore[attr-defined]
        return s

    def nvmlEventSetFree(eventSet: _EventSet) -> None:
        initialised("nvmlEventSetFree")
        event_set(eventSet, "nvmlEventSetFree")
        live_sets.discard(id(eventSet))

    for name, value in list(locals().items()):
        if name.startswith("nvml"):
            setattr(m, name, value)
    if devices and all(d.throttle_name_only for d in devices):
        del m.nvmlDeviceGetCurrentClocksEventReasons  # as in bindings older than nvidia-ml-py 12.535
    for cls in ERROR_CLASSES:
        setattr(m, cls.__name__, cls)
    m.c_nvmlGpuFabricInfo_v2_t = c_nvmlGpuFabricInfo_v2_t
    m.c_nvmlGpuFabricInfoV_t = c_nvmlGpuFabricInfo_v2_t
    m.nvmlGpuFabricInfo_v2 = nvmlGpuFabricInfo_v2
    m.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED = NVML_GPU_FABRIC_STATE_NOT_SUPPORTED
    m.NVML_GPU_FABRIC_STATE_COMPLETED = NVML_GPU_FABRIC_STATE_COMPLETED
    m.NVML_SUCCESS = NVML_SUCCESS
    m.NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    m.NVML_VOLATILE_ECC = 0
    m.NVML_TEMPERATURE_GPU = 0
    m.NVML_FEATURE_ENABLED = 1
    m.NVML_NVLINK_MAX_LINKS = 36
    m.NVML_CLOCK_GRAPHICS, m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM = 0, 1, 2
    m.NVML_NVLINK_ERROR_DL_REPLAY, m.NVML_NVLINK_ERROR_DL_RECOVERY = 0, 1
    m.NVML_NVLINK_ERROR_DL_CRC_FLIT, m.NVML_NVLINK_ERROR_DL_CRC_DATA = 2, 3
    m.nvmlEventTypeXidCriticalError = 0x8
    m.nvmlClocksEventReasonSwThermalSlowdown = 0x20
    m.nvmlClocksEventReasonHwThermalSlowdown = 0x40
    m.nvmlClocksEventReasonHwPowerBrakeSlowdown = 0x80
    m.nvmlClocksEventReasonHwSlowdown = 0x8
    m.inject_xid = lambda d, xid: events.append((d, xid))  # test hook
    m.state = state
    return m
