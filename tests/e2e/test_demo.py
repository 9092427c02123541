"""The demo scenario, smaller, with real processes: a manager subprocess (SQLite), real agents on the
fake backend, 8 rank processes on the manager's gRPC watch stream, 2 replicas x 2 stages x TP2. A
GPU of replica 0's stage 1 fails (XID 48 through the fake backend, its process killed): that stage
runs at TP1, the other stages stay at TP2; a GPU of replica 1's stage 1 fails: the planner packs
the full groups into one replica, two groups change stage; both are repaired: TP2 everywhere.
Every step's loss equals a single-process reference on the same global batches."""

from __future__ import annotations

from pathlib import Path

from ntp_manager.demo import run_demo


def test_demo_scenario_fail_then_repair(tmp_path: Path) -> None:
    res = run_demo(steps_before=3, steps_degraded=3, steps_after=3, data=tmp_path / "demo", keep_up=False)
    assert res.versions[:3] == [1, 2, 3] and len(res.versions) in (4, 5)  # the repairs: one replan or two
    assert res.stages_by_version[1] == [[2, 2], [2, 2]]
    assert res.stages_by_version[2] == [[2, 1], [2, 2]]  # one stage reduced, the rest unchanged
    assert res.stages_by_version[3] == [[2, 2], [1, 1]] and res.stage_changes[3] == 2  # packed across stages
    assert res.stages_by_version[res.versions[-1]] == [[2, 2], [2, 2]]
    steps = [s for s, *_ in res.losses]
    assert steps == list(range(len(steps))) and len(steps) >= 12
    assert {1, 2, 3, res.versions[-1]} <= {v for _, v, _, _ in res.losses}
    for s, _, loss, ref in res.losses:
        assert abs(loss - ref) <= 1e-5 * abs(ref), (s, loss, ref)
    # the timeline covers every stage of the failure handling, in order
    names = [what for what, _ in res.timeline]
    for stage in ("agent report received by the manager", "plan made", "layout pushed", "reshard done",
                  "first step at the new layout"):
        assert any(n.startswith(stage) for n in names), (stage, names)
    assert res.stall_s > 0 and res.stall2_s > 0
    assert set(res.split) == {"detection", "plan", "push + regroup", "reshard", "first step"}
    assert res.dashboard.startswith("http://127.0.0.1:") and "token=ntp_" in res.dashboard
