"""The agent's state file (agent/ntp_agent/state.py) and the two commands that read the node through it for
Slurm: `ntp-agent health` (HealthCheckProgram, prolog) and `ntp-agent power-reset` (epilog)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ntp_agent.backends.fake import FakeBackend, parse_scenario
from ntp_agent.core import Agent, AgentConfig
from ntp_agent.state import StateError, judge, read_state, write_state

NOW = 1_800_000_000.0


def doc(**kw: object) -> dict[str, object]:
    d: dict[str, object] = {"format": 1, "node": "n1", "written_at": NOW - 2, "connected": True, "since": NOW - 500,
                            "gpus": [{"index": 0, "minor": 0, "uuid": "GPU-a", "state": "healthy", "reasons": []},
                                     {"index": 1, "minor": 1, "uuid": "GPU-b", "state": "degraded",
                                      "reasons": ["throttled"]}]}
    d.update(kw)
    return d


def test_judge() -> None:
    lim = {"max_age_s": 30.0, "max_disconnected_s": 120.0}
    ok = judge(doc(), NOW, **lim)
    assert ok.ok and ok.line == "ok: node n1, 2 GPUs (1 degraded, 1 healthy), connected"
    stale = judge(doc(written_at=NOW - 31), NOW, **lim)
    assert not stale.ok and stale.line.startswith("ntp-agent state is 31s old")
    # disconnected 100 s: still fine; 121 s: the manager cannot see the node
    assert judge(doc(connected=False, since=NOW - 100), NOW, **lim).ok
    off = judge(doc(connected=False, since=NOW - 121), NOW, **lim)
    assert not off.ok and "not been connected to a manager for 121s" in off.line
    failed = doc(gpus=[{"index": 3, "uuid": "GPU-x", "state": "failed", "reasons": ["XID 79: GPU fell off the bus"]}])
    bad = judge(failed, NOW, **lim)
    assert not bad.ok and bad.line == "GPU 3 (GPU-x) failed: XID 79: GPU fell off the bus"
    assert judge(failed, NOW, **lim, gpus=False).ok  # --agent-only


def test_the_file_is_read_whole_or_refused(tmp_path: Path) -> None:
    p = tmp_path / "s.json"
    write_state(p, doc())
    assert read_state(p)["node"] == "n1" and oct(p.stat().st_mode & 0o777) == "0o644"
    assert list(tmp_path.iterdir()) == [p]  # no temporary file left behind
    for content, msg in [(b"{", "not JSON"), (b'{"format": 2, "gpus": []}', "format 1"), (b"[]", "format 1")]:
        p.write_bytes(content)
        with pytest.raises(StateError, match=msg):
            read_state(p)
    with pytest.raises(StateError, match="is ntp-agent running"):
        read_state(tmp_path / "none.json")


def test_the_agent_writes_its_gpus_minors_and_verdicts(tmp_path: Path) -> None:
    backend = FakeBackend(parse_scenario({"seed": 3, "gpus": 2}), node="n7")
    agent = Agent(backend, AgentConfig(manager="127.0.0.1:1", token="t", node="n7", domain="nvl-7",
                                       state_file=tmp_path / "agent-{node}.json"))

    async def go() -> None:
        await agent.write_state_if_due()
        first = read_state(tmp_path / "agent-n7.json")
        assert [(g["index"], g["minor"], g["state"]) for g in first["gpus"]] == [(0, 0, "healthy"), (1, 1, "healthy")]
        assert first["gpus"][1]["uuid"] == backend.gpus()[1].uuid and first["connected"] is False
        await agent.write_state_if_due()  # nothing changed, within STATE_EVERY_S: not rewritten
        assert read_state(tmp_path / "agent-n7.json")["written_at"] == first["written_at"]
        backend.inject("xid", 1, xid=79)
        agent.handle_xids(backend.wait_xids(1.0))
        await agent.write_state_if_due()  # a verdict changed: rewritten at once
        g1 = read_state(tmp_path / "agent-n7.json")["gpus"][1]
        assert g1["state"] == "failed" and "XID 79" in g1["reasons"][0]

    asyncio.run(go())
    backend.close()


def _agent(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ntp_agent.main", *args], capture_output=True, text=True,
                          timeout=60)


def test_ntp_agent_health_exit_status_and_one_line(tmp_path: Path) -> None:
    path = str(tmp_path / "agent-{node}.json")
    write_state(tmp_path / "agent-n1.json", doc(written_at=time.time()))
    r = _agent("health", "--state-file", path, "--node", "n1")
    assert r.returncode == 0 and r.stdout.startswith("ok: node n1") and r.stdout.count("\n") == 1
    write_state(tmp_path / "agent-n1.json", doc(written_at=time.time() - 100))
    r = _agent("health", "--state-file", path, "--node", "n1")
    assert r.returncode == 1 and r.stdout.startswith("unhealthy: ntp-agent state is 10") and r.stdout.count("\n") == 1
    r = _agent("health", "--state-file", path, "--node", "n2")
    assert r.returncode == 1 and "no ntp-agent state file at" in r.stdout and "agent-n2.json" in r.stdout
    r = _agent("health", "--max-age", "0")
    assert r.returncode == 2 and r.stderr.startswith("error:")


def test_ntp_agent_power_reset_to_the_base_cap(tmp_path: Path) -> None:
    sc = tmp_path / "gpus.yaml"
    sc.write_text("seed: 1\ngpus: 2\n")  # fake GPUs: 1000 W default, 1300 W maximum, 200 W minimum
    r = _agent("power-reset", "--backend", "fake", "--scenario", str(sc), "--base-cap", "0.6", "--dry-run")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2
    assert all(line.endswith("would set 780 W (now 1000 W; dry run)") for line in lines)  # 0.6 x 1300 W
    r = _agent("power-reset", "--backend", "fake", "--scenario", str(sc), "--base-cap", "0.6")
    assert r.returncode == 0 and all(line.endswith("set 780 W (was 1000 W)") for line in r.stdout.splitlines())
    r = _agent("power-reset", "--backend", "fake", "--scenario", str(sc))  # no base cap: the default limit
    assert r.returncode == 0 and all(line.endswith("at 1000 W already") for line in r.stdout.splitlines())
    sc.write_text("seed: 1\ngpus: 1\nfaults: [{at: 0, gpu: 0, kind: power_set_refused}]\n")
    r = _agent("power-reset", "--backend", "fake", "--scenario", str(sc), "--base-cap", "0.6")
    assert r.returncode == 1 and "no permission to set the power limit" in r.stdout
    r = _agent("power-reset", "--backend", "fake", "--scenario", str(sc), "--base-cap", "1.5")
    assert r.returncode == 2 and r.stderr.startswith("error:")
