"""The dashboard's data: `/v1/snapshot` and the server-sent event stream `/v1/stream` (auth by header
or a one-time ticket, never a token in the URL; a first snapshot at once, a new one when the state
changes)."""

from __future__ import annotations

import json

import httpx

from tests.integration.conftest import Service, eventually
from tests.integration.test_agent import JOB, make_agent, running


async def _next_snapshot(lines) -> dict:  # type: ignore[no-untyped-def]
    event = None
    async for line in lines:
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: ") and event == "snapshot":
            return json.loads(line[6:])
    raise AssertionError("the stream ended")


async def test_stream_auth_and_live_snapshots(sqlite_service: Service) -> None:
    svc = sqlite_service
    async with httpx.AsyncClient(base_url=svc.http, timeout=20) as c:
        r = await c.get("/v1/stream")
        assert r.status_code == 401 and "missing bearer token" in r.json()["detail"]
        r = await c.get("/v1/stream", headers={"Authorization": f"Bearer {svc.tokens['agent']}"})
        assert r.status_code == 403
        # a token in the URL opens nothing any more
        r = await c.get("/v1/stream", params={"token": svc.tokens["viewer"]})
        assert r.status_code == 401
        r = await c.post("/v1/stream/tickets", headers={"Authorization": f"Bearer {svc.tokens['agent']}"})
        assert r.status_code == 403
        assert (await c.get("/v1/snapshot")).status_code == 401
        page = await c.get("/")
        assert page.status_code == 200 and "EventSource" in page.text

    a = make_agent(svc.grpc, await svc.agent_token("node-a"), "node-a", "nvl-0", [])
    async with running(a):
        await eventually(lambda: a.registered.is_set())
        async with svc.client() as c:
            assert (await c.post("/v1/jobs", json=dict(JOB, replicas=1))).status_code == 201
        await eventually(lambda: svc.manager.world.jobs["llm"].layout is not None)
        async with svc.client("viewer") as c:
            r = await c.post("/v1/stream/tickets")
            assert r.status_code == 201
            ticket = r.json()["ticket"]
        async with httpx.AsyncClient(base_url=svc.http, timeout=20) as c, \
                c.stream("GET", "/v1/stream", params={"ticket": ticket}) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            lines = resp.aiter_lines()
            snap = await _next_snapshot(lines)
            assert [g["state"] for d in snap["domains"] for g in d["gpus"]] == ["healthy"] * 4
            assert [r["tp"] for r in snap["jobs"][0]["replicas"]] == [4]
            a.backend.inject("xid", 2, xid=48)
            while True:  # the next snapshots show the failure and the replica at TP3
                snap = await _next_snapshot(lines)
                states = {g["uuid"]: g["state"] for d in snap["domains"] for g in d["gpus"]}
                if states[a.statics[2].uuid] == "failed" and snap["jobs"][0]["replicas"][0]["tp"] == 3:
                    break
            assert snap["events"][0]["new"] == "failed"
        async with svc.client("viewer") as c:
            assert (await c.get("/v1/snapshot")).json()["gpus_by_state"] == {"healthy": 3, "failed": 1}
