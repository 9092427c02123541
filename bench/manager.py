"""Manager benchmark: failure-to-push latency and health ingest, against a real `ntp-manager serve`.

1. Failure-to-push latency. 1,000 simulated agents (4 GPUs each, 2 nodes per NVL8 domain) and
   1,000 layout watchers (one per node) on loopback; a job of 500 TP8 replicas. Each round an agent
   reports a GPU failed (or repaired); the latency is from just before the report is sent to the
   moment the new layout version has arrived on *every* watcher. The client (agents + watchers)
   runs in this process, on the same 2 cores as the manager: the numbers include its share.
2. Health ingest. 12,500 nodes x 8 GPUs = 100,000 GPUs register, then every node sends one
   heartbeat per second (the agent's steady state; changes travel as reports). We count what the
   manager processed (its own Prometheus counter) and its CPU time.
3. The event loop under the largest accepted inputs, on that 100,000-GPU cluster: the largest
   hello (128 GPUs), the largest job (every GPU), a dry run of the widest spec (one replica per
   GPU), the layout and dashboard reads. A thread polls /healthz every 20 ms; the manager's own
   watchdog (ntp_event_loop_lag_seconds, ntp_event_loop_stalls_total) says how long the loop was
   held, and its warnings (with the stack that held the loop) are collected from its log.

4. Token changes made outside the server (`ntp-manager token create/revoke` against its database)
   under a running manager: from the change's commit (its audit record's time) to the first
   request the manager answers accordingly.

5. Group commit (issue 19), with `--group-commit` (SQLite, and PostgreSQL with `--postgres URL`):
   a. state-changing reports: 500 agents x 8 GPUs each send 40 reports without waiting for acks
      (each flips a GPU between failed and healthy); reports per second from the first sent to
      the last acknowledged, then the store's event count is checked against what was acked.
   b. registration: 12,500 nodes x 8 GPUs say hello, 2,500 at a time.
   c. mass failure: 1,000 nodes x 8 GPUs (NVL16 domains of 2 nodes), a job of 1,000 TP8 replicas,
      1,000 layout watchers (one per node); 125 nodes report all 8 GPUs failed at once (1,000 GPUs);
      from the first report sent until every watcher holds the layout without those 125 replicas.
      Repaired between rounds (not timed).

Each agent has its own token, bound to its node (`ntp-manager token create --nodes-from`).

Usage: python bench/manager.py [--rounds 30] [--ingest-seconds 20] [--skip-ingest]
       python bench/manager.py --group-commit [--postgres postgresql+asyncpg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    HealthzProbe,
    cpu_seconds,
    create_tokens,
    drop_postgres,
    fresh_postgres,
    lag_buckets,
    machine_line,
    serve,
    until_none,
    worst_bucket,
)
from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc

BIG_NODE = "big-node"
MAX_GPUS = 100_000 + 128  # the ingest cluster plus one largest hello


def start_manager(data: Path, nodes: list[str], db_url: str | None = None
                  ) -> tuple[subprocess.Popen[str], dict[str, Any], dict[str, str]]:
    base_env = dict(os.environ, **({"NTP_DATABASE_URL": db_url} if db_url else {}))
    tokens = create_tokens(data, nodes, base_env)
    env = dict(base_env, NTP_SUSPECT_AFTER_S="600", NTP_FAIL_AFTER_S="1200", NTP_BREAKER_MIN_GPUS="100000",
               NTP_MAX_CLUSTER_GPUS=str(MAX_GPUS), NTP_LOG_FORMAT="json")
    prof = ["-m", "cProfile", "-o", os.environ["BENCH_PROFILE"]] if os.environ.get("BENCH_PROFILE") else []
    proc, info = serve(data, env, prof)
    return proc, info, tokens


class Agent:
    def __init__(self, channel: grpc.aio.Channel, token: str, node: str, domain: str, gpus: int) -> None:
        self.stub = agent_pb2_grpc.AgentServiceStub(channel)
        self.md = (("authorization", f"Bearer {token}"),)
        self.node, self.domain = node, domain
        self.uuids = [f"GPU-{node}-{i}" for i in range(gpus)]
        self.q: asyncio.Queue[Any] = asyncio.Queue()
        self.welcome = asyncio.Event()
        self.acked = 0  # the highest seq acknowledged
        self.acks = 0  # ack messages received (one acknowledges every report up to its seq)
        self.seq = 0

    async def run(self) -> None:
        hello = agent_pb2.AgentMessage(hello=agent_pb2.Hello(
            node=self.node, domain=self.domain, boot_id="b",
            gpus=[common_pb2.GpuInfo(uuid=u, index=i, power=common_pb2.PowerConstraints(
                min_mw=200_000, max_mw=1_300_000, default_mw=1_000_000)) for i, u in enumerate(self.uuids)]))
        await self.q.put(hello)

        async for msg in self.stub.Connect(until_none(self.q), metadata=self.md):
            kind = msg.WhichOneof("body")
            if kind == "welcome":
                self.seq = msg.welcome.last_applied_seq
                self.welcome.set()
            elif kind == "ack":
                self.acked = msg.ack.seq
                self.acks += 1

    def report(self, uuid: str, state: common_pb2.GpuState) -> None:
        self.report_many([uuid], state)

    def report_many(self, uuids: list[str], state: common_pb2.GpuState) -> None:
        self.seq += 1
        self.q.put_nowait(agent_pb2.AgentMessage(report=agent_pb2.HealthReport(
            seq=self.seq, gpus=[agent_pb2.GpuHealth(uuid=u, state=state, reasons=["bench"]) for u in uuids])))

    def heartbeat(self) -> None:
        self.q.put_nowait(agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat(last_seq=self.seq)))


async def latency(info: dict[str, Any], tokens: dict[str, str], rounds: int, console: Console) -> dict[str, Any]:
    n_agents = 1000
    channels = [grpc.aio.insecure_channel(info["grpc"], options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(20)]
    agents = [Agent(channels[i % 20], tokens[f"node-{i:04d}"], f"node-{i:04d}", f"nvl-{i // 2:03d}", 4)
              for i in range(n_agents)]
    tasks = [asyncio.create_task(a.run()) for a in agents]
    t0 = time.perf_counter()
    for a in agents:
        await asyncio.wait_for(a.welcome.wait(), 120)
    reg_s = time.perf_counter() - t0
    async with httpx.AsyncClient(base_url=f"http://{info['http']}",
                                 headers={"Authorization": f"Bearer {tokens['operator']}"}, timeout=60) as c:
        r = await c.post("/v1/jobs", json={"name": "bench", "tp": 8, "replicas": 500, "local_batch": 8,
                                           "min_tp": 4, "heads": 32, "mlp_columns": 1024})
        r.raise_for_status()

    latest: dict[int, int] = {}
    arrived: dict[int, list[float]] = {}
    wmd = (("authorization", f"Bearer {tokens['worker']}"),)

    async def watch(i: int) -> None:
        stub = worker_pb2_grpc.WorkerServiceStub(channels[i % 20])
        req = worker_pb2.WatchLayoutRequest(job="bench", worker_id=f"w{i}", gpu_uuid=agents[i].uuids[0])
        async for msg in stub.WatchLayout(req, metadata=wmd):
            latest[i] = msg.stamp.version
            arrived.setdefault(msg.stamp.version, []).append(time.perf_counter())

    watchers = [asyncio.create_task(watch(i)) for i in range(n_agents)]
    while len(latest) < n_agents or min(latest.values()) < 1:
        await asyncio.sleep(0.05)
    samples = []
    version = max(latest.values())
    for k in range(rounds):
        a = agents[(k * 37) % n_agents]
        state = common_pb2.GPU_STATE_FAILED
        t_send = time.perf_counter()
        a.report(a.uuids[1], state)
        version += 1
        while len(arrived.get(version, ())) < n_agents:
            await asyncio.sleep(0.001)
        samples.append(max(arrived[version]) - t_send)
        # repair it again (not timed) so that the cluster stays the same size
        a.report(a.uuids[1], common_pb2.GPU_STATE_HEALTHY)
        version += 1
        while len(arrived.get(version, ())) < n_agents:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
    for t in watchers + tasks:
        t.cancel()
    for ch in channels:
        await ch.close()
    samples.sort()
    return {
        "agents": n_agents, "watchers": n_agents, "rounds": rounds, "register_s": reg_s,
        "p50_ms": 1e3 * statistics.median(samples), "p99_ms": 1e3 * samples[min(len(samples) - 1,
                                                                                 int(0.99 * len(samples)))],
        "max_ms": 1e3 * samples[-1],
    }


async def ingest(info: dict[str, Any], tokens: dict[str, str], seconds: float, pid: int) -> dict[str, Any]:
    n_nodes, per_node = 12_500, 8
    # one connection per channel (as separate agents would have), not one shared HTTP/2 connection
    channels = [grpc.aio.insecure_channel(info["grpc"], options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(50)]
    agents = [Agent(channels[i % 50], tokens[f"ing-{i:05d}"], f"ing-{i:05d}", f"ing-nvl-{i // 9:04d}", per_node)
              for i in range(n_nodes)]
    tasks = []
    t0 = time.perf_counter()
    for i in range(0, n_nodes, 500):  # register in waves
        tasks += [asyncio.create_task(a.run()) for a in agents[i : i + 500]]
        for a in agents[i : i + 500]:
            await asyncio.wait_for(a.welcome.wait(), 300)
    reg_s = time.perf_counter() - t0

    async def count() -> float:
        async with httpx.AsyncClient(timeout=30) as c:
            text = (await c.get(f"http://{info['http']}/metrics")).text
        for line in text.splitlines():
            if line.startswith("ntp_agent_heartbeats_total "):
                return float(line.split()[1])
        return 0.0

    before, cpu0, t_start = await count(), cpu_seconds(pid), time.perf_counter()
    sent = 0
    for tick in range(int(seconds)):
        t_tick = t_start + tick
        for a in agents:
            a.heartbeat()
        sent += n_nodes
        await asyncio.sleep(max(0.0, t_tick + 1 - time.perf_counter()))
    await asyncio.sleep(1.0)
    elapsed = time.perf_counter() - t_start
    after, cpu1 = await count(), cpu_seconds(pid)
    processed = after - before
    res = {
        "nodes": n_nodes, "gpus": n_nodes * per_node, "register_s": reg_s, "seconds": elapsed,
        "heartbeats_sent": sent, "heartbeats_processed": processed,
        "gpus_per_s": processed * per_node / elapsed, "manager_cpu": (cpu1 - cpu0) / elapsed,
    }
    res["loop"] = await largest_inputs(info, tokens, channels[0])
    for t in tasks:
        t.cancel()
    for ch in channels:
        await ch.close()
    return res


async def largest_inputs(info: dict[str, Any], tokens: dict[str, str], channel: grpc.aio.Channel) -> dict[str, Any]:
    """Each step's largest /healthz latency and the loop lag the watchdog measured during it."""
    base = f"http://{info['http']}"
    probe = HealthzProbe(base)
    probe.start()
    steps: list[dict[str, Any]] = []
    op = httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {tokens['operator']}"}, timeout=300)

    async def step(name: str, coro: Any) -> None:
        m0 = lag_buckets((await op.get("/metrics")).text)
        t0 = time.perf_counter()
        await coro
        t1 = time.perf_counter()
        await asyncio.sleep(0.2)
        m1 = lag_buckets((await op.get("/metrics")).text)
        worst = worst_bucket(m0, m1)
        during = probe.during(t0 - 0.05, t1 + 0.2)
        steps.append({"step": name, "seconds": t1 - t0, "healthz_max_ms": 1e3 * max(during, default=0.0),
                      "probes": len(during), "lag_max_bucket_s": worst, "stalls": m1[1] - m0[1]})

    async def hello() -> None:
        a = Agent(channel, tokens[BIG_NODE], BIG_NODE, "big-nvl", 128)
        asyncio.get_running_loop().create_task(a.run())
        await asyncio.wait_for(a.welcome.wait(), 120)

    async def job() -> None:
        (await op.post("/v1/jobs", json={"name": "all", "tp": 8, "replicas": MAX_GPUS // 8, "local_batch": 8,
                                         "heads": 64, "mlp_columns": 4096})).raise_for_status()
        while (await op.get("/v1/jobs/all")).json()["layout_version"] is None:
            await asyncio.sleep(0.1)

    async def dry_run() -> None:
        (await op.post("/v1/plans", json={"spec": {"name": "wide", "tp": 1, "replicas": MAX_GPUS, "local_batch": 1,
                                                   "heads": 1}})).raise_for_status()

    async def reads() -> None:
        for path in ("/v1/jobs/all/layout", "/v1/snapshot", "/v1/status", "/v1/gpus?limit=1000",
                     "/v1/domains?limit=1000", "/v1/jobs/all"):
            (await op.get(path)).raise_for_status()

    await step("largest hello (128 GPUs)", hello())
    await step("largest job (every GPU) planned and stored", job())
    await step("dry run, one replica per GPU", dry_run())
    await step("layout, snapshot, status, listings", reads())
    probe.stop(join_s=5)
    await op.aclose()
    return {"steps": steps, "healthz_max_ms": 1e3 * max(lat for _, lat in probe.probes), "probes": len(probe.probes)}


async def token_changes(data: Path, info: dict[str, Any], tokens: dict[str, str], rounds: int = 5) -> dict[str, Any]:
    """Seconds from a CLI token change's commit to the manager acting on it."""
    from datetime import datetime

    base = f"http://{info['http']}"
    created, revoked = [], []

    async def cli(*args: str) -> str:
        p = await asyncio.create_subprocess_exec(sys.executable, "-m", "ntp_manager.cli", "token", *args,
                                                 "--data-dir", str(data), stdout=subprocess.PIPE)
        out, _ = await p.communicate()
        return out.decode()

    async def committed(c: httpx.AsyncClient, action: str, target: str) -> float:
        r = await c.get("/v1/audit", params={"action": action, "target": target})
        return datetime.fromisoformat(r.json()["items"][0]["at"]).timestamp()

    async with httpx.AsyncClient(base_url=base, timeout=30,
                                 headers={"Authorization": f"Bearer {tokens['operator']}"}) as op:
        for _ in range(rounds):
            tok = json.loads(await cli("create", "--scope", "viewer", "--json"))["token"]
            tid = tok.split("_")[1]
            async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {tok}"}) as c:
                while (await c.get("/v1/breaker")).status_code != 200:
                    await asyncio.sleep(0.005)
                created.append(time.time() - await committed(op, "token.create", tid))
                await cli("revoke", tid)
                while (await c.get("/v1/breaker")).status_code != 401:
                    await asyncio.sleep(0.005)
                revoked.append(time.time() - await committed(op, "token.revoke", tid))
    return {"rounds": rounds, "create_max_s": max(created), "revoke_max_s": max(revoked),
            "create_median_s": statistics.median(created), "revoke_median_s": statistics.median(revoked)}


def channels_for(info: dict[str, Any], n: int) -> list[grpc.aio.Channel]:
    # one connection per channel (as separate agents would have), not one shared HTTP/2 connection
    return [grpc.aio.insecure_channel(info["grpc"], options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(n)]


class AgentEnded(RuntimeError):
    """An agent's stream ended while the benchmark needed it (the manager refused or closed it)."""


async def register_all(agents: list[Agent], wave: int, timeout_s: float = 300.0
                       ) -> tuple[float, list[asyncio.Task[None]]]:
    """Start the agents `wave` at a time; each wave until every agent of it is welcomed. An agent
    whose stream ends (an error from the manager, a dropped connection) stops the benchmark at once
    with that error (`ended` raises it later too), and so does a wave not welcomed in `timeout_s`."""
    loop = asyncio.get_running_loop()
    failed: asyncio.Future[None] = loop.create_future()

    def on_end(a: Agent, t: asyncio.Task[None]) -> None:
        if t.cancelled() or failed.done():
            return
        err = t.exception()
        failed.set_exception(AgentEnded(f"agent {a.node}'s stream ended "
                                        f"({'after' if a.welcome.is_set() else 'before'} its welcome): {err!r}"))

    tasks: list[asyncio.Task[None]] = []
    t0 = time.perf_counter()
    try:
        for i in range(0, len(agents), wave):
            group = agents[i : i + wave]
            for a in group:
                t = asyncio.create_task(a.run())
                t.add_done_callback(functools.partial(on_end, a))
                tasks.append(t)
            welcomed: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*(a.welcome.wait() for a in group)))
            either: list[asyncio.Future[Any]] = [welcomed, failed]
            done, _ = await asyncio.wait(either, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if failed in done:
                welcomed.cancel()
                failed.result()
            if welcomed not in done:
                welcomed.cancel()
                raise RuntimeError(f"registration stalled: the wave of agents {i}..{i + len(group) - 1} not welcomed "
                                   f"in {timeout_s:g} s ({sum(a.welcome.is_set() for a in agents)} welcomed in all)")
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    ENDED.append(failed)
    return time.perf_counter() - t0, tasks


ENDED: list[asyncio.Future[None]] = []  # one per register_all: fails when an agent's stream ends


def ended() -> None:
    """Raise AgentEnded when an agent's stream has ended since its registration."""
    for f in ENDED:
        if f.done():
            f.result()


async def event_total(info: dict[str, Any], token: str) -> int:
    async with httpx.AsyncClient(base_url=f"http://{info['http']}", timeout=60,
                                 headers={"Authorization": f"Bearer {token}"}) as c:
        return int((await c.get("/v1/events", params={"limit": 1})).json()["total"])


async def report_rate(info: dict[str, Any], tokens: dict[str, str], pid: int, n_nodes: int = 500,
                      per_node: int = 40) -> dict[str, Any]:
    """State-changing reports, pipelined by every agent, acknowledged only once durable."""
    channels = channels_for(info, 20)
    agents = [Agent(channels[i % 20], tokens[f"rep-{i:04d}"], f"rep-{i:04d}", f"rep-nvl-{i // 2:03d}", 8)
              for i in range(n_nodes)]
    _, tasks = await register_all(agents, 500)
    before = await event_total(info, tokens["operator"])
    cpu0, client0 = cpu_seconds(pid), time.process_time()
    t0 = time.perf_counter()
    for k in range(per_node):  # report k flips GPU k % 8: failed on even rounds, healthy on odd ones
        state = common_pb2.GPU_STATE_FAILED if (k // 8) % 2 == 0 else common_pb2.GPU_STATE_HEALTHY
        for a in agents:
            a.report(a.uuids[k % 8], state)
    want = per_node
    while any(a.acked < want for a in agents):
        ended()
        await asyncio.sleep(0.002)
    elapsed = time.perf_counter() - t0
    cpu, client = cpu_seconds(pid) - cpu0, time.process_time() - client0
    stored = await event_total(info, tokens["operator"]) - before
    for t in tasks:
        t.cancel()
    for ch in channels:
        await ch.close()
    total = n_nodes * per_node
    return {"agents": n_nodes, "reports": total, "acks": sum(a.acks for a in agents), "seconds": elapsed,
            "per_s": total / elapsed,
            "stored_events": stored, "manager_cpu_s": cpu, "per_manager_cpu_s": total / cpu, "client_cpu_s": client}


async def registration(info: dict[str, Any], tokens: dict[str, str], pid: int, n_nodes: int = 12_500) -> dict[str, Any]:
    # gRPC runs at most 100 streams at once on one connection (the client keeps the rest waiting):
    # 50 agents per connection, as if many hosts sat behind one load balancer address
    n_ch = -(-n_nodes // 50)
    channels = channels_for(info, n_ch)
    agents = [Agent(channels[i % n_ch], tokens[f"ing-{i:05d}"], f"ing-{i:05d}", f"ing-nvl-{i // 9:04d}", 8)
              for i in range(n_nodes)]
    cpu0, client0 = cpu_seconds(pid), time.process_time()
    reg_s, tasks = await register_all(agents, 2500)
    cpu, client = cpu_seconds(pid) - cpu0, time.process_time() - client0
    for t in tasks:
        t.cancel()
    for ch in channels:
        await ch.close()
    return {"nodes": n_nodes, "gpus": 8 * n_nodes, "seconds": reg_s, "manager_cpu_s": cpu,
            "manager_cpu_ms_per_node": 1e3 * cpu / n_nodes, "client_cpu_s": client}


async def mass_failure(info: dict[str, Any], tokens: dict[str, str], rounds: int, pid: int) -> dict[str, Any]:
    """125 nodes x 8 GPUs fail at once; until every one of 1,000 watchers holds the new layout, and
    until the first one does (the rest is the fan-out to 1,000 streams)."""
    n_nodes, hit = 1000, 125
    channels = channels_for(info, 40)
    agents = [Agent(channels[i % 40], tokens[f"node-{i:04d}"], f"node-{i:04d}", f"nvl-{i // 2:03d}", 8)
              for i in range(n_nodes)]
    reg_s, tasks = await register_all(agents, 500)
    async with httpx.AsyncClient(base_url=f"http://{info['http']}",
                                 headers={"Authorization": f"Bearer {tokens['operator']}"}, timeout=60) as c:
        (await c.post("/v1/jobs", json={"name": "mass", "tp": 8, "replicas": n_nodes, "local_batch": 8,
                                        "min_tp": 4, "heads": 32, "mlp_columns": 1024})).raise_for_status()
    replicas: dict[int, int] = {}  # watcher -> replicas in the newest layout it holds
    wmd = (("authorization", f"Bearer {tokens['worker']}"),)

    target = [n_nodes - hit, 0.0]  # replicas of the layout a round waits for; when a watcher first held it

    async def watch(i: int) -> None:
        stub = worker_pb2_grpc.WorkerServiceStub(channels[i % 40])
        req = worker_pb2.WatchLayoutRequest(job="mass", worker_id=f"w{i}", gpu_uuid=agents[i].uuids[0])
        async for msg in stub.WatchLayout(req, metadata=wmd):
            replicas[i] = len(msg.replicas) + sum(r.count for r in msg.replica_runs)  # runs: common.proto
            if replicas[i] == target[0] and not target[1]:
                target[1] = time.perf_counter()

    stopped: list[asyncio.Task[None]] = []  # watches that ended (the manager closed or refused them)

    async def all_hold(n: int) -> float:
        while len(replicas) < n_nodes or any(v != n for v in replicas.values()):
            ended()
            if stopped:
                err = stopped[0].exception() if not stopped[0].cancelled() else None
                raise RuntimeError(f"{len(stopped)} layout watches ended: {err!r}")
            await asyncio.sleep(0.001)
        return time.perf_counter()

    watchers = [asyncio.create_task(watch(i)) for i in range(n_nodes)]
    for w in watchers:
        w.add_done_callback(lambda t: None if t.cancelled() else stopped.append(t))
    await all_hold(n_nodes)
    samples, first_ms = [], []
    cpu0, client0, t0 = cpu_seconds(pid), time.process_time(), time.perf_counter()
    for k in range(rounds):
        first = (k * 250) % n_nodes  # 125 consecutive nodes: 62.5 NVL16 domains, a rack's worth
        group = agents[first : first + hit]
        target[1] = 0.0
        t_send = time.perf_counter()
        for a in group:
            a.report_many(a.uuids, common_pb2.GPU_STATE_FAILED)
        samples.append(await all_hold(n_nodes - hit) - t_send)
        first_ms.append(1e3 * (target[1] - t_send))
        for a in group:  # repaired (not timed)
            a.report_many(a.uuids, common_pb2.GPU_STATE_HEALTHY)
        await all_hold(n_nodes)
        await asyncio.sleep(0.2)
    busy = time.perf_counter() - t0
    cpu, client = cpu_seconds(pid) - cpu0, time.process_time() - client0
    for t in watchers + tasks:
        t.cancel()
    for ch in channels:
        await ch.close()
    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    samples.sort()
    return {"nodes": n_nodes, "failed_gpus": 8 * hit, "watchers": n_nodes, "rounds": rounds, "register_s": reg_s,
            "p50_ms": 1e3 * statistics.median(samples),
            "p99_ms": 1e3 * samples[min(len(samples) - 1, int(0.99 * len(samples)))], "max_ms": 1e3 * samples[-1],
            "first_watcher_p50_ms": pct(first_ms, 0.5), "first_watcher_p99_ms": pct(first_ms, 0.99),
            "manager_cpu_share": cpu / busy, "client_cpu_share": client / busy}


async def group_commit(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    out: dict[str, Any] = {}
    stores = [("sqlite", None)] + ([("postgres", args.postgres)] if args.postgres else [])
    for store, admin in stores:
        res: dict[str, Any] = {}
        for part in ("reports", "registration", "mass_failure"):
            if part in args.skip_part:
                continue
            db_url = await fresh_postgres(admin) if admin else None
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    nodes = {"reports": [f"rep-{i:04d}" for i in range(500)],
                             "registration": [f"ing-{i:05d}" for i in range(12_500)],
                             "mass_failure": [f"node-{i:04d}" for i in range(1000)]}[part]
                    proc, info, tokens = start_manager(Path(tmp), nodes, db_url)
                    try:
                        with console.status(f"{store}: {part}"):
                            if part == "reports":
                                res[part] = await report_rate(info, tokens, proc.pid)
                            elif part == "registration":
                                res[part] = await registration(info, tokens, proc.pid)
                            else:
                                res[part] = await mass_failure(info, tokens, args.rounds, proc.pid)
                        console.print(f"{store} {part}: {json.dumps(res[part])}")
                    finally:
                        proc.send_signal(signal.SIGTERM)
                        proc.wait(120)
            finally:
                if admin and db_url:
                    await drop_postgres(admin, db_url)
        out[store] = res
    return out


def stall_sites(log: Path, top: int = 5) -> list[tuple[int, str]]:
    """Where the watchdog caught the loop held (its in-stall warnings), most frequent first."""
    sites: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"garbage collection paused every thread"' in line:
            key = "a full garbage collection (generation 2)"
        elif '"event loop is blocked"' in line:
            where = json.loads(line).get("where", "")
            files = [f.strip() for f in where.splitlines() if f.strip().startswith("File")]
            ours = [f for f in files if "/ntp_manager/" in f]
            key = (ours[-1] if ours else "?") + (f" -> {files[-1]}" if files and files[-1] not in ours else "")
        else:
            continue
        sites[key] = sites.get(key, 0) + 1
    return sorted(((n, k) for k, n in sites.items()), reverse=True)[:top]


async def main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.group_commit:
        return {"group_commit": await group_commit(args, console)}
    if args.skip_latency:
        return await ingest_only(args, console, out)
    with tempfile.TemporaryDirectory() as tmp:
        proc, info, tokens = start_manager(Path(tmp), [f"node-{i:04d}" for i in range(1000)])
        try:
            cpu0 = cpu_seconds(proc.pid)
            t0 = time.perf_counter()
            with console.status("failure-to-push latency: 1,000 agents, 1,000 watchers"):
                out["latency"] = await latency(info, tokens, args.rounds, console)
            out["latency"]["manager_cpu"] = (cpu_seconds(proc.pid) - cpu0) / (time.perf_counter() - t0)
            console.print(f"latency: {json.dumps(out['latency'])}")
            out["tokens"] = await token_changes(Path(tmp), info, tokens)
            console.print(f"token changes: {json.dumps(out['tokens'])}")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return await ingest_only(args, console, out) if not args.skip_ingest else out


async def ingest_only(args: argparse.Namespace, console: Console, out: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        proc, info, tokens = start_manager(Path(tmp), [f"ing-{i:05d}" for i in range(12_500)] + [BIG_NODE])
        try:
            with console.status("health ingest: 100,000 GPUs, then the largest inputs"):
                out["ingest"] = await ingest(info, tokens, args.ingest_seconds, proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            out["stall_sites"] = stall_sites(Path(tmp) / "manager.log")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--ingest-seconds", type=float, default=20)
    ap.add_argument("--skip-ingest", action="store_true")
    ap.add_argument("--skip-latency", action="store_true", help="only the ingest and event-loop parts")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--group-commit", action="store_true", help="only the group-commit figures (issue 19)")
    ap.add_argument("--postgres", help="also on PostgreSQL: an admin URL (a fresh database is made beside it)")
    ap.add_argument("--skip-part", action="append", default=[], choices=["reports", "registration", "mass_failure"])
    args, _ = ap.parse_known_args()
    console = Console(width=120)
    res = asyncio.run(main_async(args, console))
    if "tokens" in res:
        tk = res["tokens"]
        console.print(f"token changes by the CLI under a running manager ({tk['rounds']} rounds): created usable "
                      f"after {tk['create_median_s']:.2f} s median / {tk['create_max_s']:.2f} s max, revoked refused "
                      f"after {tk['revoke_median_s']:.2f} s / {tk['revoke_max_s']:.2f} s (goal: within 1 s)")
    if "latency" in res:
        lat = res["latency"]
        t = Table(title="failure-to-push latency (report sent -> new layout on every watcher)")
        for col in ("agents", "watchers", "rounds", "p50 ms", "p99 ms", "max ms", "manager CPU", "goal p99"):
            t.add_column(col, justify="right")
        t.add_row(str(lat["agents"]), str(lat["watchers"]), str(lat["rounds"]), f"{lat['p50_ms']:.1f}",
                  f"{lat['p99_ms']:.1f}", f"{lat['max_ms']:.1f}", f"{100 * lat['manager_cpu']:.0f}%", "250 ms")
        console.print(t)
    if "ingest" in res:
        ing = res["ingest"]
        t2 = Table(title="health ingest (heartbeats, one per node per second)")
        for col in ("nodes", "GPUs", "register s", "sent", "processed", "GPUs/s", "manager CPU", "goal"):
            t2.add_column(col, justify="right")
        t2.add_row(f"{ing['nodes']:,}", f"{ing['gpus']:,}", f"{ing['register_s']:.1f}", f"{ing['heartbeats_sent']:,}",
                   f"{ing['heartbeats_processed']:,.0f}", f"{ing['gpus_per_s']:,.0f}",
                   f"{100 * ing['manager_cpu']:.0f}%", "100,000 GPUs/s")
        console.print(t2)
        loop = ing["loop"]
        t3 = Table(title=f"event loop at {MAX_GPUS:,} GPUs: /healthz polled every 20 ms "
                         f"({loop['probes']} probes, max {loop['healthz_max_ms']:.0f} ms)")
        for col in ("step", "s", "healthz max ms", "loop lag max (bucket)", "stalls > 100 ms"):
            t3.add_column(col, justify="right")
        for st in loop["steps"]:
            t3.add_row(st["step"], f"{st['seconds']:.2f}", f"{st['healthz_max_ms']:.0f}",
                       f"<= {1000 * st['lag_max_bucket_s']:.0f} ms", f"{st['stalls']:.0f}")
        console.print(t3)
        for n, where in res.get("stall_sites", []):
            console.print(f"held the loop {n}x: {where}", highlight=False)
    for store, gc_res in res.get("group_commit", {}).items():
        t4 = Table(title=f"group commit on {store}")
        for col in ("figure", "measured", "goal"):
            t4.add_column(col, justify="right")
        if "reports" in gc_res:
            r = gc_res["reports"]
            t4.add_row(f"state-changing reports ({r['reports']:,} from {r['agents']} agents; {r['stored_events']:,} "
                       "stored)", f"{r['per_s']:,.0f} /s", ">= 5,000 /s")
            t4.add_row("  per second of manager CPU", f"{r['per_manager_cpu_s']:,.0f} /s", "")
        if "registration" in gc_res:
            r = gc_res["registration"]
            t4.add_row(f"registration of {r['nodes']:,} nodes ({r['gpus']:,} GPUs)", f"{r['seconds']:.1f} s", "<= 10 s")
            if "manager_cpu_s" in r:
                cpus = f"{r['manager_cpu_s']:.1f} s / {r['client_cpu_s']:.1f} s"
                t4.add_row("  manager CPU / bench client CPU", cpus, "")
        if "mass_failure" in gc_res:
            r = gc_res["mass_failure"]
            t4.add_row(f"{r['failed_gpus']:,} GPUs fail -> layout on {r['watchers']:,} watchers ({r['rounds']} rounds)",
                       f"p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms", "p99 <= 1,000 ms")
            if "first_watcher_p50_ms" in r:
                t4.add_row("  of which: on the first watcher",
                           f"p50 {r['first_watcher_p50_ms']:.0f} ms, p99 {r['first_watcher_p99_ms']:.0f} ms", "")
        console.print(t4)
    console.print(machine_line())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
