"""Bad input at the edge, on SQLite and PostgreSQL alike: over-long strings, NUL bytes and lone
surrogates, integers past a column's range, NaN and infinity, wrong types, oversized bodies. Each is
a 4xx / INVALID_ARGUMENT (or the matching code) naming the field, changes nothing, and never shows a
client SQL text or a 5xx. The limits themselves are in ntp_manager/contract/limits.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import grpc
import httpx
import pytest
from sqlalchemy import func, select

from ntp_manager.contract import limits
from ntp_manager.contract.proto.ntp.v1 import agent_pb2, common_pb2, worker_pb2, worker_pb2_grpc
from ntp_manager.store.models import AuditRow, HealthEventRow, JobRow
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.integration.conftest import Service, eventually

U32, U64 = 2**32 - 1, 2**64 - 1
JOB = {"name": "j", "tp": 2, "replicas": 1, "local_batch": 2, "heads": 4}
SQL_WORDS = ("INSERT", "SELECT", "UPDATE", "asyncpg", "sqlite3", "psycopg", "Traceback")


def _raw(d: dict[str, Any], **over: str) -> bytes:
    """JSON text with some values spliced in verbatim (NaN, Infinity, lone surrogates)."""
    text = json.dumps(d)
    for k, v in over.items():
        text = text[:-1] + f', "{k}": {v}' + "}"
    return text.encode()


# (what, method, path, raw body or JSON, query, field the answer must name, expected status)
REST_CASES: list[tuple[str, str, str, Any, dict[str, str] | None, str, int]] = [
    ("NaN in a spec", "POST", "/v1/jobs", _raw(JOB, attention_share="NaN"), None, "attention_share", 422),
    ("Infinity in a spec", "POST", "/v1/jobs", _raw({**JOB, "power": {}}).replace(b'"power": {}',
                                                                                   b'"power": {"max_boost": Infinity}'),
     None, "max_boost", 422),
    ("a bool for an int", "POST", "/v1/jobs", dict(JOB, tp=True), None, "tp", 422),
    ("a float for an int", "POST", "/v1/jobs", dict(JOB, replicas=1.0), None, "replicas", 422),
    ("a slash in a job name", "POST", "/v1/jobs", dict(JOB, name="a/b"), None, "name", 422),
    ("a NUL in a job name", "POST", "/v1/jobs", dict(JOB, name="a\x00b"), None, "name", 422),
    ("an over-long job name", "POST", "/v1/jobs", dict(JOB, name="j" * 129), None, "name", 422),
    ("a billion replicas", "POST", "/v1/plans", {"spec": dict(JOB, replicas=10**9)}, None, "replicas", 422),
    ("more GPUs than the cluster holds", "POST", "/v1/jobs", dict(JOB, tp=8, heads=8, replicas=20_000), None,
     "max_cluster_gpus", 422),
    ("an int64 overflow", "POST", "/v1/jobs", dict(JOB, heads=2**63), None, "heads", 422),
    ("a NUL in a reason", "POST", "/v1/gpus/GPU-node-0-0/cordon", {"reason": "a\x00b"}, None, "reason", 422),
    ("a lone surrogate in a reason", "POST", "/v1/gpus/GPU-node-0-0/cordon", b'{"reason": "a\\ud800b"}', None,
     "reason", 422),
    ("an over-long reason", "POST", "/v1/breaker/reset", {"reason": "r" * 2001}, None, "reason", 422),
    ("a NUL in a query", "GET", "/v1/events", None, {"gpu": "GPU\x00"}, "gpu", 422),
    ("a NUL in an audit filter", "GET", "/v1/audit", None, {"target": "x\x00"}, "target", 422),
    ("an over-long query", "GET", "/v1/events", None, {"node": "n" * 300}, "node", 422),
    ("a deadline past the calendar", "POST", "/v1/nodes/node-0/drain",
     {"deadline": "9999-12-31T23:59:59-05:00", "reason": "r"}, None, "deadline", 422),
    ("a naive deadline", "POST", "/v1/nodes/node-0/drain", {"deadline": "2099-01-01T00:00:00", "reason": "r"},
     None, "deadline", 422),
    ("a NUL in a maintenance target", "POST", "/v1/maintenance",
     {"target_kind": "node", "target": "node\x00", "starts_at": "2099-01-01T00:00:00Z",
      "ends_at": "2099-01-02T00:00:00Z"}, None, "target", 422),
    ("a page past the range", "GET", "/v1/gpus", None, {"offset": str(2**63)}, "offset", 422),
]


async def _counts(svc: Service) -> tuple[int, int, int]:
    async with svc.manager.sm() as s:
        return tuple([int(await s.scalar(select(func.count()).select_from(m)) or 0)  # type: ignore[return-value]
                      for m in (AuditRow, HealthEventRow, JobRow)])


@pytest.fixture
async def registered(service: Service) -> Service:
    a = ScriptedAgent(service.grpc, service.tokens["agent"], "node-0", "nvl-0", gpu_uuids("node-0", 4))
    await a.connect()
    await a.wait_for(lambda: a.welcome is not None)
    await a.close()
    await service.manager.settled()
    return service


async def test_rest_rejects_bad_input_naming_the_field(registered: Service) -> None:
    svc = registered
    before = await _counts(svc)
    async with svc.client() as c:
        for what, method, path, body, query, field, status in REST_CASES:
            kw: dict[str, Any] = {"params": query}
            if isinstance(body, bytes):
                kw |= {"content": body, "headers": {"content-type": "application/json"}}
            elif body is not None:
                kw["json"] = body
            r = await c.request(method, path, **kw)
            assert r.status_code == status, (what, r.status_code, r.text[:300])
            detail = r.json()["detail"]
            assert field in detail, (what, detail)
            assert not any(w in r.text for w in SQL_WORDS), (what, r.text[:300])
        assert (await c.get("/v1/jobs")).status_code == 200  # nothing half-stored breaks a listing
        g = (await c.get("/v1/gpus/GPU-node-0-0")).json()
        assert g["state"] == "healthy"
    assert await _counts(svc) == before


async def test_rest_body_limit_is_checked_after_auth_and_before_reading(registered: Service) -> None:
    """A declared body past the limit is refused before a byte of it is sent: 401 without a valid
    token, 413 with one. (Were the body read first, these requests would wait for it.)"""
    svc = registered
    host, port = svc.http.removeprefix("http://").split(":")
    limit = svc.manager.settings.max_request_bytes

    async def declare(length: int, token: str | None) -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port))
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        writer.write(f"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                     f"Content-Length: {length}\r\n\r\n".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.close()
        return head

    assert (await declare(100 * limit, None)).startswith(b"HTTP/1.1 401")
    assert (await declare(100 * limit, "ntp_00000000_bogus")).startswith(b"HTTP/1.1 401")
    assert (await declare(limit + 1, svc.tokens["operator"])).startswith(b"HTTP/1.1 413")

    async def chunks() -> Any:  # a chunked body that never declares its size
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    async with svc.client() as c:
        r = await c.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and "max_request_bytes" in r.json()["detail"]
        # a body just under the limit is read and judged on its content
        r = await c.post("/v1/jobs", content=b" " * (limit - 10), headers={"content-type": "application/json"})
        assert r.status_code == 422


def _hello(n: int = 2, **gpu0: Any) -> agent_pb2.AgentMessage:
    msg = ScriptedAgent("", "", "node-0", "nvl-0", gpu_uuids("node-0", n)).hello()
    g = msg.hello.gpus[0]
    for k, v in gpu0.items():
        if k == "power":
            g.power.CopyFrom(common_pb2.PowerConstraints(**v))
        else:
            setattr(g, k, v)
    return msg


def _report(seq: int = 1, **gpu: Any) -> agent_pb2.AgentMessage:
    h = agent_pb2.GpuHealth(uuid="GPU-node-0-0", state=common_pb2.GPU_STATE_DEGRADED, reasons=["r"])
    for k, v in gpu.items():
        if k == "enforced_mw":
            h.power.CopyFrom(agent_pb2.PowerReading(enforced_mw=v))
        elif k == "reasons":
            del h.reasons[:]
            h.reasons.extend(v)
        else:
            setattr(h, k, v)
    return agent_pb2.AgentMessage(report=agent_pb2.HealthReport(seq=seq, gpus=[h]))


def _long_node() -> agent_pb2.AgentMessage:
    m = _hello()
    m.hello.node = "n" * 300
    return m


def _nul_boot() -> agent_pb2.AgentMessage:
    m = _hello()
    m.hello.boot_id = "a\x00b"
    return m


# (what, first message (None: a normal hello), message after the welcome, code, field)
AGENT_CASES: list[tuple[str, Callable[[], Any] | None, Callable[[], Any] | None, grpc.StatusCode, str]] = [
    ("memory past int64", lambda: _hello(memory_bytes=U64), None, grpc.StatusCode.INVALID_ARGUMENT, "memory_bytes"),
    ("index past int32", lambda: _hello(index=U32), None, grpc.StatusCode.INVALID_ARGUMENT, "index"),
    ("power past int32", lambda: _hello(power={"min_mw": 1, "default_mw": 2, "max_mw": U32}), None,
     grpc.StatusCode.INVALID_ARGUMENT, "max_mw"),
    ("a NUL in a model name", lambda: _hello(model="H\x00100"), None, grpc.StatusCode.INVALID_ARGUMENT, "model"),
    ("a NUL in a boot id", _nul_boot, None, grpc.StatusCode.INVALID_ARGUMENT, "boot_id"),
    ("an over-long node name", _long_node, None, grpc.StatusCode.INVALID_ARGUMENT, "hello.node"),
    ("too many GPUs", lambda: _hello(limits.GPUS_PER_NODE_MAX + 1), None, grpc.StatusCode.INVALID_ARGUMENT,
     "count"),
    ("a seq past int64", None, lambda: _report(seq=U64), grpc.StatusCode.INVALID_ARGUMENT, "seq"),
    ("enforced power past int32", None, lambda: _report(enforced_mw=U32), grpc.StatusCode.INVALID_ARGUMENT,
     "enforced_mw"),
    ("a NUL in a reason", None, lambda: _report(reasons=["bad\x00"]), grpc.StatusCode.INVALID_ARGUMENT, "reasons"),
    ("too many reasons", None, lambda: _report(reasons=["r"] * 100), grpc.StatusCode.INVALID_ARGUMENT, "reasons"),
    ("an unknown GPU with a 100K-character name (the echo is capped)", None,
     lambda: _report(uuid="G" * 100_000), grpc.StatusCode.INVALID_ARGUMENT, "uuid"),
    ("a power result past int32", None, lambda: agent_pb2.AgentMessage(result=agent_pb2.CommandResult(
        gpu_uuids=["GPU-node-0-0"], power=[agent_pb2.PowerReading(enforced_mw=U32)])),
     grpc.StatusCode.INVALID_ARGUMENT, "enforced_mw"),
]


async def test_agent_stream_rejects_bad_input_naming_the_field(registered: Service) -> None:
    svc = registered
    before = await _counts(svc)
    for what, first, then, code, field in AGENT_CASES:
        a = ScriptedAgent(svc.grpc, svc.tokens["agent"], "node-0", "nvl-0", gpu_uuids("node-0", 4))
        await a.connect(first() if first else None)
        if then is not None:
            await a.wait_for(lambda a=a: a.welcome is not None or a.error is not None)
            await a.send(then())
        await a.wait_for(lambda a=a: a.error is not None, timeout=10)
        assert a.error is not None
        assert a.error.code() == code, (what, a.error.code(), a.error.details()[:300])
        assert field in a.error.details(), (what, a.error.details()[:300])
        assert len(a.error.details()) <= 1000, what
        assert not any(w in a.error.details() for w in SQL_WORDS), what
        assert a.acks == [], what
        await a.close()
    after = await _counts(svc)
    assert after[1:] == before[1:]  # no health event, no job; re-hellos of node-0 are audited
    assert all(g.health == "healthy" for g in svc.manager.world.gpus.values())


async def test_worker_calls_are_bounded_and_finite(registered: Service) -> None:
    svc = registered
    async with svc.client() as c:
        assert (await c.post("/v1/jobs", json=JOB)).status_code == 201
    await eventually(lambda: svc.manager.world.jobs["j"].layout is not None)
    epoch = svc.manager.world.jobs["j"].layout.leader_epoch
    md = (("authorization", f"Bearer {svc.tokens['worker']}"),)
    async with grpc.aio.insecure_channel(svc.grpc) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)

        async def code_of(coro: Any) -> tuple[grpc.StatusCode, str]:
            try:
                await coro
                return grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as e:
                return e.code(), e.details()

        stamp = common_pb2.LayoutStamp(leader_epoch=epoch, version=1)
        cases = [
            ("infinite step time", stub.ReportSteps(worker_pb2.StepReport(job="j", worker_id="w", ranks=[
                worker_pb2.RankStep(step_time_s=float("inf"))]), metadata=md, timeout=5),
             grpc.StatusCode.INVALID_ARGUMENT, "step_time_s"),
            ("NaN step time", stub.ReportSteps(worker_pb2.StepReport(job="j", worker_id="w", ranks=[
                worker_pb2.RankStep(step_time_s=float("nan"))]), metadata=md, timeout=5),
             grpc.StatusCode.INVALID_ARGUMENT, "step_time_s"),
            ("too many ranks", stub.ReportSteps(worker_pb2.StepReport(job="j", worker_id="w", ranks=[
                worker_pb2.RankStep()] * (limits.RANKS_PER_STEP_REPORT + 1)), metadata=md, timeout=5),
             grpc.StatusCode.INVALID_ARGUMENT, "ranks"),
            ("an ack of an older leader epoch", stub.AckLayout(worker_pb2.AckLayoutRequest(
                job="j", worker_id="w", stamp=common_pb2.LayoutStamp(leader_epoch=epoch - 1, version=1)),
                metadata=md, timeout=5), grpc.StatusCode.FAILED_PRECONDITION, "leader_epoch"),
            ("a NUL in a worker id", stub.AckLayout(worker_pb2.AckLayoutRequest(
                job="j", worker_id="w\x00", stamp=stamp), metadata=md, timeout=5),
             grpc.StatusCode.INVALID_ARGUMENT, "worker_id"),
            ("an over-long job name", stub.AckLayout(worker_pb2.AckLayoutRequest(
                job="j" * 10_000, worker_id="w", stamp=stamp), metadata=md, timeout=5),
             grpc.StatusCode.INVALID_ARGUMENT, "job"),
        ]
        for what, call, code, field in cases:
            got, details = await code_of(call)
            assert got == code and field in details, (what, got, details[:200])
            assert len(details) <= 1000, what
        # acks: a worker token cannot grow the table by inventing ids
        ok = 0
        for i in range(200):
            got, details = await code_of(stub.AckLayout(worker_pb2.AckLayoutRequest(
                job="j", worker_id=f"w{i}", stamp=stamp), metadata=md, timeout=5))
            if got == grpc.StatusCode.OK:
                ok += 1
            else:
                assert got == grpc.StatusCode.RESOURCE_EXHAUSTED and "worker_id" in details
        assert ok == 64  # max(64, 2 x the 2 GPUs the layout places)
        assert len(svc.manager.layout_acks["j"][1]) == 64
        # step reports: a window of per-rank samples within the per-job byte budget; the sequence
        # lengths are checked and summed by the worker, never kept (a sample's size does not grow)
        big = worker_pb2.StepReport(job="j", ranks=[worker_pb2.RankStep(sequence_lengths=[7] * 60_000)] * 4)
        for i in range(100):
            big.worker_id = f"w{i}"
            assert (await code_of(stub.ReportSteps(big, metadata=md, timeout=5)))[0] == grpc.StatusCode.OK
        from ntp_manager.service.worker_reports import STEP_BYTES_PER_JOB

        kept = svc.manager.workers.steps["j"]
        assert kept.used <= STEP_BYTES_PER_JOB and len(kept.samples) == 400
        assert kept.samples[-1].worker == "w99" and max(s.cost for s in kept.samples) < 2_000


async def test_json_nan_is_refused_by_the_store_too() -> None:
    """The last guard: the store's JSON serializer refuses non-finite numbers outright."""
    from ntp_manager.store.db import json_text

    with pytest.raises(ValueError):
        json_text({"x": float("nan")})
    assert json.loads(json_text({"x": 1.5})) == {"x": 1.5}


async def test_a_spec_file_with_lax_types_is_refused(tmp_path: Any) -> None:
    from ntp_manager.specfile import SpecError, load_job

    p = tmp_path / "job.yaml"
    for text, field in [("name: a\ntp: true\nreplicas: 1\nlocal_batch: 1\nheads: 1\n", "tp"),
                        ("name: a\ntp: 1\nreplicas: 1\nlocal_batch: 1\nheads: 1\nattention_share: .nan\n",
                         "attention_share"),
                        ("name: a/b\ntp: 1\nreplicas: 1\nlocal_batch: 1\nheads: 1\n", "name")]:
        p.write_text(text)
        with pytest.raises(SpecError, match=field):
            load_job(p)


async def test_http_client_sees_no_sql_when_the_store_fails(registered: Service) -> None:
    """Whatever escapes validation and fails in the store is a 500 with a fixed sentence."""
    svc = registered
    original = svc.manager.mutation

    def broken(*a: Any, **kw: Any) -> Any:
        raise RuntimeError('asyncpg.exceptions.DataError: invalid input for query argument $1: INSERT INTO "gpus"')

    svc.manager.mutation = broken  # type: ignore[method-assign]
    try:
        async with httpx.AsyncClient(base_url=svc.http, headers={"Authorization": f"Bearer {svc.tokens['operator']}"},
                                     timeout=20) as c:
            r = await c.post("/v1/gpus/GPU-node-0-0/cordon", json={"reason": "x"})
    finally:
        svc.manager.mutation = original  # type: ignore[method-assign]
    assert r.status_code == 500
    assert not any(w in r.text for w in SQL_WORDS) and "log" in r.json()["detail"]


async def test_error_text_in_grpc_trailers_is_capped(sqlite_service: Service) -> None:
    """Error text travels in trailers, which gRPC limits to ~8 KiB: however long the message the
    manager made, the client gets its status code and the text cut to 1,000 characters."""
    from ntp_manager.service.errors import InvalidArgument

    svc = sqlite_service

    async def long_error(*a: Any, **kw: Any) -> Any:
        raise InvalidArgument("stamp: " + "x" * 100_000)

    door = svc.manager.watch_door
    original = door.ack
    door.ack = long_error  # type: ignore[method-assign]
    try:
        async with grpc.aio.insecure_channel(svc.grpc) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await worker_pb2_grpc.WorkerServiceStub(ch).AckLayout(
                    worker_pb2.AckLayoutRequest(job="j", worker_id="w"),
                    metadata=(("authorization", f"Bearer {svc.tokens['worker']}"),), timeout=10)
    finally:
        door.ack = original  # type: ignore[method-assign]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("stamp: xxx") and len(e.value.details()) <= 1000
