"""A TP group with degraded (fail-slow) members: keep them, or drop the slowest (pure).

A degraded GPU runs at a measured speed factor s < 1 (topology.Gpu.speed). A TP group computes at
the pace of its slowest member, so a group of degree k whose slowest kept member runs at p does
the work of a healthy group at speed p. What that is worth comes from the planner's own
throughput model (JobSpec.reduced_batch): the local batch a replica can run at degree k and speed
p without its step taking longer than a healthy replica's,

    keep:     value(n, p_n)         every usable member, at the slowest one's pace
    exclude:  value(k, p_k)         the k fastest members, k in min_tp .. n-1 (dropping the slowest
                                    first; among equal speeds the later TP rank)

Under ntp-pw the speed is raised by the power the GPUs may draw (up to the boost that restores the
healthy step time, capped by `max_boost` and the GPUs' maximum limits; the rack's budget is
granted later, by planner/power.py, for the option chosen), so a group can keep a slightly slow
member and run boosted at full batch.

Hysteresis: changing what the running layout does costs a reshard, so the option the previous
layout took (kept or excluded, read from its member list; keep when there is none) stands unless
the other is better by more than `min_gain` (relative, at least one sample). A GPU whose measured
speed moves a little around the point where the two options are equal does not flip the layout.

Swapping in a spare group is not decided here: a group's value becomes its packing key, and the
packer and the selection (planner/plan.py) prefer a full-speed spare group over a slow one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from ntp_manager.planner.spec import JobSpec, Scheme

MIN_GAIN = 0.02  # relative gain the other option must bring before the layout changes


@dataclass(frozen=True, slots=True)
class SlowChoice:
    action: Literal["keep", "exclude"]
    kept: tuple[int, ...]  # indices of the members kept, in TP order
    pace: float  # speed of the slowest kept member
    value: int  # local batch the option allows (the group alone)
    other: int  # local batch of the best option not taken
    reason: str


def group_value(job: JobSpec, degree: int, pace: float, boost_cap: float = 1.0) -> int:
    """Local batch a replica at `degree` can run when its GPUs compute at `pace` (ntp-pw: raised by
    power, up to `boost_cap` x nominal, as far as restoring the healthy step time needs)."""
    speed = pace
    if job.scheme is Scheme.NTP_PW and boost_cap > 1.0:
        need = job.speed_needed(degree) / pace
        power = min(boost_cap, max(1.0, job.power.useful_power(need)))
        speed = pace * job.power.speed(power)
    return job.reduced_batch(degree, speed)


def choose(job: JobSpec, gid: str, names: Sequence[str], speeds: Sequence[float], *,
           was_excluded: bool | None = None, boost_cap: float = 1.0, min_gain: float = MIN_GAIN,
           value: Callable[[JobSpec, int, float, float], int] = group_value) -> SlowChoice:
    """Keep or exclude for one group of usable members `names` (TP order) at `speeds`.

    `was_excluded`: whether the previous layout ran this group without (some of) its slow members
    (True), with all of them (False), or did not place it (None). Precondition: at least one speed
    is below 1 and len(names) >= job.min_tp."""
    n = len(names)
    keep_pace = min(speeds)
    keep_value = value(job, n, keep_pace, boost_cap)
    order = sorted(range(n), key=lambda i: (-speeds[i], i))  # fastest first; ties: earlier rank first
    best: tuple[int, int, float] | None = None  # (value, k, pace)
    for k in range(n - 1, job.min_tp - 1, -1):
        pace = speeds[order[k - 1]]
        v = value(job, k, pace, boost_cap)
        if best is None or v > best[0]:
            best = (v, k, pace)
    slow = ", ".join(f"{names[i]} at {speeds[i]:.2f}" for i in range(n) if speeds[i] < 1.0)
    head = f"group {gid}: degraded {slow}: keeping TP{n} at pace {keep_pace:.2f} allows batch {keep_value}"
    if best is None:
        return SlowChoice("keep", tuple(range(n)), keep_pace, keep_value, keep_value,
                          f"{head}; min_tp {job.min_tp} allows no exclusion: keep")
    ex_value, ex_k, ex_pace = best
    dropped = sorted(order[ex_k:])
    head += (f"; dropping {', '.join(names[i] for i in dropped)} (TP{ex_k} at pace {ex_pace:.2f}) "
             f"allows {ex_value}")

    def better(a: int, b: int) -> bool:
        return a > b and a >= b * (1 + min_gain)

    if was_excluded:
        exclude = not better(keep_value, ex_value)
        note = "the running layout excludes it"
    else:
        exclude = better(ex_value, keep_value)
        note = "the running layout keeps it" if was_excluded is False else "a reshard is not free"
    if exclude:
        kept = tuple(sorted(order[:ex_k]))
        return SlowChoice("exclude", kept, ex_pace, ex_value, keep_value,
                          f"{head}: exclude ({note}; the other option must gain > {min_gain:.0%})")
    return SlowChoice("keep", tuple(range(n)), keep_pace, keep_value, ex_value,
                      f"{head}: keep ({note}; the other option must gain > {min_gain:.0%})")
