"""A new layout's views are built once and shared by every watch of the job (rpc/workers.py). The
watches that waited for the build go on to push a few at a time, one batch per pass of the event
loop: resumed all together, 667 pushes held a manager's loop for 113-160 ms (bench/RESULTS.md)."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any, cast

from ntp_manager.planner import make_plan
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.rpc import workers
from ntp_manager.rpc.workers import TURNS, WorkerService
from ntp_manager.service.core.state import LayoutRec
from tests.fakes.builders import cluster_from_counts, job


async def test_watches_that_waited_for_a_build_go_on_a_few_per_pass_of_the_loop() -> None:
    doc = LayoutDoc.of(make_plan(cluster_from_counts([4] * 8), job(tp=4, replicas=8)))
    rec = LayoutRec("llm", 2, 1, doc, "a GPU failed", dt.datetime.now(dt.UTC))
    svc = WorkerService(cast(Any, None), cast(Any, None), cast(Any, None), cast(Any, None))
    passes = 0
    ticking = True

    def tick() -> None:  # counts the loop's passes: a callback that schedules itself again
        nonlocal passes
        passes += 1
        if ticking:
            asyncio.get_running_loop().call_soon(tick)

    got: list[tuple[int, Any]] = []

    async def watch() -> None:
        v = await svc.views("llm", rec)
        got.append((passes, v))

    asyncio.get_running_loop().call_soon(tick)
    await asyncio.gather(*(watch() for _ in range(100)))
    ticking = False
    assert len(got) == 100 and len({id(v) for _, v in got}) == 1  # one build, shared
    per_pass: dict[int, int] = {}
    for p, _ in got:
        per_pass[p] = per_pass.get(p, 0) + 1
    assert max(per_pass.values()) <= TURNS, per_pass
    assert len(per_pass) >= 100 // TURNS
    # once built, a watch gets its views at once, without waiting a turn
    before = passes
    assert await svc.views("llm", rec) is got[0][1] and passes == before


async def test_without_turns_every_waiting_watch_goes_in_the_same_pass(monkeypatch: Any) -> None:
    """The control: with turns as wide as the crowd, all 100 go on in one pass (so the test above
    can fail)."""
    monkeypatch.setattr(workers, "TURNS", 1000)
    doc = LayoutDoc.of(make_plan(cluster_from_counts([4] * 8), job(tp=4, replicas=8)))
    rec = LayoutRec("llm", 2, 1, doc, "", dt.datetime.now(dt.UTC))
    svc = WorkerService(cast(Any, None), cast(Any, None), cast(Any, None), cast(Any, None))
    passes = 0
    ticking = True

    def tick() -> None:
        nonlocal passes
        passes += 1
        if ticking:
            asyncio.get_running_loop().call_soon(tick)

    seen: list[int] = []

    async def watch() -> None:
        await svc.views("llm", rec)
        seen.append(passes)

    asyncio.get_running_loop().call_soon(tick)
    await asyncio.gather(*(watch() for _ in range(100)))
    ticking = False
    assert len(set(seen)) <= 2, seen  # all in one pass (two if the build ended between two of them)
