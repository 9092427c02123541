"""service/planning.py: what counts as a layout change, and the move summary in words."""

from __future__ import annotations

import copy

import pytest

from ntp_manager.service import planning
from ntp_manager.topology import GpuState
from tests.fakes.builders import cluster_from_counts, job


def doc() -> dict:  # type: ignore[type-arg]
    return {"replicas": [{"id": 0, "tp": 4, "local_batch": 8, "groups": [
        {"group": "d0/g0", "stage": 0, "tp": 4, "gpus": ["a", "b", "c", "d"], "prev_replica": 0, "prev_stage": 0}]}],
        "power_caps_w": {}, "global_batch": 8, "moves": {"moved": 0}, "reasons": ["x"]}


@pytest.mark.parametrize("change, same", [
    (lambda d: d["replicas"][0]["groups"][0].update(prev_replica=3, prev_stage=1), True),  # history only
    (lambda d: d.update(moves=None, reasons=[]), True),  # what moved and why: not the layout
    (lambda d: d["replicas"][0]["groups"][0].update(gpus=["a", "b", "c", "e"]), False),
    (lambda d: d["replicas"][0]["groups"][0].update(stage=1), False),
    (lambda d: d["replicas"][0].update(local_batch=7), False),
    (lambda d: d.update(power_caps_w={"a": 1100.0}), False),
])
def test_fingerprint_ignores_history_and_sees_every_layout_change(change, same) -> None:  # type: ignore[no-untyped-def]
    a, b = doc(), doc()
    change(b)
    assert (planning.fingerprint(a) == planning.fingerprint(b)) is same


def test_draft_with_the_previous_plan_reports_moves_and_the_same_layout_fingerprints_alike() -> None:
    cluster = cluster_from_counts([4, 4, 4, 4])
    spec = job(tp=4, pp=2, replicas=2, min_tp=2)
    first = planning.draft(cluster, spec)
    assert first.doc["moves"] is None and "moves" not in first.summary
    again = planning.draft(cluster, spec, previous=copy.deepcopy(dict(first.doc)))
    assert again.doc["moves"]["moved"] == 0 and again.summary["moves"] == again.doc["moves"]
    assert again.fingerprint == first.fingerprint  # nothing changed: no new version
    one_down = cluster.with_states({cluster.domains[0].gpus[3].uuid: GpuState.FAILED})
    after = planning.draft(one_down, spec, previous=dict(first.doc))
    assert after.fingerprint != first.fingerprint


def test_previous_of_a_malformed_document_is_none() -> None:
    assert planning.previous_of(None) is None
    assert planning.previous_of({"replicas": [{"groups": [{}]}]}) is None


def test_moves_text() -> None:
    assert planning.moves_text(None) == ""
    text = planning.moves_text({"moved": 2, "stage_changed": 1, "joined": 0, "left": 1, "bytes": 3_000_000_000})
    assert text == "2 group(s) moved, 1 changing stage (0 newly placed), 1 left, ~3.0 GB to load"
