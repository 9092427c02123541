"""Times keep their instant on every store (UTC stored, RFC 3339 with offset returned), the circuit
breaker's state and reason survive a crash, and silent nodes fail on schedule."""

from __future__ import annotations

import asyncio
import signal
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import httpx

from ntp_manager.service.core.inputs import GpuInventory
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.fakes.clock import FakeClock
from tests.fakes.procs import create_token, start_manager
from tests.integration.conftest import Service, eventually

IST = timezone(timedelta(hours=5, minutes=30))


def _instant(s: str) -> datetime:
    t = datetime.fromisoformat(s)
    assert t.tzinfo is not None, f"{s} has no offset"
    return t


async def test_a_maintenance_window_given_in_plus_0530_starts_on_time(service: Service) -> None:
    svc = service
    a = ScriptedAgent(svc.grpc, svc.tokens["agent"], "node-0", "nvl-0", gpu_uuids("node-0", 2))
    await a.connect()
    await a.wait_for(lambda: a.welcome is not None)
    # on PostgreSQL the welcome says the hello is durable; the leader applies it just after
    await eventually(lambda: "node-0" in svc.manager.world.nodes, timeout=10)
    now = datetime.now(UTC)
    starts, ends = (now - timedelta(minutes=1)).astimezone(IST), (now + timedelta(hours=1)).astimezone(IST)
    async with svc.client() as c:
        r = await c.post("/v1/maintenance", json={"target_kind": "node", "target": "node-0",
                                                  "starts_at": starts.isoformat(), "ends_at": ends.isoformat()})
        assert r.status_code == 201, r.text
        # the window is in force now: its start was a minute ago, whatever the offset it came with
        await eventually(lambda: all(g.admin == "maintenance" for g in svc.manager.world.gpus.values()), timeout=10)
        w = (await c.get("/v1/maintenance")).json()["items"][0]
        assert _instant(w["starts_at"]) == starts and _instant(w["ends_at"]) == ends
        # a drain deadline given at -07:00 comes back as the same instant, stored in UTC
        deadline = (now + timedelta(days=1)).astimezone(timezone(timedelta(hours=-7)))
        r = await c.post("/v1/nodes/node-0/drain", json={"deadline": deadline.isoformat(), "reason": "kernel"})
        assert r.status_code == 200 and _instant(r.json()["drain_deadline"]) == deadline
        node = (await c.get("/v1/nodes")).json()["items"][0]
        assert _instant(node["drain_deadline"]) == deadline
    from ntp_manager.store.models import NodeRow

    async with svc.manager.sm() as s:
        row = await s.get(NodeRow, "node-0")
        assert row is not None and row.drain_deadline == deadline and row.drain_deadline.utcoffset() == timedelta(0)
    await a.close()


async def test_the_breaker_and_its_reason_survive_a_crash(tmp_path: Path) -> None:
    data = tmp_path / "d"
    env = {"NTP_BREAKER_MIN_GPUS": "1", "NTP_BREAKER_SHARE": "0.1"}
    operator = create_token(data, "operator")
    agent = create_token(data, "agent", node="node-0")
    proc, info = start_manager(data, env=env)
    try:
        a = ScriptedAgent(info["grpc"], agent, "node-0", "nvl-0", gpu_uuids("node-0", 8))
        await a.connect()
        await a.wait_for(lambda: a.welcome is not None)
        await a.report({u: "failed" for u in gpu_uuids("node-0", 8)[:4]})  # acked: committed
        proc.send_signal(signal.SIGKILL)  # at once, nothing more gets a chance to run
        await asyncio.to_thread(proc.wait, 20)
        await a.close()
        proc, info = start_manager(data, env=env)
        async with httpx.AsyncClient(base_url=f"http://{info['http']}",
                                     headers={"Authorization": f"Bearer {operator}"}) as c:
            b = (await c.get("/v1/breaker")).json()
            assert b["open"] and "4 GPUs failed" in b["reason"]
            assert (await c.get("/v1/status")).json()["breaker"] == b
            assert "ntp_circuit_breaker_open 1.0" in (await c.get("/metrics")).text
            opened = (await c.get("/v1/audit", params={"action": "breaker.open"})).json()["items"]
            assert len(opened) == 1 and opened[0]["reason"] == b["reason"]
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.wait, 20)


async def test_a_silent_node_is_suspect_then_failed_on_schedule(tmp_path: Path) -> None:
    """The documented timeouts, checked with a fake clock (no sleeping): silent for more than
    suspect_after_s -> suspect; for more than fail_after_s -> failed, at the first monitor pass after."""
    clock = FakeClock()
    m = Manager(Settings(data_dir=tmp_path, suspect_after_s=6, fail_after_s=20, heartbeat_interval_s=2), clock)
    await m.start()
    try:
        await m.register_agent("n", "d", [GpuInventory("G0", 0), GpuInventory("G1", 1)], "b", "v")
        await m.register_agent("talker", "d", [GpuInventory("T0", 0)], "b", "v")
        timeline = []
        for step in range(0, 26):  # one monitor pass per second, as the monitor loop does
            clock.t = 1000.0 + step
            m.heartbeat("talker")  # a node that keeps talking stays healthy throughout
            await m.check_heartbeats()
            timeline.append((step, m.world.gpus["G0"].health))
        first = {state: next(t for t, s in timeline if s == state) for state in ("suspect", "failed")}
        assert first == {"suspect": 7, "failed": 21}  # 6 s and 20 s of silence, checked each second
        assert m.world.gpus["T0"].health == "healthy"
        assert "no heartbeat from n for 21.0s" in m.world.gpus["G1"].health_reason
    finally:
        await m.stop()
