"""Planner invariants, packing optimality against brute force, schemes, power and bad input."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec, PlanError, PowerModel, PreviousLayout, Scheme, make_plan
from ntp_manager.planner.power import domain_budget_w
from ntp_manager.topology import PowerLimits, TopologyError, generate_cluster
from tests.fakes.builders import cluster_from_counts, cluster_with_usable, job


def check_invariants(cluster, spec, plan):
    seen: set[str] = set()
    for r in plan.replicas:
        assert r.tp >= spec.min_tp
        assert r.tp == min(g.tp for g in r.groups)
        assert len(r.groups) == spec.groups_per_replica
        for g in r.groups:
            assert len(g.gpus) == g.tp <= spec.tp
            assert len({cluster.gpu(u).domain for u in g.gpus}) == 1  # TP stays inside a domain
            for u in g.gpus:
                assert u not in seen, "GPU in two groups"
                seen.add(u)
                assert cluster.gpu(u).placeable, "unusable GPU placed"
    assert plan.global_batch == sum(r.local_batch for r in plan.replicas)
    assert plan.global_batch <= plan.target_batch
    ids = [r.replica_id for r in plan.replicas]
    assert len(ids) == len(set(ids))


# ---- invariants on random clusters ------------------------------------------------------------


@st.composite
def scenarios(draw):
    tp = draw(st.sampled_from([2, 4, 8]))
    per_domain = draw(st.integers(1, 3))
    domains = draw(st.integers(1, 8))
    size = tp * per_domain + draw(st.integers(0, 2))
    total = domains * size
    failed = draw(st.sets(st.integers(0, total - 1), max_size=max(1, total // 4)))
    pp = draw(st.integers(1, 3))
    replicas = draw(st.integers(1, 4))
    spec = job(
        tp=tp, pp=pp, replicas=replicas, min_tp=draw(st.integers(1, tp)),
        scheme=draw(st.sampled_from(list(Scheme))), spares=draw(st.integers(0, 3)),
        batch=draw(st.integers(1, 16)),
    )
    cluster = cluster_from_counts([size] * domains, [(f // size, f % size) for f in failed])
    return cluster, spec


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_plan_invariants(sc):
    cluster, spec = sc
    plan = make_plan(cluster, spec)
    check_invariants(cluster, spec, plan)
    # same input -> same plan
    assert make_plan(cluster, spec) == plan


# ---- packing equals the brute-force optimum -----------------------------------------------------


def brute_force_best(values: list[int], size: int) -> int:
    """Max over all partitions of `values` into blocks of `size` of the sum of block minima."""
    best = -1

    def rec(rest: tuple[int, ...], acc: int) -> None:
        nonlocal best
        if not rest:
            best = max(best, acc)
            return
        first, others = rest[0], rest[1:]
        for combo in itertools.combinations(range(len(others)), size - 1):
            block = [first] + [others[i] for i in combo]
            left = tuple(v for i, v in enumerate(others) if i not in combo)
            rec(left, acc + min(block))

    rec(tuple(values), 0)
    return best


@settings(max_examples=200, deadline=None)
@given(
    st.integers(2, 8).flatmap(
        lambda tp: st.tuples(
            st.just(tp),
            st.integers(1, 3).flatmap(
                lambda pp: st.tuples(
                    st.just(pp),
                    st.lists(st.integers(1, tp), min_size=pp, max_size=pp * 3).filter(
                        lambda xs, pp=pp: len(xs) % pp == 0
                    ),
                )
            ),
        )
    )
)
def test_packing_matches_brute_force(case):
    tp, (pp, usable) = case
    cluster = cluster_with_usable(tp, usable)
    spec = job(tp=tp, pp=pp, replicas=len(usable) // pp, min_tp=1, batch=1000, heads=64, mlp=64)
    plan = make_plan(cluster, spec)
    assert len(plan.replicas) == spec.replicas
    assert sum(r.tp for r in plan.replicas) == brute_force_best(usable, pp)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(2, 6).flatmap(
        lambda tp: st.tuples(
            st.just(tp),
            st.integers(2, 3).flatmap(
                lambda pp: st.tuples(
                    st.just(pp),
                    st.lists(st.integers(1, tp), min_size=2 * pp, max_size=pp * 3).filter(
                        lambda xs, pp=pp: len(xs) % pp == 0
                    ),
                )
            ),
            st.randoms(use_true_random=False),
        )
    )
)
def test_packing_with_a_previous_layout_still_matches_brute_force(case):
    # Whatever the previous layout (here: a random assignment of the groups to replicas and stages),
    # keeping groups in place never costs total TP: the sum of replica minima is the optimum.
    tp, (pp, usable), rnd = case
    cluster = cluster_with_usable(tp, usable)
    spec = job(tp=tp, pp=pp, replicas=len(usable) // pp, min_tp=1, batch=1000, heads=64, mlp=64)
    gids = [f"d{d}/g0" for d in range(len(usable))]
    rnd.shuffle(gids)
    prev = PreviousLayout({g: (i // pp, i % pp) for i, g in enumerate(gids)}, tp, pp)
    plan = make_plan(cluster, spec, prev)
    assert sum(r.tp for r in plan.replicas) == brute_force_best(usable, pp)
    assert plan.global_batch == make_plan(cluster, spec, packing="sorted").global_batch


def test_packing_puts_partly_failed_domains_together():
    # 4 replicas x 2 stages; failures in domains 0, 3 and 5 (homes: replicas 0, 1, 2).
    usable = [7, 8, 8, 6, 8, 7, 8, 8]
    cluster = cluster_with_usable(8, usable)
    plan = make_plan(cluster, job(tp=8, pp=2, replicas=4, min_tp=4, heads=32, mlp=256))
    tps = sorted(r.tp for r in plan.replicas)
    # sorted groups 8,8,8,8,8,7,7,6 -> replicas (8,8) (8,8) (8,7) (7,6): minima 8,8,7,6 (= 29)
    assert tps == [6, 7, 8, 8]
    # replica 3 never had a failure, so it stays exactly as it was
    r3 = next(r for r in plan.replicas if r.replica_id == 3)
    assert [g.group_id for g in r3.groups] == ["d6/g0", "d7/g0"]


def test_intact_replicas_do_not_move_when_another_fails():
    cluster = generate_cluster(8, 8, 4)
    spec = job(tp=8, pp=2, replicas=4, min_tp=4, heads=32, mlp=256)
    before = make_plan(cluster, spec)
    victim = cluster.domains[5].gpus[2].uuid
    after = make_plan(cluster.with_states({victim: GpuState.FAILED}), spec)
    unchanged = {r.replica_id: r for r in after.replicas if r.replica_id != 2}
    for r in before.replicas:
        if r.replica_id != 2:
            assert unchanged[r.replica_id] == r


# ---- schemes -------------------------------------------------------------------------------------


def test_dp_drop_drops_any_hit_group_and_loses_its_share():
    # 8 domains, TP8, 1 stage, 8 replicas; 3 hit domains -> loss = 3/8 exactly.
    cluster = cluster_with_usable(8, [8, 7, 8, 5, 8, 8, 1, 8])
    plan = make_plan(cluster, job(tp=8, replicas=8, scheme=Scheme.DP_DROP, heads=32, mlp=256))
    assert len(plan.dropped) == 3
    assert plan.relative_throughput == pytest.approx(5 / 8)


def test_ntp_reduces_local_batch_by_the_work_model():
    # TP8 -> TP7 with 32 heads and 256 columns, attention share 0.4:
    # work(7) = 0.4 * ceil(32/7)/4 + 0.6 * ceil(256/7)/32 = 0.4*5/4 + 0.6*37/32 = 1.19375
    # local batch 16 -> floor(16 / 1.19375) = 13
    spec = job(tp=8, replicas=2, batch=16, min_tp=4, heads=32, mlp=256)
    assert spec.work(7) == pytest.approx(1.19375)
    plan = make_plan(cluster_with_usable(8, [8, 7]), spec)
    batches = {r.tp: r.local_batch for r in plan.replicas}
    assert batches == {8: 16, 7: 13}
    assert plan.global_batch == 29


def test_min_tp_drops_groups_below_it():
    plan = make_plan(cluster_with_usable(8, [8, 5]), job(tp=8, replicas=2, min_tp=6, heads=32, mlp=256))
    assert [d.group_id for d in plan.dropped] == ["d1/g0"]
    assert "below min_tp 6" in plan.dropped[0].reason
    assert len(plan.replicas) == 1


def test_spares_replace_dropped_groups_and_extra_spares_stand_by():
    cluster = cluster_with_usable(8, [8, 3, 8, 8])  # d1 dropped (min_tp 4); d2, d3 are spares
    plan = make_plan(cluster, job(tp=8, replicas=2, min_tp=4, spares=2, heads=32, mlp=256))
    assert plan.meets_target and plan.relative_throughput == 1.0
    assert plan.spares_used == ("d2/g0",)
    assert [s.group_id for s in plan.idle] == ["d3/g0"]


def test_spares_make_extra_replicas_to_reach_the_target_batch():
    # Two TP8 replicas at batch 8; one runs at TP6 -> batch floor(8/work(6)) < 8.
    # A healthy spare adds a third replica, trimmed so that the global batch is exactly 16.
    cluster = cluster_with_usable(8, [8, 6, 8])
    spec = job(tp=8, replicas=2, min_tp=4, spares=1, heads=32, mlp=256)
    plan = make_plan(cluster, spec)
    assert plan.global_batch == 16
    assert len(plan.replicas) == 2  # the spare beats the TP6 group, which stands by
    assert {g.group_id for r in plan.replicas for g in r.groups} == {"d0/g0", "d2/g0"}


def test_in_domain_leftover_gpus_fill_failed_slots():
    # NVL10 with TP4: two groups and 2 leftover GPUs. Positions 1 and 6 fail:
    # group 0 takes leftover 8, group 1 takes leftover 9 -> both full.
    cluster = cluster_from_counts([10], [(0, 1), (0, 6)], gpus_per_node=2)
    plan = make_plan(cluster, job(tp=4, replicas=2, heads=8, mlp=16, scheme=Scheme.DP_DROP))
    assert plan.relative_throughput == 1.0
    gpus = [g.gpus for r in plan.replicas for g in r.groups]
    assert gpus == [("GPU-0-0", "GPU-0-8", "GPU-0-2", "GPU-0-3"), ("GPU-0-4", "GPU-0-5", "GPU-0-9", "GPU-0-7")]


# ---- power ---------------------------------------------------------------------------------------


def test_ntp_pw_boosts_survivors_and_keeps_the_batch():
    # TP8 -> TP7: needs speed work(7) = 1.19375 -> power 1.19375^(1/0.7) = 1.2878 x TDP (< 1.3).
    # Budget: 1.15 * 8 * 1000 W = 9200 W; 7 GPUs at 1287.8 W = 9014 W fits.
    spec = job(tp=8, replicas=2, batch=16, min_tp=4, heads=32, mlp=256, scheme=Scheme.NTP_PW)
    plan = make_plan(cluster_with_usable(8, [8, 7]), spec)
    assert plan.global_batch == 32
    assert len(plan.power_caps_w) == 7
    assert all(w == pytest.approx(1000 * 1.19375 ** (1 / 0.7), rel=1e-5) for w in plan.power_caps_w.values())


def test_ntp_pw_falls_back_to_a_smaller_batch_when_the_rack_is_short():
    # Budget exactly 8 x TDP: 7 survivors may take 8000/7 = 1142.857 W each -> speed 1.0979 < 1.19375
    # -> batch floor(16 * 1.0979 / 1.19375) = 14.
    cluster = cluster_from_counts([8, 8], [(1, 7)], budget_w=8000.0)
    spec = job(tp=8, replicas=2, batch=16, min_tp=4, heads=32, mlp=256, scheme=Scheme.NTP_PW)
    plan = make_plan(cluster, spec)
    ratio = 8000 / 7 / 1000
    caps = list(plan.power_caps_w.values())
    assert len(caps) == 7 and all(c == pytest.approx(1000 * ratio, rel=1e-5) for c in caps)
    assert sorted(r.local_batch for r in plan.replicas) == [math.floor(16 * ratio**0.7 / 1.19375), 16]


def test_power_of_a_reduced_group_that_need_not_run_goes_to_its_rack_mate():
    # Rack d0 (16 GPUs, budget 1.0 x 16,000 W) holds two TP8 groups with 7 usable GPUs each; d1, d2
    # are healthy. 5 replicas of one group (target 80) + 1 spare. With proportional work, TP7 needs
    # speed 8/7 = 1.1429, i.e. power 1.1429^(1/0.7) = 1.2104x. Both boosted: 16,000 / 14 = 1.1429x
    # each -> batch floor(16 x 1.1429^0.7 / 1.1429) = 15, so the sorted cut runs both (15 + 1).
    # Granted again without the trimmed one (its 7 GPUs at nominal), the other may take
    # (16,000 - 7,000) / 7 = 1.286x >= 1.2104x and runs the full 16: the same global batch from
    # 5 replicas instead of 6, with 7 boosted GPUs instead of 14.
    cluster = cluster_from_counts([16, 16, 16], [(0, 7), (0, 15)])
    spec = job(tp=8, replicas=5, spares=1, batch=16, heads=32, mlp=64, scheme=Scheme.NTP_PW, balance="stage",
               power=PowerModel(rack_headroom=1.0))
    stable = make_plan(cluster, spec)
    sorted_cut = make_plan(cluster, spec, packing="sorted")  # the packer before power awareness
    assert stable.global_batch == sorted_cut.global_batch == 80
    assert sorted(r.local_batch for r in sorted_cut.replicas) == [1, 15, 16, 16, 16, 16]
    assert sorted(r.local_batch for r in stable.replicas) == [16] * 5
    assert len(sorted_cut.power_caps_w) == 14 and len(stable.power_caps_w) == 7
    assert all(w == pytest.approx(1000 * (8 / 7) ** (1 / 0.7), rel=1e-5) for w in stable.power_caps_w.values())


def test_power_curve_is_used_when_given():
    curve = ((1.0, 1.0), (1.1, 1.069), (1.2, 1.122), (1.3, 1.16))
    pm = PowerModel(curve=curve)
    assert pm.speed(1.1) == pytest.approx(1.069)
    assert pm.power_for_speed(1.0955) == pytest.approx(1.15)
    assert pm.power_for_speed(1.2) == math.inf


def test_a_regrant_that_lifts_no_batch_is_undone_and_the_rack_stays_in_budget():
    # Found by the property test below (CI, 2026-11-28). One rack of 16 (budget 1.0 x 16,000 W), GPUs
    # 0, 1 and 8 failed: a TP6 and a TP7 group, both granted 16,000 / 13 = 1.2308x; target 3 samples
    # = TP6 (batch 2) + TP7 trimmed to 1. Granted again as if the trimmed TP7 drew nominal, the TP6
    # rose to 1.3x, which lifted no batch, so the selection stayed: the TP7 still ran at 1.2308x and
    # the rack drew 16,415 W. The raise is now undone when no batch rises.
    cluster = cluster_from_counts([16], [(0, 0), (0, 1), (0, 8)])
    spec = job(tp=8, replicas=1, spares=1, batch=3, min_tp=1, scheme=Scheme.NTP_PW,
               power=PowerModel(max_boost=1.5, rack_headroom=1.0))
    plan = make_plan(cluster, spec)
    assert plan.global_batch == 3
    assert sorted(r.tp for r in plan.replicas) == [6, 7]
    assert sum(plan.power_caps_w.values()) <= 16_000 + 1e-6
    assert all(w == pytest.approx(16_000 / 13, abs=1e-3) for w in plan.power_caps_w.values())


@settings(max_examples=200, deadline=None)
@given(scenarios(), st.floats(0.9, 1.4), st.floats(1.0, 1.5))
def test_power_caps_never_exceed_rack_budget_or_gpu_cap(sc, headroom, max_boost):
    cluster, spec = sc
    spec = JobSpec(
        **{**spec.__dict__, "scheme": Scheme.NTP_PW, "power": PowerModel(max_boost=max_boost, rack_headroom=headroom)}
    )
    plan = make_plan(cluster, spec)
    for d in cluster.domains:
        draw = 0.0
        for g in d.gpus:
            if g.uuid in plan.power_caps_w:
                cap = plan.power_caps_w[g.uuid]
                assert cap <= g.power.nominal_w * max_boost + 1e-6
                assert g.power.min_w <= cap <= g.power.max_w
                draw += cap
            elif g.placeable:
                draw += g.power.nominal_w
        boosted_here = any(g.uuid in plan.power_caps_w for g in d.gpus)
        if boosted_here:
            assert draw <= domain_budget_w(d, spec.power) + 1e-6


def test_gpu_own_max_limit_caps_the_boost():
    power = PowerLimits(tdp_w=700, min_w=200, max_w=750)
    cluster = cluster_from_counts([8, 8], [(1, 0)], power=power)
    spec = job(tp=8, replicas=2, batch=16, min_tp=4, heads=32, mlp=256, scheme=Scheme.NTP_PW)
    plan = make_plan(cluster, spec)
    assert max(plan.power_caps_w.values()) <= 750


# ---- fleet base power cap --------------------------------------------------------------------------

H100 = PowerLimits(tdp_w=700, min_w=200, max_w=700)  # default = max, as recorded on a real H100


def test_default_equal_to_max_leaves_ntp_pw_no_headroom():
    # Without a base cap a TP7 group cannot go above 700 W = its default: ntp-pw plans what ntp plans.
    cluster = cluster_from_counts([8, 8], [(1, 7)], power=H100)
    pw = make_plan(cluster, job(tp=8, replicas=2, batch=16, min_tp=4, heads=32, mlp=256, scheme=Scheme.NTP_PW))
    ntp = make_plan(cluster, job(tp=8, replicas=2, batch=16, min_tp=4, heads=32, mlp=256, scheme=Scheme.NTP))
    assert pw.global_batch == ntp.global_batch == 16 + 13 and not pw.power_caps_w


def test_base_cap_gives_the_reduced_group_headroom_up_to_the_maximum():
    # Base cap 0.85 x 700 = 595 W. TP8 -> TP7 needs speed work(7) = 1.19375, i.e. power
    # 1.19375^(1/0.7) = 1.288 x base; the maximum is 700/595 = 1.1765 x base, so the 7 survivors get
    # exactly 700 W and speed 1.1765^0.7 = 1.1205: batch floor(16 x 1.1205 / 1.19375) = 15 (ntp: 13).
    power = H100.with_base_cap(0.85)
    assert power.base_w == pytest.approx(595) and power.nominal_w == pytest.approx(595)
    cluster = cluster_from_counts([8, 8], [(1, 7)], power=power)
    plan = make_plan(cluster, job(tp=8, replicas=2, batch=16, min_tp=4, heads=32, mlp=256, scheme=Scheme.NTP_PW))
    assert sorted(plan.power_caps_w.values()) == [700.0] * 7  # only the reduced group, at its maximum
    assert sorted(r.local_batch for r in plan.replicas) == [math.floor(16 * (700 / 595) ** 0.7 / 1.19375), 16]
    (boosted,) = [g for r in plan.replicas for g in r.groups if g.tp == 7]
    assert boosted.power_ratio == pytest.approx(700 / 595)
    assert any("base cap" in x for x in plan.reasons)


def test_base_cap_restores_full_speed_where_the_need_is_below_the_maximum():
    # TP32 -> TP31 with the paper's units: work(31) = 1.1195 -> power 1.1195^(1/0.7) = 1.1749 x base,
    # below 700/595 = 1.1765: full batch, survivors at 595 x 1.1749 = 699.1 W.
    power = PowerLimits(700, 200, 700).with_base_cap(0.85)
    cluster = cluster_from_counts([32, 32], [(0, 5)], power=power)
    spec = job(tp=32, replicas=2, batch=8, min_tp=28, heads=128, mlp=81920, scheme=Scheme.NTP_PW)
    plan = make_plan(cluster, spec)
    assert plan.global_batch == 16
    need = spec.work(31) ** (1 / 0.7)
    assert all(w == pytest.approx(595 * need, abs=1e-3) and w <= 700 for w in plan.power_caps_w.values())
    # the rack budget is counted against base limits: 1.15 x 32 x 595 W
    assert domain_budget_w(cluster.domains[0], spec.power) == pytest.approx(1.15 * 32 * 595)


@pytest.mark.parametrize(
    ("ratio", "base"),
    [(0.85, 595.0), (0.2, 200.0), (0.1, 200.0), (1.0, 700.0)],  # raised to the minimum, never above the default
)
def test_base_cap_is_a_share_of_the_maximum_within_min_and_default(ratio, base):
    assert H100.with_base_cap(ratio).base_w == pytest.approx(base)


def test_base_cap_never_raises_a_gpu_above_its_default():
    b200 = PowerLimits(1000, 200, 1300)
    assert b200.with_base_cap(0.9).base_w == 1000  # 0.9 x 1300 = 1170 > default: stays at 1000
    assert b200.with_base_cap(0.7).base_w == pytest.approx(910)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.2])
def test_bad_base_cap_is_refused(bad):
    with pytest.raises(TopologyError, match="base power cap"):
        H100.with_base_cap(bad)
    with pytest.raises(TopologyError, match="between the minimum and the default"):
        PowerLimits(700, 200, 700, base_w=150)


# ---- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"tp": 16}, "above the largest domain size 8"),
        ({"min_tp": 9}, "min_tp 9 is above the healthy TP degree 8"),
        ({"replicas": 0}, "replicas must be a positive integer"),
        ({"heads": 4}, "heads=4 is smaller than tp=8"),
        ({"domains": ("nope",)}, "unknown domain 'nope'"),
        ({"spares": -1}, "spares must be >= 0"),
    ],
)
def test_bad_job_is_rejected_with_a_clear_message(kw, message):
    base = {"tp": 8, "replicas": 2, "min_tp": 4, "heads": 32, "mlp": 256}
    base.update(kw)
    with pytest.raises(PlanError, match=message):
        make_plan(cluster_with_usable(8, [8, 8]), job(**base))
