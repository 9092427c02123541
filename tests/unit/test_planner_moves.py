"""Stage identity and minimal movement: packing against exhaustive search, what a plan reports as
moved, the previous-layout inputs, and what each scheme does to each pipeline stage."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import PlanError, PreviousLayout, Scheme, diff_assignments, make_plan
from ntp_manager.planner.export import plan_to_dict
from ntp_manager.planner.packing import Item, pack
from ntp_manager.topology import generate_cluster
from tests.fakes.builders import cluster_from_counts, cluster_with_usable, job
from tests.unit.test_planner import check_invariants, scenarios

# ---- the packer against exhaustive search -------------------------------------------------------


def _blocks(idxs: list[int], P: int, m: int):
    """Every way to choose m disjoint unordered blocks of P from idxs (the rest left over)."""
    if m == 0:
        yield []
        return
    if len(idxs) < P * m:
        return
    first, rest = idxs[0], idxs[1:]
    for combo in itertools.combinations(rest, P - 1):
        left = [i for i in rest if i not in combo]
        for others in _blocks(left, P, m - 1):
            yield [(first, *combo), *others]
    yield from _blocks(rest, P, m)


def optimum(items: list[Item], P: int) -> tuple[list[int], int]:
    """Best vector of replica minima, and the most groups any packing reaching it keeps in their
    reference slot (a replica may take one reference id; its members of that id keep their stages)."""
    n, m = len(items), len(items) // P
    keys = sorted((it.key for it in items), reverse=True)
    target = [keys[(i + 1) * P - 1] for i in range(m)]
    rids = sorted({it.ref[0] for it in items if it.ref})
    best = -1
    for part in _blocks(list(range(n)), P, m):
        if sorted((min(items[i].key for i in b) for b in part), reverse=True) != target:
            continue
        w = [[sum(1 for i in b if items[i].ref and items[i].ref[0] == r) for r in rids] for b in part]
        for perm in itertools.permutations(range(max(len(rids), len(part))), len(part)):
            best = max(best, sum(w[b][r] for b, r in enumerate(perm) if r < len(rids)))
    return target, best


def packed(items: list[Item], P: int) -> tuple[list[int], int]:
    blocks, left = pack(items, P)
    assert sorted([i for b in blocks for i in b.slots] + left) == list(range(len(items)))
    for b in blocks:  # the reported stayers are the members in their reference slot
        assert b.stayers == sum(1 for s, i in enumerate(b.slots) if b.rid is not None and items[i].ref == (b.rid, s))
    return sorted((min(items[i].key for i in b.slots) for b in blocks), reverse=True), sum(b.stayers for b in blocks)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([2, 3]), st.randoms(use_true_random=False))
def test_one_change_after_a_packing_moves_no_more_than_exhaustive_search(P, rnd):
    # A layout the packer made, then one group's key drops (a failure) or rises (a repair): the
    # repack is optimal and keeps exactly as many groups in place as the best possible packing.
    n = rnd.randint(P, 8 if P == 2 else 9)
    keys = [rnd.choice([3, 3, 3, 2, 1]) for _ in range(n)]
    blocks, _ = pack([Item(i, k, None) for i, k in enumerate(keys)], P)
    refs: list[tuple[int, int] | None] = [None] * n
    for r, b in enumerate(blocks):
        for s, i in enumerate(b.slots):
            refs[i] = (r, s)
    j = rnd.randrange(n)
    keys[j] = max(1, keys[j] - 1) if rnd.random() < 0.7 else min(3, keys[j] + 1)
    items = [Item(i, keys[i], refs[i]) for i in range(n)]
    assert packed(items, P) == optimum(items, P)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([2, 3]), st.randoms(use_true_random=False))
def test_any_reference_layout_gives_the_optimum_within_one_move_of_exhaustive_search(P, rnd):
    # Arbitrary references (random keys, random partial layouts): the total is always optimal; the
    # greedy choice of which replicas close where keeps all but at most one of the groups the best
    # packing keeps (it is exact in ~99% of such cases, and in every one-change case above).
    n = rnd.randint(P, 8 if P == 2 else 9)
    keys = [rnd.randint(1, 3) for _ in range(n)]
    order = list(range(n))
    rnd.shuffle(order)
    refs: list[tuple[int, int] | None] = [None] * n
    slot = 0
    for r in range(rnd.randint(0, n // P + 1)):
        for s in range(P):
            if slot < n and rnd.random() < 0.85:
                refs[order[slot]] = (r, s)
            slot += 1
    items = [Item(i, keys[i], refs[i]) for i in range(n)]
    (got_target, got), (want_target, want) = packed(items, P), optimum(items, P)
    assert got_target == want_target
    assert want - 1 <= got <= want


# ---- a new failure never moves a replica it did not touch -----------------------------------------


def full_replicas(plan, cluster_after, spec):
    """Replicas of `plan` whose groups are all complete before and after (by group id)."""
    after = make_plan(cluster_after, spec, packing="sorted")  # any plan: only its group usables are read
    usable_after = {g.group_id: g.usable for r in after.replicas for g in r.groups}
    usable_after.update({s.group_id: s.usable for s in (*after.idle, *after.dropped)})
    return [
        r for r in plan.replicas
        if all(g.usable == spec.tp and usable_after.get(g.group_id) == spec.tp for g in r.groups)
    ]


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.integers(0, 10_000))
def test_one_more_failure_never_moves_a_group_of_a_replica_that_stays_healthy(sc, pick):
    cluster, spec = sc
    before = make_plan(cluster, spec)
    placeable = [g.uuid for g in cluster.gpus() if g.placeable]
    if not placeable:
        return
    cluster2 = cluster.with_states({placeable[pick % len(placeable)]: GpuState.FAILED})
    after = make_plan(cluster2, spec, before)
    check_invariants(cluster2, spec, after)
    by_id = {r.replica_id: r for r in after.replicas}
    for r in full_replicas(before, cluster2, spec):
        same = by_id.get(r.replica_id)
        assert same is not None, f"replica {r.replica_id} vanished"
        assert [(g.group_id, g.stage) for g in same.groups] == [(g.group_id, g.stage) for g in r.groups]
        assert all((g.prev_replica, g.prev_stage) == (r.replica_id, g.stage) for g in same.groups)


# Found by hypothesis: TP8, one stage, 2 replicas + 2 spares, batch 8, groups at 8, 7, 6 and 7
# usable; the hint held d0, d1 and d2 in replicas 0-2. Under ntp (16 heads, 64 columns) TP7 and TP6
# both allow a local batch of 5 (floor(8 / 1.35) = floor(8 / 1.425) = 5), and the target is 16, so
# the plan runs 8 + 5 + 3. The sorted packer fills the trimmed third replica with the second TP7
# group (d3); the moves-aware packer keeps d2 (TP6) in its slot: the same batches, no group moved.
# The selected TP degrees differ ([8, 7, 6] vs [8, 7, 7]) while every replica's batch is the same.
_TIE = (
    cluster_from_counts([8, 8, 8, 8], [(1, 7), (2, 6), (2, 7), (3, 7)]),
    job(tp=8, pp=1, replicas=2, spares=2, batch=8, min_tp=4),
)


@settings(max_examples=200, deadline=None)
@given(scenarios(), scenarios())
@example(_TIE, (cluster_from_counts([8, 8, 8]), job(tp=8, pp=1, replicas=3, batch=8)))
def test_same_totals_as_the_sorted_packer_whatever_the_previous_plan(sc, other):
    # The plan's quality never depends on the previous plan: dp-drop and ntp give the sorted
    # packer's replica batches exactly (so its global batch); ntp-pw (packed by the batch each
    # group's power grant allows, not by usable count) at least its global batch. The TP degrees
    # need not match: replicas of different degrees may allow the same batch, and among those the
    # planner keeps the ones whose groups stay where they were.
    cluster, spec = sc
    prev = make_plan(other[0], other[1])  # a plan of another cluster and job: a meaningless hint
    for hint in (None, prev):
        new = make_plan(cluster, spec, hint)
        old = make_plan(cluster, spec, packing="sorted")
        check_invariants(cluster, spec, new)
        if spec.scheme is Scheme.NTP_PW:
            assert new.global_batch >= old.global_batch
        else:
            assert new.global_batch == old.global_batch
            assert sorted(r.local_batch for r in new.replicas) == sorted(r.local_batch for r in old.replicas)
            # what each selected replica could run untrimmed: the packings are equally good
            assert sorted(spec.reduced_batch(r.tp) for r in new.replicas) == sorted(
                spec.reduced_batch(r.tp) for r in old.replicas)
        assert make_plan(cluster, spec, hint) == new  # deterministic


def test_equal_batches_keep_the_group_in_place_rather_than_the_higher_degree():
    # The hypothesis example above, spelled out: the previous plan ran d0, d1, d2 as replicas 0-2.
    cluster, spec = _TIE
    prev = make_plan(cluster_from_counts([8, 8, 8]), job(tp=8, pp=1, replicas=3, batch=8))
    new = make_plan(cluster, spec, prev)
    old = make_plan(cluster, spec, packing="sorted")
    assert [(r.tp, r.local_batch) for r in old.replicas] == [(8, 8), (7, 5), (7, 3)]  # d3 joins, d2 left
    assert [(r.tp, r.local_batch) for r in new.replicas] == [(8, 8), (7, 5), (6, 3)]
    assert [g.group_id for r in new.replicas for g in r.groups] == ["d0/g0", "d1/g0", "d2/g0"]
    assert new.moves is not None and (new.moves.moved, new.moves.joined, new.moves.left) == (0, 0, 0)
    assert new.global_batch == old.global_batch == 16


# ---- the paper's shape: one failure, one swap ------------------------------------------------------


def test_consolidating_a_new_reduced_group_is_one_swap_at_the_same_stage():
    # 16 NVL8 domains, TP8 x 4 stages, 4 replicas, ntp. A failure in replica 0 stage 2: nothing moves
    # (that replica simply runs at TP7). A second one in replica 1 stage 1: the best total puts both
    # TP7 groups into one replica, and the sorted cut would repack both replicas; here replica 0
    # takes replica 1's healthy stage-2 group and gives it its TP7 stage-2 group: 2 groups move,
    # neither changes stage, so no state is loaded.
    cluster = generate_cluster(16, 8, 4)
    spec = job(tp=8, pp=4, replicas=4, min_tp=4, heads=32, mlp=256, parameters=10**9)
    plan0 = make_plan(cluster, spec)
    one = cluster.with_states({cluster.domains[2].gpus[0].uuid: GpuState.FAILED})  # replica 0, stage 2
    plan1 = make_plan(one, spec, plan0)
    assert plan1.moves is not None and plan1.moves.moved == 0 and plan1.moves.bytes == 0
    two = one.with_states({cluster.domains[5].gpus[3].uuid: GpuState.FAILED})  # replica 1, stage 1
    plan2 = make_plan(two, spec, plan1)
    assert sorted(r.tp for r in plan2.replicas) == [7, 8, 8, 8]
    m = plan2.moves
    assert m is not None and (m.moved, m.stage_changed, m.joined, m.left, m.bytes) == (2, 0, 0, 0, 0)
    moved = {g.group_id: (g.prev_replica, g.prev_stage, r.replica_id, g.stage)
             for r in plan2.replicas for g in r.groups if (g.prev_replica, g.prev_stage) != (r.replica_id, g.stage)}
    assert moved == {"nvl-02/g0": (0, 2, 1, 2), "nvl-06/g0": (1, 2, 0, 2)}
    assert any("moves vs the previous plan: 2 group(s) moved (0 change stage" in x for x in plan2.reasons)
    assert "group nvl-06/g0: replica 1 stage 2 -> replica 0 stage 2" in plan2.reasons


def test_when_the_free_slot_is_another_stage_the_swap_changes_two_stages():
    # Both failures at stage 2: replica 1's healthy groups sit at stages 0, 1 and 3, so whichever
    # group fills replica 0's stage 2 must load another stage; the best plan still moves only 2.
    cluster = generate_cluster(16, 8, 4)
    spec = job(tp=8, pp=4, replicas=4, min_tp=4, heads=32, mlp=256, stage_bytes=(1, 2, 4, 8))
    bad = {cluster.domains[2].gpus[0].uuid: GpuState.FAILED, cluster.domains[6].gpus[3].uuid: GpuState.FAILED}
    plan1 = make_plan(cluster.with_states({cluster.domains[2].gpus[0].uuid: GpuState.FAILED}), spec)
    plan2 = make_plan(cluster.with_states(bad), spec, plan1)
    m = plan2.moves
    assert m is not None and (m.moved, m.stage_changed) == (2, 2)
    assert m.bytes == 4 + 1  # one group loads stage 2, the other stage 0


def test_bytes_count_the_stage_each_moved_group_loads():
    # A spare joins at stage 1 when a group of replica 0 drops below min_tp: it loads stage 1.
    # 480e9 parameters x 16 bytes / 2 stages = 3.84e12 bytes.
    cluster = generate_cluster(5, 8, 4)
    spec = job(tp=8, pp=2, replicas=2, min_tp=6, spares=1, heads=32, mlp=256, parameters=480 * 10**9)
    plan0 = make_plan(cluster, spec)
    bad = {cluster.domains[1].gpus[i].uuid: GpuState.FAILED for i in range(3)}  # replica 0, stage 1: TP5
    plan1 = make_plan(cluster.with_states(bad), spec, plan0)
    m = plan1.moves
    assert m is not None and (m.moved, m.stage_changed, m.joined, m.left) == (1, 1, 1, 1)
    assert m.bytes == 480 * 10**9 * 16 // 2
    (spare,) = [g for r in plan1.replicas for g in r.groups if g.spare]
    assert (spare.group_id, spare.stage, spare.prev_replica) == ("nvl-4/g0", 1, None)
    assert "3.8 TB of state to load" in m.describe()
    explicit = job(tp=8, pp=2, replicas=2, min_tp=6, spares=1, heads=32, mlp=256, stage_bytes=(7, 11))
    assert make_plan(cluster.with_states(bad), explicit, plan0).moves.bytes == 11


# ---- what each scheme does to each stage ----------------------------------------------------------


def test_ntp_pw_boosts_only_the_reduced_stage_and_ntp_runs_the_whole_replica_at_its_lowest():
    # 4 NVL8 domains = one replica of 4 stages (TP8) + one more replica; stage 2 of replica 0 loses
    # a GPU. ntp-pw: that group runs TP7 at 1.288 x TDP, the other three stages TP8 at TDP, batch kept.
    # ntp: every stage of replica 0 runs TP7 and the replica's batch is floor(16 / work(7)) = 13.
    cluster = cluster_with_usable(8, [8, 8, 7, 8, 8, 8, 8, 8])
    pw = make_plan(cluster, job(tp=8, pp=4, replicas=2, batch=16, min_tp=4, heads=32, mlp=256,
                                scheme=Scheme.NTP_PW))
    r0 = next(r for r in pw.replicas if any(g.usable == 7 for g in r.groups))
    assert [g.tp for g in r0.groups] == [8, 8, 7, 8] and r0.local_batch == 16
    assert [g.power_ratio > 1 for g in r0.groups] == [False, False, True, False]
    assert set(pw.power_caps_w) == set(next(g for g in r0.groups if g.tp == 7).gpus)
    ntp = make_plan(cluster, job(tp=8, pp=4, replicas=2, batch=16, min_tp=4, heads=32, mlp=256))
    r0 = next(r for r in ntp.replicas if r.tp == 7)
    assert [g.tp for g in r0.groups] == [7, 7, 7, 7] and r0.local_batch == 13 and not ntp.power_caps_w


def test_ntp_pw_replica_runs_at_its_slowest_stage():
    # Two reduced stages in one replica, one rack short of power: the replica's batch is the
    # smaller of the two stages' batches.
    cluster = cluster_from_counts([8, 8, 8, 8], [(0, 7), (1, 6), (1, 7)], budget_w=8000.0)
    plan = make_plan(cluster, job(tp=8, pp=2, replicas=2, batch=16, min_tp=4, heads=32, mlp=256,
                                  scheme=Scheme.NTP_PW))
    spec = job(tp=8, pp=2, replicas=2, batch=16, min_tp=4, heads=32, mlp=256, scheme=Scheme.NTP_PW)
    reduced = next(r for r in plan.replicas if r.tp < 8)
    per_stage = [spec.reduced_batch(g.tp, spec.power.speed(g.power_ratio)) for g in reduced.groups]
    assert reduced.local_batch == min(per_stage) < 16


# ---- inputs and outputs -----------------------------------------------------------------------------


def test_previous_from_plan_json_equals_previous_from_the_plan():
    cluster = generate_cluster(8, 8, 4)
    spec = job(tp=8, pp=2, replicas=4, min_tp=4, heads=32, mlp=256)
    plan0 = make_plan(cluster.with_states({cluster.domains[1].gpus[0].uuid: GpuState.FAILED}), spec)
    after = cluster.with_states({cluster.domains[1].gpus[0].uuid: GpuState.FAILED,
                                 cluster.domains[4].gpus[5].uuid: GpuState.FAILED})
    doc = plan_to_dict(plan0)
    a = make_plan(after, spec, PreviousLayout.from_dict(doc))
    b = make_plan(after, spec, plan0)
    assert a == b and a.moves is not None
    out = plan_to_dict(a)
    assert out["moves"] == {"moved": a.moves.moved, "stage_changed": a.moves.stage_changed,
                            "joined": a.moves.joined, "left": a.moves.left, "bytes": None}
    g = out["replicas"][0]["groups"][0]
    assert {"prev_replica", "prev_stage"} <= g.keys()
    assert plan_to_dict(make_plan(after, spec))["moves"] is None


def test_a_previous_plan_of_another_shape_is_ignored_with_a_reason():
    cluster = generate_cluster(8, 8, 4)
    other = make_plan(cluster, job(tp=4, pp=2, replicas=8, min_tp=2, heads=32, mlp=256))
    plan = make_plan(cluster, job(tp=8, pp=2, replicas=4, min_tp=4, heads=32, mlp=256), other)
    assert plan.moves is None and any("previous plan ignored: its TP degree 4" in x for x in plan.reasons)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"replicas": []}, "malformed"),
        ({"tp": 8, "replicas": [{"id": 0, "groups": [{"group": "a/g0"}]}]}, "malformed"),
        ({"tp": 8, "replicas": [{"id": 0, "groups": [{"group": "a/g0", "stage": 0}, {"group": "a/g1", "stage": 0}]}]},
         "held by two groups"),
    ],
)
def test_malformed_previous_plan_json_is_refused(doc, message):
    with pytest.raises(PlanError, match=message):
        PreviousLayout.from_dict(doc)


def test_diff_counts_moves_joins_and_leavers():
    before = {"a": (0, 0), "b": (0, 1), "c": (1, 0), "d": (1, 1)}
    # b changes replica (not stage: no bytes), c changes stage (loads stage 1), e joins at stage 0
    # (loads it), d left.
    after = [("a", (0, 0)), ("b", (1, 1)), ("c", (2, 1)), ("e", (2, 0))]
    m = diff_assignments(before, after, {0: 5, 1: 7})
    assert (m.moved, m.stage_changed, m.joined, m.left, m.bytes) == (3, 2, 1, 1, 12)
    assert m.moved_groups == ("b", "c", "e")
    assert diff_assignments(before, after).bytes is None


def test_unknown_groups_in_a_previous_layout_count_as_left():
    cluster = generate_cluster(4, 8, 4)
    spec = job(tp=8, pp=2, replicas=2, min_tp=4, heads=32, mlp=256)
    plan0 = plan_to_dict(make_plan(cluster, spec))
    plan0["replicas"][0]["groups"][0]["group"] = "gone-rack/g0"
    plan = make_plan(cluster, spec, PreviousLayout.from_dict(plan0))
    assert plan.moves is not None and plan.moves.left == 1 and plan.moves.joined == 1


def test_random_sequences_keep_the_paper_like_shape_quiet():
    # 64 NVL8 domains, TP8 x 8 stages, 8 replicas, 20 failures one at a time under ntp: each step
    # moves at most a handful of groups and keeps the sorted packer's global batch.
    cluster = generate_cluster(64, 8, 4)
    spec = job(tp=8, pp=8, replicas=8, min_tp=6, heads=32, mlp=256, stage_bytes=tuple(range(1, 9)))
    rng = random.Random(3)
    plan = make_plan(cluster, spec)
    snap = cluster
    for uuid in rng.sample(list(cluster.flat_uuids), 20):
        snap = snap.with_states({uuid: GpuState.FAILED})
        new = make_plan(snap, spec, plan)
        assert new.global_batch == make_plan(snap, spec, packing="sorted").global_batch
        assert new.moves is not None and new.moves.moved <= 8
        # the plan's own summary is the group-by-group comparison of the two plans
        slots = [(g.group_id, (r.replica_id, g.stage)) for r in new.replicas for g in r.groups]
        ref = diff_assignments(PreviousLayout.from_plan(plan).assignments, slots, spec.stage_sizes())
        assert (ref.moved, ref.stage_changed, ref.joined, ref.left, ref.bytes) == (
            new.moves.moved, new.moves.stage_changed, new.moves.joined, new.moves.left, new.moves.bytes)
        assert set(ref.moved_groups) == set(new.moves.moved_groups)
        plan = new


def test_among_equal_groups_the_one_in_a_contended_rack_is_left_over():
    # Three groups of equal key and no reference slot, replicas of 2: one is left over. Items 0 and
    # 1 share a rack with another reduced group (slack 0), item 2 has its rack's power to itself:
    # leaving 0 or 1 idle frees power for its rack-mate, so one of them is left, never item 2.
    blocks, left = pack([Item(0, 5, None, 0), Item(1, 5, None, 0), Item(2, 5, None, 1)], 2)
    assert left in ([0], [1]) and 2 in blocks[0].slots
    blocks, left = pack([Item(0, 5, None, 1), Item(1, 5, None, 1), Item(2, 5, None, 0)], 2)
    assert left == [2]
