"""Layouts with pipeline stages, from the planner through the manager's export to the worker: every
GPU's rank, stage and peers agree with `contract.ranks`, and a view whose stages do not add up is
refused."""

from __future__ import annotations

import datetime as dt

import pytest

from ntp_manager.contract.proto.ntp.v1 import common_pb2 as pb
from ntp_manager.contract.ranks import global_rank
from ntp_manager.planner import PowerModel, Scheme, make_plan
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.rpc.views import build_views
from ntp_manager.service.core.state import LayoutRec
from ntp_manager.worker.sources import layout_from_doc, layout_from_pb
from tests.fakes.builders import cluster_from_counts, job


def _plan_pp2_r0s1_failed() -> LayoutDoc:
    j = job(tp=4, pp=2, replicas=2, batch=4, min_tp=2, scheme=Scheme.NTP_PW, heads=6, mlp=96,
            power=PowerModel(max_boost=1.1))
    p0 = make_plan(cluster_from_counts([4] * 4), j)
    # GPU 3 of domain d1 (replica 0, stage 1) fails: that stage runs at TP3, stage 0 stays at TP4
    return LayoutDoc.of(make_plan(cluster_from_counts([4] * 4, [(1, 3)]), j, p0))


def test_views_carry_stage_degrees_and_every_gpu_finds_its_rank() -> None:
    plan = _plan_pp2_r0s1_failed()
    rec = LayoutRec("llm", 7, 1, plan, "GPU-1-3 failed", dt.datetime.now(dt.UTC))
    views = build_views(rec)
    expect = {}  # GPU -> (replica, stage, TP index) in the plan
    for ri, r in enumerate(plan.replicas):
        for g in r.groups:
            for j, u in enumerate(g.gpus):
                expect[u] = (ri, g.stage, j)
    assert len(expect) == 15
    for u, (ri, si, j) in expect.items():
        lay = layout_from_pb(pb.Layout.FromString(views.bytes_for_gpu(u)), u)
        assert lay.stages == ((4, 3), (4, 4)) and lay.n_stages == 2 and lay.world == 15
        assert lay.rank == global_rank(lay.stages, ri, si, j)
        assert lay.where(lay.rank) == (ri, si, j)
        assert lay.tp_of(lay.rank) == (3 if (ri, si) == (0, 1) else 4)
        assert lay.version == 7 and lay.epoch == 1
    # a GPU with no place still gets the replicas
    lay = layout_from_pb(pb.Layout.FromString(views.bytes_for_gpu("GPU-1-3")), "GPU-1-3")
    assert lay.rank is None and lay.stages == ((4, 3), (4, 4))
    # the sync of stage 1 spans stage 1 of both replicas, whatever their degrees
    sl = lay.sync_layout({"heads": 6}, stage=1)
    assert [r.ranks for r in sl.replicas] == [(4, 5, 6), (11, 12, 13, 14)]
    assert sl.sync_degree == 3


def test_a_view_without_stage_degrees_cannot_place_a_later_stage() -> None:
    """A summary without stage_tps (a manager from before pipelines) is one stage: a group
    of stage 1 in it contradicts that and is refused rather than numbered wrongly."""
    msg = pb.Layout(replicas=[pb.ReplicaSummary(replica_id=0, tp=2, local_batch=2)])
    msg.own.replica_id = 0
    msg.own.groups.append(pb.TpGroup(stage=0, tp=2, gpu_uuids=["a", "b"], global_ranks=[0, 1]))
    msg.own.groups.append(pb.TpGroup(stage=1, tp=2, gpu_uuids=["c", "d"], global_ranks=[2, 3]))
    assert layout_from_pb(msg, "b").rank == 1
    with pytest.raises(ValueError, match="does not match replica 0's stage degrees"):
        layout_from_pb(msg, "c")
    # and a rank that disagrees with the numbering is refused
    msg.replicas[0].stage_tps.extend([2, 2])
    msg.own.groups[1].global_ranks[:] = [3, 2]
    with pytest.raises(ValueError, match="the stage numbering gives 2"):
        layout_from_pb(msg, "c")


def test_store_documents_with_stages() -> None:
    doc = {"version": 3, "replicas": [{"stages": [["a", "b"], ["c"]], "local_batch": 2},
                                      {"stages": [["d", "e"], ["f", "g"]], "local_batch": 3}]}
    lay = layout_from_doc(doc, "f")
    assert lay.stages == ((2, 1), (2, 2)) and lay.rank == 5 and lay.where(5) == (1, 1, 0)
    assert lay.replicas == ((1, 2), (2, 3)) and lay.global_batch == 5
    assert [[list(g) for g in rep] for rep in lay.group_ranks()] == [[[0, 1], [2]], [[3, 4], [5, 6]]]
    single = layout_from_doc({"version": 1, "replicas": [{"workers": ["a", "b"], "local_batch": 2}]}, "b")
    assert single.stages == () and single.degrees == ((2,),) and single.rank == 1
