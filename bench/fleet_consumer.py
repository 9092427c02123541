"""The fleet leader's cost per outbox row it applies, by batch size (issue 30: <= 50 us a report),
and per unchanged re-hello (the storm a new leader applies after a failover moved agents).

One manager in this process leads a throwaway PostgreSQL database in fleet mode; its consumer task
is stopped so that this script feeds it: N nodes (8 GPUs each) registered through the outbox, then
state-changing reports (GPU 0 degraded, healthy, ... as bench/fleet_load.py sends them) appended
and applied in batches of each size given. For each size: this process's CPU per row applied
(`time.process_time`: the consumer's Python, SQLAlchemy and asyncpg; PostgreSQL's own work is in
its server process and not counted) and the wall time per row.

A profile of the largest batch size: `--profile` (cProfile; the top entries by own time).

Usage: python bench/fleet_consumer.py [--nodes 2000] [--rows 4000] [--batches 1,16,128,2048]
                                      [--postgres postgresql+asyncpg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import io
import pstats
import secrets
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store import outbox


async def main_async(a: argparse.Namespace) -> dict[str, Any]:
    admin = a.postgres.replace("postgresql+asyncpg://", "postgresql://")
    name = f"ntp_bench_{secrets.token_hex(4)}"
    c = await asyncpg.connect(admin)
    await c.execute(f'CREATE DATABASE "{name}"')
    await c.close()
    url = f"{a.postgres.rsplit('/', 1)[0]}/{name}"
    m = Manager(Settings(database_url=url))
    out: dict[str, Any] = {"nodes": a.nodes, "by_batch": {}}
    try:
        await m.start()
        await m.wait_leading()
        assert m.fleet is not None and m.fleet.consumer is not None
        for t in list(m.fleet._tasks):  # the script feeds the consumer itself
            if t.get_name() == "fleet-consumer":
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
        cons = m.fleet.consumer
        nodes = [f"n-{i:05d}" for i in range(a.nodes)]
        hellos = [outbox.Entry(outbox.HELLO, n, {
            "domain": "d0", "boot_id": "b", "agent_version": "bench", "token": None, "peer": "",
            "gpus": [[f"GPU-{n}-{k}", k, "H100", 80 << 30, 700_000, 200_000, 700_000] for k in range(8)]},
            f"hello:{n}") for n in nodes]
        await append(m, hellos)
        await drain(m, cons, 512)
        gc.collect()  # as ntp_manager/server.py does once a manager has started
        gc.freeze()
        gc.set_threshold(50_000, 20, 20)
        seq = dict.fromkeys(nodes, 0)
        state = dict.fromkeys(nodes, "healthy")

        def reports(k: int) -> list[outbox.Entry]:
            es = []
            for i in range(k):
                n = nodes[i % len(nodes)]
                seq[n] += 1
                state[n] = "degraded" if state[n] == "healthy" else "healthy"
                es.append(outbox.Entry(outbox.REPORT, n, {"gpus": [[f"GPU-{n}-0", state[n], ["bench"], [], None]]},
                                       f"report:{n}:{seq[n]}", report_seq=seq[n]))
            return es

        sizes = [int(x) for x in a.batches.split(",")]
        for b in sizes:
            await append(m, reports(a.rows))
            prof = cProfile.Profile() if a.profile and b == max(sizes) else None
            cpu0, t0 = time.process_time(), time.perf_counter()
            if prof is not None:
                prof.enable()
            per: list[float] = []
            n = await drain(m, cons, b, per)
            if prof is not None:
                prof.disable()
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
            out["by_batch"][b] = {"rows": n, "cpu_us_per_row": 1e6 * cpu / n, "wall_us_per_row": 1e6 * wall / n,
                                  "per_batch_cpu_us_per_row": per}
            print(f"batch {b:5d}: {n} rows, CPU {1e6 * cpu / n:7.1f} us/row, wall {1e6 * wall / n:7.1f} us/row"
                  f"{spread(per)}", flush=True)
            if prof is not None:
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
                print(s.getvalue())
        # a failover's storm: every node says hello again, unchanged, through another manager
        again = [outbox.Entry(outbox.HELLO, e.node, {**e.payload, "peer": "ipv4:127.0.0.1:1"}, f"again:{e.node}")
                 for e in hellos]
        await append(m, again)
        prof = cProfile.Profile() if a.profile else None
        cpu0, t0 = time.process_time(), time.perf_counter()
        if prof is not None:
            prof.enable()
        per = []
        n = await drain(m, cons, 512, per)
        if prof is not None:
            prof.disable()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        out["rehello"] = {"rows": n, "cpu_us_per_row": 1e6 * cpu / n, "wall_us_per_row": 1e6 * wall / n,
                          "per_batch_cpu_us_per_row": per}
        print(f"unchanged re-hellos (batch 512): {n} rows, CPU {1e6 * cpu / n:7.1f} us/row, "
              f"wall {1e6 * wall / n:7.1f} us/row{spread(per)}", flush=True)
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
            print(s.getvalue())
        assert cons.quarantined == 0, f"{cons.quarantined} rows quarantined"
        return out
    finally:
        await m.stop()
        await m.engine.dispose()
        c = await asyncpg.connect(admin)
        await c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await c.close()


async def append(m: Manager, entries: list[outbox.Entry]) -> None:
    for i in range(0, len(entries), 1000):
        async with m.sm() as s, s.begin():
            await outbox.append(s, entries[i:i + 1000], "bench", datetime.now(UTC))


async def drain(m: Manager, cons: Any, batch: int, per_batch: list[float] | None = None) -> int:
    """Apply every row after the cursor, `batch` rows a transaction, as Consumer.run does; each
    batch's CPU per row (read and apply, microseconds) into `per_batch`."""
    n = 0
    while True:
        cpu0 = time.process_time()
        rows = await cons.read(batch)
        if not rows:
            return n
        await cons.apply(rows)
        n += len(rows)
        if per_batch is not None:
            per_batch.append(1e6 * (time.process_time() - cpu0) / len(rows))


def spread(per_batch: list[float]) -> str:
    """p10 and median of the batches' CPU per row: on a noisy box the low quantiles of many
    batches say more about the code than one total does."""
    if len(per_batch) < 2:
        return ""
    q = statistics.quantiles(per_batch, n=10)
    return f" (per batch: p10 {q[0]:.1f}, median {statistics.median(per_batch):.1f} us/row)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=2000)
    p.add_argument("--rows", type=int, default=4000, help="reports applied per batch size")
    p.add_argument("--batches", default="1,16,128,2048")
    p.add_argument("--postgres", default="postgresql+asyncpg://postgres@127.0.0.1:5432/test")
    p.add_argument("--profile", action="store_true", help="cProfile the largest batch size")
    p.add_argument("--top", type=int, default=25)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
