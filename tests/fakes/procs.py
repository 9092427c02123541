"""Real processes for tests: a free loopback port, `ntp-manager` tokens and `serve` subprocesses, a
process's descendants (to check that nothing outlives it), and the multiprocessing context the
worker tests start their rank processes from."""

from __future__ import annotations

import atexit
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def create_token(data: Path, scope: str, node: str | None = None, env: dict[str, str] | None = None) -> str:
    """`ntp-manager token create` against the data dir (or NTP_DATABASE_URL in `env`); agent
    tokens need the `node` they speak for."""
    cmd = [sys.executable, "-m", "ntp_manager.cli", "token", "create", "--scope", scope, "--json", "--data-dir",
           str(data)]
    if node is not None:
        cmd += ["--node", node]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True,
                         env=dict(os.environ, **(env or {}))).stdout
    return str(json.loads(out)["token"])


def create_agent_tokens(data: Path, nodes: list[str]) -> dict[str, str]:
    """One agent token per node, made by one `ntp-manager token create --nodes-from -` call."""
    cmd = [sys.executable, "-m", "ntp_manager.cli", "token", "create", "--scope", "agent", "--nodes-from", "-",
           "--data-dir", str(data)]
    out = subprocess.run(cmd, input="\n".join(nodes), capture_output=True, text=True, timeout=120,
                         check=True).stdout
    return {d["node"]: d["token"] for d in map(json.loads, out.splitlines())}


_managers: list[subprocess.Popen[str]] = []  # what start_manager started and has not seen end


def start_manager(
    data: Path, http_port: int = 0, grpc_port: int = 0, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """`ntp-manager serve` on loopback; returns the process and its READY info (http, grpc, epoch).
    The caller stops it; one still running when the test process exits is stopped then
    (`_stop_managers`)."""
    _managers[:] = [p for p in _managers if p.poll() is None]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ntp_manager.cli", "serve", "--data-dir", str(data), "--http-port", str(http_port),
         "--grpc-port", str(grpc_port)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=dict(os.environ, **(env or {})),
    )
    _managers.append(proc)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("NTP-MANAGER READY"):
            # the rest is read on a thread, which closes the pipe at its end: a manager that prints
            # again (a standby's LEADING line) neither fills the pipe nor writes to a closed one
            threading.Thread(target=_drain, args=(proc.stdout,), daemon=True, name=f"manager-{proc.pid}").start()
            return proc, json.loads(line.split(" ", 2)[2])
    proc.stdout.close()
    raise AssertionError(f"manager did not start (rc={proc.wait()})")


def run_bounded(cmd: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(cmd, capture_output=True, text=True)` in a session of its own. Past `timeout`
    seconds the whole session (a launcher and the ranks it started) is killed and the test fails
    with the output so far: a hang shows where it hung, and leaves no process behind. Keep
    `timeout` below pytest-timeout's (pyproject.toml), which would stop the test without either."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kw)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd[:4])} ... still running after {timeout:.0f} s; "
                             f"its output:\n{out[-12000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _drain(out: IO[str]) -> None:
    with out:
        for _ in out:
            pass


def stop_process(proc: subprocess.Popen[str], timeout: float = 15) -> None:
    """End `proc` if it still runs: SIGTERM, then SIGKILL when it has not exited within `timeout`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@atexit.register
def _stop_managers() -> None:
    """At the test process's exit, the managers that a failed test (or one that timed out) left
    running: SIGTERM, then SIGKILL after 10 s. Left alone they would serve on for ever, adopted by
    init."""
    running = [p for p in _managers if p.poll() is None]
    for p in running:
        p.terminate()
    for p in running:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _stat(pid: int) -> tuple[str, int, int] | None:
    """`pid`'s state letter, parent pid and start time (clock ticks after boot) from /proc, or None
    when there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw.rpartition(")")[2].split()  # after "pid (command)"; the command may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """Every live process below `pid` (children, their children, ...), each with its start time:
    with the start time a later check is not fooled by a new process that got a reused pid. Linux
    only (/proc)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None and st[0] not in "ZX":
            children.setdefault(st[1], []).append((int(entry.name), st[2]))
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child, start in children.get(todo.pop(), []):
            if child not in out:
                out[child] = start
                todo.append(child)
    return out


def still_running(procs: dict[int, int]) -> list[int]:
    """Those of `procs` (pid: start time, as `descendants` gives them) that have not ended (a zombie
    has: it only waits to be reaped)."""
    left = []
    for pid, start in procs.items():
        st = _stat(pid)
        if st is not None and st[0] not in "ZX" and st[2] == start:
            left.append(pid)
    return left


# What every rank process of the worker tests imports. Each spawned child used to import them
# itself: ~2.5 s of CPU for torch, ~7 s with transformers' Llama, times ~150 children per suite run
# on a 2-core CI machine. The forkserver imports them once; its children are forked from it.
WORKER_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.multiprocessing",
    "ntp_manager.worker.runtime",
    "ntp_manager.worker.checkpoint",
    "transformers.models.llama.modeling_llama",  # skipped by the server when transformers is absent
    "tests.worker.compare",
)


def worker_context() -> multiprocessing.context.ForkServerContext:
    """The forkserver context for tests' rank processes (`ctx.Process`, `ctx.SimpleQueue`, or
    `torch.multiprocessing.start_processes(..., start_method="forkserver")`).

    The server is started once per test process, by the first caller, and has run nothing but
    imports (no threads, no process groups, no CUDA), so its children start clean. Every caller
    gives it the same preload list, whichever test file runs first. Environment changes made in the
    test process after the server started do not reach the children: set them in the child."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(WORKER_PRELOAD))
    return ctx
