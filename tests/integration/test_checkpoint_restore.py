"""Issue 22, manager side: a restore from a checkpoint that workers report in their layout acks is
recorded once per layout version (audit row, the layout's reason and history, a counter, the job
view and the dashboard), through the real path: the workers' own GrpcLayoutSource on loopback
gRPC, a real manager and database."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from ntp_manager.contract.proto.ntp.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from ntp_manager.store.models import AuditRow
from ntp_manager.worker.sources import GrpcLayoutSource, RestoreNote
from tests.integration.conftest import Service, audit_rows, eventually, submit_job
from tests.integration.test_ntpctl import cj, ctl
from tests.integration.test_service import JOB, start_agents, watch
from tests.worker.ckpt_cases import TARGETS
from tests.worker.test_checkpoint import _shard_file, reference, save_all


async def restore_audits(svc: Service) -> list[AuditRow]:
    return await audit_rows(svc, "job.restore")  # the only action of that name


async def test_a_restore_reported_by_every_rank_is_recorded_once(service: Service) -> None:
    svc = service
    agents = await start_agents(svc)
    await submit_job(svc, JOB)
    lay = svc.manager.world.jobs["llm"].layout
    gpus = list(lay.doc.gpus)
    # every worker of the layout watches it and acks it with the same restore, all at once
    # one at a time: a source's constructor waits for the first view, which the manager builds on
    # the loop's default executor (a pool of a few threads that waiting constructors would fill)
    sources = [await asyncio.to_thread(GrpcLayoutSource, svc.grpc, svc.tokens["worker"], "llm", u) for u in gpus]
    try:
        views = [s.latest() for s in sources]
        assert all(v is not None and v.version == 1 for v in views)
        note = RestoreNote(40, "step-000000000040", "pipeline stage 0: unit 3 of 'heads' has no surviving holder",
                           ("step-000000000050: r1/__0_0.distcp: sha256 differs from the manifest's",))
        await asyncio.gather(*(asyncio.to_thread(s.ack, v, True, "restored from step 40", note)
                               for s, v in zip(sources, views, strict=True)))
        await eventually(lambda: len(svc.manager.layout_acks.get("llm", {}).get(1, {})) == len(gpus))

        (row,) = await restore_audits(svc)  # eight acks, one restore
        assert row.target == "llm" and row.actor.startswith("worker:")
        assert row.after == {"leader_epoch": svc.manager.epoch, "version": 1, "step": 40,
                             "checkpoint": "step-000000000040", "skipped": list(note.skipped)}
        assert row.reason == note.reason
        async with svc.client("viewer") as c:
            cur = (await c.get("/v1/jobs/llm/layout")).json()
            assert cur["reason"].endswith("; workers restored from step 40 (step-000000000040)"), cur["reason"]
            history = (await c.get("/v1/jobs/llm/layouts")).json()["items"]
            assert history[0]["version"] == 1 and "restored from step 40" in history[0]["reason"]
            job = (await c.get("/v1/jobs/llm")).json()
            assert job["restored"]["step"] == 40 and job["restored"]["version"] == 1
            snap = (await c.get("/v1/snapshot")).json()
            (entry,) = [j for j in snap["jobs"] if j["name"] == "llm"]
            assert entry["restored"]["step"] == 40 and "restored from step 40" in entry["reason"]
            metrics = (await c.get("/metrics")).text
        assert 'ntp_checkpoint_restores_total{job="llm"} 1.0' in metrics

        # an ack without a restore (the usual one) and a repeated one record nothing more
        await asyncio.to_thread(sources[0].ack, views[0], True)
        await asyncio.to_thread(sources[1].ack, views[1], True, "", note)
        assert len(await restore_audits(svc)) == 1

        # the next version's restore is a new one
        await agents[1].report({gpus[-1]: "failed"}, xids=[79], reasons=["XID 79"])
        await eventually(lambda: svc.manager.world.jobs["llm"].layout.version == 2)
        await eventually(lambda: all(s.latest() is not None and s.latest().version == 2 for s in sources[:2]))
        for s in sources[:2]:
            lay2 = s.latest()
            assert lay2 is not None
            await asyncio.to_thread(s.ack, lay2, True, "", RestoreNote(50, "step-000000000050"))
        rows = await restore_audits(svc)
        assert [(r.after["version"], r.after["step"]) for r in rows] == [(1, 40), (2, 50)]
        assert rows[1].reason == "the job resumed from its newest checkpoint"  # no reason given
        async with svc.client("viewer") as c:
            assert (await c.get("/v1/jobs/llm")).json()["restored"]["step"] == 50
            history = (await c.get("/v1/jobs/llm/layouts")).json()["items"]
            assert [("restored from step 50" in h["reason"], "restored from step 40" in h["reason"])
                    for h in history] == [(True, False), (False, True)]
            assert 'ntp_checkpoint_restores_total{job="llm"} 2.0' in (await c.get("/metrics")).text
    finally:
        for s in sources:
            s.close()
        for a in agents:
            await a.close()


BAD = [  # (the report, the ack's status, the field the refusal names)
    (worker_pb2.CheckpointRestore(step=4, checkpoint=""), worker_pb2.ACK_STATUS_APPLIED, "restored.checkpoint"),
    (worker_pb2.CheckpointRestore(step=4, checkpoint="step 4"), worker_pb2.ACK_STATUS_APPLIED, "restored.checkpoint"),
    (worker_pb2.CheckpointRestore(step=2**63, checkpoint="s"), worker_pb2.ACK_STATUS_APPLIED, "restored.step"),
    (worker_pb2.CheckpointRestore(step=4, checkpoint="s", reason="x" * 2001), worker_pb2.ACK_STATUS_APPLIED,
     "restored.reason"),
    (worker_pb2.CheckpointRestore(step=4, checkpoint="s", skipped=["a"] * 17), worker_pb2.ACK_STATUS_APPLIED,
     "restored.skipped"),
    (worker_pb2.CheckpointRestore(step=4, checkpoint="s", skipped=["a\x00"]), worker_pb2.ACK_STATUS_APPLIED,
     "restored.skipped[0]"),
    (worker_pb2.CheckpointRestore(step=4, checkpoint="s"), worker_pb2.ACK_STATUS_FAILED, "restored"),
]


async def test_a_bad_restore_report_is_refused_and_changes_nothing(sqlite_service: Service) -> None:
    svc = sqlite_service
    agents = await start_agents(svc)
    await submit_job(svc, JOB)
    async with grpc.aio.insecure_channel(svc.grpc) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        md = (("authorization", f"Bearer {svc.tokens['worker']}"),)
        for restored, status, field in BAD:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.AckLayout(worker_pb2.AckLayoutRequest(
                    job="llm", worker_id="w0", stamp=common_pb2.LayoutStamp(leader_epoch=svc.manager.epoch, version=1),
                    status=status, restored=restored), metadata=md, timeout=5)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert (e.value.details() or "").startswith(f"{field}:"), e.value.details()
    assert await restore_audits(svc) == []
    assert svc.manager.layout_acks.get("llm", {}).get(1, {}) == {}  # the acks themselves were not recorded either
    assert "restored" not in svc.manager.world.jobs["llm"].layout.reason
    for a in agents:
        await a.close()


async def test_the_manager_lists_checkpoints_and_a_layout_that_loses_a_unit_carries_the_step(
        sqlite_service: Service, tmp_path: Path) -> None:
    """Checkpoints written by the workers' own Checkpointer, read by the manager (REST and ntpctl);
    then a failure that leaves units of the one-replica job with no surviving holder makes the new
    layout carry the newest verified step, on the watch stream and in its reason."""
    svc = sqlite_service
    root = tmp_path / "ck"
    ref, opt = reference("sgd", steps=1)
    for step in (2, 4, 6):
        await asyncio.to_thread(save_all, root, step, "sgd", ref, opt, TARGETS["TP1"])
    victim = _shard_file(root / "step-000000000006")
    victim.write_bytes(victim.read_bytes()[:-1])  # 6 does not verify: 4 is the newest usable one
    (root / ".tmp-step-000000000008-x").mkdir()  # an attempt that never completed
    agents = await start_agents(svc)
    job = {"name": "ck", "tp": 4, "replicas": 1, "local_batch": 8, "min_tp": 2, "heads": 16, "mlp_columns": 64,
           "checkpoint": {"dir": str(root), "interval_steps": 2}}
    async with svc.client() as c:
        assert (await c.post("/v1/jobs", json=job)).status_code == 201
        # no checkpoint block; one replica: each job owns one of the two domains
        assert (await c.post("/v1/jobs", json=dict(JOB, replicas=1))).status_code == 201
    await eventually(lambda: svc.manager.world.jobs["ck"].layout is not None)
    first = svc.manager.world.jobs["ck"].layout
    assert first.doc.restore_step is None

    async with svc.client("viewer") as c:
        d = (await c.get("/v1/jobs/ck/checkpoints", params={"limit": 3})).json()
        assert d["root"] == str(root) and d["total"] == 4
        assert [(x["step"], x["complete"], x["verified"]) for x in d["items"]] == [
            (8, False, False), (6, True, False), (4, True, True)]
        assert "the manifest says" in d["items"][1]["problem"] and d["items"][2]["bytes"] > 0
        r = await c.get("/v1/jobs/llm/checkpoints")
        assert r.status_code == 409 and "no checkpoint block" in r.json()["detail"]
        assert (await c.get("/v1/jobs/nope/checkpoints")).status_code == 404
        assert (await c.get("/v1/jobs/ck/checkpoints", params={"limit": 0})).status_code == 422
    listed = await cj(svc, "checkpoints", "ck", scope="viewer")
    assert [x["step"] for x in listed["items"]] == [8, 6, 4, 2]
    rc, out, err = await ctl(svc.http, "checkpoints", "ck", token=svc.tokens["viewer"])
    assert rc == 0, err
    assert "step-000000000004" in out and "verified" in out and "the manifest says" in out

    # one GPU of the one replica fails: its units have no other holder
    gone = first.doc.replicas[0].groups[0].gpus[3]
    seen: list[common_pb2.Layout] = []
    task = await watch(svc, "ck", first.doc.replicas[0].groups[0].gpus[0], seen)
    await eventually(lambda: len(seen) == 1)
    assert not seen[0].HasField("restore_step")
    agent = next(a for a in agents if gone.startswith(f"GPU-{a.node}-"))
    await agent.report({gone: "failed"}, xids=[79], reasons=["XID 79"])
    await eventually(lambda: svc.manager.world.jobs["ck"].layout.version == 2)
    lay = svc.manager.world.jobs["ck"].layout
    assert lay.doc.restore_step == 4 and any("restore from the checkpoint of step 4" in r for r in lay.doc.reasons)
    assert "restore from the checkpoint of step 4" in lay.reason and "no surviving GPU holds units" in lay.reason
    await eventually(lambda: any(m.stamp.version == 2 for m in seen))
    assert seen[-1].stamp.version == 2 and seen[-1].restore_step == 4
    task.cancel()
    for a in agents:
        await a.close()
