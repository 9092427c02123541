"""Layout versions through a restart, on SQLite and PostgreSQL: more versions than a keyframe
interval are stored (a keyframe, deltas, a keyframe, deltas), and a manager started on the same
database holds the same current layout, shows the same history, and appends the next version to
the chain it found."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ntp_manager.store import layout_codec as codec
from tests.integration.conftest import Service, eventually, running_service
from tests.integration.test_service import JOB, start_agents


def version(svc: Service) -> int:
    lay = svc.manager.world.jobs["llm"].layout
    return 0 if lay is None else lay.version


async def flip(svc: Service, times: int, first: int = 0) -> None:
    """Cordon (even flips) and uncordon (odd) one GPU in turn: every flip is a new layout version
    (TP4 <-> TP3)."""
    async with svc.client() as c:
        for i in range(first, first + times):
            v = version(svc)
            action = "cordon" if i % 2 == 0 else "uncordon"
            r = await c.post(f"/v1/gpus/GPU-node-0-3/{action}", json={"reason": f"flip {i}"})
            assert r.status_code == 200, r.text
            await eventually(lambda v=v: version(svc) == v + 1)


async def reads(svc: Service) -> tuple[Any, Any, Any]:
    async with svc.client() as c:
        history = (await c.get("/v1/jobs/llm/layouts", params={"limit": 1000})).json()
        page = (await c.get("/v1/jobs/llm/layouts", params={"limit": 3, "offset": 5})).json()
        current = (await c.get("/v1/jobs/llm/layout")).json()
    return history, page, current


async def test_versions_across_keyframes_survive_a_restart(db_url: str, tmp_path: Path) -> None:
    n = codec.KEYFRAME_EVERY + 4  # versions 1..21: keyframes at 1 and 17
    async with running_service(db_url, tmp_path) as svc:
        agents = await start_agents(svc)
        async with svc.client() as c:
            assert (await c.post("/v1/jobs", json=JOB)).status_code == 201
        await eventually(lambda: version(svc) == 1)
        await flip(svc, n - 1)
        before = svc.manager.world.jobs["llm"].layout
        assert before.version == n and before.chain == (n - 1) % codec.KEYFRAME_EVERY
        history, page, current = await reads(svc)
        for a in agents:
            await a.close()
    assert history["total"] == n and [h["version"] for h in history["items"]] == list(range(n, 0, -1))
    # the layout alternates between two replicas at TP4 and one of them at TP3
    assert [sorted(r["tp"] for r in h["replicas"]) for h in history["items"][:2]] in ([[4, 4], [3, 4]],
                                                                                    [[3, 4], [4, 4]])
    assert [h["version"] for h in page["items"]] == [n - 5, n - 6, n - 7]
    assert page["items"] == history["items"][5:8]

    async with running_service(db_url, tmp_path) as svc:
        after = svc.manager.world.jobs["llm"].layout
        assert (after.version, after.leader_epoch < svc.manager.epoch) == (n, True)
        assert after.doc == before.doc and after.reason == before.reason and after.chain == before.chain
        assert await reads(svc) == (history, page, current)
        # the next version continues the chain that was read back
        await flip(svc, 1, first=n - 1)
        assert version(svc) == n + 1 and svc.manager.world.jobs["llm"].layout.chain == after.chain + 1
        history2, _, _ = await reads(svc)
        assert history2["items"][1:] == history["items"]
