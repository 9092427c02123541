"""Planner benchmark: timing at 8K..1M GPUs, and churn (what a replan moves) on the paper's shape.

Timing. A generated cluster with 0.2% of GPUs failed at random (seeded), a job using every domain
at TP = 32 (NVL32) or TP = 64 (NVL72, whose 8 leftover GPUs per rack act as in-domain spares), 8
TP groups per replica, scheme ntp-pw (the most work: packing + power water-filling). Timed:
`make_plan` on the snapshot ("full plan", no previous plan), and `with_states` for one more failure
followed by `make_plan(..., previous=plan)` ("replan", as the manager would call it). Median of
several runs; `time.perf_counter`. The packer before stage identity (`packing="sorted"`) is timed
beside it.

Churn. The paper's shape (32,768 GPUs, 1,024 NVL32 domains, TP32 x 8 stages, 128 replicas, min TP 28,
a 480B-parameter model at 16 bytes per parameter: 960 GB of state per stage). (a) 60 failures
added one at a time (random GPUs, seed 0); (b) the 15-day failure trace the simulator generates
for this preset (Llama 3 rates, 3-day hardware repair, steady-state start, seed 0), replanned after
every batch of simultaneous events. After each replan the new plan is compared with the previous
one group by group: groups that change stage (newly placed ones included), groups that change
replica or stage, and the bytes of state the stage-changing groups load. The new packer gets the
previous plan; the sorted packer cannot use one. Asserted: the new packer's global batch equals
the sorted packer's at every step (ntp-pw: is not below it).

Usage: python bench/planner.py [--quick] [--only N] [--skip-timing] [--skip-churn] [--json FILE]
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

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec, Plan, Scheme, diff_assignments, make_plan
from ntp_manager.sim import FailureModel, SimSetup, make_trace, preset, preset_cluster
from ntp_manager.topology import DEFAULT_POWER, Cluster, PowerLimits, generate_cluster

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
    failed_set = set(failed)
    healthy_left = [u for u in uuids if u not in failed_set]
    full, replan, full_sorted = [], [], []
    plan = None
    # The snapshot is long-lived (as in the manager, which freezes it too): keep the cyclic GC from
    # re-walking a million GPU objects on every allocation burst.
    gc.collect()
    gc.freeze()
    for i in range(repeats):
        t0 = time.perf_counter()
        plan = make_plan(snap, job)
        full.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        make_plan(snap, job, packing="sorted")
        full_sorted.append(time.perf_counter() - t0)
        victim = healthy_left[rng.randrange(len(healthy_left))]
        t0 = time.perf_counter()
        after = snap.with_states({victim: GpuState.FAILED})
        make_plan(after, job, plan)
        replan.append(time.perf_counter() - t0)
        del after
        _ = i
    assert plan is not None
    gc.unfreeze()
    return {
        "gpus": cluster.gpu_count,
        "domains": domains,
        "full_ms": statistics.median(full) * 1e3,
        "full_sorted_ms": statistics.median(full_sorted) * 1e3,
        "replan_ms": statistics.median(replan) * 1e3,
        "replicas": len(plan.replicas),
        "throughput": plan.relative_throughput,
    }


# ---- churn ------------------------------------------------------------------------------------------

PAPER_PARAMETERS = 480 * 10**9  # the paper's 480B model; 16 bytes per parameter -> 960 GB per stage


def _slots(plan: Plan) -> dict[str, tuple[int, int]]:
    return {g.group_id: (r.replica_id, g.stage) for r in plan.replicas for g in r.groups}


class Churn:
    """Per-replan move counts of one packer."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int, int, int]] = []  # (kind, stage changed, moved, bytes)

    def add(self, kind: str, before: Plan, after: Plan, job: JobSpec) -> None:
        m = diff_assignments(_slots(before), _slots(after).items(), job.stage_sizes())
        self.steps.append((kind, m.stage_changed, m.moved, m.bytes or 0))

    def row(self, kind: str | None = None) -> dict[str, float]:
        rows = [x for x in self.steps if kind is None or x[0] == kind]
        n = max(len(rows), 1)
        return {
            "steps": len(rows),
            "stage_mean": sum(x[1] for x in rows) / n, "stage_max": max((x[1] for x in rows), default=0),
            "moved_mean": sum(x[2] for x in rows) / n, "moved_max": max((x[2] for x in rows), default=0),
            "tb_mean": sum(x[3] for x in rows) / n / 1e12, "tb_max": max((x[3] for x in rows), default=0) / 1e12,
        }


def churn_run(
    cluster: Cluster, job: JobSpec, steps: list[dict[str, GpuState]], initial: dict[str, GpuState] | None = None
) -> dict[str, dict[str, float]]:
    """Replan after each batch of state changes with both packers (starting from `initial`, not
    counted); returns their churn rows."""
    new = old = None
    snap = cluster.with_states(initial or {})
    stable, cut = Churn(), Churn()
    equal = 0
    for changes in [{}, *steps]:
        snap = snap.with_states(changes)
        plan_new = make_plan(snap, job, new)
        plan_old = make_plan(snap, job, packing="sorted")
        if job.scheme is Scheme.NTP_PW:
            assert plan_new.global_batch >= plan_old.global_batch, (plan_new.global_batch, plan_old.global_batch)
        else:
            assert plan_new.global_batch == plan_old.global_batch, (plan_new.global_batch, plan_old.global_batch)
        equal += plan_new.global_batch == plan_old.global_batch
        if new is not None and old is not None:
            kind = "failure" if any(v is GpuState.FAILED for v in changes.values()) else "repair"
            stable.add(kind, new, plan_new, job)
            cut.add(kind, old, plan_old, job)
        new, old = plan_new, plan_old
    out: dict[str, dict[str, float]] = {"stable": stable.row(), "sorted": cut.row(),
                                        "equal_batch_steps": {"equal": equal, "of": len(steps) + 1}}
    for kind in ("failure", "repair"):
        out[f"stable/{kind}"], out[f"sorted/{kind}"] = stable.row(kind), cut.row(kind)
    return out


def paper_job(scheme: Scheme) -> JobSpec:
    from dataclasses import replace

    return replace(preset("paper-32k").job, scheme=scheme, parameters=PAPER_PARAMETERS)


# (label, scheme, GPU power limits): the third is an H100-like fleet (700 W default = max) under a
# 0.85 base cap, where ntp-pw restores TP31 groups but not TP30 ones, so its packing keys differ.
VARIANTS = [
    ("ntp", Scheme.NTP, DEFAULT_POWER),
    ("ntp-pw", Scheme.NTP_PW, DEFAULT_POWER),
    ("ntp-pw, H100 base 0.85", Scheme.NTP_PW, PowerLimits(700, 200, 700).with_base_cap(0.85)),
]


def churn_one_at_a_time(
    scheme: Scheme, power: PowerLimits = DEFAULT_POWER, failures: int = 60, seed: int = 0
) -> dict[str, dict[str, float]]:
    cluster = preset_cluster(preset("paper-32k"), power=power)
    victims = random.Random(seed).sample(list(cluster.flat_uuids), failures)
    return churn_run(cluster, paper_job(scheme), [{v: GpuState.FAILED} for v in victims])


def churn_trace(
    scheme: Scheme, power: PowerLimits = DEFAULT_POWER, days: float = 15, seed: int = 0
) -> dict[str, dict[str, float]]:
    p = preset("paper-32k")
    cluster = preset_cluster(p, power=power)
    setup = SimSetup.create(cluster, paper_job(scheme), FailureModel(hardware_repair_h=72.0))
    trace = make_trace(setup, days, seed, warmup_days=6)
    steps: list[dict[str, GpuState]] = []
    i, ev = 0, trace.events
    initial: dict[str, GpuState] = {}
    if ev and ev[0].at_h == 0.0 and not ev[0].repaired:  # the state the warm-up reached: the start
        initial = {setup.uuids[g]: GpuState.FAILED for g in ev[0].failed}
        i = 1
    while i < len(ev):  # one replan per batch of simultaneous events, as the simulator does
        at = ev[i].at_h
        changes: dict[str, GpuState] = {}
        while i < len(ev) and ev[i].at_h == at:
            changes.update({setup.uuids[g]: GpuState.HEALTHY for g in ev[i].repaired})
            changes.update({setup.uuids[g]: GpuState.FAILED for g in ev[i].failed})
            i += 1
        steps.append(changes)
    out = churn_run(cluster, paper_job(scheme), steps, initial)
    out["trace"] = {"replans": len(steps), "failures": trace.failures, "failed_at_start": len(initial),
                    "peak_failed": trace.peak_failed()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip 1M GPUs")
    ap.add_argument("--json", type=Path, help="also write results here")
    ap.add_argument("--only", type=int, help="run one size only")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--skip-churn", action="store_true")
    args = ap.parse_args()
    console = Console(width=140)
    results: dict[str, object] = {}
    if not args.skip_timing:
        results["timing"] = timing(console, args)
    if not args.skip_churn:
        results["churn"] = churn(console)
    console.print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


def timing(console: Console, args: argparse.Namespace) -> list[dict[str, float]]:
    table = Table(title="planner: full plan and replan after one more failure (median)")
    for col in ("shape", "GPUs", "domains", "replicas", "full plan ms", "sorted packer ms", "replan ms",
                "rel. throughput"):
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
            r["shape"] = name  # type: ignore[assignment]
            rows.append(r)
            table.add_row(
                f"{name}/TP{tp}", f"{r['gpus']:,}", f"{r['domains']:,}", f"{r['replicas']:,}",
                f"{r['full_ms']:.1f}", f"{r['full_sorted_ms']:.1f}", f"{r['replan_ms']:.1f}", f"{r['throughput']:.4f}",
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
    return rows


def churn(console: Console) -> dict[str, object]:
    table = Table(title="churn per replan, paper shape (32,768 GPUs, TP32 x 8 stages, 128 replicas; 960 GB per stage)")
    for col in ("sequence", "scheme", "packer", "replans", "change stage mean", "max", "moved mean", "max",
                "TB loaded mean", "max", "same batch as sorted"):
        table.add_column(col, justify="right")
    out: dict[str, object] = {}
    for label, fn in (("60 failures, one at a time", churn_one_at_a_time), ("15-day trace", churn_trace)):
        for name, scheme, power in VARIANTS:
            with console.status(f"{label}, {name}"):
                res = fn(scheme, power)
            out[f"{label} / {name}"] = res
            eq = res["equal_batch_steps"]
            kinds = ("", "/failure", "/repair") if "trace" in label else ("",)
            for kind in kinds:
                for packer in ("stable", "sorted"):
                    r = res[packer + kind]
                    table.add_row(
                        label + (f" ({kind[1:]}s)" if kind else ""), name, packer, str(r["steps"]),
                        f"{r['stage_mean']:.2f}", str(r["stage_max"]), f"{r['moved_mean']:.2f}", str(r["moved_max"]),
                        f"{r['tb_mean']:.2f}", f"{r['tb_max']:.1f}",
                        f"{eq['equal']}/{eq['of']}" if packer == "stable" and not kind else "",
                    )
            if "trace" in res:
                console.print(f"15-day trace ({name}): {res['trace']}")
    console.print(table)
    return out


if __name__ == "__main__":
    main()
