"""`ntp-agent` as a real process (fake backend) against a real manager: READY, metrics, clean exit."""

from __future__ import annotations

import asyncio
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
        [sys.executable, "-m", "agent.main", "--manager", svc.grpc, "--token-file", str(token), "--backend", "fake",
         "--scenario", str(scenario), "--metrics-port", str(mport)],
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
