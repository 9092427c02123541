"""Scaffolding the benchmarks share: a real `ntp-manager serve` with its tokens, the event-loop
figures from its /metrics page, a /healthz prober, the machine line, the result tables, and the
kill-a-parked-rank step of the runtime failover benchmarks, and a fresh PostgreSQL database per run.

The benchmarks import it as `bench.common` (each puts the repository root on sys.path first, so
`python bench/x.py` works from anywhere). Nothing here imports torch: the manager benchmarks do not
need it.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import secrets
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

CLI = [sys.executable, "-m", "ntp_manager.cli"]


# ---- a fresh PostgreSQL database per run --------------------------------------------------------


async def fresh_postgres(url: str, prefix: str = "ntp_bench") -> str:
    """A new empty database beside the one `url` (postgresql+asyncpg://...) names; its URL in the
    same form. Dropped by `drop_postgres`."""
    import asyncpg

    name = f"{prefix}_{secrets.token_hex(4)}"
    conn = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return f"{url.rsplit('/', 1)[0]}/{name}"


async def drop_postgres(admin_url: str, url: str) -> None:
    """Drop the database `url` names (made by `fresh_postgres`), ending its sessions."""
    import asyncpg

    conn = await asyncpg.connect(admin_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')
    finally:
        await conn.close()


# ---- simulated clients -----------------------------------------------------------------------------


async def until_none(q: asyncio.Queue[Any]) -> AsyncIterator[Any]:
    """The messages put on `q`, as a stream's request iterator, until a None is put."""
    while True:
        m = await q.get()
        if m is None:
            return
        yield m


# ---- a manager process ----------------------------------------------------------------------------
def create_tokens(data: Path, nodes: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Tokens made with `ntp-manager token create` on the store in `data`: one per scope
    ("operator", "worker") and one agent token per node in `nodes` (keyed by the node's name)."""
    tokens = {}
    for scope in ("operator", "worker"):
        out = subprocess.run([*CLI, "token", "create", "--scope", scope, "--json", "--data-dir", str(data)],
                             capture_output=True, text=True, check=True, env=env).stdout
        tokens[scope] = json.loads(out)["token"]
    out = subprocess.run([*CLI, "token", "create", "--scope", "agent", "--nodes-from", "-", "--data-dir", str(data)],
                         input="\n".join(nodes), capture_output=True, text=True, check=True, env=env).stdout
    for line in out.splitlines():
        d = json.loads(line)
        tokens[d["node"]] = d["token"]
    return tokens


def serve(data: Path, env: Mapping[str, str], python_args: Sequence[str] = ()) -> tuple[subprocess.Popen[str],
                                                                                          dict[str, Any]]:
    """Starts `ntp-manager serve` on `data` (ports chosen by the OS, its log in data/manager.log)
    and waits for its READY line; returns the process and what that line says (its addresses).
    `python_args` go to the interpreter (a profiler, say). Raises RuntimeError when it ends first."""
    log = open(data / "manager.log", "w")  # noqa: SIM115 - the manager writes it until it ends
    proc = subprocess.Popen(
        [sys.executable, *python_args, "-m", "ntp_manager.cli", "serve", "--data-dir", str(data), "--http-port", "0",
         "--grpc-port", "0"], stdout=subprocess.PIPE, stderr=log, text=True, env=dict(env))
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("NTP-MANAGER READY"):
            return proc, json.loads(line.split(" ", 2)[2])
    raise RuntimeError("manager did not start")


def stop(proc: subprocess.Popen[str], timeout: float = 60) -> None:
    """SIGTERM, then waits for the manager to end."""
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_of_name(name: str) -> dict[int, float]:
    """User + system CPU time so far of each process whose command is `name` (e.g. "postgres": the
    server and its backends), by pid. Over an interval, sum each pid's difference, a pid new since
    the first reading from 0 (a process that ended meanwhile is missing from the second reading)."""
    out: dict[int, float] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "comm").read_text().strip() == name:
                out[int(d.name)] = cpu_seconds(int(d.name))
        except (OSError, ValueError, IndexError):
            continue  # ended while read
    return out


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all cores (Linux /proc/stat): the
    busy share of an interval is the difference of two readings' busy over that of their totals."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    hz = os.sysconf("SC_CLK_TCK")
    return (sum(ticks) - idle) / hz, sum(ticks) / hz


# ---- the event loop's figures -------------------------------------------------------------------
Lag = tuple[dict[float, float], float]


def lag_buckets(text: str) -> Lag:
    """The watchdog's histogram buckets (le -> count) and stall counter from a /metrics page."""
    buckets, stalls = {}, 0.0
    for line in text.splitlines():
        if line.startswith("ntp_event_loop_lag_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if le == "+Inf" else float(le)] = float(line.split()[-1])
        elif line.startswith("ntp_event_loop_stalls_total "):
            stalls = float(line.split()[-1])
    return buckets, stalls


def worst_bucket(m0: Lag, m1: Lag) -> float:
    """Between two /metrics readings: the smallest bucket bound that holds every lag measured
    (the buckets are cumulative)."""
    delta = {le: n - m0[0].get(le, 0) for le, n in m1[0].items()}
    total = delta.get(float("inf"), 0.0)
    return min((le for le, n in delta.items() if n >= total), default=0.0)


class HealthzProbe:
    """A thread that asks GET /healthz every 20 ms and keeps (when sent, seconds taken) of each."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.probes: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=60) as c:
            while not self._stop.is_set():
                t = time.perf_counter()
                c.get("/healthz")
                self.probes.append((t, time.perf_counter() - t))
                time.sleep(0.02)

    def start(self) -> None:
        self._thread.start()

    def stop(self, join_s: float | None = None) -> None:
        self._stop.set()
        if join_s is not None:
            self._thread.join(join_s)

    def during(self, t0: float, t1: float) -> list[float]:
        """The latencies of the probes sent in [t0, t1] (perf_counter seconds)."""
        return [lat for t, lat in self.probes if t0 <= t <= t1]


def percentiles_ms(samples: Iterable[float]) -> dict[str, float]:
    """p50, p99 (nearest rank below) and max of `samples` (seconds), in milliseconds."""
    s = sorted(samples)
    return {"p50_ms": 1e3 * statistics.median(s), "p99_ms": 1e3 * s[min(len(s) - 1, int(0.99 * len(s)))],
            "max_ms": 1e3 * s[-1]}


# ---- printing -----------------------------------------------------------------------------------
def machine_line() -> str:
    return (f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
            f"load average {os.getloadavg()[0]:.1f}")


def show(console: Console, title: str, cols: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A table of right-aligned columns."""
    t = Table(title=title)
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(*r)
    console.print(t)


# ---- runtime failover ---------------------------------------------------------------------------
FAILOVER_PARTS = ("detection", "regroup", "reshard", "first step", "total", "step before")


def kill_parked(store: Any, pid: int, parked: Callable[[], None] | None = None, settle_s: float = 1.0) -> float:
    """Waits until the victim rank has set "bench/parked" in `store` (it sleeps at a step boundary
    while its peers go into the step and block on it), calls `parked` (if given), gives the peers
    `settle_s` to get there, then SIGKILLs process `pid`; returns the time of the kill (epoch seconds)."""
    while not store.check(["bench/parked"]):
        time.sleep(0.05)
    if parked is not None:
        parked()
    time.sleep(settle_s)  # the peers are inside the step, blocked on the victim
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    return t_kill


def last_event(timelines: Mapping[str, list[tuple[str, int, float]]], what: str, version: int = 2) -> float:
    """When the last rank reached `what` at layout `version` (each rank's first such event; for
    "failure detected", whatever its version)."""
    return max(next(t for w, v, t in tl if w == what and (v == version or what == "failure detected"))
               for tl in timelines.values())


def failover_row(label: str, runs: list[dict[str, float]]) -> tuple[str, ...]:
    """One table row: the median of each of FAILOVER_PARTS over `runs`, and the worst total."""
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return (label, *(f"{med[k]:.2f}" for k in FAILOVER_PARTS), f"{max(r['total'] for r in runs):.2f}")
