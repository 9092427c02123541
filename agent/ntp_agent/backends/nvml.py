"""The NVML backend, through nvidia-ml-py (`import pynvml`).

NVML errors are mapped by subclass: GPU is lost -> GpuLost (the policy fails the GPU), not
supported -> NotSupported (the query is skipped), no permission -> NoPermission (a deployment
error the agent reports), anything else -> BackendError. XID events come from an event set
registered for critical XID errors; `wait_xids` blocks in `nvmlEventSetWait_v2` for a short
timeout (NVML raises a timeout error when nothing happened) and is run on a dedicated thread.

How each call is made (audited against nvidia-ml-py 13.x, where the Python wrapper hands its
arguments to the C function as they are):
- `nvmlDeviceGetGpuFabricInfoV` takes a *pointer* to a versioned struct: the struct's `version`
  is set explicitly (`nvmlGpuFabricInfo_v2`; older bindings did not set it in the constructor),
  its size is checked against the version, and it is passed with `ctypes.byref`. Passing the
  struct by value crashed the agent on a real H100 (issue 15). On a GPU without an NVLink fabric
  (H100) the call succeeds with state NOT_SUPPORTED and zero ids: no domain, `--domain` names it.
- Every other call takes plain ints and handles and builds its own out-structs; integers are
  passed as `int` (ctypes rejects floats and wraps negative numbers).
- Queries some GPUs do not have are optional (`_opt`): constraints, default limit, memory, PCI,
  ECC, remapped rows, retired pages (NotSupported on A100 and later), throttle reasons,
  temperature, enforced limit, usage, NVLink, SM clocks and NVLink error counters. The names of
  those that answered NotSupported are kept in `unsupported` (shown by `ntp-agent probe`).

The module is injectable (`NvmlBackend(nvml=...)`) so the tests drive this exact code with a fake
module that has nvidia-ml-py's names, signatures, error classes and its strictness about argument
types and by-reference structs (tests/fakes/fake_pynvml.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from types import ModuleType
from typing import Any

from ntp_agent.backends.base import (
    BackendError,
    BackendEvent,
    GpuLost,
    GpuSample,
    GpuStatic,
    NoPermission,
    NotSupported,
    XidEvent,
)

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
                import pynvml  # nvidia-ml-py
            except ImportError as e:  # pragma: no cover - a packaging error
                raise BackendError(f"nvidia-ml-py is not installed: {e}") from None
            nvml = pynvml
        self.nv: Any = nvml
        self._lock = threading.Lock()
        try:
            self.nv.nvmlInit()
        except self.nv.NVMLError as e:
            raise BackendError(f"NVML init failed: {e}") from None
        self._handles: dict[str, Any] = {}
        self._static: list[GpuStatic] = []
        self.unsupported: set[str] = set()  # NVML functions that answered NotSupported
        self.fabric: dict[str, dict[str, Any]] = {}  # raw fabric info per GPU (probe output)
        for i in range(self._call(self.nv.nvmlDeviceGetCount)):
            h = self._call(self.nv.nvmlDeviceGetHandleByIndex, i)
            uuid = _text(self._call(self.nv.nvmlDeviceGetUUID, h))
            self._handles[uuid] = h
            self._static.append(self._describe(i, uuid, h))
        # nvidia-ml-py 12.535+ names it ClocksEvent; older bindings only have ClocksThrottle
        nv: Any = self.nv
        self._reasons_fn: Any = (getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
                                 or nv.nvmlDeviceGetCurrentClocksThrottleReasons)
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
            self.unsupported.add(getattr(fn, "__name__", str(fn)))
            return None

    # ---- static description ---------------------------------------------------------------------
    def _describe(self, index: int, uuid: str, h: Any) -> GpuStatic:
        nv = self.nv
        lo, hi = self._opt(nv.nvmlDeviceGetPowerManagementLimitConstraints, h) or (0, 0)
        default = self._opt(nv.nvmlDeviceGetPowerManagementDefaultLimit, h) or hi
        mem = self._opt(nv.nvmlDeviceGetMemoryInfo, h)
        pci = self._opt(nv.nvmlDeviceGetPciInfo, h)
        minor = self._opt(nv.nvmlDeviceGetMinorNumber, h)
        return GpuStatic(
            uuid=uuid, index=index, model=_text(self._call(nv.nvmlDeviceGetName, h)),
            memory_bytes=int(mem.total) if mem is not None else 0,
            min_mw=int(lo), max_mw=int(hi), default_mw=int(default),
            pci_bus_id=_text(pci.busId) if pci is not None else "",
            domain=self._fabric_domain(uuid, h), minor=None if minor is None else int(minor),
        )

    def _fabric_domain(self, uuid: str, h: Any) -> str | None:
        """clusterUuid + cliqueId identify the NVLink domain (GB200-class systems); None when the GPU
        has no fabric (H100: state NOT_SUPPORTED), the fabric has not finished registering it, or
        the binding lacks the call."""
        nv = self.nv
        fn = getattr(nv, "nvmlDeviceGetGpuFabricInfoV", None)
        struct = getattr(nv, "c_nvmlGpuFabricInfo_v2_t", None) or getattr(nv, "c_nvmlGpuFabricInfoV_t", None)
        version = getattr(nv, "nvmlGpuFabricInfo_v2", None)
        if fn is None or struct is None or version is None:
            return None
        info = struct()
        if ctypes.sizeof(info) != int(version) & 0xFFFFFF:
            # The binding's struct is not the v2 layout: NVML would read past it. Skip the query.
            self.fabric[uuid] = {"error": f"{struct.__name__} is {ctypes.sizeof(info)} bytes, not v2"}
            return None
        info.version = int(version)
        try:
            fn(h, ctypes.byref(info))
        except nv.NVMLError as e:
            self.fabric[uuid] = {"error": str(e)}
            return None
        cluster = bytes(info.clusterUuid)
        state = int(info.state)
        self.fabric[uuid] = {"state": state, "status": int(info.status), "cluster_uuid": cluster.hex(),
                             "clique_id": int(info.cliqueId)}
        if state != int(getattr(nv, "NVML_GPU_FABRIC_STATE_COMPLETED", 3)) or not any(cluster):
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
            # GPUs before Ampere retire pages instead of remapping rows; A100 and later answer
            # NotSupported here (the H100 does), so it is asked only where rows are not supported.
            retired = None
            if rows is None and hasattr(nv, "nvmlDeviceGetRetiredPagesPendingStatus"):
                retired = self._opt(nv.nvmlDeviceGetRetiredPagesPendingStatus, h)
            reasons = self._opt(self._reasons_fn, h)
            sm = self._opt(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
            sm_max = self._opt(nv.nvmlDeviceGetMaxClockInfo, h, nv.NVML_CLOCK_SM)
            temp = self._opt(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
            enforced = self._opt(nv.nvmlDeviceGetEnforcedPowerLimit, h)
            usage = self._opt(nv.nvmlDeviceGetPowerUsage, h)
            down = 0
            errors: list[int | None] = [None, None, None, None]
            for link in range(int(nv.NVML_NVLINK_MAX_LINKS)):
                try:
                    state = nv.nvmlDeviceGetNvLinkState(h, link)
                except nv.NVMLError as e:
                    if isinstance(e, nv.NVMLError_GpuIsLost):
                        raise GpuLost(str(e)) from None
                    break  # not supported, or past the last link
                if state != nv.NVML_FEATURE_ENABLED:
                    down += 1
                else:
                    self._link_errors(h, link, errors)
        replay, recovery, crc_flit, crc_data = errors
        return GpuSample(
            uuid, sbe_total=None if sbe is None else int(sbe), dbe_total=int(dbe or 0),
            remap_pending=bool(rows[2]) if rows else bool(retired),
            remap_failure=bool(rows[3]) if rows else False,
            throttled=None if reasons is None else bool(int(reasons) & self._throttle_mask),
            temperature_c=None if temp is None else int(temp), nvlink_down=down,
            limit_mw=None if enforced is None else int(enforced), usage_mw=None if usage is None else int(usage),
            clock_event_reasons=None if reasons is None else int(reasons),
            sm_clock_mhz=None if sm is None else int(sm), sm_clock_max_mhz=None if sm_max is None else int(sm_max),
            nvlink_replay=replay, nvlink_recovery=recovery,
            nvlink_crc=None if crc_flit is None and crc_data is None else (crc_flit or 0) + (crc_data or 0),
        )

    def _link_errors(self, h: Any, link: int, acc: list[int | None]) -> None:
        """Add one active link's DL error counters (replay, recovery, CRC flit, CRC data) into acc;
        a counter the link does not support stays as it was (None if no link had it)."""
        nv = self.nv
        for i, counter in enumerate((nv.NVML_NVLINK_ERROR_DL_REPLAY, nv.NVML_NVLINK_ERROR_DL_RECOVERY,
                                     nv.NVML_NVLINK_ERROR_DL_CRC_FLIT, nv.NVML_NVLINK_ERROR_DL_CRC_DATA)):
            v = self._opt(nv.nvmlDeviceGetNvLinkErrorCounter, h, link, int(counter))
            if v is not None:
                acc[i] = (acc[i] or 0) + int(v)

    def wait_xids(self, timeout_s: float) -> list[BackendEvent]:
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
        """Set the limit; refuses (changing nothing) a value outside the GPU's constraints, or any
        value when the constraints are unknown."""
        st = next(g for g in self._static if g.uuid == uuid)
        if st.min_mw <= 0 or st.max_mw < st.min_mw:
            raise NotSupported(f"GPU {uuid}: power limit constraints unknown; not setting a limit")
        if not st.min_mw <= int(mw) <= st.max_mw:
            raise BackendError(f"GPU {uuid}: {int(mw)} mW is outside its constraints {st.min_mw}-{st.max_mw} mW")
        with self._lock:
            self._call(self.nv.nvmlDeviceSetPowerManagementLimit, self._handles[uuid], int(mw))

    def info(self) -> dict[str, Any]:
        """Driver and library versions, fabric answers and unsupported queries (read-only)."""
        out: dict[str, Any] = {"unsupported": sorted(self.unsupported), "fabric": dict(self.fabric)}
        for key, fn in (("driver", "nvmlSystemGetDriverVersion"), ("nvml", "nvmlSystemGetNVMLVersion")):
            f = getattr(self.nv, fn, None)
            if f is not None:
                try:
                    out[key] = _text(f())
                except self.nv.NVMLError as e:
                    out[key] = f"error: {e}"
        return out

    def close(self) -> None:
        nv = self.nv
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlEventSetFree(self._events)
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
