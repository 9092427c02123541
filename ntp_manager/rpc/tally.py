"""Log lines that come in storms, coalesced: one line per period with a count, not one per event.

After a failover or a restart the whole fleet reconnects within a second or two; a JSON log line
per agent (written on the event loop) is manager CPU that delays the agent whose report carries
a failure, and says nothing the audit log does not (every registration and re-hello is audited
by name). So an event that comes alone is logged at once with its fields, as before; the ones that
follow within `period_s` are counted and logged together at the end of the period (how many, and
the first few names).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any


class Tally:
    def __init__(self, logger: Any, event: str, period_s: float = 1.0, names: int = 10,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = logger
        self.clock = clock
        self.event = event
        self.period_s = period_s
        self.names = names
        self._quiet_until = 0.0  # monotonic: until then, events are counted, not logged one by one
        self._count = 0
        self._first: list[str] = []
        self._flush: asyncio.TimerHandle | None = None

    def add(self, name: str, **fields: Any) -> None:
        """One event about `name` (a node, a worker); `fields` go on its line when it is logged alone."""
        now = self.clock()
        if now >= self._quiet_until and self._count == 0:
            self.log.info(self.event, node=name, **fields)
            self._quiet_until = now + self.period_s
            return
        self._count += 1
        if len(self._first) < self.names:
            self._first.append(name)
        if self._flush is None:
            delay = max(0.0, self._quiet_until - now)
            self._flush = asyncio.get_running_loop().call_later(delay, self.flush)

    def flush(self) -> None:
        """Log what was counted (if anything) and start a new period."""
        self._flush = None
        if self._count:
            self.log.info(self.event, count=self._count, first=self._first, coalesced_s=self.period_s)
        self._count, self._first = 0, []
        self._quiet_until = self.clock() + self.period_s
