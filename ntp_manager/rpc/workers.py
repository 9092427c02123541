"""ntp.v1.WorkerService: layout watches, acks and step reports, through the manager's `WatchDoor`
(service/ingest/doors.py). A watch yields pre-serialized layouts: the views of one layout version are
built once, off the event loop, and shared by every watcher (rpc/views.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from ntp_manager.contract.proto.ntp.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from ntp_manager.rpc.guard import abort, code_of, principal_of
from ntp_manager.rpc.views import LayoutViews, build_views
from ntp_manager.service.core import offloop
from ntp_manager.service.core.errors import InvalidArgument, ServiceError
from ntp_manager.service.core.metrics import Metrics
from ntp_manager.service.ingest.doors import WatchDoor
from ntp_manager.service.ingest.worker_reports import WorkerReports
from ntp_manager.service.leadership.balance import MOVE_KEY, MOVE_MESSAGE
from ntp_manager.service.operations.tokens import Tokens
from ntp_manager.service.planning.restores import RestoreReport

REVOKED = "the token of this stream was revoked"
TURNS = 8  # watches that go on to push in one pass of the event loop after a layout's views are built


class WorkerService(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, door: WatchDoor, tokens: Tokens, workers: WorkerReports, metrics: Metrics) -> None:
        self.door, self.tokens, self.workers, self.metrics = door, tokens, workers, metrics
        self._views: dict[str, tuple[tuple[int, int], asyncio.Future[LayoutViews]]] = {}
        self._turns = asyncio.Semaphore(TURNS)  # bound to a loop when first waited on

    async def views(self, job: str, rec: Any) -> LayoutViews:
        """The views of a layout version, built once (off the event loop: O(plan)) and shared.

        Every watch of the job waits for the same build, so they all resume in one pass of the
        event loop when it ends, and each then pushes (its view's bytes and gRPC's send, about a
        quarter of a millisecond on a 2-core VM): a manager holding 667 watches held its loop for
        113-160 ms at each new layout, REST requests and agents' acks waiting behind (bench/RESULTS.md).
        So the watches that waited go on TURNS at a time, one batch per pass of the loop."""
        key = (rec.leader_epoch, rec.version)
        cached = self._views.get(job)
        if cached is None or cached[0] != key:
            fut = asyncio.ensure_future(offloop.run(build_views, rec))
            cached = (key, fut)
            self._views[job] = cached
        if cached[1].done():
            return cached[1].result()
        views = await asyncio.shield(cached[1])
        async with self._turns:
            await asyncio.sleep(0)  # the next pass: the others wait their turn meanwhile
        return views

    async def WatchLayout(
        self, request: worker_pb2.WatchLayoutRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:  # pre-serialized ntp.v1.Layout messages (see worker_handler)
        if not request.job:
            await abort(context, grpc.StatusCode.INVALID_ARGUMENT, "job: watch needs a job name")
        self.workers.check_ids(request.job, request.worker_id)
        await self.door.check(request.job, request.gpu_uuid)
        principal = principal_of(self.tokens.table, context)
        if principal is None:
            await abort(context, grpc.StatusCode.UNAUTHENTICATED, "missing or unknown bearer token")
        assert principal is not None
        revoked = asyncio.Event()

        def on_revoke() -> None:
            revoked.set()
            self.door.wake_all()

        unwatch = self.tokens.watch(principal.token_id, on_revoke)
        seen = (-1, -1)
        self.metrics.watchers.inc()
        held = self.door.hold()  # the balancer may tell it to move

        def stop() -> bool:
            return revoked.is_set() or (held is not None and held.told is not None)
        try:
            while True:
                try:
                    rec = await self.door.wait(request.job, seen, stop)
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
                self.metrics.pushes.inc()
                yield data
        finally:
            unwatch()
            self.metrics.watchers.dec()
            self.door.release(held)

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
        rec = await self.door.ack(request.job, request.worker_id, request.stamp.leader_epoch, request.stamp.version,
                                  ok, restored)
        return worker_pb2.AckLayoutResponse(
            current=common_pb2.LayoutStamp(leader_epoch=rec.leader_epoch, version=rec.version))

    async def ReportSteps(
        self, request: worker_pb2.StepReport, context: grpc.aio.ServicerContext
    ) -> worker_pb2.StepReportResponse:
        await self.door.report_steps(request.job, request.worker_id, request)
        return worker_pb2.StepReportResponse(accepted=True)


def _pass_bytes(msg: Any) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def worker_handler(svc: WorkerService) -> grpc.GenericRpcHandler:
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
