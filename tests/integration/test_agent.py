"""The real agent (fake GPU backend) against a real manager on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

from ntp_agent.backends.fake import FakeBackend, parse_scenario
from ntp_agent.core import Agent, AgentConfig
from ntp_agent.local import FakeFleet, FakeNode
from tests.fakes.procs import free_port
from tests.integration.conftest import Service, eventually, running_service

JOB = {"name": "llm", "tp": 4, "replicas": 2, "local_batch": 8, "min_tp": 2, "heads": 16, "mlp_columns": 64}


def make_agent(svc_grpc: str, token: str, node: str, domain: str, faults: list[dict], hb: float = 30.0) -> Agent:
    sc = parse_scenario({"seed": 1, "gpus": 4, "faults": faults})
    backend = FakeBackend(sc, node=node)
    cfg = AgentConfig(manager=svc_grpc, token=token, node=node, domain=domain, heartbeat_interval_s=hb,
                      sample_interval_s=0.1, backoff_initial_s=0.05, backoff_max_s=0.5)
    return Agent(backend, cfg)


@contextlib.asynccontextmanager
async def running(agent: Agent):  # type: ignore[no-untyped-def]
    task = asyncio.create_task(agent.run())
    try:
        yield agent
    finally:
        agent.stopping.set()
        await asyncio.wait_for(task, 10)


async def test_xid79_fails_the_node_before_the_next_heartbeat_and_xid13_changes_nothing(sqlite_service: Service):
    svc = sqlite_service
    # heartbeats every 30 s: anything the manager learns within the test came as an immediate report
    a = make_agent(svc.grpc, await svc.agent_token("node-a"), "node-a", "nvl-0",
                   [{"at": 0.3, "gpu": 2, "kind": "xid", "xid": 13}])
    async with running(a):
        await eventually(lambda: a.registered.is_set())
        uuids = [g.uuid for g in a.statics]
        await eventually(lambda: a.xid_counts.get(13) == 1)
        await asyncio.sleep(0.3)
        assert all(svc.manager.world.gpus[u].health == "healthy" for u in uuids)  # XID 13: nothing
        # XID 79 only once the check above is done: a scheduled time raced registration under a GC pause
        a.backend.inject("xid", 1, xid=79)
        await eventually(lambda: all(svc.manager.world.gpus[u].health == "failed" for u in uuids), timeout=5)
        async with svc.client() as c:
            ev = (await c.get("/v1/events", params={"gpu": uuids[1]})).json()["items"]
            # later reports may refine the reasons (the lost GPU stops answering samples); the XID rides on
            # the report that failed the GPU
            with_xid = [e for e in ev if 79 in e["xids"]]
            assert len(with_xid) == 1 and with_xid[0]["new_state"] == "failed"
            assert with_xid[0]["old_state"] == "healthy"
            assert any("fell off the bus" in r for r in with_xid[0]["reasons"])


async def test_power_cap_reaches_the_fake_gpu_and_is_read_back(sqlite_service: Service):
    svc = sqlite_service
    a = make_agent(svc.grpc, await svc.agent_token("node-a"), "node-a", "nvl-0",
                   [{"at": 1.0, "gpu": 3, "kind": "ecc_uncorrectable"}])
    b = make_agent(svc.grpc, await svc.agent_token("node-b"), "node-b", "nvl-1", [])
    async with running(a), running(b):
        await eventually(lambda: a.registered.is_set() and b.registered.is_set())
        async with svc.client() as c:
            assert (await c.post("/v1/jobs", json=dict(JOB, scheme="ntp-pw"))).status_code == 201
        survivors = [g.uuid for g in a.statics[:3]]
        await eventually(lambda: all(a.power.caps.get(u) and a.power.caps[u].enforced_mw for u in survivors),
                         timeout=10)
        for u in survivors:
            desired = svc.manager.world.gpus[u].desired_mw
            assert desired and desired > 1_000_000
            assert a.backend.get_limit_mw(u) == desired  # the fake GPU really holds it
        await eventually(lambda: all(svc.manager.world.gpus[u].enforced_mw == svc.manager.world.gpus[u].desired_mw
                                     for u in survivors))
    # clean shutdown restores the limits the agent found
    assert all(a.backend.get_limit_mw(u) == 1_000_000 for u in survivors)


async def test_fake_fleet_fails_a_gpu_live_and_its_repair_clears_it(sqlite_service: Service):
    # agent.local.FakeFleet, the agent's in-process entry point (the demo's agents): an injected
    # XID 48 fails the GPU at the manager; an injected repair (a GpuRepaired event, not an XID)
    # clears the agent's evidence, and its healthy verdict reaches the manager
    svc = sqlite_service
    tokens = {n: await svc.agent_token(n) for n in ("node-a", "node-b")}
    fleet = FakeFleet(svc.grpc, tokens, [FakeNode("node-a", "nvl-0"), FakeNode("node-b", "nvl-1", gpus=2)])
    try:
        await eventually(fleet.ready)
        assert len(fleet.gpus("node-a")) == 4 and len(fleet.gpus("node-b")) == 2
        bad = fleet.gpus("node-a")[3]
        world = svc.manager.world
        await eventually(lambda: bad in world.gpus)
        fleet.inject("node-a", "xid", 3, xid=48)
        await eventually(lambda: world.gpus[bad].health == "failed")
        assert all(world.gpus[u].health == "healthy" for u in fleet.gpus("node-a")[:3])
        fleet.inject("node-a", "repair", 3)
        await eventually(lambda: world.gpus[bad].health == "healthy")
    finally:
        await asyncio.to_thread(fleet.stop)



async def test_manager_restart_during_a_scenario_loses_no_report(tmp_path: Path):
    port = free_port()
    url = f"sqlite+aiosqlite:///{tmp_path / 'r.db'}"
    token_holder: dict[str, str] = {}
    async with running_service(url, tmp_path, grpc_port=port) as svc:
        token_holder["agent"] = await svc.agent_token("node-a")
        a = make_agent(svc.grpc, token_holder["agent"], "node-a", "nvl-0", [])
        task = asyncio.create_task(a.run())
        await eventually(lambda: a.registered.is_set())
        uuids = [g.uuid for g in a.statics]
    # the manager is down (and the agent knows it) while the faults happen; the agent buffers its reports
    await eventually(lambda: not a.connected.is_set(), timeout=10)
    a.backend.inject("xid", 0, xid=48)
    a.backend.inject("nvlink_down", 1)
    a.backend.inject("thermal_throttle", 2)
    await eventually(lambda: len(a.pending) >= 2, timeout=5)
    assert not a.connected.is_set()
    async with running_service(url, tmp_path, grpc_port=port) as svc2:
        await eventually(lambda: a.connected.is_set(), timeout=10)
        await eventually(lambda: not a.pending, timeout=10)
        w = svc2.manager.world
        assert w.gpus[uuids[0]].health == "failed" and w.gpus[uuids[1]].health == "failed"
        seqs = sorted(svc2.manager.world.nodes["node-a"].last_seq for _ in range(1))
        assert seqs[0] == a.last_acked == a.next_seq - 1
        async with svc2.client() as c:
            events = (await c.get("/v1/events", params={"node": "node-a"})).json()["items"]
        applied = sorted({e["seq"] for e in events if e["seq"]})
        assert applied == list(range(1, a.last_acked + 1)), "a report was lost or applied twice"
        a.stopping.set()
        await asyncio.wait_for(task, 10)
