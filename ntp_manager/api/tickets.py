"""One-time tickets for the dashboard's event stream.

A browser's EventSource cannot send an Authorization header, and a token in a URL ends up in
history, logs and Referer headers. So the page, which holds the token in session storage, asks
`POST /v1/stream/tickets` (with the header) for a ticket: random, good for `TTL_S` seconds and
for one use, bound to the token it was issued for (revoking the token voids its tickets and ends
the streams opened with them). At most `MAX_OUTSTANDING` tickets exist; the oldest go first.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from ntp_manager.auth import Principal

TTL_S = 30.0
MAX_OUTSTANDING = 10_000


class Tickets:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._open: dict[str, tuple[float, Principal]] = {}

    def issue(self, principal: Principal) -> str:
        now = self.clock()
        for t in [t for t, (exp, _) in self._open.items() if exp <= now]:
            del self._open[t]
        while len(self._open) >= MAX_OUTSTANDING:
            del self._open[next(iter(self._open))]
        ticket = secrets.token_urlsafe(24)
        self._open[ticket] = (now + TTL_S, principal)
        return ticket

    def redeem(self, ticket: str) -> Principal | None:
        """The principal the ticket was issued to, once; None if unknown, used or expired."""
        entry = self._open.pop(ticket, None)
        if entry is None or entry[0] <= self.clock():
            return None
        return entry[1]
