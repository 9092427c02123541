"""service/offloop.py: the garbage collector is off while off-loop work runs, across overlapping
callers and errors, and comes back as it was."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from ntp_manager.service import offloop


def test_collection_is_paused_while_work_runs_and_restored_after_overlapping_callers() -> None:
    assert gc.isenabled()
    inside = threading.Event()
    release = threading.Event()
    seen: list[bool] = []

    def slow() -> int:
        seen.append(gc.isenabled())
        inside.set()
        release.wait(5)
        return 1

    async def main() -> None:
        first = asyncio.ensure_future(offloop.run(slow))
        await asyncio.to_thread(inside.wait, 5)
        # a second caller ends while the first still runs: collection stays off
        assert await offloop.run(lambda: gc.isenabled()) is False
        assert not gc.isenabled()
        release.set()
        assert await first == 1

    asyncio.run(main())
    assert seen == [False] and gc.isenabled()
    with pytest.raises(ZeroDivisionError):
        offloop.paused(lambda: 1 // 0)
    assert gc.isenabled()
    gc.disable()
    try:  # off before: left off
        assert offloop.paused(lambda: 2) == 2 and not gc.isenabled()
    finally:
        gc.enable()
