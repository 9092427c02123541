"""Work that grows with the cluster, run off the event loop: in a worker thread, with Python's
cyclic garbage collector paused while it runs.

A thread keeps the loop's thread from running only while it holds the GIL, and it gives the GIL
up every switch interval (0.5 ms in the service), except inside a single C call. A garbage
collection is one: whichever thread triggers it scans every object of the generations it
collects, holding the GIL throughout. Planning a job of 100K one-GPU replicas makes about a
million short-lived objects (the planner's records); their allocations trigger collections that
scan them (a generation-1 collection over them took 0.4 s on the bench VM), and nothing they hold
is cyclic: they are freed by reference counting when the work ends. So while any such work runs,
automatic collection is off (process-wide, counted across overlapping callers, and restored only if
it was on); what the loop allocates meanwhile is collected after.

Long-lived results of such work are kept out of the collector too (`keep_out_of_gc`): the planner's
snapshot of a 100K-GPU cluster is 200,000 objects, built after start-up, and every automatic full
(generation-2) collection walked them: 63-118 ms holding the GIL, on a loaded 2-core VM
(bench/loop_costs.py). A served process (server.py) turns this on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_lock = threading.Lock()
_depth = 0
_restore = False
_freezing = False
_frozen_at = -float("inf")


def freeze_long_lived(enable: bool = True) -> None:
    """Let `keep_out_of_gc` freeze (a served process; not tests, whose many managers would be kept)."""
    global _freezing
    _freezing = enable


def keep_out_of_gc(every_s: float = 30.0) -> None:
    """Move everything the cyclic collector tracks now into its permanent generation (`gc.freeze`,
    O(1)): call it right after a large long-lived structure was made. Frozen objects are still
    freed by reference counting when dropped; only cyclic garbage that exists at this moment is
    never collected, so call it rarely (after a world load, after a cluster snapshot is rebuilt for
    new GPUs), and at most once per `every_s` (a registration storm rebuilds the snapshot often:
    what is built meanwhile stays tracked, which costs time, not memory). Does nothing
    unless `freeze_long_lived()` was called."""
    global _frozen_at
    now = time.monotonic()
    if _freezing and now - _frozen_at >= every_s:
        if every_s > 0:  # a forced one (a world load) does not delay the next snapshot's
            _frozen_at = now
        gc.freeze()


def paused(fn: Callable[[], T]) -> T:
    """`fn()` with automatic garbage collection off while it runs."""
    global _depth, _restore
    with _lock:
        if _depth == 0:
            _restore = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        return fn()
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _restore:
                gc.enable()


async def run(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` in a worker thread, garbage collection paused (see the module)."""
    return await asyncio.to_thread(paused, functools.partial(fn, *args, **kwargs))


WORKERS = min(32, (os.cpu_count() or 1) + 4)  # the size asyncio's default executor would have
_warmed: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


async def warm() -> None:
    """Give the running loop a default executor whose WORKERS threads already run. The default
    one starts a thread the first time it has no idle one, and `Thread.start` waits until the new
    thread is scheduled: on a loaded machine that wait, on the loop's thread, was a stall of its
    own (seen in bench/layouts.py's stall sites). Done once per loop, here, at start-up."""
    loop = asyncio.get_running_loop()
    if loop in _warmed:
        return
    _warmed.add(loop)
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="offloop")
    loop.set_default_executor(pool)
    everyone = threading.Barrier(WORKERS)

    def arrive() -> None:  # each blocks until all have started: one thread per task
        with contextlib.suppress(threading.BrokenBarrierError):
            everyone.wait(timeout=30)

    await asyncio.gather(*(loop.run_in_executor(pool, arrive) for _ in range(WORKERS)))
