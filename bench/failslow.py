"""Fail-slow detection quality: the workload-aware detector beside the time-only z-score baseline.

Setup: simulated traces (ntp_manager/detect/simulate.py) of a job of PP4 x TP8 x DP4 = 128 ranks,
8 micro-batches of up to 8,192 packed tokens per step, sequence lengths log-normal (median 600,
sigma 1.2, clipped to 8,192). Per trace: 4 persistent slowdowns of the given level on random GPUs
(a fifth of them on a whole TP group) for 30-300 steps, one data-imbalanced replica (6x longer
sequences) and one TP group with 2.5x slower links, each for 50-200 steps; transient one-step
compute spikes (30 per 1,000 steps), whole-group stalls (10) and 1-3 step network hiccups (20)
that must not count. Both detectors run on the same traces with their default options; counting
rules in ntp_manager/detect/evaluate.py. Quality figures do not depend on the machine; the per-step
cost does: it is this process's CPU time (`time.process_time`, so other load on a shared machine
does not inflate it) per observed step, scoring included, divided evenly over the steps.

Usage: python bench/failslow.py [--quick] [--seeds N] [--steps N] [--json FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ntp_manager.detect import WorkloadDetector, ZScoreDetector, adapt
from ntp_manager.detect.evaluate import Observer, Score, score
from ntp_manager.detect.simulate import TraceSpec, make_trace

LEVELS = [0.1, 0.2, 0.4]
DETECTORS: dict[str, Callable[[], Observer]] = {"workload": WorkloadDetector, "z-score": ZScoreDetector}


def run_level(base: TraceSpec, level: float, seeds: int) -> tuple[dict[str, Score], dict[str, float]]:
    totals = {name: Score() for name in DETECTORS}
    cost = dict.fromkeys(DETECTORS, 0.0)
    for seed in range(seeds):
        trace = make_trace(dataclasses.replace(base, slow_level=level, seed=1000 * round(level * 100) + seed))
        for name, make in DETECTORS.items():
            t0 = time.process_time()
            totals[name].add(score(make(), trace))
            cost[name] += time.process_time() - t0
    steps = seeds * base.steps
    return totals, {k: 1e3 * v / steps for k, v in cost.items()}


def row(label: str, name: str, s: Score, ms: float) -> list[str]:
    causes = ", ".join(f"{k} {v}" for k, v in sorted(s.false_by_cause.items())) or "-"
    within = sum(d <= 10 for d in s.delays) / s.positives if s.positives else 1.0
    return [
        label, name, str(s.positives), f"{s.precision:.3f}", f"{s.recall:.3f}", f"{s.false_per_1k:.2f}", causes,
        f"{s.delay_quantile(0.5):.0f}", f"{s.delay_quantile(0.95):.0f}", f"{max(s.delays, default=0)}",
        f"{within:.3f}", str(s.flaps), f"{s.imbalance_found}/{s.imbalance_injected}",
        f"{s.network_found}/{s.network_injected}", f"{ms:.2f}",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 seeds of 1,000 steps")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--json", type=Path, help="also write results here")
    args = ap.parse_args()
    seeds, steps = (4, 1000) if args.quick else (args.seeds, args.steps)
    base = TraceSpec(stages=4, tp=8, dp=4, steps=steps)
    noisy = dataclasses.replace(base, rank_jitter=0.04, mb_jitter=0.04, job_jitter=0.04, gpu_spread=0.02)
    console = Console(width=200)
    table = Table(title=f"fail-slow detection: {base.ranks} ranks unless noted, {seeds} traces x {steps} steps per row")
    for col in (
        "slowdown", "detector", "GPUs slowed", "precision", "recall", "false/1k steps", "false alarms by cause",
        "delay p50", "p95", "max", "<= 10 steps", "flaps", "imbalance found", "network found", "CPU ms/step",
    ):
        table.add_column(col, justify="right")
    results = []
    small = dataclasses.replace(base, tp=4)
    runs = [(f"{int(lv * 100)}%", base, lv) for lv in LEVELS] + [
        ("20%, 2x noise", noisy, 0.2),
        ("20%, 64 ranks (TP4)", small, 0.2),
    ]
    for label, spec, level in runs:
        with console.status(f"{label}: {seeds} traces"):
            totals, cost = run_level(spec, level, seeds)
        for name, s in totals.items():
            table.add_row(*row(label, name, s, cost[name]))
            results.append({
                "run": label, "detector": name, "positives": s.positives, "precision": s.precision,
                "recall": s.recall, "false_per_1k": s.false_per_1k, "false_by_cause": s.false_by_cause,
                "delays": s.delays, "flaps": s.flaps, "imbalance": [s.imbalance_found, s.imbalance_injected],
                "network": [s.network_found, s.network_injected], "ms_per_step": cost[name],
            })
        table.add_section()
    console.print(table)

    t2 = Table(title="what to do with a TP8 group (min_tp 6) that has one slow GPU (detect.adapt)")
    for col in ("slowdown", "no power headroom", "group throughput", "with a 1.2x boost", "group throughput"):
        t2.add_column(col, justify="right")
    for lv in [0.1, 0.15, 0.2, 0.3, 0.4]:
        speeds = {f"t{i}": 1.0 for i in range(7)} | {"t7": 1 / (1 + lv)}
        plain, boosted = adapt(speeds, 6), adapt(speeds, 6, boost=1.2)
        t2.add_row(
            f"{lv:.0%}", plain.action.value, f"{plain.throughput:.3f} (keep {plain.keep_throughput:.3f})",
            boosted.action.value, f"{boosted.throughput:.3f}",
        )
    console.print(t2)
    console.print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
