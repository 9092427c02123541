"""Monotonicity: one more failed GPU never raises the global batch, where that must hold.

Where it must hold, and why:
- dp-drop: the plan is min(target, floor(full groups / P) x B) and a failure never adds a full group.
- ntp: a group's key is its usable count, one failure lowers one key by at most 1 (an in-domain
  leftover GPU may absorb it), the optimal replica minima (the sorted cut, docs/planner.md) are
  monotone in every key, and floor(B / work(t)) is monotone in t.
- ntp-pw, when each domain holds one TP group and work is proportional (balance "stage": work(t) =
  T / t): a group's grant is min(cap, need, budget / t) from its own rack alone, and with a speed
  curve whose speed(p) / p does not increase (any concave curve through (1, 1): p^a, the paper's
  points), t x speed(budget / t) does not fall as t falls by one; so speed / work(t) does not rise.
Where it need not hold (inherent in the model, not a packing accident): with the per-layer unit
rule a rank's work can stay the same when the group loses a GPU (128 heads: 5 per rank at TP30 and
at TP29) while the rack's budget is shared by fewer GPUs, so the survivors run faster; and with
several groups per rack and a budget below the healthy draw, a failure in one group lowers its draw
and frees power for its neighbour.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_manager.planner import PAPER_POWER_CURVE, JobSpec, PowerModel, Scheme, make_plan
from ntp_manager.sim import FailureModel, SimSetup, static_sweep
from ntp_manager.topology import generate_cluster
from tests.fakes.builders import cluster_from_counts


@st.composite
def growing_failures(draw, scheme_choices, one_group_per_domain=False):
    tp = draw(st.sampled_from([2, 4, 8]))
    per = 1 if one_group_per_domain else draw(st.integers(1, 3))
    size = tp * per + draw(st.integers(0, tp - 1 if one_group_per_domain else 2))
    domains = draw(st.integers(1, 8))
    total = domains * size
    failed = draw(st.lists(st.integers(0, total - 1), min_size=1, max_size=max(1, total // 3), unique=True))
    pp = draw(st.integers(1, 3))
    scheme = draw(st.sampled_from(scheme_choices))
    power = PowerModel(
        rack_headroom=draw(st.sampled_from([0.9, 1.0, 1.05, 1.15, 1.3])),
        curve=draw(st.sampled_from([(), PAPER_POWER_CURVE])),
    )
    spec = JobSpec(
        name="m", tp=tp, groups_per_replica=pp, replicas=draw(st.integers(1, 4)), local_batch=draw(st.integers(1, 16)),
        min_tp=draw(st.integers(1, tp)), heads=draw(st.sampled_from([tp, 3 * tp + 1, 16 * tp])),
        mlp_columns=draw(st.sampled_from([0, 4 * tp + 3, 64 * tp])), scheme=scheme,
        spares=draw(st.integers(0, 2)), power=power,
        balance="stage" if one_group_per_domain else draw(st.sampled_from(["layer", "stage"])),
    )
    return [size] * domains, failed, spec


def assert_batches_never_rise(sizes, failed, spec, with_previous):
    cluster = cluster_from_counts(sizes)
    prev_plan = make_plan(cluster, spec)
    for k in range(1, len(failed) + 1):
        snap = cluster_from_counts(sizes, [(f // sizes[0], f % sizes[0]) for f in failed[:k]])
        plan = make_plan(snap, spec, prev_plan if with_previous else None)
        assert plan.global_batch <= prev_plan.global_batch, (k, failed[:k])
        prev_plan = plan


@settings(max_examples=150, deadline=None)
@given(growing_failures([Scheme.DP_DROP, Scheme.NTP]), st.booleans())
def test_dp_drop_and_ntp_never_gain_from_a_failure(case, with_previous):
    assert_batches_never_rise(*case, with_previous)


@settings(max_examples=150, deadline=None)
@given(growing_failures([Scheme.NTP_PW], one_group_per_domain=True), st.booleans())
def test_ntp_pw_never_gains_with_one_group_per_rack_and_proportional_work(case, with_previous):
    assert_batches_never_rise(*case, with_previous)


def test_ntp_pw_can_gain_from_a_failure_with_per_layer_units():
    # 128 heads (no MLP units), TP32, rack budget 1.05 x 32 x 1000 W, speed = power^0.7.
    # 2 failed: 30 survivors at 1.05 x 32 / 30 = 1.12x -> speed 1.0826; work(30) = 5/4 -> batch
    # floor(8 x 1.0826 / 1.25) = 6. 3 failed: 29 survivors at 1.1586x -> speed 1.1084, work(29) =
    # 5/4 still -> batch 7. The same heads per rank on fewer GPUs, each with more power.
    spec = JobSpec(name="h", tp=32, groups_per_replica=1, replicas=2, local_batch=8, min_tp=28, heads=128,
                   scheme=Scheme.NTP_PW, power=PowerModel(rack_headroom=1.05))
    two = make_plan(cluster_from_counts([32, 32], [(1, 0), (1, 1)]), spec)
    three = make_plan(cluster_from_counts([32, 32], [(1, 0), (1, 1), (1, 2)]), spec)
    assert (two.global_batch, three.global_batch) == (8 + 6, 8 + 7)


def test_static_sweep_placements_are_nested_so_losses_grow_with_the_fraction():
    # Placement p at a higher fraction contains placement p at every lower one: under ntp every
    # placement's loss is non-decreasing along the sweep (before, independent draws per point made
    # the mean at 57 failures come out below the mean at 56 by chance).
    job = JobSpec(name="t", tp=16, groups_per_replica=4, replicas=16, local_batch=8, min_tp=12, heads=128,
                  mlp_columns=4096, scheme=Scheme.NTP)
    setup = SimSetup.create(generate_cluster(32, 32, 4), job, FailureModel())
    pts = static_sweep(setup, [Scheme.NTP], [0.002, 0.004, 0.006, 0.01], placements=10, seed=3)
    for a, b in itertools.pairwise(pts):
        assert all(x <= y for x, y in zip(a.losses, b.losses, strict=True))
