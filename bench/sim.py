"""Simulator benchmark (paper-32k preset, 32,768 GPUs).

1. A 15-day trace at Llama 3 rates (3-day hardware repair, steady-state start) replayed for all
   three schemes: wall time of trace generation + replay.   Goal <= 30 s.
2. The 0-0.4% static sweep (9 points) with 100 placements per point, all three schemes.
   Goal <= 60 s.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ntp_manager.planner import Scheme
from ntp_manager.sim import SimSetup, make_trace, preset, preset_cluster, replay, static_sweep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--placements", type=int, default=100)
    ap.add_argument("--json", type=Path)
    args, _ = ap.parse_known_args()
    console = Console(width=120)
    p = preset("paper-32k")
    setup = SimSetup.create(preset_cluster(p), p.job, p.model)
    schemes = list(Scheme)

    t0 = time.perf_counter()
    trace = make_trace(setup, 15, seed=0, warmup_days=6)
    stats = replay(setup, trace, [(s, 0) for s in schemes])
    trace_s = time.perf_counter() - t0

    fractions = [i * 0.0005 for i in range(9)]
    t0 = time.perf_counter()
    points = static_sweep(setup, schemes, fractions, args.placements, seed=0)
    sweep_s = time.perf_counter() - t0

    table = Table(title="simulator speed (paper-32k, 32,768 GPUs)")
    for col in ("run", "work", "wall s", "goal s"):
        table.add_column(col, justify="right")
    table.add_row("15-day trace, 3 schemes", f"{len(trace.events)} events x 3 plans", f"{trace_s:.1f}", "30")
    table.add_row(
        "0-0.4% sweep, 3 schemes", f"9 points x {args.placements} placements x 3 plans", f"{sweep_s:.1f}", "60"
    )
    console.print(table)
    res = Table(title="what they computed")
    for col in ("result", "dp-drop", "ntp", "ntp-pw"):
        res.add_column(col, justify="right")
    res.add_row("15-day mean throughput", *[f"{100 * s.mean_throughput:.2f}%" for s in stats])
    by = {(pt.fraction, pt.scheme): pt for pt in points}
    res.add_row("loss at 0.4% (mean)", *[f"{100 * by[(fractions[-1], s)].mean_loss:.2f}%" for s in schemes])
    console.print(res)
    console.print(f"machine: {platform.machine()}, python {platform.python_version()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"trace_s": trace_s, "sweep_s": sweep_s}, indent=2))


if __name__ == "__main__":
    main()
