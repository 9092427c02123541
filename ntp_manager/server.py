"""`ntp-manager serve`: FastAPI, the gRPC server and the control loop on one event loop.

The composition root: the one place that builds the service (the manager) and the transports
around it (api/, rpc/), so that service/ never imports the layers above it.

A manager that loses its lease (service/leadership/leader.py) shuts down the same way and exits with status 75
for its supervisor to start it again as a standby; when that takes longer than one lease (its
database unreachable: calls hang), it exits at once. gRPC health says, per service, what this
manager serves now (rpc/server.py): the agent and worker services on every manager that takes
them and is in touch with the store, `ntp.leader` on the leader alone.

Shutdown (SIGTERM/SIGINT): readiness and gRPC health flip to NOT_SERVING, the gRPC server stops
accepting and gives open streams a grace period, HTTP stops, then the manager stops its loops and
closes the database. Every acknowledged write was committed before its acknowledgement.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator

import structlog
import uvicorn

from ntp_manager.api.app import create_app
from ntp_manager.contract.logs import configure_logging
from ntp_manager.manager_process import LEADING, READY
from ntp_manager.rpc.server import RpcServer
from ntp_manager.service.core import offloop
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the service handles signals itself
        yield


LOST_LEASE_EXIT = 75  # EX_TEMPFAIL: the supervisor restarts the process, which stands by


def loop_factory(settings: Settings) -> Callable[[], asyncio.AbstractEventLoop]:
    """The event loop `serve` runs the service on (`event_loop`). uvloop runs the same asyncio code
    with its loop, handles and transports in C: the per-message work around gRPC and asyncpg that a
    manager does for every agent report costs less (bench/RESULTS.md)."""
    if settings.event_loop == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        raise RuntimeError("event_loop is uvloop, which is not installed here (pip install uvloop, or set "
                           "NTP_EVENT_LOOP=asyncio)") from None
    return uvloop.new_event_loop


async def run_service(settings: Settings, stop: asyncio.Event | None = None) -> int:
    """Serve until SIGTERM/SIGINT (or `stop`), or until this manager, having led, lost its lease.
    Returns the exit status: 0, or LOST_LEASE_EXIT. A standby (PostgreSQL, another manager leads)
    serves its probes and tells clients where the leader is until it takes the lease over."""
    configure_logging(settings.log_format)
    log = structlog.get_logger("ntp.serve")
    manager = Manager(settings)
    # Listen first: the lease row carries this manager's addresses, and a standby answers its
    # clients (with the leader's address) while it waits.
    rpc = RpcServer(manager)
    grpc_port = await rpc.start(settings.grpc_host, settings.grpc_port)
    sock = socket.socket(socket.AF_INET6 if ":" in settings.http_host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.http_host, settings.http_port))
    except OSError as e:  # in use, or no such address: stop the gRPC server first (no half-started process)
        sock.close()
        await rpc.stop(grace=0)
        raise OSError(f"cannot bind REST to {settings.http_host}:{settings.http_port} ({e.strerror or e})") from None
    http_port = sock.getsockname()[1]
    manager.leadership.advertise(f"{_reachable(settings.http_host)}:{http_port}",
                                 f"{_reachable(settings.grpc_host)}:{grpc_port}")
    # built before the lease is taken: building the routes holds the event loop for a while, and a
    # leader's loop must be free to renew its lease
    config = uvicorn.Config(create_app(manager), log_level="warning", lifespan="off", access_log=False)
    try:
        await manager.start()
    except BaseException:
        await rpc.stop(grace=0)
        sock.close()
        await manager.leadership.close()
        raise
    # A long-lived service with many small objects: keep what start-up loaded out of the cyclic GC
    # and collect the young generation less often, so collections do not stall layout pushes.
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)
    offloop.freeze_long_lived()  # and what is built later to last (service/core/offloop.py)
    # Work that grows with the cluster runs in worker threads; a thread that computes holds the GIL
    # for up to the switch interval each time the loop's thread gives it up (every syscall), so a
    # short interval keeps the loop's callbacks from waiting 5 ms per system call.
    sys.setswitchinterval(0.0005)
    server = _Server(config)
    serve_task = asyncio.create_task(server.serve(sockets=[sock]))

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    info: dict[str, object] = {"http": f"{settings.http_host}:{http_port}",
                               "grpc": f"{settings.grpc_host}:{grpc_port}", "epoch": manager.epoch,
                               "role": "leader" if manager.leading else "standby"}
    if rpc.tls_port is not None:
        info["grpc_tls"] = f"{settings.grpc_tls_host or settings.grpc_host}:{rpc.tls_port}"
    await rpc.refresh_health()
    print(f"{READY} {json.dumps(info)}", flush=True)
    log.info("serving", event_loop=type(loop).__module__, **info)
    led = asyncio.create_task(_announce_leading(manager, log))
    stopped = asyncio.create_task(stop.wait())
    lost = asyncio.create_task(manager.lost.wait())
    try:
        await asyncio.wait([stopped, lost], return_when=asyncio.FIRST_COMPLETED)
    finally:
        led.cancel()
        stopped.cancel()
        lost.cancel()
        was_lost = manager.lost.is_set()
        log.info("shutting down", lost_lease=was_lost)
        await rpc.not_serving()
        down = asyncio.ensure_future(_shut_down(manager, rpc, server, serve_task, 0.5 if was_lost else 3.0))
        if was_lost:
            # a manager that lost its lease has nothing left to commit (the fence refuses it all),
            # and when the database is cut off its connections may hang for minutes: one lease of
            # time to stop in order, then out at once (its supervisor starts it again as a standby)
            done, _ = await asyncio.wait({down}, timeout=settings.lease_ttl_s)
            if not done:
                log.error("exiting now: this manager lost its lease and did not stop within lease_ttl_s "
                          "(its database unreachable?); start it again to stand by",
                          reason=manager.leadership.lost_reason, status=LOST_LEASE_EXIT)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(LOST_LEASE_EXIT)
        await down
        log.info("stopped")
    if manager.lost.is_set():
        log.error("exiting: this manager lost its lease; start it again to stand by",
                  reason=manager.leadership.lost_reason, status=LOST_LEASE_EXIT)
        return LOST_LEASE_EXIT
    return 0


async def _shut_down(manager: Manager, rpc: RpcServer, server: uvicorn.Server, serve_task: asyncio.Task[None],
                     grace: float) -> None:
    await manager.begin_shutdown()
    await rpc.stop(grace=grace)
    server.should_exit = True
    with contextlib.suppress(Exception):
        await asyncio.wait_for(serve_task, 10)
    await manager.stop()


def _reachable(host: str) -> str:
    """The host part to tell clients: a wildcard bind is reachable by this machine's name."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


async def _announce_leading(manager: Manager, log: structlog.stdlib.BoundLogger) -> None:
    """A standby prints one line when it takes over (the fault tests and the demo wait for it)."""
    if manager.leading:
        return
    await manager.wait_leading()
    print(f"{LEADING} {json.dumps({'epoch': manager.epoch})}", flush=True)
    log.info("took over", epoch=manager.epoch)
