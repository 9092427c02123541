"""What a warm standby costs and saves at 100,000 GPUs (issue 40): 12,500 nodes of 8 GPUs (one
NVLink domain each) and one job over 96,000 of them (`--replicas`: 32 GPUs each), on a scratch
PostgreSQL database, managers in this process.

- the standby's start: loading the world and building the planner's snapshot (wall, CPU, memory);
- following: the standby applies rows the leader wrote while it was paused (the leader idle), CPU
  per row and per GPU record;
- a takeover on the followed world (warm) and one that loads it (cold, as before): the new
  leader's CPU from taking the lease to its first layout at the new epoch (a GPU failure reported
  to it as soon as it leads), this process's CPU plus the planner process's.

    .venv/bin/python bench/takeover.py [--postgres URL] [--reports N]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg

from bench.common import drop_postgres, fresh_postgres
from ntp_manager.service.manager import GpuReport, Manager
from ntp_manager.service.planning import planproc
from ntp_manager.settings import Settings
from ntp_manager.store import db, worldlog

NODES, PER_NODE = 12_500, 8
JOB = {"name": "big", "tp": 8, "groups_per_replica": 4, "replicas": 3000, "local_batch": 1, "min_tp": 2,
       "heads": 64, "mlp_columns": 256}
TICK = os.sysconf("SC_CLK_TCK")
PROFILE = "--profile" in sys.argv
PRIME = "--no-prime" not in sys.argv


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def child_cpu() -> float:
    """CPU seconds of this process's live children (the planner process)."""
    total = 0.0
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # ppid
            total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def cpu() -> float:
    return time.process_time() + child_cpu()


def settings(url: str, name: str) -> Settings:
    return Settings(database_url=url, leader_id=name, lease_ttl_s=6.0, lease_renew_s=0.5, takeover_grace_s=600.0,
                    data_dir=Path(f"/tmp/ntp-bench-takeover-{name}"))


async def seed(url: str) -> None:
    m = Manager(Settings(database_url=url))
    await db.upgrade(m.engine)
    await m.engine.dispose()
    c = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://", 1))
    await c.execute(f"INSERT INTO domains (id, power_budget_w, created_at) "
                    f"SELECT 'nvl-' || i, NULL, now() FROM generate_series(0, {NODES - 1}) i")
    await c.execute(f"INSERT INTO nodes (name, domain_id, boot_id, agent_version, last_seq, registered_at) "
                    f"SELECT 'f-' || i, 'nvl-' || i, 'b', '1', 0, now() FROM generate_series(0, {NODES - 1}) i")
    await c.execute(f"INSERT INTO gpus (uuid, pos, node, domain_id, idx, model, memory_bytes, tdp_mw, min_mw, "
                    f"max_mw, health, health_reason, health_source, health_since) "
                    f"SELECT 'GPU-' || g, g, 'f-' || (g / {PER_NODE}), 'nvl-' || (g / {PER_NODE}), g % {PER_NODE}, "
                    f"'H100', 85899345920, 700000, 200000, 700000, 'healthy', '', 'agent', now() "
                    f"FROM generate_series(0, {NODES * PER_NODE - 1}) g")
    await c.close()


async def until(cond: Any, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("the bench waited too long")
        await asyncio.sleep(0.002)


async def takeover(old: Manager, new: Manager, seq: dict[str, int], node: int) -> dict[str, float]:
    """Stop `old` (it gives the lease up); from the moment `new` leads, report a GPU failed to it
    and wait for the layout at its epoch. Seconds of CPU and wall from the lease to each step."""
    base = new.world.jobs["big"].layout
    # the new leader's planner process as a standby's is: its own (in a deployment each manager has
    # one; the managers of this process would share one, and the old leader's shutdown kills it
    # when one of its plans is still running there), started, sent what its follower primes
    new.jobs.planner = planproc.PlanProcess(True)
    await new.jobs.planner.warm()
    if new.follower is not None and PRIME:  # what a standby's follower has sent its own planner by now
        await new.follower.prime()
    commits: list[tuple[str, int]] = []
    new.kernel.after_commit.append(lambda tx: commits.append((tx.actor, len(tx.gpus_written))))
    await old.stop()
    await until(lambda: new.leadership.leading, 30)
    pp = new.jobs.planner
    sent0 = (pp.calls, pp.shapes_sent, pp.docs_sent)
    c0, t0, k0 = cpu(), time.perf_counter(), child_cpu()
    prof = cProfile.Profile(time.process_time) if PROFILE else None
    if prof is not None:
        prof.enable()
    await until(lambda: new.acting)
    ready_cpu, ready_wall = cpu() - c0, time.perf_counter() - t0
    name = f"f-{node}"
    seq[name] = seq.get(name, 0) + 1
    await new.apply_report(name, seq[name], [GpuReport(f"GPU-{node * PER_NODE}", "failed", ["XID 79"], [79])])
    await until(lambda: (lay := new.world.jobs["big"].layout) is not None and lay.leader_epoch == new.epoch
                and (base is None or lay.version > base.version))
    out = {"acting_cpu": ready_cpu, "acting_wall": ready_wall, "layout_cpu": cpu() - c0,
           "layout_wall": time.perf_counter() - t0, "planner_cpu": child_cpu() - k0}
    print(f"planner calls in the window {pp.calls - sent0[0]}, cluster shapes sent {pp.shapes_sent - sent0[1]}, "
          f"running layouts sent {pp.docs_sent - sent0[2]}", flush=True)
    if PROFILE:
        print("transactions of the new leader (actor, GPUs written):", commits[:40], len(commits))
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    return out


async def main(base_url: str, reports: int) -> None:
    url = await fresh_postgres(base_url, "ntp_takeover")
    managers: list[Manager] = []
    try:
        await seed(url)
        a = Manager(settings(url, "a"))
        managers.append(a)
        await a.start()
        async with a.mutation("bench") as tx:
            await a.create_job(tx, JOB)
        await until(lambda: a.world.jobs["big"].layout is not None)
        print(f"leader a: {len(a.world.gpus):,} GPUs, job over "
              f"{JOB['tp'] * JOB['groups_per_replica'] * JOB['replicas']:,} of them", flush=True)

        gc.collect()
        r0, c0, t0 = rss_mib(), cpu(), time.perf_counter()
        b = Manager(settings(url, "b"))
        managers.append(b)
        await b.start()
        assert b.follower is not None and b.follower.warm
        gc.collect()
        start = {"wall": time.perf_counter() - t0, "cpu": cpu() - c0, "rss": rss_mib() - r0}
        print(f"standby start (load + snapshot): wall {start['wall']:.2f} s, CPU {start['cpu']:.2f} s, "
              f"memory +{start['rss']:.0f} MiB", flush=True)

        # following: b paused while a takes `reports` failure and recovery reports, then b catches up
        await b.follower.stop()
        seq: dict[str, int] = {}
        futs = []
        for i in range(reports):
            node = (i * 7) % NODES
            name = f"f-{node}"
            seq[name] = seq.get(name, 0) + 1
            state = "failed" if seq[name] % 2 else "healthy"
            futs.append(a.apply_report(name, seq[name], [GpuReport(f"GPU-{node * PER_NODE + 1}", state, [], [])]))
        await asyncio.gather(*futs)
        async with a.engine.connect() as conn:
            head = await worldlog.head(conn)
        rows = head - b.follower.cursor
        await asyncio.sleep(3.0)  # a's replans settle
        c0, t0 = cpu(), time.perf_counter()
        b.follower.start_following()
        await until(lambda: b.follower is not None and b.follower.cursor >= head)
        await until(lambda: b.follower is not None and not b.follower._jobs)
        fcpu, fwall = cpu() - c0, time.perf_counter() - t0
        print(f"follow: {rows} rows ({reports} reports, the layouts they caused): CPU {fcpu:.3f} s "
              f"({fcpu / max(rows, 1) * 1e6:.0f} us per row), wall {fwall:.3f} s", flush=True)

        warm = await takeover(a, b, seq, 11)
        print(f"warm takeover: CPU {warm['acting_cpu']:.3f} s to acting, {warm['layout_cpu']:.3f} s to the first "
              f"layout, of which the planner process {warm['planner_cpu']:.3f} s (wall {warm['acting_wall']:.3f} / "
              f"{warm['layout_wall']:.3f} s)", flush=True)

        c = Manager(settings(url, "c"))
        managers.append(c)
        await c.start()
        assert c.follower is not None

        async def cold() -> bool:
            assert c.follower is not None
            await c.follower.stop()
            return False

        c.follower.take_over = cold  # type: ignore[method-assign]
        coldr = await takeover(b, c, seq, 13)
        print(f"cold takeover (world loaded): CPU {coldr['acting_cpu']:.3f} s to acting, {coldr['layout_cpu']:.3f} s "
              f"to the first layout (wall {coldr['acting_wall']:.3f} / {coldr['layout_wall']:.3f} s)", flush=True)
        print()
        print("| measure (100,000 GPUs, 12,500 nodes) | goal | warm standby | loaded at takeover |")
        print("|---|---|---|---|")
        print(f"| new leader CPU, lease -> first layout at its epoch | <= 0.3 s | {warm['layout_cpu']:.3f} s | "
              f"{coldr['layout_cpu']:.3f} s |")
        print(f"| wall, lease -> first layout | | {warm['layout_wall']:.3f} s | {coldr['layout_wall']:.3f} s |")
        print(f"| standby start: load + planner snapshot | | wall {start['wall']:.2f} s, CPU {start['cpu']:.2f} s | |")
        print(f"| standby world in memory | | +{start['rss']:.0f} MiB RSS | |")
        print(f"| following, per world-log row | | {fcpu / max(rows, 1) * 1e6:.0f} us CPU | |")
    finally:
        for m in reversed(managers):
            await m.stop()
        await drop_postgres(base_url, url)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--postgres", default=os.environ.get("NTP_TEST_POSTGRES_URL",
                                                         "postgresql+asyncpg://postgres@127.0.0.1:5432/test"))
    ap.add_argument("--reports", type=int, default=2000)
    ap.add_argument("--replicas", type=int, default=3000, help="the job's replicas (x 4 stages x TP8 GPUs each)")
    ap.add_argument("--no-prime", action="store_true", help="the warm standby's planner process is not sent the "
                    "cluster and layouts ahead (as before the planner priming)")
    ap.add_argument("--profile", action="store_true", help="cProfile of each takeover window (this process)")
    args = ap.parse_args()
    JOB["replicas"] = args.replicas
    asyncio.run(main(args.postgres, args.reports))
