"""Reservations: a job's `spares` are held for it in the free pool, not owned (issue 41).

A job admitted without named `domains` owns whole domains for its replicas' groups only and
reserves `spares` TP groups (of its `tp`) in the pool. While its planned throughput is below full
(a failure it could not make up), the pool grants it domains against that reservation (kind
`reserved`); those groups count as granted until the domain goes back to the pool, when the
reservation is outstanding again. A job naming its `domains` reserves nothing (the groups of its
named domains beyond its replicas' are its spares, owned).

The pool must cover every placed job's outstanding reservation at all times we decide it: a new
job is admitted only if the free domains left after its own still hold them (`earmark`), and a
grant beyond a reservation (`min_throughput`) uses only free domains no reservation needs. The
earmark is a plan, not a holding: it is recomputed from the world each time (pure, here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from ntp_manager.service.core.state import JobRec

RESERVED = "reserved"  # allocations.kind of a domain granted against a job's reservation


@dataclass(frozen=True)
class Need:
    """A job's outstanding reservation: `groups` TP groups of `tp` GPUs."""

    job: str
    tp: int
    groups: int
    reserved: int  # the whole reservation (granted + outstanding)


def order(rec: JobRec) -> tuple[int, float, str]:
    """The order the pool serves jobs in: highest priority, then arrival, then name."""
    return (-rec.policy.priority, rec.created_at.timestamp() if rec.created_at else 0.0, rec.name)


def reserved_groups(rec: JobRec) -> int:
    """TP groups `rec` reserves in the pool: its spares, unless it names its domains (0 then)."""
    return 0 if rec.spec.domains else rec.spec.spares


def granted_groups(rec: JobRec, groups_in: Callable[[str, int], int]) -> int:
    """TP groups of `rec`'s tp in the domains it holds against its reservation."""
    return sum(groups_in(d, rec.spec.tp) for d, kind in rec.held.items() if kind == RESERVED)


def need_of(rec: JobRec, groups_in: Callable[[str, int], int]) -> Need:
    """`rec`'s outstanding reservation (a pending job holds none: it reserves once placed)."""
    r = reserved_groups(rec) if rec.held else 0
    return Need(rec.name, rec.spec.tp, max(0, r - granted_groups(rec, groups_in)) if r else 0, r)


def needs(jobs: Iterable[JobRec], groups_in: Callable[[str, int], int],
          order: Callable[[JobRec], tuple[int, float, str]]) -> list[Need]:
    """Every placed job's outstanding reservation, in the order the pool serves them."""
    out = [need_of(j, groups_in) for j in sorted(jobs, key=order)]
    return [n for n in out if n.groups > 0]


def earmark(free: Sequence[tuple[str, int]], wanted: Sequence[Need],
            choose: Callable[[Iterable[tuple[str, int]], int], list[str] | None]
            ) -> tuple[dict[str, list[str]], list[Need]]:
    """Which free domains (id, GPUs) would cover each outstanding reservation, in the order of
    `wanted` (each takes whole domains as admission does: `choose`); and the reservations the
    rest of the pool cannot cover. A greedy, deterministic plan: O(jobs x free domains log)."""
    left = dict(free)
    marks: dict[str, list[str]] = {}
    short: list[Need] = []
    for n in wanted:
        chosen = choose(((d, g // n.tp) for d, g in left.items()), n.groups)
        if chosen is None:
            short.append(n)
            continue
        marks[n.job] = chosen
        for d in chosen:
            del left[d]
    return marks, short


def describe(wanted: Sequence[Need]) -> str:
    """The reservations holding the pool's capacity, for a refusal (at most 8 named)."""
    parts = [f"job {n.job!r} reserves {n.groups} group(s) of tp={n.tp}" for n in wanted[:8]]
    more = f" and {len(wanted) - 8} more" if len(wanted) > 8 else ""
    return "; ".join(parts) + more if parts else "none"
