"""`ntp-run` without a model: its arguments, and what it does when a rank's process dies (a
script that crashes once stands in for the training script)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ntp_run_refuses_bad_arguments() -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ntp_manager.worker.run", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)

    for args, msg in [
        (["--nproc", "4", "--tp", "3,2", "examples/train_hf_llama.py"], "does not split into replicas"),
        (["--manager", "127.0.0.1:1", "examples/train_hf_llama.py"], "--manager needs --gpus"),
        (["--manager", "127.0.0.1:1", "--gpus", "GPU-a", "examples/train_hf_llama.py"], "needs a token"),
        (["--repair-at", "3", "examples/train_hf_llama.py"], "needs an earlier --fail-at"),
        (["--nproc", "2", "no/such/script.py"], "no such script"),
    ]:
        r = run(*args)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)


def test_the_example_refuses_to_run_outside_ntp_run() -> None:
    r = subprocess.run([sys.executable, "examples/train_hf_llama.py", "--steps", "1"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "start it with ntp-run" in r.stderr


CRASH_ONCE = """
import os, pathlib, sys, time
marker = pathlib.Path(sys.argv[1]) / os.environ["NTP_WORKER_ID"]
if os.environ["NTP_WORKER_ID"] == "r0g1" and not marker.exists():
    marker.write_text("crashed")
    sys.exit(3)
time.sleep(3)
"""


def test_ntp_run_restarts_a_dead_rank_or_stops_the_run(tmp_path: Path) -> None:
    """Without a manager: a rank that dies is left out of the next layout and put back once its
    fresh process is up (--max-restarts); with no restarts left the run stops, as torchrun's."""
    script = tmp_path / "crash_once.py"
    script.write_text(CRASH_ONCE)

    def run(*flags: str) -> subprocess.CompletedProcess[str]:
        for f in tmp_path.glob("r*"):
            f.unlink()
        return subprocess.run([sys.executable, "-m", "ntp_manager.worker.run", "--nproc", "4", "--replicas", "2",
                               *flags, str(script), str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                              timeout=120)

    r = run("--max-restarts", "1", "--restart-delay", "0.2")
    assert r.returncode == 0, r.stderr
    layouts = re.findall(r"layout v\d: TP \[([\d, ]+)\] \((.*)\)", r.stderr)
    assert layouts == [("2, 2", "start"), ("1, 2", "r0g1 died"), ("2, 2", "r0g1 restarted")], r.stderr
    assert "done: 4 of 4 ranks finished cleanly" in r.stderr
    r = run()
    assert r.returncode == 1 and "r0g1: exited with status 3" in r.stderr and "stopping every rank" in r.stderr
