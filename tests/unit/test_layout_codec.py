"""store/layout_codec.py: compact layout bodies and deltas read back exactly what was written.

Property-style: random layouts (any replica ids, pipeline depths, TP degrees, previous places,
power caps, set-aside lists), chains of versions where each is a small change of the one before
or an unrelated layout, keyframes restarting a chain; and real plans of the planner through a
sequence of failures. Bodies that cannot be read are refused with CodecError, never misread."""

from __future__ import annotations

import json
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import Scheme, make_plan
from ntp_manager.planner.export import plan_to_dict
from ntp_manager.planner.layout import AsideDoc, GroupDoc, LayoutDoc, MovesDoc, ReplicaDoc
from ntp_manager.store import layout_codec as codec
from tests.fakes.builders import cluster_from_counts, job

UUIDS = [f"GPU-{i:04d}-{'x' * (i % 3)}" for i in range(300)]
# positions are not the UUIDs' order: a shuffled, gappy table, as registrations over time give
POS = {u: 7 + 3 * ((i * 113) % 300) for i, u in enumerate(UUIDS)}
AT = {p: u for u, p in POS.items()}


def pos_of(u: str) -> int:
    return POS[u]


def uuid_at(p: int) -> str:
    return AT[p]


floats = st.one_of(st.just(1.0), st.floats(0.5, 2.0, allow_nan=False, allow_infinity=False))
domains = st.sampled_from(["d0", "d1", "nvl-07", "rack/a", "x/g"])


@st.composite
def groups(draw: st.DrawFn, rid: int, stage: int) -> GroupDoc:
    dom = draw(domains)
    gid = draw(st.one_of(st.integers(0, 40).map(lambda n: f"{dom}/g{n}"), st.sampled_from(["odd", f"{dom}/g01"])))
    tp = draw(st.integers(1, 4))
    prev = draw(st.sampled_from([(None, None), (rid, stage), "other"]))
    if prev == "other":
        prev = (draw(st.integers(0, 60)), draw(st.integers(0, 3)))
    return GroupDoc(gid, dom, stage, tp, tp + draw(st.integers(0, 2)), draw(st.booleans()), draw(floats),
                    tuple(draw(st.lists(st.sampled_from(UUIDS), min_size=tp, max_size=tp))), prev[0], prev[1])


@st.composite
def replicas(draw: st.DrawFn, rid: int, depth: int) -> ReplicaDoc:
    gs = tuple(draw(groups(rid, s)) for s in range(depth))
    return ReplicaDoc(rid, min(g.tp for g in gs), draw(st.integers(0, 64)), draw(floats), gs)


asides = st.lists(st.builds(AsideDoc, domains.map(lambda d: f"{d}/g0"), domains, st.integers(0, 8), st.booleans(),
                            st.text(max_size=20)), max_size=4)


@st.composite
def layouts(draw: st.DrawFn) -> LayoutDoc:
    depth = draw(st.integers(1, 3))
    ids = sorted(draw(st.sets(st.integers(0, 60), max_size=8)))
    reps = tuple(draw(replicas(i, depth)) for i in ids)
    track = draw(st.booleans())
    if not track:  # a layout written before previous places were recorded has none
        reps = tuple(r._replace(groups=tuple(g._replace(prev_replica=None, prev_stage=None) for g in r.groups))
                     for r in reps)
    used = [u for r in reps for g in r.groups for u in g.gpus]
    caps = {u: draw(st.floats(100, 1500, allow_nan=False)) for u in draw(st.sets(st.sampled_from(used)))} if used \
        else {}
    moves = draw(st.one_of(st.none(), st.builds(MovesDoc, st.integers(0, 9), st.integers(0, 9), st.integers(0, 9),
                                                st.integers(0, 9), st.one_of(st.none(), st.integers(0, 10**13)))))
    return LayoutDoc(
        job=draw(st.text(min_size=1, max_size=8)), scheme=draw(st.sampled_from(["dp-drop", "ntp", "ntp-pw"])),
        tp=draw(st.integers(1, 8)), global_batch=draw(st.integers(0, 10**6)), target_batch=draw(st.integers(1, 10**6)),
        relative_throughput=draw(floats), meets_target=draw(st.booleans()), replicas=reps, dropped=tuple(draw(asides)),
        idle=tuple(draw(asides)), spares_used=tuple(draw(st.lists(st.text(max_size=6), max_size=3))),
        power_caps_w=dict(sorted(caps.items())), reasons=tuple(draw(st.lists(st.text(max_size=30), max_size=4))),
        moves=moves, tracks_moves=track)


@st.composite
def changed(draw: st.DrawFn, doc: LayoutDoc) -> LayoutDoc:
    """A small change of `doc`, as a replan makes one: a replica replaced, dropped or added, caps or
    reasons changed; or an unrelated layout."""
    kind = draw(st.sampled_from(["replica", "drop", "add", "caps", "reasons", "fresh", "same"]))
    reps = list(doc.replicas)
    depth = len(reps[0].groups) if reps else 1
    if kind == "replica" and reps:
        i = draw(st.integers(0, len(reps) - 1))
        reps[i] = draw(replicas(reps[i].id, depth))
    elif kind == "drop" and reps:
        del reps[draw(st.integers(0, len(reps) - 1))]
    elif kind == "add":
        new = draw(st.integers(0, 70))
        if new not in {r.id for r in reps}:
            reps = sorted([*reps, draw(replicas(new, depth))], key=lambda r: r.id)
    elif kind == "caps":
        used = [u for r in reps for g in r.groups for u in g.gpus] or ["GPU-0000-"]
        caps = dict(doc.power_caps_w)
        for u in draw(st.lists(st.sampled_from(used), max_size=3)):
            caps[u] = draw(st.floats(100, 1500))
        for u in draw(st.lists(st.sampled_from(sorted(caps) or used), max_size=2)):
            caps.pop(u, None)
        return doc.replace(power_caps_w=dict(sorted(caps.items())))
    elif kind == "reasons":
        return doc.replace(reasons=(*doc.reasons, "one more"), idle=doc.idle[1:], moves=None)
    elif kind == "fresh":
        return draw(layouts())
    if not doc.tracks_moves:
        reps = [r._replace(groups=tuple(g._replace(prev_replica=None, prev_stage=None) for g in r.groups))
                for r in reps]
    return doc.replace(replicas=tuple(reps), global_batch=sum(r.local_batch for r in reps))


@settings(max_examples=40, deadline=None)
@given(layouts())
def test_a_keyframe_reads_back_the_layout_it_was_made_of(doc: LayoutDoc) -> None:
    body = codec.encode(doc, pos_of)
    assert codec.decode(body, uuid_at) == doc
    # and the documented plan JSON reads back the same layout (a layout without groups cannot say
    # whether it records previous places)
    if doc.replicas:
        assert LayoutDoc.from_dict(doc.to_dict()) == doc


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_delta_carries_exactly_the_replicas_whose_records_differ(data: st.DataObject) -> None:
    # the codec compares columns; a replica differs when its record (every field, its groups and
    # their GPUs) differs from the base's of the same id, or the base has none
    old = data.draw(layouts())
    new = data.draw(changed(old))
    if data.draw(st.booleans()) and new.replicas:  # one GPU of a kept replica swapped for another
        reps = list(new.replicas)
        i = data.draw(st.integers(0, len(reps) - 1))
        g = reps[i].groups[0]
        swapped = g._replace(gpus=(data.draw(st.sampled_from(UUIDS)), *g.gpus[1:]))
        reps[i] = reps[i]._replace(groups=(swapped, *reps[i].groups[1:]))
        new = new.replace(replicas=tuple(reps))
    before = {r.id: r for r in old.replicas}
    assert codec.changed(new, old) == [i for i, r in enumerate(new.replicas) if before.get(r.id) != r]


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_a_chain_of_deltas_with_keyframes_reads_back_every_version(data: st.DataObject) -> None:
    docs = [data.draw(layouts())]
    for _ in range(data.draw(st.integers(1, codec.KEYFRAME_EVERY + 3))):
        docs.append(data.draw(changed(docs[-1])))
    # write as the manager does: a keyframe every KEYFRAME_EVERY versions, deltas between
    bodies = [codec.encode(d, pos_of, None if i % codec.KEYFRAME_EVERY == 0 else docs[i - 1])
              for i, d in enumerate(docs)]
    assert codec.decode_chain(bodies, uuid_at) == docs
    # any version is read from its keyframe: at most KEYFRAME_EVERY bodies
    v = data.draw(st.integers(0, len(docs) - 1))
    key = v - v % codec.KEYFRAME_EVERY
    assert codec.decode_chain(bodies[key : v + 1], uuid_at)[-1] == docs[v]


def test_real_plans_through_failures_round_trip_and_deltas_stay_small() -> None:
    cluster = cluster_from_counts([8] * 256)
    spec = job(tp=8, pp=2, replicas=120, min_tp=4, scheme=Scheme.NTP_PW, heads=64, mlp=256)
    plans = [make_plan(cluster, spec)]
    rng = [cluster.domains[(37 * k) % 256].gpus[k % 8].uuid for k in range(12)]
    for u in rng:
        cluster = cluster.with_states({u: GpuState.FAILED})
        plans.append(make_plan(cluster, spec, plans[-1]))
    docs = [LayoutDoc.of(p) for p in plans]
    # the columns LayoutDoc.of fills from a plan are those of the plan's records, as typed records
    for p, d in zip(plans, docs, strict=True):
        records = [ReplicaDoc(r.replica_id, r.tp, r.local_batch, round(r.relative_throughput, 6), tuple(
            GroupDoc(g.group_id, g.domain, g.stage, g.tp, g.usable, g.spare, g.power_ratio, g.gpus, g.prev_replica,
                     g.prev_stage) for g in r.groups)) for r in p.replicas]
        assert d == LayoutDoc(**d.header(), replicas=records) and list(d.replicas) == records
    pos = {u: i for i, u in enumerate(g.uuid for d in cluster.domains for g in d.gpus)}
    at = {i: u for u, i in pos.items()}
    bodies = [codec.encode(d, pos.__getitem__, docs[i - 1] if i else None) for i, d in enumerate(docs)]
    assert codec.decode_chain(bodies, at.__getitem__) == docs
    # the decoded layouts show the plan JSON exactly as the planner exports it
    assert [d.to_dict() for d in codec.decode_chain(bodies, at.__getitem__)] == [plan_to_dict(p) for p in plans]
    # a one-GPU replan rewrites a replica or two, not the layout: its delta is far below a keyframe
    # (the first replan records every group's previous place, which the first layout has none of)
    key = codec.encode(docs[-1], pos.__getitem__)
    assert all(len(b) < len(key) / 2 for b in bodies[2:]), ([len(b) for b in bodies], len(key))


def test_bodies_that_cannot_be_read_are_refused() -> None:
    doc = LayoutDoc.of(make_plan(cluster_from_counts([4, 4]), job(tp=4, replicas=2)))
    pos = {u: i for i, u in enumerate(doc.gpus)}
    key = codec.encode(doc, pos.__getitem__)
    delta = codec.encode(doc, pos.__getitem__, base=doc)
    with pytest.raises(codec.CodecError, match="no position"):
        codec.encode(doc, {}.__getitem__)
    with pytest.raises(codec.CodecError, match="does not hold"):
        codec.decode(key, {0: "GPU-0-0"}.__getitem__)
    with pytest.raises(codec.CodecError, match="no base"):
        codec.decode(delta, list(pos).__getitem__)
    with pytest.raises(codec.CodecError, match="compressed JSON"):
        codec.decode(key[:-3], list(pos).__getitem__)
    with pytest.raises(codec.CodecError, match="unknown codec"):
        codec.decode(zlib.compress(b'{"codec": 99, "kind": "key"}'), list(pos).__getitem__)
    with pytest.raises(codec.CodecError, match="malformed"):
        codec.decode(zlib.compress(b'{"codec": 1, "kind": "key", "head": []}'), list(pos).__getitem__)


def test_long_columns_are_written_and_read_a_chunk_per_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lists longer than CHUNK go on lines of their own, so no single JSON call spans a whole
    100K-GPU column (each holds the GIL throughout)."""
    monkeypatch.setattr(codec, "CHUNK", 3)
    plans = [make_plan(cluster_from_counts([4] * 6), job(tp=4, replicas=5, scheme=Scheme.NTP_PW, heads=64, mlp=256))]
    doc = LayoutDoc.of(plans[0])
    pos = {u: 10 * i for i, u in enumerate(doc.gpus)}
    body = codec.encode(doc, pos.__getitem__)
    lines = zlib.decompress(body).split(b"\n")
    assert len(lines) > 10 and all(line.count(b",") < 3 for line in lines[1:])  # 3 items a line at most
    assert codec.decode(body, {p: u for u, p in pos.items()}.__getitem__) == doc
    with pytest.raises(codec.CodecError, match="compressed JSON"):  # a line short, or one too many
        codec.decode(zlib.compress(b"\n".join(lines[:-1])), {p: u for u, p in pos.items()}.__getitem__)
    with pytest.raises(codec.CodecError, match="compressed JSON"):
        codec.decode(zlib.compress(b"\n".join([*lines, b"[1]"])), {p: u for u, p in pos.items()}.__getitem__)


@settings(max_examples=30, deadline=None)
@given(layouts())
def test_gpus_are_kept_in_the_global_rank_order_of_planner_ranks(doc: LayoutDoc) -> None:
    """A layout keeps every GPU at its global rank as `contract.ranks.stage_ranks` numbers them (the
    workers' numbering), and its records read back the groups it was made of."""
    numbered = [r for stages in doc.ranks() for r in stages]
    assert [doc.group_ranks(g) for g in range(len(doc.group_ids))] == numbered
    for r, stages in zip(doc.replicas, doc.ranks(), strict=True):
        for g, ranks in zip(r.groups, stages, strict=True):
            assert tuple(doc.gpus[k] for k in ranks) == g.gpus
    assert LayoutDoc(**{**doc.header(), "replicas": list(doc.replicas)}) == doc


@given(st.data())
def test_the_replicas_changed_since_a_layout_are_those_its_records_show(data: st.DataObject) -> None:
    """LayoutDoc.changed_since compares column slices; the records say the same, replica by replica."""
    old = data.draw(layouts())
    new = data.draw(st.one_of(changed(old), layouts()))
    before = {r.id: r for r in old.replicas}
    want = [i for i, r in enumerate(new.replicas) if (b := before.get(r.id)) is None or b[:4] != r[:4]
            or [g.placement() for g in b.groups] != [g.placement() for g in r.groups]]
    assert new.changed_since(old) == want
    assert new.changed_since(None) == list(range(len(new.replica_ids)))
    assert new.changed_since(new) == []


def record_columns(reps: list[ReplicaDoc]) -> dict[str, object]:
    """What a body says of `reps`, written from the typed records, one by one: the reference the
    codec's column reads are compared with."""
    doms: dict[str, int] = {}
    r: dict[str, list[object]] = {k: [] for k in ("id", "tp", "lb", "rt", "ng")}
    g: dict[str, list[object]] = {k: [] for k in ("dom", "id", "tp", "us", "sp", "pr", "pv")}
    gpus: list[int] = []
    for rep in reps:
        for k, v in zip(r, (rep.id, rep.tp, rep.local_batch, rep.relative_throughput, len(rep.groups)), strict=True):
            r[k].append(v)
        for grp in rep.groups:
            n = grp.group.rpartition("/g")[2]
            local: object = int(n) if grp.group == f"{grp.domain}/g{n}" and n.isdigit() and str(int(n)) == n \
                else grp.group
            prev = (grp.prev_replica, grp.prev_stage)
            pv = True if prev == (rep.id, grp.stage) else None if prev == (None, None) else list(prev)
            for k, v in zip(g, (doms.setdefault(grp.domain, len(doms)), local, grp.tp, grp.usable, int(grp.spare),
                                grp.power_ratio, pv), strict=True):
                g[k].append(v)
            gpus.extend(POS[u] for u in grp.gpus)
    return {"domains": list(doms), "r": r, "g": g, "gpus": [b - a for a, b in zip([0, *gpus], gpus, strict=False)]}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_body_s_replica_columns_are_those_its_records_give(data: st.DataObject) -> None:
    """The codec reads a body's replicas off the layout's columns (no record made); the records,
    replica by replica, give the same columns: for every replica, and for any subset a delta
    carries."""
    doc = data.draw(layouts())
    which = sorted(data.draw(st.sets(st.integers(0, max(len(doc.replica_ids) - 1, 0)))) if doc.replica_ids else [])
    for idx in (list(range(len(doc.replica_ids))), which):
        # as JSON text: True and 1, 2 and 2.0 are equal in Python, not in a body
        want = record_columns([doc.replica(i) for i in idx])
        assert json.dumps(codec._replicas(doc, idx, pos_of)) == json.dumps(want)
