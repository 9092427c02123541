"""service/core/steps.py: the bounded step window, its exact per-replica / per-stage sums, and how a
report's ranks are placed."""

from __future__ import annotations

import gc
import tracemalloc
from types import SimpleNamespace

import pytest

from ntp_manager.contract.proto.ntp.v1 import common_pb2, worker_pb2
from ntp_manager.service.core.errors import InvalidArgument
from ntp_manager.service.core.steps import Place, StepSample, StepWindow, check_report, places_of, samples_of


def sample(i: int, *, version: int = 1, replica: int | None = 0, stage: int | None = 0, t: float = 1.0) -> StepSample:
    return StepSample(float(i), version, i, f"w{i % 7}", 0, f"GPU-{i % 13}", replica, stage, "d0/g0", 4, t, t / 2,
                      t / 4, 100, 5000)


def test_sums_stay_exact_as_samples_leave_the_window() -> None:
    w = StepWindow()
    w.add(sample(i, replica=i % 2, stage=i % 3, t=float(i)) for i in range(10))
    cost = w.samples[0].cost
    w.bytes_cap = 6 * cost + 8  # room for six (sample 10 names "GPU-10": a byte more than the others)
    w.add([sample(10, replica=0, stage=1, t=10.0)])
    assert [s.step for s in w.samples] == [5, 6, 7, 8, 9, 10] and w.dropped == 5
    # replica 0 holds steps 6, 8, 10 now: mean (6 + 8 + 10) / 3 = 8; replica 1 holds 5, 7, 9: mean 7
    reps = w.per_replica(1)
    assert reps[0]["samples"] == 3 and reps[0]["mean_step_s"] == pytest.approx(8.0)
    assert reps[1]["mean_step_s"] == pytest.approx(7.0) and reps[1]["last_step_s"] == 9.0
    # stages: 5 % 3 = 2, 6 -> 0, 7 -> 1, 8 -> 2, 9 -> 0, 10 -> stage 1 (as reported)
    stages = w.per_stage(1)
    assert {k: v["samples"] for k, v in stages.items()} == {0: 2, 1: 2, 2: 2}
    assert stages[0]["mean_comm_wait_s"] == pytest.approx((6 + 9) / 4 / 2)
    assert w.used == sum(s.cost for s in w.samples) <= w.bytes_cap


def test_versions_are_kept_apart_and_unplaced_samples_count_in_no_replica() -> None:
    w = StepWindow()
    w.add([sample(0, version=1, replica=0), sample(1, version=2, replica=0, t=3.0), sample(2, replica=None,
                                                                                             stage=None)])
    assert w.per_replica(2) == {0: {"samples": 1, "mean_step_s": 3.0, "mean_compute_s": 1.5,
                                    "mean_comm_wait_s": 0.75, "last_step_s": 3.0}}
    assert w.per_replica(1)[0]["samples"] == 1
    summary = w.summary(2, recent=2)
    assert [s["step"] for s in summary["recent"]] == [2, 1] and summary["window"]["samples"] == 3


def test_memory_stays_under_the_cap() -> None:
    """The window's own estimate bounds what it really holds (measured by tracemalloc)."""
    cap = 2**20
    w = StepWindow(bytes_cap=cap)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for i in range(12_000):  # ~2x what fits
        w.add([StepSample(float(i), 1, i, f"worker-{i}", i % 8, f"GPU-{i:08d}-{'x' * 40}", i % 50, i % 4,
                          f"nvl-{i % 50}/g0", 8, 0.5 + i * 1e-6, 0.4, 0.05, 8192, 8192 * 512)])
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    assert w.dropped > 0 and w.used <= cap
    assert held <= cap * 1.05, f"the window holds {held} bytes, past its cap of {cap}"


def report(ranks: list[worker_pb2.RankStep], version: int = 3) -> worker_pb2.StepReport:
    return worker_pb2.StepReport(job="j", worker_id="w", step=7, ranks=ranks,
                                 stamp=common_pb2.LayoutStamp(leader_epoch=1, version=version))


def test_the_layout_places_ranks_and_a_report_that_disagrees_is_refused() -> None:
    # the fields of a LayoutDoc that places_of reads: one replica of two stages
    g0 = SimpleNamespace(group="d0/g0", stage=0, tp=2, gpus=("a", "b"))
    g1 = SimpleNamespace(group="d1/g0", stage=1, tp=2, gpus=("c", "d"))
    places = places_of(SimpleNamespace(replicas=[SimpleNamespace(id=5, groups=(g0, g1))]))  # type: ignore[arg-type]
    assert places["c"] == Place(5, 1, "d1/g0", 2)
    got = samples_of(report([worker_pb2.RankStep(gpu_uuid="c", step_time_s=0.5)]), 10.0, places)
    assert (got[0].replica, got[0].stage, got[0].group, got[0].tp, got[0].version) == (5, 1, "d1/g0", 2, 3)
    with pytest.raises(InvalidArgument, match=r"ranks\[0\]\.stage: GPU c has stage 1"):
        samples_of(report([worker_pb2.RankStep(gpu_uuid="c", stage=0)]), 10.0, places)
    # without the current layout (an older stamp), the report's own place is used
    old = samples_of(report([worker_pb2.RankStep(gpu_uuid="c", stage=0, replica_id=2)], version=2), 1.0, None)
    assert (old[0].replica, old[0].stage) == (2, 0)


@pytest.mark.parametrize("rank, field", [
    (worker_pb2.RankStep(compute_s=float("nan")), "compute_s"),
    (worker_pb2.RankStep(comm_wait_s=-1.0), "comm_wait_s"),
    (worker_pb2.RankStep(step_time_s=float("inf")), "step_time_s"),
    (worker_pb2.RankStep(tokens=10, sequence_sq_sum=101), "sequence_sq_sum"),
    (worker_pb2.RankStep(tp=5000), "tp"),
    (worker_pb2.RankStep(stage=10_000), "stage"),
    (worker_pb2.RankStep(tp_group_id="a b"), "tp_group_id"),
])
def test_bad_fields_are_named(rank: worker_pb2.RankStep, field: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"ranks\[0\]\.{field}"):
        check_report(report([rank]))
