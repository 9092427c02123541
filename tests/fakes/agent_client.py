"""A scripted agent for tests: speaks the real agent gRPC stream to a real manager."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import grpc

from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc, common_pb2

STATES = {
    "healthy": common_pb2.GPU_STATE_HEALTHY,
    "suspect": common_pb2.GPU_STATE_SUSPECT,
    "degraded": common_pb2.GPU_STATE_DEGRADED,
    "failed": common_pb2.GPU_STATE_FAILED,
    "cordoned": common_pb2.GPU_STATE_CORDONED,
}


def gpu_uuids(node: str, n: int) -> list[str]:
    return [f"GPU-{node}-{i}" for i in range(n)]


class ScriptedAgent:
    def __init__(self, target: str, token: str, node: str, domain: str, gpus: list[str], tdp_mw: int = 1_000_000,
                 max_mw: int | None = None, credentials: grpc.ChannelCredentials | None = None):
        self.target, self.token, self.node, self.domain, self.gpus = target, token, node, domain, gpus
        self.credentials = credentials  # TLS / mTLS when given
        self.tdp_mw = tdp_mw
        self.max_mw = int(tdp_mw * 1.3) if max_mw is None else max_mw
        self.channel: grpc.aio.Channel | None = None
        self.out: asyncio.Queue[Any] = asyncio.Queue()
        self.welcome: Any = None
        self.acks: list[int] = []
        self.commands: list[Any] = []
        self.error: grpc.aio.AioRpcError | None = None
        self.seq = 0
        self._reader: asyncio.Task[None] | None = None
        self._got = asyncio.Event()

    def hello(self) -> agent_pb2.AgentMessage:
        return agent_pb2.AgentMessage(
            hello=agent_pb2.Hello(
                node=self.node, domain=self.domain, boot_id="boot-1", agent_version="test",
                gpus=[
                    common_pb2.GpuInfo(
                        uuid=u, index=i, model="FakeGPU",
                        power=common_pb2.PowerConstraints(min_mw=200_000, max_mw=self.max_mw,
                                                          default_mw=self.tdp_mw),
                    )
                    for i, u in enumerate(self.gpus)
                ],
            )
        )

    async def connect(self, first: agent_pb2.AgentMessage | None = None) -> None:
        self.channel = (grpc.aio.secure_channel(self.target, self.credentials) if self.credentials
                        else grpc.aio.insecure_channel(self.target))
        stub = agent_pb2_grpc.AgentServiceStub(self.channel)
        await self.out.put(first or self.hello())

        async def requests():  # type: ignore[no-untyped-def]
            while True:
                m = await self.out.get()
                if m is None:
                    return
                yield m

        call = stub.Connect(requests(), metadata=(("authorization", f"Bearer {self.token}"),))

        async def read() -> None:
            try:
                async for msg in call:
                    kind = msg.WhichOneof("body")
                    if kind == "welcome":
                        self.welcome = msg.welcome
                        self.seq = max(self.seq, msg.welcome.last_applied_seq)
                    elif kind == "ack":
                        self.acks.append(msg.ack.seq)
                    else:
                        self.commands.append(msg)
                    self._got.set()
            except grpc.aio.AioRpcError as e:
                self.error = e
                self._got.set()

        self._reader = asyncio.create_task(read())

    async def wait_for(self, pred: Any, timeout: float = 10.0) -> None:
        async def loop() -> None:
            while not pred():
                self._got.clear()
                if pred():
                    return
                await self._got.wait()

        await asyncio.wait_for(loop(), timeout)

    async def report(self, states: dict[str, str], seq: int | None = None, reasons: list[str] | None = None,
                     xids: list[int] | None = None, wait: bool = True) -> int:
        if seq is None:
            self.seq += 1
            seq = self.seq
        gpus = [
            agent_pb2.GpuHealth(uuid=u, state=STATES.get(s, 99), reasons=reasons or [f"test: {s}"],
                                xids=[agent_pb2.XidEvent(xid=x) for x in (xids or [])])
            for u, s in states.items()
        ]
        n = len(self.acks)
        await self.out.put(agent_pb2.AgentMessage(report=agent_pb2.HealthReport(seq=seq, gpus=gpus)))
        if wait:
            await self.wait_for(lambda: len(self.acks) > n or self.error is not None)
        return seq

    async def heartbeat(self) -> None:
        await self.out.put(agent_pb2.AgentMessage(heartbeat=agent_pb2.Heartbeat(last_seq=self.seq)))

    async def send(self, msg: agent_pb2.AgentMessage) -> None:
        await self.out.put(msg)

    async def close(self) -> None:
        await self.out.put(None)
        if self._reader is not None:
            with contextlib.suppress(asyncio.TimeoutError, Exception):
                await asyncio.wait_for(self._reader, 5)
        if self.channel is not None:
            await self.channel.close()
