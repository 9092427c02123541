"""Silent failures, end to end in real processes: how long until the manager fails the GPUs.

Three ways a node or a GPU goes quiet, each against a real `ntp-manager serve` and a real
`ntp-agent` (fake backend) with the documented defaults (liveness period 2 s: the stream's
connection pinged that often, 2 s to answer; suspect after 6 s, failed after 20 s, GPU call
deadline 3 s):

- the agent is stopped (SIGSTOP: the process and its TCP connection stay, nothing is sent or
  answered: its stream ends when a ping goes unanswered),
- the agent is killed (SIGKILL: the connection closes),
- one GPU's driver calls hang (the fake backend's `hang` fault): only that GPU should fail, fast.

Times are from the fault until the manager's REST API shows the GPU(s) failed, polled every 0.25 s.

    python bench/silent.py [--runs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fakes.procs import create_token, start_manager  # noqa: E402


def one(mode: str, work: Path) -> tuple[float, float, list[str]]:
    """The agent stopped or killed: (seconds to suspect, seconds to all failed, final health)."""
    data = work / mode
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    mgr, info = start_manager(data)
    agent: subprocess.Popen[str] | None = None
    try:
        op = create_token(data, "operator")
        tok = data / "agent.tok"
        tok.write_text(create_token(data, "agent", node="n1") + "\n")
        sc = data / "scenario.yaml"
        sc.write_text("seed: 1\nnode: n1\ndomain: d1\ngpus: 4\n")
        agent = subprocess.Popen(
            [sys.executable, "-m", "ntp_agent.main", "--manager", info["grpc"], "--token-file", str(tok),
             "--backend", "fake", "--scenario", str(sc)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "NTP_AGENT_LOG_FORMAT": "json"})
        assert agent.stdout is not None and agent.stdout.readline().strip() == "NTP-AGENT READY"
        c = httpx.Client(base_url="http://" + info["http"], headers={"Authorization": f"Bearer {op}"})

        def health() -> list[str]:
            items = c.get("/v1/gpus").json()["items"]
            return sorted(g["health"] for g in items)

        while health() != ["healthy"] * 4:
            time.sleep(0.1)
        t0 = time.monotonic()
        if mode == "agent stopped":
            agent.send_signal(signal.SIGSTOP)
        else:
            agent.kill()
        suspect = float("nan")
        while time.monotonic() - t0 < 60:
            h = health()
            if "suspect" in h and suspect != suspect:
                suspect = time.monotonic() - t0
            if h.count("failed") == 4:
                return suspect, time.monotonic() - t0, h
            time.sleep(0.25)
        return suspect, float("nan"), health()
    finally:
        if agent is not None:
            if agent.poll() is None:
                agent.send_signal(signal.SIGCONT)
                agent.kill()
            agent.wait(10)
        mgr.terminate()
        mgr.wait(20)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    console = Console()
    t = Table(title=f"silent failures -> GPUs failed on the manager ({os.cpu_count()} cores)")
    for col in ("case", "documented", "suspect (s)", "failed (s)", "GPUs at the end"):
        t.add_column(col)
    # a stopped agent's stream ends when its connection misses a ping (every 2 s, 2 s to answer);
    # the node was counted as heard from until then (rpc/server.py keepalive)
    goals = {"agent stopped": "suspect 6 s, failed 20 s after its stream ends, which takes 2-4 s",
             "agent killed": "suspect 6 s, failed 20 s (+ up to 2 s liveness phase)",
             "one GPU hangs": "that GPU failed in 3 s (+ 1 s sample interval); others stay healthy"}
    with tempfile.TemporaryDirectory() as d:
        for mode in goals:
            for _ in range(args.runs):
                if mode == "one GPU hangs":
                    s, f, h = hung_gpu(Path(d))
                else:
                    s, f, h = one(mode, Path(d))
                t.add_row(mode, goals[mode], f"{s:.1f}", f"{f:.1f}", " ".join(h))
                console.print(f"{mode}: suspect {s:.1f} s, failed {f:.1f} s", style="dim")
    console.print(t)


def hung_gpu(work: Path) -> tuple[float, float, list[str]]:
    """One GPU hangs 3 s after the agent's backend starts: from the moment the fault took effect
    (the agent's JSON log line "fake fault") to the moment the manager failed that GPU (its
    `health_since`); both are wall-clock times on this machine."""
    data = work / "hang"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    mgr, info = start_manager(data)
    agent: subprocess.Popen[str] | None = None
    log = data / "agent.log"
    try:
        op = create_token(data, "operator")
        tok = data / "agent.tok"
        tok.write_text(create_token(data, "agent", node="n1") + "\n")
        sc = data / "scenario.yaml"
        sc.write_text("seed: 1\nnode: n1\ndomain: d1\ngpus: 4\nfaults:\n  - {at: 3.0, gpu: 2, kind: hang}\n")
        with log.open("w") as err:
            agent = subprocess.Popen(
                [sys.executable, "-m", "ntp_agent.main", "--manager", info["grpc"], "--token-file", str(tok),
                 "--backend", "fake", "--scenario", str(sc)], stdout=subprocess.PIPE, stderr=err, text=True,
                env={**os.environ, "NTP_AGENT_LOG_FORMAT": "json"})
        assert agent.stdout is not None and agent.stdout.readline().strip() == "NTP-AGENT READY"
        c = httpx.Client(base_url="http://" + info["http"], headers={"Authorization": f"Bearer {op}"})
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            items = c.get("/v1/gpus").json()["items"]
            failed = [g for g in items if g["health"] == "failed"]
            if failed:
                since = datetime.fromisoformat(failed[0]["health_since"])
                fault = next(json.loads(line) for line in log.read_text().splitlines()
                             if line.startswith("{") and json.loads(line).get("event") == "fake fault")
                at = datetime.fromisoformat(fault["timestamp"].replace("Z", "+00:00"))
                return float("nan"), (since - at).total_seconds(), sorted(g["health"] for g in items)
            time.sleep(0.25)
        return float("nan"), float("nan"), sorted(g["health"] for g in c.get("/v1/gpus").json()["items"])
    finally:
        if agent is not None:
            agent.kill()
            agent.wait(10)
        mgr.terminate()
        mgr.wait(20)


if __name__ == "__main__":
    main()
