"""The event-loop watchdog (service/operations/watchdog.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from prometheus_client import CollectorRegistry

from ntp_manager.service.operations.watchdog import LoopWatchdog


async def test_a_watchdog_started_late_measures_from_its_start_not_from_construction() -> None:
    """A standby constructs its watchdog at start-up and runs it only when it takes over the lease;
    the stall thread must not count the standby period as a blocked loop."""
    w = LoopWatchdog(CollectorRegistry(), interval_s=0.5, warn_s=5.0)
    w._beat -= 60  # constructed a minute ago (a standby that stood by that long)
    before = time.monotonic()
    task = asyncio.create_task(w.run())
    try:
        await asyncio.sleep(0)  # run() has begun (and started its thread); no beat of the loop yet
        assert w._beat >= before  # the thread measures from now
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert not w.stall_stacks
