"""End-to-end stall per failure: the `make demo` scenario (manager process, fake-backend agents,
8 CPU ranks over gRPC), repeated; the time from the injected GPU failure to the first completed step
at the new TP degree, split into detection (agent report at the manager), planning, push + regroup,
reshard and the first step; shown beside FT-HSDP's ~3 minute stall and torchft's 5 s heartbeat
timeout (REFERENCE.md).

    python bench/e2e.py [--runs N]
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

from ntp_manager import demo

PARTS = ["detection", "plan", "push + regroup", "reshard", "first step"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    console = Console()
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
