"""A peer side by side: the same model, data and failure under pytorch/torchft and under ntp-run.

    .venv/bin/python bench/peers/compare.py            # both, one run each, a table at the end
    .venv/bin/python bench/peers/compare.py --only ntp

Each side trains bench/peers/common.py's model on its index-addressed data with two data-parallel
replicas of one process each (on a CPU box: gloo). After `--kill-at` committed steps the driver
SIGKILLs replica 1's process and starts it again `--restart-after` seconds later (torchft: a new
process of the replica group, which heals from its peer; ntp-run: its own restart of the dead rank,
`--max-restarts 1 --restart-delay`, which rejoins through a layout change). What it prints, per side:

- steady step: the median committed step before the kill (both replicas);
- kill -> first committed: from the kill to the end of the survivors' first committed step without
  the dead replica;
- time lost: that, minus the survivors' own step time at the reduced size (their median committed
  step without the dead replica), minus the time the step spent moving model state (regroup and
  reshard: bytes that must move are not waste; torchft moves none at a shrink);
- restart -> rejoined: from the new process's start to the end of its first committed step with
  both replicas;
- samples trained, lost (indices below the highest trained that no committed step trained) and
  repeated (trained more than once).

torchft cannot go into the project's venv as an extra (its OpenTelemetry pins protobuf < 7, which
the project's generated stubs cannot use): the driver installs torchft 0.2.0 and a consistent
OpenTelemetry set into .peers/torchft (once), drops the protobuf that came with them, and puts that
folder on the peer's PYTHONPATH only. Results: bench/RESULTS.md, "Peers".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.peers.common import STEP_BATCH, StepRecord, process_starts, read_logs  # noqa: E402

PEER_DIR = ROOT / ".peers" / "torchft"
TORCHFT = "torchft==0.2.0"
OTEL = ("opentelemetry-exporter-otlp-proto-http==1.39.1", "opentelemetry-sdk==1.39.1", "opentelemetry-api==1.39.1")
PY = sys.executable


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ensure_torchft() -> None:
    """torchft and its OpenTelemetry in a folder of their own, without their protobuf. From the
    package index, or from the wheels in $NTP_PEER_WHEELS (a machine without the index: `make
    gpu-wheels` puts them in .whl/peers for bench/gpu_session.sh)."""
    if (PEER_DIR / "torchft" / "__init__.py").exists():
        return
    say(f"installing {TORCHFT} into {PEER_DIR.relative_to(ROOT)} (once)")
    pip = [PY, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(PEER_DIR)]
    wheels = os.environ.get("NTP_PEER_WHEELS")
    if wheels:
        pip += ["--no-index", "--find-links", wheels]
    subprocess.run([*pip, *OTEL], check=True)
    subprocess.run([*pip, "--no-deps", TORCHFT], check=True)
    shutil.rmtree(PEER_DIR / "google" / "protobuf", ignore_errors=True)
    for d in PEER_DIR.glob("protobuf-*.dist-info"):
        shutil.rmtree(d, ignore_errors=True)


def peer_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PEER_DIR), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def wait_until(pred: object, timeout: float, what: str, *alive: subprocess.Popen[bytes]) -> None:
    """Until `pred()`; TimeoutError past `timeout`, RuntimeError when a process in `alive` ends first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():  # type: ignore[operator]
            return
        gone = [p for p in alive if p.poll() is not None]
        if gone:
            raise RuntimeError(f"{what}: {gone[0].args[1] if len(gone[0].args) > 1 else gone[0].args[0]} "
                               f"exited with {gone[0].returncode} first (its output is in the logs folder)")
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def committed_steps(logs: Path, replica: str) -> list[StepRecord]:
    return [r for r in read_logs(logs) if r.replica == replica and r.committed]


# ---- the two runs --------------------------------------------------------------------------------
def run_torchft(logs: Path, steps: int, kill_at: int, restart_after: float, timeout: float) -> float:
    ensure_torchft()
    env = peer_env()
    lighthouse = subprocess.Popen(
        [PY, "-c", "import sys, time\nfrom torchft._torchft import LighthouseServer\n"
         "lh = LighthouseServer(bind='127.0.0.1:0', min_replicas=1, join_timeout_ms=1000)\n"
         "print(lh.address(), flush=True)\ntime.sleep(1e9)"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        assert lighthouse.stdout is not None
        address = lighthouse.stdout.readline().strip()
        say(f"torchft: lighthouse at {address}")

        def group(g: int, *extra: str) -> subprocess.Popen[bytes]:
            out = open(logs / f"torchft-group{g}.out", "ab")  # noqa: SIM115 (the child holds it)
            return subprocess.Popen([PY, str(ROOT / "bench/peers/tft_replica.py"), "--group", str(g), "--groups", "2",
                                     "--lighthouse", address, "--steps", str(steps), "--log-dir", str(logs), *extra],
                                    env=env, stdout=out, stderr=subprocess.STDOUT)
        procs = [group(0, "--wait-go"), group(1, "--wait-go")]
        wait_until(lambda: all((logs / f"ready-{g}").exists() for g in (0, 1)), timeout, "torchft: groups joining",
                   *procs)
        (logs / "go").touch()  # both heartbeat now: the first quorum holds both
        wait_until(lambda: len(committed_steps(logs, "group1")) >= kill_at, timeout, "torchft: steps before the kill",
                   *procs)
        procs[1].send_signal(signal.SIGKILL)
        t_kill = time.time()
        say(f"torchft: killed group1 after {kill_at} steps; restarting it in {restart_after:.1f} s")
        time.sleep(restart_after)
        procs.append(group(1))
        wait_until(lambda: procs[0].poll() is not None and procs[2].poll() is not None, timeout, "torchft: the run")
        return t_kill
    finally:
        for p in [*procs, lighthouse]:
            if p.poll() is None:
                p.kill()
            p.wait()


def run_ntp(logs: Path, steps: int, kill_at: int, restart_after: float, timeout: float) -> float:
    cmd = [str(Path(PY).with_name("ntp-run")), "--nproc", "2", "--replicas", "2",
           "--batch-per-rank", str(STEP_BATCH), "--max-restarts", "1", "--restart-delay", str(restart_after),
           "--log-dir", str(logs / "ranks"), "-r", "3",
           str(ROOT / "bench/peers/ntp_replica.py"), "--steps", str(steps), "--log-dir", str(logs)]
    out = open(logs / "ntp-run.out", "ab")  # noqa: SIM115 (the child holds it)
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        wait_until(lambda: len({r.replica for r in read_logs(logs)}) >= 2, timeout, "ntp: both ranks stepping", proc)
        victim = sorted({r.replica for r in read_logs(logs)})[-1]
        wait_until(lambda: len(committed_steps(logs, victim)) >= kill_at, timeout, "ntp: steps before the kill",
                   proc)
        pid = committed_steps(logs, victim)[-1].pid
        os.kill(pid, signal.SIGKILL)
        t_kill = time.time()
        say(f"ntp: killed {victim} (pid {pid}) after {kill_at} steps; ntp-run restarts it in {restart_after:.1f} s")
        proc.wait(timeout=timeout)
        return t_kill
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- what a run shows ----------------------------------------------------------------------------
@dataclass
class Figures:
    side: str
    steady_s: float
    kill_to_first_s: float
    reduced_step_s: float
    moved_s: float
    time_lost_s: float
    restart_to_rejoined_s: float
    committed_steps: int
    samples_trained: int
    samples_lost: int
    samples_repeated: int


def figures(side: str, logs: Path, t_kill: float) -> Figures:
    recs = [r for r in read_logs(logs) if r.committed]
    pids_before = {r.pid for r in recs if r.end <= t_kill}
    before = [r.end - r.start for r in recs if r.end <= t_kill and r.participants == 2][2:]  # after warm-up
    after = sorted((r for r in recs if r.end > t_kill and r.pid in pids_before), key=lambda r: r.end)
    first = next(r for r in after if r.participants == 1)
    reduced = [r.end - r.start for r in after if r.participants == 1 and r is not first]
    reduced_s = statistics.median(reduced) if reduced else first.end - first.start
    starts = process_starts(logs)
    new = [r for r in recs if r.pid not in pids_before and r.participants == 2]
    rejoined = min(new, key=lambda r: r.end) if new else None
    restart_to_rejoined = rejoined.end - starts.get(rejoined.pid, rejoined.start) if rejoined else float("nan")
    # one record per replica and step (a replica's ranks train the same samples)
    seen: dict[tuple[str, int], list[int]] = {}
    for r in recs:
        seen.setdefault((r.replica.split("-")[0] if side == "torchft" else r.replica, r.step), r.indices)
    trained = [i for idx in seen.values() for i in idx]
    top = max(trained) if trained else -1
    lost = len(set(range(top + 1)) - set(trained))
    kill_to_first = first.end - t_kill
    return Figures(side, statistics.median(before) if before else float("nan"), kill_to_first, reduced_s,
                   first.switch_s, kill_to_first - reduced_s - first.switch_s, restart_to_rejoined,
                   max(r.step for r in recs) + 1, len(trained), lost, len(trained) - len(set(trained)))


def table(rows: list[Figures]) -> str:
    cols = ("side", "steady step s", "kill -> first committed s", "reduced step s", "state moved s", "time lost s",
            "restart -> rejoined s", "steps", "samples trained", "lost", "repeated")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for f in rows:
        lines.append(f"| {f.side} | {f.steady_s:.2f} | {f.kill_to_first_s:.2f} | {f.reduced_step_s:.2f} | "
                     f"{f.moved_s:.2f} | {f.time_lost_s:.2f} | {f.restart_to_rejoined_s:.2f} | {f.committed_steps} | "
                     f"{f.samples_trained} | {f.samples_lost} | {f.samples_repeated} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=8)
    ap.add_argument("--restart-after", type=float, default=6.0)
    ap.add_argument("--only", choices=["torchft", "ntp"], action="append")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args()
    sides = args.only or ["torchft", "ntp"]
    rows: list[Figures] = []
    for side in sides:
        logs = Path(tempfile.mkdtemp(prefix=f"peers-{side}-"))
        say(f"{side}: {args.steps} steps, 2 replicas; logs in {logs}")
        run = run_torchft if side == "torchft" else run_ntp
        t_kill = run(logs, args.steps, args.kill_at, args.restart_after, args.timeout)
        rows.append(figures(side, logs, t_kill))
    print(table(rows), flush=True)
    if args.json:
        args.json.write_text(json.dumps([f.__dict__ for f in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
