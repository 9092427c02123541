"""The Slurm drain decisions (service/operations/slurm_policy.py), as functions with made-up times; and the
command runner's timeout and retries (service/operations/slurm.py) on stand-in executables. The real Slurm
is in tests/integration/test_slurm.py."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.state import HealthSource
from ntp_manager.service.manager import Manager
from ntp_manager.service.operations.slurm import SlurmCommands, SlurmError
from ntp_manager.service.operations.slurm_policy import (
    MARKER,
    REASON_MAX,
    ActionKind,
    Cause,
    CauseKind,
    GpuFacts,
    SlurmNode,
    SlurmOptions,
    causes_key,
    decide,
    drain_reason,
    node_causes,
    owned,
    parse_sinfo,
)
from ntp_manager.settings import Settings

NOW = 10_000.0


def gpu(idx: int, health: GpuState = GpuState.HEALTHY, source: HealthSource = HealthSource.AGENT, reason: str = "",
        since: float | None = NOW - 10, admin: GpuState | None = None, admin_reason: str | None = None) -> GpuFacts:
    return GpuFacts(f"GPU-{idx}", idx, health, source, reason, since, admin, admin_reason)


def test_what_needs_a_person() -> None:
    gpus = [
        gpu(0),
        gpu(1, GpuState.FAILED, reason="XID 48: needs a GPU reset or replacement"),
        gpu(2, GpuState.FAILED, HealthSource.HEARTBEAT, "no heartbeat from n1 for 30.0s"),  # silence: not a cause
        gpu(3, admin=GpuState.MAINTENANCE, admin_reason="window 4: PSU swap"),
        gpu(4, GpuState.DEGRADED, HealthSource.DETECTOR, "running at 60% speed", since=NOW - 3600),  # exactly due
        gpu(5, GpuState.DEGRADED, HealthSource.DETECTOR, "running at 60% speed", since=NOW - 3599),  # 1 s short
        gpu(6, admin=GpuState.CORDONED, admin_reason="operator"),  # an operator's cordon: the operator decides
    ]
    causes = node_causes(NOW, gpus, degraded_after_s=3600)
    assert [(c.idx, c.kind) for c in causes] == [(1, CauseKind.FAILED), (3, CauseKind.MAINTENANCE),
                                                  (4, CauseKind.DEGRADED)]
    assert causes[0].detail == "XID 48: needs a GPU reset or replacement"
    assert node_causes(NOW, gpus, degraded_after_s=0)[-1].kind is CauseKind.MAINTENANCE  # 0: degraded never drains
    assert node_causes(NOW, [gpu(0), gpu(1, GpuState.SUSPECT)], 3600) == ()


def test_the_reason_names_the_gpu_and_links_the_audit_record_within_bounds() -> None:
    c = Cause("GPU-aaaa", 3, CauseKind.FAILED, "XID 48: needs a GPU reset or replacement")
    r = drain_reason([c], "http://mgr:8080/v1/audit/17")
    assert r == ("ntp-manager: GPU 3 GPU-aaaa failed: XID 48: needs a GPU reset or replacement; "
                 "audit http://mgr:8080/v1/audit/17")
    assert owned(r) and not owned("PSU swap (ticket 4)") and not owned(f" {MARKER}")
    long = Cause("GPU-b", 1, CauseKind.MAINTENANCE, "x|y\n" * 200)
    r = drain_reason([long, c], "/v1/audit/9")
    assert len(r) <= REASON_MAX and r.startswith(MARKER) and r.endswith(" (+1 more GPUs); audit /v1/audit/9")
    assert "|" not in r and "\n" not in r
    with pytest.raises(ValueError):
        drain_reason([], "/v1/audit/1")


def test_sinfo_lines_are_parsed_and_junk_is_refused() -> None:
    text = "sn1|drained|ntp-manager: GPU 1 x failed: XID 48; audit /v1/audit/3\nsn2|draining|PSU | ticket 7\n" \
           "sn1|drained|again (a second partition)\nsn3|drained|none\n"
    nodes = parse_sinfo(text)
    assert nodes["sn1"].reason.startswith(MARKER) and nodes["sn2"].reason == "PSU | ticket 7"
    assert nodes["sn3"].reason == ""
    with pytest.raises(ValueError, match=r"not NAME\|STATE\|REASON"):
        parse_sinfo("slurm_load_partitions: Unable to contact slurm controller\n")


OPTS = SlurmOptions(max_drains=2, window_s=60)
XID = (Cause("GPU-1", 1, CauseKind.FAILED, "XID 48"),)


def ours(node: str) -> SlurmNode:
    return SlurmNode(node, "drained", f"{MARKER} GPU 1 GPU-1 failed: XID 48; audit /v1/audit/1")


def test_drains_what_is_wanted_resumes_only_its_own_and_leaves_operators_alone() -> None:
    wanted = {"a": XID, "b": XID}
    drained = {
        "b": SlurmNode("b", "drained", "bad DIMM (ticket 12)"),  # an operator's: never drained over
        "c": ours("c"),  # ours, nothing wrong any more: resumed
        "d": SlurmNode("d", "drained", "bad DIMM"),  # an operator's, nothing wrong for us: never resumed
        "e": ours("e"),  # ours, but the manager does not know e now: left drained
    }
    d = decide(NOW, wanted, drained, {"a", "b", "c", "d"}, [], {}, {}, False, OPTS)
    assert [(a.kind, a.node) for a in d.actions] == [(ActionKind.DRAIN, "a"), (ActionKind.RESUME, "c")]
    assert d.actions[0].causes == XID
    held = dict(d.held)
    assert "someone else" in held["b"] and "does not know" in held["e"] and "d" not in held


def test_the_rate_cap_and_the_breaker() -> None:
    wanted = {n: XID for n in "edcba"}
    # 2 drains per 60 s: one made 59 s ago still counts, one 61 s ago does not -> 1 drain now, in name order
    d = decide(NOW, wanted, {}, set(wanted), [NOW - 61, NOW - 59], {}, {}, False, OPTS)
    assert [a.node for a in d.actions] == ["a"]
    assert [n for n, why in d.held if why.startswith("rate cap")] == ["b", "c", "d", "e"]
    d = decide(NOW, wanted, {"z": ours("z")}, {"z", *wanted}, [], {}, {}, True, OPTS)
    assert d.actions == () and {n for n, _ in d.held} == {*wanted, "z"}
    assert all("breaker is open" in why for _, why in d.held)


def test_a_node_resumed_by_someone_or_unknown_to_slurm_waits_for_new_causes() -> None:
    key = causes_key(XID)
    d = decide(NOW, {"a": XID, "b": XID}, {}, {"a", "b"}, [], {"a": key}, {"b": key}, False, OPTS)
    assert d.actions == ()
    assert "someone resumed it" in dict(d.held)["a"] and "does not know" in dict(d.held)["b"]
    more = (*XID, Cause("GPU-2", 2, CauseKind.FAILED, "XID 79"))  # another GPU fails: new causes
    d = decide(NOW, {"a": more, "b": more}, {}, {"a", "b"}, [], {"a": key}, {"b": key}, False, OPTS)
    assert [a.node for a in d.actions] == ["a", "b"]


# ---- the command runner ----------------------------------------------------------------------------
def _script(d: Path, name: str, body: str) -> None:
    p = d / name
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


def test_commands_time_out_retry_with_backoff_and_refuse_unknown_nodes(tmp_path: Path) -> None:
    # stand-ins for Slurm's commands: scontrol hangs on its first call, then answers; sinfo fails
    # twice, then prints; an unknown node is refused as scontrol refuses it
    calls = tmp_path / "calls"
    _script(tmp_path, "scontrol", f"""echo "$@" >> {calls}
case "$2" in NodeName=nosuch) echo "slurm_update error: Invalid node name specified" >&2; exit 1;; esac
[ -e {tmp_path}/hung ] || {{ touch {tmp_path}/hung; exec sleep 30; }}
exit 0
""")
    _script(tmp_path, "sinfo", f"""n=$(cat {tmp_path}/n 2>/dev/null || echo 0); echo $((n+1)) > {tmp_path}/n
[ $n -ge 2 ] || {{ echo "Unable to contact slurm controller (connect failure)" >&2; exit 1; }}
echo "sn1|drained|{MARKER} x"
""")
    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    async def go() -> None:
        c = SlurmCommands(tmp_path, tmp_path / "slurm.conf", timeout_s=0.5, retries=3, backoff_s=1.0, sleep=sleep)
        t0 = time.monotonic()
        await c.drain("sn1", "ntp-manager: test")  # the first attempt hangs, is killed, the second answers
        assert time.monotonic() - t0 < 20  # bounded: not the 30 s the stand-in would hang
        assert calls.read_text().count("State=DRAIN") == 2 and len(slept) == 1
        nodes = await c.drained()  # two failures, then an answer
        assert list(nodes) == ["sn1"] and len(slept) == 3 and slept[1] >= 1.0 and slept[2] >= 2.0  # backoff grows
        with pytest.raises(SlurmError) as e:
            await c.drain("nosuch", "x")
        assert e.value.permanent and "Invalid node name specified" in str(e.value)
        assert len(slept) == 3  # refused at once: not retried
        missing = SlurmCommands(tmp_path / "nowhere", None, 1.0, retries=1, backoff_s=0.1, sleep=sleep)
        with pytest.raises(SlurmError, match="cannot run"):
            await missing.drained()

    asyncio.run(go())
    assert os.environ.get("SLURM_CONF") != str(tmp_path / "slurm.conf")  # set for the commands only


def test_set_up_refuses_a_drain_it_could_not_carry_out(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="scontrol and sinfo cannot be found in slurm_bin_dir"):
        Manager(Settings(data_dir=tmp_path, slurm_drain=True, slurm_bin_dir=tmp_path))
    with pytest.raises(ValidationError, match="slurm_dry_run needs slurm_drain"):
        Settings(data_dir=tmp_path, slurm_dry_run=True)
    assert not Manager(Settings(data_dir=tmp_path)).slurm.enabled  # off by default: nothing is looked for
