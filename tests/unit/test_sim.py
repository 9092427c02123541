"""Simulator against closed forms, the paper's numbers, reproducibility and bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from ntp_manager.cli.manager import app as cli_app
from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import PAPER_POWER_CURVE, JobSpec, PreviousLayout, Scheme, make_plan
from ntp_manager.sim import FailureModel, SimError, SimSetup, make_trace, preset, preset_cluster, replay, static_sweep
from ntp_manager.sim.engine import Event, Trace, job_pool_size, min_spares_never_pause, placement
from ntp_manager.sim.stall import STALL_PRESETS, reshard_s
from ntp_manager.topology import PowerLimits, generate_cluster


def flat_setup(domains=64, size=8, pp=1, model=FailureModel(), max_spares=0):
    job = JobSpec(name="t", tp=size, groups_per_replica=pp, replicas=domains // pp, local_batch=8,
                  min_tp=size // 2, heads=32, mlp_columns=1024)
    cluster = generate_cluster(domains + max_spares, size, 4)
    return SimSetup.create(cluster, job, model, max_spares)


def test_zero_failures_give_zero_loss():
    setup = flat_setup()
    pts = static_sweep(setup, list(Scheme), [0.0], placements=3, seed=1)
    assert all(pt.losses == (0.0, 0.0, 0.0) for pt in pts)
    trace = make_trace(dataclasses.replace(setup, model=FailureModel(rate_per_gpu_hour=0.0)), 10, seed=1)
    assert trace.events == ()
    assert all(s.mean_throughput == 1.0 for s in replay(setup, trace, [(s, 0) for s in Scheme]))


def test_dp_drop_loss_equals_share_of_hit_groups():
    # One TP8 group per domain and per replica: a placement's DP-DROP loss is exactly the share of
    # domains holding a failed GPU.
    setup = flat_setup(domains=64, size=8)
    fractions = [0.01, 0.03]
    pts = static_sweep(setup, [Scheme.DP_DROP], fractions, placements=20, seed=7)
    pool = job_pool_size(setup, 0)
    assert pool == 512
    for pt in pts:
        for p, loss in enumerate(pt.losses):
            hit = {g // 8 for g in placement(7, p, pool, pt.failed_gpus)}
            assert loss == pytest.approx(len(hit) / 64)


def test_dp_drop_mean_matches_the_hypergeometric_closed_form():
    # k failed of N GPUs, uniformly: P(domain of T untouched) = C(N-T, k) / C(N, k).
    setup = flat_setup(domains=128, size=8)
    pts = static_sweep(setup, [Scheme.DP_DROP], [0.02], placements=200, seed=3)
    n, t, k = 1024, 8, pts[0].failed_gpus
    expected = 1 - math.comb(n - t, k) / math.comb(n, k)
    assert pts[0].mean_loss == pytest.approx(expected, abs=0.01)


def test_seed_reproduces_a_run_exactly_and_another_seed_differs():
    setup = flat_setup(model=FailureModel(rate_multiplier=200.0))
    a, b, c = make_trace(setup, 5, 11), make_trace(setup, 5, 11), make_trace(setup, 5, 12)
    assert a == b and a != c
    cfg = [(Scheme.NTP, 0), (Scheme.DP_DROP, 0)]
    assert replay(setup, a, cfg) == replay(setup, b, cfg)
    assert static_sweep(setup, list(Scheme), [0.01], 5, seed=2) == static_sweep(setup, list(Scheme), [0.01], 5, seed=2)


def test_trace_failed_fraction_follows_littles_law():
    # rate x mean repair: 2e-3/h x (0.5 x 20 h + 0.5 x 4 h) = 2.4% of GPUs failed on average.
    model = FailureModel(rate_per_gpu_hour=2e-3, hardware_share=0.5, hardware_repair_h=20, software_repair_h=4)
    setup = flat_setup(domains=128, model=model)
    trace = make_trace(setup, 60, seed=5, warmup_days=2)
    mean = sum((b - a) * f for a, b, f in trace.failed_fraction_profile()) / trace.hours
    assert mean == pytest.approx(model.steady_state_failed_fraction(), rel=0.1)


def test_blast_radius_node_takes_the_whole_node():
    model = FailureModel(rate_multiplier=100.0, blast_node=1.0)
    trace = make_trace(flat_setup(model=model), 2, seed=1)
    fails = [e for e in trace.events if e.failed]
    assert fails and all(len(e.failed) <= 4 for e in fails)
    assert any(len(e.failed) == 4 for e in fails)
    for e in fails:
        assert len({g // 4 for g in e.failed}) == 1  # one node


def test_fixed_minibatch_pauses_and_spares_fix_it():
    # 8 domains, TP8, 1 group/replica, 8 replicas. At t=1 h one GPU of domain 0 fails for 2 h.
    setup = flat_setup(domains=8, size=8, max_spares=2)
    trace = Trace(hours=4.0, n_gpus=setup.n_gpus, events=(Event(1.0, (3,), ()), Event(3.0, (), (3,))), failures=1)
    (dp0, dp1) = replay(setup, trace, [(Scheme.DP_DROP, 0), (Scheme.DP_DROP, 1)], fixed_minibatch=True)
    # paused 2 of 4 hours without spares; never with one spare domain
    assert dp0.paused_share == pytest.approx(0.5) and dp0.mean_throughput == pytest.approx(0.5)
    assert dp1.paused_share == 0.0 and dp1.mean_throughput == 1.0
    # per-GPU throughput counts the spare: 8 / 9 GPUs do the work
    assert dp1.per_gpu_throughput == pytest.approx(8 / 9)
    assert min_spares_never_pause(setup, trace, Scheme.DP_DROP) == 1
    # NTP at TP7: local batch floor(8 / work(7)) < 8, so it also needs the spare; variable batch
    # mode loses exactly that share of a replica for 2 of 4 hours
    (ntp,) = replay(setup, trace, [(Scheme.NTP, 0)])
    b7 = setup.job.reduced_batch(7)
    assert ntp.mean_throughput == pytest.approx(1 - 0.5 * (8 - b7) / 64)


# ---- the paper's numbers (docs/references.md, "The NTP paper") ----------------------------------


@pytest.fixture(scope="module")
def paper_setup():
    p = preset("paper-32k")
    return SimSetup.create(preset_cluster(p), p.job, p.model)


def test_paper_sweep_ordering_and_magnitudes(paper_setup):
    pts = static_sweep(paper_setup, list(Scheme), [0.001, 0.002, 0.004], placements=8, seed=0)
    by = {(pt.fraction, pt.scheme): pt.mean_loss for pt in pts}
    for f in (0.001, 0.002, 0.004):
        assert by[(f, Scheme.DP_DROP)] > by[(f, Scheme.NTP)] > by[(f, Scheme.NTP_PW)] - 1e-12
    assert by[(0.004, Scheme.DP_DROP)] == pytest.approx(0.12, abs=0.015)
    assert by[(0.004, Scheme.NTP)] <= 0.03


def test_ntp_pw_result_rests_on_the_rack_budget(paper_setup):
    # The preset's power model: the paper's measured curve (flat beyond 1.2x -> 1.122x), rack budget
    # 1.15 x nominal. A TP31 group needs speed work(31) = 1.1195, i.e. power 1.1 + 0.1 x
    # (1.1195 - 1.069) / 0.053 = 1.195x; its rack gives the 31 survivors 1.15 x 32 / 31 = 1.187x:
    # short, so a reduced replica keeps 7 of 8 sequences, as under ntp (ntp-pw may keep one more
    # where a TP29 group is boosted part of the way; ntp runs it at 6). With 1.16 (1.197x) TP31
    # keeps full speed; TP30 (needs 1.140 > 1.122) never can, hence the residual loss.
    assert paper_setup.job.power.curve == PAPER_POWER_CURVE and paper_setup.job.power.rack_headroom == 1.15
    args = ([0.004], 4, 0)
    ntp, pw = static_sweep(paper_setup, [Scheme.NTP, Scheme.NTP_PW], *args)
    assert all(a <= b for a, b in zip(pw.losses, ntp.losses, strict=True))
    assert pw.mean_loss == pytest.approx(ntp.mean_loss, abs=2 / 1024)
    roomy = dataclasses.replace(paper_setup, job=dataclasses.replace(
        paper_setup.job, power=dataclasses.replace(paper_setup.job.power, rack_headroom=1.16)))
    (pw_roomy,) = static_sweep(roomy, [Scheme.NTP_PW], *args)
    assert 0 < pw_roomy.mean_loss < 0.2 * ntp.mean_loss


def test_uniform_tp64_availability_at_0_1_percent():
    p = preset("uniform-tp64")
    setup = SimSetup.create(preset_cluster(p), p.job, p.model)
    (pt,) = static_sweep(setup, [Scheme.DP_DROP], [0.001], placements=20, seed=0)
    assert 1 - pt.mean_loss == pytest.approx(0.94, abs=0.01)


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model",
    [FailureModel(rate_per_gpu_hour=-1), FailureModel(rate_multiplier=-2), FailureModel(hardware_share=1.5),
     FailureModel(hardware_repair_h=0), FailureModel(blast_node=0.7, blast_domain=0.7)],
)
def test_bad_models_are_rejected(model):
    with pytest.raises(SimError):
        model.validate()


cli_runner = CliRunner()


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "ntp_manager.cli", "simulate", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--preset", "nope"), "unknown preset 'nope'"),
        (("--preset", "small", "--failed-fraction", "0.5,1.0"), "failed fraction must be in [0, 1)"),
        (("--preset", "small", "--failed-fraction", "abc"), "use 'a,b,c' or 'start:stop:count'"),
        (("--preset", "small", "--rate-multiplier", "-1", "--days", "1"), "rate multiplier must be >= 0"),
        (("--preset", "small", "--failure-rate", "-0.1", "--days", "1"), "failure rate must be a non-negative"),
        (("--preset", "small", "--days", "0"), "--days must be positive"),
        (("--preset", "small", "--scheme", "magic"), "unknown scheme 'magic'"),
        (("--preset", "small", "--spares", "x"), "comma-separated list of integers"),
        (("--preset", "small", "--gpu-power", "700,200"), "use 'DEFAULT,MIN,MAX'"),
        (("--preset", "small", "--gpu-power", "700,800,900"), "0 < MIN <= DEFAULT <= MAX"),
        (("--preset", "small", "--base-cap", "1.5"), "base power cap"),
        (("--cluster", "c.yaml", "--base-cap", "0.9"), "apply to presets"),
    ],
)
def test_cli_bad_input(args, message):
    r = cli_runner.invoke(cli_app, ["simulate", *args])
    assert r.exit_code == 2, r.output
    assert message in r.output.replace("\n", " ") and "Traceback" not in r.output


# Every option that would do nothing in a mode is refused, never ignored.
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--fixed-minibatch",), "--fixed-minibatch applies to trace mode"),
        (("--find-spares",), "--find-spares applies to trace mode"),
        (("--seeds", "3"), "--seeds applies to trace mode"),
        (("--warmup-days", "1"), "--warmup-days applies to trace mode"),
        (("--repair-days", "5"), "--repair-days applies to trace mode"),
        (("--software-repair-hours", "2"), "--software-repair-hours applies to trace mode"),
        (("--rate-multiplier", "3"), "--rate-multiplier applies to trace mode"),
        (("--failure-rate", "1e-5"), "--failure-rate applies to trace mode"),
        (("--spares", "0,8"), "--spares takes one value in the static sweep"),
        (("--max-spares", "9"), "--max-spares bounds --find-spares"),
        (("--days", "1", "--max-spares", "9"), "--max-spares bounds --find-spares"),
        (("--days", "1", "--failed-fraction", "0.01"), "--failed-fraction applies to the static sweep"),
        (("--days", "1", "--placements", "5"), "--placements applies to the static sweep"),
        (("--cluster", "c.yaml", "--job", "j.yaml", "--preset", "small"), "--preset names a cluster and a job"),
        (("--cluster", "c.yaml", "--gpu-power", "700,200,700"), "apply to presets"),
        (("--power-curve", "steep"), "--power-curve 'steep'"),
        (("--power-curve", "1.0:1.0,1.1:0.9"), "power.curve needs"),
        (("--rack-headroom", "0"), "rack_headroom must be positive"),
        (("--scheme", "ntp", "--rack-headroom", "1.2"), "--rack-headroom only changes ntp-pw"),
        (("--scheme", "dp-drop", "--power-curve", "paper"), "--power-curve only changes ntp-pw"),
        (("--scheme", "ntp", "--base-cap", "0.9"), "--base-cap only changes ntp-pw"),
        (("--days", "1", "--stall", "restart", "--step-seconds", "2"), "only --stall live redoes one"),
        (("--stall", "nope", "--days", "1"), "unknown stall model 'nope'"),
        (("--step-model", "paper"), "step_model layout TP32 x PP8 is not the job's TP8"),
    ],
)
def test_cli_refuses_options_that_would_do_nothing(args, message):
    r = cli_runner.invoke(cli_app, ["simulate", "--preset", "small", *args] if "--preset" not in args
                          else ["simulate", *args])
    assert r.exit_code == 2, r.output
    assert message in r.output.replace("\n", " ")


def test_cli_blast_radius_applies_to_the_static_sweep():
    # 4 NVL8 domains of 2 nodes of 4. 8 failed GPUs as whole-domain blasts fill exactly one domain:
    # dp-drop keeps 3 of 4 groups -> one whole replica of 2 -> loss 50%. As single GPUs, 8 random
    # failures almost always hit more than one domain.
    base = ["simulate", "--preset", "small", "--scheme", "dp-drop", "--failed-fraction", "0.25",
            "--placements", "4", "--json"]
    r = cli_runner.invoke(cli_app, [*base, "--blast-domain", "1"])
    assert r.exit_code == 0, r.output
    (pt,) = json.loads(r.stdout[r.stdout.index("{"):])["points"]
    assert pt["mean_loss"] == pt["max_loss"] == 0.5


def test_cli_trace_summary_names_paused_only_with_fixed_minibatch():
    base = ["simulate", "--preset", "small", "--scheme", "ntp", "--days", "2", "--rate-multiplier", "300"]
    variable = cli_runner.invoke(cli_app, base)
    fixed = cli_runner.invoke(cli_app, [*base, "--fixed-minibatch"])
    assert variable.exit_code == fixed.exit_code == 0
    assert "paused" not in variable.output and "time below" in variable.output
    assert "paused" in fixed.output


def test_cli_static_json_and_plot(tmp_path):
    png = tmp_path / "loss.png"
    r = run_cli("--preset", "small", "--failed-fraction", "0,0.05", "--placements", "3", "--json", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["mode"] == "static" and len(doc["points"]) == 6
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_trace_json_with_spare_search(tmp_path):
    png = tmp_path / "trace.png"
    r = run_cli("--preset", "small", "--days", "20", "--rate-multiplier", "300", "--spares", "0,1",
                "--fixed-minibatch", "--find-spares", "--max-spares", "2", "--json", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    run = doc["runs"][0]
    assert {s["scheme"] for s in run["stats"]} == {"dp-drop", "ntp", "ntp-pw"}
    assert set(run["spares_needed"]) == {"dp-drop", "ntp", "ntp-pw"}
    assert png.exists()


def test_base_cap_gives_ntp_pw_its_headroom_back_on_a_default_equal_max_fleet():
    # 64 NVL8 domains of H100-like GPUs (700 W default = max). Without a base cap ntp-pw cannot boost
    # and loses what ntp loses; under a 0.85 base cap the reduced groups rise to 700 W and lose less.
    job = JobSpec(name="t", tp=8, groups_per_replica=1, replicas=64, local_batch=8, min_tp=4, heads=32,
                  mlp_columns=1024, scheme=Scheme.NTP)
    h100 = PowerLimits(700, 200, 700)
    flat = SimSetup.create(generate_cluster(64, 8, 4, power=h100), job, FailureModel())
    capped = SimSetup.create(generate_cluster(64, 8, 4, power=h100.with_base_cap(0.85)), job, FailureModel())
    args = ([0.02], 10, 4)
    ntp, pw = static_sweep(flat, [Scheme.NTP, Scheme.NTP_PW], *args)
    (pw_capped,) = static_sweep(capped, [Scheme.NTP_PW], *args)
    assert ntp.mean_loss > 0 and pw.losses == ntp.losses
    # TP7 needs speed work(7) = 0.4 x 5/4 + 0.6 x 147/128 = 1.189; ntp keeps floor(8 / 1.189) = 6 of 8
    # samples; at 700/595 = 1.176 x base the survivors run at 1.120 and keep floor(8 x 1.120 / 1.189) = 7.
    assert pw_capped.mean_loss < 0.6 * ntp.mean_loss


# ---- the abstract's figure: what a job without repacking loses; NVL72 leftovers ------------------


def test_without_repacking_one_failure_idles_the_whole_pipeline_replica():
    # 16 NVL8 domains, TP8 x 2 stages, 8 replicas; no repacking: dp-drop loses every replica with a
    # failed GPU in either stage, with repacking only the hit groups (and the odd one out).
    job = JobSpec(name="t", tp=8, groups_per_replica=2, replicas=8, local_batch=4, min_tp=6, heads=32,
                  mlp_columns=1024)
    cluster = generate_cluster(16, 8, 4)
    frozen = SimSetup.create(cluster, job, FailureModel(), packing="none")
    managed = SimSetup.create(cluster, job, FailureModel())
    (pt,) = static_sweep(frozen, [Scheme.DP_DROP], [0.02], placements=10, seed=1)
    (pt_m,) = static_sweep(managed, [Scheme.DP_DROP], [0.02], placements=10, seed=1)
    for p, (loss, loss_m) in enumerate(zip(pt.losses, pt_m.losses, strict=True)):
        failed = placement(1, p, 128, pt.failed_gpus)
        replicas_hit = {g // 16 for g in failed}  # replica r = domains 2r, 2r+1 = GPUs 16r..16r+15
        groups_hit = {g // 8 for g in failed}
        assert loss == pytest.approx(len(replicas_hit) / 8)
        assert loss_m == pytest.approx(1 - ((16 - len(groups_hit)) // 2) / 8)  # replicas of healthy groups


def test_nvl72_tp64_leftovers_hide_failures_until_a_domain_has_more_than_eight():
    p = preset("nvl72-tp64")
    assert (p.domain_size, p.job.tp) == (72, 64)
    small = dataclasses.replace(p, domains=2)
    job = dataclasses.replace(p.job, replicas=2)
    setup = SimSetup.create(preset_cluster(small), job, p.model)
    for failed, expected in ((range(8), 1.0), (range(9), 0.5)):  # 8 fit in the leftovers, the 9th not
        plan = make_plan(setup.snapshot(list(failed)), setup.variant(Scheme.DP_DROP))
        assert plan.relative_throughput == expected


# ---- the cost of reconfiguring ------------------------------------------------------------------


def one_failure_trace(setup, gpu=3, fail_at=1.0, repair_at=3.0, hours=4.0):
    return Trace(hours, setup.n_gpus, (Event(fail_at, (gpu,), ()), Event(repair_at, (), (gpu,))), 1)


def test_restart_stall_counts_each_failure_and_defers_repairs():
    # 8 domains, TP8, one group per replica. One failure at 1 h (repaired at 3 h) under the restart
    # model: 600 s of standing still at 1 h; the repair is acted on only at the next failure (none),
    # so dp-drop stays at 7/8 from 1 h to the end: effective = (1 x 1 + 7/8 x (3 - 1/6)) / 4 h.
    setup = flat_setup(domains=8, size=8)
    trace = one_failure_trace(setup)
    (dp,) = replay(setup, trace, [(Scheme.DP_DROP, 0)], stall=STALL_PRESETS["restart"])
    assert dp.changes == 1 and dp.stalled_share == pytest.approx((600 / 3600) / 4)
    assert dp.mean_throughput == pytest.approx((1 + 7 / 8 * 3) / 4)
    assert dp.effective_throughput == pytest.approx((1 + 7 / 8 * (3 - 1 / 6)) / 4)
    # ft-hsdp: 180 s for the failure, the repair free and taken at once
    (ft,) = replay(setup, trace, [(Scheme.DP_DROP, 0)], stall=STALL_PRESETS["ft-hsdp"])
    assert ft.changes == 1 and ft.mean_throughput == pytest.approx((1 + 7 / 8 * 2 + 1) / 4)
    assert ft.effective_throughput == pytest.approx((1 + 7 / 8 * (2 - 180 / 3600) + 1) / 4)


def test_stalls_chain_when_changes_come_faster_than_they_end():
    setup = flat_setup(domains=8, size=8)
    trace = Trace(1.0, setup.n_gpus, (Event(0.1, (3,), ()), Event(0.15, (20,), ())), 2)
    model = dataclasses.replace(STALL_PRESETS["ft-hsdp"], fixed_s=360.0)  # 0.1 h each
    (dp,) = replay(setup, trace, [(Scheme.DP_DROP, 0)], stall=model)
    assert dp.changes == 2 and dp.stalled_share == pytest.approx(0.2)  # 0.1 -> 0.2 -> 0.3 h


def test_live_stall_scales_with_the_state_a_change_moves():
    # NVL8 TP8, 2 stages, stage state 8 GB: a group that changes stage loads 8 GB / 8 GPUs = 1 GB
    # per GPU; one that keeps its stage and drops to TP7 fetches 8 GB x (1/7 - 1/8) = 0.143 GB.
    job = JobSpec(name="t", tp=8, groups_per_replica=2, replicas=2, local_batch=8, min_tp=4, heads=32,
                  mlp_columns=1024, stage_bytes=(8_000_000_000,))
    cluster = generate_cluster(4, 8, 4)
    before = make_plan(cluster, job)
    hit = cluster.with_states({cluster.domains[1].gpus[0].uuid: GpuState.FAILED})
    after = make_plan(hit, job, before)
    live = STALL_PRESETS["live"]
    assert after.moves is not None and after.moves.stage_changed == 0  # the TP7 group stays in place
    assert reshard_s(job, after, before, live.net_bw) == pytest.approx(8e9 * (1 / 7 - 1 / 8) / live.net_bw)
    assert live.stall_s(job, after, before, step_s=2.0) == pytest.approx(0.16 + 0.27 + 2.0 + 8e9 / 56 / 40e9)
    moved = make_plan(cluster, job, PreviousLayout({"d1/g0": (0, 1), "d0/g0": (0, 0)}, 8, 2))
    assert reshard_s(job, moved, before, live.net_bw) == pytest.approx(1e9 / live.net_bw)


def test_cli_stall_applies_to_traces_and_names_its_step():
    r = cli_runner.invoke(cli_app, ["simulate", "--preset", "small", "--stall", "restart"])
    assert r.exit_code == 2 and "--stall applies to trace mode" in r.output
    r = cli_runner.invoke(cli_app, ["simulate", "--preset", "small", "--days", "1", "--stall", "live"])
    assert r.exit_code == 2 and "--step-seconds" in r.output
    r = cli_runner.invoke(cli_app, ["simulate", "--preset", "small", "--days", "2", "--rate-multiplier", "300",
                                    "--stall", "live", "--step-seconds", "1.5", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout[r.stdout.index("{"):])
    stats = doc["runs"][0]["stats"]
    assert all(s["stall"] == "live" and s["effective_throughput"] <= s["mean_throughput"] for s in stats)
