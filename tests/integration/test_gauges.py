"""The world's gauges (GPUs per state, each job's replicas) are counted when someone reads them, not
on a timer: a count is O(GPUs), 20-30 ms at 100,000 GPUs, and a count every monitor tick while
reports kept changing states cost the leader CPU per report for gauges nobody read
(service/operations/gauges.py). Real gRPC agent on loopback, real SQLite, the REST /metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.integration.conftest import eventually, running_service


async def test_gauges_are_counted_by_a_scrape_not_by_the_monitor_tick(tmp_path: Path) -> None:
    async with running_service(f"sqlite+aiosqlite:///{tmp_path / 'ntp.db'}", tmp_path,
                               heartbeat_interval_s=0.25) as svc:  # a monitor tick every 0.125 s
        m = svc.manager
        agent = ScriptedAgent(svc.grpc, await svc.agent_token("n0"), "n0", "d-n0", gpu_uuids("n0", 2))
        await agent.connect()
        await agent.wait_for(lambda: agent.welcome is not None or agent.error is not None)
        assert agent.error is None

        def failed_gauge() -> float | None:
            return m.metrics.registry.get_sample_value("ntp_gpus", {"state": "failed"})

        async with svc.client() as c:
            assert 'ntp_gpus{state="healthy"} 2.0' in (await c.get("/metrics")).text
            assert not m.gauges.stale and failed_gauge() == 0.0

            victim = gpu_uuids("n0", 2)[0]
            await agent.report({victim: "failed"})
            await eventually(lambda: m.world.gpus[victim].health == "failed")
            await asyncio.sleep(0.6)  # several monitor ticks: none of them counts
            assert m.gauges.stale and failed_gauge() == 0.0

            text = (await c.get("/metrics")).text  # the scrape counts, once
            assert 'ntp_gpus{state="failed"} 1.0' in text and 'ntp_gpus{state="healthy"} 1.0' in text
            assert not m.gauges.stale
            counts = (await c.get("/v1/status")).json()["gpus_by_state"]
            assert counts == {"healthy": 1, "failed": 1}
        await agent.close()
