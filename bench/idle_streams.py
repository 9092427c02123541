"""What an idle agent stream costs a manager when every agent has a connection of its own.

bench/fleet.py's load generators share 8 HTTP/2 connections per manager per process among
thousands of simulated agents, so it counts what each stream's messages cost but hardly what each
connection's upkeep costs. A deployment has one connection per agent. Here a gRPC server with the
manager's own options (rpc/server.py `keepalive`) and a servicer that only reads holds N streams
from two client processes, one connection each, every stream sending a heartbeat every H seconds
(phases spread at random); its CPU over a window, per connection:

- before: the server pinged every 20 s, agents beat every 2 s (liveness from heartbeats),
- now: the server pings every 2 s (liveness from the stream), agents beat at the longest quiet (30 s)
  while their counters do not change,
- now, no heartbeat in the window (the floor: the pings and the clients' own keepalive).

    python bench/idle_streams.py [--connections 2000] [--window-s 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def server(period_s: float) -> None:
    from grpc import aio

    from ntp_manager.contract.proto.ntp.v1 import agent_pb2_grpc
    from ntp_manager.rpc.server import KEEPALIVE, keepalive

    class Reader(agent_pb2_grpc.AgentServiceServicer):
        async def Connect(self, it, ctx):  # type: ignore[no-untyped-def]
            async for _ in it:
                pass
            if False:
                yield

    opts = keepalive(period_s) if period_s < 20 else [("grpc.keepalive_time_ms", 20_000),
                                                     ("grpc.keepalive_timeout_ms", 10_000), *KEEPALIVE]
    s = aio.server(options=opts)
    agent_pb2_grpc.add_AgentServiceServicer_to_server(Reader(), s)  # type: ignore[no-untyped-call]
    print(s.add_insecure_port("127.0.0.1:0"), flush=True)
    await s.start()
    await asyncio.sleep(1e9)


async def clients(port: int, n: int, beat_s: float) -> None:
    from grpc import aio

    from ntp_manager.contract.client import CLIENT_KEEPALIVE
    from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc

    async def one() -> None:
        ch = aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1),
                                                                 *CLIENT_KEEPALIVE])

        async def beats():  # type: ignore[no-untyped-def]
            await asyncio.sleep(random.uniform(0, beat_s))
            while True:
                yield agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat(last_seq=0))
                await asyncio.sleep(beat_s)

        async for _ in agent_pb2_grpc.AgentServiceStub(ch).Connect(beats()):  # type: ignore[no-untyped-call]
            pass

    await asyncio.gather(*(one() for _ in range(n)))


def measure(period_s: float, beat_s: float, n: int, window_s: float) -> float:
    py = sys.executable
    srv = subprocess.Popen([py, __file__, "--serve", str(period_s)], stdout=subprocess.PIPE, text=True)
    assert srv.stdout is not None
    port = int(srv.stdout.readline())
    cl = [subprocess.Popen([py, __file__, "--clients", str(port), str(n // 2), str(beat_s)]) for _ in range(2)]
    try:
        time.sleep(max(15.0, n / 100))  # connected, and past the first beats' spread
        c0, t0 = cpu_s(srv.pid), time.perf_counter()
        time.sleep(window_s)
        return (cpu_s(srv.pid) - c0) / (time.perf_counter() - t0)
    finally:
        for p in (*cl, srv):
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connections", type=int, default=2000)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--serve", type=float)
    ap.add_argument("--clients", nargs=3)
    a = ap.parse_args()
    if a.serve is not None:
        asyncio.run(server(a.serve))
        return
    if a.clients:
        asyncio.run(clients(int(a.clients[0]), int(a.clients[1]), float(a.clients[2])))
        return
    t = Table(title=f"{a.connections:,} idle agent streams, one connection each ({os.cpu_count()} cores)")
    for col in ("design", "server pings", "heartbeats", "server CPU", "per connection"):
        t.add_column(col)
    for label, period, beat in (("before", 20.0, 2.0), ("now", 2.0, 30.0), ("now, counters quiet", 2.0, 1e6)):
        share = measure(period, beat, a.connections, a.window_s)
        print(f"{label}: {share:.1%} of a core", flush=True)
        t.add_row(label, f"every {period:g} s", "none" if beat > 1e5 else f"every {beat:g} s", f"{share:.1%}",
                  f"{share / a.connections * 1e6:.0f} us/s")
    Console().print(t)


if __name__ == "__main__":
    main()
