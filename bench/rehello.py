"""The manager's CPU per re-hello: what a new leader pays for each agent that comes back to it.

After a failover every agent of the fleet says hello again at once, with the inventory the store
already holds; the agent whose report carries the failure waits its turn among them (bench/ha.py).
This benchmark isolates that storm on one manager: N simulated agents (4 GPUs each, 2 nodes per
NVL8 domain, as in bench/ha.py) register, then, round after round, every stream is closed and all N
agents reconnect at once. One of them (the "victim", a different one each round) carries a buffered
failure report, as in the failover bench: it is re-sent once the agent is welcomed.

Figures per round: the manager's CPU seconds for the storm (from /proc, user + system, minus its idle
rate measured just before), per re-hello; the wall time until every agent is welcomed; when the
victim was welcomed and when its report was acknowledged (from the start of the storm). The clients
run in this process, on the same cores: say the load average next to every figure.

`--profile FILE` runs the manager under cProfile, enabled only during the storms (SIGUSR1 starts it,
SIGUSR2 stops it and writes FILE), to see where a re-hello's CPU goes (cProfile inflates Python
calls: use the CPU figures of a run without it).

Usage: python bench/rehello.py [--agents 1000] [--rounds 5] [--watchers 0] [--sqlite]
                               [--postgres postgresql+asyncpg://postgres@127.0.0.1:5432/test]
                               [--profile out.prof] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import cpu_seconds, drop_postgres, fresh_postgres, machine_line, show, until_none
from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc

FAILED = common_pb2.GPU_STATE_FAILED


class _Stream:
    """A client call run as a task: `start` (again after `stop`) and `stop` (cancels it)."""

    task: asyncio.Task[None] | None = None
    answered: asyncio.Event  # cleared at each start; set by `run` (an agent welcomed, a watcher's first layout)

    def start(self) -> None:
        self.answered.clear()
        self.task = asyncio.create_task(self.run())

    async def run(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await self.task
            self.task = None


class Agent(_Stream):
    """An agent reduced to its protocol: hello (with its next seq), welcome (drop what was applied,
    renumber and re-send the rest), cumulative acks."""

    def __init__(self, i: int, channel: grpc.aio.Channel, token: str) -> None:
        self.i = i
        self.stub = agent_pb2_grpc.AgentServiceStub(channel)  # type: ignore[no-untyped-call]
        self.md = (("authorization", f"Bearer {token}"),)
        self.node, self.domain = f"rh-{i:05d}", f"rh-nvl-{i // 2:04d}"
        self.uuids = [f"GPU-{self.node}-{k}" for k in range(4)]
        self.pending: list[tuple[int, int, str]] = []  # (seq, state, reason) of uuids[0]
        self.next_seq = 1
        self.acked = 0
        self.answered = asyncio.Event()
        self.welcomed_at = 0.0
        self.acked_at = 0.0
        self.task: asyncio.Task[None] | None = None

    def report(self, state: int, reason: str) -> None:
        self.pending.append((self.next_seq, state, reason))
        self.next_seq += 1

    def _msg(self, p: tuple[int, int, str]) -> agent_pb2.AgentMessage:
        return agent_pb2.AgentMessage(report=agent_pb2.HealthReport(
            seq=p[0], gpus=[agent_pb2.GpuHealth(uuid=self.uuids[0], state=p[1], reasons=[p[2]])]))  # type: ignore[arg-type]


    async def run(self) -> None:
        q: asyncio.Queue[Any] = asyncio.Queue()
        q.put_nowait(agent_pb2.AgentMessage(hello=agent_pb2.Hello(
            node=self.node, domain=self.domain, boot_id="b", agent_version="bench", next_seq=self.next_seq,
            gpus=[common_pb2.GpuInfo(uuid=u, index=k, power=common_pb2.PowerConstraints(
                min_mw=200_000, max_mw=1_300_000, default_mw=1_000_000)) for k, u in enumerate(self.uuids)])))

        async for msg in self.stub.Connect(until_none(q), metadata=self.md):
            kind = msg.WhichOneof("body")
            if kind == "welcome":
                last = msg.welcome.last_applied_seq
                self.acked = max(self.acked, last)
                self.pending = [(last + 1 + k, s, r) for k, (_, s, r) in enumerate(p for p in self.pending
                                                                                    if p[0] > last)]
                self.next_seq = last + 1 + len(self.pending)
                for p in self.pending:
                    q.put_nowait(self._msg(p))
                self.welcomed_at = time.perf_counter()
                self.answered.set()
            elif kind == "ack":
                self.acked = max(self.acked, msg.ack.seq)
                self.pending = [p for p in self.pending if p[0] > msg.ack.seq]
                if not self.pending:
                    self.acked_at = time.perf_counter()


class Watcher(_Stream):
    """A worker's layout watch, reduced: the versions seen, with their arrival times."""

    def __init__(self, i: int, channel: grpc.aio.Channel, token: str, gpu: str) -> None:
        self.i, self.gpu = i, gpu
        self.stub = worker_pb2_grpc.WorkerServiceStub(channel)  # type: ignore[no-untyped-call]
        self.md = (("authorization", f"Bearer {token}"),)
        self.seen: dict[int, float] = {}
        self.answered = asyncio.Event()
        self.task: asyncio.Task[None] | None = None


    async def run(self) -> None:
        call = self.stub.WatchLayout(worker_pb2.WatchLayoutRequest(job="rh", worker_id=f"w{self.i}", gpu_uuid=self.gpu),
                                     metadata=self.md)
        async for msg in call:
            self.seen.setdefault(msg.stamp.version, time.perf_counter())
            self.answered.set()


def serve_profiled(out: str) -> None:
    """`ntp-manager serve` under a cProfile that SIGUSR1 enables and SIGUSR2 disables (writing `out`)."""
    import cProfile

    from ntp_manager.server import run_service
    from ntp_manager.settings import Settings

    prof = cProfile.Profile()
    signal.signal(signal.SIGUSR1, lambda *_: prof.enable())

    def dump(*_: Any) -> None:
        prof.disable()
        prof.dump_stats(out)

    signal.signal(signal.SIGUSR2, dump)
    sys.exit(asyncio.run(run_service(Settings())))


def start_manager(url: str, log: Path, profile: str | None) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    env = dict(os.environ, NTP_DATABASE_URL=url, NTP_DATA_DIR=str(log.parent), NTP_LOG_FORMAT="json",
               NTP_SUSPECT_AFTER_S="600", NTP_FAIL_AFTER_S="1200", NTP_BREAKER_MIN_GPUS="100000",
               NTP_HTTP_PORT="0", NTP_GRPC_PORT="0")
    cmd = ([sys.executable, __file__, "--serve-profiled", profile] if profile
           else [sys.executable, "-m", "ntp_manager.cli", "serve", "--http-port", "0", "--grpc-port", "0"])
    err = log.open("w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("NTP-MANAGER READY"):
            return proc, json.loads(line.split(" ", 2)[2])
    raise RuntimeError(f"manager did not start: {log.read_text()[-2000:]}")


async def commits(http: str) -> tuple[float, float]:
    """The manager's group commits so far and the items they carried (its /metrics)."""
    async with httpx.AsyncClient(timeout=30) as c:
        text = (await c.get(f"http://{http}/metrics")).text
    got = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
           if line.startswith(("ntp_group_commits_total ", "ntp_group_commit_items_total "))}
    return got.get("ntp_group_commits_total", 0.0), got.get("ntp_group_commit_items_total", 0.0)


async def idle_rate(pid: int, seconds: float = 1.0) -> float:
    c0, t0 = cpu_seconds(pid), time.perf_counter()
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.perf_counter() - t0)


async def main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    from ntp_manager.service.manager import Manager
    from ntp_manager.settings import Settings
    from ntp_manager.store import db

    tmp = Path(tempfile.mkdtemp(prefix="ntp-rehello-"))
    url = f"sqlite+aiosqlite:///{tmp}/ntp.db" if args.sqlite else await fresh_postgres(args.postgres, "ntp_rh")
    n = args.agents
    proc = None
    try:
        m = Manager(Settings(database_url=url, data_dir=tmp))
        await db.upgrade(m.engine)
        tokens = await m.token_service.create_agents([f"rh-{i:05d}" for i in range(n)], "bench")
        op, wtok = await m.create_token("bench-op", "operator"), await m.create_token("bench-w", "worker")
        await m.engine.dispose()
        proc, info = start_manager(url, tmp / "manager.log", args.profile)
        opts = [("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.aio.insecure_channel(info["grpc"], options=opts) for _ in range(10)]
        agents = [Agent(i, channels[i % 10], tokens[f"rh-{i:05d}"]) for i in range(n)]
        t0 = time.perf_counter()
        for a in agents:
            a.start()
        await asyncio.gather(*(a.answered.wait() for a in agents))
        console.print(f"{n} agents registered in {time.perf_counter() - t0:.1f} s")
        watchers: list[Watcher] = []
        if args.watchers:
            async with httpx.AsyncClient(base_url=f"http://{info['http']}", timeout=60,
                                         headers={"Authorization": f"Bearer {op}"}) as h:
                r = await h.post("/v1/jobs", json={"name": "rh", "tp": 8, "replicas": n // 2, "local_batch": 8,
                                                   "min_tp": 4, "heads": 32, "mlp_columns": 128})
                r.raise_for_status()
            watchers = [Watcher(i, channels[i % 10], wtok, agents[i % n].uuids[1]) for i in range(args.watchers)]
            for w in watchers:
                w.start()
            await asyncio.gather(*(w.answered.wait() for w in watchers))
            console.print(f"{args.watchers} watchers hold the layout")
        rounds = []
        for rnd in range(args.rounds):
            for a in agents:
                await a.stop()
            for w in watchers:
                await w.stop()
            await asyncio.sleep(1.0)  # the manager closes the sessions (and logs it)
            newest = max((v for w in watchers for v in w.seen), default=0)
            idle = await idle_rate(proc.pid)
            b0, i0 = await commits(info["http"])
            victim = agents[(rnd * 397 + 11) % n]
            victim.report(FAILED, f"bench round {rnd}")  # a new victim each round: the layout changes
            want = victim.next_seq - 1
            load = os.getloadavg()[0]
            if args.profile:
                proc.send_signal(signal.SIGUSR1)
            c0, cl0, t0 = cpu_seconds(proc.pid), time.process_time(), time.perf_counter()
            for k in range(max(n, len(watchers))):  # agents and watchers come back interleaved
                if k < n:
                    agents[k].start()
                if k < len(watchers):
                    watchers[k].start()
            await asyncio.gather(*(a.answered.wait() for a in agents))
            t_all = time.perf_counter()
            while victim.acked < want:
                await asyncio.sleep(0.002)
            first_layout = None
            if watchers:  # the victim's report changes the layout: the first watcher to hold it
                end = time.perf_counter() + 60
                while first_layout is None and time.perf_counter() < end:
                    got = [t for w in watchers for v, t in w.seen.items() if v > newest]
                    first_layout = min(got) - t0 if got else None
                    await asyncio.sleep(0.005)
            await asyncio.sleep(0.3)  # what the storm left queued (log lines, commands)
            t1 = time.perf_counter()
            cpu = cpu_seconds(proc.pid) - c0 - idle * (t1 - t0)
            client = time.process_time() - cl0
            if args.profile:
                proc.send_signal(signal.SIGUSR2)
            b1, i1 = await commits(info["http"])
            rounds.append({"round": rnd, "load": load, "manager_cpu_s": cpu, "ms_per_hello": 1e3 * cpu / n,
                           "client_cpu_s": client, "all_welcomed_s": t_all - t0,
                           "victim_welcomed_s": victim.welcomed_at - t0, "victim_acked_s": victim.acked_at - t0,
                           "first_layout_s": first_layout, "victim": victim.node, "idle_cpu_rate": idle,
                           "group_commits": b1 - b0, "items_per_commit": (i1 - i0) / max(1.0, b1 - b0)})
            r0 = rounds[-1]
            console.print(f"round {rnd}: manager {r0['ms_per_hello']:.2f} ms CPU per re-hello "
                          f"({cpu:.2f} s; idle rate {idle:.3f}), client {client:.2f} s, all welcomed "
                          f"{r0['all_welcomed_s']:.2f} s, victim welcomed {r0['victim_welcomed_s']:.2f} s / acked "
                          f"{r0['victim_acked_s']:.2f} s, first new layout {first_layout or -1:.2f} s; "
                          f"{r0['group_commits']:.0f} group commits, "
                          f"{r0['items_per_commit']:.1f} items each (load {load:.1f})")
        for a in agents:
            await a.stop()
        for w in watchers:
            await w.stop()
        for c in channels:
            await c.close()
        per = [r["ms_per_hello"] for r in rounds]
        return {"agents": n, "watchers": args.watchers, "store": "sqlite" if args.sqlite else "postgresql",
                "ms_per_hello_median": statistics.median(per), "ms_per_hello_min": min(per),
                "ms_per_hello_max": max(per), "rounds_detail": rounds, "machine": machine_line()}
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()
        if not args.sqlite:
            await drop_postgres(args.postgres, url)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-profiled":
        serve_profiled(sys.argv[2])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--watchers", type=int, default=0)
    ap.add_argument("--sqlite", action="store_true")
    ap.add_argument("--postgres", default=os.environ.get("NTP_TEST_POSTGRES_URL",
                                                         "postgresql+asyncpg://postgres@127.0.0.1:5432/test"))
    ap.add_argument("--profile", help="write a cProfile of the manager during the storms to this file")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    console = Console()
    s = asyncio.run(main_async(args, console))
    show(console, f"re-hello storm: {s['agents']} agents, {s['watchers']} watchers, {s['store']}",
         ("round", "manager ms CPU / re-hello", "client CPU s", "all welcomed s", "victim welcomed s",
          "victim acked s", "first new layout s", "load avg"),
         [(str(r["round"]), f"{r['ms_per_hello']:.2f}", f"{r['client_cpu_s']:.2f}", f"{r['all_welcomed_s']:.2f}",
           f"{r['victim_welcomed_s']:.2f}", f"{r['victim_acked_s']:.2f}",
           "-" if r["first_layout_s"] is None else f"{r['first_layout_s']:.2f}", f"{r['load']:.1f}")
          for r in s["rounds_detail"]])
    console.print(f"median {s['ms_per_hello_median']:.2f} ms per re-hello (min {s['ms_per_hello_min']:.2f}, "
                  f"max {s['ms_per_hello_max']:.2f}); {s['machine']}")
    if args.json:
        args.json.write_text(json.dumps(s, indent=2))


if __name__ == "__main__":
    main()
