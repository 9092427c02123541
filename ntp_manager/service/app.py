"""`ntp-manager serve`: FastAPI, the gRPC server and the control loop on one event loop.

Shutdown (SIGTERM/SIGINT): readiness and gRPC health flip to NOT_SERVING, the gRPC server stops
accepting and gives open streams a grace period, HTTP stops, then the manager stops its loops and
closes the database. Every acknowledged write was committed before its acknowledgement.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import signal
import socket
import sys
from collections.abc import Iterator

import structlog
import uvicorn

from ntp_manager.api.app import create_app
from ntp_manager.logs import configure_logging
from ntp_manager.rpc.server import RpcServer
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the service handles signals itself
        yield


async def run_service(settings: Settings, stop: asyncio.Event | None = None) -> None:
    configure_logging(settings.log_format)
    log = structlog.get_logger("ntp.serve")
    manager = Manager(settings)
    await manager.start()
    # A long-lived service with many small objects: keep what start-up loaded out of the cyclic GC
    # and collect the young generation less often, so collections do not stall layout pushes.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    # Work that grows with the cluster runs in worker threads; a thread that computes holds the GIL
    # for up to the switch interval each time the loop's thread gives it up (every syscall), so a
    # short interval keeps the loop's callbacks from waiting 5 ms per system call.
    sys.setswitchinterval(0.0005)
    rpc = RpcServer(manager)
    grpc_port = await rpc.start(settings.grpc_host, settings.grpc_port)

    sock = socket.socket(socket.AF_INET6 if ":" in settings.http_host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((settings.http_host, settings.http_port))
    http_port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(manager), log_level="warning", lifespan="off", access_log=False)
    server = _Server(config)
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    info: dict[str, object] = {"http": f"{settings.http_host}:{http_port}",
                               "grpc": f"{settings.grpc_host}:{grpc_port}", "epoch": manager.epoch}
    if rpc.tls_port is not None:
        info["grpc_tls"] = f"{settings.grpc_tls_host or settings.grpc_host}:{rpc.tls_port}"
    print(f"NTP-MANAGER READY {json.dumps(info)}", flush=True)
    log.info("serving", **info)
    try:
        await stop.wait()
    finally:
        log.info("shutting down")
        await manager.begin_shutdown()
        await rpc.stop(grace=3.0)
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(serve_task, 10)
        await manager.stop()
        log.info("stopped")
