"""Manager benchmark: failure-to-push latency and health ingest, against a real `ntp-manager serve`.

1. Failure-to-push latency. 1,000 simulated agents (4 GPUs each, 2 nodes per NVL8 domain) and
   1,000 layout watchers (one per node) on loopback; a job of 500 TP8 replicas. Each round an agent
   reports a GPU failed (or repaired); the latency is from just before the report is sent to the
   moment the new layout version has arrived on *every* watcher. The client (agents + watchers)
   runs in this process, on the same 2 cores as the manager: the numbers include its share.
2. Health ingest. 12,500 nodes x 8 GPUs = 100,000 GPUs register, then every node sends one
   heartbeat per second (the agent's steady state; changes travel as reports). We count what the
   manager processed (its own Prometheus counter) and its CPU time.

Usage: python bench/manager.py [--rounds 30] [--ingest-seconds 20] [--skip-ingest]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
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

from ntp_manager._proto.ntp.v1 import agent_pb2, agent_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc

CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def start_manager(data: Path) -> tuple[subprocess.Popen[str], dict[str, Any], dict[str, str]]:
    tokens = {}
    for scope in ("operator", "agent", "worker"):
        out = subprocess.run(
            [sys.executable, "-m", "ntp_manager.cli", "token", "create", "--scope", scope, "--json",
             "--data-dir", str(data)], capture_output=True, text=True, check=True).stdout
        tokens[scope] = json.loads(out)["token"]
    env = dict(os.environ, NTP_SUSPECT_AFTER_S="600", NTP_FAIL_AFTER_S="1200", NTP_BREAKER_MIN_GPUS="100000")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ntp_manager.cli", "serve", "--data-dir", str(data), "--http-port", "0",
         "--grpc-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("NTP-MANAGER READY"):
            return proc, json.loads(line.split(" ", 2)[2]), tokens
    raise RuntimeError("manager did not start")


class Agent:
    def __init__(self, channel: grpc.aio.Channel, token: str, node: str, domain: str, gpus: int) -> None:
        self.stub = agent_pb2_grpc.AgentServiceStub(channel)
        self.md = (("authorization", f"Bearer {token}"),)
        self.node, self.domain = node, domain
        self.uuids = [f"GPU-{node}-{i}" for i in range(gpus)]
        self.q: asyncio.Queue[Any] = asyncio.Queue()
        self.welcome = asyncio.Event()
        self.acked = 0
        self.seq = 0

    async def run(self) -> None:
        hello = agent_pb2.AgentMessage(hello=agent_pb2.Hello(
            node=self.node, domain=self.domain, boot_id="b",
            gpus=[common_pb2.GpuInfo(uuid=u, index=i, power=common_pb2.PowerConstraints(
                min_mw=200_000, max_mw=1_300_000, default_mw=1_000_000)) for i, u in enumerate(self.uuids)]))
        await self.q.put(hello)

        async def out():  # type: ignore[no-untyped-def]
            while True:
                m = await self.q.get()
                if m is None:
                    return
                yield m

        async for msg in self.stub.Connect(out(), metadata=self.md):
            kind = msg.WhichOneof("body")
            if kind == "welcome":
                self.seq = msg.welcome.last_applied_seq
                self.welcome.set()
            elif kind == "ack":
                self.acked = msg.ack.seq

    def report(self, uuid: str, state: int) -> None:
        self.seq += 1
        self.q.put_nowait(agent_pb2.AgentMessage(report=agent_pb2.HealthReport(
            seq=self.seq, gpus=[agent_pb2.GpuHealth(uuid=uuid, state=state, reasons=["bench"])])))

    def heartbeat(self) -> None:
        self.q.put_nowait(agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat(last_seq=self.seq)))


async def latency(info: dict[str, Any], tokens: dict[str, str], rounds: int, console: Console) -> dict[str, Any]:
    n_agents = 1000
    channels = [grpc.aio.insecure_channel(info["grpc"], options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(20)]
    agents = [Agent(channels[i % 20], tokens["agent"], f"node-{i:04d}", f"nvl-{i // 2:03d}", 4)
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
    agents = [Agent(channels[i % 50], tokens["agent"], f"ing-{i:05d}", f"ing-nvl-{i // 9:04d}", per_node)
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
    for t in tasks:
        t.cancel()
    for ch in channels:
        await ch.close()
    processed = after - before
    return {
        "nodes": n_nodes, "gpus": n_nodes * per_node, "register_s": reg_s, "seconds": elapsed,
        "heartbeats_sent": sent, "heartbeats_processed": processed,
        "gpus_per_s": processed * per_node / elapsed, "manager_cpu": (cpu1 - cpu0) / elapsed,
    }


async def main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        proc, info, tokens = start_manager(Path(tmp))
        try:
            cpu0 = cpu_seconds(proc.pid)
            t0 = time.perf_counter()
            with console.status("failure-to-push latency: 1,000 agents, 1,000 watchers"):
                out["latency"] = await latency(info, tokens, args.rounds, console)
            out["latency"]["manager_cpu"] = (cpu_seconds(proc.pid) - cpu0) / (time.perf_counter() - t0)
            console.print(f"latency: {json.dumps(out['latency'])}")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    if not args.skip_ingest:
        with tempfile.TemporaryDirectory() as tmp:
            proc, info, tokens = start_manager(Path(tmp))
            try:
                with console.status("health ingest: 100,000 GPUs"):
                    out["ingest"] = await ingest(info, tokens, args.ingest_seconds, proc.pid)
            finally:
                proc.send_signal(signal.SIGTERM)
                proc.wait(60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--ingest-seconds", type=float, default=20)
    ap.add_argument("--skip-ingest", action="store_true")
    ap.add_argument("--json", type=Path)
    args, _ = ap.parse_known_args()
    console = Console(width=120)
    res = asyncio.run(main_async(args, console))
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
    console.print(f"machine: {platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
