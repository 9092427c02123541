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
"""

from __future__ import annotations

import asyncio
import functools
import gc
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_lock = threading.Lock()
_depth = 0
_restore = False


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
