"""A fleet saying hello at once to a manager whose event loop is busy: every agent is welcomed.

grpc.aio takes up one new call per turn of the event loop; the calls that arrive meanwhile wait in
gRPC core, which by default ends them with CANCELLED once more than 1,000 wait (at random, all past
3,000), before the manager sees them. bench/manager.py's registration of 12,500 nodes stalled on
exactly that (its agents did not retry). The manager now lets calls wait (rpc/server.py,
PENDING_CALLS_MAX).

The agents run in a child process (their own event loop and gRPC client); the test holds the
manager's loop until they have opened their streams, as a loop busy with a burst of registrations
would, so that more than 1,000 calls are waiting when it lets go.
"""

from __future__ import annotations

import asyncio
import json
import select
import subprocess
import sys
import time
from pathlib import Path

from tests.integration.conftest import Service

NODES = 1_500  # past gRPC's default backlog of 1,000 waiting calls (dozens refused there, at random)
HOLD_S = 1.0  # the manager's loop held on after the agents have opened their streams (their bytes arrive)

CLIENT = r'''
import asyncio, collections, json, sys
import grpc
from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc, common_pb2

async def main() -> None:
    target, tokens = sys.argv[1], json.loads(sys.stdin.readline())
    nodes = sorted(tokens)
    channels = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(len(nodes) // 50 + 1)]  # 50 agents per connection
    for ch in channels:
        await ch.channel_ready()
    print("ready", flush=True)
    sys.stdin.readline()
    done = asyncio.Event()

    async def agent(i: int, node: str) -> str:
        hello = agent_pb2.AgentMessage(hello=agent_pb2.Hello(
            node=node, domain=f"nvl-{i // 8}", boot_id="b", agent_version="burst",
            gpus=[common_pb2.GpuInfo(uuid=f"GPU-{node}", index=0, power=common_pb2.PowerConstraints(
                min_mw=200_000, max_mw=1_300_000, default_mw=1_000_000))]))

        async def out():
            yield hello
            await done.wait()  # the stream stays open until every agent has its answer

        stub = agent_pb2_grpc.AgentServiceStub(channels[i % len(channels)])
        try:
            async for msg in stub.Connect(out(), metadata=(("authorization", f"Bearer {tokens[node]}"),)):
                if msg.WhichOneof("body") == "welcome":
                    return "welcome"
            return "ended"
        except grpc.aio.AioRpcError as e:
            return e.code().name

    tasks = [asyncio.create_task(agent(i, n)) for i, n in enumerate(nodes)]
    await asyncio.sleep(0.5)  # every call started (its headers and hello on their way)
    print("started", flush=True)
    outcomes = collections.Counter(await asyncio.gather(*tasks))
    done.set()
    print(json.dumps(outcomes), flush=True)
    for ch in channels:
        await ch.close()

asyncio.run(main())
'''


async def test_a_burst_of_hellos_past_grpcs_default_backlog_is_welcomed_in_full(sqlite_service: Service) -> None:
    svc = sqlite_service
    nodes = [f"burst-{i:04d}" for i in range(NODES)]
    tokens = await svc.manager.token_service.create_agents(nodes, "test")
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, svc.grpc], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parents[2], text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(tokens) + "\n")
        proc.stdin.flush()
        assert await asyncio.to_thread(proc.stdout.readline) == "ready\n"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        # Hold the manager's loop (deliberately blocking) until the agents have opened every
        # stream, and a moment more: the calls wait in gRPC core meanwhile.
        assert select.select([proc.stdout], [], [], 60)[0], "the agents did not start"
        assert proc.stdout.readline() == "started\n"
        time.sleep(HOLD_S)
        outcomes = json.loads(await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120))
        # every agent welcomed: none ended by gRPC before the manager took its call up
        assert outcomes == {"welcome": NODES}, outcomes
        assert all(n in svc.manager.world.nodes for n in nodes)
        assert await asyncio.to_thread(proc.wait, 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)  # reaps it and closes its pipes
