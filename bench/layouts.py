"""Layout storage and replan -> push at 100K GPUs (issue 19 item 6; the loop-stall goal of issue 17).

1. Storage per layout version (in this process, no I/O): a 100,000-GPU cluster (12,500 nodes of 8
   GPUs, NVL72 domains of 9 nodes, as bench/manager.py registers), one job over every GPU; version
   1 is the initial plan, version 2 the replan after one GPU failed (every group now records its
   previous place), version 3 after a second failure (the steady state). Bytes of one version
   stored as the plan JSON the manager wrote before (UUID strings), as a compact keyframe (GPU
   positions, store/layout_codec.py) and as a delta on the version before; and the CPU time to
   make and read each.
2. Replan -> push at 100K GPUs: a real `ntp-manager serve` on SQLite whose store is seeded with the
   same 100,000 GPUs (rows written directly: registering 12,500 agents is bench/manager.py's
   subject, not this one's), the job over every GPU, layout watchers on loopback. Each round the
   agent of one node reports a GPU failed: from just before the report is sent until every watcher
   holds the new version; then it reports it healthy again (timed as well). The manager's own
   watchdog says how long its event loop was held meanwhile (ntp_event_loop_lag_seconds: the
   smallest bucket bound holding every lag of the round; each lag over 100 ms is logged with its
   length, and counted), and a thread polls /healthz every 20 ms. An idle event loop in a process of
   its own (same priority) records its own lags meanwhile: on a shared machine that is what the
   load alone does to a loop, the floor under the manager's figures. Then reads, the dashboard
   snapshot (twice), 3 s of monitor ticks with a domain maintenance window, and a dry run, each
   measured the same way.

Usage: python bench/layouts.py [--rounds 5] [--watchers 20] [--skip-storage] [--skip-push]
                               [--shapes tp8,tp1] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import httpx
from rich.console import Console
from rich.table import Table
from sqlalchemy import create_engine, insert

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import HealthzProbe, create_tokens, lag_buckets, machine_line, serve, stop, worst_bucket
from ntp_manager.contract.gpu import GpuState
from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from ntp_manager.jsontext import dumps_in_pieces
from ntp_manager.planner import make_plan
from ntp_manager.planner.export import plan_to_dict
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.specfile import job_from_dict
from ntp_manager.store import layout_codec as codec
from ntp_manager.store.models import DomainRow, GpuRow, NodeRow
from ntp_manager.topology import Cluster, Domain, Gpu

NODES, PER_NODE, NODES_PER_DOMAIN = 12_500, 8, 9  # 100,000 GPUs in NVL72 domains
SHAPES = {  # name -> the job over every GPU
    "tp8": {"name": "all", "tp": 8, "replicas": NODES, "local_batch": 8, "min_tp": 4, "heads": 64,
            "mlp_columns": 4096},
    "tp1": {"name": "all", "tp": 1, "replicas": NODES * PER_NODE, "local_batch": 1, "heads": 1},
}


def node(i: int) -> str:
    return f"ing-{i:05d}"


def uuid(i: int, j: int) -> str:
    return f"GPU-{node(i)}-{j}"


def domain(i: int) -> str:
    return f"ing-nvl-{i // NODES_PER_DOMAIN:04d}"


def cluster() -> Cluster:
    doms: dict[str, list[Gpu]] = {}
    for i in range(NODES):
        doms.setdefault(domain(i), []).extend(Gpu(uuid(i, j), node(i), domain(i), j) for j in range(PER_NODE))
    return Cluster.build("bench", [Domain(d, tuple(g)) for d, g in sorted(doms.items())])


# ---- 1. storage per version -------------------------------------------------------------------


def timed(fn: Any, *args: Any, repeats: int = 3) -> tuple[Any, float]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t0)
    return out, best


def storage(shape: str) -> dict[str, Any]:
    c = cluster()
    spec = job_from_dict(SHAPES[shape], "job")
    p1 = make_plan(c, spec)
    c2 = c.with_states({uuid(0, 3): GpuState.FAILED})
    p2 = make_plan(c2, spec, p1)
    p3 = make_plan(c2.with_states({uuid(4000, 5): GpuState.FAILED}), spec, p2)
    pos = {g.uuid: i for i, g in enumerate(g for d in c.domains for g in d.gpus)}
    at = {i: u for u, i in pos.items()}
    d1, d2, d3 = (LayoutDoc.of(p) for p in (p1, p2, p3))
    full, t_full = timed(lambda: dumps_in_pieces(plan_to_dict(p3)))
    key, t_key = timed(codec.encode, d3, pos.__getitem__)
    first_delta = codec.encode(d2, pos.__getitem__, d1)
    delta, t_delta = timed(codec.encode, d3, pos.__getitem__, d2)
    back, t_read_key = timed(codec.decode, key, at.__getitem__)
    back3, t_read_delta = timed(codec.decode, delta, at.__getitem__, d2)
    assert back == d3 and back3 == d3, "a body did not read back the layout it was made of"
    _, t_read_full = timed(lambda: LayoutDoc.from_dict(json.loads(full)))
    _, t_doc = timed(LayoutDoc.of, p3)
    return {"shape": shape, "gpus": len(pos), "replicas": len(d3.replicas),
            "groups": sum(len(r.groups) for r in d3.replicas),
            "full_bytes": len(full.encode()), "keyframe_bytes": len(key), "first_delta_bytes": len(first_delta),
            "delta_bytes": len(delta), "full_write_ms": 1e3 * t_full, "keyframe_write_ms": 1e3 * t_key,
            "delta_write_ms": 1e3 * t_delta, "full_read_ms": 1e3 * t_read_full, "keyframe_read_ms": 1e3 * t_read_key,
            "delta_read_ms": 1e3 * t_read_delta, "layout_doc_ms": 1e3 * t_doc,
            "per_100_versions_full_mb": 100 * len(full.encode()) / 1e6,
            "per_100_versions_compact_mb": (7 * len(key) + 93 * len(delta)) / 1e6}


# ---- 2. replan -> push through a real manager ---------------------------------------------------


def seed(url: str) -> None:
    """The 100,000 GPUs as registration leaves them (gpus.pos in registration order)."""
    now = datetime.now(UTC)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(insert(DomainRow.__table__), [{"id": d, "power_budget_w": None, "created_at": now}
                                                  for d in sorted({domain(i) for i in range(NODES)})])
        conn.execute(insert(NodeRow.__table__), [
            {"name": node(i), "domain_id": domain(i), "boot_id": "b", "agent_version": "", "last_seq": 0,
             "drain_deadline": None, "drain_reason": None, "registered_at": now} for i in range(NODES)])
        conn.execute(insert(GpuRow.__table__), [
            {"uuid": uuid(i, j), "pos": i * PER_NODE + j, "node": node(i), "domain_id": domain(i), "idx": j,
             "model": "", "memory_bytes": 0, "tdp_mw": 1_000_000, "min_mw": 200_000, "max_mw": 1_300_000,
             "health": "healthy", "health_reason": "", "health_source": "agent", "health_since": now,
             "admin": None, "admin_owner": None, "admin_reason": None, "desired_mw": None, "enforced_mw": None}
            for i in range(NODES) for j in range(PER_NODE)])
    engine.dispose()


def start_manager(data: Path) -> tuple[subprocess.Popen[str], dict[str, Any], dict[str, str]]:
    tokens = create_tokens(data, [node(0)])
    tokens["agent"] = tokens[node(0)]
    seed(f"sqlite:///{data / 'ntp-manager.db'}")
    env = dict(os.environ, NTP_SUSPECT_AFTER_S="3600", NTP_FAIL_AFTER_S="7200", NTP_BREAKER_MIN_GPUS="100000",
               NTP_MAX_CLUSTER_GPUS=str(NODES * PER_NODE), NTP_LOG_FORMAT="json")
    proc, info = serve(data, env)
    return proc, info, tokens


def logged_stalls(log: Path, since: float) -> list[float]:
    """Lengths (ms) of the lags over 100 ms the watchdog logged after `since` (epoch seconds)."""
    out = []
    for line in log.read_text().splitlines():
        if '"event loop was blocked"' not in line:
            continue
        with_ts = json.loads(line)
        ts = datetime.fromisoformat(with_ts["timestamp"].replace("Z", "+00:00")).timestamp()
        if ts >= since:
            out.append(float(with_ts["blocked_ms"]))
    return out


CONTROL = """
import asyncio, sys, time
async def main():
    loop = asyncio.get_running_loop()
    with open(sys.argv[1], "w", buffering=1) as out:
        while True:
            t = loop.time()
            await asyncio.sleep(0.02)
            lag = loop.time() - t - 0.02
            if lag > 0.01:
                out.write(f"{time.time()} {lag}\\n")
asyncio.run(main())
"""


def control_lag(path: Path, t0: float, t1: float) -> float:
    """The largest lag an idle event loop in another process (same priority) had in [t0, t1]:
    what the machine's load alone does to a loop (the noise floor of the manager's figures)."""
    worst = 0.0
    for line in path.read_text().splitlines():
        at, lag = (float(x) for x in line.split())
        if at >= t0 and at - lag <= t1:  # the lag [at - lag, at] overlaps [t0, t1]
            worst = max(worst, lag)
    return worst


def stall_sites(log: Path, top: int = 8) -> list[tuple[int, str]]:
    """Where the watchdog caught the loop held (its in-stall warnings: the loop thread's stack,
    last frames), most frequent first; and full GC pauses over 100 ms."""
    sites: dict[str, int] = {}
    for line in log.read_text().splitlines():
        if '"event loop is blocked"' in line:
            where = json.loads(line).get("where", "")
            frames = [f.strip() for f in where.split("File ")[1:]]
            key = " <- ".join(f.split(", in ")[-1].split("\n")[0] + " (" + f.split('"')[1].rsplit("/", 1)[-1] + ")"
                              for f in reversed(frames[-4:]))
        elif '"garbage collection paused every thread"' in line:
            key = "full garbage collection"
        else:
            continue
        sites[key] = sites.get(key, 0) + 1
    return sorted(((n, k) for k, n in sites.items()), reverse=True)[:top]


async def push(shape: str, rounds: int, n_watchers: int, console: Console) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        t0 = time.perf_counter()
        proc, info, tokens = start_manager(data)
        started_s = time.perf_counter() - t0
        base = f"http://{info['http']}"
        prober = HealthzProbe(base)
        control = subprocess.Popen([sys.executable, "-c", CONTROL, str(data / "control.lag")])
        channel = grpc.aio.insecure_channel(info["grpc"])
        op = httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {tokens['operator']}"}, timeout=600)
        tasks: list[asyncio.Task[None]] = []
        try:
            agent = agent_pb2_grpc.AgentServiceStub(channel)
            q: asyncio.Queue[Any] = asyncio.Queue()
            welcome = asyncio.Event()
            await q.put(agent_pb2.AgentMessage(hello=agent_pb2.Hello(
                node=node(0), domain=domain(0), boot_id="b",
                gpus=[common_pb2.GpuInfo(uuid=uuid(0, j), index=j, power=common_pb2.PowerConstraints(
                    min_mw=200_000, max_mw=1_300_000, default_mw=1_000_000)) for j in range(PER_NODE)])))

            async def out():  # type: ignore[no-untyped-def]
                while True:
                    yield await q.get()

            async def agent_run() -> None:
                async for msg in agent.Connect(out(), metadata=(("authorization", f"Bearer {tokens['agent']}"),)):
                    if msg.WhichOneof("body") == "welcome":
                        welcome.set()

            tasks.append(asyncio.create_task(agent_run()))
            await asyncio.wait_for(welcome.wait(), 120)

            m0 = lag_buckets((await op.get("/metrics")).text)
            wall0, t1 = time.time(), time.perf_counter()
            (await op.post("/v1/jobs", json=SHAPES[shape])).raise_for_status()
            while (await op.get("/v1/jobs/all", params={"limit": 1})).json()["layout_version"] is None:
                await asyncio.sleep(0.05)
            first_s = time.perf_counter() - t1
            await asyncio.sleep(0.3)
            m1 = lag_buckets((await op.get("/metrics")).text)
            first = {"lag_bucket_s": worst_bucket(m0, m1), "stalls": m1[1] - m0[1],
                     "stall_ms": logged_stalls(data / "manager.log", wall0),
                     "control_ms": 1e3 * control_lag(data / "control.lag", wall0, time.time())}
            console.print(f"{shape} first layout (its power staged over every GPU): {json.dumps(first)}",
                          highlight=False)

            held: dict[int, int] = {}  # watcher -> newest version it holds
            worker = worker_pb2_grpc.WorkerServiceStub(channel)
            wmd = (("authorization", f"Bearer {tokens['worker']}"),)
            # watchers spread over the cluster; the first sits on the replica that loses a GPU
            gpus = [uuid(0, 0)] + [uuid((k * 4999) % NODES, k % PER_NODE) for k in range(1, n_watchers)]

            async def watch(k: int) -> None:
                req = worker_pb2.WatchLayoutRequest(job="all", worker_id=f"w{k}", gpu_uuid=gpus[k])
                async for msg in worker.WatchLayout(req, metadata=wmd):
                    held[k] = msg.stamp.version

            tasks.extend(asyncio.create_task(watch(k)) for k in range(n_watchers))

            async def all_hold(v: int) -> float:
                while len(held) < n_watchers or min(held.values()) < v:
                    await asyncio.sleep(0.001)
                return time.perf_counter()

            version = (await op.get("/v1/jobs/all")).json()["layout_version"]
            await all_hold(version)
            prober.start()
            seq = 0
            samples: list[dict[str, Any]] = []
            for r in range(rounds):
                for state, what in ((common_pb2.GPU_STATE_FAILED, "fail"), (common_pb2.GPU_STATE_HEALTHY, "repair")):
                    await asyncio.sleep(0.5)
                    m0 = lag_buckets((await op.get("/metrics")).text)
                    wall0 = time.time()
                    seq += 1
                    t_send = time.perf_counter()
                    q.put_nowait(agent_pb2.AgentMessage(report=agent_pb2.HealthReport(
                        seq=seq, gpus=[agent_pb2.GpuHealth(uuid=uuid(0, 3), state=state, reasons=["bench"])])))
                    version += 1
                    t_done = await all_hold(version)
                    await asyncio.sleep(0.3)
                    m1 = lag_buckets((await op.get("/metrics")).text)
                    during = prober.during(t_send - 0.05, t_done + 0.3)
                    wall1 = time.time()
                    samples.append({"round": r, "what": what, "ms": 1e3 * (t_done - t_send),
                                    "control_ms": 1e3 * control_lag(data / "control.lag", wall0, wall1),
                                    "lag_bucket_s": worst_bucket(m0, m1), "stalls": m1[1] - m0[1],
                                    "stall_ms": logged_stalls(data / "manager.log", wall0),
                                    "healthz_max_ms": 1e3 * max(during, default=0.0)})
                    console.print(f"{shape} {what} {r}: {json.dumps(samples[-1])}", highlight=False)
            steps = []
            for name, coro in reads_and_dry_run(op, shape):
                await asyncio.sleep(0.5)
                m0 = lag_buckets((await op.get("/metrics")).text)
                wall0, t0 = time.time(), time.perf_counter()
                size = await coro
                t1 = time.perf_counter()
                await asyncio.sleep(0.3)
                m1 = lag_buckets((await op.get("/metrics")).text)
                during = prober.during(t0 - 0.05, t1 + 0.3)
                steps.append({"step": name, "s": t1 - t0, "bytes": size, "lag_bucket_s": worst_bucket(m0, m1),
                              "stalls": m1[1] - m0[1],
                              "control_ms": 1e3 * control_lag(data / "control.lag", wall0, time.time()),
                              "stall_ms": logged_stalls(data / "manager.log", wall0),
                              "healthz_max_ms": 1e3 * max(during, default=0.0)})
                console.print(f"{shape} {json.dumps(steps[-1])}", highlight=False)
            ms = sorted(s["ms"] for s in samples)
            return {"shape": shape, "gpus": NODES * PER_NODE, "watchers": n_watchers, "rounds": rounds,
                    "start_s": started_s, "first_layout_s": first_s, "first_layout": first, "samples": samples,
                    "p50_ms": statistics.median(ms) if ms else 0.0, "max_ms": ms[-1] if ms else 0.0,
                    "lag_bucket_max_s": max((s["lag_bucket_s"] for s in samples), default=0.0),
                    "stalls": sum(s["stalls"] for s in samples),
                    "stall_max_ms": max((x for s in samples for x in s["stall_ms"]), default=0.0),
                    "control_max_ms": max((s["control_ms"] for s in samples), default=0.0),
                    "healthz_max_ms": max((s["healthz_max_ms"] for s in samples), default=0.0), "steps": steps}
        finally:
            prober.stop()
            control.kill()
            for t in tasks:
                t.cancel()
            await op.aclose()
            await channel.close()
            stop(proc)
            for n, where in stall_sites(data / "manager.log"):
                console.print(f"{shape}: held the loop {n}x: {where}", highlight=False)


def reads_and_dry_run(op: httpx.AsyncClient, shape: str) -> list[tuple[str, Any]]:
    """What an operator may ask of a 100K-GPU job, each measured like a replan; each answers its
    size in bytes (a manager from before the replica pages answers every replica, whatever the
    paging parameters; one without `/layouts/{version}` answers 404 there, and the bench goes on)."""
    async def get(path: str, **params: Any) -> int:
        r = await op.get(path, params=params)
        if r.status_code != 404:
            r.raise_for_status()
        return len(r.content)

    async def dry_run() -> int:
        r = await op.post("/v1/plans", json={"spec": {**SHAPES[shape], "name": "dry"}})
        r.raise_for_status()
        return len(r.content)

    async def monitor_ticks() -> int:
        # a maintenance window on a domain (far ahead): every monitor tick lists its GPUs; and the
        # ticks' liveness passes over 12,500 nodes (bench/loop_costs.py has every node silent)
        r = await op.post("/v1/maintenance", json={
            "target_kind": "domain", "target": domain(NODES - 1), "starts_at": "2999-01-01T00:00:00Z",
            "ends_at": "2999-01-02T00:00:00Z", "reason": "bench"})
        r.raise_for_status()
        await asyncio.sleep(3.0)
        return len(r.content)

    last = NODES * PER_NODE if shape == "tp1" else NODES
    return [("GET the layout (default page)", get("/v1/jobs/all/layout")),
            ("GET the layout's last 1,000 replicas", get("/v1/jobs/all/layout", limit=1000, offset=last - 1000)),
            ("GET version 1's last 1,000 replicas", get("/v1/jobs/all/layouts/1", limit=1000, offset=last - 1000)),
            ("GET the history (20 versions)", get("/v1/jobs/all/layouts", limit=20)),
            ("GET the job", get("/v1/jobs/all")),
            ("GET the dashboard snapshot", get("/v1/snapshot")),
            ("GET the dashboard snapshot again (job part cached)", get("/v1/snapshot")),
            ("monitor ticks for 3 s: liveness pass, a domain maintenance window listed", monitor_ticks()),
            ("dry run of the same spec", dry_run())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="failure + repair rounds (0: the first layout and reads)")
    ap.add_argument("--watchers", type=int, default=20)
    ap.add_argument("--shapes", default="tp8,tp1")
    ap.add_argument("--skip-storage", action="store_true")
    ap.add_argument("--skip-push", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    console = Console(width=140)
    shapes = args.shapes.split(",")
    res: dict[str, Any] = {"storage": [], "push": []}
    if not args.skip_storage:
        for s in shapes:
            with console.status(f"storage: {s}"):
                res["storage"].append(storage(s))
        t = Table(title="one layout version of a job over 100,000 GPUs (version 3: after two one-GPU failures)")
        for col in ("job", "replicas", "plan JSON (before)", "compact keyframe", "delta", "first delta",
                    "100 versions before", "100 versions now", "write ms JSON/key/delta",
                    "read ms JSON/key/delta"):
            t.add_column(col, justify="right")
        for x in res["storage"]:
            t.add_row(x["shape"], f"{x['replicas']:,}", f"{x['full_bytes']:,} B", f"{x['keyframe_bytes']:,} B",
                      f"{x['delta_bytes']:,} B", f"{x['first_delta_bytes']:,} B",
                      f"{x['per_100_versions_full_mb']:.1f} MB", f"{x['per_100_versions_compact_mb']:.2f} MB",
                      f"{x['full_write_ms']:.0f} / {x['keyframe_write_ms']:.0f} / {x['delta_write_ms']:.0f}",
                      f"{x['full_read_ms']:.0f} / {x['keyframe_read_ms']:.0f} / {x['delta_read_ms']:.0f}")
        console.print(t)
    if not args.skip_push:
        for s in shapes:
            res["push"].append(asyncio.run(push(s, args.rounds, args.watchers, console)))
        t = Table(title="replan -> push at 100,000 GPUs: one GPU fails (or is repaired) until every watcher "
                        "holds the new layout")
        for col in ("job", "watchers", "changes", "p50 ms", "max ms", "loop lag max (bucket)", "stalls > 100 ms",
                    "longest stall ms", "idle loop's max lag ms", "/healthz max ms", "first layout s"):
            t.add_column(col, justify="right")
        for x in res["push"]:
            t.add_row(x["shape"], str(x["watchers"]), str(len(x["samples"])), f"{x['p50_ms']:.0f}",
                      f"{x['max_ms']:.0f}", f"<= {1e3 * x['lag_bucket_max_s']:.0f} ms", f"{x['stalls']:.0f}",
                      f"{x['stall_max_ms']:.0f}", f"{x['control_max_ms']:.0f}", f"{x['healthz_max_ms']:.0f}",
                      f"{x['first_layout_s']:.1f}")
        console.print(t)
        t = Table(title="reads and a dry run of the 100,000-GPU job (same manager, after the replans)")
        for col in ("job", "step", "s", "bytes", "loop lag max (bucket)", "stalls > 100 ms", "longest stall ms",
                    "idle loop's max lag ms", "/healthz max ms"):
            t.add_column(col, justify="right")
        for x in res["push"]:
            for st in x["steps"]:
                t.add_row(x["shape"], st["step"], f"{st['s']:.2f}", f"{st['bytes']:,}",
                          f"<= {1e3 * st['lag_bucket_s']:.0f} ms",
                          f"{st['stalls']:.0f}", f"{max(st['stall_ms'], default=0):.0f}", f"{st['control_ms']:.0f}",
                          f"{st['healthz_max_ms']:.0f}")
        console.print(t)
    console.print(machine_line())
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
