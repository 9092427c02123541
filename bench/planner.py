"""Planner benchmark: full plan and replan-after-one-more-failure at 8K..1M GPUs, NVL32 and NVL72.

Setup (not timed): a generated cluster with 0.2% of GPUs failed at random (seeded), a job using
every domain at TP = 32 (NVL32) or TP = 64 (NVL72, whose 8 leftover GPUs per rack act as in-domain
spares), 8 TP groups per replica, scheme ntp-pw (the most work: packing + power water-filling).
Timed: `make_plan` on the snapshot ("full plan"), and `with_states` for one more failure followed by
`make_plan` ("replan"). Median of several runs; `time.perf_counter`.

Usage: python bench/planner.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ntp_manager.planner import JobSpec, Scheme, make_plan
from ntp_manager.topology import GpuState, generate_cluster

SIZES = [8_192, 32_768, 100_000, 1_000_000]
SHAPES = [("NVL32", 32, 32), ("NVL72", 72, 64)]  # (name, domain size, TP)


def bench_one(total: int, domain_size: int, tp: int, repeats: int, seed: int = 0) -> dict[str, float]:
    domains = max(1, round(total / domain_size))
    cluster = generate_cluster(domains, domain_size, 4 if domain_size % 4 == 0 else 1, name="bench")
    rng = random.Random(seed)
    uuids = [g.uuid for g in cluster.gpus()]
    failed = rng.sample(uuids, int(0.002 * len(uuids)))
    snap = cluster.with_states(dict.fromkeys(failed, GpuState.FAILED))
    groups = domains * (domain_size // tp)
    pp = 8
    job = JobSpec(
        name="bench", tp=tp, groups_per_replica=pp, replicas=max(1, groups // pp), local_batch=8,
        min_tp=tp * 7 // 8, heads=128, mlp_columns=81920, scheme=Scheme.NTP_PW,
    )
    healthy_left = [u for u in uuids if u not in set(failed)]
    full, replan = [], []
    plan = None
    # The snapshot is long-lived (as in the manager, which freezes it too): keep the cyclic GC from
    # re-walking a million GPU objects on every allocation burst.
    gc.collect()
    gc.freeze()
    for i in range(repeats):
        t0 = time.perf_counter()
        plan = make_plan(snap, job)
        full.append(time.perf_counter() - t0)
        victim = healthy_left[rng.randrange(len(healthy_left))]
        t0 = time.perf_counter()
        after = snap.with_states({victim: GpuState.FAILED})
        make_plan(after, job)
        replan.append(time.perf_counter() - t0)
        del after
        _ = i
    assert plan is not None
    gc.unfreeze()
    return {
        "gpus": cluster.gpu_count,
        "domains": domains,
        "full_ms": statistics.median(full) * 1e3,
        "replan_ms": statistics.median(replan) * 1e3,
        "replicas": len(plan.replicas),
        "throughput": plan.relative_throughput,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip 1M GPUs")
    ap.add_argument("--json", type=Path, help="also write results here")
    ap.add_argument("--only", type=int, help="run one size only")
    args = ap.parse_args()
    console = Console(width=120)
    table = Table(title="planner: full plan and replan after one more failure (median)")
    for col in ("shape", "GPUs", "domains", "replicas", "full plan ms", "replan ms", "rel. throughput"):
        table.add_column(col, justify="right")
    rows = []
    sizes = SIZES[:-1] if args.quick else SIZES
    if args.only:
        sizes = [s for s in sizes if s == args.only]
    for name, dsize, tp in SHAPES:
        for total in sizes:
            repeats = 3 if total >= 1_000_000 else 7
            with console.status(f"{name} {total:,} GPUs"):
                r = bench_one(total, dsize, tp, repeats)
            r["shape"] = name
            rows.append(r)
            table.add_row(
                f"{name}/TP{tp}", f"{r['gpus']:,}", f"{r['domains']:,}", f"{r['replicas']:,}",
                f"{r['full_ms']:.1f}", f"{r['replan_ms']:.1f}", f"{r['throughput']:.4f}",
            )
    console.print(table)
    for name, _, _ in SHAPES:
        by = {r["gpus"]: r for r in rows if r["shape"] == name}
        k100 = next((v for g, v in by.items() if 99_000 <= g <= 101_000), None)
        if k100 is None:
            continue
        k1m = next((v for g, v in by.items() if g >= 999_000), None)
        line = f"{name}: 100K full plan {k100['full_ms']:.1f} ms (goal <= 100 ms)"
        if k1m:
            line += f"; 1M/100K = {k1m['full_ms'] / k100['full_ms']:.1f}x (goal <= 12x)"
        console.print(line)
    console.print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
