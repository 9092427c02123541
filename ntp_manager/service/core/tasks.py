"""Background tasks: stopping a set of them, and one pass at a time run again if asked for meanwhile.

`cancel_all` cancels tasks and waits until each has ended, whatever it raised (a component's
`stop`). Some work is asked for by many commits in a row (place the pending jobs after domains were freed,
look at the jobs the pool could help) and is the same whoever asks: `Coalesced.later` starts a pass
soon, and while one runs it only notes that another is wanted, which starts when the current pass
ends. A pass that fails is logged and does not stop the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable

import structlog

log = structlog.get_logger("ntp.tasks")


async def cancel_all(tasks: Iterable[asyncio.Task[None] | None]) -> None:
    """Cancel `tasks` (None: none there) and wait for each to end; what they raise is theirs."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    for t in live:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


class Coalesced:
    def __init__(self, work: Callable[[], Awaitable[object]], name: str) -> None:
        self.work = work
        self.name = name  # the task's name, and what a failure's log line says failed
        self._task: asyncio.Task[None] | None = None
        self._again = False

    @property
    def busy(self) -> bool:
        """A pass is running (or about to start)."""
        return self._task is not None and not self._task.done()

    def later(self) -> None:
        """Run a pass soon (another one after the current pass, if one runs)."""
        if self.busy:
            self._again = True
            return
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def _run(self) -> None:
        while True:
            self._again = False
            try:
                await self.work()
            except Exception:
                log.exception("background pass failed", task=self.name)
            if not self._again:
                return
