"""ntp.v1.AgentService: one bidirectional stream per node agent.

The first message is the hello (checked here for shape, then by the manager's `AgentDoor`:
service/ingest/doors.py); the answer is a welcome with the last report seq that is durable. Then the agent
sends heartbeats, reports and power read-backs, and the manager sends acks and commands (power
caps, drains) from the session's outbox. The edge never asks where what the agent says is stored:
that is the door's business.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator
from typing import Any

import grpc
import structlog
from google.protobuf.timestamp_pb2 import Timestamp

from ntp_manager.auth import Principal
from ntp_manager.contract import limits
from ntp_manager.contract.gpu import GpuState
from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from ntp_manager.rpc.guard import abort, code_of, peer_fingerprint, principal_of
from ntp_manager.rpc.tally import Tally
from ntp_manager.service.core.errors import ServiceError, Unavailable
from ntp_manager.service.core.inputs import GpuInventory, GpuReport
from ntp_manager.service.ingest.agents import Ack, AgentCommand, AgentSession, Drain, EndStream, ReleasePower, SetPower
from ntp_manager.service.ingest.doors import AgentDoor
from ntp_manager.service.leadership.balance import MOVE_KEY
from ntp_manager.service.operations.tokens import Tokens
from ntp_manager.settings import Settings

log = structlog.get_logger("ntp.rpc")

STATE_NAMES: dict[int, str] = {
    common_pb2.GPU_STATE_HEALTHY: GpuState.HEALTHY,
    common_pb2.GPU_STATE_SUSPECT: GpuState.SUSPECT,
    common_pb2.GPU_STATE_DEGRADED: GpuState.DEGRADED,
    common_pb2.GPU_STATE_FAILED: GpuState.FAILED,
    common_pb2.GPU_STATE_CORDONED: GpuState.CORDONED,
    common_pb2.GPU_STATE_DRAINING: GpuState.DRAINING,
    common_pb2.GPU_STATE_MAINTENANCE: GpuState.MAINTENANCE,
}
PIPELINE = 64  # reports of one agent stream in flight at once
REVOKED = "the token of this stream was revoked"
INTERNAL = "internal error; the manager's log has the details"
STOPPING = Unavailable("a report was not stored (this manager is stopping); try another manager")


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, msg: str) -> None:
        self.code, self.msg = code, msg


def _inventory(h: Any) -> list[GpuInventory]:
    return [
        GpuInventory(g.uuid, g.index, g.model, g.memory_bytes, g.power.default_mw or 1_000_000,
                     g.power.min_mw or 200_000, g.power.max_mw or 1_300_000)
        for g in h.gpus
    ]


def _reports(r: Any) -> list[GpuReport]:
    return [
        GpuReport(g.uuid, STATE_NAMES.get(g.state, f"unknown({g.state})"), list(g.reasons),
                  [x.xid for x in g.xids], g.power.enforced_mw or None)
        for g in r.gpus
    ]


def _failed(node: str, e: BaseException) -> EndStream:
    if isinstance(e, ServiceError):
        return EndStream(code_of(e).name, e.message)
    log.error("agent report failed", node=node, exc_info=e)  # never OK, never the error's text
    return EndStream(grpc.StatusCode.INTERNAL.name, INTERNAL)


class _Stream:
    """What an agent sends after its hello, read by one task; the acks go out as the reports become durable.

    Reports are applied in order but not one round trip at a time: up to PIPELINE of a stream's
    reports wait in the group commit together. Acks are cumulative (ack n: every report up to n is
    durable), so the reports that commit together get one ack. No task waits for the acks: each
    report's future, when done, sends the acks of the done reports at the head of the stream's
    queue (a future done out of order, a replay answered at once, waits for the ones before it).
    Whatever ends the reading (the stream's end, bad input, a failure) settles the reports already
    read first, then puts the end (None or an EndStream) in the session's outbox."""

    def __init__(self, door: AgentDoor, session: AgentSession, messages: AsyncIterator[Any]) -> None:
        self.door, self.session, self.messages = door, session, messages
        self.node = session.node
        self.inflight: collections.deque[asyncio.Future[int]] = collections.deque()
        self.failed = False  # a report could not be stored: its end is in the outbox, nothing more is acked
        self._room: asyncio.Future[None] | None = None  # the reader waits here while PIPELINE are in flight
        self.reader = asyncio.create_task(self._read())

    async def close(self) -> None:
        self.reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.reader

    def _done(self, done: asyncio.Future[int] | None = None) -> None:
        """Ack what is durable at the head of the queue (one ack for all of it), or end the stream
        at the first report that failed (after acking the ones before it)."""
        if done is not None and not done.cancelled():
            done.exception()  # seen, here or below (after a failure the rest are dropped unread)
        q, out, seq = self.inflight, self.session.outbox, 0
        while q and q[0].done() and not self.failed:
            fut = q.popleft()
            err = STOPPING if fut.cancelled() else fut.exception()
            if err is not None:
                if seq:
                    out.put_nowait(Ack(seq))
                    seq = 0
                out.put_nowait(_failed(self.node, err))
                self.failed = True
            else:
                seq = fut.result()
        if seq:
            out.put_nowait(Ack(seq))
        if self.failed:
            q.clear()
        room = self._room
        if room is not None and not room.done() and (len(q) < PIPELINE or self.failed):
            room.set_result(None)

    async def _settle(self) -> None:
        """Wait until every report read is durable or failed (its ack or end then in the outbox)."""
        if self.inflight:
            await asyncio.wait(list(self.inflight))
        self._done()  # the futures' own callbacks ran first; this only makes sure

    async def _one(self, msg: Any) -> bool:
        """Handle one message; False when the stream must end (a report failed)."""
        kind = msg.WhichOneof("body")
        if kind == "heartbeat":
            self.door.heartbeat(self.node, msg.heartbeat.gpus)
        elif kind == "report":
            while len(self.inflight) >= PIPELINE and not self.failed:
                self._room = asyncio.get_running_loop().create_future()
                await self._room
            if self.failed:
                return False
            fut = self.door.report(self.session, msg.report.seq, _reports(msg.report))
            self.inflight.append(fut)
            fut.add_done_callback(self._done)
            return not self.failed
        elif kind == "result":
            res = msg.result
            await self.door.power(self.node, [(u, p.enforced_mw) for u, p in zip(res.gpu_uuids, res.power,
                                                                                 strict=False)])
        elif kind == "hello":
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "hello may only be sent once per stream")
        else:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "empty agent message")
        return True

    async def _read(self) -> None:
        out = self.session.outbox
        session, clock = self.session, asyncio.get_running_loop().time
        session.heard = clock()
        try:
            async for msg in self.messages:
                session.heard = clock()  # a stream that brings nothing for long is ended (leadership/fleet.py)
                if not await self._one(msg):
                    return
        except ServiceError as e:
            await self._settle()
            out.put_nowait(EndStream(code_of(e).name, e.message))
        except _Abort as e:
            await self._settle()
            out.put_nowait(EndStream(e.code.name, e.msg))
        except (asyncio.CancelledError, grpc.aio.AioRpcError, grpc.aio.AbortError):
            pass  # the stream ended (AbortError: this side ended it: a revoked token, a move)
        except Exception:  # a failed message never ends the stream with OK
            log.exception("agent stream failed", node=self.node)
            out.put_nowait(EndStream(grpc.StatusCode.INTERNAL.name, INTERNAL))
        finally:
            # the reports already read are acked (or refused) before the stream ends
            with contextlib.suppress(asyncio.CancelledError):
                await self._settle()
            out.put_nowait(None)


class AgentService(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, door: AgentDoor, tokens: Tokens, settings: Settings) -> None:
        self.door, self.tokens, self.settings = door, tokens, settings
        self._ids = itertools.count(1)
        # a fleet reconnecting at once (a failover) gets one line per second, not one per agent
        self.connected_log = Tally(log, "agent connected")
        self.disconnected_log = Tally(log, "agent disconnected")

    async def _caller(self, context: grpc.aio.ServicerContext) -> tuple[Principal, str | None]:
        principal = principal_of(self.tokens.table, context)
        if principal is None:  # revoked between the interceptor and here
            await abort(context, grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")
        assert principal is not None
        fingerprint = peer_fingerprint(context)
        if self.settings.grpc_tls_client_ca is not None and fingerprint is None:
            await abort(context, grpc.StatusCode.PERMISSION_DENIED,
                        "agents must connect over mTLS (the manager's TLS port, with a client certificate)")
        return principal, fingerprint

    async def _hello(self, first: Any, principal: Principal, fingerprint: str | None,
                     context: grpc.aio.ServicerContext) -> tuple[AgentSession, int, int, int]:
        """The stream's first message as a hello, taken by the door: (session, last seq, epoch, GPUs)."""
        if first.WhichOneof("body") != "hello":
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the first message on the stream must be a hello")
        h = first.hello
        if len(h.gpus) > limits.GPUS_PER_NODE_MAX:  # before building records for all of them
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                        f"hello.gpus (count): {len(h.gpus)} is outside [1, {limits.GPUS_PER_NODE_MAX}]")
        inv = _inventory(h)
        try:
            session, last_seq, epoch = await self.door.hello(h.node, h.domain, inv, h.boot_id, h.agent_version,
                                                             principal, fingerprint, context.peer() or "")
        except ServiceError as e:
            await abort(context, code_of(e), e.message)
        return session, last_seq, epoch, len(inv)

    async def Connect(
        self, request_iterator: AsyncIterator[agent_pb2.AgentMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb2.ManagerMessage]:
        principal, fingerprint = await self._caller(context)
        try:
            first = await anext(aiter(request_iterator))
        except StopAsyncIteration:
            return
        session, last_seq, epoch, gpus = await self._hello(first, principal, fingerprint, context)
        unwatch = self.tokens.watch(
            principal.token_id,
            lambda: session.outbox.put_nowait(EndStream(grpc.StatusCode.UNAUTHENTICATED.name, REVOKED)),
        )
        self.connected_log.add(session.node, last_seq=last_seq, gpus=gpus)
        stream: _Stream | None = None
        try:
            yield agent_pb2.ManagerMessage(welcome=agent_pb2.Welcome(
                leader_epoch=epoch, last_applied_seq=last_seq,
                heartbeat_interval_ms=int(self.settings.heartbeat_interval_s * 1000),
                heartbeat_max_quiet_ms=int(self.settings.heartbeat_max_quiet_s * 1000)))
            stream = _Stream(self.door, session, request_iterator)
            while True:
                item = await session.outbox.get()
                if item is None or session.closed:
                    break
                if isinstance(item, EndStream):
                    if item.move_to:  # told to move for balance (service/leadership/balance.py)
                        context.set_trailing_metadata(((MOVE_KEY, item.move_to),))
                    await abort(context, grpc.StatusCode[item.status], item.message)
                    break
                yield self._command(item)
        finally:
            unwatch()
            if stream is not None:
                await stream.close()
            self.door.disconnected(session)
            self.disconnected_log.add(session.node)

    def _command(self, cmd: AgentCommand) -> agent_pb2.ManagerMessage:
        cid = next(self._ids)
        if isinstance(cmd, Ack):
            return agent_pb2.ManagerMessage(ack=agent_pb2.ReportAck(seq=cmd.seq), command_id=cid)
        if isinstance(cmd, SetPower):
            return agent_pb2.ManagerMessage(
                set_power=agent_pb2.SetPowerLimit(gpu_uuid=cmd.gpu, limit_mw=cmd.limit_mw, reason=cmd.reason),
                command_id=cid)
        if isinstance(cmd, ReleasePower):
            return agent_pb2.ManagerMessage(release_power=agent_pb2.ReleasePowerLimit(gpu_uuid=cmd.gpu),
                                            command_id=cid)
        assert isinstance(cmd, Drain)
        ts = Timestamp()
        ts.FromDatetime(cmd.deadline)
        return agent_pb2.ManagerMessage(drain=agent_pb2.Drain(deadline=ts, reason=cmd.reason), command_id=cid)
