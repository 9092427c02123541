"""Agent pieces on their own: XID policy, trends, power reconcile, scenario validation, CLI errors."""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

import pytest

from ntp_agent.backends.base import GpuStatic
from ntp_agent.backends.fake import FakeBackend, ScenarioError, parse_scenario
from ntp_agent.policy import GpuEvidence, HealthPolicy, PolicyError, Thresholds, XidAction, XidPolicy
from ntp_agent.power import PowerController, base_target_mw
from ntp_manager.topology import PowerLimits

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("xid", "action"),
    [(13, XidAction.IGNORE), (31, XidAction.IGNORE), (43, XidAction.IGNORE), (45, XidAction.IGNORE),
     (68, XidAction.IGNORE), (63, XidAction.WATCH), (92, XidAction.WATCH), (94, XidAction.RESTART),
     (48, XidAction.FAIL), (79, XidAction.FAIL_NODE), (74, XidAction.FAIL), (145, XidAction.FAIL),
     (119, XidAction.FAIL), (1234, XidAction.WATCH)],
)
def test_default_xid_table(xid, action):
    assert XidPolicy.default().action(xid) is action


def test_application_xids_never_fail_and_fail_xids_stick():
    p = HealthPolicy()
    ev = GpuEvidence("g")
    for xid in (13, 31, 43, 45, 68, 94):
        p.on_xid(ev, xid, 0.0)
    assert p.verdict(ev, 0.0).state == "healthy"
    p.on_xid(ev, 48, 1.0)
    v = p.verdict(ev, 1e6)
    assert v.state == "failed" and "XID 48" in v.reasons[0]
    p.clear(ev)
    assert p.verdict(ev, 1e6).state == "healthy"


def test_trends_degrade_with_reasons():
    p = HealthPolicy(thresholds=Thresholds(watch_xids=3, window_s=100, sbe_per_hour=100, throttle_min_samples=4))
    ev = GpuEvidence("g")
    for t in (0, 10, 20):
        p.on_xid(ev, 63, t)
    v = p.verdict(ev, 30)
    assert v.state == "degraded" and "3 ECC/row-remap XIDs" in v.reasons[0]
    assert p.verdict(ev, 500).state == "healthy"  # the window slid past them
    # 1,000 corrected errors in 36 s = 100,000/h
    p.on_sample(ev, 1000, sbe_total=0)
    p.on_sample(ev, 1036, sbe_total=1000)
    assert "single-bit ECC rate" in p.verdict(ev, 1036).reasons[0]
    ev2 = GpuEvidence("h")
    for _ in range(4):
        p.on_sample(ev2, 0, throttled=True)
    assert "throttled in 100%" in p.verdict(ev2, 0).reasons[0]


def test_policy_overrides_are_validated():
    pol = XidPolicy.default().with_overrides({"94": "fail"})
    assert pol.action(94) is XidAction.FAIL
    with pytest.raises(PolicyError):
        XidPolicy.default().with_overrides({"x": "fail"})
    with pytest.raises(PolicyError):
        XidPolicy.default().with_overrides({"94": "explode"})


def test_power_clamps_reads_back_restores_and_reconciles():
    be = FakeBackend(parse_scenario({"gpus": 2, "tdp_w": 700}))
    u = be.gpus()[0].uuid
    pc = PowerController(be)
    st = pc.set(u, 5_000_000)  # above max: clamped to 1.3 x 700 W
    assert st.desired_mw == st.enforced_mw == 910_000 and st.original_mw == 700_000
    be._gpus[u].limit_mw = 700_000  # a driver reload reverted it
    assert pc.reconcile() == [u] and be.get_limit_mw(u) == 910_000 and pc.drift_events == 1
    pc.release(u)
    assert be.get_limit_mw(u) == 700_000 and u not in pc.caps


@pytest.mark.parametrize(("limits_w", "ratio"), [((700, 200, 700), 0.85), ((700, 200, 700), 0.1),
                                                ((1000, 200, 1300), 0.9), ((1000, 200, 1300), 0.7),
                                                ((700, 200, 700), 1.0), ((700, 200, 700), None)])
def test_power_reset_goes_to_the_base_the_manager_plans_with(limits_w, ratio):
    """`ntp-agent power-reset` and the manager take the base cap from the same contract arithmetic."""
    tdp, lo, hi = limits_w
    g = GpuStatic("u", 0, "m", 0, min_mw=lo * 1000, max_mw=hi * 1000, default_mw=tdp * 1000)
    manager = PowerLimits(tdp, lo, hi).with_base_cap(ratio).nominal_w
    assert abs(base_target_mw(g, ratio) - manager * 1000) < 1  # mW, truncated


def test_refused_power_set_is_reported_not_raised():
    be = FakeBackend(parse_scenario({"gpus": 1, "faults": [{"at": 0, "gpu": 0, "kind": "power_set_refused"}]}))
    st = PowerController(be).set(be.gpus()[0].uuid, 1_100_000)
    assert st.error and "no permission" in st.error and st.enforced_mw is None


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gpus": 2, "faults": [{"at": 1, "gpu": 5, "kind": "lost"}]}, "names GPU 5, but there are 2"),
        ({"faults": [{"at": 1, "gpu": 0, "kind": "xid"}]}, "needs an 'xid' number"),
        ({"faults": [{"at": -1, "gpu": 0, "kind": "lost"}]}, "faults.0.at"),
        ({"faults": [{"at": 1, "gpu": 0, "kind": "meteor"}]}, "faults.0.kind"),
        ({"gpus": 0}, "between 1 and 64"),
        ({"bogus": 1}, "bogus"),
        ([1, 2], "expected a mapping"),
    ],
)
def test_bad_scenarios(data, message):
    with pytest.raises(ScenarioError, match=message):
        be = parse_scenario(data)
        FakeBackend(be)


def test_scenario_is_deterministic():
    sc = parse_scenario({"seed": 3, "gpus": 2})
    assert [g.uuid for g in FakeBackend(sc, node="n").gpus()] == [g.uuid for g in FakeBackend(sc, node="n").gpus()]


def run_agent(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ntp_agent.main", *args], capture_output=True, text=True,
                          timeout=60)


def test_cli_bad_input_is_one_clear_line(tmp_path):
    token = tmp_path / "token"
    token.write_text("ntp_00000000_x\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: [oops\n")
    cases = [
        (("--backend", "fake", "--token-file", str(token), "--scenario", str(bad)), "malformed YAML"),
        (("--backend", "fake", "--token-file", str(token)), "needs --scenario"),
        (("--backend", "fake", "--token-file", str(tmp_path / "nope"), "--scenario", str(bad)), "cannot read"),
        (("--backend", "quantum", "--token-file", str(token)), "backend"),
    ]
    for args, message in cases:
        r = run_agent(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr


def test_systemd_unit_is_well_formed():
    cp = configparser.ConfigParser(strict=False)
    cp.read(ROOT / "agent" / "ntp-agent.service")
    assert cp["Service"]["Type"] == "notify" and cp["Service"]["Restart"] == "on-failure"
    assert "nvidia-persistenced.service" in cp["Unit"]["After"]
    assert int(cp["Service"]["WatchdogSec"]) > 0 and "ntp-agent" in cp["Service"]["ExecStart"]


def test_buffer_coalesces_only_unsent_reports_and_renumbers_after_welcome():
    from ntp_agent.core import Agent, AgentConfig
    from ntp_agent.policy import Verdict

    be = FakeBackend(parse_scenario({"gpus": 3}))
    a = Agent(be, AgentConfig(manager="x", token="t", node="n", domain="d", max_buffer=3))
    u0, u1, u2 = (g.uuid for g in be.gpus())
    # seq 1 went on the wire just before the connection dropped (the manager may have applied it)
    a._enqueue({u2: Verdict("failed", ("XID 79",))}, {u2: [79]})
    a._report_msg(a.pending[0])
    assert a.sent_upto == 1
    for i in range(5):  # 5 more changes while disconnected, buffer of 3
        a._enqueue({u0: Verdict("failed" if i % 2 == 0 else "healthy", (f"r{i}",))}, {u0: [48]} if i == 0 else {})
    a._enqueue({u1: Verdict("degraded", ("slow",))}, {})
    assert len(a.pending) <= 3
    assert a.pending[0].seq == 1 and a.pending[0].gpus[u2].state == "failed"  # the sent one is untouched
    unsent = {u: v for r in a.pending[1:] for u, v in r.gpus.items()}
    assert unsent[u0].state == "failed" and unsent[u1].state == "degraded"  # latest verdict per GPU
    assert any(48 in r.xids.get(u0, []) for r in a.pending[1:])
    seqs = [r.seq for r in a.pending]
    assert seqs == list(range(1, 1 + len(seqs)))
    # case 1: the manager had applied seq 1 -> the rest is resent from 2, nothing lost
    msgs = a.on_welcome(1)
    assert [m.report.seq for m in msgs] == list(range(2, 2 + len(msgs)))
    resent = {g.uuid: g.state for m in msgs for g in m.report.gpus}
    assert set(resent) == {u0, u1}
    a.on_ack(a.next_seq - 1)
    assert a.pending == []


def test_welcome_before_the_sent_report_was_applied_resends_it():
    from ntp_agent.core import Agent, AgentConfig
    from ntp_agent.policy import Verdict

    be = FakeBackend(parse_scenario({"gpus": 1}))
    a = Agent(be, AgentConfig(manager="x", token="t", node="n", domain="d"))
    u = be.gpus()[0].uuid
    a._enqueue({u: Verdict("failed", ("x",))}, {})
    a._report_msg(a.pending[0])
    msgs = a.on_welcome(0)  # lost in flight: resent with the same number
    assert [m.report.seq for m in msgs] == [1] and msgs[0].report.gpus[0].uuid == u


def test_example_scenarios_load_and_repair_clears_a_node_wide_failure():
    import time as _time

    from ntp_agent.backends.fake import load_scenario
    from ntp_agent.core import Agent, AgentConfig

    for path in (ROOT / "examples" / "scenarios").glob("*.yaml"):
        load_scenario(path)
    now = [0.0]
    sc = parse_scenario({"gpus": 3, "faults": [{"at": 1, "gpu": 1, "kind": "xid", "xid": 79},
                                               {"at": 2, "gpu": 1, "kind": "repair"}]})
    be = FakeBackend(sc, clock=lambda: now[0])
    a = Agent(be, AgentConfig(manager="x", token="t", node="n", domain="d"), clock=_time.monotonic)
    now[0] = 1.5
    a.handle_xids(be.wait_xids(0.01))
    a.sample_all()
    assert {v.state for v in a.verdicts.values()} == {"failed"}
    now[0] = 2.5
    a.handle_xids(be.wait_xids(0.01))
    a.sample_all()
    assert {v.state for v in a.verdicts.values()} == {"healthy"}


async def test_the_agent_moves_to_the_next_manager_after_a_refusal_with_only_its_token():
    """A manager that refuses the connection (killed): the agent goes on to the next address of its
    list. Every manager serving clients takes its stream, so the call carries its token and nothing
    about where it has been."""
    import asyncio

    from ntp_agent.core import Agent, AgentConfig
    from ntp_agent.policy import Verdict

    be = FakeBackend(parse_scenario({"gpus": 2}))
    a = Agent(be, AgentConfig(manager="127.0.0.1:1,127.0.0.1:2", token="t", node="n", domain="d",
                              backoff_initial_s=0.01, backoff_max_s=0.05))
    u0 = next(iter(be.gpus())).uuid
    a._enqueue({u0: Verdict("failed", ("XID 79",))}, {u0: [79]})
    task = asyncio.create_task(a.connect_forever())
    try:
        for _ in range(500):
            if a.failovers >= 2:
                break
            await asyncio.sleep(0.02)
    finally:
        a.stopping.set()
        await task
    assert a.failovers >= 2 and a.target in ("127.0.0.1:1", "127.0.0.1:2")
    assert dict(a.call_metadata()) == {"authorization": "Bearer t"}
