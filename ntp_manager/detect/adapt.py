"""What to do with a TP group that has slow members: the ResiHP rule, as a pure function.

A TP group runs at the pace of its slowest member, so its throughput is proportional to
    degree x (speed of its slowest member)
relative to a healthy group of the full degree at speed 1. Among subsets of a given degree k the
k fastest members are best, so only n - min_tp + 1 candidates need comparing:
- keep: all n members, at the slowest one's speed;
- boost (when the caller has power headroom, `boost` > 1): all n, the members slower than 1 sped
  up by `boost` (a power raise, as ntp-pw does), the pace then being the slowest after the raise;
- exclude: the k fastest members for the k in min_tp..n-1 that scores best.
Exclusion is chosen only when it beats the better of keep and boost by at least `min_gain`
(a reshard is not free); boost only when it beats keep at all. Ties keep the group as it is.

The caller decides what `boost` is worth: a GPU that is slow because it is thermally throttled
gains nothing from a higher power limit (pass None), one held back by its power cap does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum


class AdaptError(ValueError):
    """Invalid input to `adapt`; the message names it."""


class Action(StrEnum):
    KEEP = "keep"
    BOOST = "boost"
    EXCLUDE = "exclude"


@dataclass(frozen=True, slots=True)
class AdaptDecision:
    action: Action
    keep: tuple[str, ...]  # members that stay, in the order given
    exclude: tuple[str, ...]  # members that leave (empty unless action is exclude)
    degree: int
    throughput: float  # degree x pace / n: 1.0 is the healthy full group
    keep_throughput: float  # what keeping every member unchanged gives, same scale
    reason: str


def adapt(
    speeds: Mapping[str, float], min_tp: int, *, boost: float | None = None, min_gain: float = 0.02,
) -> AdaptDecision:
    """Decide keep / boost / exclude for one TP group.

    `speeds`: each member's speed factor (1.0 healthy; 1 / a Slow verdict's factor), in TP-rank
    order. `min_tp`: the lowest degree the job tolerates (1..n). `boost`: speed-up the slow members
    would get from the power headroom available (> 1), or None. `min_gain`: relative gain an
    exclusion must bring (>= 0). Raises AdaptError on bad input.
    """
    n = len(speeds)
    if n == 0:
        raise AdaptError("speeds must name at least one member")
    for gpu, s in speeds.items():
        if not (isinstance(s, int | float) and math.isfinite(s) and 0 < s <= 10):
            raise AdaptError(f"speed of {gpu} must be a number in (0, 10], got {s!r}")
    if isinstance(min_tp, bool) or not isinstance(min_tp, int) or not 1 <= min_tp <= n:
        raise AdaptError(f"min_tp must be an integer in 1..{n} (the group's size), got {min_tp!r}")
    if boost is not None and not (math.isfinite(boost) and boost >= 1):
        raise AdaptError(f"boost must be a speed-up >= 1 or None, got {boost!r}")
    if not (math.isfinite(min_gain) and min_gain >= 0):
        raise AdaptError(f"min_gain must be >= 0, got {min_gain!r}")

    names = list(speeds)
    keep_pace = min(speeds.values())
    keep_tp = keep_pace  # n * pace / n
    best_action, best_tp, best_members = Action.KEEP, keep_tp, tuple(names)
    detail = f"keeping all {n} runs at {n} x {keep_pace:.2f} = {n * keep_pace:.2f}"

    if boost is not None and boost > 1:
        raised = [s * boost if s < 1 else s for s in speeds.values()]
        boost_pace = min(raised)
        detail += f"; boosting the slow members ({boost:.2f}x) runs at {n} x {boost_pace:.2f} = {n * boost_pace:.2f}"
        if boost_pace > keep_pace:
            best_action, best_tp = Action.BOOST, boost_pace

    # the k fastest members for each k < n; stable order so ties drop the later rank
    order = sorted(range(n), key=lambda i: (-speeds[names[i]], i))
    ex_tp, ex_k = 0.0, n
    for k in range(n - 1, min_tp - 1, -1):
        pace = speeds[names[order[k - 1]]]
        if k * pace / n > ex_tp:
            ex_tp, ex_k = k * pace / n, k
    if ex_k < n:
        kept = sorted(order[:ex_k])
        dropped = [names[i] for i in sorted(order[ex_k:])]
        detail += (
            f"; dropping {', '.join(dropped)} runs at {ex_k} x {speeds[names[order[ex_k - 1]]]:.2f} = {ex_tp * n:.2f}"
        )
        if ex_tp >= best_tp * (1 + min_gain):
            gain = ex_tp / best_tp - 1
            return AdaptDecision(
                action=Action.EXCLUDE, keep=tuple(names[i] for i in kept), exclude=tuple(dropped), degree=ex_k,
                throughput=ex_tp, keep_throughput=keep_tp,
                reason=f"exclude: {detail}; +{gain:.1%} over {best_action.value} (>= min_gain {min_gain:.0%})",
            )
    else:
        detail += f"; min_tp {min_tp} allows no exclusion"
    verb = "boost" if best_action is Action.BOOST else "keep"
    return AdaptDecision(
        action=best_action, keep=best_members, exclude=(), degree=n, throughput=best_tp, keep_throughput=keep_tp,
        reason=f"{verb}: {detail}",
    )
