"""The fleet base power cap's arithmetic (issue 35: the agent computes a GPU's base limit for
`ntp-agent power-reset` and the manager for its power commands; both must agree, so it lives in
the contract). Standard library only (topology imports it)."""

from __future__ import annotations


def base_cap_w(min_w: float, default_w: float, max_w: float, ratio: float) -> float:
    """The base limit of a GPU under a fleet base cap `ratio` (a share of its maximum limit, in
    (0, 1]): ratio x max, raised to the GPU's minimum and never above its default limit (a base cap
    only ever lowers a healthy GPU). Any unit, the same for all three limits. Raises ValueError for
    a ratio outside (0, 1]."""
    if not 0 < ratio <= 1:
        raise ValueError(f"a base power cap is a share of the maximum limit in (0, 1], got {ratio}")
    return min(default_w, max(min_w, ratio * max_w))
