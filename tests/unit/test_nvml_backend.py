"""The nvml backend's own code, driven through a fake pynvml module as strict as nvidia-ml-py,
and the fake itself checked against the installed nvidia-ml-py."""

from __future__ import annotations

import ctypes
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ntp_agent.backends.base import BackendError, GpuLost, NotSupported
from ntp_agent.backends.nvml import NvmlBackend
from ntp_agent.core import Agent, AgentConfig
from ntp_agent.main import probe
from ntp_agent.power import PowerController
from tests.fakes.fake_pynvml import Device, FakeNvmlMisuse, make

ROOT = Path(__file__).resolve().parents[2]
real = pytest.importorskip("pynvml")  # nvidia-ml-py: a runtime dependency, importable without a GPU


def backend(*devs: Device) -> tuple[NvmlBackend, object]:
    mod = make(list(devs))
    return NvmlBackend(nvml=mod), mod


def test_inventory_constraints_and_fabric_domain():
    be, _ = backend(Device("GPU-a", cluster_uuid=bytes(range(16)), clique=7), Device("GPU-b", remap_supported=False))
    a, b = be.gpus()
    assert (a.uuid, a.min_mw, a.max_mw, a.default_mw) == ("GPU-a", 200_000, 1_300_000, 1_000_000)
    assert a.domain == bytes(range(16)).hex() + "/7" and b.domain is None
    assert a.memory_bytes == 192 << 30 and a.pci_bus_id == "00000000:1B:00.0"
    s = be.sample("GPU-b")  # remapped rows not supported: ignored, the rest is read
    assert s.limit_mw == 1_000_000 and s.nvlink_down == 0 and s.temperature_c == 60


def test_xid_is_delivered_once():
    dev = Device("GPU-a")
    be, mod = backend(dev)
    mod.inject_xid(dev, 79)  # type: ignore[attr-defined]
    events = be.wait_xids(0.01)
    assert [(e.uuid, e.xid) for e in events] == [("GPU-a", 79)]
    assert be.wait_xids(0.01) == []  # NVML timeout -> nothing happened


def test_gpu_lost_is_mapped_and_fails_the_gpu():
    dev = Device("GPU-a")
    be, _ = backend(dev, Device("GPU-b"))
    dev.lost = True
    with pytest.raises(GpuLost):
        be.sample("GPU-a")
    agent = Agent(be, AgentConfig(manager="127.0.0.1:1", token="t", node="n", domain="d"))
    agent.sample_all()
    assert agent.verdicts["GPU-a"].state == "failed" and "lost" in agent.verdicts["GPU-a"].reasons[0]
    assert agent.verdicts["GPU-b"].state == "healthy"


def test_throttle_and_nvlink_and_ecc_readings():
    dev = Device("GPU-a", clocks_reasons=0x40, sbe=5, dbe=1)
    dev.links[3] = 0
    be, _ = backend(dev)
    s = be.sample("GPU-a")
    assert s.throttled is True and s.nvlink_down == 1 and s.sbe_total == 5 and s.dbe_total == 1


def test_fail_slow_signals_are_read():
    dev = Device("GPU-a", clocks_reasons=0x20 | 0x4, sm_clock_mhz=1410, sm_clock_max_mhz=1980, temperature_c=88,
                 nvlink_errors={(0, 0): 3, (2, 0): 4, (1, 1): 2, (5, 2): 7, (5, 3): 1})
    dev.links[2] = 0  # an inactive link's counters are not read
    be, nv = backend(dev)
    s = be.sample("GPU-a")
    assert s.clock_event_reasons == 0x24 and s.throttled is True
    assert (s.sm_clock_mhz, s.sm_clock_max_mhz, s.temperature_c) == (1410, 1980, 88)
    assert (s.nvlink_replay, s.nvlink_recovery, s.nvlink_crc) == (3, 2, 8)
    assert s.usage_mw == 800_000 and s.limit_mw == 1_000_000
    assert nv.state["misuse"] == []


def test_fail_slow_signals_are_optional_and_the_old_throttle_name_is_used():
    dev = Device("GPU-a", throttle_name_only=True, clocks_reasons=0x40, nvlink_errors_supported=False)
    be, nv = backend(dev)
    assert not hasattr(nv, "nvmlDeviceGetCurrentClocksEventReasons")
    s = be.sample("GPU-a")
    assert s.clock_event_reasons == 0x40 and s.throttled is True
    assert (s.nvlink_replay, s.nvlink_recovery, s.nvlink_crc) == (None, None, None)
    assert "nvmlDeviceGetNvLinkErrorCounter" in be.unsupported
    assert nv.state["calls"]["nvmlDeviceGetCurrentClocksThrottleReasons"] == 1
    nolinks = Device("GPU-b", nvlink_supported=False)
    be2, _ = backend(nolinks)
    s2 = be2.sample("GPU-b")
    assert s2.nvlink_replay is None and s2.sm_clock_mhz == 1980


def test_no_permission_on_set_is_reported():
    be, _ = backend(Device("GPU-a", refuse_set=True))
    st = PowerController(be).set("GPU-a", 1_200_000)
    assert st.error and "no permission" in st.error and "root" in st.error


def test_original_limit_is_restored():
    dev = Device("GPU-a", limit_mw=900_000)
    be, _ = backend(dev)
    pc = PowerController(be)
    st = pc.set("GPU-a", 1_150_000)
    assert st.enforced_mw == 1_150_000 and dev.limit_mw == 1_150_000 and st.original_mw == 900_000
    pc.restore_all()
    assert dev.limit_mw == 900_000


def test_close_shuts_nvml_down():
    be, mod = backend(Device("GPU-a"))
    assert mod.state["init"] == 1  # type: ignore[attr-defined]
    be.close()
    assert mod.state["init"] == 0  # type: ignore[attr-defined]


# ---- the fake is as strict as the real library ----------------------------------------------------


def old_fabric_domain(nv, h):
    """The call as shipped before issue 15: versionless struct, passed by value (a segfault on an H100)."""
    info = nv.c_nvmlGpuFabricInfoV_t()
    try:
        nv.nvmlDeviceGetGpuFabricInfoV(h, info)
    except nv.NVMLError:
        return None
    return bytes(info.clusterUuid)


def test_fake_rejects_a_struct_passed_by_value():
    nv = make([Device("GPU-a", cluster_uuid=bytes(range(16)), clique=7)])
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(FakeNvmlMisuse, match="passed by value"):
        old_fabric_domain(nv, h)  # not an NVMLError: the old `except NVMLError` cannot hide it
    assert len(nv.state["misuse"]) == 1


def test_fake_answers_a_versionless_struct_as_nvml_does():
    nv = make([Device("GPU-a", cluster_uuid=bytes(range(16)), clique=7)])
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    info = nv.c_nvmlGpuFabricInfoV_t()
    assert info.version == 0  # stricter than nvidia-ml-py 13's constructor: the caller must set it
    with pytest.raises(nv.NVMLError_ArgumentVersionMismatch):
        nv.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
    info.version = nv.nvmlGpuFabricInfo_v2
    assert nv.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info)) == 0
    assert bytes(info.clusterUuid) == bytes(range(16)) and info.cliqueId == 7
    assert info.state == nv.NVML_GPU_FABRIC_STATE_COMPLETED


def test_fake_rejects_floats_negative_ints_and_foreign_handles():
    nv = make([Device("GPU-a")])
    nv.nvmlInit()
    h = nv.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(TypeError, match="int expected"):  # what ctypes' c_uint(1.5) says
        nv.nvmlDeviceSetPowerManagementLimit(h, 1_000_000.0)
    with pytest.raises(FakeNvmlMisuse, match="wrap"):
        nv.nvmlDeviceSetPowerManagementLimit(h, -1)
    with pytest.raises(FakeNvmlMisuse, match="not a device handle"):
        nv.nvmlDeviceGetUUID(0)
    with pytest.raises(FakeNvmlMisuse, match="event set"):
        nv.nvmlEventSetWait_v2(object(), 10)


def test_fake_signatures_match_nvidia_ml_py():
    nv = make([])
    fake_fns = {n: getattr(nv, n) for n in dir(nv) if n.startswith("nvml") and inspect.isfunction(getattr(nv, n))}
    assert len(fake_fns) > 20
    for name, fn in fake_fns.items():
        assert hasattr(real, name), f"{name} is not in nvidia-ml-py"
        want = [(p.name, p.default) for p in inspect.signature(getattr(real, name)).parameters.values()]
        got = [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]
        assert got == want, f"{name}: fake {got} vs nvidia-ml-py {want}"
    for cls in ("NVMLError_NotSupported", "NVMLError_NoPermission", "NVMLError_GpuIsLost", "NVMLError_Timeout",
                "NVMLError_InvalidArgument", "NVMLError_ArgumentVersionMismatch", "NVMLError_Uninitialized"):
        assert getattr(nv, cls)().value == getattr(real, cls)(0).value, cls


def test_fake_fabric_struct_has_the_real_layout():
    ours, theirs = make([]).c_nvmlGpuFabricInfoV_t, real.c_nvmlGpuFabricInfo_v2_t
    assert [(n, ctypes.sizeof(t)) for n, t in ours._fields_] == [(n, ctypes.sizeof(t)) for n, t in theirs._fields_]
    assert ctypes.sizeof(ours) == ctypes.sizeof(theirs) == real.nvmlGpuFabricInfo_v2 & 0xFFFFFF
    assert make([]).nvmlGpuFabricInfo_v2 == real.nvmlGpuFabricInfo_v2
    for name in ("NVML_NVLINK_MAX_LINKS", "nvmlEventTypeXidCriticalError", "NVML_GPU_FABRIC_STATE_COMPLETED",
                 "nvmlClocksEventReasonHwThermalSlowdown", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_CLOCK_SM",
                 "NVML_NVLINK_ERROR_DL_REPLAY", "NVML_NVLINK_ERROR_DL_RECOVERY", "NVML_NVLINK_ERROR_DL_CRC_FLIT",
                 "NVML_NVLINK_ERROR_DL_CRC_DATA"):
        assert getattr(make([]), name) == getattr(real, name), name


def test_backend_names_only_what_nvidia_ml_py_has():
    src = (ROOT / "agent" / "ntp_agent" / "backends" / "nvml.py").read_text()
    names = set(re.findall(r"\bnv\.(\w+)", src)) | set(re.findall(r"getattr\((?:self\.)?nv, \"(\w+)\"", src))
    names |= set(re.findall(r"\"(nvml\w+)\"", src))
    names -= {"NVMLError"}
    assert len(names) > 25
    missing = sorted(n for n in names if not hasattr(real, n))
    assert not missing, f"not in nvidia-ml-py: {missing}"


def test_h100_as_recorded_constructs_and_samples_without_misuse():
    dev = Device.h100("GPU-h100")
    be, nv = backend(dev)
    (g,) = be.gpus()
    assert (g.model, g.min_mw, g.default_mw, g.max_mw) == ("NVIDIA H100 80GB HBM3", 200_000, 700_000, 700_000)
    assert g.domain is None
    assert be.fabric["GPU-h100"]["state"] == 0  # NOT_SUPPORTED: no NVLink fabric on this machine
    s = be.sample("GPU-h100")
    assert s.limit_mw == 700_000 and s.remap_pending is False
    assert be.unsupported == set()  # remapped rows answered, so retired pages were never asked
    assert be.wait_xids(0.0) == []
    be.set_limit_mw("GPU-h100", 600_000)
    assert be.get_limit_mw("GPU-h100") == 600_000
    be.close()
    assert nv.state["misuse"] == []


def test_retired_pages_are_asked_only_without_row_remapping_and_stay_optional():
    old = Device("GPU-v100", remap_supported=False, retired_pages_supported=True, retired_pending=True)
    neither = Device("GPU-x", remap_supported=False)
    be, nv = backend(old, neither)
    assert be.sample("GPU-v100").remap_pending is True
    assert be.sample("GPU-x").remap_pending is False
    assert be.unsupported == {"nvmlDeviceGetRemappedRows", "nvmlDeviceGetRetiredPagesPendingStatus"}
    assert nv.state["misuse"] == []


def test_set_limit_outside_constraints_or_unknown_is_refused_before_nvml():
    dev = Device.h100("GPU-a")
    blind = Device("GPU-b", constraints_supported=False)
    be, nv = backend(dev, blind)
    with pytest.raises(BackendError, match="outside its constraints"):
        be.set_limit_mw("GPU-a", 750_000)
    with pytest.raises(NotSupported, match="constraints unknown"):
        be.set_limit_mw("GPU-b", 500_000)
    assert nv.state["set_calls"] == 0 and dev.limit_mw == 700_000


def test_probe_reads_and_never_sets():
    lost = Device("GPU-b", cluster_uuid=bytes(range(16)), clique=3)
    be, nv = backend(Device.h100("GPU-a"), lost)
    lost.lost = True
    doc = probe(be, be.domain_of_node())
    json.dumps(doc)  # plain data
    a, b = doc["gpus"]
    assert a["static"]["max_mw"] == 700_000 and a["sample"]["limit_mw"] == 700_000
    # the counters a heartbeat carries, read back from the message built from the (mocked NVML) sample
    hb, sm = a["heartbeat"], a["sample"]
    assert [hb[k] for k in ("limit_mw", "usage_mw", "temperature_c")] == [sm[k] for k in ("limit_mw", "usage_mw",
                                                                                          "temperature_c")]
    assert (hb["ecc_corrected"], hb["ecc_uncorrected"]) == (sm["sbe_total"], sm["dbe_total"])
    assert "GpuLost" in b["sample_error"] and "heartbeat" not in b
    assert doc["backend_info"]["driver"].startswith("580") and doc["backend_info"]["fabric"]["GPU-a"]["state"] == 0
    assert nv.state["set_calls"] == 0 and "nvmlDeviceSetPowerManagementLimit" not in nv.state["calls"]
    assert nv.state["misuse"] == []


def test_probe_cli_prints_json_and_fails_cleanly_without_nvml(tmp_path):
    sc = tmp_path / "sc.yaml"
    sc.write_text("gpus: [{tdp_w: 700, max_w: 700}]\ndomain: nvl-0\n")
    r = subprocess.run([sys.executable, "-m", "ntp_agent.main", "probe", "--backend", "fake", "--scenario",
                        str(sc), "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["domain"] == "nvl-0" and doc["gpus"][0]["static"]["max_mw"] == 700_000
    try:
        real.nvmlInit()
        real.nvmlShutdown()
        return  # a machine with a driver: nothing to check here
    except real.NVMLError:
        pass
    r = subprocess.run([sys.executable, "-m", "ntp_agent.main", "probe"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "NVML" in r.stderr and "Traceback" not in r.stderr


# ---- power caps: never outside the GPU's constraints, always read back ---------------------------


def test_cap_above_max_or_below_min_is_clamped_and_reported():
    # H100: 200-700 W. A base cap of 0.85 x 700 = 595 W for healthy GPUs; a boost request of 800 W
    # (above the maximum) is clamped to 700 W, a request of 100 W to the 200 W minimum.
    dev = Device.h100("GPU-a")
    be, nv = backend(dev)
    pc = PowerController(be)
    st = pc.set("GPU-a", 595_000)
    assert (st.desired_mw, st.enforced_mw, st.note, st.error) == (595_000, 595_000, None, None)
    st = pc.set("GPU-a", 800_000)
    assert st.desired_mw == st.enforced_mw == dev.limit_mw == 700_000
    assert "clamped to the GPU's maximum 700000" in st.note and st.error is None
    st = pc.set("GPU-a", 100_000)
    assert dev.limit_mw == 200_000 and "minimum 200000" in st.note
    assert pc.clamped_events == 2 and nv.state["misuse"] == []


def test_enforced_limit_is_read_back_and_a_mismatch_is_an_error_not_retried():
    dev = Device.h100("GPU-a")
    dev.enforce_ceiling_mw = 650_000  # another limit in force on this GPU
    be, nv = backend(dev)
    pc = PowerController(be)
    st = pc.set("GPU-a", 700_000)
    assert st.enforced_mw == 650_000 and "driver enforces 650000 mW" in st.error
    calls = nv.state["set_calls"]
    assert pc.reconcile() == [] and nv.state["set_calls"] == calls  # not re-set every period
    dev.limit_mw = 700_000  # a driver reload: the enforced limit moved, so it is re-applied
    assert pc.reconcile() == ["GPU-a"] and dev.limit_mw == 650_000


def test_unknown_constraints_mean_no_limit_is_ever_set():
    dev = Device("GPU-a", constraints_supported=False)
    be, nv = backend(dev)
    st = PowerController(be).set("GPU-a", 900_000)
    assert "unknown" in st.error and st.desired_mw is None
    assert nv.state["set_calls"] == 0


def test_agent_reports_the_clamp_and_the_enforced_limit_to_the_manager():
    from ntp_manager.contract.proto.ntp.v1 import agent_pb2

    be, _ = backend(Device.h100("GPU-a"))
    agent = Agent(be, AgentConfig(manager="127.0.0.1:1", token="t", node="n", domain="d"))
    msg = agent_pb2.ManagerMessage(command_id=1, set_power=agent_pb2.SetPowerLimit(gpu_uuid="GPU-a",
                                                                                      limit_mw=760_000))
    res = agent.on_command(msg).result
    assert res.ok and "clamped" in res.detail
    assert (res.power[0].desired_mw, res.power[0].enforced_mw) == (700_000, 700_000)
