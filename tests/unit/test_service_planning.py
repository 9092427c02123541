"""service/planning/planning.py: what counts as a layout change, how a version is stored after the one
before it, and the move summary in words."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

import pytest

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner.layout import GroupDoc, LayoutDoc, MovesDoc, ReplicaDoc
from ntp_manager.service.core.state import LayoutRec
from ntp_manager.service.planning import planning
from ntp_manager.store import layout_codec as codec
from tests.fakes.builders import cluster_from_counts, job


def doc() -> LayoutDoc:
    g = GroupDoc("d0/g0", "d0", 0, 4, 4, False, 1.0, ("a", "b", "c", "d"), 0, 0)
    return LayoutDoc("j", "ntp", 4, 8, 8, 1.0, True, (ReplicaDoc(0, 4, 8, 1.0, (g,)),),
                     moves=MovesDoc(0, 0, 0, 0, None), reasons=("x",))


def group(d: LayoutDoc, **kw: object) -> LayoutDoc:
    r = d.replicas[0]
    return d.replace(replicas=(r._replace(groups=(r.groups[0]._replace(**kw),)),))


@pytest.mark.parametrize("change, same", [
    (lambda d: group(d, prev_replica=3, prev_stage=1), True),  # history only
    (lambda d: d.replace(moves=None, reasons=()), True),  # what moved and why: not the layout
    (lambda d: group(d, gpus=("a", "b", "c", "e")), False),
    (lambda d: group(d, power_ratio=1.1), False),
    (lambda d: d.replace(replicas=(d.replicas[0]._replace(local_batch=7),)), False),
    (lambda d: d.replace(power_caps_w={"a": 1100.0}), False),
    (lambda d: d.replace(global_batch=7), False),
])
def test_same_layout_ignores_history_and_sees_every_layout_change(
        change: Callable[[LayoutDoc], LayoutDoc], same: bool) -> None:
    assert doc().same_layout(change(doc())) is same
    assert change(doc()).same_layout(doc()) is same


def test_draft_with_the_previous_layout_reports_moves_and_an_unchanged_layout_is_no_version() -> None:
    cluster = cluster_from_counts([4, 4, 4, 4])
    pos = {g.uuid: i for i, g in enumerate(g for d in cluster.domains for g in d.gpus)}
    spec = job(tp=4, pp=2, replicas=2, min_tp=2)
    first = planning.draft(cluster, spec, None, pos.__getitem__)
    assert first.doc.moves is None and "moves" not in first.summary and not first.unchanged
    assert first.encoded is not None and first.encoded.base_version is None  # the first version is a keyframe
    v1 = LayoutRec("t", 1, 1, first.doc, first.why, dt.datetime.now(dt.UTC))
    again = planning.draft(cluster, spec, v1, pos.__getitem__)
    assert again.doc.moves is not None and again.doc.moves.moved == 0
    assert again.unchanged and again.encoded is None  # nothing changed: no new version
    one_down = cluster.with_states({cluster.domains[0].gpus[3].uuid: GpuState.FAILED})
    after = planning.draft(one_down, spec, v1, pos.__getitem__)
    assert not after.unchanged and after.summary["moves"] == after.doc.moves._asdict()
    assert after.encoded is not None and after.encoded.base_version == 1 and after.encoded.chain == 1
    assert codec.decode(after.encoded.body, {i: u for u, i in pos.items()}.__getitem__, v1.doc) == after.doc
    assert after.why.startswith("replanned: replicas 2 -> 2, TP degrees [4, 4] -> [3, 4]")


def test_every_keyframe_every_th_version_is_a_keyframe() -> None:
    d = doc()
    pos = dict.fromkeys("abcd", 0) | {"b": 1, "c": 2, "d": 3}
    chain = [planning.encode_for(d, LayoutRec("j", v, 1, d, "", dt.datetime.now(dt.UTC), chain=c), pos.__getitem__)
             for v, c in [(1, 0), (2, codec.KEYFRAME_EVERY - 2), (3, codec.KEYFRAME_EVERY - 1)]]
    assert [(e.base_version, e.chain) for e in chain] == [(1, 1), (2, codec.KEYFRAME_EVERY - 1), (None, 0)]


def test_previous_of_a_layout_that_cannot_be_kept_is_none() -> None:
    assert planning.previous_of(None) is None
    d = doc()
    twice = d.replace(replicas=(d.replicas[0], d.replicas[0]._replace(id=1, groups=(d.replicas[0].groups[0],))))
    # the same group in two replicas is no previous layout the planner can keep
    assert planning.previous_of(twice) is None


def test_reasons_stay_short_for_large_jobs_and_moves_read_in_words() -> None:
    d = doc()
    big = d.replace(replicas=tuple(d.replicas[0]._replace(id=i, tp=8 - (i == 5)) for i in range(100)))
    assert planning.tps_text(big) == "TP7 x 1, TP8 x 99"
    assert planning.tps_text(d) == "[4]"
    assert planning.moves_text(None) == ""
    text = planning.moves_text(MovesDoc(2, 1, 0, 1, 3_000_000_000))
    assert text == "2 group(s) moved, 1 changing stage (0 newly placed), 1 left, ~3.0 GB to load"


def test_the_audit_summary_names_what_changed_and_stays_bounded() -> None:
    d = doc()
    r0 = d.replicas[0]
    old = d.replace(replicas=tuple(r0._replace(id=i) for i in range(200)))
    # replica 7 loses a GPU (TP3), replica 9 leaves, replica 300 is new
    g3 = r0.groups[0]._replace(tp=3, gpus=("a", "b", "c"))
    new_reps = [r0._replace(id=i) if i != 7 else r0._replace(id=7, tp=3, groups=(g3,)) for i in range(200) if i != 9]
    new = old.replace(replicas=(*new_reps, r0._replace(id=300)))
    s = planning.summary(new, old)
    assert s["replicas"] == 200 and s["tp_counts"] == {"3": 1, "4": 199}
    assert s["changed"] == 2 and s["changed_replicas"] == [[7, 3, 8], [300, 4, 8]] and s["removed_replicas"] == [9]
    # a first layout: every replica is new, but only AUDITED of them are listed
    first = planning.summary(new, None)
    assert first["changed"] == 200 and len(first["changed_replicas"]) == planning.AUDITED
