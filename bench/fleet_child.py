"""The child side of bench/fleet.py's generator processes (bench/fleet_load.py, bench/fleet_watchers.py).

Both read one JSON config line on stdin, open `CHANNELS` gRPC channels per manager address, run
their simulated clients as tasks, and then answer commands read on stdin with one JSON line each
on stdout until {"cmd": "quit"}. `retarget` (a manager restarted on a new address) is the same for
both: every client's address list and failover cycle name the new address instead of the old one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import grpc

from ntp_manager.contract.client import CLIENT_KEEPALIVE

CHANNELS = 8  # per address (HTTP/2 connections the clients of one process share)
Channels = dict[str, list[Any]]
Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


class Targeted(Protocol):
    targets: list[str]
    cycle: list[str]  # the failover cycle (contract/client.py ManagerClient.cycle)


class ChildLoop:
    def __init__(self, extra_options: Sequence[tuple[str, Any]] = ()) -> None:
        self.options = [("grpc.use_local_subchannel_pool", 1), *extra_options, *CLIENT_KEEPALIVE]
        self.chans: Channels = {}
        self.reader = asyncio.StreamReader(limit=64 << 20)  # the config line lists every client (MBs at 12,500)
        self._lag = 0.0
        self._probe: asyncio.Task[None] | None = None

    async def config(self) -> dict[str, Any]:
        """The config line; opens the channels to its "targets"."""
        loop = asyncio.get_running_loop()
        reader = self.reader
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        cfg: dict[str, Any] = json.loads(await reader.readline())
        for t in cfg["targets"]:
            self._open(t)
        return cfg

    def start_lag_probe(self, period_s: float = 0.05) -> None:
        """Measure this process's own event-loop lag (how late a `period_s` sleep wakes): a
        generator starved of CPU delivers its clients' messages late, and a figure measured
        through it is the generator's, not the managers'. `lag_max()` reads and resets it."""
        self._lag = 0.0

        async def probe() -> None:
            loop = asyncio.get_running_loop()
            while True:
                t = loop.time()
                await asyncio.sleep(period_s)
                self._lag = max(self._lag, loop.time() - t - period_s)

        self._probe = asyncio.get_running_loop().create_task(probe())

    def lag_max(self) -> float:
        lag, self._lag = self._lag, 0.0
        return round(lag, 3)

    def _open(self, target: str) -> None:
        self.chans.setdefault(target, [grpc.aio.insecure_channel(target, options=self.options)
                                       for _ in range(CHANNELS)])

    @staticmethod
    def out(d: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(d) + "\n")
        sys.stdout.flush()

    async def serve(self, handlers: dict[str, Handler], clients: Sequence[Targeted]) -> None:
        """Answer commands until "quit" (or stdin closes); "retarget" is handled here."""
        while line := await self.reader.readline():
            c = json.loads(line)
            cmd = c["cmd"]
            if cmd == "quit":
                return
            if cmd == "retarget":
                self._open(c["new"])
                for x in clients:
                    x.targets = [c["new"] if t == c["old"] else t for t in x.targets]
                    x.cycle = [c["new"] if t == c["old"] else t for t in x.cycle]
                self.out({"ok": True})
            else:
                self.out(await handlers[cmd](c))

    @staticmethod
    async def finish(stop: asyncio.Event, tasks: Sequence[asyncio.Task[None]]) -> None:
        stop.set()
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
