"""gRPC: the agent and worker services, auth, health and reflection on one grpc.aio server.

Auth: `authorization: Bearer <token>` metadata; AgentService needs an `agent` token, WorkerService
a `worker` token; health and reflection are open. Missing/unknown token -> UNAUTHENTICATED, wrong
scope -> PERMISSION_DENIED. An agent token speaks for the one node it names (and over the client
certificate it names, if any): a hello for another node is PERMISSION_DENIED and audited.
Malformed requests -> INVALID_ARGUMENT naming the field (nothing written); anything unexpected ->
INTERNAL with a fixed sentence (rpc/guard.py). A revoked token's open streams are ended with
UNAUTHENTICATED.

TLS (rpc/tls.py): with a certificate and key the server also listens on a TLS port; with a client
CA that port requires client certificates (mTLS) and agents must connect through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import structlog
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from ntp_manager.auth import parse_bearer
from ntp_manager.contract import limits
from ntp_manager.contract.gpu import GpuState
from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc, common_pb2, worker_pb2, worker_pb2_grpc
from ntp_manager.rpc import tls
from ntp_manager.rpc.guard import GuardInterceptor, abort, code_of, peer_fingerprint, principal_of
from ntp_manager.rpc.tally import Tally
from ntp_manager.rpc.views import LayoutViews, build_views
from ntp_manager.service import offloop
from ntp_manager.service.agents import Ack, AgentCommand, Drain, EndStream, ReleasePower, SetPower
from ntp_manager.service.balance import MOVE_KEY, MOVE_MESSAGE
from ntp_manager.service.errors import InvalidArgument, ServiceError
from ntp_manager.service.manager import GpuInventory, GpuReport, Manager
from ntp_manager.service.restores import RestoreReport

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
SERVICE_PERMISSION = {"ntp.v1.AgentService": "agent", "ntp.v1.WorkerService": "worker"}


REVOKED = "the token of this stream was revoked"


AGENT_SERVICE = "ntp.v1.AgentService"
WORKER_SERVICE = "ntp.v1.WorkerService"
LEADER_KEY = "ntp-leader"  # trailing metadata: host:port of the leader's gRPC server
# request metadata from a client that could not reach the leader a standby named (or the one it
# was connected to) just now: host:port of that leader. A standby holds such a call (`_hold`).
UNREACHABLE_KEY = "ntp-leader-unreachable"
HOLD_RECHECK_S = 1.0  # a held call looks again at least this often (it is woken on every lease read)
# request metadata from an agent: how many reports it holds that no manager has acknowledged yet.
# When a takeover releases the calls a standby held, those agents go first (`_head_start`).
PENDING_KEY = "ntp-pending-reports"
HEAD_START_MAX_S = 0.5  # the other held calls wait at most this long for them
# set (in the call's own context) on an agent's call with news that a takeover released
RELEASED_WITH_NEWS: contextvars.ContextVar[bool] = contextvars.ContextVar("released_with_news", default=False)


class StandbyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """A manager that does not lead (a standby, one still loading, one that lost its lease) answers
    every AgentService / WorkerService call with UNAVAILABLE naming the leader, in the message and
    in the trailing metadata `ntp-leader` (host:port), before authentication (a standby holds no
    token table). Clients go there (agent/core.py, worker/sources.py). Health and reflection are
    served as usual. While a takeover is due (the leader missed its renewals) or under way, and
    while the client says the leader is unreachable and the standby has not seen it renew since,
    calls are held until this manager leads instead (`_hold`)."""

    def __init__(self, manager: Manager) -> None:
        self.manager = manager
        self._acting: asyncio.Future[Any] | None = None
        self._head = 0  # held calls of agents with news (unacknowledged reports) not served yet
        self._head_done = asyncio.Event()

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        service = details.method.lstrip("/").split("/")[0]
        fleet = self.manager.fleet
        if service in (AGENT_SERVICE, WORKER_SERVICE) and fleet is not None and fleet.ready:
            return await continuation(details)  # fleet mode: every manager takes agent and worker calls
        if service in SERVICE_PERMISSION and not self.manager.acting:
            await self._hold(details)
        handler = await continuation(details)
        if handler is None or service not in SERVICE_PERMISSION or self.manager.acting:
            return handler
        err = self.manager.leadership.not_leader()
        trailer = ((LEADER_KEY, err.leader.grpc),) if err.leader is not None and err.leader.grpc else ()
        return _deny(handler, grpc.StatusCode.UNAVAILABLE, err.message, trailer)

    def close(self) -> None:
        if self._acting is not None:
            self._acting.cancel()

    async def _hold(self, details: grpc.HandlerCallDetails) -> None:
        """Hold a call on a standby until it leads, while sending it to the leader would likely be
        in vain: its client would bounce between a dead leader and this standby and back off, and
        come to the new leader seconds after it is ready (a whole fleet does, after a failover).

        Held while a takeover is due (the leader missed its renewals: `takeover_due_in`) or under
        way, looked at again on every read of the lease; and, when the client says the leader is
        unreachable (metadata `ntp-leader-unreachable`: it found it gone before this standby could
        know), until this standby sees the lease renewed after the call came (then the leader is
        alive and the client goes there; a standby on a lease that is not renewed takes over a lease
        later). At most three leases in all. Then the call goes on as usual: served here, or sent
        to the leader. When the takeover releases the held calls, those of agents with news go
        first (`_head_start`)."""
        m = self.manager
        lead = m.leadership
        unreachable = any(k == UNREACHABLE_KEY for k, _ in (details.invocation_metadata or ()))
        news = _pending(details) > 0
        ends = lead.lease_ends()
        # a dead leader's last renewal may land after this standby's last read, moving the lease by
        # up to two renewal periods and a read's delay; a live one moves it past that within three
        renewed_past = None if ends is None else ends + 2.5 * m.settings.lease_renew_s
        loop = asyncio.get_running_loop()
        give_up = loop.time() + 3 * m.settings.lease_ttl_s
        held = False
        if news:
            self._head += 1
            self._head_done.clear()
        try:
            while not m.acting and not lead.lost.is_set():
                now_ends = lead.lease_ends()
                renewed = renewed_past is not None and now_ends is not None and now_ends > renewed_past
                if lead.takeover_due_in() is None and not (unreachable and not renewed):
                    return  # the leader renews as it should (and has renewed since the client found it gone)
                left = give_up - loop.time()
                if left <= 0:
                    return
                held = True
                if self._acting is None:
                    self._acting = asyncio.ensure_future(m.acting_event.wait())
                await asyncio.wait({self._acting, lead.next_view()}, timeout=min(left, HOLD_RECHECK_S),
                                   return_when=asyncio.FIRST_COMPLETED)
        finally:
            if news and not (held and m.acting):  # not released by the takeover: not waited for
                self.news_served()
        if held and m.acting:
            if news:
                RELEASED_WITH_NEWS.set(True)  # its handler calls news_served (AgentService.Connect)
            else:
                await self._head_start()

    async def _head_start(self) -> None:
        """A takeover released every held call at once: a thousand agents' hellos and as many layout
        watches. Those of agents with news (reports no manager acknowledged: a GPU that failed
        while there was no leader) go first: the others wait until those agents' first reports
        are acknowledged (`news_served`), HEAD_START_MAX_S at most, so the failure that needs a new
        layout is not one in two thousand calls the new leader takes in lock step."""
        if self._head > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._head_done.wait(), HEAD_START_MAX_S)

    def news_served(self) -> None:
        """An agent with news that a takeover released was served (its first ack sent, or its stream
        ended): the held calls behind it may go once all such agents are."""
        if self._head > 0:
            self._head -= 1
            if self._head == 0:
                self._head_done.set()


def _pending(details: Any) -> int:
    """The `ntp-pending-reports` a call's metadata carries (0 when absent or not a number)."""
    for k, v in details.invocation_metadata or ():
        if k == PENDING_KEY:
            try:
                return max(0, int(v))
            except (TypeError, ValueError):
                return 0
    return 0


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, manager: Manager) -> None:
        self.manager = manager

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], details: grpc.HandlerCallDetails
    ) -> Any:
        handler = await continuation(details)
        service = details.method.lstrip("/").split("/")[0]
        perm = SERVICE_PERMISSION.get(service)
        if handler is None or perm is None:
            return handler
        header = dict(details.invocation_metadata or ()).get("authorization")
        token = parse_bearer(header)
        principal = self.manager.tokens.verify(token) if token else None
        if principal is None:
            code, msg = grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token"
        elif not principal.can(perm):
            code, msg = grpc.StatusCode.PERMISSION_DENIED, f"a {principal.scope!r} token may not call {service}"
        else:
            return handler
        return _deny(handler, code, msg)


def _deny(handler: Any, code: grpc.StatusCode, msg: str, trailer: tuple[tuple[str, str], ...] = ()) -> Any:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if trailer:
            context.set_trailing_metadata(trailer)
        await abort(context, code, msg)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if trailer:
            context.set_trailing_metadata(trailer)
        await abort(context, code, msg)
        yield None  # pragma: no cover

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class AgentService(agent_pb2_grpc.AgentServiceServicer):
    def __init__(self, manager: Manager, standby: StandbyInterceptor | None = None) -> None:
        self.m = manager
        self.standby = standby
        self._ids = itertools.count(1)
        # a fleet reconnecting at once (a failover) gets one line per second, not one per agent
        self.connected_log = Tally(log, "agent connected")
        self.disconnected_log = Tally(log, "agent disconnected")

    async def Connect(
        self, request_iterator: AsyncIterator[agent_pb2.AgentMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb2.ManagerMessage]:
        news = [RELEASED_WITH_NEWS.get() and self.standby is not None]  # a takeover let it go first

        def served() -> None:  # its first ack is out (or its stream ended): the calls behind it may go
            if news[0] and self.standby is not None:
                news[0] = False
                self.standby.news_served()

        try:
            principal = principal_of(self.m.tokens, context)
            if principal is None:  # revoked between the interceptor and here
                await abort(context, grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")
            assert principal is not None
            fingerprint = peer_fingerprint(context)
            if self.m.settings.grpc_tls_client_ca is not None and fingerprint is None:
                await abort(context, grpc.StatusCode.PERMISSION_DENIED,
                            "agents must connect over mTLS (the manager's TLS port, with a client certificate)")
            try:
                first = await anext(aiter(request_iterator))
            except StopAsyncIteration:
                return
            if first.WhichOneof("body") != "hello":
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                            "the first message on the stream must be a hello")
            h = first.hello
            if len(h.gpus) > limits.GPUS_PER_NODE_MAX:  # before building records for all of them
                await abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                            f"hello.gpus (count): {len(h.gpus)} is outside [1, {limits.GPUS_PER_NODE_MAX}]")
            inv = [
                GpuInventory(g.uuid, g.index, g.model, g.memory_bytes, g.power.default_mw or 1_000_000,
                             g.power.min_mw or 200_000, g.power.max_mw or 1_300_000)
                for g in h.gpus
            ]
            fleet = self.m.fleet
            try:
                if fleet is not None:  # any manager: stored in the outbox (service/ingest.py)
                    session, last_seq, epoch = await fleet.agents.hello(
                        h.node, h.domain, inv, h.boot_id, h.agent_version, principal, fingerprint,
                        context.peer() or "")
                else:
                    session, last_seq = await self.m.register_agent(
                        h.node, h.domain, inv, h.boot_id, h.agent_version, principal, fingerprint,
                        context.peer() or "")
                    epoch = self.m.epoch
            except ServiceError as e:
                await abort(context, code_of(e), e.message)
            node = h.node
            unwatch = self.m.token_service.watch(
                principal.token_id,
                lambda: session.outbox.put_nowait(EndStream(grpc.StatusCode.UNAUTHENTICATED.name, REVOKED)),
            )
            self.connected_log.add(node, last_seq=last_seq, gpus=len(inv))
            yield agent_pb2.ManagerMessage(
                welcome=agent_pb2.Welcome(
                    leader_epoch=epoch, last_applied_seq=last_seq,
                    heartbeat_interval_ms=int(self.m.settings.heartbeat_interval_s * 1000),
                )
            )

            # Reports are applied in order but not one round trip at a time: up to PIPELINE of a
            # stream's reports wait in the group commit together. Acks are cumulative (ack n: every
            # report up to n is applied), so the reports that commit together get one ack.
            pending: asyncio.Queue[asyncio.Future[int] | None] = asyncio.Queue(PIPELINE)

            def failed(e: BaseException) -> EndStream:
                if isinstance(e, ServiceError):
                    return EndStream(code_of(e).name, e.message)
                log.error("agent report failed", node=node, exc_info=e)  # never OK, never the error's text
                return EndStream(grpc.StatusCode.INTERNAL.name, "internal error; the manager's log has the details")

            async def acks() -> None:
                held: list[asyncio.Future[int] | None] = []  # taken from the queue, not done yet
                while True:
                    fut = held.pop() if held else await pending.get()
                    if fut is None:
                        return
                    try:
                        seq = await fut
                    except Exception as e:
                        session.outbox.put_nowait(failed(e))
                        return
                    while not pending.empty():  # the next reports that are already applied
                        nxt = pending.get_nowait()
                        if nxt is None or not nxt.done():
                            held.append(nxt)
                            break
                        if nxt.exception() is not None:
                            session.outbox.put_nowait(Ack(seq))
                            session.outbox.put_nowait(failed(nxt.exception()))  # type: ignore[arg-type]
                            return
                        seq = nxt.result()
                    session.outbox.put_nowait(Ack(seq))
                    served()

            acker = asyncio.create_task(acks())

            async def read() -> None:
                try:
                    async for msg in request_iterator:
                        kind = msg.WhichOneof("body")
                        if kind == "heartbeat":
                            if fleet is not None:
                                fleet.agents.heartbeat(node)
                                if msg.heartbeat.gpus:
                                    fleet.telemetry(node, msg.heartbeat.gpus)
                            else:
                                self.m.heartbeat(node, msg.heartbeat.gpus)
                        elif kind == "report":
                            r = msg.report
                            reports = [
                                GpuReport(g.uuid, STATE_NAMES.get(g.state, f"unknown({g.state})"), list(g.reasons),
                                          [x.xid for x in g.xids], g.power.enforced_mw or None)
                                for g in r.gpus
                            ]
                            fut = (fleet.agents.report(session, r.seq, reports) if fleet is not None
                                   else asyncio.ensure_future(self.m.apply_report(node, r.seq, reports)))
                            await pending.put(fut)
                            if acker.done():
                                return
                        elif kind == "result":
                            res = msg.result
                            readings = [(u, p.enforced_mw) for u, p in zip(res.gpu_uuids, res.power, strict=False)]
                            if fleet is not None:
                                await fleet.agents.power(node, readings)
                            else:
                                await self.m.record_power_result(node, readings)
                        elif kind == "hello":
                            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "hello may only be sent once per stream")
                        else:
                            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "empty agent message")
                except ServiceError as e:
                    await _settle(pending)
                    session.outbox.put_nowait(EndStream(code_of(e).name, e.message))
                except _Abort as e:
                    await _settle(pending)
                    session.outbox.put_nowait(EndStream(e.code.name, e.msg))
                except (asyncio.CancelledError, grpc.aio.AioRpcError, grpc.aio.AbortError):
                    pass  # the stream ended (AbortError: this side ended it: a revoked token, a move)
                except Exception:  # a failed message never ends the stream with OK
                    log.exception("agent stream failed", node=node)
                    session.outbox.put_nowait(EndStream(grpc.StatusCode.INTERNAL.name,
                                                        "internal error; the manager's log has the details"))
                finally:
                    # the reports already read are acked (or refused) before the stream ends
                    with contextlib.suppress(asyncio.CancelledError):
                        await _settle(pending)
                    session.outbox.put_nowait(None)

            async def _settle(q: asyncio.Queue[asyncio.Future[int] | None]) -> None:
                if not acker.done():
                    await q.put(None)
                    await asyncio.wait([acker])

            reader = asyncio.create_task(read())
            try:
                while True:
                    item = await session.outbox.get()
                    if item is None or session.closed:
                        break
                    if isinstance(item, EndStream):
                        if item.move_to:  # told to move for balance (service/balance.py)
                            context.set_trailing_metadata(((MOVE_KEY, item.move_to),))
                        await abort(context, grpc.StatusCode[item.status], item.message)
                        break
                    yield self._command(item)
            finally:
                unwatch()
                reader.cancel()
                acker.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await acker
                if fleet is not None:
                    fleet.disconnected(session)
                else:
                    self.m.disconnect_agent(session)
                self.disconnected_log.add(node)
        finally:
            served()

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


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, msg: str) -> None:
        self.code, self.msg = code, msg


class WorkerService(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, manager: Manager) -> None:
        self.m = manager
        self._views: dict[str, tuple[tuple[int, int], asyncio.Future[LayoutViews]]] = {}

    async def views(self, job: str, rec: Any) -> LayoutViews:
        """The views of a layout version, built once (off the event loop: O(plan)) and shared."""
        key = (rec.leader_epoch, rec.version)
        cached = self._views.get(job)
        if cached is None or cached[0] != key:
            fut = asyncio.ensure_future(offloop.run(build_views, rec))
            cached = (key, fut)
            self._views[job] = cached
        return await asyncio.shield(cached[1])

    async def WatchLayout(
        self, request: worker_pb2.WatchLayoutRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:  # pre-serialized ntp.v1.Layout messages (see _worker_handler)
        if not request.job:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "job: watch needs a job name")
        self.m.workers.check_ids(request.job, request.worker_id)
        fleet = self.m.fleet
        feed = fleet.feed if fleet is not None else None  # fleet mode: every manager, from the database
        if feed is not None:
            await feed.current(request.job)  # NotFound for an unknown job
        elif request.job not in self.m.world.jobs:
            await abort(context, grpc.StatusCode.NOT_FOUND, f"job: unknown job {request.job!r}")
        if request.gpu_uuid and not (await feed.known_gpu(request.gpu_uuid) if feed is not None
                                     else request.gpu_uuid in self.m.world.gpus):
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"gpu_uuid: unknown GPU {request.gpu_uuid[:200]!r}")
        principal = principal_of(self.m.tokens, context)
        if principal is None:
            await abort(context, grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")
        assert principal is not None
        revoked = asyncio.Event()

        def on_revoke() -> None:
            revoked.set()
            self.m.wake_watchers()
            if feed is not None:
                feed.wake_all()

        unwatch = self.m.token_service.watch(principal.token_id, on_revoke)
        seen = (-1, -1)
        self.m.metrics.watchers.inc()
        held = feed.hold() if feed is not None else None  # the balancer may tell it to move

        def stop() -> bool:
            return revoked.is_set() or (held is not None and held.told is not None)
        try:
            while True:
                try:
                    if feed is not None:
                        rec = await feed.wait(request.job, seen, stop)
                    else:
                        rec = await self.m.wait_layout(request.job, seen, revoked.is_set)
                except ServiceError as e:  # the job was deleted
                    await abort(context, code_of(e), e.message)
                if revoked.is_set():
                    await abort(context, grpc.StatusCode.UNAUTHENTICATED, REVOKED)
                if held is not None and held.told is not None:
                    context.set_trailing_metadata(((MOVE_KEY, held.told),))
                    await abort(context, grpc.StatusCode.UNAVAILABLE, MOVE_MESSAGE.format(target=held.told))
                if rec is None:
                    return
                seen = (rec.leader_epoch, rec.version)
                # pre-serialized bytes; the handler's serializer passes bytes through
                data = (await self.views(request.job, rec)).bytes_for_gpu(request.gpu_uuid)
                self.m.metrics.pushes.inc()
                yield data
        finally:
            unwatch()
            self.m.metrics.watchers.dec()
            if feed is not None and held is not None:
                feed.release(held)

    async def AckLayout(
        self, request: worker_pb2.AckLayoutRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.AckLayoutResponse:
        ok = request.status != worker_pb2.ACK_STATUS_FAILED
        restored = None
        if request.HasField("restored"):  # checked before the ack is recorded: bad input changes nothing
            if not ok:
                raise InvalidArgument("restored: a failed ack cannot report a restore")
            r = request.restored
            restored = RestoreReport(int(r.step), r.checkpoint, r.reason, tuple(r.skipped)).check()
        fleet = self.m.fleet
        if fleet is not None and not self.m.acting:  # checked here, stored, applied by the leader
            rec = await fleet.workers.ack(request.job, request.worker_id, request.stamp.leader_epoch,
                                          request.stamp.version, ok, restored)
            return worker_pb2.AckLayoutResponse(
                current=common_pb2.LayoutStamp(leader_epoch=rec.leader_epoch, version=rec.version))
        rec = self.m.ack_layout(request.job, request.worker_id, request.stamp.leader_epoch, request.stamp.version, ok)
        if restored is not None:
            await self.m.record_restore(request.job, request.worker_id, request.stamp.leader_epoch,
                                        request.stamp.version, restored)
        return worker_pb2.AckLayoutResponse(
            current=common_pb2.LayoutStamp(leader_epoch=rec.leader_epoch, version=rec.version)
        )

    async def ReportSteps(
        self, request: worker_pb2.StepReport, context: grpc.aio.ServicerContext
    ) -> worker_pb2.StepReportResponse:
        fleet = self.m.fleet
        if fleet is not None and not self.m.acting:  # checked here, stored, applied by the leader
            await fleet.workers.report_steps(request.job, request.worker_id, request)
        else:
            await self.m.record_steps(request.job, request.worker_id, request)
        return worker_pb2.StepReportResponse(accepted=True)


def _pass_bytes(msg: Any) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _worker_handler(svc: WorkerService) -> grpc.GenericRpcHandler:
    """Like the generated registration, but WatchLayout may yield pre-serialized bytes."""
    return grpc.method_handlers_generic_handler(
        "ntp.v1.WorkerService",
        {
            "WatchLayout": grpc.unary_stream_rpc_method_handler(
                svc.WatchLayout, request_deserializer=worker_pb2.WatchLayoutRequest.FromString,
                response_serializer=_pass_bytes),
            "AckLayout": grpc.unary_unary_rpc_method_handler(
                svc.AckLayout, request_deserializer=worker_pb2.AckLayoutRequest.FromString,
                response_serializer=_pass_bytes),
            "ReportSteps": grpc.unary_unary_rpc_method_handler(
                svc.ReportSteps, request_deserializer=worker_pb2.StepReport.FromString,
                response_serializer=_pass_bytes),
        },
    )


# Calls that have arrived but that the server has not taken up yet. grpc.aio takes up one new call
# per turn of the event loop, so while the loop is busy (a fleet saying hello at once, after a
# restart or a failover) the new calls queue in gRPC core; past its default backlog (1,000, then
# refused at random up to 3,000) it ends them with CANCELLED, before any handler sees them. Agents
# and workers would retry after a back-off, but the fleet's reconnection would then take rounds of
# back-offs, and a client that does not retry is simply dropped. A waiting call costs a few KB.
PENDING_CALLS_MAX = 200_000  # about two calls (an agent's stream, a worker's watch) per GPU at 100K GPUs
PENDING_CALL_WAIT_S = 60  # one that waits longer is ended (CANCELLED) for its client to retry

KEEPALIVE = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_concurrent_streams", 10_000),
    ("grpc.server.max_pending_requests", PENDING_CALLS_MAX),
    ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS_MAX),
    ("grpc.server_max_unrequested_time_in_server", PENDING_CALL_WAIT_S),
]


HEALTH_SERVICES = ("", "ntp.v1.AgentService", "ntp.v1.WorkerService")


class RpcServer:
    def __init__(self, manager: Manager) -> None:
        self.manager = manager
        self.standby = StandbyInterceptor(manager)
        interceptors = [self.standby, GuardInterceptor(), AuthInterceptor(manager)]
        self.server = grpc.aio.server(interceptors=interceptors, options=KEEPALIVE)
        self.health = health_aio.HealthServicer()
        agent_pb2_grpc.add_AgentServiceServicer_to_server(AgentService(manager, self.standby), self.server)  # type: ignore[no-untyped-call]
        self.server.add_generic_rpc_handlers((_worker_handler(WorkerService(manager)),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [
            agent_pb2.DESCRIPTOR.services_by_name["AgentService"].full_name,
            worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ]
        reflection.enable_server_reflection(names, self.server)
        self.port = 0
        self.tls_port: int | None = None
        self._role: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, tls_port: int | None = None) -> int:
        """Listen on `port` (plaintext) and, when the settings carry a certificate, on `tls_port`
        (TLS; mTLS with a client CA). Returns the plaintext port; `self.tls_port` has the other."""
        try:  # grpcio reports a port it cannot bind as 0, or (newer) as RuntimeError
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            raise OSError(f"cannot bind gRPC to {host}:{port}")
        creds = tls.server_credentials(self.manager.settings)
        if creds is not None:
            want = self.manager.settings.grpc_tls_port if tls_port is None else tls_port
            tls_host = self.manager.settings.grpc_tls_host or host
            try:
                self.tls_port = self.server.add_secure_port(f"{tls_host}:{want}", creds)
            except RuntimeError:
                self.tls_port = 0
            if self.tls_port == 0:
                raise OSError(f"cannot bind gRPC TLS to {tls_host}:{want}")
        await self.server.start()
        await self.set_serving(self.manager.acting)
        self._role = asyncio.create_task(self._follow_role(), name="grpc-health")
        return self.port

    async def _follow_role(self) -> None:
        """Health follows the role: SERVING once this manager leads (a standby's takeover), and
        NOT_SERVING from the moment it loses its lease."""
        m = self.manager
        if not m.acting:
            with contextlib.suppress(Exception):
                await m.wait_leading()
            if m.acting:
                await self.set_serving(True)
        await m.lost.wait()
        await self.set_serving(False)

    async def set_serving(self, serving: bool) -> None:
        """The standard gRPC health (grpc.health.v1, for the server as a whole and for each ntp.v1
        service): SERVING only while this manager leads with its world loaded, so a load balancer
        or probe that checks gRPC health finds the leader; a standby, a manager still loading and
        one that lost its lease or is stopping answer NOT_SERVING. server.py flips it."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for svc in HEALTH_SERVICES:
            await self.health.set(svc, status)

    async def stop(self, grace: float = 5.0) -> None:
        if self._role is not None:
            self._role.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._role
            self._role = None
        await self.set_serving(False)
        await self.server.stop(grace)
        self.standby.close()
