"""Many jobs (issue 41): admission and allocation at 100,000 GPUs with 100 jobs, and how many jobs
a failure replans.

An in-process manager on SQLite (its real kernel, jobs, ownership and planner process); the cluster
(NVL32 domains of 32 GPUs, 8 GPUs a node) is written in one registration transaction, as agents'
hellos would write it. Then:

1. Admission: 100 jobs of 30 replicas x TP32 each (no `domains`: the manager chooses 30 whole
   domains each), created one by one, each in its own transaction (choose + write + commit), and
   one more job that does not fit (its 409, naming the pool). Goal: <= 50 ms each at 100 jobs.
2. Allocation: `GET /v1/cluster/allocation`'s answer (a page of 100 domains, the pool, the jobs).
   Goal: <= 50 ms.
3. A failure in one job with a spare group reserved in the pool: the pool grants it a domain against
   its reservation; the jobs replanned (layout versions written) once the manager is quiet. Goal: 1
   (that job: its failure, then its grant).
4. A failure in a job with `min_throughput: 1` and no spare: the pool grants it a domain; the jobs
   replanned (the receiver only: its failure, then its grant).

    .venv/bin/python bench/alloc.py [--gpus 100000] [--jobs 100]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console

from bench.common import machine_line, show
from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.errors import Conflict
from ntp_manager.service.core.state import GpuRec, HealthSource, NodeRec, health_to
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings

DOMAIN, NODE = 32, 8


async def register(m: Manager, gpus: int) -> None:
    async with m.kernel.exclusive("bench") as tx:
        for d in range(gpus // DOMAIN):
            for n in range(DOMAIN // NODE):
                node = f"n{d}-{n}"
                # seen now (a last_seen of 0 is the machine's uptime ago: past fail_after_s on a box up 2 h)
                tx.add_node(NodeRec(node, f"nvl-{d:05d}", [], last_seen=m.clock.monotonic()))
                for i in range(NODE):
                    tx.add_gpu(GpuRec(f"GPU-{d}-{n}-{i}", node, f"nvl-{d:05d}", i, 1_000_000, 200_000, 1_300_000,
                                      health_source=HealthSource.AGENT))


def spec(name: str, replicas: int, **kw: object) -> dict[str, object]:
    return {"name": name, "tp": 32, "replicas": replicas, "local_batch": 4, "min_tp": 16, "heads": 64,
            "mlp_columns": 4096, **kw}


async def quiet(m: Manager, changed: str | None = None, before: dict[str, int] | None = None) -> None:
    """Until nothing is dirty or being shared out (and `changed` has a new version: the control loop
    takes a job out of the dirty set before it plans it)."""
    end = time.monotonic() + 30
    while changed is not None and before is not None and versions(m).get(changed) == before.get(changed):
        assert time.monotonic() < end, f"{changed} was not replanned"
        await asyncio.sleep(0.02)
    for _ in range(3):
        while m.kernel.dirty or m.sharing.passes.busy:
            await asyncio.sleep(0.01)
        await asyncio.sleep(1.0)


def versions(m: Manager) -> dict[str, int]:
    return {n: j.layout.version for n, j in m.world.jobs.items() if j.layout is not None}


async def fail(m: Manager, uuid: str) -> None:
    async with m.kernel.exclusive("bench") as tx:
        tx.change_gpu(uuid, health_to(GpuState.FAILED, "bench", HealthSource.AGENT, tx.now))


async def run(gpus: int, jobs: int, console: Console) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        m = Manager(Settings(data_dir=Path(tmp), database_url=f"sqlite+aiosqlite:///{tmp}/ntp.db",
                             max_cluster_gpus=max(gpus, 100_000), breaker_min_gpus=1000,
                             suspect_after_s=3600.0, fail_after_s=7200.0))
        await m.start()
        try:
            t0 = time.perf_counter()
            await register(m, gpus)
            console.print(f"registered {gpus:,} GPUs in {time.perf_counter() - t0:.1f} s")
            per_job = (gpus // DOMAIN - 25) // jobs  # domains per job, a few left in the pool
            admit: list[float] = []
            for j in range(jobs):
                extra = {"spares": 1} if j == 0 else ({"min_throughput": 1.0} if j == 1 else {})
                reps = per_job - 1 if j == 0 else per_job
                t = time.perf_counter()
                async with m.mutation("bench") as tx:
                    await m.create_job(tx, spec(f"job-{j:03d}", reps, **extra))
                admit.append(time.perf_counter() - t)
            t = time.perf_counter()
            try:
                async with m.mutation("bench") as tx:
                    await m.create_job(tx, spec("too-big", gpus // DOMAIN))
            except Conflict:
                refused = time.perf_counter() - t
            views = []
            for _ in range(5):
                t = time.perf_counter()
                await m.sharing.view(100, 0)
                views.append(time.perf_counter() - t)
            await quiet(m)
            planned = sum(1 for j in m.world.jobs.values() if j.layout is not None)

            async def replanned_by_failure_in(job: str) -> dict[str, int]:
                """Fail the first GPU of `job`'s layout; the new layout versions per job it caused."""
                before = versions(m)
                lay = m.world.jobs[job].layout
                assert lay is not None
                await fail(m, lay.doc.gpus[0])
                await quiet(m, job, before)
                after = versions(m)
                return {n: after[n] - before.get(n, 0) for n in after if after[n] != before.get(n)}

            # 3. a failure that job-000's reserved spare absorbs (granted from the pool)
            replanned_1 = await replanned_by_failure_in("job-000")
            # 4. a failure in job-001 (min_throughput 1, no spare): the pool grants a domain
            replanned_2 = await replanned_by_failure_in("job-001")
            rows = [
                ("admission, one job (choose + write + commit)", f"{1000 * statistics.median(admit):.1f} median, "
                 f"{1000 * max(admit[1:]):.1f} max, {1000 * admit[-1]:.1f} for the {jobs}th", "<= 50 ms"),
                ("the first admission after the registration", f"{1000 * admit[0]:.0f} (waits for the planner's "
                 "snapshot, built off the loop)", ""),
                ("a refusal (409 naming the pool)", f"{1000 * refused:.1f}", "<= 50 ms"),
                ("allocation view (100 domains, pool, jobs)", f"{1000 * statistics.median(views):.1f}", "<= 50 ms"),
                ("jobs replanned by a failure its reserved spare absorbs", f"{len(replanned_1)} {replanned_1} "
                 "(versions)", "1 (that job)"),
                ("jobs replanned by a failure the pool helps", f"{len(replanned_2)} {replanned_2} (versions), "
                 f"grants {m.sharing.grants}", "1 (the receiver)"),
            ]
            show(console, f"{gpus:,} GPUs (NVL{DOMAIN}), {jobs} jobs of {per_job} domains, {planned} planned; "
                 f"{machine_line()}", ("what", "ms / count", "goal"), rows)
        finally:
            await m.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=100_000)
    p.add_argument("--jobs", type=int, default=100)
    a = p.parse_args()
    asyncio.run(run(a.gpus, a.jobs, Console()))


if __name__ == "__main__":
    main()
