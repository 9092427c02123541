"""service/planning/planning.py `previous_of`: a running layout's assignments are made once per
document and kept for the last PREVIOUS_KEPT documents, and a cached answer is the answer."""

from __future__ import annotations

import pytest

from ntp_manager.planner import PlanError, make_plan
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.planning import planning
from tests.fakes.builders import cluster_from_counts, job


def _doc(replicas: int = 2) -> LayoutDoc:
    return LayoutDoc.of(make_plan(cluster_from_counts([4] * replicas), job(replicas=replicas)))


def test_the_assignments_of_a_document_are_made_once_and_are_its_own() -> None:
    doc = _doc()
    first = planning.previous_of(doc)
    assert first is not None and first == doc.previous()
    assert planning.previous_of(doc) is first
    other = _doc(3)  # equal documents are not mixed up: the key is the document itself
    assert planning.previous_of(other) == other.previous() != first


def test_the_cache_keeps_the_last_documents_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planning, "_previous", type(planning._previous)())
    docs = [_doc() for _ in range(planning.PREVIOUS_KEPT + 1)]
    made = [planning.previous_of(d) for d in docs]
    assert len(planning._previous) == planning.PREVIOUS_KEPT
    again = planning.previous_of(docs[0])  # dropped (the oldest): made again, equal
    assert again is not made[0] and again == made[0]
    assert planning.previous_of(docs[-1]) is made[-1]


def test_a_document_that_cannot_be_used_is_none_and_kept_as_none(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = _doc()
    calls = []

    def broken(self: LayoutDoc) -> None:
        calls.append(1)
        raise PlanError("a group is placed twice")

    monkeypatch.setattr(LayoutDoc, "previous", broken)
    assert planning.previous_of(doc) is None and planning.previous_of(doc) is None
    assert calls == [1]
