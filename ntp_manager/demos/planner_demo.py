"""`make demo`: plan a sample cluster, fail a few GPUs, and show what each scheme makes of it.

Runs on embedded defaults (no files needed): 8 NVL32 racks, a job of 3 replicas x 2 pipeline
stages at TP32 with one spare rack. Until the end-to-end demo (manager + agents + workers) exists,
this is the main job: it shows the planner's decisions, which the live service reuses unchanged.
"""

from __future__ import annotations

import random

from rich.console import Console
from rich.table import Table

from ntp_manager.cli.manager import render_plan
from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec, Scheme, make_plan
from ntp_manager.topology import generate_cluster


def main(seed: int = 7) -> None:
    console = Console()
    cluster = generate_cluster(8, 32, 4, name="demo")
    base = JobSpec(
        name="demo-llm", tp=32, groups_per_replica=2, replicas=3, local_batch=8, min_tp=28,
        heads=128, mlp_columns=81920, spares=1,
    )
    rng = random.Random(seed)
    uuids = [g.uuid for g in cluster.gpus()]
    # Two failures in one rack, one in another: the racks are packed into the same replica.
    failed = [uuids[5], uuids[40], uuids[41], *rng.sample(uuids[100:], 1)]
    broken = cluster.with_states(dict.fromkeys(failed, GpuState.FAILED))
    console.rule("[bold]ntp-manager demo: the planner")
    console.print(
        f"cluster: {cluster.gpu_count} GPUs in {len(cluster.domains)} NVL32 domains; "
        f"failed GPUs: {len(failed)}; job: {base.replicas} replicas x {base.groups_per_replica} "
        f"stages at TP{base.tp}, min TP{base.min_tp}, {base.spares} spare group"
    )
    summary = Table(title="throughput by scheme")
    for col in ("scheme", "replicas", "TP degrees", "global batch", "relative throughput", "boosted GPUs"):
        summary.add_column(col)
    for scheme in Scheme:
        for spares in (0, base.spares):
            job = JobSpec(**{**base.__dict__, "scheme": scheme, "spares": spares})
            plan = make_plan(broken, job)
            if spares:
                console.rule(f"{scheme.value}")
                render_plan(plan, console)
            summary.add_row(
                f"{scheme.value} ({spares} spare)", str(len(plan.replicas)),
                ",".join(str(r.tp) for r in plan.replicas),
                f"{plan.global_batch}/{plan.target_batch}", f"{plan.relative_throughput:.4f}",
                str(len(plan.power_caps_w)),
            )
    console.rule()
    console.print(summary)


if __name__ == "__main__":
    main()
