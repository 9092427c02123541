"""A GPU that stops answering must not silence its node.

When a GPU hangs (a driver or firmware hang, a GPU stuck in recovery), NVML calls about it can
block for minutes. Made on the agent's event loop, one such call stops the loop: no heartbeats,
no reports, the watchdog starves, and the manager ends up failing the whole node after its
heartbeat timeout (and systemd restarts the agent, which hangs again on its first sample).

`GuardedBackend` wraps a backend so that every per-GPU call runs on that GPU's own thread and is
waited for at most `timeout_s`. A call that does not return in time raises `GpuHung`; further calls
about that GPU fail at once with `GpuHung` until the stuck call has returned (no pile of blocked
threads). Other GPUs are not affected: each has its own thread. The caller decides what a hang means
(the agent fails the GPU, sticky, with the reason).

Node-wide calls (`gpus`, `wait_xids`, `close`) pass through: `wait_xids` already runs on its own
thread, and the rest are made once.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from collections.abc import Callable
from typing import TypeVar, cast

from ntp_agent.backends.base import BackendError, BackendEvent, GpuBackend, GpuSample, GpuStatic

T = TypeVar("T")

_Job = tuple[Callable[..., object], tuple[object, ...], "cf.Future[object]"]


class _GpuThread:
    """One daemon thread running the calls about one GPU, in order. A daemon, so that a thread
    stuck in the driver never holds up the agent's exit (a ThreadPoolExecutor's would: its workers
    are joined at interpreter exit)."""

    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[..., object], args: tuple[object, ...]) -> cf.Future[object]:
        fut: cf.Future[object] = cf.Future()
        self.jobs.put((fn, args, fut))
        return fut

    def stop(self) -> None:
        self.jobs.put(None)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            fn, args, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the caller, as an executor would
                fut.set_exception(e)


class GpuHung(BackendError):
    """A call about this GPU did not return within the agent's deadline (or an earlier one still has not)."""

    def __init__(self, uuid: str, what: str, waited_s: float) -> None:
        super().__init__(f"GPU {uuid} did not answer {what} within {waited_s:.1f}s")
        self.uuid = uuid
        self.what = what
        self.waited_s = waited_s


class GuardedBackend:
    """A `GpuBackend` whose per-GPU calls are bounded in time (see the module docstring)."""

    def __init__(self, inner: GpuBackend, timeout_s: float = 3.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.inner = inner
        self.timeout_s = timeout_s
        self.clock = clock
        self.name = inner.name
        self._lock = threading.Lock()
        self._threads: dict[str, _GpuThread] = {}
        self._stuck: dict[str, tuple[str, float]] = {}  # uuid -> (call, since)

    # ---- what the agent asks about hangs --------------------------------------------------------
    def stuck(self, uuid: str) -> tuple[str, float] | None:
        """(the call, when it started) while a call about `uuid` has not returned; else None."""
        with self._lock:
            return self._stuck.get(uuid)

    # ---- the protocol ---------------------------------------------------------------------------
    def gpus(self) -> list[GpuStatic]:
        return self.inner.gpus()

    def sample(self, uuid: str) -> GpuSample:
        return self._call(uuid, "a sample", self.inner.sample, uuid)

    def wait_xids(self, timeout_s: float) -> list[BackendEvent]:
        return self.inner.wait_xids(timeout_s)

    def get_limit_mw(self, uuid: str) -> int:
        return self._call(uuid, "a power limit read", self.inner.get_limit_mw, uuid)

    def set_limit_mw(self, uuid: str, mw: int) -> None:
        self._call(uuid, "a power limit change", self.inner.set_limit_mw, uuid, mw)

    def close(self) -> None:
        with self._lock:
            threads, self._threads = list(self._threads.values()), {}
        for t in threads:  # a thread still stuck in the driver is not waited for
            t.stop()
        self.inner.close()

    # ---- the guard ------------------------------------------------------------------------------
    def _call(self, uuid: str, what: str, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            stuck = self._stuck.get(uuid)
            if stuck is not None:
                raise GpuHung(uuid, stuck[0], self.clock() - stuck[1])
            worker = self._threads.get(uuid)
            if worker is None:
                worker = self._threads[uuid] = _GpuThread(f"gpu-{uuid[-8:]}")
        started = self.clock()
        fut = worker.submit(fn, args)
        try:
            return cast(T, fut.result(timeout=self.timeout_s))
        except cf.TimeoutError:
            with self._lock:
                self._stuck.setdefault(uuid, (what, started))
            # cleared when the stuck call returns at last (the GPU answered again)
            fut.add_done_callback(lambda _f: self._returned(uuid, started))
            raise GpuHung(uuid, what, self.clock() - started) from None

    def _returned(self, uuid: str, started: float) -> None:
        with self._lock:
            cur = self._stuck.get(uuid)
            if cur is not None and cur[1] == started:
                del self._stuck[uuid]
