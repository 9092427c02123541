"""Fail-slow evidence (issue 21): the real agent on the NVML backend (driven by the strict fake
pynvml) sends its GPUs' read-only counters with heartbeats over gRPC; the manager keeps the latest
per GPU and shows it on GET /v1/gpus/{uuid}."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ntp_agent.backends.nvml import NvmlBackend
from ntp_agent.core import Agent, AgentConfig
from tests.fakes.fake_pynvml import Device, make
from tests.integration.conftest import Service, eventually


@contextlib.asynccontextmanager
async def running(agent: Agent) -> AsyncIterator[Agent]:
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        agent.stopping.set()
        await asyncio.wait_for(task, 10)


async def test_heartbeats_carry_gpu_counters_to_rest(sqlite_service: Service) -> None:
    svc = sqlite_service
    hot = Device("GPU-hot", clocks_reasons=0x40, sm_clock_mhz=1200, sm_clock_max_mhz=1980, temperature_c=91,
                 nvlink_errors={(0, 0): 5, (1, 2): 2})
    cool = Device("GPU-cool", nvlink_errors_supported=False)
    nv = make([hot, cool])
    cfg = AgentConfig(manager=svc.grpc, token=await svc.agent_token("node-t"), node="node-t", domain="nvl-t",
                      heartbeat_interval_s=0.05, sample_interval_s=0.05, backoff_initial_s=0.05, backoff_max_s=0.5)
    agent = Agent(NvmlBackend(nvml=nv), cfg)
    async with running(agent):
        await eventually(lambda: svc.manager.telemetry.get("GPU-hot") and svc.manager.telemetry.get("GPU-cool"))
        async with svc.client("viewer") as c:
            body = (await c.get("/v1/gpus/GPU-hot")).json()
            t = body["telemetry"]
            assert t["node"] == "node-t" and t["clock_event_reasons"] == 0x40
            assert t["throttle_reasons"] == ["hw_thermal_slowdown"]
            assert (t["sm_clock_mhz"], t["sm_clock_max_mhz"], t["temperature_c"]) == (1200, 1980, 91)
            assert (t["usage_mw"], t["limit_mw"]) == (800_000, 1_000_000)
            assert (t["nvlink_replay"], t["nvlink_crc"], t["nvlink_recovery"]) == (5, 2, 0)
            cool_t = (await c.get("/v1/gpus/GPU-cool")).json()["telemetry"]
            assert cool_t["nvlink_replay"] is None and cool_t["clock_event_reasons"] == 0  # not supported: unset
        sig = svc.manager.telemetry.signals("GPU-hot")
        assert sig is not None and any("SM clock at 61%" in n for n in sig.notes())
        # a new reading replaces the old one: bounded to one entry per GPU
        hot.sm_clock_mhz = 1900
        await eventually(lambda: svc.manager.telemetry.get("GPU-hot").sm_clock_mhz == 1900)
        assert set(svc.manager.telemetry.latest) == {"GPU-hot", "GPU-cool"}
    assert nv.state["misuse"] == []


async def test_an_agent_configured_slower_than_the_manager_beats_at_the_managers_period(
        sqlite_service: Service) -> None:
    """The manager (heartbeat_interval_s 0.2 here) judges silence by its own period; an agent set to
    beat every 30 s takes the welcome's shorter period, so a changed counter reaches the manager
    within a few of its periods. (Before: the agent beat at its own 30 s; the change did not arrive
    within the 10 s this waits.)"""
    svc = sqlite_service
    gpu = Device("GPU-slow-cfg", sm_clock_mhz=1200)
    cfg = AgentConfig(manager=svc.grpc, token=await svc.agent_token("node-s"), node="node-s", domain="nvl-s",
                      heartbeat_interval_s=30.0, sample_interval_s=0.05, backoff_initial_s=0.05, backoff_max_s=0.5)
    agent = Agent(NvmlBackend(nvml=make([gpu])), cfg)
    async with running(agent):
        await eventually(lambda: agent.registered.is_set())
        assert agent.beat_s == svc.manager.settings.heartbeat_interval_s < 30.0
        gpu.sm_clock_mhz = 1700
        await eventually(lambda: (t := svc.manager.telemetry.get("GPU-slow-cfg")) is not None
                         and t.sm_clock_mhz == 1700)
    # an agent configured faster keeps its own period
    assert Agent(NvmlBackend(nvml=make([])), AgentConfig(manager="x", token="t", node="n", domain="d",
                                                         heartbeat_interval_s=0.1)).heartbeat_period(200) == 0.1
