"""The nvml backend's own code, driven through a fake pynvml module with nvidia-ml-py's API."""

from __future__ import annotations

import pytest

from agent.backends.base import GpuLost
from agent.backends.nvml import NvmlBackend
from agent.core import Agent, AgentConfig
from agent.power import PowerController
from tests.fakes.fake_pynvml import Device, make


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
