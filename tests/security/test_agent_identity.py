"""Agent identity: a token speaks for one node. Impersonation is refused and audited, every re-hello
is audited, and a re-hello with a new inventory changes memory as well as the store."""

from __future__ import annotations

import asyncio

import grpc
from sqlalchemy import select

from ntp_manager.contract.proto.ntp.v1 import agent_pb2, common_pb2
from ntp_manager.store.models import AuditRow, GpuRow, TokenRow
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.integration.conftest import Service, eventually


async def _audit(svc: Service, action: str) -> list[AuditRow]:
    async with svc.manager.sm() as s:
        return list((await s.scalars(select(AuditRow).where(AuditRow.action == action).order_by(AuditRow.id))).all())


async def _refused(svc: Service, token: str, node: str, gpus: list[str]) -> grpc.aio.AioRpcError:
    a = ScriptedAgent(svc.grpc, token, node, "nvl-0", gpus)
    await a.connect()
    await a.wait_for(lambda: a.error is not None)
    await a.close()
    assert a.error is not None
    return a.error


async def test_a_token_for_one_node_cannot_speak_for_another(service: Service) -> None:
    svc = service
    victim = ScriptedAgent(svc.grpc, await svc.agent_token("node-1"), "node-1", "nvl-1", gpu_uuids("node-1", 4))
    await victim.connect()
    await victim.wait_for(lambda: victim.welcome is not None)
    thief_token = await svc.agent_token("node-2")
    # impersonating a registered node (to report its GPUs failed), and registering a made-up one
    for node in ("node-1", "node-9"):
        err = await _refused(svc, thief_token, node, gpu_uuids(node, 4))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "node-2" in err.details() and node in err.details()
    assert "node-9" not in svc.manager.world.nodes
    assert all(g.health == "healthy" for g in svc.manager.world.gpus.values())
    denied = await _audit(svc, "agent.denied")
    assert [r.target for r in denied] == ["node-1", "node-9"]
    assert denied[0].after["token"] == thief_token.split("_")[1] and denied[0].after["token_node"] == "node-2"
    # the victim's own stream is untouched: its reports still land
    await victim.report({"GPU-node-1-0": "degraded"})
    await svc.manager.settled()
    assert svc.manager.world.gpus["GPU-node-1-0"].health == "degraded"
    await victim.close()


async def test_an_unbound_agent_token_from_before_the_migration_is_refused(sqlite_service: Service) -> None:
    svc = sqlite_service
    token = await svc.agent_token("node-5")
    async with svc.manager.sm() as s, s.begin():  # what 0002 leaves of an old agent token: no node
        row = (await s.scalars(select(TokenRow).where(TokenRow.public_id == token.split("_")[1]))).one()
        row.node = None
    await svc.manager.token_service.reload()
    err = await _refused(svc, token, "node-5", gpu_uuids("node-5", 2))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "bound to no node" in err.details()


async def test_every_rehello_is_audited_and_a_new_inventory_reaches_memory(service: Service) -> None:
    svc = service
    token = await svc.agent_token("node-0")
    a = ScriptedAgent(svc.grpc, token, "node-0", "nvl-0", gpu_uuids("node-0", 4))
    await a.connect()
    await a.wait_for(lambda: a.welcome is not None)
    await a.close()
    await svc.manager.settled()
    assert len(await _audit(svc, "node.register")) == 1
    assert await _audit(svc, "node.rehello") == []

    # the node comes back with GPU 3 gone, GPU 0 at another index and a lower power limit, and a new GPU
    hello = a.hello()
    del hello.hello.gpus[3]
    hello.hello.gpus[0].index = 7
    hello.hello.gpus[0].power.CopyFrom(common_pb2.PowerConstraints(min_mw=100_000, default_mw=700_000,
                                                                   max_mw=700_000))
    hello.hello.gpus.append(common_pb2.GpuInfo(uuid="GPU-node-0-new", index=3, model="FakeGPU",
                                               power=common_pb2.PowerConstraints(min_mw=200_000, default_mw=1_000_000,
                                                                                 max_mw=1_300_000)))
    hello.hello.boot_id = "boot-2"
    b = ScriptedAgent(svc.grpc, token, "node-0", "nvl-0", [])
    await b.connect(hello)
    await b.wait_for(lambda: b.welcome is not None)
    await svc.manager.settled()
    rehello = await _audit(svc, "node.rehello")
    assert len(rehello) == 1
    assert rehello[0].before["boot_id"] == "boot-1" and rehello[0].after["boot_id"] == "boot-2"
    assert rehello[0].after["token"] == token.split("_")[1]
    assert rehello[0].after["added"] == ["GPU-node-0-new"] and rehello[0].after["absent"] == ["GPU-node-0-3"]

    w = svc.manager.world
    g0 = w.gpus["GPU-node-0-0"]
    assert (g0.idx, g0.tdp_mw, g0.min_mw, g0.max_mw) == (7, 700_000, 100_000, 700_000)  # memory, not just rows
    snap = {g.uuid: g for g in (await w.cluster_async()).gpus()}
    assert snap["GPU-node-0-0"].power.tdp_w == 700 and snap["GPU-node-0-0"].index == 7  # what the planner sees
    assert w.gpus["GPU-node-0-3"].health == "failed" and "absent" in w.gpus["GPU-node-0-3"].health_reason
    assert "GPU-node-0-new" in w.gpus and "GPU-node-0-new" in w.nodes["node-0"].gpus
    async with svc.manager.sm() as s:
        row = await s.get(GpuRow, "GPU-node-0-0")
        assert row is not None and (row.idx, row.tdp_mw) == (7, 700_000)
    async with svc.client("viewer") as c:
        v = (await c.get("/v1/gpus/GPU-node-0-0")).json()
        assert v["index"] == 7 and v["tdp_w"] == 700
    await b.close()

    # GPU 3 is back in the next inventory: its absence was the only evidence, so it is healthy again
    c2 = ScriptedAgent(svc.grpc, token, "node-0", "nvl-0", gpu_uuids("node-0", 4))
    await c2.connect()
    await c2.wait_for(lambda: c2.welcome is not None)
    await eventually(lambda: w.gpus["GPU-node-0-3"].health == "healthy")
    assert len(await _audit(svc, "node.rehello")) == 2
    await c2.close()


async def test_a_report_that_fails_inside_the_manager_ends_its_stream_with_internal(sqlite_service: Service) -> None:
    """Whatever breaks while applying a report (here: a store error), the agent learns the report was
    not applied: the stream ends INTERNAL with a fixed sentence, never OK, never the error's text."""
    svc = sqlite_service
    a = ScriptedAgent(svc.grpc, svc.tokens["agent"], "node-0", "nvl-0", gpu_uuids("node-0", 2))
    await a.connect()
    await a.wait_for(lambda: a.welcome is not None)
    door = svc.manager.agent_door
    original = door.report

    async def broken(*args, **kw):  # type: ignore[no-untyped-def]
        raise RuntimeError('(psycopg) INSERT INTO "health_events" VALUES (...) -- secret detail')

    door.report = lambda *a, **kw: asyncio.ensure_future(broken())  # type: ignore[method-assign]
    try:
        await a.send(agent_pb2.AgentMessage(report=agent_pb2.HealthReport(seq=1, gpus=[
            agent_pb2.GpuHealth(uuid="GPU-node-0-0", state=common_pb2.GPU_STATE_FAILED)])))
        await a.wait_for(lambda: a.error is not None)
    finally:
        door.report = original  # type: ignore[method-assign]
    assert a.error is not None and a.error.code() == grpc.StatusCode.INTERNAL
    assert "INSERT" not in a.error.details() and "secret" not in a.error.details()
    assert a.acks == []
    await a.close()
