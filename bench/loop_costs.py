"""What the manager's periodic and dashboard work costs its event loop at 100K GPUs (issue 17).

An in-process manager (no HTTP) on SQLite seeded with the cluster bench/layouts.py uses (12,500
nodes of 8 GPUs in NVL72 domains), the job of 100,000 one-GPU replicas planned over it. Then, each
several times:

- the dashboard snapshot (`api/dashboard.py`), cold (first after a new layout) and warm;
- a liveness tick (`Liveness.check`) with every node heard from, and the scan it makes when every
  node has gone silent (the GPUs' transitions themselves are one transaction, not measured here);
- a maintenance tick over domain windows (`Maintenance.apply_windows`) and one window's target listing.

Each is timed as the longest the loop was held while it ran (a probe task sleeping 1 ms measures how
late it wakes) and the wall time. The process is set up as `ntp-manager serve` sets itself up
(gc.freeze after loading, young-generation threshold 50,000, switch interval 0.5 ms).

Usage: python bench/loop_costs.py [--nodes 12500] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import layouts
from bench.common import machine_line
from ntp_manager.api.dashboard import dashboard_snapshot
from ntp_manager.api.edge import json_reply
from ntp_manager.service.core import offloop
from ntp_manager.service.ingest import liveness
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store.db import make_engine, upgrade


class LagProbe:
    """The longest the loop was kept from running a 1 ms timer while it ran."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.001)
            self.worst = max(self.worst, loop.time() - t - 0.001)

    async def measure(self, fn: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
        """(wall s, worst lag s) of one `await fn()`."""
        self.worst = 0.0
        self._task = asyncio.create_task(self._run())
        await asyncio.sleep(0.005)
        self.worst = 0.0
        t0 = time.perf_counter()
        await fn()
        wall = time.perf_counter() - t0
        await asyncio.sleep(0.005)
        self._task.cancel()
        return wall, self.worst


async def world(tmp: Path, nodes: int) -> Manager:
    layouts.NODES = nodes
    engine = make_engine(f"sqlite+aiosqlite:///{tmp / 'ntp.db'}")
    await upgrade(engine)
    await engine.dispose()
    layouts.seed(f"sqlite:///{tmp / 'ntp.db'}")
    gpus = nodes * layouts.PER_NODE
    settings = Settings(data_dir=tmp, database_url=f"sqlite+aiosqlite:///{tmp / 'ntp.db'}", http_port=0,
                        grpc_port=0, max_cluster_gpus=gpus, suspect_after_s=3600.0, fail_after_s=7200.0,
                        breaker_min_gpus=gpus)
    m = Manager(settings)
    await m.start()
    for t in m._tasks:  # the monitor's own ticks would run the passes measured here meanwhile
        if t.get_name() == "monitor":
            t.cancel()
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    sys.setswitchinterval(0.0005)
    if hasattr(offloop, "freeze_long_lived"):  # as server.py does
        offloop.freeze_long_lived()
    async with m.mutation("bench") as tx:
        await m.create_job(tx, {**layouts.SHAPES["tp1"], "replicas": gpus})
    while m.world.jobs["all"].layout is None:
        await asyncio.sleep(0.1)
    return m


def row(name: str, runs: list[tuple[float, float]]) -> dict[str, Any]:
    walls, lags = [1e3 * w for w, _ in runs], [1e3 * lag for _, lag in runs]
    out = {"step": name, "runs": len(runs), "wall_ms_median": statistics.median(walls),
           "lag_ms_median": statistics.median(lags), "lag_ms_max": max(lags)}
    print(json.dumps(out), flush=True)
    return out


async def main(nodes: int, repeats: int, verbose: bool = False) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        t0 = time.perf_counter()
        m = await world(tmp, nodes)
        print(f"world of {len(m.world.gpus):,} GPUs and its layout in {time.perf_counter() - t0:.1f} s", flush=True)
        probe = LagProbe()
        out = []
        try:
            job = m.world.jobs["all"]

            async def cold() -> None:
                job.layout.reason += " "  # type: ignore[union-attr]  # a new stamp: the job's part is redrawn
                await dashboard_snapshot(m)

            async def snap() -> None:
                await dashboard_snapshot(m)

            async def full_gc() -> None:
                gc.collect()

            out.append(row("a full garbage collection (what an automatic generation-2 one costs)",
                           [await probe.measure(full_gc) for _ in range(2)]))
            print(f"  objects the collector tracks: {len(gc.get_objects()):,}, frozen: {gc.get_freeze_count():,}")
            if verbose:
                from collections import Counter
                kinds = Counter(type(o).__qualname__ for o in gc.get_objects())
                print("  most tracked:", kinds.most_common(12))

            async def answer() -> None:  # what GET /v1/snapshot does
                await json_reply(await dashboard_snapshot(m))

            m.watchdog.warn_s = 0.015  # stacks of the loop held > 15 ms
            m.watchdog.stall_stacks.clear()
            out.append(row("dashboard snapshot, cold job part", [await probe.measure(cold) for _ in range(repeats)]))
            out.append(row("dashboard snapshot, warm", [await probe.measure(snap) for _ in range(repeats)]))
            out.append(row("dashboard answer (snapshot + JSON)", [await probe.measure(answer) for _ in range(repeats)]))
            for where in m.watchdog.stall_stacks:
                print("  held the loop > 15 ms:", where.replace("\n", " | ")[-600:], flush=True)
            m.watchdog.warn_s = 0.1

            out.append(row("liveness tick, every node heard from",
                           [await probe.measure(m.liveness.check) for _ in range(repeats)]))
            for n in m.world.nodes.values():  # every node silent for an hour and more
                n.last_seen -= 10_000.0
            if hasattr(m.liveness, "watch"):
                m.liveness.watch.touched(m.world.nodes)  # last_seen moved back: say so (its precondition)
            now = m.kernel.clock.monotonic()

            async def walk_all() -> None:
                liveness.walk(m.world, now, m.liveness.options)

            out.append(row("liveness scan, every node silent: the full walk (before)",
                           [await probe.measure(walk_all) for _ in range(repeats)]))
            if hasattr(m.liveness, "watch"):
                out.append(row("liveness tick, every node silent: first pass (100,000 GPUs turn suspect)",
                               [await probe.measure(m.liveness.check)]))
                out.append(row("liveness tick, every node silent: later passes",
                               [await probe.measure(m.liveness.check) for _ in range(repeats)]))
            for n in m.world.nodes.values():
                n.last_seen += 10_000.0

            doms = sorted(m.world.domains)
            wall = m.clock.now()
            for k, dom in enumerate(doms[:8]):  # eight domain windows, far in the future
                async with m.mutation("bench") as tx:
                    await m.add_maintenance(tx, "domain", dom, wall + timedelta(days=30 + k),
                                            wall + timedelta(days=31 + k), "bench")

            async def listing() -> None:
                m.maintenance.targets("domain", doms[-1])

            out.append(row("maintenance listing of one domain's GPUs",
                           [await probe.measure(listing) for _ in range(repeats)]))
            out.append(row("maintenance tick, 8 domain windows",
                           [await probe.measure(m.maintenance.apply_windows) for _ in range(repeats)]))
        finally:
            await m.stop()
        return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=12_500)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--verbose", action="store_true", help="what the garbage collector tracks, by type")
    args = ap.parse_args()
    res = asyncio.run(main(args.nodes, args.repeats, args.verbose))
    print(machine_line())
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
