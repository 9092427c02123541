"""Replans keep groups in place: the manager hands the running layout to the planner, records what
moved in the layout (its reason, its `moves`), and bumps the version only when the layout itself
changed (a replan whose only difference is the groups' previous places is no new version)."""

from __future__ import annotations

from typing import Any

from tests.integration.conftest import Service, eventually
from tests.integration.test_ntpctl import ctl
from tests.integration.test_service import start_agents

# 4 NVL domains of 4 GPUs; 2 replicas of 2 pipeline stages at TP4: home layout
# r0 = [nvl-0/g0 s0, nvl-1/g0 s1], r1 = [nvl-2/g0 s0, nvl-3/g0 s1].
JOB = {"name": "pp", "tp": 4, "replicas": 2, "groups_per_replica": 2, "local_batch": 8, "min_tp": 2,
       "heads": 16, "mlp_columns": 64, "scheme": "ntp", "stage_bytes": [3_000_000_000, 5_000_000_000]}


def layout(svc: Service) -> Any:
    return svc.manager.world.jobs["pp"].layout


async def test_replans_pass_the_previous_layout_and_record_the_moves(sqlite_service: Service) -> None:
    svc = sqlite_service
    agents = await start_agents(svc, domains=4)
    async with svc.client() as c:
        assert (await c.post("/v1/jobs", json=JOB)).status_code == 201
        await eventually(lambda: layout(svc) is not None)
        v1 = layout(svc)
        assert v1.version == 1 and v1.doc.moves is None and "moves:" not in v1.reason

        # One GPU of replica 0 fails: r0 runs at TP3 (its groups stay where they are).
        await agents[0].report({"GPU-node-0-3": "failed"})
        await eventually(lambda: layout(svc).version == 2)
        v2 = layout(svc)
        assert v2.doc.moves is not None, "the replan was not given the previous layout"
        assert "; moves: " in v2.reason

        # A GPU of replica 1 fails too: two replicas at TP3 (3 + 3) lose to one at TP3 and one at
        # TP4 (3 + 4), so the two reduced groups are gathered into one replica: groups move.
        await agents[2].report({"GPU-node-2-3": "failed"})
        await eventually(lambda: layout(svc).version == 3)
        v3 = layout(svc)
        assert sorted(r.tp for r in v3.doc.replicas) == [3, 4]
        assert v3.doc.moves is not None
        moves = v3.doc.moves._asdict()
        assert moves["moved"] >= 1 and moves["bytes"] is not None
        moved_here = [g for r in v3.doc.replicas for g in r.groups if (g.prev_replica, g.prev_stage) != (r.id, g.stage)]
        assert len(moved_here) == moves["moved"]
        assert f"{moves['moved']} group(s) moved" in v3.reason and "to load" in v3.reason

        # Replanning the unchanged cluster: the plan's groups now all stay put (their previous
        # places differ from v3's), which is no change to the layout: no version 4.
        r = await c.post("/v1/plans", json={"job": "pp", "dry_run": False})
        assert r.status_code == 200, r.text
        assert r.json()["version"] == 3
        assert layout(svc) is v3
        history = (await c.get("/v1/jobs/pp/layouts")).json()
        assert history["total"] == 3
        latest = history["items"][0]  # the history names each stage's degree and the groups that moved
        assert latest["moves"] == moves
        assert sorted(r["stage_tp"] for r in latest["replicas"]) == sorted([g.tp for g in r.groups]
                                                                           for r in v3.doc.replicas)
        assert sum(len(r["moved"]) for r in latest["replicas"]) == moves["moved"]
        # every moved group is named with where it was: the history says the same as the layout
        assert sorted((m["group"], m["from_replica"], m["from_stage"]) for r in latest["replicas"]
                      for m in r["moved"]) == sorted((g.group, g.prev_replica, g.prev_stage) for g in moved_here)
        # and every version reads back from its stored body (keyframe, then deltas) as it was
        older = history["items"][1]
        assert [r["stage_tp"] for r in older["replicas"]] == [list(r.stage_tp) for r in v2.doc.replicas]
        assert older["moves"] == v2.doc.moves._asdict() and older["reason"] == v2.reason

        # The dashboard shows the moves of the current layout.
        snap = (await c.get("/v1/snapshot")).json()
        job = snap["jobs"][0]
        assert job["moves"] == moves
        shown = [g for rep in job["replicas"] for g in rep["groups"] if g["moved_from"]]
        assert len(shown) == moves["moved"]

    # ntpctl shows them too: per replica, the groups that moved there, and the summary.
    rc, out, err = await ctl(svc.http, "layout", "pp", token=svc.tokens["viewer"])
    assert rc == 0, err
    assert "(from " in out and f"moves vs the previous layout: {moves['moved']} group(s) moved" in out
    for a in agents:
        await a.close()
