"""service/planning/layout_views.py and `LayoutDoc.to_dict` pages: answers about a layout list a page of
its replicas (and their GPUs' power caps), cap the lists that grow with the cluster, and always
give the totals; the pages together are the whole plan JSON."""

from __future__ import annotations

import pytest

from ntp_manager.planner import Scheme, make_plan
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.core.errors import InvalidArgument
from ntp_manager.service.planning import layout_views as views
from tests.fakes.builders import cluster_from_counts, job


def layout() -> LayoutDoc:
    # 6 domains of 4, one GPU failed in d0 and in d2: 5 replicas at TP 3, 4, 3, 4, 4 (ids 0..4),
    # the two TP3 groups boosted (6 capped GPUs), 18 GPUs placed
    cluster = cluster_from_counts([4] * 6, [(0, 1), (2, 3)])
    return LayoutDoc.of(make_plan(cluster, job(tp=4, replicas=5, scheme=Scheme.NTP_PW, heads=64, mlp=256)))


def test_pages_together_are_the_whole_plan() -> None:
    doc = layout()
    whole = doc.to_dict()
    assert len(whole["replicas"]) == 5 and len(whole["power_caps_w"]) == 6
    for size in (1, 2, 3, 5, 7):
        pages = [views.plan_page(doc, size, off) for off in range(0, 5, size)]
        assert [r for p in pages for r in p["plan"]["replicas"]] == whole["replicas"], size
        caps: dict[str, float] = {}
        for p in pages:
            shown = {u for r in p["plan"]["replicas"] for g in r["groups"] for u in g["gpus"]}
            assert set(p["plan"]["power_caps_w"]) <= shown  # a page's caps are its own GPUs'
            caps.update(p["plan"]["power_caps_w"])
        assert caps == whole["power_caps_w"]
        for p in pages:  # everything but the replicas and caps is the whole plan's
            assert {k: v for k, v in p["plan"].items() if k not in ("replicas", "power_caps_w")} == \
                   {k: v for k, v in whole.items() if k not in ("replicas", "power_caps_w")}


def test_counts_and_the_page_envelope() -> None:
    doc = layout()
    p = views.plan_page(doc, 2, 1)
    assert (p["limit"], p["offset"]) == (2, 1)
    assert [r["id"] for r in p["plan"]["replicas"]] == [1, 2]
    # TP 3, 4, 3, 4, 4: two replicas at TP3, three at TP4
    assert p["counts"] == {"replicas": 5, "groups": 5, "gpus": 18, "tp_counts": {"3": 2, "4": 3}, "dropped": 0,
                           "idle": 0, "spares_used": 0, "power_caps": 6, "reasons": len(doc.reasons)}
    for off in (5, 7, 10_000_000):  # at or past the end: no replica, no cap, the totals still there
        past = views.plan_page(doc, 100, off)
        assert past["plan"]["replicas"] == [] and past["plan"]["power_caps_w"] == {}
        assert past["counts"]["replicas"] == 5
        assert views.replica_summaries(doc, off, off + 100) == []


def test_lists_that_grow_with_the_cluster_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = layout()
    monkeypatch.setattr(views, "LIST_MAX", 1)
    p = views.plan_page(doc, 5, 0)
    assert p["plan"]["reasons"] == [doc.reasons[0]] and p["counts"]["reasons"] == len(doc.reasons) > 1


def test_summaries_list_the_first_replicas() -> None:
    doc = layout()
    s = views.summary(doc, 2)
    assert [r["id"] for r in s["replicas"]] == [0, 1] and s["counts"]["replicas"] == 5
    # planned without a previous layout: every group is newly placed
    assert s["replicas"][0] == {"id": 0, "tp": 3, "local_batch": doc.local_batches[0], "stage_tp": [3], "moved": [
        {"group": "d0/g0", "stage": 0, "from_replica": None, "from_stage": None}]}
    assert views.summary(doc, 0)["replicas"] == []
    assert [r["id"] for r in views.replica_summaries(doc, 3, 10)] == [3, 4]


def test_a_list_may_not_ask_for_too_many_replicas() -> None:
    views.check_summary_page(1000, 20)  # 20,000: the most
    with pytest.raises(InvalidArgument, match=r"^replicas_limit: "):
        views.check_summary_page(1000, 21)


def test_acks_are_counted_per_version_with_the_newest_time() -> None:
    from ntp_manager.service.operations.queries import ACKS_LISTED, acks_view

    per = [(f"w{i}", {"ok": i % 3 != 0, "at": f"2026-11-23T10:00:{i:02d}+00:00"}) for i in range(40)]
    got = acks_view([(7, per), (8, [])])
    failed = [w for w, a in per if not a["ok"]]
    assert got["7"] == {"workers": 40, "ok": 40 - len(failed), "failed": len(failed),
                        "failed_workers": failed[:ACKS_LISTED], "last_at": "2026-11-23T10:00:39+00:00"}
    assert got["8"] == {"workers": 0, "ok": 0, "failed": 0, "failed_workers": [], "last_at": None}
