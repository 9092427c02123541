"""Manager end to end on loopback: agents report, the control loop replans, workers watch."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import grpc
import pytest
from sqlalchemy import func, select

from ntp_manager.contract.layout import WireLayout
from ntp_manager.contract.proto.ntp.v1 import agent_pb2, common_pb2, worker_pb2, worker_pb2_grpc
from ntp_manager.store.models import AuditRow, HealthEventRow, LayoutRow
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.integration.conftest import Service, eventually

JOB = {"name": "llm", "tp": 4, "replicas": 2, "local_batch": 8, "min_tp": 2, "heads": 16, "mlp_columns": 64}


async def start_agents(svc: Service, domains: int = 2, per_node: int = 4) -> list[ScriptedAgent]:
    agents = []
    for d in range(domains):
        node = f"node-{d}"
        a = ScriptedAgent(svc.grpc, await svc.agent_token(node), node, f"nvl-{d}", gpu_uuids(node, per_node))
        await a.connect()
        await a.wait_for(lambda a=a: a.welcome is not None)
        agents.append(a)
    await svc.manager.settled()  # acks say durable; the leader's world has them once applied
    return agents


async def watch(svc: Service, job: str, gpu: str, out: list[common_pb2.Layout]) -> asyncio.Task[None]:
    channel = grpc.aio.insecure_channel(svc.grpc)
    stub = worker_pb2_grpc.WorkerServiceStub(channel)

    async def run() -> None:
        call = stub.WatchLayout(worker_pb2.WatchLayoutRequest(job=job, worker_id="w0", gpu_uuid=gpu),
                                metadata=(("authorization", f"Bearer {svc.tokens['worker']}"),))
        try:
            async for msg in call:
                out.append(msg)
        finally:
            await channel.close()

    return asyncio.create_task(run())


async def count(svc: Service, model) -> int:  # type: ignore[no-untyped-def]
    async with svc.manager.sm() as s:
        return int(await s.scalar(select(func.count()).select_from(model)) or 0)


async def test_failure_report_produces_new_layout_on_watch_stream(service: Service):
    agents = await start_agents(service)
    async with service.client() as c:
        r = await c.post("/v1/jobs", json=JOB)
        assert r.status_code == 201, r.text
        await eventually(lambda: service.manager.world.jobs["llm"].layout is not None)
        seen: list[common_pb2.Layout] = []
        victim = "GPU-node-1-2"
        task = await watch(service, "llm", victim, seen)
        await eventually(lambda: len(seen) == 1)
        first = seen[0]
        assert first.stamp.version == 1 and first.stamp.leader_epoch == service.manager.epoch
        assert sorted(r.tp for r in WireLayout.decode(first).replicas) == [4, 4]  # two TP4: a run
        assert first.own.groups[0].gpu_uuids  # the worker's own replica, with ranks
        assert len(first.peers) == 1  # a donor to fetch state from

        await agents[1].report({victim: "failed"}, xids=[79], reasons=["XID 79: fallen off the bus"])
        await eventually(lambda: len(seen) == 2)
        second = seen[1]
        assert second.stamp.version == 2
        assert sorted(r.tp for r in WireLayout.decode(second).replicas) == [3, 4]
        assert not second.HasField("own")  # the failed GPU's worker has no place any more
        assert second.world_size == 7

        layout = (await c.get("/v1/jobs/llm/layout")).json()
        assert layout["version"] == 2
        history = (await c.get("/v1/jobs/llm/layouts")).json()
        assert [h["version"] for h in history["items"]] == [2, 1]
        events = (await c.get("/v1/events", params={"gpu": victim})).json()["items"]
        assert events[0]["new_state"] == "failed" and events[0]["xids"] == [79]
        audit = (await c.get("/v1/audit", params={"action": "layout.update"})).json()["items"]
        assert len(audit) == 2
        metrics = (await c.get("/metrics")).text
        assert 'ntp_gpus{state="failed"} 1.0' in metrics
        assert "ntp_layout_pushes_total" in metrics
    task.cancel()
    for a in agents:
        await a.close()


async def test_worker_ack_and_step_reports(sqlite_service: Service):
    svc = sqlite_service
    agents = await start_agents(svc)
    async with svc.client() as c:
        assert (await c.post("/v1/jobs", json=JOB)).status_code == 201
    await eventually(lambda: svc.manager.world.jobs["llm"].layout is not None)
    channel = grpc.aio.insecure_channel(svc.grpc)
    stub = worker_pb2_grpc.WorkerServiceStub(channel)
    md = (("authorization", f"Bearer {svc.tokens['worker']}"),)
    resp = await stub.AckLayout(worker_pb2.AckLayoutRequest(
        job="llm", worker_id="w0", stamp=common_pb2.LayoutStamp(leader_epoch=svc.manager.epoch, version=1),
        status=worker_pb2.ACK_STATUS_APPLIED), metadata=md, timeout=5)
    assert resp.current.version == 1
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.AckLayout(worker_pb2.AckLayoutRequest(
            job="llm", stamp=common_pb2.LayoutStamp(leader_epoch=svc.manager.epoch, version=9)),
            metadata=md, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.AckLayout(worker_pb2.AckLayoutRequest(job="nope"), metadata=md, timeout=5)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    ok = await stub.ReportSteps(worker_pb2.StepReport(job="llm", worker_id="w0", step=3, ranks=[
        worker_pb2.RankStep(rank=0, step_time_s=0.5, tokens=4096, sequence_lengths=[2048, 2048])]),
        metadata=md, timeout=5)
    assert ok.accepted
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.ReportSteps(worker_pb2.StepReport(job="llm", ranks=[worker_pb2.RankStep(step_time_s=-1)]),
                               metadata=md, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    # Step reports stamped with the current layout are placed by it: per replica, per stage.
    lay = svc.manager.world.jobs["llm"].layout
    stamp = common_pb2.LayoutStamp(leader_epoch=lay.leader_epoch, version=lay.version)
    first_of = {r.id: r.groups[0].gpus for r in lay.doc.replicas}  # replica -> its GPUs
    for step in range(3):
        for rid, gpus in first_of.items():
            # replica 0 steps in 1.0 s, replica 1 in 2.0 s; every rank waits 0.1 s on its group
            ranks = [worker_pb2.RankStep(rank=i, gpu_uuid=u, step_time_s=1.0 + rid, compute_s=0.8 + rid,
                                         comm_wait_s=0.1, tokens=4096, sequence_sq_sum=2 * 2048**2)
                     for i, u in enumerate(gpus)]
            await stub.ReportSteps(worker_pb2.StepReport(job="llm", worker_id=f"w{rid}", step=step, stamp=stamp,
                                                         ranks=ranks), metadata=md, timeout=5)
    with pytest.raises(grpc.aio.AioRpcError) as e:  # a report that places a GPU elsewhere is mixed up
        await stub.ReportSteps(worker_pb2.StepReport(job="llm", worker_id="w0", stamp=stamp, ranks=[
            worker_pb2.RankStep(gpu_uuid=first_of[0][0], replica_id=1)]), metadata=md, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "replica_id" in (e.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as e:  # a version that does not exist yet
        await stub.ReportSteps(worker_pb2.StepReport(job="llm", stamp=common_pb2.LayoutStamp(
            leader_epoch=lay.leader_epoch, version=lay.version + 1)), metadata=md, timeout=5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stamp" in (e.value.details() or "")
    async with svc.client("viewer") as c:
        got = (await c.get("/v1/jobs/llm/steps", params={"recent": 5})).json()
        assert got["layout_version"] == lay.version
        by_rep = {r["replica"]: r for r in got["replicas"]}
        assert by_rep[0]["samples"] == 12 and by_rep[0]["mean_step_s"] == pytest.approx(1.0)  # 3 steps x 4 ranks
        assert by_rep[1]["mean_step_s"] == pytest.approx(2.0) and by_rep[1]["mean_compute_s"] == pytest.approx(1.8)
        # stage 0 holds both replicas' ranks: mean (1.0 + 2.0) / 2
        assert [(s["stage"], s["samples"]) for s in got["stages"]] == [(0, 24)]
        assert got["stages"][0]["mean_step_s"] == pytest.approx(1.5)
        assert len(got["recent"]) == 5 and got["recent"][0]["tp_group"] and got["recent"][0]["step"] == 2
        assert (await c.get("/v1/jobs/nope/steps")).status_code == 404
        metrics = (await c.get("/metrics")).text
    assert 'ntp_job_replica_step_seconds{job="llm",replica="1"} 2.0' in metrics
    assert 'ntp_job_stage_step_seconds{job="llm",stage="0"} 1.5' in metrics
    await channel.close()
    for a in agents:
        await a.close()


async def test_malformed_agent_input_is_rejected_without_side_effects(service: Service):
    (agent,) = await start_agents(service, domains=1)
    events_before = await count(service, HealthEventRow)
    # unknown GPU
    await agent.report({"GPU-elsewhere": "failed"}, wait=False)
    await agent.wait_for(lambda: agent.error is not None)
    assert agent.error.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown GPU" in agent.error.details()
    assert await count(service, HealthEventRow) == events_before
    await agent.close()

    # reconnect: the manager still expects seq 1; a gap is rejected
    agent2 = ScriptedAgent(service.grpc, service.tokens["agent"], "node-0", "nvl-0", gpu_uuids("node-0", 4))
    await agent2.connect()
    await agent2.wait_for(lambda: agent2.welcome is not None)
    assert agent2.welcome.last_applied_seq == 0
    await agent2.report({"GPU-node-0-0": "failed"}, seq=5, wait=False)
    await agent2.wait_for(lambda: agent2.error is not None)
    assert agent2.error.code() == grpc.StatusCode.INVALID_ARGUMENT and "sequence" in agent2.error.details()
    assert await count(service, HealthEventRow) == events_before
    await agent2.close()

    # a replayed seq is acknowledged and applied once
    agent3 = ScriptedAgent(service.grpc, service.tokens["agent"], "node-0", "nvl-0", gpu_uuids("node-0", 4))
    await agent3.connect()
    await agent3.wait_for(lambda: agent3.welcome is not None)
    await agent3.report({"GPU-node-0-0": "degraded"}, seq=1)
    await agent3.report({"GPU-node-0-0": "degraded"}, seq=1)
    assert agent3.acks == [1, 1]
    await service.manager.settled()
    assert await count(service, HealthEventRow) == events_before + 1
    # an operator state may not come from an agent
    await agent3.report({"GPU-node-0-1": "cordoned"}, seq=2, wait=False)
    await agent3.wait_for(lambda: agent3.error is not None)
    assert agent3.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    await agent3.close()

    # duplicate UUIDs in a hello, and a GPU claimed by two nodes
    dup = ScriptedAgent(service.grpc, await service.agent_token("node-x"), "node-x", "nvl-0", ["GPU-a", "GPU-a"])
    await dup.connect()
    await dup.wait_for(lambda: dup.error is not None)
    assert dup.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    thief = ScriptedAgent(service.grpc, await service.agent_token("node-y"), "node-y", "nvl-0", ["GPU-node-0-0"])
    await thief.connect()
    await thief.wait_for(lambda: thief.error is not None)
    assert thief.error.code() == grpc.StatusCode.INVALID_ARGUMENT and "already registered" in thief.error.details()
    # the first message must be a hello
    rude = ScriptedAgent(service.grpc, await service.agent_token("node-z"), "node-z", "nvl-0", ["GPU-z"])
    await rude.connect(agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat()))
    await rude.wait_for(lambda: rude.error is not None)
    assert rude.error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "node-x" not in service.manager.world.nodes and "node-y" not in service.manager.world.nodes


async def test_cordon_is_never_undone_by_automation(service: Service):
    agents = await start_agents(service)
    uuid = "GPU-node-0-1"
    async with service.client() as c:
        assert (await c.post("/v1/jobs", json=JOB)).status_code == 201
        r = await c.post(f"/v1/gpus/{uuid}/cordon", json={"reason": "flaky fan"})
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "cordoned" and r.json()["admin_owner"] == "test-operator"
        await eventually(lambda: uuid not in {
            u for rep in service.manager.world.jobs["llm"].layout.doc.replicas
            for g in rep.groups for u in g.gpus} if service.manager.world.jobs["llm"].layout else False)
        # the agent says the GPU is healthy: evidence changes health, never the cordon
        await agents[0].report({uuid: "failed"})
        await agents[0].report({uuid: "healthy"})
        await service.manager.settled()
        g = (await c.get(f"/v1/gpus/{uuid}")).json()
        assert g["state"] == "cordoned" and g["admin_reason"] == "flaky fan" and g["health"] == "healthy"
        # mark-healthy neither: it clears a health verdict, not a cordon
        await agents[0].report({uuid: "failed"})
        await service.manager.settled()
        r = await c.post(f"/v1/gpus/{uuid}/mark-healthy", json={"reason": "replaced DIMM"})
        assert r.status_code == 200 and r.json()["state"] == "cordoned"
        r = await c.post(f"/v1/gpus/{uuid}/uncordon", json={"reason": "fan fixed"})
        assert r.json()["state"] == "healthy"
        r = await c.post(f"/v1/gpus/{uuid}/uncordon", json={"reason": "again"})
        assert r.status_code == 409 and "not cordoned" in r.json()["detail"]
        assert (await c.post("/v1/gpus/GPU-nope/cordon", json={"reason": "x"})).status_code == 404
        assert (await c.post(f"/v1/gpus/{uuid}/cordon", json={"reason": ""})).status_code == 422
    for a in agents:
        await a.close()


async def test_drain_with_deadline_then_maintenance(service: Service):
    agents = await start_agents(service)
    async with service.client() as c:
        assert (await c.post("/v1/jobs", json=JOB)).status_code == 201
        await eventually(lambda: service.manager.world.jobs["llm"].layout is not None)
        past = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
        r = await c.post("/v1/nodes/node-1/drain", json={"deadline": past, "reason": "kernel update"})
        assert r.status_code == 422 and "future" in r.json()["detail"]
        assert (await c.post("/v1/nodes/nope/drain", json={"deadline": past, "reason": "x"})).status_code == 404
        soon = (datetime.now(UTC) + timedelta(seconds=1.5)).isoformat()
        r = await c.post("/v1/nodes/node-1/drain", json={"deadline": soon, "reason": "kernel update"})
        assert r.status_code == 200, r.text
        g = (await c.get("/v1/gpus", params={"node": "node-1"})).json()["items"]
        assert {x["state"] for x in g} == {"draining"}
        by_state = (await c.get("/v1/gpus", params={"state": "draining"})).json()["items"]
        assert {x["uuid"] for x in by_state} == {x["uuid"] for x in g}
        r = await c.get("/v1/gpus", params={"state": "drained"})  # not a state: refused, not an empty page
        assert r.status_code == 422 and r.json()["detail"].startswith("query.state:")
        await eventually(lambda: sorted(r.tp for r in service.manager.world.jobs["llm"].layout.doc.replicas)
                         == [4])
        await eventually(lambda: all(service.manager.world.gpus[u].admin == "maintenance"
                                     for u in gpu_uuids("node-1", 4)), timeout=10)
        r = await c.post("/v1/nodes/node-1/undrain", json={"reason": "done"})
        assert r.status_code == 200
        await eventually(lambda: len(service.manager.world.jobs["llm"].layout.doc.replicas) == 2)
        actions = [a["action"] for a in (await c.get("/v1/audit")).json()["items"]]
        assert {"node.drain", "node.drain_done", "node.undrain", "gpu.drain"} <= set(actions)
    for a in agents:
        await a.close()


async def test_maintenance_window(service: Service):
    agents = await start_agents(service)
    async with service.client() as c:
        now = datetime.now(UTC)
        body = {"target_kind": "domain", "target": "nvl-0", "starts_at": now.isoformat(),
                # long enough that a loaded machine still sees the window open before it ends
                "ends_at": (now + timedelta(seconds=8)).isoformat(), "reason": "firmware"}
        r = await c.post("/v1/maintenance", json=body)
        assert r.status_code == 201, r.text
        await eventually(lambda: all(service.manager.world.gpus[u].admin == "maintenance"
                                     for u in gpu_uuids("node-0", 4)))
        await eventually(lambda: all(service.manager.world.gpus[u].admin is None for u in gpu_uuids("node-0", 4)))
        bad = dict(body, ends_at=now.isoformat(), starts_at=(now + timedelta(seconds=5)).isoformat())
        assert (await c.post("/v1/maintenance", json=bad)).status_code == 422
        assert (await c.post("/v1/maintenance", json=dict(body, target="nope"))).status_code == 404
        assert (await c.delete("/v1/maintenance/999")).status_code == 404
        listed = (await c.get("/v1/maintenance")).json()
        assert listed["total"] == 1
    for a in agents:
        await a.close()


async def test_dry_run_changes_nothing_but_the_audit_log(service: Service):
    agents = await start_agents(service)
    async with service.client() as c:
        assert (await c.post("/v1/jobs", json=JOB)).status_code == 201
        await eventually(lambda: service.manager.world.jobs["llm"].layout is not None)
        before = {m.__name__: await count(service, m) for m in (LayoutRow, HealthEventRow, AuditRow)}
        states_before = {u: g.state for u, g in service.manager.world.gpus.items()}
        layout_before = (await c.get("/v1/jobs/llm/layout")).json()
        r = await c.post("/v1/plans", json={"job": "llm", "dry_run": True, "fail": ["GPU-node-0-0", "GPU-node-0-1"]})
        assert r.status_code == 200, r.text
        assert sorted(x["tp"] for x in r.json()["plan"]["replicas"]) == [2, 4]
        r2 = await c.post("/v1/plans", json={"spec": dict(JOB, name="what-if", scheme="dp-drop"), "dry_run": True})
        assert r2.status_code == 200 and r2.json()["plan"]["job"] == "what-if"
        after = {m.__name__: await count(service, m) for m in (LayoutRow, HealthEventRow, AuditRow)}
        assert after["LayoutRow"] == before["LayoutRow"] and after["HealthEventRow"] == before["HealthEventRow"]
        assert after["AuditRow"] == before["AuditRow"] + 2
        assert {u: g.state for u, g in service.manager.world.gpus.items()} == states_before
        assert (await c.get("/v1/jobs/llm/layout")).json() == layout_before
        assert "what-if" not in service.manager.world.jobs
        # bad requests
        assert (await c.post("/v1/plans", json={"dry_run": True})).status_code == 422
        assert (await c.post("/v1/plans", json={"job": "nope"})).status_code == 404
        assert (await c.post("/v1/plans", json={"job": "llm", "fail": ["GPU-x"]})).status_code == 404
        bad_spec = dict(JOB, min_tp=9)
        assert (await c.post("/v1/plans", json={"spec": bad_spec})).status_code == 422
    for a in agents:
        await a.close()


async def test_idempotency_keys(service: Service):
    job = dict(JOB, queue=True)  # no agent registered: the jobs wait for capacity (pending)
    async with service.client() as c:
        h = {"Idempotency-Key": "create-llm-1"}
        r1 = await c.post("/v1/jobs", json=job, headers=h)
        r2 = await c.post("/v1/jobs", json=job, headers=h)
        assert r1.status_code == r2.status_code == 201 and r1.json() == r2.json()
        assert r2.headers.get("Idempotent-Replay") == "true"
        r3 = await c.post("/v1/jobs", json=dict(job, replicas=3), headers=h)
        assert r3.status_code == 409 and "different request" in r3.json()["detail"]
        assert (await c.post("/v1/jobs", json=job)).status_code == 409  # no key: plain conflict
        creates = (await c.get("/v1/audit", params={"action": "job.create"})).json()["items"]
        assert len(creates) == 1
        # a failed request stores nothing under its key
        h2 = {"Idempotency-Key": "bad-1"}
        assert (await c.delete("/v1/jobs/nope", headers=h2)).status_code == 404
        assert (await c.post("/v1/jobs", json=dict(job, name="other"), headers={"Idempotency-Key": "bad-1"})
                ).status_code == 201


async def test_heartbeat_loss_suspect_then_failed_then_back(tmp_path):
    # The manager's clock is a fake one that only the test moves, so silence is measured in steps
    # the test takes, not in wall time: a loaded machine that stalls the event loop can neither
    # make node-0 (which beats at every step) look silent nor skip node-1's suspect state. The
    # manager's own monitor loop (every 0.1 s of real time) makes every transition.
    from tests.fakes.clock import FakeClock
    from tests.integration.conftest import running_service

    clock = FakeClock()
    async with running_service(f"sqlite+aiosqlite:///{tmp_path / 'hb.db'}", tmp_path, clock=clock,
                               suspect_after_s=0.6, fail_after_s=1.5, breaker_min_gpus=100) as svc:
        m = svc.manager  # its `world` is read afresh each time
        agents = await start_agents(svc)
        async with svc.client() as c:
            assert (await c.post("/v1/jobs", json=JOB)).status_code == 201

        async def tick(seconds: float) -> None:
            """Time moves on; node-0 beats and the manager has taken its beat in; node-1 stays silent."""
            clock.advance(seconds)
            await agents[0].heartbeat()
            await eventually(lambda: m.world.nodes["node-0"].last_seen == clock.monotonic())

        # node-1's stream ends (its agent died, or its connection stopped answering the manager's
        # pings): an open stream counts as heard from, however quiet (tests/integration/test_stream_liveness.py)
        await agents[1].close()
        await eventually(lambda: "node-1" not in m.agents.sessions)
        for _ in range(3):  # 0.9 s of silence: past suspect_after_s (0.6), not fail_after_s (1.5)
            await tick(0.3)
        await eventually(lambda: m.world.gpus["GPU-node-1-0"].health == "suspect")
        assert m.world.gpus["GPU-node-0-0"].health == "healthy"
        for _ in range(3):  # 1.8 s of silence: past fail_after_s
            await tick(0.3)
        await eventually(lambda: m.world.gpus["GPU-node-1-0"].health == "failed")
        assert m.world.gpus["GPU-node-0-0"].health == "healthy"
        await eventually(lambda: (lay := m.world.jobs["llm"].layout) is not None and len(lay.doc.replicas) == 1,
                         timeout=30)  # a replan (the job may have no layout yet when its first plan is slow)
        # the agent comes back: silence was the only evidence, so its GPUs are healthy again
        back = ScriptedAgent(svc.grpc, await svc.agent_token("node-1"), "node-1", "nvl-1", gpu_uuids("node-1", 4))
        await back.connect()
        await back.wait_for(lambda: back.welcome is not None)
        await eventually(lambda: m.world.gpus["GPU-node-1-0"].health == "healthy")
        for a in (agents[0], back):
            await a.close()


async def test_circuit_breaker_stops_replanning_until_reset(tmp_path):
    from tests.integration.conftest import running_service

    async with running_service(f"sqlite+aiosqlite:///{tmp_path / 'cb.db'}", tmp_path,
                               breaker_share=0.2, breaker_min_gpus=2) as svc:
        agents = await start_agents(svc, domains=3)
        async with svc.client() as c:
            assert (await c.post("/v1/jobs", json=JOB)).status_code == 201
            await eventually(lambda: svc.manager.world.jobs["llm"].layout is not None)
            # 12 GPUs, limit max(2, 0.2 * 12) = 2.4 -> the third failure inside the window trips it
            await agents[0].report({"GPU-node-0-0": "failed", "GPU-node-0-1": "failed", "GPU-node-0-2": "failed"})
            await eventually(lambda: svc.manager.breaker_open)
            assert (await c.get("/v1/breaker")).json()["open"] is True
            assert svc.manager.world.jobs["llm"].layout.version == 1  # frozen
            r = await c.post("/v1/plans", json={"job": "llm", "dry_run": False})
            assert r.status_code == 409 and "circuit breaker" in r.json()["detail"]
            r = await c.post("/v1/breaker/reset", json={"reason": "PDU replaced"})
            assert r.status_code == 200 and r.json()["was_open"] is True
            await eventually(lambda: svc.manager.world.jobs["llm"].layout.version == 2)
            actions = {a["action"] for a in (await c.get("/v1/audit")).json()["items"]}
            assert {"breaker.open", "breaker.reset"} <= actions
        for a in agents:
            await a.close()


async def test_power_caps_reach_the_agent(sqlite_service: Service):
    svc = sqlite_service
    agents = await start_agents(svc, domains=2)
    async with svc.client() as c:
        assert (await c.post("/v1/jobs", json=dict(JOB, scheme="ntp-pw"))).status_code == 201
        await eventually(lambda: svc.manager.world.jobs["llm"].layout is not None)
        await agents[0].report({"GPU-node-0-3": "failed"})
        await agents[0].wait_for(lambda: sum(m.WhichOneof("body") == "set_power" for m in agents[0].commands) >= 3)
        sets = [m.set_power for m in agents[0].commands if m.WhichOneof("body") == "set_power"]
        assert {s.gpu_uuid for s in sets} == {"GPU-node-0-0", "GPU-node-0-1", "GPU-node-0-2"}
        assert all(1_000_000 < s.limit_mw <= 1_300_000 for s in sets)
        # the agent applies and reads back; the manager records the enforced limit
        await agents[0].send(agent_pb2.AgentMessage(result=agent_pb2.CommandResult(
            ok=True, gpu_uuids=[s.gpu_uuid for s in sets],
            power=[agent_pb2.PowerReading(desired_mw=s.limit_mw, enforced_mw=s.limit_mw) for s in sets])))
        await eventually(lambda: svc.manager.world.gpus["GPU-node-0-0"].enforced_mw == sets[0].limit_mw)
        g = (await c.get("/v1/gpus/GPU-node-0-0")).json()
        assert g["desired_w"] == g["enforced_w"] == sets[0].limit_mw / 1000
        # repair: the caps are released
        await agents[0].report({"GPU-node-0-3": "healthy"})
        await agents[0].wait_for(lambda: any(m.WhichOneof("body") == "release_power" for m in agents[0].commands))
    for a in agents:
        await a.close()
