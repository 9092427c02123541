"""Unit maps for nonuniform tensor parallelism (docs/references.md, "NTP: units and the gradient sync").

A layer's work is split into *units* (attention heads or KV groups, MLP columns, vocabulary rows).
When a replica of TP degree `n_healthy` synchronises gradients with replicas of TP degree
`n_reduced` (< n_healthy), units are arranged as follows:

- *Sync partition*: units 0..U-1 are cut into `n_reduced` contiguous chunks, as even as possible
  (the first U mod n_reduced chunks get one unit more). Chunk i is owned by rank i of a reduced
  replica and by *core* rank i of a healthy one.
- *Healthy compute partition*: core rank i keeps a contiguous prefix of chunk i; the tails are lent
  to the `n_healthy - n_reduced` *extra* ranks so that every rank holds floor(U/n) or ceil(U/n)
  units. The "+1" loads go to core ranks first (they then lend less). Lent tails are handed out in
  order (core 0's tail first) and cut into the extras' loads, so each extra borrows a few contiguous
  ranges and every transfer is one contiguous slice.

Before the DP all-reduce each extra rank returns the gradients of its borrowed units to their core
ranks; after it, the core ranks send the synced values back. `ntp_map(U, n, n)` is the uniform case:
no extras, nothing to move.

Pure: used by the planner (per-rank work) and by the worker runtime (sharding and sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

Range = tuple[int, int]  # half-open [start, stop)


@dataclass(frozen=True, slots=True)
class Transfer:
    """`count` units starting at `start` move between a core rank and an extra rank."""

    core: int
    extra: int
    start: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.count


@dataclass(frozen=True, slots=True)
class NtpMap:
    units: int
    n_healthy: int
    n_reduced: int
    sync_chunks: tuple[Range, ...]  # per sync index i < n_reduced
    assignment: tuple[tuple[Range, ...], ...]  # per rank of the healthy replica, sorted ranges
    transfers: tuple[Transfer, ...]  # extra <-> core exchanges (empty when uniform)

    def units_of(self, rank: int) -> list[int]:
        """Unit indices computed by `rank` (of a replica at degree n_healthy), ascending."""
        return [u for a, b in self.assignment[rank] for u in range(a, b)]

    def load(self, rank: int) -> int:
        return sum(b - a for a, b in self.assignment[rank])

def even_chunks(units: int, parts: int) -> tuple[Range, ...]:
    """Cut 0..units-1 into `parts` contiguous ranges whose sizes differ by at most one."""
    base, rem = divmod(units, parts)
    out = []
    start = 0
    for i in range(parts):
        size = base + (1 if i < rem else 0)
        out.append((start, start + size))
        start += size
    return tuple(out)


def ntp_map(units: int, n_healthy: int, n_reduced: int) -> NtpMap:
    """Core/extra unit assignment for a degree-`n_healthy` replica syncing at degree `n_reduced`.

    Preconditions: units >= n_healthy >= n_reduced >= 1 (every rank must hold at least one unit).
    Raises ValueError otherwise."""
    return _ntp_map_cached(int(units), int(n_healthy), int(n_reduced))


@lru_cache(maxsize=4096)
def _ntp_map_cached(units: int, n_healthy: int, n_reduced: int) -> NtpMap:
    if n_reduced < 1:
        raise ValueError(f"reduced TP degree must be >= 1, got {n_reduced}")
    if n_healthy < n_reduced:
        raise ValueError(f"healthy TP degree {n_healthy} is below the reduced degree {n_reduced}")
    if units < n_healthy:
        raise ValueError(f"{units} units cannot be spread over {n_healthy} ranks (need one each)")

    chunks = even_chunks(units, n_reduced)
    if n_healthy == n_reduced:
        return NtpMap(units, n_healthy, n_reduced, chunks, tuple((c,) for c in chunks), ())

    q, r = divmod(units, n_healthy)
    # Target loads: q everywhere, the r "+1"s to core ranks first (largest chunks are first),
    # then to extras. A core's target never exceeds its chunk (see module doc / tests).
    targets = [q + (1 if i < r else 0) for i in range(n_healthy)]
    keep = []
    lent: list[tuple[int, int, int]] = []  # (core, start, count) tails in core order
    for i, (a, b) in enumerate(chunks):
        k = targets[i]
        if k > b - a:  # pragma: no cover - excluded by the arithmetic above
            raise AssertionError("core target exceeds its sync chunk")
        keep.append((a, a + k))
        if b - (a + k):
            lent.append((i, a + k, b - (a + k)))

    transfers: list[Transfer] = []
    extra_ranges: list[list[Range]] = [[] for _ in range(n_healthy - n_reduced)]
    li = 0
    core, start, left = lent[0] if lent else (0, 0, 0)
    for e in range(n_healthy - n_reduced):
        need = targets[n_reduced + e]
        while need:
            if left == 0:
                li += 1
                core, start, left = lent[li]
            take = min(need, left)
            transfers.append(Transfer(core, n_reduced + e, start, take))
            extra_ranges[e].append((start, start + take))
            start += take
            left -= take
            need -= take
    assignment = tuple((kp,) for kp in keep) + tuple(_merge(rs) for rs in extra_ranges)
    return NtpMap(units, n_healthy, n_reduced, chunks, assignment, tuple(transfers))


def _merge(ranges: list[Range]) -> tuple[Range, ...]:
    out: list[Range] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def max_units_per_rank(units: int, tp: int) -> int:
    """Most units any rank holds at degree `tp` (ceil(units / tp)); the planner's work measure."""
    return -(-units // tp)


def sync_groups(replica_ranks: Sequence[Sequence[int]]) -> list[list[int]]:
    """DP sync groups for one TP stage across replicas of possibly different TP degrees.

    `replica_ranks[k]` lists the global ranks of replica k's TP group in TP-rank order. The sync
    degree is the smallest TP degree present; group i (i < sync degree) joins rank i of every
    replica (core ranks of the larger ones); the larger replicas' extra ranks sync nothing across
    DP and appear as singleton groups, in replica then rank order.

    Worked example (docs/references.md): TP2 replica [0, 1] and TP4 replica [2, 3, 4, 5] give
    [[0, 2], [1, 3], [4], [5]]."""
    if not replica_ranks or any(len(r) == 0 for r in replica_ranks):
        raise ValueError("every replica needs at least one rank")
    n_sync = min(len(r) for r in replica_ranks)
    groups = [[r[i] for r in replica_ranks] for i in range(n_sync)]
    for r in replica_ranks:
        groups.extend([x] for x in r[n_sync:])
    return groups
