"""`ntp-agent` as a real process (fake backend) against a real manager: READY, metrics, clean exit."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.fakes.procs import free_port
from tests.integration.conftest import Service, eventually


async def test_agent_process_reports_and_exposes_metrics(sqlite_service: Service, tmp_path: Path):
    svc = sqlite_service
    token = tmp_path / "token"
    token.write_text(await svc.agent_token("rack1-tray3") + "\n")
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text(
        "seed: 5\nnode: rack1-tray3\ndomain: nvl-7\ngpus: 4\n"
        "faults:\n  - {at: 0.5, gpu: 2, kind: xid, xid: 48}\n  - {at: 0.6, gpu: 1, kind: xid, xid: 13}\n"
    )
    mport = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ntp_agent.main", "--manager", svc.grpc, "--token-file", str(token),
         "--backend", "fake", "--scenario", str(scenario), "--metrics-port", str(mport)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line.strip() == "NTP-AGENT READY"
        await eventually(lambda: "rack1-tray3" in svc.manager.world.nodes)
        node = svc.manager.world.nodes["rack1-tray3"]
        assert node.domain == "nvl-7" and len(node.gpus) == 4
        await eventually(lambda: sum(svc.manager.world.gpus[u].health == "failed" for u in node.gpus) == 1)
        async def metrics() -> str:
            async with httpx.AsyncClient() as c:
                return (await c.get(f"http://127.0.0.1:{mport}/metrics")).text

        async def both_xids() -> bool:
            t = await metrics()
            return 'ntp_agent_xids_total{xid="48"} 1.0' in t and 'ntp_agent_xids_total{xid="13"} 1.0' in t

        await eventually(both_xids)
        text = await metrics()
        assert "ntp_agent_connected 1.0" in text and "ntp_agent_last_report_timestamp_seconds" in text
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, 15)
        assert rc == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)  # reaps it and closes its pipes


async def test_a_hung_gpu_is_failed_alone_and_its_node_keeps_heartbeating(sqlite_service: Service, tmp_path: Path):
    """A GPU whose NVML calls stop returning (the fake's `hang`): the agent fails that GPU with the
    reason within its call deadline, and keeps heartbeating for the node, so the manager neither
    waits for the heartbeat timeout nor fails the node's other GPUs."""
    svc = sqlite_service
    token = tmp_path / "token"
    token.write_text(await svc.agent_token("hang-node") + "\n")
    scenario = tmp_path / "scenario.yaml"
    scenario.write_text("seed: 9\nnode: hang-node\ndomain: nvl-9\ngpus: 4\n"
                        "faults:\n  - {at: 1.0, gpu: 2, kind: hang}\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ntp_agent.main", "--manager", svc.grpc, "--token-file", str(token),
         "--backend", "fake", "--scenario", str(scenario)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "NTP_AGENT_GPU_CALL_TIMEOUT_S": "0.5", "NTP_AGENT_HEARTBEAT_INTERVAL_S": "0.3"},
    )
    try:
        assert proc.stdout is not None
        assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "NTP-AGENT READY"
        w = svc.manager.world
        await eventually(lambda: "hang-node" in w.nodes)
        gpus = w.nodes["hang-node"].gpus
        await eventually(lambda: any(w.gpus[u].health == "failed" for u in gpus), timeout=30)
        failed = [u for u in gpus if w.gpus[u].health == "failed"]
        assert len(failed) == 1 and "GPU not answering: a sample took over 0.5s" in w.gpus[failed[0]].health_reason
        seen = w.nodes["hang-node"].last_seen
        await eventually(lambda: w.nodes["hang-node"].last_seen > seen)  # heartbeats go on after the hang
        assert sorted(w.gpus[u].health for u in gpus) == ["failed", "healthy", "healthy", "healthy"]
        proc.send_signal(signal.SIGTERM)  # a thread stuck in the driver does not hold up the exit
        assert await asyncio.to_thread(proc.wait, 15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)  # reaps it and closes its pipes
