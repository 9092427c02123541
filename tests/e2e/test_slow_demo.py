"""The fail-slow demo (`make slow-demo`, issue 21 item 5), short, through the real path: a manager
subprocess (SQLite), real agents on the fake backend, 4 rank processes (2 replicas x TP2, one
stage) on the manager's gRPC watch stream. One rank is made slow by NTP_DEMO_SLOW_RANK (a sleep
inside its timed forward); nothing else tells the manager. The detector must call that GPU slow,
the GPU must become degraded at its measured speed, and the planner must publish a layout whose
reason gives the fail-slow decision and which runs without it; the dashboard's stream shows the
verdict and the per-rank figures; every step's loss still equals a single-process reference.
No wall-clock time is asserted."""

from __future__ import annotations

from pathlib import Path

from ntp_manager.demo_slow import run_slow_demo


def test_slow_rank_is_detected_degraded_and_planned_around(tmp_path: Path) -> None:
    res = run_slow_demo(factor=3.0, slow_from=6, steps_after=2, data=tmp_path / "slow", keep_up=False)
    victim = res.victim
    # the detector's verdict names the slowed GPU, with a factor well above the 1.5x margin
    slow = [v for v in res.verdicts if v["kind"] == "slow"]
    assert slow and slow[0]["gpu"] == victim, res.verdicts
    # not before the slowdown (its onset estimate may take in a noisy step before it: the machine is shared)
    assert slow[0]["factor"] >= 1.5 and slow[0]["step"] >= 6
    assert not any(v["kind"] == "slow" and v.get("gpu") != victim for v in res.verdicts), res.verdicts
    # the GPU is degraded at its measured speed (1 / factor)
    assert res.victim_state == "degraded"
    assert res.victim_speed is not None and 0.0 < res.victim_speed < 1.0 / 1.5
    # the layout: first both replicas at TP2 with the victim, then the victim's replica at TP1 without it
    assert res.versions[0] == 1 and res.tp_by_version[1] == [2, 2]
    assert victim in res.gpus_by_version[1]
    new = max(res.gpus_by_version)
    assert new > 1 and victim not in res.gpus_by_version[new] and len(res.gpus_by_version[new]) == 3
    assert sorted(res.tp_by_version[new]) == [1, 2]
    reason = res.reasons[new]
    assert "fail-slow: group" in reason and victim in reason and "exclude" in reason, reason
    assert res.steps_after >= 2
    # the dashboard's stream carries the verdict and per-rank figures
    d = res.dashboard_slow
    assert d is not None and victim in d["flagged"], d
    row = next(r for r in d["ranks"] if r["gpu"] == victim)
    assert row["slow"] and row["factor"] >= 1.5
    assert any(r["step_time_s"] for r in d["ranks"] if r["gpu"] != victim)
    assert any(v["kind"] == "slow" and v["gpu"] == victim for v in d["verdicts"])
    # training was right throughout: every step's loss equals the single-process reference
    steps = [s for s, *_ in res.losses]
    assert steps == list(range(len(steps))) and {1, new} <= {v for _, v, _, _ in res.losses}
    for s, _, loss, ref in res.losses:
        assert abs(loss - ref) <= 1e-5 * abs(ref), (s, loss, ref)
