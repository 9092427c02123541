"""The worker library's layout watch across several managers (worker/sources.py GrpcLayoutSource):
after an address it could not reach, it goes on to the next one with its token and nothing else
(every manager serving clients takes the watch)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import pytest

from ntp_manager.worker.sources import GrpcLayoutSource
from tests.fakes.procs import free_port


class _RecordingManager(grpc.GenericRpcHandler):
    """Answers every layout watch NOT_FOUND (no such job), recording the metadata it came with."""

    def __init__(self) -> None:
        self.watches: list[dict[str, Any]] = []

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if not details.method.endswith("/WatchLayout"):
            return None
        self.watches.append(dict(details.invocation_metadata or ()))

        def refuse(_request: bytes, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.NOT_FOUND, "job 'j' not found")
            yield b""  # never reached: makes this a generator, as a server-streaming handler is

        return grpc.unary_stream_rpc_method_handler(refuse)


@pytest.fixture
def manager() -> Iterator[tuple[_RecordingManager, str]]:
    """A recording manager served on loopback, and its address."""
    recorder = _RecordingManager()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[recorder])
    addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    try:
        yield recorder, addr
    finally:
        server.stop(None)


def test_the_watch_goes_on_to_the_next_manager_with_its_token(manager: tuple[_RecordingManager, str]) -> None:
    recorder, live = manager
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there: the watch is refused
    with pytest.raises(RuntimeError, match="NOT_FOUND"):
        GrpcLayoutSource([dead, live], token="t", job="j", gpu_uuid="G-0", connect_timeout_s=30)
    assert len(recorder.watches) == 1
    md = recorder.watches[0]
    assert md["authorization"] == "Bearer t"
    assert not any(k.startswith("ntp-") for k in md)


def test_a_watch_that_reached_its_manager_stays_there(manager: tuple[_RecordingManager, str]) -> None:
    recorder, live = manager
    with pytest.raises(RuntimeError, match="NOT_FOUND"):
        GrpcLayoutSource([live, f"127.0.0.1:{free_port()}"], token="t", job="j", gpu_uuid="G-0")
    assert [set(w) & {"authorization"} for w in recorder.watches] == [{"authorization"}]
