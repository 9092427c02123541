"""The step-time model: arithmetic, the paper's utilisation comparison, and its use by the planner."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec, PlanError, Scheme, make_plan
from ntp_manager.planner.steptime import Hardware, Layout, ModelShape, StepModel, best_layout
from ntp_manager.sim.engine import plan_throughput
from ntp_manager.topology import generate_cluster

PAPER = ModelShape()  # 100 layers, hidden 20,480, 128 heads, FFN 81,920, 16K tokens


def test_model_arithmetic():
    # 100 x (4 h^2 + 2 h f) = 100 x (1.678e9 + 3.355e9) = 503.3e9 parameters (the paper says 480B)
    assert PAPER.params == 100 * (4 * 20_480**2 + 2 * 20_480 * 81_920)
    att, mlp = PAPER.fwd_flops()
    # step FLOPs of one sequence: 3 passes x 100 layers x (attention + MLP)
    assert PAPER.step_flops(1) == pytest.approx(300 * (att + mlp))
    # causal attention scores: 2 s^2 h per layer and sequence
    assert att - 2 * 16_384 * 4 * 20_480**2 == pytest.approx(2 * 16_384**2 * 20_480)


def test_pipeline_time_is_the_interleaved_1f1b_formula():
    # m >= p: (v m + p - 1) chunk times; m < p: (v p + m - 1) (latency-bound); chunk = stage / v
    sm = StepModel(PAPER, Hardware(), Layout(tp=32, pp=4, dp=256, domain=32, interleave=5))
    c, x, _ = sm.chunk_times(32)
    stage = 25 * (c + x)  # 100 layers / 4 stages
    send = 2 * 2 * 16_384 * 20_480 / 32 / (50e9 * 0.8) * 3  # 2 (p - 1) sends across domains
    assert sm.pipeline_time(32, 8) == pytest.approx((5 * 8 + 3) * stage / 5 + send)
    assert sm.pipeline_time(32, 2) == pytest.approx((5 * 4 + 1) * stage / 5 + send)


def test_paper_utilisation_nvl32_vs_nvl8_at_32k_gpus():
    # The paper: 87% per-GPU utilisation with NVL32 vs 68% with NVL8 at 32K GPUs, 1,024 sequences of
    # 16K tokens per step. Best layout per domain size under the stated B200 model (MFU 0.5, links
    # at 80%, comm-GEMM overlap): the NVL8 layout must run TP across domains or deep pipelines.
    nvl32 = best_layout(PAPER, Hardware(), 32_768, 32, 1024)
    nvl8 = best_layout(PAPER, Hardware(), 32_768, 8, 1024)
    assert nvl32 is not None and nvl8 is not None
    assert nvl32.breakdown.utilisation == pytest.approx(0.87, abs=0.05)
    assert nvl8.breakdown.utilisation == pytest.approx(0.68, abs=0.05)
    assert nvl8.breakdown.tp_comm > 3 * nvl32.breakdown.tp_comm  # what the larger domain buys
    hw = Hardware()
    for best in (nvl32, nvl8):
        assert best.breakdown.memory_bytes <= hw.hbm_bytes * hw.hbm_usable


def paper_job(interleave: int, **kw) -> JobSpec:
    sm = StepModel(PAPER, Hardware(), Layout(tp=32, pp=8, dp=128, domain=32, interleave=interleave))
    return JobSpec(name="p", tp=32, groups_per_replica=8, replicas=4, local_batch=8, min_tp=28, heads=128,
                   mlp_columns=81_920, step_model=sm, **kw)


def test_reduced_batch_from_the_step_model():
    # Non-interleaved, m = 8 sequences over p = 8 stages: (m + 7) chunk times. A TP31 chunk is
    # r = chunk(31)/chunk(32) longer, so b sequences fit when (b + 7) r <= 15 (sends are equal).
    job = paper_job(1)
    sm = job.step_model
    c32, x32, _ = sm.chunk_times(32)
    c31, x31, _ = sm.chunk_times(31)
    r = (c31 + x31) / (c32 + x32)
    assert job.reduced_batch(31) == math.floor(15 / r - 7) == 6
    # full speed restored by compute alone at speed_needed
    need = job.speed_needed(31)
    assert job.reduced_batch(31, need) == 8 and job.reduced_batch(31, need * 0.99) < 8


def test_full_pipeline_leaves_a_slower_replica_no_batch():
    # Interleaved with m = p: one sequence still needs v p chunk times to get around the pipeline,
    # 96 x r > 96 + 7 for r > 1.073, so a TP31 replica (r = 1.09) cannot keep pace with any batch.
    job = paper_job(12)
    assert job.reduced_batch(31) == 0


def test_plan_throughput_counts_the_slowest_replica_and_the_ntp_sync():
    job = paper_job(1, scheme=Scheme.NTP)
    cluster = generate_cluster(32, 32, 4)
    assert plan_throughput(make_plan(cluster, job), job) == pytest.approx(1.0)
    hit = cluster.with_states({cluster.domains[3].gpus[0].uuid: GpuState.FAILED})
    plan = make_plan(hit, job)
    thr = plan_throughput(plan, job)
    # one replica keeps 6 of 8 sequences; the DP sync of TP31 moves 32/31 the bytes (exposed or not)
    assert thr <= plan.relative_throughput == pytest.approx((3 * 8 + 6) / 32)


def test_step_model_must_match_the_job():
    with pytest.raises(PlanError, match="not the job's TP32 x 4"):
        dataclasses.replace(paper_job(1), groups_per_replica=4).validate()
    with pytest.raises(PlanError, match="units"):
        dataclasses.replace(paper_job(1), heads=64).validate()
    with pytest.raises(PlanError, match="chunks per stage"):
        paper_job(13).validate()
