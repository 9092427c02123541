"""What the Slurm component remembers (service/operations/slurm.py), with a stand-in Slurm (tests/fakes/
fake_slurm.py: sinfo and scontrol run as subprocesses over a state file) and agents on gRPC:

- a node ntp-manager drained and an operator resumed while its GPU still needs a person is not
  drained over the operator's decision after a manager restart either, and the rate cap counts the
  drains made before the restart;
- once that GPU is repaired, a new failure of it (the same GPU, the same kind) drains the node again;
- a resume decided before a GPU of the node failed is not carried out.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ntp_manager.service.operations.slurm_policy import MARKER, Action, ActionKind
from tests.fakes import fake_slurm
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.integration.conftest import Service, eventually, running_service

XID48 = "XID 48: needs a GPU reset or replacement"


def _setup(tmp_path: Path, nodes: list[str], url: str = "") -> tuple[Path, str, dict[str, Any]]:
    state = tmp_path / "slurm.json"
    fake_slurm.new_state(state, nodes)
    fake_slurm.install(tmp_path / "bin", state)
    opts = {"slurm_drain": True, "slurm_bin_dir": tmp_path / "bin", "slurm_poll_s": 0.2, "slurm_retries": 0,
            "slurm_max_drains": 1, "breaker_window_s": 3600.0}
    return state, url or f"sqlite+aiosqlite:///{tmp_path / 'ntp.db'}", opts


async def _agent(svc: Service, node: str) -> ScriptedAgent:
    a = ScriptedAgent(svc.grpc, await svc.agent_token(node), node, f"nvl-{node}", gpu_uuids(node, 2))
    await a.connect()
    await a.wait_for(lambda: a.welcome is not None)
    return a


async def _passes(svc: Service, n: int) -> None:
    """Wait for `n` more passes of the Slurm component."""
    target = svc.manager.slurm.passes + n
    await eventually(lambda: svc.manager.slurm.passes >= target, timeout=20)


def _drained(state: Path, node: str) -> bool:
    return fake_slurm.drained(state).get(node, "").startswith(MARKER)


async def test_an_operator_resume_and_the_rate_cap_outlive_a_restart(tmp_path: Path, db_url: str) -> None:
    state, url, opts = _setup(tmp_path, ["sn1", "sn2"], db_url)
    async with running_service(url, tmp_path, **opts) as svc:
        a = await _agent(svc, "sn1")
        await a.report({"GPU-sn1-0": "failed"}, reasons=[XID48], xids=[48])
        await eventually(lambda: _drained(state, "sn1") and "sn1" in svc.manager.slurm.ours, timeout=20)
        fake_slurm.resume(state, "sn1")  # an operator: scontrol update NodeName=sn1 State=RESUME
        await _passes(svc, 3)
        assert "sn1" not in fake_slurm.drained(state)  # held: the operator decided
        await a.close()
    async with running_service(url, tmp_path, **opts) as svc:
        await _passes(svc, 3)
        assert "sn1" in svc.manager.slurm.wanted  # its GPU still needs a person ...
        assert "sn1" not in fake_slurm.drained(state)  # ... and the operator's resume still stands
        held = dict(svc.manager.slurm.last.held if svc.manager.slurm.last else ())
        assert "someone resumed it" in held["sn1"], held
        # one drain per window (slurm_max_drains=1), and sn1's was made before the restart
        b = await _agent(svc, "sn2")
        await b.report({"GPU-sn2-1": "failed"}, reasons=[XID48], xids=[48])
        await eventually(lambda: "sn2" in svc.manager.slurm.wanted, timeout=20)
        await _passes(svc, 3)
        assert "sn2" not in fake_slurm.drained(state)
        held = dict(svc.manager.slurm.last.held if svc.manager.slurm.last else ())
        assert held["sn2"].startswith("rate cap"), held
        await b.close()


async def test_a_gpu_that_fails_again_after_a_repair_drains_its_node_again(tmp_path: Path) -> None:
    state, url, opts = _setup(tmp_path, ["sn1"])
    async with running_service(url, tmp_path, **{**opts, "slurm_max_drains": 10}) as svc:
        a = await _agent(svc, "sn1")
        await a.report({"GPU-sn1-0": "failed"}, reasons=[XID48], xids=[48])
        await eventually(lambda: _drained(state, "sn1") and "sn1" in svc.manager.slurm.ours, timeout=20)
        fake_slurm.resume(state, "sn1")  # an operator resumes it while the GPU is still failed
        await _passes(svc, 3)
        assert "sn1" not in fake_slurm.drained(state)
        await a.report({"GPU-sn1-0": "healthy"}, reasons=["repaired"])
        await eventually(lambda: "sn1" not in svc.manager.slurm.wanted, timeout=20)
        await _passes(svc, 2)
        await a.report({"GPU-sn1-0": "failed"}, reasons=[XID48], xids=[48])  # the same GPU, the same kind
        await eventually(lambda: _drained(state, "sn1"), timeout=20)
        await a.close()


async def test_a_resume_decided_before_a_gpu_failed_is_not_carried_out(tmp_path: Path) -> None:
    state, url, opts = _setup(tmp_path, ["sn1"])
    async with running_service(url, tmp_path, **opts) as svc:
        a = await _agent(svc, "sn1")
        await a.report({"GPU-sn1-1": "failed"}, reasons=[XID48], xids=[48])
        await eventually(lambda: _drained(state, "sn1") and "sn1" in svc.manager.slurm.ours, timeout=20)
        # a pass that judged sn1 before GPU 1 failed decided to resume it; the resume runs now (its
        # commands and audit writes take time: a failure can land in between)
        await svc.manager.slurm._resume(Action(ActionKind.RESUME, "sn1", (), "no GPU of the node needs a person"))
        assert _drained(state, "sn1")
        await a.close()
