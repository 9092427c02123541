"""The pure decisions of checkpoints: who writes which units (`write_ranges`), how a shard's units
fall into contiguous stretches (`stretches`), and which checkpoints to keep (`retention_plan`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ntp_manager.contract.ntp_map import even_chunks
from ntp_manager.worker.sync import SyncLayout


def write_ranges(layout: SyncLayout, rank: int) -> dict[str, tuple[int, int]]:
    """Family -> the units [start, stop) that `rank`'s replica writes: a family's units cut into
    one contiguous range per replica (sizes differ by at most one). Within the replica exactly one
    rank holds each unit, so every unit is written once in the job."""
    ri, _ = layout.locate(rank)
    return {f: even_chunks(n, len(layout.replicas))[ri] for f, n in layout.units.items()}


def stretches(units: Sequence[int], lo: int = 0, hi: int | None = None) -> list[tuple[int, int, int]]:
    """(first unit, its position in `units`, count) of every stretch of units in [lo, hi) that
    are consecutive both as unit numbers and as positions in `units` (a shard's unit list, so a
    stretch is one contiguous slice of the shard), in unit order."""
    pairs = sorted((u, i) for i, u in enumerate(units) if u >= lo and (hi is None or u < hi))
    out: list[tuple[int, int, int]] = []
    for u, i in pairs:
        if out and out[-1][0] + out[-1][2] == u and out[-1][1] + out[-1][2] == i:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((u, i, 1))
    return out


@dataclass(frozen=True)
class Retention:
    """Keep the newest `keep_last` good checkpoints, and also every one whose step is a multiple
    of `keep_every` (0: none). Steps, not positions, so the choice does not shift as checkpoints
    are removed."""

    keep_last: int = 3
    keep_every: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"keep_last must be a positive integer, got {self.keep_last!r}")
        if not isinstance(self.keep_every, int) or self.keep_every < 0:
            raise ValueError(f"keep_every must be a non-negative integer, got {self.keep_every!r}")


@dataclass(frozen=True)
class RetentionDecision:
    keep: tuple[int, ...]
    delete: tuple[int, ...]
    reasons: dict[int, str]


def retention_plan(steps: Iterable[int], policy: Retention, bad: Iterable[int] = ()) -> RetentionDecision:
    """Which complete checkpoints (by step) to keep and which to delete, with a reason for each.
    `bad` ones (a load found them corrupt) do not count towards `keep_last` and are deleted
    unless `keep_every` keeps them -- a kept multiple is kept as evidence even when bad."""
    bad_set = set(bad)
    ordered = sorted(set(steps), reverse=True)
    good = [s for s in ordered if s not in bad_set]
    newest = set(good[: policy.keep_last])
    keep, delete, reasons = [], [], {}
    for s in ordered:
        if s in newest:
            keep.append(s)
            reasons[s] = f"one of the newest {policy.keep_last} good"
        elif policy.keep_every and s % policy.keep_every == 0:
            keep.append(s)
            reasons[s] = f"a multiple of keep_every={policy.keep_every}"
        else:
            delete.append(s)
            reasons[s] = "failed verification" if s in bad_set else f"older than the newest {policy.keep_last} good"
    return RetentionDecision(tuple(sorted(keep)), tuple(sorted(delete)), reasons)
