"""The worker side of bench/fleet.py (`--watchers N`): simulated layout watches
(`WorkerService.WatchLayout`) in a process of their own, so that the benchmark measures the managers.

Started with a JSON line on stdin: {"targets": [grpc addresses, the preferred first], "token": a
worker token, "job": name, "gpus": [GPU UUID per watcher]}. Each watcher keeps one stream; when it
ends (the manager died, or told it to move: trailing metadata `ntp-move-to` / `ntp-leader`) it
records a reconnect, goes to the address named or else the next one, and records how long it was
without a stream (until its first layout on the new one). Each layout is parsed for its stamp only.
Then reads commands on stdin, answering each with one JSON line on stdout:

- {"cmd": "ready"}: once every watcher has a layout: {"wall_s", "cpu_s"}
- {"cmd": "stats"}: {"connected", "reconnects", "moved" (told to move), "lost_from" (reconnects by
  the manager the stream was lost from), "gaps_s" (per reconnect), "served_at" (the wall clock of
  each reconnect's first layout),
  "epochs": {epoch: watchers whose newest layout is of it}, "on": [address per connected watcher],
  "cpu_s"}
- {"cmd": "epochs", "on": ADDRESS}: {"epochs", "connected", "on" (of them, on ADDRESS), "lag_max_s": this process's
  longest event-loop lag since the last "epochs" (bench/fleet_child.py), "first_at": {epoch: the wall clock
  (time.time) at which the first watcher of this process got a layout of it}}
- {"cmd": "retarget", "old": ADDRESS, "new": ADDRESS}: a manager restarted on a new address: {"ok"}
- {"cmd": "quit"}
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fleet_child import CHANNELS, ChildLoop
from ntp_manager.contract.client import ManagerClient, leader_hint
from ntp_manager.contract.proto.ntp.v1 import common_pb2, worker_pb2


def stamp_of(data: bytes) -> tuple[int, int]:
    """(epoch, version) of a serialized ntp.v1.Layout, reading its stamp field alone."""
    msg = common_pb2.Layout()
    msg.ParseFromString(data)
    return int(msg.stamp.leader_epoch), int(msg.stamp.version)


class Watcher:
    def __init__(self, i: int, gpu: str, targets: list[str], chans: dict[str, list[Any]], token: str,
                 job: str, first_at: dict[int, float]) -> None:
        self.i, self.gpu, self.targets, self.chans, self.job = i, gpu, targets, chans, job
        self.first_at = first_at  # shared by the process's watchers: epoch -> the first layout of it
        # the failover cycle: the worker's own (contract/client.py ManagerClient)
        self.cycle = ManagerClient(targets).cycle
        self.md = (("authorization", f"Bearer {token}"),)
        self.target = targets[i % len(targets)]  # spread over the managers
        self.connected = asyncio.Event()
        self.newest = (0, 0)
        self.reconnects = 0
        self.moved = 0
        self.gaps: list[float] = []
        self.served_at: list[float] = []  # per reconnect: the wall clock (time.time) of its first layout
        self.lost_at: float | None = None
        self.lost_from: Counter[str] = Counter()  # reconnects by the manager the stream was lost from

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            hint = None
            ch = self.chans[self.target][self.i % CHANNELS]
            call = ch.unary_stream("/ntp.v1.WorkerService/WatchLayout",
                                   request_serializer=worker_pb2.WatchLayoutRequest.SerializeToString,
                                   response_deserializer=lambda b: b)(
                worker_pb2.WatchLayoutRequest(job=self.job, worker_id=f"bench-{self.i}", gpu_uuid=self.gpu),
                metadata=self.md)
            try:
                async for data in call:
                    stamp = stamp_of(data)
                    if stamp[0] not in self.first_at:
                        self.first_at[stamp[0]] = time.time()
                    self.newest = max(self.newest, stamp)
                    if self.lost_at is not None:
                        self.gaps.append(time.perf_counter() - self.lost_at)
                        self.served_at.append(time.time())
                        self.lost_at = None
                    self.connected.set()
            except grpc.aio.AioRpcError as e:
                hint = leader_hint(e)
            if stop.is_set():
                return
            if self.connected.is_set():
                self.reconnects += 1
                self.lost_from[self.target] += 1
                self.moved += hint is not None
                self.lost_at = time.perf_counter()
            self.connected.clear()
            if hint is not None and hint in self.chans:
                self.target = hint
            else:
                i = self.cycle.index(self.target) if self.target in self.cycle else -1
                self.target = self.cycle[(i + 1) % len(self.cycle)]
                await asyncio.sleep(0.05)


async def main() -> None:
    child = ChildLoop([("grpc.max_receive_message_length", 256 << 20)])
    cfg = await child.config()
    stop = asyncio.Event()
    t0 = time.perf_counter()
    first_at: dict[int, float] = {}
    ws = [Watcher(i, g, cfg["targets"], child.chans, cfg["token"], cfg["job"], first_at)
          for i, g in enumerate(cfg["gpus"])]
    tasks = [asyncio.create_task(w.run(stop)) for w in ws]
    child.start_lag_probe()

    async def ready(c: dict[str, Any]) -> dict[str, Any]:
        for w in ws:
            await w.connected.wait()
        return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time()}

    async def epochs(c: dict[str, Any]) -> dict[str, Any]:  # polled often while a round waits: small
        return {"epochs": dict(Counter(w.newest[0] for w in ws)), "connected": sum(w.connected.is_set() for w in ws),
                "on": sum(w.connected.is_set() and w.target == c.get("on") for w in ws), "lag_max_s": child.lag_max(),
                "first_at": {str(e): t for e, t in first_at.items()}}

    async def stats(c: dict[str, Any]) -> dict[str, Any]:
        return {"connected": sum(w.connected.is_set() for w in ws), "reconnects": sum(w.reconnects for w in ws),
                "moved": sum(w.moved for w in ws),
                "lost_from": dict(sum((w.lost_from for w in ws), Counter())),
                "gaps_s": [g for w in ws for g in w.gaps], "served_at": [t for w in ws for t in w.served_at],
                "epochs": dict(Counter(w.newest[0] for w in ws)),
                "on": [w.target for w in ws if w.connected.is_set()], "cpu_s": time.process_time()}

    await child.serve({"ready": ready, "stats": stats, "epochs": epochs}, ws)
    await child.finish(stop, tasks)


if __name__ == "__main__":
    asyncio.run(main())
