"""End-to-end stall per failure: the `make demo` scenario (manager process, fake-backend agents,
8 CPU ranks over gRPC), repeated; the time from the injected GPU failure to the first completed step
at the new TP degree, split into detection (agent report at the manager), planning, push + regroup,
reshard and the first step; shown beside FT-HSDP's ~3 minute stall and torchft's 5 s heartbeat
timeout (docs/references.md, "FT-HSDP and torchft").

`--repair` times the repair instead (issue 33): from the repair injected to the first step with
every GPU back, phase by phase, with the failed GPUs' fresh processes started after each failure
(waiting for a place, as ntp-run's restarts do: what the demo does) beside started only at the
repair (what the demo did before: the survivors then wait for the processes to start).

    python bench/e2e.py [--runs N] [--repair]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntp_manager.demos import demo

PARTS = ["detection", "plan", "push + regroup", "reshard", "first step"]


def _phase(what: str) -> str:
    return what.split(" (")[0]


def repair(runs: int, console: Console) -> None:
    """The repair's timeline, median of `runs` runs per way of restarting, in seconds since the
    repair was injected."""
    by_mode: dict[str, list[dict[str, float]]] = {}
    for late in (False, True):
        mode = "started at the repair" if late else "waiting since the failure"
        for i in range(runs):
            with contextlib.redirect_stdout(io.StringIO()):
                demo.console.file = io.StringIO()
                res = demo.run_demo(steps_before=4, steps_degraded=3, steps_after=3, keep_up=False, late_restart=late)
            phases = {_phase(w): t for w, t in res.timelines["repair"]}
            by_mode.setdefault(mode, []).append(phases)
            console.print(f"{mode}, run {i + 1}: first step {phases['first step at the new layout']:.2f} s")
    names = ["agent report received by the manager", "plan made", "layout pushed", "fresh process up",
             "fresh ranks have it", "process group rebuilt", "reshard done", "first step at the new layout"]
    t = Table(title=f"repair of 2 GPUs, demo scenario ({runs} run(s) each, median; s since the repair)")
    t.add_column("phase")
    for mode in by_mode:
        t.add_column(f"fresh processes {mode}", justify="right")
    for n in names:
        cells = []
        for rows in by_mode.values():
            got = [r[n] for r in rows if n in r]
            cells.append(f"{statistics.median(got):.2f}" if got else "-")
        t.add_row(n, *cells)
    console.print(t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--repair", action="store_true", help="time the repair (fresh processes early vs late)")
    args = ap.parse_args()
    console = Console()
    if args.repair:
        repair(args.runs, console)
        return
    runs = []
    for i in range(args.runs):
        with contextlib.redirect_stdout(io.StringIO()):
            demo.console.file = io.StringIO()
            res = demo.run_demo(steps_before=4, steps_degraded=3, steps_after=3, keep_up=False)
        runs.append(res)
        console.print(f"run {i + 1}: stall {res.stall_s:.2f} s")
    t = Table(title=f"stall per GPU failure, demo scenario ({args.runs} runs, median; seconds)")
    for c in ("system", *PARTS, "total"):
        t.add_column(c, justify="right")
    med = {p: statistics.median(r.split[p] for r in runs) for p in PARTS}
    t.add_row("ntp-manager (this run)", *(f"{med[p]:.2f}" for p in PARTS),
              f"{statistics.median(r.stall_s for r in runs):.2f}")
    t.add_row("torchft (heartbeat timeout alone)", "5.00", "", "", "", "", ">= 5")
    t.add_row("FT-HSDP (reported)", "", "", "", "", "", "~180")
    console.print(t)


if __name__ == "__main__":
    main()
