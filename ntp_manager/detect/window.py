"""Hysteresis over fixed windows, for many keyed subjects at once (GPUs or TP groups).

Each subject has a ring of its last `capacity` values and the steps they belong to, and a flag
(plus, optionally, further rings of other quantities kept under the same slot).
`decide` applies the k-of-n rule to the subjects seen this step, vectorised:
- enter when >= enter_count of the last enter_window values are >= enter_level;
- exit when >= exit_count of the last exit_window values are <= exit_level.
A subject whose values sit between the two levels keeps its flag either way, which is what stops
flapping. Memory is capacity x subjects; subjects not seen for a while are dropped by `expire`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ntp_manager.detect.model import row_nanmedian

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class Rule:
    enter_level: float
    enter_window: int
    enter_count: int
    exit_level: float
    exit_window: int
    exit_count: int


class Ring:
    """Per-slot rings of the last `capacity` values and their steps."""

    def __init__(self, capacity: int, slots: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.values: FloatArray = np.full((slots, capacity), np.nan)
        self.steps: IntArray = np.full((slots, capacity), -1, dtype=np.int64)
        self.written: IntArray = np.zeros(slots, dtype=np.int64)

    def clear(self, s: int) -> None:
        self.values[s] = np.nan
        self.steps[s] = -1
        self.written[s] = 0

    def grow(self, n: int) -> None:
        old = len(self.written)
        self.values = np.vstack([self.values, np.full((n - old, self.capacity), np.nan)])
        self.steps = np.vstack([self.steps, np.full((n - old, self.capacity), -1, dtype=np.int64)])
        self.written = np.concatenate([self.written, np.zeros(n - old, dtype=np.int64)])

    def resize(self, capacity: int) -> None:
        """Change the ring length, keeping each slot's newest values in order."""
        if capacity == self.capacity:
            return
        n = len(self.written)
        keep = min(capacity, self.capacity)
        vals, steps = self.last(np.arange(n, dtype=np.int64), keep)  # newest last
        have = np.minimum(self.written, keep)
        # Re-lay each ring from index 0: the k newest values go to positions 0..k-1, oldest first,
        # which is where `last` reads them from once `written` is k.
        col = np.arange(capacity)[None, :]
        src = np.clip(col + keep - have[:, None], 0, keep - 1)
        ok = col < have[:, None]
        rows = np.arange(n)[:, None]
        self.values = np.where(ok, vals[rows, src], np.nan)
        self.steps = np.where(ok, steps[rows, src], -1)
        self.written = have.astype(np.int64)
        self.capacity = capacity

    def push(self, slots: IntArray, values: FloatArray, step: int) -> None:
        """Append one value per slot (slots unique), all for `step`."""
        pos = self.written[slots] % self.capacity
        self.values[slots, pos] = values
        self.steps[slots, pos] = step
        self.written[slots] += 1

    def last(self, slots: IntArray, n: int) -> tuple[FloatArray, IntArray]:
        """The last `n` (<= capacity) values and their steps per slot, oldest first; NaN / -1 where
        a slot has fewer."""
        if n > self.capacity:
            raise ValueError(f"window {n} exceeds the ring capacity {self.capacity}")
        back = np.arange(n - 1, -1, -1, dtype=np.int64)  # n-1 .. 0 steps back
        idx = (self.written[slots, None] - 1 - back[None, :]) % self.capacity
        vals = self.values[slots[:, None], idx]
        steps = self.steps[slots[:, None], idx]
        missing = back[None, :] >= self.written[slots, None]
        return np.where(missing, np.nan, vals), np.where(missing, -1, steps)

    def median(self, slots: IntArray, n: int) -> FloatArray:
        return row_nanmedian(self.last(slots, n)[0])


class Tracker:
    """Keyed subjects, each with a main ring (what `decide` judges), optional named channel rings,
    and a k-of-n enter/exit flag. Not thread-safe."""

    def __init__(self, capacity: int, initial_slots: int = 64) -> None:
        self._keys: list[str | None] = []
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        n = max(1, initial_slots)
        self.main = Ring(capacity, n)
        self.channels: dict[str, Ring] = {}
        self.flag: BoolArray = np.zeros(n, dtype=np.bool_)
        self.since: IntArray = np.full(n, -1, dtype=np.int64)
        self.reported: FloatArray = np.full(n, np.nan)  # last factor issued while flagged
        self.last_seen: IntArray = np.full(n, -1, dtype=np.int64)
        self.aux: FloatArray = np.full(n, np.nan)  # a per-subject scalar its owner keeps (NaN: unset)

    @property
    def capacity(self) -> int:
        return self.main.capacity

    @property
    def values(self) -> FloatArray:
        return self.main.values

    def add_channel(self, name: str, capacity: int) -> Ring:
        ring = self.channels[name] = Ring(capacity, len(self.flag))
        return ring

    # ---- subjects -------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._slot)

    def keys(self) -> list[str]:
        return list(self._slot)

    def key(self, slot: int) -> str:
        k = self._keys[slot]
        assert k is not None
        return k

    def slot_of(self, key: str) -> int | None:
        return self._slot.get(key)

    def slots_for(self, keys: Sequence[str]) -> IntArray:
        """Slots of `keys`, allocating fresh (empty, unflagged) ones for new subjects."""
        get = self._slot.get
        found = [get(k) for k in keys]
        if None in found:
            found = [s if s is not None else self._allocate(k) for k, s in zip(keys, found, strict=True)]
        return np.array(found, dtype=np.int64)

    def _allocate(self, key: str) -> int:
        if self._free:
            s = self._free.pop()
            self._keys[s] = key
        else:
            s = len(self._keys)
            self._keys.append(key)
            if s >= len(self.flag):
                self._grow(2 * len(self.flag))
        self._slot[key] = s
        self._clear(s)
        return s

    def _rings(self) -> list[Ring]:
        return [self.main, *self.channels.values()]

    def _clear(self, s: int) -> None:
        for r in self._rings():
            r.clear(s)
        self.flag[s] = False
        self.since[s] = -1
        self.reported[s] = np.nan
        self.last_seen[s] = -1
        self.aux[s] = np.nan

    def _grow(self, n: int) -> None:
        old = len(self.flag)
        for r in self._rings():
            r.grow(n)
        self.flag = np.concatenate([self.flag, np.zeros(n - old, dtype=np.bool_)])
        self.since = np.concatenate([self.since, np.full(n - old, -1, dtype=np.int64)])
        self.reported = np.concatenate([self.reported, np.full(n - old, np.nan)])
        self.last_seen = np.concatenate([self.last_seen, np.full(n - old, -1, dtype=np.int64)])
        self.aux = np.concatenate([self.aux, np.full(n - old, np.nan)])

    def forget(self, keys: Iterable[str]) -> list[str]:
        """Drop subjects (their windows and flags); returns those that were known."""
        gone = []
        for k in keys:
            s = self._slot.pop(k, None)
            if s is not None:
                self._keys[s] = None
                self._clear(s)
                self._free.append(s)
                gone.append(k)
        return gone

    def expire(self, step: int, idle_steps: int) -> list[str]:
        """Forget subjects last seen more than `idle_steps` before `step`."""
        if not self._slot:
            return []
        live = np.fromiter(self._slot.values(), dtype=np.int64, count=len(self._slot))
        old = live[self.last_seen[live] < step - idle_steps]
        return self.forget([self.key(int(s)) for s in old])

    # ---- the main ring and the rule -----------------------------------------------------------------

    def resize(self, capacity: int) -> None:
        self.main.resize(capacity)

    def push(self, slots: IntArray, values: FloatArray, step: int) -> None:
        self.main.push(slots, values, step)
        self.last_seen[slots] = step

    def last(self, slots: IntArray, n: int) -> tuple[FloatArray, IntArray]:
        return self.main.last(slots, n)

    def decide(self, slots: IntArray, rule: Rule) -> tuple[IntArray, IntArray]:
        """Apply the rule to `slots`; update flags and onsets; return (entered, exited) slots."""
        if len(slots) == 0:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty
        w = max(rule.enter_window, rule.exit_window)
        allv, alls = self.last(slots, w)
        vals, steps = allv[:, w - rule.enter_window :], alls[:, w - rule.enter_window :]
        above = vals >= rule.enter_level  # NaN compares False
        enter = ~self.flag[slots] & (above.sum(axis=1) >= rule.enter_count)
        below = allv[:, w - rule.exit_window :] <= rule.exit_level
        leave = self.flag[slots] & (below.sum(axis=1) >= rule.exit_count)
        entered = slots[enter]
        if len(entered):
            onset = np.where(above[enter], steps[enter], np.iinfo(np.int64).max).min(axis=1)
            self.flag[entered] = True
            self.since[entered] = onset
        exited = slots[leave]
        self.flag[exited] = False
        self.reported[exited] = np.nan
        return entered, exited

    def median_last(self, slots: IntArray, n: int) -> FloatArray:
        return self.main.median(slots, n)

    def median_since_onset(self, slots: IntArray, n: int) -> FloatArray:
        """Median of the last `n` values that belong to steps at or after each slot's onset: the
        factor of a flagged subject, not diluted by the healthy steps before it turned."""
        vals, steps = self.last(slots, n)
        vals = np.where(steps >= self.since[slots, None], vals, np.nan)
        return row_nanmedian(vals)

    def flagged(self) -> list[str]:
        return [k for k, s in self._slot.items() if self.flag[s]]
