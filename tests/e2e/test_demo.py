"""The demo scenario, smaller, with real processes: a manager subprocess (SQLite), real agents on the
fake backend, 8 rank processes on the manager's gRPC watch stream. A GPU fails (XID 48 through the
fake backend, its process killed), the job goes to TP3 on that replica and back to TP4 after the
repair; every step's loss equals a single-process reference on the same global batches."""

from __future__ import annotations

from pathlib import Path

from ntp_manager.demo import run_demo


def test_demo_scenario_fail_then_repair(tmp_path: Path) -> None:
    res = run_demo(steps_before=3, steps_degraded=3, steps_after=3, data=tmp_path / "demo", keep_up=False)
    assert res.versions == [1, 2, 3]
    assert res.tp_by_version == {1: [4, 4], 2: [3, 4], 3: [4, 4]}
    steps = [s for s, *_ in res.losses]
    assert steps == list(range(len(steps))) and len(steps) >= 9
    assert {v for _, v, _, _ in res.losses} == {1, 2, 3}
    for s, _, loss, ref in res.losses:
        assert abs(loss - ref) <= 1e-5 * abs(ref), (s, loss, ref)
    # the timeline covers every stage of the failure handling, in order
    names = [what for what, _ in res.timeline]
    for stage in ("agent report received by the manager", "plan made", "layout pushed", "reshard done",
                  "first step at the new degree"):
        assert any(n.startswith(stage) for n in names), (stage, names)
    assert res.stall_s > 0 and set(res.split) == {"detection", "plan", "push + regroup", "reshard", "first step"}
    assert res.dashboard.startswith("http://127.0.0.1:") and "token=ntp_" in res.dashboard
