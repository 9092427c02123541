import subprocess
import sys


def test_planner_demo_runs_and_shows_every_scheme():
    r = subprocess.run([sys.executable, "-m", "ntp_manager.demos.planner_demo"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    for scheme in ("dp-drop", "ntp", "ntp-pw"):
        assert scheme in r.stdout
    assert "relative throughput" in r.stdout
