"""Event-loop watchdog: how long the manager's one event loop is kept from running, and by what.

Three parts:
- A probe task sleeps `interval_s` again and again and measures how late it wakes up: the lag,
  which is how long some callback held the loop (plus scheduling noise). Every lag goes into the
  `ntp_event_loop_lag_seconds` histogram; the largest is kept in `ntp_event_loop_lag_max_seconds`,
  and each lag above `warn_s` (default 100 ms) counts in `ntp_event_loop_stalls_total` and logs a
  warning.
- A thread looks every `interval_s` at when the probe last ran. When the loop has been held for
  more than `warn_s`, it logs a warning while the stall is still going on, with the stack of the
  loop's thread: the code that holds the loop, named, instead of a number after the fact.
- Garbage-collector pauses stop every thread; each full (generation 2) collection is timed into
  `ntp_gc_pause_seconds` and one past `warn_s` is logged, so a stall the GC caused is named too.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import sys
import threading
import time
import traceback

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

log = structlog.get_logger("ntp.watchdog")

BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopWatchdog:
    def __init__(self, registry: CollectorRegistry, interval_s: float = 0.02, warn_s: float = 0.1) -> None:
        self.interval_s, self.warn_s = interval_s, warn_s
        self.lag = Histogram("ntp_event_loop_lag_seconds", "how late the event loop ran a timer", registry=registry,
                             buckets=BUCKETS)
        self.lag_max = Gauge("ntp_event_loop_lag_max_seconds", "largest event-loop lag seen since start",
                             registry=registry)
        self.stalls = Counter("ntp_event_loop_stalls_total", "event-loop lags above the warning threshold",
                              registry=registry)
        self.gc_pause = Histogram("ntp_gc_pause_seconds", "full (generation 2) garbage collections",
                                  registry=registry, buckets=BUCKETS)
        self._gc_t0 = 0.0
        self.max_lag_s = 0.0
        self.window_max_s = 0.0  # largest lag since the last `take_window_max()`
        self.samples = 0
        self.stall_stacks: collections.deque[str] = collections.deque(maxlen=32)  # where the loop was held
        self._beat = time.monotonic()
        self._loop_thread: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take_window_max(self) -> float:
        """The largest lag since the previous call (for benchmarks and tests)."""
        v, self.window_max_s = self.window_max_s, 0.0
        return v

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._stop.clear()
        # the loop is not held now: without this the thread would measure from the last beat of an
        # earlier run, or from construction (a standby starts the watchdog only when it takes over,
        # and every takeover logged a false "event loop is blocked" as long as it had stood by)
        self._beat = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()
        gc.callbacks.append(self._on_gc)
        try:
            while True:
                t0 = loop.time()
                await asyncio.sleep(self.interval_s)
                self._beat = time.monotonic()  # before anything else runs: the stall has ended
                self.record(max(0.0, loop.time() - t0 - self.interval_s))
        finally:
            self._stop.set()
            with contextlib.suppress(ValueError):
                gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._gc_t0 = time.perf_counter()
            return
        pause = time.perf_counter() - self._gc_t0
        self.gc_pause.observe(pause)
        if pause > self.warn_s:
            log.warning("garbage collection paused every thread", paused_ms=round(pause * 1000, 1),
                        collected=info.get("collected", 0))

    def record(self, lag: float) -> None:
        self.samples += 1
        self.lag.observe(lag)
        self.window_max_s = max(self.window_max_s, lag)
        if lag > self.max_lag_s:
            self.max_lag_s = lag
            self.lag_max.set(lag)
        if lag > self.warn_s:
            self.stalls.inc()
            log.warning("event loop was blocked", blocked_ms=round(lag * 1000, 1), limit_ms=self.warn_s * 1000)

    def _watch(self) -> None:
        warned_for = -1.0
        while not self._stop.wait(self.interval_s):
            beat = self._beat
            held = time.monotonic() - beat - self.interval_s
            if held > self.warn_s and beat != warned_for:
                warned_for = beat
                where = self._stack()
                self.stall_stacks.append(where)
                log.warning("event loop is blocked", blocked_ms=round(held * 1000, 1), where=where)

    def _stack(self) -> str:
        if self._loop_thread is None:
            return ""
        frame = sys._current_frames().get(self._loop_thread)
        if frame is None:
            return ""
        with contextlib.suppress(Exception):
            return "".join(traceback.format_stack(frame, limit=8)).strip()
        return ""
