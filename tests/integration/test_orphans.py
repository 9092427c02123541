"""No process outlives the test run that started it.

- A SIGKILLed manager leaves no process behind: its planner process (service/planning/planproc.py), and the
  resource tracker (and forkserver) that multiprocessing started for it, end with it. Before, they
  waited for ever, adopted by init (six such sets stayed after every CI run, one per manager
  subprocess that a test SIGKILLed; bench/ha.py left one per round), and the forkserver's socket
  stayed in a /tmp/pymp-* directory.
- A manager subprocess that a failed test did not stop is stopped when the test process exits
  (tests/fakes/procs.py); before, it served on, adopted by init."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.fakes.procs import create_token, descendants, start_manager, still_running

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# no GPU has registered: the dry run is refused, but by the planner, in the planner process
SPEC = {"name": "p", "tp": 1, "replicas": 1, "local_batch": 1, "heads": 1}


async def until(cond: Callable[[], bool], timeout: float) -> bool:
    """Polls `cond` every 0.1 s until it holds or `timeout` seconds have passed; its last value."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            return cond()
        await asyncio.sleep(0.1)
    return True


def cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    return "?"


async def test_a_sigkilled_manager_takes_its_planner_processes_with_it(tmp_path: Path) -> None:
    data = tmp_path / "d"
    token = create_token(data, "operator")
    tmp = tmp_path / "tmp"  # the manager's temporary files
    tmp.mkdir()
    proc, info = start_manager(data, env={"TMPDIR": str(tmp)})
    family: dict[int, int] = {}
    try:
        async with httpx.AsyncClient(
            base_url=f"http://{info['http']}", timeout=60, headers={"Authorization": f"Bearer {token}"}
        ) as c:
            r = await c.post("/v1/plans", json={"spec": SPEC})  # starts the planner process
        assert r.status_code < 500, r.text
        # the planner's worker and the resource tracker (and a forkserver, were the worker forked
        # from one)

        def worker_up() -> bool:
            return any("resource_tracker" not in cmdline(p) for p in descendants(proc.pid))

        assert await until(worker_up, 60), [cmdline(p) for p in descendants(proc.pid)]
        family = descendants(proc.pid)
        assert len(family) >= 2 and any("resource_tracker" in cmdline(p) for p in family), [cmdline(p) for p in family]

        proc.send_signal(signal.SIGKILL)  # no shutdown, no atexit: only what the kernel does
        await asyncio.to_thread(proc.wait, 20)
        # generous: they go within a second of the kill
        gone = await until(lambda: not still_running(family), 60)
        assert gone, [f"{p}: {cmdline(p)}" for p in still_running(family)]
        # nor a file: a forkserver's socket, in a directory of its own, stayed in /tmp
        assert not list(tmp.iterdir())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(20)
        for pid in still_running(family):  # this test's own leftovers, by the pids it recorded
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


LEAVER = """
import json, os, sys
from pathlib import Path
from tests.fakes.procs import descendants, start_manager
start_manager(Path(sys.argv[1]))
print(json.dumps(descendants(os.getpid())), flush=True)
"""  # a test process whose test failed before it stopped its manager: it just exits


async def test_a_manager_that_a_failed_test_left_running_is_stopped_when_the_test_process_exits(
    tmp_path: Path,
) -> None:
    root = Path(__file__).resolve().parents[2]
    out = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", LEAVER, str(tmp_path / "d")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    family = {int(pid): start for pid, start in json.loads(out.stdout).items()}
    assert family  # the manager
    try:
        # stopped at the leaver's exit, which waited for it: at most a zombie for init to reap
        assert not still_running(family), [f"{p}: {cmdline(p)}" for p in still_running(family)]
    finally:
        for pid in still_running(family):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
