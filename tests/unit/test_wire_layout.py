"""The wire layout codec (contract/layout.py), which the manager encodes with and the worker decodes
with: any view survives encode -> bytes -> decode, however its serialized parts are split (the
manager concatenates them per watcher), every field of the messages has a place in the dataclasses,
and `rank_of` agrees with `contract.ranks` or refuses the view."""

from __future__ import annotations

import dataclasses
import itertools
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_manager.contract import layout as layout_mod
from ntp_manager.contract.layout import (
    WireGroup,
    WireLayout,
    WireReplica,
    WireSummary,
    head_part,
    own_part,
    peers_part,
    summaries_part,
    summary_runs_part,
)
from ntp_manager.contract.proto.ntp.v1 import common_pb2 as pb
from ntp_manager.contract.ranks import stage_ranks

U32, U64 = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
TEXT = st.text(max_size=12)

groups = st.builds(WireGroup, TEXT, TEXT, U32, U32, st.lists(TEXT, max_size=4).map(tuple),
                   st.lists(U32, max_size=4).map(tuple), st.floats(allow_nan=False))
replicas = st.builds(WireReplica, U32, st.lists(groups, max_size=3).map(tuple))
summaries = st.builds(WireSummary, U32, U32, U32, st.lists(U32, max_size=4).map(tuple))
layouts = st.builds(
    WireLayout,
    job=TEXT, version=U64, epoch=U64,
    created_at=st.none() | st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30),
                                        timezones=st.just(UTC)),
    healthy_tp=U32, target_batch=U32, global_batch=U32, world_size=U32,
    replicas=st.lists(summaries, max_size=6).map(tuple),
    own=st.none() | replicas,
    peers=st.lists(replicas, max_size=2).map(tuple),
    rendezvous=TEXT, reason=TEXT,
    restore_step=st.none() | U64,
)


@given(layouts)
@settings(max_examples=300, deadline=None)
def test_every_view_round_trips(w: WireLayout) -> None:
    assert WireLayout.from_bytes(w.to_bytes()) == w
    assert WireLayout.decode(w.encode()) == w


@given(layouts, st.data())
@settings(max_examples=200, deadline=None)
def test_parts_concatenated_in_any_split_are_the_view(w: WireLayout, data: st.DataObject) -> None:
    """The manager serializes the summaries in chunks, the own replica and a peer separately, and
    concatenates the bytes: that parses to the same view, wherever the chunks are cut."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(w.replicas)), max_size=3)))
    bounds = [0, *cuts, len(w.replicas)]
    parts = [head_part(w)] + [summaries_part(w.replicas[a:b]) for a, b in itertools.pairwise(bounds)]
    if w.own is not None:
        parts.append(own_part(w.own))
    parts += [peers_part([p]) for p in w.peers]  # one peer at a time, as the views cache them
    assert WireLayout.from_bytes(b"".join(parts)) == w


def test_every_message_field_has_a_place() -> None:
    """A field added to common.proto but not to the codec would be dropped silently: each message's
    fields are the dataclass's (the stamp's three are the layout's version, epoch and created_at)."""
    def names(msg: type) -> set[str]:
        return {f.name for f in msg.DESCRIPTOR.fields}  # type: ignore[attr-defined]

    fields = {f.name for f in dataclasses.fields(WireLayout)}
    # replica_runs is a second encoding of `replicas` (runs of summaries: see the tests below)
    assert names(pb.Layout) - {"stamp", "replica_runs"} == fields - {"version", "epoch", "created_at"}
    assert names(pb.ReplicaRun) == {"first_id", "count"} | set(WireSummary._fields) - {"replica_id"}
    assert names(pb.LayoutStamp) == {"leader_epoch", "version", "created_at"}
    assert names(pb.ReplicaSummary) == set(WireSummary._fields)
    assert names(pb.ReplicaDetail) == {f.name for f in dataclasses.fields(WireReplica)}
    assert names(pb.TpGroup) == {f.name for f in dataclasses.fields(WireGroup)}


def test_created_at_decodes_as_aware_utc() -> None:
    naive = datetime(2026, 11, 28, 17, 30, 1, 250)  # what SQLite gives: read as UTC
    w = WireLayout.from_bytes(WireLayout("j", 1, created_at=naive).to_bytes())
    assert w.created_at == naive.replace(tzinfo=UTC)
    assert WireLayout.from_bytes(WireLayout("j", 1).to_bytes()).created_at is None


# -- reading a view: ranks -------------------------------------------------------------------------

degrees_st = st.integers(1, 3).flatmap(
    lambda depth: st.lists(st.lists(st.integers(1, 4), min_size=depth, max_size=depth).map(tuple),
                           min_size=1, max_size=4).map(tuple))


def _view(degrees: tuple[tuple[int, ...], ...], own: int) -> WireLayout:
    """A consistent view of replica `own` of a layout of `degrees` (GPU names "r{i}s{j}t{k}")."""
    ranks = stage_ranks(degrees)
    detail = WireReplica(own, tuple(
        WireGroup(f"g{own}.{s}", "d", s, d, tuple(f"r{own}s{s}t{k}" for k in range(d)), tuple(ranks[own][s]), 1.0)
        for s, d in enumerate(degrees[own])))
    summ = tuple(WireSummary(i, min(d), 1, d) for i, d in enumerate(degrees))
    return WireLayout("j", 3, replicas=summ, own=detail)


@given(degrees_st, st.data())
@settings(max_examples=200, deadline=None)
def test_rank_of_numbers_like_contract_ranks(degrees: tuple[tuple[int, ...], ...], data: st.DataObject) -> None:
    own = data.draw(st.integers(0, len(degrees) - 1))
    view = WireLayout.from_bytes(_view(degrees, own).to_bytes())
    ranks = stage_ranks(degrees)
    for s, d in enumerate(degrees[own]):
        for k in range(d):
            assert view.rank_of(f"r{own}s{s}t{k}") == ranks[own][s][k]
    assert view.rank_of("elsewhere") is None
    assert view.degrees == degrees


@given(degrees_st, st.data())
@settings(max_examples=200, deadline=None)
def test_a_view_whose_ranks_disagree_is_refused(degrees: tuple[tuple[int, ...], ...], data: st.DataObject) -> None:
    own = data.draw(st.integers(0, len(degrees) - 1))
    view = _view(degrees, own)
    assert view.own is not None
    s = data.draw(st.integers(0, len(degrees[own]) - 1))
    g = view.own.groups[s]
    k = data.draw(st.integers(0, g.tp - 1))
    shift = data.draw(st.integers(1, 50))
    bad = dataclasses.replace(g, global_ranks=tuple(r + shift if i == k else r for i, r in enumerate(g.global_ranks)))
    groups = tuple(bad if i == s else x for i, x in enumerate(view.own.groups))
    broken = dataclasses.replace(view, own=WireReplica(own, groups))
    with pytest.raises(ValueError, match="the stage numbering gives"):
        broken.rank_of(g.gpu_uuids[k])


def test_views_that_do_not_add_up_are_refused() -> None:
    view = _view(((2, 2), (2, 1)), 1)
    with pytest.raises(ValueError, match="own replica 9 has no summary"):
        dataclasses.replace(view, own=dataclasses.replace(view.own, replica_id=9)).rank_of("r1s0t0")  # type: ignore[arg-type]
    short = dataclasses.replace(view, replicas=(view.replicas[0], view.replicas[1]._replace(stage_tps=(2,))))
    with pytest.raises(ValueError, match="every replica of a job is a pipeline of the same depth"):
        short.rank_of("r1s0t0")
    one_stage = dataclasses.replace(view, replicas=tuple(s._replace(stage_tps=()) for s in view.replicas))
    with pytest.raises(ValueError, match="does not match replica 1's stage degrees"):
        one_stage.rank_of("r1s1t0")


# ---- summaries as runs (views.py sends them so) ---------------------------------------------------

shapes = st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2]),
                   st.sampled_from([(), (4,), (8, 8), (8, 4)]))


@st.composite
def ascending_summaries(draw: st.DrawFn) -> list[WireSummary]:
    """Summaries as a plan has them: ascending ids, mostly consecutive, few distinct shapes."""
    steps = draw(st.lists(st.tuples(st.sampled_from([1, 1, 1, 2, 7]), shapes), max_size=60))
    out, rid = [], draw(st.integers(0, 5))
    for gap, (tp, batch, stage_tps) in steps:
        out.append(WireSummary(rid, tp, batch, stage_tps))
        rid += gap
    return out


@given(ascending_summaries(), st.data())
@settings(max_examples=300, deadline=None)
def test_summaries_as_runs_decode_to_the_same_view(summ: list[WireSummary], data: st.DataObject) -> None:
    """Runs in chunks cut anywhere (the manager encodes a large job a few thousand at a time),
    merged with the single summaries, decode to the summaries in id order."""
    w = WireLayout(job="j", version=3, epoch=2, replicas=tuple(summ))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(summ)), max_size=3)))
    bounds = [0, *cuts, len(summ)]
    parts = [head_part(w)] + [summary_runs_part(summ[a:b]) for a, b in itertools.pairwise(bounds)]
    assert WireLayout.from_bytes(b"".join(parts)) == w


def test_a_large_job_is_a_few_runs() -> None:
    """12,500 replicas at TP8 with three of them reduced: a few dozen bytes of runs, where the
    summaries one by one are ~100 KB (what each of 12,500 watchers was sent per version)."""
    summ = [WireSummary(i, 8, 2, (8,)) for i in range(12_500)]
    for i in (17, 4_000, 4_001):
        summ[i] = WireSummary(i, 7, 2, (7,))
    runs, plain = summary_runs_part(summ), summaries_part(summ)
    assert len(runs) < 200 and len(plain) > 100_000
    msg = pb.Layout.FromString(runs)
    assert len(msg.replica_runs) == 4 and len(msg.replicas) == 1  # 4,000-4,001 are a run too
    assert WireLayout.from_bytes(runs).replicas == tuple(summ)


def test_summaries_whose_ids_do_not_ascend_go_one_by_one() -> None:
    summ = [WireSummary(5, 8, 1, ()), WireSummary(6, 8, 1, ()), WireSummary(2, 8, 1, ())]
    data = summary_runs_part(summ)
    assert data == summaries_part(summ) and WireLayout.from_bytes(data).replicas == tuple(summ)


@pytest.mark.parametrize(("runs", "singles", "error"), [
    ([pb.ReplicaRun(first_id=3, count=0, tp=8)], [], "run from replica 3 lists no replica"),
    ([pb.ReplicaRun(first_id=0, count=4, tp=8)], [pb.ReplicaSummary(replica_id=2, tp=8)], "replica 2 is listed twice"),
    ([pb.ReplicaRun(first_id=0, count=4, tp=8), pb.ReplicaRun(first_id=3, count=2, tp=8)], [],
     "replica 3 is listed twice"),
    ([pb.ReplicaRun(first_id=0, count=2**32 - 1, tp=8)], [], "more than"),
])
def test_runs_that_do_not_add_up_are_refused(runs: list[pb.ReplicaRun], singles: list[pb.ReplicaSummary],
                                             error: str) -> None:
    """A worker refuses such a view (ValueError: worker/sources.py) before it allocates for it."""
    msg = pb.Layout(job="j", replicas=singles, replica_runs=runs)
    with pytest.raises(ValueError, match=error):
        WireLayout.decode(msg)
    assert layout_mod.MAX_REPLICAS < 2**32 - 1
