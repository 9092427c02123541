"""bench/gpu_session.sh (issue 15's checks on a lent GPU machine, docs/gpu-runbook.md) cannot run
here; what can: its shell parses, its test selection selects tests, and the guard it puts on every
Python process refuses every NVML call that would change a GPU while reads still work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_script_parses_and_its_selection_selects_cuda_and_nccl_tests() -> None:
    for script in ("bench/gpu_session.sh", "bench/gpu_wheels.sh"):
        subprocess.run(["bash", "-n", script], cwd=ROOT, check=True)
    text = (ROOT / "bench/gpu_session.sh").read_text()
    assert '-k "cuda or nccl"' in text and "bench/gpu_guard" in text
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--co", "-p", "no:cacheprovider", "tests/worker",
                          "-k", "cuda or nccl"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    picked = out.splitlines()
    assert any("test_runtime.py::test_kill_a_rank" in line and "cuda" in line for line in picked), out[-2000:]
    assert any("nccl" in line for line in picked), out[-2000:]


def test_the_guard_refuses_every_nvml_write_and_lets_reads_through(tmp_path: Path) -> None:
    # a stand-in pynvml with one read and the writes the agent's power code would use
    (tmp_path / "pynvml.py").write_text(
        "def nvmlDeviceGetCount(): return 1\n"
        "def nvmlDeviceSetPowerManagementLimit(h, mw): raise AssertionError('reached the driver')\n"
        "def nvmlDeviceResetGpuLockedClocks(h): raise AssertionError('reached the driver')\n"
        "def nvmlDeviceSetPersistenceMode(h, m): raise AssertionError('reached the driver')\n")
    code = ("import pynvml\n"
            "assert pynvml.nvmlDeviceGetCount() == 1\n"
            "for f in (lambda: pynvml.nvmlDeviceSetPowerManagementLimit(0, 500000),\n"
            "          lambda: pynvml.nvmlDeviceResetGpuLockedClocks(0),\n"
            "          lambda: pynvml.nvmlDeviceSetPersistenceMode(0, 1)):\n"
            "    try:\n"
            "        f()\n"
            "    except RuntimeError as e:\n"
            "        assert 'read-only' in str(e)\n"
            "    else:\n"
            "        raise SystemExit('a write went through')\n"
            "print('guarded')\n")
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'bench/gpu_guard'}{os.pathsep}{tmp_path}")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "guarded", out.stderr


def _probe(*uuids: str) -> dict[str, object]:
    """The shape of `ntp-agent probe --json` (the H200 run's probe.json): each GPU's uuid appears
    in its inventory and again in its sample."""
    return {"backend": "nvml", "gpus": [{"static": {"uuid": u, "index": i}, "sample": {"uuid": u, "usage_mw": 78000}}
                                        for i, u in enumerate(uuids)],
            "backend_info": {"fabric": {u: {"state": 0} for u in uuids}}}


def test_the_session_counts_gpus_not_uuid_strings(tmp_path: Path) -> None:
    """Issue 32: one H200 was reported as "2 GPU(s) sampled" (uuid counted twice per GPU)."""
    import json

    sys.path.insert(0, str(ROOT))
    from bench.gpu_report import gpu_count

    one = _probe("GPU-0f98e174")
    assert json.dumps(one).count('"uuid"') == 2  # what the old count saw
    assert gpu_count(one) == 1
    assert gpu_count(_probe(*(f"GPU-{i}" for i in range(8)))) == 8
    assert gpu_count(_probe()) == 0
    for bad, why in (({}, "no 'gpus' list"), ({"gpus": [{"sample": {}}]}, r"gpus\[0\] has no static.uuid"),
                     (_probe("GPU-a", "GPU-a"), "lists a GPU twice")):
        with pytest.raises(ValueError, match=why):
            gpu_count(bad)
    # the script calls it so, and prints its number
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(_probe("GPU-a", "GPU-b")))
    out = subprocess.run([sys.executable, "bench/gpu_report.py", "gpus", str(path)], cwd=ROOT, capture_output=True,
                         text=True)
    assert (out.returncode, out.stdout.strip()) == (0, "2")
    path.write_text("{")
    out = subprocess.run([sys.executable, "bench/gpu_report.py", "gpus", str(path)], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 1 and "unreadable" in out.stderr
    assert "bench/gpu_report.py gpus" in (ROOT / "bench/gpu_session.sh").read_text()
