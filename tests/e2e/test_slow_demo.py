"""The fail-slow demo (`make slow-demo`, issue 21 item 5), short, through the real path: a manager
subprocess (SQLite), real agents on the fake backend, 4 rank processes (2 replicas x TP2, one
stage) on the manager's gRPC watch stream. One rank is made slow by NTP_DEMO_SLOW_RANK (a sleep
inside its timed forward); nothing else tells the manager. The detector must call that GPU slow,
the GPU must become degraded at its measured speed, and the planner must publish a layout whose
reason gives the fail-slow decision and which runs without it; the dashboard's stream shows the
verdict and the per-rank figures; every step's loss still equals a single-process reference.
No wall-clock time is asserted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ntp_manager.demos.demo_slow import run_slow_demo
from tests.fakes.procs import descendants, still_running

ROOT = Path(__file__).resolve().parents[2]


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
    assert any(v["kind"] == "slow" and v["gpu"] == victim for v in d["verdicts"]), d["verdicts"]
    # training was right throughout: every step's loss equals the single-process reference
    steps = [s for s, *_ in res.losses]
    assert steps == list(range(len(steps))) and {1, new} <= {v for _, v, _, _ in res.losses}
    for s, _, loss, ref in res.losses:
        assert abs(loss - ref) <= 1e-5 * abs(ref), (s, loss, ref)


def test_sigterm_stops_every_process_quietly(tmp_path: Path) -> None:
    """`make slow-demo` stopped by SIGTERM (as `timeout` or a supervisor stops it) while its ranks
    train: every process it started ends (the manager, the rank processes, multiprocessing's
    resource tracker), nothing is printed on stderr (before: 'resource_tracker: There appear to
    be 12 leaked semaphore objects'), and it says on stdout that it stopped. Only the demo's own
    process gets the signal."""
    proc = subprocess.Popen([sys.executable, "-m", "ntp_manager.demos.demo_slow", "--no-wait", "--step-delay", "0.1",
                             "--data-dir", str(tmp_path / "slow")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout is not None and proc.stderr is not None
    lines: list[str] = []
    training = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("detector step"):  # the ranks report steps: they train
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started: dict[int, int] = {}
    try:
        assert training.wait(240), "".join(lines)[-3000:]
        started = descendants(proc.pid)
        # the manager, 4 ranks, the resource tracker (and the manager's planner process)
        assert len(started) >= 6, started
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        reader.join(10)
        err = proc.stderr.read()
        deadline = time.monotonic() + 15  # the resource tracker ends once it has read its pipe's end
        while still_running(started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert still_running(started) == [], started
        assert err.strip() == "", err[-3000:]
        assert "stopped (SIGTERM)" in "".join(lines[-3:]), "".join(lines)[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in still_running(started):  # what a failed check left (the manager has a session of its own)
            os.kill(pid, signal.SIGKILL)
