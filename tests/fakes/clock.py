"""A clock the test sets: `t` is monotonic seconds; wall time moves with it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta


class FakeClock:
    def __init__(self, t: float = 1000.0, wall: datetime = datetime(2030, 1, 1, tzinfo=UTC)) -> None:
        self.t = t
        self._t0 = t
        self.wall = wall

    def now(self) -> datetime:
        return self.wall + timedelta(seconds=self.t - self._t0)

    def monotonic(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds
