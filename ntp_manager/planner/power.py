"""Power boost for reduced TP groups (NTP-PW), within a rack's budget.

Power is counted against each GPU's *nominal* limit: its fleet base cap when the cluster sets one,
else its default limit (TDP). A power ratio is limit / nominal and the power model's speed is
relative to a GPU at its nominal limit.

A domain (rack) has a power budget. Every usable GPU that is not boosted is counted at its nominal
limit (idle ones too, so the budget holds if they start working); unusable GPUs at the model's
`unusable_draw_ratio` x nominal. What is left is shared by the reduced groups by water-filling:
every group is raised towards the power ratio that restores a healthy step time, groups needing
less are satisfied first, and no GPU goes above `max_boost` x nominal or its own maximum limit (with
a default equal to the maximum and no base cap, that leaves no boost at all). The result never
exceeds the budget (if the budget is below the fixed draw, boosted GPUs stay at the lowest level
that fits, but never below their minimum limit).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from ntp_manager.planner.spec import PowerModel
from ntp_manager.topology import Domain


@dataclass(frozen=True, slots=True)
class PowerRequest:
    key: Hashable
    domain: Domain
    gpus: tuple[str, ...]  # the group's working GPUs
    speed_needed: float  # relative speed that restores a healthy step time


def domain_budget_w(domain: Domain, model: PowerModel) -> float:
    if domain.power_budget_w is not None:
        return domain.power_budget_w
    return model.rack_headroom * domain.nominal_sum_w


def allocate_domain_power(
    domain: Domain, requests: Sequence[PowerRequest], model: PowerModel
) -> dict[Hashable, float]:
    """Power ratio (limit / nominal limit) granted to each request's GPUs."""
    boosted = {u for r in requests for u in r.gpus}
    fixed = 0.0
    limits = {}
    for g in domain.gpus:
        if g.uuid in boosted:
            limits[g.uuid] = g.power
        else:
            fixed += g.power.nominal_w * (1.0 if g.placeable else model.unusable_draw_ratio)
    left = domain_budget_w(domain, model) - fixed

    infos = []
    for r in requests:
        pl = [limits[u] for u in r.gpus]
        cap = min([model.max_boost] + [p.max_w / p.nominal_w for p in pl])
        floor = max(p.min_w / p.nominal_w for p in pl)
        need = min(cap, max(1.0, model.useful_power(r.speed_needed)))
        infos.append((need, floor, sum(p.nominal_w for p in pl), r.key, cap))
    infos.sort(key=lambda x: x[0])

    grants: dict[Hashable, float] = {}
    remaining_weight = sum(x[2] for x in infos)
    for need, floor, weight, key, cap in infos:
        level = left / remaining_weight if remaining_weight > 0 else 0.0
        ratio = max(floor, min(need, level))
        if ratio < cap:
            # Round down to a milliwatt-friendly value so the sum stays within the budget.
            ratio = int(ratio * 1e6) / 1e6
        # else: exactly the GPUs' own cap (their maximum limit, or max_boost), so that a group at
        # its maximum is set to the maximum and not a milliwatt below it
        grants[key] = ratio
        left -= ratio * weight
        remaining_weight -= weight
    return grants
