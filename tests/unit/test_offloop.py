"""service/core/offloop.py: the garbage collector is off while off-loop work runs, across overlapping
callers and errors, and comes back as it was."""

from __future__ import annotations

import asyncio
import gc
import threading

import pytest

from ntp_manager.service.core import offloop


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


def test_a_large_cluster_snapshot_is_kept_out_of_full_collections(monkeypatch: pytest.MonkeyPatch) -> None:
    # a served manager (server.py turns this on): the planner's snapshot of >= 10,000 GPUs (2 objects
    # per GPU) goes into the collector's permanent generation, so full collections skip it
    from ntp_manager.service.core.state import GpuRec, World

    w = World(gpus={f"GPU-{i}": GpuRec(f"GPU-{i}", f"n{i // 8}", f"d{i // 72}", i % 8, 1000, 100, 1300)
                    for i in range(10_000)}, domains={f"d{d}": None for d in range(140)})
    monkeypatch.setattr(offloop, "_frozen_at", -float("inf"))
    gc.collect()
    before = gc.get_freeze_count()
    offloop.freeze_long_lived()
    try:
        cluster = asyncio.run(w.cluster_async())
        assert gc.get_freeze_count() - before >= 2 * 10_000
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(g) in tracked for d in cluster.domains for g in d.gpus)
        # a second rebuild within 30 s is not frozen (cyclic garbage of the moment would be kept)
        frozen = gc.get_freeze_count()
        w.invalidate()
        again = asyncio.run(w.cluster_async())
        # (frozen objects that die leave the permanent generation: the count may fall, never grow)
        assert gc.get_freeze_count() <= frozen
        tracked = {id(o) for o in gc.get_objects()}
        assert all(id(g) in tracked for d in again.domains for g in d.gpus)
    finally:
        offloop.freeze_long_lived(False)
        gc.unfreeze()
