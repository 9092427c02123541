"""Degraded (fail-slow) GPUs in the planner: kept at their pace, excluded, power-boosted, or replaced
by a spare group, by the planner's own throughput model; hysteresis against the previous plan."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import Scheme, make_plan
from ntp_manager.planner.slow import choose, group_value
from ntp_manager.topology import Cluster, TopologyError
from tests.fakes.builders import cluster_from_counts, job
from tests.unit.test_planner import check_invariants

# TP8, 32 heads, 256 columns, attention share 0.4, local batch 16 (test_planner's arithmetic):
# work(7) = 1.19375 -> a TP7 replica runs floor(16 / 1.19375) = 13 samples.
BIG = {"tp": 8, "batch": 16, "heads": 32, "mlp": 256}


def slowed(cluster: Cluster, speeds: dict[str, float]) -> Cluster:
    return cluster.with_states(dict.fromkeys(speeds, GpuState.DEGRADED), speeds)


def gpus_of(plan) -> set[str]:  # type: ignore[no-untyped-def]
    return {u for r in plan.replicas for g in r.groups for u in g.gpus}


def test_a_slightly_slow_gpu_is_kept_and_its_replica_runs_a_smaller_batch() -> None:
    # speed 0.95: keep TP8 at pace 0.95 -> floor(16 x 0.95) = 15; drop it -> TP7 -> 13: keep
    cluster = slowed(cluster_from_counts([8, 8]), {"GPU-1-3": 0.95})
    plan = make_plan(cluster, job(replicas=2, min_tp=4, **BIG))
    check_invariants(cluster, job(replicas=2, min_tp=4, **BIG), plan)
    assert "GPU-1-3" in gpus_of(plan)
    by_group = {g.group_id: (r.tp, r.local_batch, g.pace) for r in plan.replicas for g in r.groups}
    assert by_group == {"d0/g0": (8, 16, 1.0), "d1/g0": (8, 15, 0.95)}
    (why,) = [x for x in plan.reasons if "degraded" in x]
    assert "keep" in why and "GPU-1-3 at 0.95" in why and "allows batch 15" in why and "allows 13" in why


def test_a_much_slower_gpu_is_excluded_and_its_group_runs_at_tp7() -> None:
    # speed 0.6: keep -> floor(9.6) = 9; drop it -> TP7 -> 13 (+44%): exclude
    cluster = slowed(cluster_from_counts([8, 8]), {"GPU-1-3": 0.6})
    spec = job(replicas=2, min_tp=4, **BIG)
    plan = make_plan(cluster, spec)
    check_invariants(cluster, spec, plan)
    assert "GPU-1-3" not in gpus_of(plan)
    assert sorted((r.tp, r.local_batch) for r in plan.replicas) == [(7, 13), (8, 16)]
    assert any(x.endswith(")") and ": exclude (" in x for x in plan.reasons)


def test_a_spare_group_replaces_a_slow_group() -> None:
    # d1 holds a GPU at 0.6 (best it can do: TP7, 13 samples); the healthy spare d2 runs 16
    cluster = slowed(cluster_from_counts([8, 8, 8]), {"GPU-1-0": 0.6})
    spec = job(replicas=2, min_tp=4, spares=1, **BIG)
    plan = make_plan(cluster, spec)
    check_invariants(cluster, spec, plan)
    assert plan.relative_throughput == 1.0 and plan.spares_used == ("d2/g0",)
    assert [s.group_id for s in plan.idle] == ["d1/g0"]
    assert any("d1/g0 (a degraded GPU; alone it runs TP7" in x and "stands by" in x for x in plan.reasons)


def test_ntp_pw_boosts_a_slow_groups_power_and_keeps_the_full_batch() -> None:
    # speed 0.95 needs 1/0.95 = 1.0526x speed -> 1.0526^(1/0.7) = 1.0761x power (<= 1.3); the rack
    # (1.15 x 8,000 W) gives all 8 GPUs 1,076 W: the group keeps the GPU and the full batch
    cluster = slowed(cluster_from_counts([8, 8]), {"GPU-1-3": 0.95})
    spec = job(replicas=2, min_tp=4, scheme=Scheme.NTP_PW, **BIG)
    plan = make_plan(cluster, spec)
    check_invariants(cluster, spec, plan)
    assert plan.global_batch == 32 and "GPU-1-3" in gpus_of(plan)
    caps = plan.power_caps_w
    assert sorted(caps) == sorted(f"GPU-1-{i}" for i in range(8))
    assert all(w == pytest.approx(1000 * (1 / 0.95) ** (1 / 0.7), rel=1e-5) for w in caps.values())
    assert any("at pace 0.95 (degraded GPU) boosted" in x for x in plan.reasons)


def test_dp_drop_counts_a_degraded_gpu_as_unusable() -> None:
    cluster = slowed(cluster_from_counts([8, 8, 8]), {"GPU-1-0": 0.95})
    spec = job(replicas=2, spares=1, scheme=Scheme.DP_DROP, **BIG)
    plan = make_plan(cluster, spec)
    assert [d.group_id for d in plan.dropped] == ["d1/g0"] and plan.spares_used == ("d2/g0",)
    assert any("dp-drop: degraded GPU GPU-1-0" in x for x in plan.reasons)


def test_a_degraded_gpu_without_a_measured_speed_takes_no_work() -> None:
    # an agent's trend verdict (degraded, no speed) stays out of placement, as before fail-slow
    cluster = cluster_from_counts([8, 8]).with_states({"GPU-1-3": GpuState.DEGRADED})
    assert not cluster.gpu("GPU-1-3").placeable
    plan = make_plan(cluster, job(replicas=2, min_tp=4, **BIG))
    assert "GPU-1-3" not in gpus_of(plan)
    with pytest.raises(TopologyError, match="speed"):
        cluster.with_states({"GPU-1-3": GpuState.DEGRADED}, {"GPU-1-3": 1.5})


def test_hysteresis_the_running_choice_stands_at_the_break_even_point() -> None:
    # keep at speed s allows floor(16 s); exclusion (TP7) allows 13. At 0.80: 12 vs 13 -> exclude.
    # At 0.84: 13 vs 13 -> a tie: with no history the group keeps its GPU (a reshard is not free),
    # but after a layout that excluded it, it stays excluded. A speed wobbling 0.80 / 0.84 moves
    # the layout once, not on every wobble.
    spec = job(replicas=2, min_tp=4, **BIG)
    base = cluster_from_counts([8, 8])
    fresh = make_plan(slowed(base, {"GPU-1-3": 0.84}), spec)
    assert "GPU-1-3" in gpus_of(fresh)
    plan = None
    used = []
    for s in (0.80, 0.84, 0.80, 0.84, 0.84):
        plan = make_plan(slowed(base, {"GPU-1-3": s}), spec, plan)
        used.append("GPU-1-3" in gpus_of(plan))
    assert used == [False] * 5
    assert any("the running layout excludes it" in x for x in plan.reasons)  # type: ignore[union-attr]
    # ... and it comes back only once keeping it is clearly better (0.95: 15 vs 13)
    plan = make_plan(slowed(base, {"GPU-1-3": 0.95}), spec, plan)
    assert "GPU-1-3" in gpus_of(plan)
    # the same from a stored plan (the service's previous layout is JSON)
    from ntp_manager.planner import PreviousLayout
    from ntp_manager.planner.export import plan_to_dict

    excluded = make_plan(slowed(base, {"GPU-1-3": 0.80}), spec)
    again = make_plan(slowed(base, {"GPU-1-3": 0.84}), spec, PreviousLayout.from_dict(plan_to_dict(excluded)))
    assert "GPU-1-3" not in gpus_of(again)


@st.composite
def slow_groups(draw):  # type: ignore[no-untyped-def]
    tp = draw(st.sampled_from([2, 4, 8]))
    n = draw(st.integers(1, tp))
    speeds = [draw(st.sampled_from([1.0, 1.0, 0.95, 0.9, 0.8, 0.7, 0.5, 0.3])) for _ in range(n)]
    if min(speeds) == 1.0:
        speeds[draw(st.integers(0, n - 1))] = 0.75
    min_tp = draw(st.integers(1, n))
    scheme = draw(st.sampled_from([Scheme.NTP, Scheme.NTP_PW]))
    return tp, speeds, min_tp, scheme, draw(st.integers(1, 32))


@settings(max_examples=200, deadline=None)
@given(slow_groups())
def test_choice_matches_brute_force_over_every_member_subset(case) -> None:  # type: ignore[no-untyped-def]
    """The best exclusion the rule considers (the k fastest, for each k) is the best over every
    subset of the members, and the choice is that optimum or, by hysteresis, an option within
    min_gain (2%) of it."""
    tp, speeds, min_tp, scheme, batch = case
    spec = job(tp=tp, batch=batch, min_tp=min_tp, scheme=scheme, heads=16 * tp, mlp=64 * tp)
    names = [f"g{i}" for i in range(len(speeds))]
    c = choose(spec, "d/g0", names, speeds, boost_cap=1.3)
    brute = max(
        group_value(spec, k, min(speeds[i] for i in subset), 1.3)
        for k in range(min_tp, len(speeds) + 1) for subset in itertools.combinations(range(len(speeds)), k)
    )
    assert max(c.value, c.other) == brute
    assert c.value == brute or (c.action == "keep" and brute < c.value * 1.02 + 1e-9) or brute <= c.value
    assert c.pace == min(speeds[i] for i in c.kept) and len(c.kept) >= min_tp


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_plan_invariants_with_degraded_gpus(data) -> None:  # type: ignore[no-untyped-def]
    from tests.unit.test_planner import scenarios

    cluster, spec = data.draw(scenarios())
    uuids = [g.uuid for g in cluster.gpus() if g.placeable]
    chosen = data.draw(st.lists(st.sampled_from(uuids), max_size=4, unique=True)) if uuids else []
    speeds = {u: data.draw(st.sampled_from([0.5, 0.8, 0.9, 0.97])) for u in chosen}
    cluster = slowed(cluster, speeds)
    plan = make_plan(cluster, spec)
    check_invariants(cluster, spec, plan)
    assert make_plan(cluster, spec) == plan
    for r in plan.replicas:
        for g in r.groups:
            assert g.pace == min([speeds.get(u, 1.0) for u in g.gpus])


def test_simulated_throughput_doing_nothing_vs_the_planners_decision() -> None:
    from ntp_manager.sim.slow import slow_outcome

    # one GPU at 0.6 in a job of 2 TP8 replicas of 16 samples. Doing nothing: both replicas wait
    # for it, 0.6. The planner drops it: TP7 runs 13, so (16 + 13) / 32 = 0.90625. Over 100 steps
    # with 3 to detect and 5 lost to the reshard: (3 x 0.6 + 92 x 0.90625) / 100 = 0.85175.
    o = slow_outcome(cluster_from_counts([8, 8]), job(replicas=2, min_tp=4, **BIG), {"GPU-1-3": 0.6},
                     steps=100, detect_steps=3, reshard_steps=5)
    assert (o.nothing, o.planner, o.action) == (0.6, 0.90625, "exclude")
    assert o.episode == pytest.approx(0.85175)
    # with a healthy spare the slow group stands by and the job is whole again
    o = slow_outcome(cluster_from_counts([8, 8, 8]), job(replicas=2, min_tp=4, spares=1, **BIG), {"GPU-1-3": 0.6})
    assert (o.planner, o.action) == (1.0, "spare")
