"""The circuit breaker: owns whether automatic replanning is stopped, why, and the window of recent
failures it counts.

Every transaction that fails GPUs asks `policy.breaker` before it commits; when the breaker opens,
its row and audit record are written in that same transaction, so the breaker's state and reason
are durable exactly when the failures that tripped it are (they survive any restart). Only an
operator closes it (`reset`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import structlog
from sqlalchemy.ext.asyncio import AsyncSession

from ntp_manager.service.core import policy
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.metrics import Metrics
from ntp_manager.settings import Settings
from ntp_manager.store.models import BreakerRow

log = structlog.get_logger("ntp.breaker")


class Breaker:
    def __init__(self, kernel: Kernel, settings: Settings, metrics: Metrics) -> None:
        self.kernel = kernel
        self.metrics = metrics
        self.options = policy.BreakerOptions(settings.breaker_window_s, settings.breaker_share,
                                             settings.breaker_min_gpus)
        self.open = False
        self.reason = ""
        self._failures: deque[float] = deque()  # monotonic times of failures inside the window
        kernel.before_commit.append(self.stage)
        kernel.after_commit.append(self.note)

    async def load(self, session: AsyncSession) -> None:
        row = await session.get(BreakerRow, 1)
        if row is not None:
            self.open, self.reason = row.open, row.reason if row.open else ""
        self.metrics.breaker.set(1 if self.open else 0)

    async def stage(self, tx: Tx) -> None:
        """Before a commit: open the breaker in the same transaction when its failures trip it."""
        if not tx.newly_failed:
            return
        horizon = self.kernel.clock.monotonic() - self.options.window_s
        while self._failures and self._failures[0] < horizon:
            self._failures.popleft()
        d = policy.breaker(self.open, len(self._failures), len(tx.newly_failed), len(self.kernel.world.gpus),
                           self.options)
        if not d.open:
            return
        await self._write(tx, True, d.reason)
        tx.audit(tx.now, "breaker.open", "breaker", reason=d.reason)

        def opened() -> None:
            self.open, self.reason = True, d.reason
            self.metrics.breaker.set(1)
            log.warning("circuit breaker open", reason=d.reason)

        tx.after.append(opened)

    def note(self, tx: Tx) -> None:
        """After a commit: its failures count in the window."""
        if tx.newly_failed:
            now = self.kernel.clock.monotonic()
            self._failures.extend(now for _ in tx.newly_failed)

    async def reset(self, tx: Tx, reason: str) -> dict[str, Any]:
        """Close the breaker (an operator's decision) and replan every job."""
        was = self.open
        await self._write(tx, False, reason)
        tx.audit(tx.now, "breaker.reset", "breaker", before={"open": was}, after={"open": False}, reason=reason)

        def closed() -> None:
            self.open, self.reason = False, ""
            self._failures.clear()
            self.metrics.breaker.set(0)
            self.kernel.mark_all_dirty()

        tx.after.append(closed)
        return {"open": False, "was_open": was}

    async def _write(self, tx: Tx, is_open: bool, reason: str) -> None:
        row = await tx.session.get(BreakerRow, 1)
        if row is None:
            tx.session.add(BreakerRow(id=1, open=is_open, reason=reason, changed_at=tx.now))
        else:
            row.open, row.reason, row.changed_at = is_open, reason, tx.now
