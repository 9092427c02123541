"""Multi-job simulator: the pool's rules on hand-made traces, the ownership invariant at every
event, shared vs private on random traces, the searches against brute force, and the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from ntp_manager.cli.manager import app as cli_app
from ntp_manager.planner import JobSpec, Scheme
from ntp_manager.sim import FailureModel, SimError, SimSetup, make_trace, replay
from ntp_manager.sim.engine import Event, Trace
from ntp_manager.sim.multijob import (
    EQUAL,
    JobEntry,
    MultiSetup,
    _World,
    home_domains,
    pool_needed,
    private_effective,
    private_spares_needed,
    run,
)
from ntp_manager.sim.presets import multi_preset, multi_setup
from ntp_manager.sim.stall import STALL_PRESETS
from ntp_manager.topology import generate_cluster

SIZE = 8  # GPUs per domain; one TP8 group per domain


def entry(name: str, replicas: int = 2, spares: int = 0, priority: int = 0, preemptible: bool = False,
          min_throughput: float = 1.0, scheme: Scheme = Scheme.NTP) -> JobEntry:
    job = JobSpec(name=name, tp=SIZE, groups_per_replica=2, replicas=replicas, local_batch=8, min_tp=4, heads=32,
                  mlp_columns=4096, scheme=scheme, spares=spares)
    return JobEntry(job, priority, preemptible, min_throughput)


def make_setup(entries: list[JobEntry], pool: int, extra: int = 0, model: FailureModel = FailureModel()) -> MultiSetup:
    homes = sum(home_domains(e.job, SIZE) for e in entries)
    return MultiSetup.create(generate_cluster(homes + pool + extra, SIZE, 4), entries, model, pool)


def gpu(domain: int, index: int = 0) -> int:
    return domain * SIZE + index


def trace_of(setup: MultiSetup, hours: float, *events: Event) -> Trace:
    return Trace(hours, setup.n_gpus, tuple(events), sum(1 for e in events if e.failed))


# ---- the pool's rules, on hand-made traces -----------------------------------------------------------


@pytest.mark.parametrize(("prio_a", "prio_b", "winner"), [(1, 2, "B"), (2, 1, "A"), (1, 1, "A")])
def test_the_pool_grants_the_highest_priority_first_then_arrival_order(prio_a, prio_b, winner):
    # A holds domains 0-3, B 4-7, one free domain (8). Both are hit at once; one of them gets it.
    s = make_setup([entry("A", priority=prio_a), entry("B", priority=prio_b)], pool=1)
    tr = trace_of(s, 10.0, Event(1.0, (gpu(0), gpu(4)), ()))
    res = run(s, tr, "shared", audit=True).by_name()
    loser = "B" if winner == "A" else "A"
    assert res[winner].effective == 1.0 and res[winner].grants == 1
    assert res[loser].effective < 1.0 and res[loser].grants == 0
    # Private: nobody has a spare (the pool goes to reservations first, then by size: 1 domain, A first).
    priv = run(s, tr, "private").by_name()
    assert priv["A"].effective == 1.0 and priv["B"].effective == res[loser].effective


def test_a_reservation_is_kept_from_higher_priority_jobs():
    # B reserves the only free domain: A (higher priority, wanting full throughput) may not take it,
    # and there is nobody to preempt; B takes it when its own failure comes.
    s = make_setup([entry("A", priority=2), entry("B", spares=1, priority=1)], pool=1)
    tr = trace_of(s, 10.0, Event(1.0, (gpu(0),), ()), Event(2.0, (gpu(4),), ()))
    res = run(s, tr, "shared", audit=True).by_name()
    assert res["A"].grants == 0 and res["A"].effective < 1.0
    assert res["B"].grants == 1 and res["B"].effective == 1.0


def test_min_throughput_zero_uses_only_the_reservation():
    s = make_setup([entry("A", min_throughput=0.0), entry("B", min_throughput=0.0)], pool=2)
    tr = trace_of(s, 10.0, Event(1.0, (gpu(0),), ()))
    res = run(s, tr, "shared", audit=True).by_name()
    assert res["A"].grants == 0 and res["A"].effective < 1.0


def test_a_preemptible_job_loses_a_replica_to_a_higher_priority_job_and_gets_it_back():
    # No free domain. A (priority 2) is hit at t=1 and repaired at t=5; B (0, preemptible) gives it
    # a replica (2 domains): A keeps one, B takes the other back and runs 1 replica of 2 until A
    # returns the domain. C (priority 1, not preemptible) is never touched.
    entries = [entry("A", priority=2), entry("B", priority=0, preemptible=True), entry("C", priority=1)]
    s = make_setup(entries, pool=0)
    tr = trace_of(s, 10.0, Event(1.0, (gpu(0),), ()), Event(5.0, (), (gpu(0),)))
    res = run(s, tr, "shared", audit=True).by_name()
    assert res["A"].effective == 1.0 and res["A"].preempting == 1
    assert res["B"].preempted == 1
    assert res["B"].effective == pytest.approx((1.0 + 4 * 0.5 + 5 * 1.0) / 10)
    assert res["C"].effective == 1.0 and res["C"].preempted == 0
    # Not preemptible: A stays reduced until its repair, B is untouched.
    s2 = make_setup([dataclasses.replace(e, preemptible=False) for e in entries], pool=0)
    res2 = run(s2, tr, "shared", audit=True).by_name()
    assert res2["A"].effective < 1.0 and res2["B"].effective == 1.0 and res2["A"].preempting == 0


def test_the_lowest_priority_preemptible_job_is_the_victim():
    entries = [entry("A", priority=3), entry("B", priority=1, preemptible=True),
               entry("C", priority=0, preemptible=True), entry("D", priority=0, preemptible=True)]
    s = make_setup(entries, pool=0)
    res = run(s, trace_of(s, 10.0, Event(1.0, (gpu(0),), ())), "shared", audit=True).by_name()
    # C and D tie on priority: the latest arrival (D) goes first.
    assert (res["B"].preempted, res["C"].preempted, res["D"].preempted) == (0, 0, 1)


def test_a_broken_spare_is_replaced_from_the_pool_and_returned_when_not_needed():
    # A reserves 1 domain; its home and then the granted spare break; the spare does not count
    # against the reservation once broken, so A draws the second free domain.
    s = make_setup([entry("A", spares=1, min_throughput=0.0)], pool=2)
    tr = trace_of(s, 10.0, Event(1.0, (gpu(0),), ()), Event(2.0, (gpu(4),), ()),
                  Event(6.0, (), (gpu(0),)), Event(7.0, (), (gpu(4),)))
    seen: list[list[float]] = []
    res = run(s, tr, "shared", audit=True, observe=lambda _t, thr, _s: seen.append(thr))
    assert [t[0] for t in seen] == [1.0, 1.0, 1.0, 1.0]
    assert res.jobs[0].grants == 2 and res.jobs[0].peak_held == 2
    # Once its home is repaired A needs no spare and returns both (they are free again).
    w = _World(s, "shared", audit=True)
    for e in tr.events:
        w.step(w.apply(e.failed, e.repaired))
    assert w.held[0] == [0, 1, 2, 3] and w.free == {4, 5}


# ---- the invariant and the private policy -------------------------------------------------------------


def test_ownership_invariant_holds_at_every_event_of_a_random_trace():
    s = multi_setup(multi_preset("jobs-small"))
    tr = make_trace(s.sim, 15, seed=3, warmup_days=6)
    times = sorted({e.at_h for e in tr.events})
    for policy in ("private", "shared"):
        batches: list[float] = []
        run(s, tr, policy, audit=True, observe=lambda t, _thr, _s, b=batches: b.append(t))  # type: ignore[arg-type]
        assert batches == times  # checked after every batch of events


def test_the_invariant_check_catches_a_domain_in_two_jobs():
    s = make_setup([entry("A"), entry("B")], pool=1)
    w = _World(s, "shared", audit=True)
    w.check()
    w.held[1].append(w.held[0][0])
    with pytest.raises(AssertionError, match="held by jobs 0 and 1"):
        w.check()


def test_private_is_the_single_job_trace_mode_once_per_job():
    s = make_setup([entry("A", replicas=3, spares=1), entry("B", scheme=Scheme.DP_DROP)], pool=3,
                   model=FailureModel(rate_multiplier=100.0))
    tr = make_trace(s.sim, 10, seed=1, warmup_days=3)
    res = run(s, tr, "private")
    split = s.private_split()
    assert split == [2, 1]
    ids = s.cluster.domain_ids
    pool = list(s.pool_domains)
    for j, e in enumerate(s.jobs):
        mine = list(s.home[j]) + pool[sum(split[:j]):sum(split[:j + 1])]
        single = SimSetup.create(s.cluster, dataclasses.replace(e.job, domains=tuple(ids[d] for d in mine)),
                                 s.model, max_spares=split[j])
        (stats,) = replay(single, tr, [(e.job.scheme, split[j])])
        assert res.jobs[j].effective == pytest.approx(stats.mean_throughput, abs=1e-12)
        assert private_effective(s, tr, j, split[j]) == pytest.approx(stats.mean_throughput, abs=1e-12)


def test_runs_are_deterministic():
    s = multi_setup(multi_preset("jobs-small"))
    a = run(s, make_trace(s.sim, 10, seed=5, warmup_days=3), "shared")
    b = run(s, make_trace(s.sim, 10, seed=5, warmup_days=3), "shared")
    assert a == b


@pytest.mark.parametrize("seed", [0, 1])
def test_after_every_batch_no_job_below_target_could_gain_from_what_the_rules_still_allow(seed):
    # Brute force on the grant phase: after each batch of events, plan every job that is below its
    # target on its domains plus *every* domain the rules would still let it take (within its
    # reservation: any healthy free domain; below min_throughput: also those no other job's
    # reservation claims). The one-at-a-time grants must have left nothing that helps.
    entries = [entry("A", replicas=3, spares=1, priority=2), entry("B", spares=1, priority=1, min_throughput=0.0),
               entry("C", priority=1), entry("D", replicas=1, scheme=Scheme.DP_DROP)]
    s = make_setup(entries, pool=4, model=FailureModel(rate_multiplier=80.0))
    tr = make_trace(s.sim, 15, seed=seed, warmup_days=6)
    w = _World(s, "shared", audit=True)
    checked = 0
    i = 0
    while i < len(tr.events):
        at, failed, repaired = tr.events[i].at_h, [], []
        while i < len(tr.events) and tr.events[i].at_h == at:
            failed += tr.events[i].failed
            repaired += tr.events[i].repaired
            i += 1
        w.step(w.apply(failed, repaired))
        free = w.healthy_free()
        for j, e in enumerate(s.jobs):
            if w.thr[j] >= 1.0:
                continue
            allowed = max(0, w.base[j] + w.res[j] - w.counted(j))
            if w.thr[j] < e.min_throughput:
                others = sum(w.outstanding(k) for k in range(len(s.jobs)) if k != j)
                allowed += max(0, len(free) - others - allowed)
            extra = free[:allowed]
            if not extra:
                continue
            _, best = w.trial(j, w.held[j] + extra)
            assert best <= w.thr[j] + 1e-12, (at, e.name, extra)
            checked += 1
    assert checked > 0


# ---- stalls --------------------------------------------------------------------------------------------


def test_stalls_charge_failures_and_preemptions_and_repairs_only_when_the_model_says():
    # A is hit at t=1 and takes B's replica (B preemptible, pool empty); repaired at t=5 it returns
    # the domain, which B takes back. ft-hsdp: 180 s per forced change, repairs free: A's change at
    # t=1 and B's loss at t=1 stall; the moves after the repair do not.
    entries = [entry("A", priority=2), entry("B", priority=0, preemptible=True)]
    s = make_setup(entries, pool=0)
    tr = trace_of(s, 10.0, Event(1.0, (gpu(0),), ()), Event(5.0, (), (gpu(0),)))
    free = run(s, tr, "shared", stall=STALL_PRESETS["ft-hsdp"]).by_name()
    assert (free["A"].changes, free["B"].changes) == (1, 1)
    assert free["A"].stalled_share == pytest.approx(180 / 3600 / 10)
    assert free["A"].effective == pytest.approx(free["A"].throughput - 180 / 3600 / 10)
    assert free["B"].effective == pytest.approx(free["B"].throughput - 0.5 * 180 / 3600 / 10)  # at 1 replica of 2
    live = run(s, tr, "shared", stall=STALL_PRESETS["live"], step_s=2.0).by_name()
    assert (live["A"].changes, live["B"].changes) == (2, 2)  # live stalls for repairs too
    assert live["A"].stalled_share == pytest.approx(2 * (0.16 + 0.27 + 2.0) / 3600 / 10)
    none = run(s, tr, "shared").by_name()
    assert none["A"].effective == none["A"].throughput and none["A"].changes == 0
    with pytest.raises(SimError, match="restart takes repairs back only at the next restart"):
        run(s, tr, "shared", stall=STALL_PRESETS["restart"])


@pytest.mark.parametrize("model", ["ft-hsdp", "live"])
def test_private_stalls_are_the_single_job_trace_modes(model):
    s = make_setup([entry("A", replicas=3, spares=1), entry("B", scheme=Scheme.DP_DROP)], pool=3,
                   model=FailureModel(rate_multiplier=100.0))
    tr = make_trace(s.sim, 10, seed=1, warmup_days=3)
    res = run(s, tr, "private", stall=STALL_PRESETS[model], step_s=1.5)
    split, ids, pool = s.private_split(), s.cluster.domain_ids, list(s.pool_domains)
    for j, e in enumerate(s.jobs):
        mine = list(s.home[j]) + pool[sum(split[:j]):sum(split[:j + 1])]
        single = SimSetup.create(s.cluster, dataclasses.replace(e.job, domains=tuple(ids[d] for d in mine)),
                                 s.model, max_spares=split[j])
        (st,) = replay(single, tr, [(e.job.scheme, split[j])], stall=STALL_PRESETS[model], step_s=1.5)
        assert res.jobs[j].changes == st.changes > 0
        assert res.jobs[j].effective == pytest.approx(st.effective_throughput, abs=1e-12)
        assert res.jobs[j].stalled_share == pytest.approx(st.stalled_share, abs=1e-12)


# ---- shared vs private on the same trace --------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_fully_reserved_pool_is_never_worse_than_private_spares(seed):
    # Same spare GPUs: each job reserves exactly its private share of the pool. Where the pool had a
    # healthy domain for every reserved ask (the job is not "short"), a shared job holds its home
    # domains plus as many healthy spares as private has spares (or needs fewer), and a plan never
    # gains from a failure (NTP, DP-DROP), so at every moment it plans at least what private does.
    # It can be worse only while short: the pool grants healthy domains only, where a private job
    # keeps using its own spare at reduced TP.
    entries = [entry("A", replicas=3, spares=2), entry("B", spares=1, scheme=Scheme.DP_DROP), entry("C", spares=1)]
    s = make_setup(entries, pool=4, model=FailureModel(rate_multiplier=60.0))
    assert s.private_split() == [2, 1, 1]
    tr = make_trace(s.sim, 15, seed=seed, warmup_days=6)
    rows: dict[str, list[tuple[list[float], list[bool]]]] = {"private": [], "shared": []}
    for policy in ("private", "shared"):
        run(s, tr, policy, audit=True,  # type: ignore[arg-type]
            observe=lambda _t, thr, short, p=policy: rows[p].append((thr, short)))
    better = short = 0
    for (p_thr, _), (s_thr, s_short) in zip(rows["private"], rows["shared"], strict=True):
        for j in range(len(entries)):
            if s_short[j]:
                short += 1
                continue
            assert s_thr[j] >= p_thr[j] - 1e-12
            better += s_thr[j] > p_thr[j] + 1e-12
    assert better > 0  # the comparison is not vacuous: broken private spares cost something
    assert short < len(rows["shared"]) * len(entries)


def test_the_unreserved_pool_beats_the_same_spares_split_privately():
    # The GPU-weighted effective time is what multiplexing buys: at 32K-like failure rates over a
    # few jobs, a pool nobody reserves serves whichever job is hit.
    entries = [entry("A", replicas=4, priority=2), entry("B", replicas=4, priority=1), entry("C", replicas=4)]
    s = make_setup(entries, pool=3, model=FailureModel(rate_multiplier=40.0))
    tr = make_trace(s.sim, 15, seed=0, warmup_days=6)
    priv, shar = run(s, tr, "private"), run(s, tr, "shared", audit=True)
    assert sum(r.effective for r in shar.jobs) > sum(r.effective for r in priv.jobs)


# ---- the searches against brute force -------------------------------------------------------------------


def test_private_spares_needed_is_the_smallest_count_a_scan_finds():
    s = make_setup([entry("A", replicas=3), entry("B")], pool=2, extra=3, model=FailureModel(rate_multiplier=80.0))
    tr = make_trace(s.sim, 15, seed=2, warmup_days=6)
    for j in range(2):
        effs = [private_effective(s, tr, j, n) for n in range(6)]
        assert effs == sorted(effs)  # more private spares never lower it
        for goal in (effs[0], (effs[0] + effs[-1]) / 2, effs[-1], effs[-1] + 0.01):
            scan = next((n for n, e in enumerate(effs) if e >= goal - EQUAL), None)
            assert private_spares_needed(s, tr, j, goal, 5) == scan


def test_pool_needed_matches_a_scan_over_every_pool_size():
    entries = [entry("A", replicas=3, priority=1), entry("B", priority=0)]
    s = make_setup(entries, pool=0, extra=5, model=FailureModel(rate_multiplier=80.0))
    tr = make_trace(s.sim, 15, seed=4, warmup_days=6)
    effs = [[r.effective for r in run(s.with_pool(k), tr, "shared").jobs] for k in range(6)]
    goals = [effs[3][0], effs[3][1]]
    passing = [all(e >= g - EQUAL for e, g in zip(row, goals, strict=True)) for row in effs]
    found = pool_needed(s, tr, goals, 5)
    assert found.pool == passing.index(True)
    assert passing[found.pool:] == [True] * (6 - found.pool)  # monotone here, so bisection = scan
    assert pool_needed(s, tr, [1.1, None], 5).pool is None


# ---- bad input and the CLI ---------------------------------------------------------------------------


def test_setups_refuse_what_cannot_be_simulated():
    with pytest.raises(SimError, match="reserve 2 spare domains; the pool holds 1"):
        make_setup([entry("A", spares=1), entry("B", spares=1)], pool=1)
    with pytest.raises(SimError, match="need 9 domains; the cluster has 8"):
        MultiSetup.create(generate_cluster(8, SIZE, 4), [entry("A"), entry("B")], FailureModel(), 1)
    with pytest.raises(SimError, match="unique"):
        make_setup([entry("A"), entry("A")], pool=0)
    with pytest.raises(SimError, match="min_throughput"):
        make_setup([entry("A", min_throughput=1.5)], pool=0)
    with pytest.raises(SimError, match="unknown multi-job preset"):
        multi_preset("nope")


cli = CliRunner()


def test_cli_multi_job_table_json_and_plot(tmp_path):
    png = tmp_path / "jobs.png"
    r = cli.invoke(cli_app, ["simulate", "--jobs", "jobs-small", "--days", "5", "--find-spares", "--plot", str(png)])
    assert r.exit_code == 0, r.output
    assert "private spares vs the shared pool" in r.output and "equal effective time" in r.output
    assert png.stat().st_size > 0
    r = cli.invoke(cli_app, ["simulate", "--jobs", "jobs-small", "--days", "5", "--json", "--seed", "2"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["mode"] == "multi-job" and [j["name"] for j in out["jobs"]] == ["A", "B", "C"]
    s = multi_setup(multi_preset("jobs-small"))
    expected = run(s, make_trace(s.sim, 5, seed=2, warmup_days=6), "shared")
    assert [j["shared"]["effective"] for j in out["jobs"]] == [r.effective for r in expected.jobs]
    r = cli.invoke(cli_app, ["simulate", "--jobs", "jobs-small", "--days", "5", "--json", "--seed", "2",
                             "--stall", "live", "--step-seconds", "1.5"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    expected = run(s, make_trace(s.sim, 5, seed=2, warmup_days=6), "shared", stall=STALL_PRESETS["live"], step_s=1.5)
    assert out["stall"]["name"] == "live" and out["step_s"] == 1.5
    assert [j["shared"]["changes"] for j in out["jobs"]] == [r.changes for r in expected.jobs]
    assert sum(r.changes for r in expected.jobs) > 0


@pytest.mark.parametrize(("args", "message"), [
    (["--jobs", "nope"], "unknown multi-job preset"),
    (["--jobs", "jobs-small", "--failed-fraction", "0.1"], "--failed-fraction does not apply to multi-job"),
    (["--jobs", "jobs-small", "--spares", "2"], "--spares (use --pool) does not apply"),
    (["--jobs", "jobs-small", "--pool", "0"], "reserve 1 spare domains"),
    (["--jobs", "jobs-small", "--pool", "9"], "need 21 domains; the cluster has 16"),
    (["--jobs", "jobs-small", "--scheme", "ntp", "--scheme", "dp-drop"], "one --scheme"),
    (["--jobs", "jobs-small", "--days", "0"], "--days must be positive"),
    (["--pool", "3"], "--pool applies to multi-job mode"),
    (["--jobs", "jobs-small", "--stall", "restart"], "restart takes repairs back only at the next restart"),
    (["--jobs", "jobs-small", "--stall", "live"], "--stall live redoes a step: give --step-seconds"),
    (["--jobs", "jobs-small", "--stall", "ft-hsdp", "--step-seconds", "2"], "only --stall live redoes one"),
    (["--jobs", "jobs-small", "--stall", "ft-hsdp", "--find-spares"], "drop --stall or --find-spares"),
])
def test_cli_multi_job_bad_input(args, message):
    r = cli.invoke(cli_app, ["simulate", *args])
    assert r.exit_code == 2, r.output
    assert message in " ".join(r.output.split())
