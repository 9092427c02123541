"""The NVML backend, through nvidia-ml-py (`import pynvml`).

NVML errors are mapped by subclass: GPU is lost -> GpuLost (the policy fails the GPU), not
supported -> NotSupported (the query is skipped), no permission -> NoPermission (a deployment
error the agent reports), anything else -> BackendError. XID events come from an event set
registered for critical XID errors; `wait_xids` blocks in `nvmlEventSetWait_v2` for a short
timeout (NVML raises a timeout error when nothing happened) and is run on a dedicated thread.

The module is injectable (`NvmlBackend(nvml=...)`) so the tests drive this exact code with a fake
module that has nvidia-ml-py's names, signatures and error classes.
"""

from __future__ import annotations

import contextlib
import threading
from types import ModuleType
from typing import Any

from agent.backends.base import BackendError, GpuLost, GpuSample, GpuStatic, NoPermission, NotSupported, XidEvent

THROTTLE_MASK_NAMES = (
    "nvmlClocksEventReasonSwThermalSlowdown",
    "nvmlClocksEventReasonHwThermalSlowdown",
    "nvmlClocksEventReasonHwPowerBrakeSlowdown",
    "nvmlClocksEventReasonHwSlowdown",
)


class NvmlBackend:
    name = "nvml"

    def __init__(self, nvml: ModuleType | None = None) -> None:
        if nvml is None:
            try:
                import pynvml as nvml  # nvidia-ml-py
            except ImportError as e:  # pragma: no cover - a packaging error
                raise BackendError(f"nvidia-ml-py is not installed: {e}") from None
        self.nv: Any = nvml
        self._lock = threading.Lock()
        try:
            self.nv.nvmlInit()
        except self.nv.NVMLError as e:
            raise BackendError(f"NVML init failed: {e}") from None
        self._handles: dict[str, Any] = {}
        self._static: list[GpuStatic] = []
        for i in range(self._call(self.nv.nvmlDeviceGetCount)):
            h = self._call(self.nv.nvmlDeviceGetHandleByIndex, i)
            uuid = _text(self._call(self.nv.nvmlDeviceGetUUID, h))
            self._handles[uuid] = h
            self._static.append(self._describe(i, uuid, h))
        self._throttle_mask = 0
        for name in THROTTLE_MASK_NAMES:
            self._throttle_mask |= int(getattr(self.nv, name, 0))
        self._events = self._call(self.nv.nvmlEventSetCreate)
        for h in self._handles.values():
            try:
                self.nv.nvmlDeviceRegisterEvents(h, self.nv.nvmlEventTypeXidCriticalError, self._events)
            except self.nv.NVMLError as e:
                mapped = self._map(e)
                if not isinstance(mapped, NotSupported):
                    raise mapped from None

    # ---- errors -------------------------------------------------------------------------------
    def _map(self, e: Exception) -> BackendError:
        nv = self.nv
        if isinstance(e, nv.NVMLError_GpuIsLost):
            return GpuLost(str(e))
        if isinstance(e, nv.NVMLError_NotSupported):
            return NotSupported(str(e))
        if isinstance(e, nv.NVMLError_NoPermission):
            return NoPermission(str(e))
        return BackendError(f"NVML: {e}")

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except self.nv.NVMLError as e:
            raise self._map(e) from None

    def _opt(self, fn: Any, *args: Any) -> Any:
        """A query some GPUs do not support: None instead of NotSupported."""
        try:
            return self._call(fn, *args)
        except NotSupported:
            return None

    # ---- static description ---------------------------------------------------------------------
    def _describe(self, index: int, uuid: str, h: Any) -> GpuStatic:
        nv = self.nv
        lo, hi = self._opt(nv.nvmlDeviceGetPowerManagementLimitConstraints, h) or (0, 0)
        default = self._opt(nv.nvmlDeviceGetPowerManagementDefaultLimit, h) or hi
        mem = self._opt(nv.nvmlDeviceGetMemoryInfo, h)
        pci = self._opt(nv.nvmlDeviceGetPciInfo, h)
        return GpuStatic(
            uuid=uuid, index=index, model=_text(self._call(nv.nvmlDeviceGetName, h)),
            memory_bytes=int(mem.total) if mem is not None else 0,
            min_mw=int(lo), max_mw=int(hi), default_mw=int(default),
            pci_bus_id=_text(pci.busId) if pci is not None else "",
            domain=self._fabric_domain(h),
        )

    def _fabric_domain(self, h: Any) -> str | None:
        """clusterUuid + cliqueId identify the NVLink domain (GB200-class systems)."""
        nv = self.nv
        if not hasattr(nv, "nvmlDeviceGetGpuFabricInfoV"):
            return None
        info = nv.c_nvmlGpuFabricInfoV_t()
        try:
            nv.nvmlDeviceGetGpuFabricInfoV(h, info)
        except nv.NVMLError:
            return None
        cluster = bytes(info.clusterUuid)
        if not any(cluster):
            return None
        return f"{cluster.hex()}/{int(info.cliqueId)}"

    def domain_of_node(self) -> str | None:
        domains = {g.domain for g in self._static if g.domain}
        return domains.pop() if len(domains) == 1 else None

    # ---- the protocol -------------------------------------------------------------------------
    def gpus(self) -> list[GpuStatic]:
        return list(self._static)

    def sample(self, uuid: str) -> GpuSample:
        nv = self.nv
        h = self._handles[uuid]
        with self._lock:
            sbe = self._opt(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                            nv.NVML_VOLATILE_ECC)
            dbe = self._opt(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                            nv.NVML_VOLATILE_ECC)
            rows = self._opt(nv.nvmlDeviceGetRemappedRows, h)
            reasons = self._opt(nv.nvmlDeviceGetCurrentClocksEventReasons, h)
            temp = self._opt(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            enforced = self._opt(nv.nvmlDeviceGetEnforcedPowerLimit, h)
            usage = self._opt(nv.nvmlDeviceGetPowerUsage, h)
            down = 0
            for link in range(int(nv.NVML_NVLINK_MAX_LINKS)):
                try:
                    state = nv.nvmlDeviceGetNvLinkState(h, link)
                except nv.NVMLError as e:
                    if isinstance(e, nv.NVMLError_GpuIsLost):
                        raise GpuLost(str(e)) from None
                    break  # not supported, or past the last link
                if state != nv.NVML_FEATURE_ENABLED:
                    down += 1
        return GpuSample(
            uuid, sbe_total=None if sbe is None else int(sbe), dbe_total=int(dbe or 0),
            remap_pending=bool(rows[2]) if rows else False, remap_failure=bool(rows[3]) if rows else False,
            throttled=None if reasons is None else bool(int(reasons) & self._throttle_mask),
            temperature_c=None if temp is None else int(temp), nvlink_down=down,
            limit_mw=None if enforced is None else int(enforced), usage_mw=None if usage is None else int(usage),
        )

    def wait_xids(self, timeout_s: float) -> list[XidEvent]:
        nv = self.nv
        try:
            data = nv.nvmlEventSetWait_v2(self._events, int(timeout_s * 1000))
        except nv.NVMLError as e:
            if isinstance(e, nv.NVMLError_Timeout):
                return []
            if isinstance(e, nv.NVMLError_GpuIsLost):
                return []  # the sampler reports the lost GPU
            raise self._map(e) from None
        if int(data.eventType) != int(nv.nvmlEventTypeXidCriticalError):
            return []
        try:
            uuid = _text(nv.nvmlDeviceGetUUID(data.device))
        except nv.NVMLError:
            return []
        return [XidEvent(uuid, int(data.eventData), "NVML critical XID event")]

    def get_limit_mw(self, uuid: str) -> int:
        return int(self._call(self.nv.nvmlDeviceGetEnforcedPowerLimit, self._handles[uuid]))

    def set_limit_mw(self, uuid: str, mw: int) -> None:
        with self._lock:
            self._call(self.nv.nvmlDeviceSetPowerManagementLimit, self._handles[uuid], int(mw))

    def close(self) -> None:
        nv = self.nv
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlEventSetFree(self._events)
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
