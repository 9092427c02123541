"""The load generator of bench/fleet.py: simulated node agents in a process of their own, so that
the benchmark measures the managers, not the client.

Started with a JSON line on stdin: {"targets": [grpc addresses], "nodes": [[node, token], ...],
"gpus": 8, "heartbeat_s": 0, "spread": false}. "heartbeat_s" 0: beat at the welcome's longest
quiet, as the agent does while its counters do not change. Every agent prefers targets[0], or with
"spread" agent i prefers targets[i % len(targets)] (the agents of every process spread over the
managers, as the watches of bench/fleet_watchers.py, so that the agents of one manager are not all
simulated by one process). Each agent keeps one stream (the protocol of agent/ntp_agent/core.py
reduced to its bones): hello, welcome (re-send what was not applied), reports acknowledged
cumulatively, heartbeats; when its stream ends it goes to the next address of its failover cycle
(contract/client.py ManagerClient) and records how long it was without a stream. Then reads
commands on stdin, answering each with one JSON line on stdout:

- {"cmd": "ready"}: once every agent is welcomed: {"wall_s": ..., "cpu_s": ...}
- {"cmd": "reports", "k": K, "on": [ADDRESS, ...]}: every agent connected to one of those managers
  (every agent without "on") sends K state-changing reports (GPU 0 degraded, healthy, degraded,
  ...: failed ones would trip the circuit breaker), one after another (the next once the last is
  acknowledged): {"reports", "by": {address: reports sent to it}, "wall_s", "cpu_s"}
- {"cmd": "fail", "not": ADDRESS, "strict": bool}: an agent connected elsewhere than ADDRESS if any, else
  (unless strict) any (not failed yet)
  reports every GPU of its node failed (not waited for): {"node"}. Every GPU, not GPU 0 alone: a GPU
  the ingest phases left degraded is out of the layout already, so failing it changes no layout (at
  2,000 agents with an odd --reports the failover waited for a layout that never came)
- {"cmd": "retarget", "old": ADDRESS, "new": ADDRESS}: a manager restarted elsewhere: {"ok"}
- {"cmd": "stats"}: {"acked": {node: seq}, "moves", "gaps_s": [time without a stream, per move],
  "welcomed_at": [the wall clock of the welcome that ended each gap], "cpu_s", "connected"}
- {"cmd": "connected", "on": ADDRESS}: {"connected", "on" (of them, connected to ADDRESS), "lag_max_s":
  this process's longest event-loop lag since the last "connected" (bench/fleet_child.py)}
- {"cmd": "quit"}
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fleet_child import CHANNELS, ChildLoop
from ntp_manager.contract.client import ManagerClient, leader_hint
from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc, common_pb2

BACKOFF_INITIAL_S, BACKOFF_MAX_S = 0.2, 10.0  # the agent's defaults (AgentConfig)
HEALTHY, FAILED, DEGRADED = common_pb2.GPU_STATE_HEALTHY, common_pb2.GPU_STATE_FAILED, common_pb2.GPU_STATE_DEGRADED


class Sim:
    def __init__(self, i: int, node: str, token: str, targets: list[str], gpus: int, chans: dict[str, list[Any]],
                 heartbeat_s: float, spread: bool = False) -> None:
        self.i, self.node, self.token, self.targets = i, node, token, targets
        self.uuids = [f"GPU-{node}-{k}" for k in range(gpus)]
        self.domain = f"nvl-{node}"
        self.chans = chans
        self.hb = heartbeat_s
        # the failover cycle: the agent's own (contract/client.py ManagerClient): its first address,
        # then the others in an order of this agent's own
        first = targets[i % len(targets)] if spread else targets[0]
        others = [t for t in targets if t != first]
        self.cycle = ManagerClient([first, *others]).cycle
        self.t = 0  # index in the cycle of the address tried now
        self.pending: list[tuple[int, int]] = []  # (seq, state of GPU 0)
        self.next_seq = 1
        self.acked = 0
        self.q: asyncio.Queue[Any] | None = None
        self.connected = asyncio.Event()
        self.acked_ev = asyncio.Event()
        self.moves = 0
        self.failed_here = 0  # addresses failed in a row (no welcome)
        self.rounds_failed = 0  # rounds of every address failed in a row
        self.gaps: list[float] = []
        self.hello_waits: list[float] = []  # per welcome: from sending the hello to the welcome
        self.welcomed_at: list[float] = []  # per move: the wall clock (time.time) of the new welcome
        self.errors: dict[str, int] = {}  # stream ends by status code (and why the hello failed)
        self.lost_at: float | None = None
        self.state = HEALTHY

    @property
    def target(self) -> str:
        """The manager this agent is connected to (or tries now)."""
        return self.cycle[self.t % len(self.cycle)]

    def report(self, state: int) -> int:
        self.pending.append((self.next_seq, state))
        self.next_seq += 1
        if self.q is not None and self.connected.is_set():
            self.q.put_nowait(self._msg(self.pending[-1]))
        return self.next_seq - 1

    def _msg(self, p: tuple[int, int]) -> agent_pb2.AgentMessage:
        # FAILED (the "fail" command) is reported for every GPU of the node: whatever the ingest phases
        # left degraded (out of the layout), the node's replica must go, so the layout must change
        uuids = self.uuids if p[1] == FAILED else self.uuids[:1]
        return agent_pb2.AgentMessage(report=agent_pb2.HealthReport(seq=p[0], gpus=[agent_pb2.GpuHealth(
            uuid=u, state=p[1], reasons=["bench"]) for u in uuids]))

    async def _requests(self, q: asyncio.Queue[Any]) -> Any:
        while (m := await q.get()) is not None:
            yield m

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            q: asyncio.Queue[Any] = asyncio.Queue()
            self.q = q
            q.put_nowait(agent_pb2.AgentMessage(hello=agent_pb2.Hello(
                node=self.node, domain=self.domain, boot_id="b", agent_version="bench",
                gpus=[common_pb2.GpuInfo(uuid=u, index=k, power=common_pb2.PowerConstraints(
                    min_mw=200_000, max_mw=1_300_000, default_mw=1_000_000)) for k, u in enumerate(self.uuids)])))
            target = self.target
            sent_at = time.perf_counter()
            beat: asyncio.Task[None] | None = None
            welcomed = False
            hint: str | None = None
            try:
                stub = agent_pb2_grpc.AgentServiceStub(self.chans[target][self.i % CHANNELS])
                call = stub.Connect(self._requests(q), metadata=(("authorization", f"Bearer {self.token}"),))
                async for msg in call:
                    kind = msg.WhichOneof("body")
                    if kind == "welcome":
                        last = msg.welcome.last_applied_seq
                        self.acked = max(self.acked, last)
                        self.pending = [(last + 1 + k, s) for k, (_, s) in enumerate(p for p in self.pending
                                                                                        if p[0] > last)]
                        self.next_seq = last + 1 + len(self.pending)
                        for p in self.pending:
                            q.put_nowait(self._msg(p))
                        if self.lost_at is not None:
                            self.hello_waits.append(time.perf_counter() - sent_at)
                            self.gaps.append(time.perf_counter() - self.lost_at)
                            self.welcomed_at.append(time.time())
                            self.lost_at = None
                        if msg.welcome.heartbeat_max_quiet_ms and self.hb <= 0:  # as the agent: counters unchanged
                            self.hb = msg.welcome.heartbeat_max_quiet_ms / 1000
                        elif self.hb <= 0:
                            self.hb = msg.welcome.heartbeat_interval_ms / 1000
                        self.connected.set()
                        welcomed, self.rounds_failed = True, 0
                        beat = asyncio.create_task(self._beat(q))
                    elif kind == "ack":
                        self.acked = max(self.acked, msg.ack.seq)
                        self.pending = [p for p in self.pending if p[0] > msg.ack.seq]
                        self.acked_ev.set()
            except grpc.aio.AioRpcError as e:
                key = f"{e.code().name}{'' if welcomed else ' (no welcome)'}: {(e.details() or '')[:60]}"
                self.errors[key] = self.errors.get(key, 0) + 1
                hint = leader_hint(e)  # told to move (balance) or to the leader: go there, as the agent does
            finally:
                if beat is not None:
                    beat.cancel()
                if self.connected.is_set() and self.lost_at is None:
                    self.lost_at = time.perf_counter()
                self.connected.clear()
                self.q = None
                q.put_nowait(None)
            if stop.is_set():
                return
            self.moves += 1
            if hint is not None and hint in self.cycle:
                self.t = self.cycle.index(hint)
                self.failed_here = 0
                await asyncio.sleep(random.uniform(0, BACKOFF_INITIAL_S))
                continue
            self.t += 1
            # as the real agent waits (agent/ntp_agent/core.py connect_forever): the next address at
            # once (jittered), and after a round of failures exponentially longer, up to 10 s
            self.failed_here = 0 if welcomed else self.failed_here + 1
            if self.failed_here < len(self.targets):
                await asyncio.sleep(random.uniform(0, BACKOFF_INITIAL_S))
            else:
                self.failed_here = 0
                self.rounds_failed += 1
                await asyncio.sleep(min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2 ** self.rounds_failed)
                                    + random.uniform(0, BACKOFF_INITIAL_S))

    async def _beat(self, q: asyncio.Queue[Any]) -> None:
        while True:
            await asyncio.sleep(self.hb)
            q.put_nowait(agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat(last_seq=self.next_seq - 1)))

    async def reports(self, k: int) -> None:
        for _ in range(k):
            self.state = DEGRADED if self.state == HEALTHY else HEALTHY  # failed ones would trip the breaker
            seq = self.report(self.state)
            while self.acked < seq:
                self.acked_ev.clear()
                await self.acked_ev.wait()


async def main() -> None:
    child = ChildLoop()  # keepalive options: a stopped manager is noticed
    cfg = await child.config()
    stop = asyncio.Event()
    t0 = time.perf_counter()
    sims = [Sim(i, n, tok, cfg["targets"], cfg.get("gpus", 8), child.chans, cfg.get("heartbeat_s", 0.0),
                bool(cfg.get("spread", False)))
            for i, (n, tok) in enumerate(cfg["nodes"])]
    tasks = [asyncio.create_task(s.run(stop)) for s in sims]
    child.start_lag_probe()

    async def ready(c: dict[str, Any]) -> dict[str, Any]:
        for s in sims:
            await s.connected.wait()
        return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time()}

    async def reports(c: dict[str, Any]) -> dict[str, Any]:
        t1, c1 = time.perf_counter(), time.process_time()
        on = c.get("on")
        busy = [s for s in sims if on is None or (s.connected.is_set() and s.target in on)]
        k = int(c["k"])
        by: dict[str, int] = {}
        for s in busy:
            by[s.target] = by.get(s.target, 0) + k
        await asyncio.gather(*(s.reports(k) for s in busy))
        return {"reports": len(busy) * k, "by": by, "wall_s": time.perf_counter() - t1,
                "cpu_s": time.process_time() - c1}

    async def fail(c: dict[str, Any]) -> dict[str, Any]:  # an agent connected to a manager other than c["not"]
        live = [x for x in sims if x.connected.is_set() and x.state != FAILED]
        # one on another manager than c["not"] if any (else one on it: it re-sends after reconnecting)
        s = next((x for x in live if x.target != c.get("not")),
                 None if c.get("strict") or not live else live[0])
        if s is not None:
            s.state = FAILED
            s.report(FAILED)
        return {"node": None if s is None else s.node,
                "on_it": s is not None and s.target == c.get("not")}

    async def stats(c: dict[str, Any]) -> dict[str, Any]:
        errors: dict[str, int] = {}
        for sim in sims:
            for k, v in sim.errors.items():
                errors[k] = errors.get(k, 0) + v
        return {"acked": {s.node: s.acked for s in sims}, "moves": sum(s.moves for s in sims), "errors": errors,
                "gaps_s": [g for s in sims for g in s.gaps],
                "hello_waits_s": [g for s in sims for g in s.hello_waits], "cpu_s": time.process_time(),
                "welcomed_at": [t for s in sims for t in s.welcomed_at],
                "connected": sum(s.connected.is_set() for s in sims),
                "on": [s.target for s in sims if s.connected.is_set()]}

    async def connected(c: dict[str, Any]) -> dict[str, Any]:  # polled often while a kill is measured: small
        addr = c.get("on")
        return {"connected": sum(s.connected.is_set() for s in sims),
                "on": sum(s.connected.is_set() and s.target == addr for s in sims),
                "lag_max_s": child.lag_max()}

    await child.serve({"ready": ready, "reports": reports, "fail": fail, "stats": stats, "connected": connected},
                      sims)
    await child.finish(stop, tasks)
    child.out({"bye": True})


if __name__ == "__main__":
    asyncio.run(main())
