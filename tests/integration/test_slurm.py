"""ntp-manager under a real Slurm (issue 31): munged, slurmctld and two slurmd on loopback
(slurm_cluster.py), driven only through Slurm's own commands.

- The manager drains a node whose GPU its agent failed (the reason names the GPU and the XID and
  links the audit record), resumes it when repaired, never resumes (or drains over) a node an
  operator drained, refuses a node Slurm does not know, holds drains past its rate cap, and in dry
  run only audits. A slurmctld that hangs delays the drain (bounded, retried), not the planner.
- deploy/slurm/healthcheck.sh (HealthCheckProgram) drains a node whose agent is gone and resumes it,
  under the environment slurmd gives it.
- deploy/slurm/train.sbatch: a job submitted with sbatch, one ntp-run per node with GPUs from
  Slurm, the job registered by ntp-run; a GPU fails (fake backend, XID 48) and its rank dies, the
  replica goes on at TP1, the node is drained; the GPU is repaired, the rank rejoins, the node is
  resumed; the job ends COMPLETED with every step's loss equal to one process's. The prolog (health)
  and the epilog (power back to the base cap, dry run) run around it.

All tests share one cluster (module scope); each leaves its nodes resumed.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from ntp_agent.local import FakeFleet, FakeNode
from ntp_manager.service.operations.slurm_policy import MARKER
from ntp_manager.worker.env import pid_key, progress_key
from ntp_manager.worker.slurm_env import expand_hostlist
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.integration.conftest import Service, audit_rows, eventually, running_service
from tests.integration.slurm_cluster import ROOT, SlurmCluster, free_port

BIN = Path(sys.executable).parent
XID48 = "XID 48: needs a GPU reset or replacement"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    root = tmp_path_factory.mktemp("slurm")
    (root / "gpus.yaml").write_text("seed: 1\ngpus: 2\n")
    env = {"NTP_AGENT": str(BIN / "ntp-agent"), "NTP_AGENT_STATE_FILE": str(root / "agent-{node}.json"),
           "NTP_HEALTH_ARGS": "--agent-only", "NTP_POWER_BACKEND": "fake",
           "NTP_POWER_SCENARIO": str(root / "gpus.yaml"), "NTP_BASE_CAP": "0.6", "NTP_EPILOG_DRY_RUN": "1",
           "NTP_SLURM_LOG": str(root / "ntp-slurm.log")}
    cluster = SlurmCluster(root, script_env=env).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def clean(slurm: SlurmCluster) -> Iterator[SlurmCluster]:
    slurm.resume_all()
    try:
        yield slurm
    finally:
        slurm.resume_all()


def slurm_settings(cluster: SlurmCluster, **more: Any) -> dict[str, Any]:
    return {"slurm_drain": True, "slurm_conf": cluster.conf, "slurm_poll_s": 0.5, "slurm_timeout_s": 5.0,
            "slurm_retries": 1, "slurm_backoff_s": 0.2, **more}


async def state_of(cluster: SlurmCluster, node: str) -> tuple[str, str]:
    return (await asyncio.to_thread(cluster.nodes_state))[node]


async def drained_by(cluster: SlurmCluster, node: str, prefix: str) -> bool:
    st, reason = await state_of(cluster, node)
    return "drain" in st and reason.startswith(prefix)


@pytest.fixture
async def agents(clean: SlurmCluster, tmp_path: Path) -> AsyncIterator[tuple[Service, dict[str, ScriptedAgent]]]:
    async with running_service(f"sqlite+aiosqlite:///{tmp_path / 'ntp.db'}", tmp_path,
                               **slurm_settings(clean, slurm_max_drains=1)) as svc:
        svc.manager.leadership.advertise(svc.http.removeprefix("http://"), svc.grpc)  # as server.py does
        nodes = {"sn1": 2, "sn2": 2, "ghost": 1}  # ghost: an agent on a host Slurm does not have
        ags = {n: ScriptedAgent(svc.grpc, await svc.agent_token(n), n, f"nvl-{n}", gpu_uuids(n, k))
               for n, k in nodes.items()}
        for a in ags.values():
            await a.connect()
            await a.wait_for(lambda a=a: a.welcome is not None)
        try:
            yield svc, ags
        finally:
            for a in ags.values():
                await a.close()


def test_host_lists_expand_as_scontrol_does(slurm: SlurmCluster) -> None:
    for text in ("sn[1-2]", "sn1,gpu-[3,08-11],r[1-2]n[01-02],a[1-2],a[2-3]"):
        assert expand_hostlist(text) == slurm.cmd("scontrol", "show", "hostnames", text).split()


async def test_drains_its_own_resumes_its_own_and_leaves_operators_alone(
        agents: tuple[Service, dict[str, ScriptedAgent]], clean: SlurmCluster) -> None:
    svc, ags = agents
    mgr, c = svc.manager, clean
    # the same moment: a GPU of ghost, sn1 and sn2 fail (XID 48); one drain per window (slurm_max_drains=1)
    for n in ("ghost", "sn1", "sn2"):
        await ags[n].report({f"GPU-{n}-0": "failed"}, reasons=[XID48], xids=[48])
    # ghost comes first in name order: Slurm does not know it, so it is refused (audited, not retried)
    await eventually(lambda: "ghost" in mgr.slurm.refused, timeout=20)
    refused = await audit_rows(svc, "slurm.refused")
    assert [r.target for r in refused] == ["ghost"] and "Invalid node name specified" in refused[0].reason
    # then sn1 is drained; sn2 waits under the rate cap
    await eventually(lambda: drained_by(c, "sn1", MARKER), timeout=20)
    _, reason = await state_of(c, "sn1")
    assert f"GPU 0 GPU-sn1-0 failed: {XID48}" in reason and "/v1/audit/" in reason
    link = reason.rsplit("audit ", 1)[1]
    assert link.startswith(svc.http + "/v1/audit/")
    async with svc.client("viewer") as http:
        async def recorded() -> bool:  # the record's result is written once scontrol has answered
            return (await http.get(link.removeprefix(svc.http))).json()["after"]["result"] == "drained"

        await eventually(recorded, timeout=10)
        row = (await http.get(link.removeprefix(svc.http))).json()
        assert (row["action"], row["target"], row["after"]["slurm_reason"]) == ("slurm.drain", "sn1", reason)
        assert row["after"]["gpus"][0]["gpu"] == "GPU-sn1-0"
        assert (await http.get("/v1/audit/999999")).status_code == 404
        status = (await http.get("/v1/slurm")).json()
    assert await _not_drained(c, "sn2")
    held = {h["node"]: h["why"] for h in status["held"]}
    assert held["sn2"].startswith("rate cap") and "does not know" in held["ghost"]
    assert [d["node"] for d in status["drained_by_ntp_manager"]] == ["sn1"]

    # an operator drains sn2 for a reason of their own; then everything is repaired
    c.cmd("scontrol", "update", "NodeName=sn2", "State=DRAIN", "Reason=bad DIMM (ticket 12)")
    for n in ("ghost", "sn1", "sn2"):
        await ags[n].report({f"GPU-{n}-0": "healthy"}, reasons=["repaired"])
    await eventually(lambda: not mgr.slurm.wanted, timeout=10)
    await eventually(lambda: _not_drained(c, "sn1"), timeout=20)
    async def resumed() -> bool:
        return [(r.target, r.after["result"]) for r in await audit_rows(svc, "slurm.resume")] == [("sn1", "resumed")]

    await eventually(resumed, timeout=10)
    await asyncio.sleep(1.5)  # passes go by: sn2 is never resumed, its reason never replaced
    assert await state_of(c, "sn2") == ("drained", "bad DIMM (ticket 12)")
    # one drain record per attempt, with how it went: ghost's refused by Slurm, sn1's made
    assert [(r.target, r.after["result"]) for r in await audit_rows(svc, "slurm.drain")] == [
        ("ghost", "refused"), ("sn1", "drained")]


async def _not_drained(c: SlurmCluster, node: str) -> bool:
    return "drain" not in (await state_of(c, node))[0]


async def test_a_hung_slurmctld_delays_the_drain_not_the_planner(
        agents: tuple[Service, dict[str, ScriptedAgent]], clean: SlurmCluster) -> None:
    svc, ags = agents
    mgr, c = svc.manager, clean
    async with svc.client() as http:
        job = {"name": "j", "tp": 2, "replicas": 1, "local_batch": 4, "min_tp": 1, "heads": 6, "mlp_columns": 96,
               "domains": ["nvl-sn1"]}
        assert (await http.post("/v1/jobs", json=job)).status_code == 201
    await eventually(lambda: mgr.world.jobs["j"].layout is not None)
    v0 = mgr.world.jobs["j"].layout.version  # type: ignore[union-attr]
    ctld = c.procs["slurmctld"]
    ctld.send_signal(signal.SIGSTOP)  # every Slurm command now hangs until killed at slurm_timeout_s
    try:
        before = mgr.slurm.commands.attempts
        await ags["sn1"].report({"GPU-sn1-1": "failed"}, reasons=[XID48], xids=[48])
        # the planner replans at once (the job goes on at TP1) while the drain waits on Slurm
        await eventually(lambda: mgr.world.jobs["j"].layout.version > v0, timeout=10)  # type: ignore[union-attr]
        assert mgr.world.jobs["j"].layout.doc.replicas[0].tp == 1  # type: ignore[union-attr]
        # the commands time out (5 s), are retried with backoff, fail, are logged and tried again
        await eventually(lambda: mgr.slurm.commands.attempts >= before + 2 and mgr.slurm.last_error, timeout=30)
        assert "did not finish within 5s" in (mgr.slurm.last_error or "")
    finally:
        ctld.send_signal(signal.SIGCONT)
    await eventually(lambda: drained_by(c, "sn1", MARKER), timeout=40)
    await ags["sn1"].report({"GPU-sn1-1": "healthy"}, reasons=["repaired"])
    await eventually(lambda: _not_drained(c, "sn1"), timeout=20)


async def test_dry_run_audits_what_it_would_do_and_touches_nothing(clean: SlurmCluster, tmp_path: Path) -> None:
    async with running_service(f"sqlite+aiosqlite:///{tmp_path / 'ntp.db'}", tmp_path,
                               **slurm_settings(clean, slurm_dry_run=True)) as svc:
        a = ScriptedAgent(svc.grpc, await svc.agent_token("sn2"), "sn2", "nvl-sn2", gpu_uuids("sn2", 2))
        await a.connect()
        try:
            await a.wait_for(lambda: a.welcome is not None)
            await a.report({"GPU-sn2-1": "failed"}, reasons=[XID48], xids=[48])
            await eventually(lambda: audit_rows(svc, "slurm.would_drain"), timeout=20)
            await asyncio.sleep(1.5)  # several passes: reported once, drained never
            rows = await audit_rows(svc, "slurm.")
            assert [(r.action, r.target) for r in rows] == [("slurm.would_drain", "sn2")]
            assert await _not_drained(clean, "sn2")
        finally:
            await a.close()


def _run_healthcheck(c: SlurmCluster, node: str) -> None:
    # as slurmd runs it: as root, with SLURMD_NODENAME and nothing else (not even PATH)
    subprocess.run([str(c.scripts / "healthcheck.sh")], env={"SLURMD_NODENAME": node}, check=True, timeout=60,
                   cwd=c.root)


def _agent_state(path: Path, node: str, written_at: float, connected: bool = True) -> None:
    path.write_text(json.dumps({"format": 1, "node": node, "domain": f"nvl-{node}", "written_at": written_at,
                                "connected": connected, "since": written_at - 100,
                                "gpus": [{"index": 0, "minor": 0, "uuid": f"GPU-{node}-0", "state": "healthy",
                                          "reasons": []}]}))


def test_the_health_check_drains_a_node_whose_agent_is_gone_and_resumes_only_its_own(clean: SlurmCluster) -> None:
    c = clean
    state = {n: c.root / f"agent-{n}.json" for n in ("sn1", "sn2")}
    try:
        _agent_state(state["sn1"], "sn1", time.time() - 300)  # the agent stopped writing 5 minutes ago
        state["sn2"].unlink(missing_ok=True)  # no agent at all on sn2 ...
        c.cmd("scontrol", "update", "NodeName=sn2", "State=DRAIN", "Reason=bad DIMM")  # ... and an operator's drain
        for n in ("sn1", "sn2"):
            _run_healthcheck(c, n)
        st, reason = c.nodes_state()["sn1"]
        assert "drain" in st and reason.startswith("ntp-agent health: ntp-agent state is ") and "old" in reason
        assert c.nodes_state()["sn2"] == ("drained", "bad DIMM")  # not drained over
        _agent_state(state["sn1"], "sn1", time.time())  # the agent is back
        _agent_state(state["sn2"], "sn2", time.time())
        for n in ("sn1", "sn2"):
            _run_healthcheck(c, n)
        assert "drain" not in c.nodes_state()["sn1"][0]
        assert c.nodes_state()["sn2"] == ("drained", "bad DIMM")  # never resumed: not its drain
        log = (c.root / "ntp-slurm.log").read_text()
        assert "healthcheck sn1: drained:" in log and "healthcheck sn1: resumed: ok: node sn1" in log
    finally:
        for p in state.values():
            p.unlink(missing_ok=True)


JOB_SPEC = "tp: 2\nreplicas: 2\nlocal_batch: 4\nmin_tp: 1\nheads: 6\nmlp_columns: 96\nscheme: ntp\n"


async def test_an_sbatch_job_survives_a_gpu_failure_and_its_repair(clean: SlurmCluster, tmp_path: Path) -> None:
    import torch.distributed as tdist

    c = clean
    async with running_service(f"sqlite+aiosqlite:///{tmp_path / 'ntp.db'}", tmp_path, heartbeat_interval_s=0.5,
                               **slurm_settings(c)) as svc:
        svc.manager.leadership.advertise(svc.http.removeprefix("http://"), svc.grpc)
        worker_tok, op_tok = tmp_path / "worker.token", tmp_path / "operator.token"
        worker_tok.write_text(svc.tokens["worker"])
        op_tok.write_text(svc.tokens["operator"])
        (tmp_path / "job.yaml").write_text(JOB_SPEC)
        tokens = {n: await svc.agent_token(n) for n in ("sn1", "sn2")}
        fleet = FakeFleet(svc.grpc, tokens, [FakeNode("sn1", "nvl-sn1", gpus=2), FakeNode("sn2", "nvl-sn2", gpus=2)],
                          state_file=c.root / "agent-{node}.json")
        port = free_port()
        job_id = ""
        try:
            await eventually(fleet.ready, timeout=20)
            await eventually(lambda: all(_connected(c.root / f"agent-{n}.json") for n in ("sn1", "sn2")), timeout=20)
            env = {**c.env, "PATH": f"{BIN}:{os.environ['PATH']}", "NTP_MANAGER": svc.grpc,
                   "NTP_TOKEN_FILE": str(worker_tok), "NTP_MANAGER_HTTP": svc.http,
                   "NTP_REGISTER_TOKEN_FILE": str(op_tok), "NTP_JOB_SPEC": str(tmp_path / "job.yaml"),
                   "NTP_AGENT_STATE_FILE": str(c.root / "agent-{node}.json"), "NTP_STORE_PORT": str(port),
                   "NTP_RUN": str(BIN / "ntp-run"), "NTP_MAX_RESTARTS": "1", "NTP_RESTART_DELAY": "0.5"}
            out = subprocess.run(
                ["sbatch", "--parsable", "-N", "2", "--gres=gpu:2", "-J", "tiny", f"--chdir={ROOT}",
                 f"--output={tmp_path}/job-%j.out", str(ROOT / "deploy" / "slurm" / "train.sbatch"),
                 "examples/train_tiny_gpt.py", "--steps", "16", "--check", "--step-delay", "0.2"],
                env=env, capture_output=True, text=True, timeout=30, check=True).stdout
            job_id = out.strip().split(";")[0]
            name = f"tiny-{job_id}"
            jobs = svc.manager.world.jobs
            until = JobWatch(c, job_id, tmp_path / f"job-{job_id}.out").until
            # ntp-run (node 0's) registered the job over the allocation's domains
            await until(lambda: name in jobs and jobs[name].layout is not None, 60)
            assert jobs[name].spec.domains == ("nvl-sn1", "nvl-sn2")
            store = await asyncio.to_thread(tdist.TCPStore, "127.0.0.1", port, is_master=False,  # type: ignore[attr-defined]
                                            timeout=dt.timedelta(seconds=30))
            gpus = fleet.gpus("sn1") + fleet.gpus("sn2")

            def step() -> int:
                best = -1
                for g in gpus:
                    if store.check([progress_key(name, g)]):
                        best = max(best, int(json.loads(store.get(progress_key(name, g)))["step"]))
                return best

            await until(lambda: step() >= 3, 120)
            victim = fleet.gpus("sn1")[1]
            fleet.inject("sn1", "xid", 1, xid=48)  # the GPU fails; its rank's process dies with it
            os.kill(int(store.get(pid_key(name, victim))), signal.SIGKILL)
            await until(lambda: _tps(jobs[name]) == [1, 2], 60)
            await until(lambda: drained_by(c, "sn1", MARKER), 30)
            reason = (await state_of(c, "sn1"))[1]
            assert victim in reason and "XID 48" in reason
            at_failure = step()
            await until(lambda: step() >= at_failure + 3, 60)  # goes on at TP1
            fleet.inject("sn1", "repair", 1)  # repaired: ntp-run's fresh process rejoins
            await until(lambda: _tps(jobs[name]) == [2, 2], 60)
            await until(lambda: _not_drained(c, "sn1"), 30)
            await until(lambda: False, 180, done_ok=True)  # the job ends
            text = (tmp_path / f"job-{job_id}.out").read_text()
            assert c.job_state(job_id) == "COMPLETED", text[-3000:]
            assert text.count("check ok") == 4 and "FAILED" not in text, text[-3000:]  # 3 survivors + the rejoined
            done = [e for e in map(json.loads, (ln for ln in text.splitlines() if ln.startswith("{")))
                    if e.get("event") == "done"]  # each node's ntp-run's last line (JSON: not a terminal)
            assert [(e["finished_cleanly"], e["ranks"]) for e in done] == [(2, 2), (2, 2)], text[-3000:]
            await eventually(lambda: name not in jobs, timeout=30)  # node 0's ntp-run deleted what it registered
            log = await asyncio.to_thread((c.root / "ntp-slurm.log").read_text)
            for n in ("sn1", "sn2"):  # prolog: the agent was healthy; epilog: back to the base cap (dry run)
                assert f"prolog {n} job {job_id}: ok: node {n}" in log, log
                # 0.6 x the fake GPU's 1300 W maximum = 780 W, below its 1000 W default
                assert f"epilog {n} job {job_id}: GPU 0 " in log and "would set 780 W (now 1000 W; dry run)" in log, log
            want = [("slurm.drain", "sn1", "drained"), ("slurm.resume", "sn1", "resumed")]

            async def audited() -> bool:
                return [(r.action, r.target, r.after["result"]) for r in await audit_rows(svc, "slurm.")] == want

            await eventually(audited, timeout=10)
        finally:
            if job_id and c.job_state(job_id) in ("RUNNING", "PENDING", "CONFIGURING"):
                c.cmd("scancel", job_id, check=False)
            await asyncio.to_thread(fleet.stop)


LIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")


class JobWatch:
    """Waits for a condition while a Slurm job runs; fails at once, with the job's output, when
    the job ends first."""

    def __init__(self, c: SlurmCluster, job_id: str, out: Path) -> None:
        self.c, self.job_id, self.out = c, job_id, out

    def _tail(self) -> str:
        return self.out.read_text(errors="replace")[-4000:] if self.out.exists() else "(no output yet)"

    async def until(self, pred: Any, timeout: float, done_ok: bool = False) -> None:
        end = time.monotonic() + timeout
        while True:
            got = pred()
            if asyncio.iscoroutine(got):
                got = await got
            if got:
                return
            st = await asyncio.to_thread(self.c.job_state, self.job_id)
            if st not in LIVE:
                if done_ok:
                    return
                raise AssertionError(f"Slurm job {self.job_id} is {st or 'gone'} before the condition held:\n"
                                     + self._tail())
            if time.monotonic() > end:
                raise AssertionError(f"condition not met within {timeout:g}s; job {self.job_id} is {st}:\n"
                                     + self._tail())
            await asyncio.sleep(0.2)


def _connected(path: Path) -> bool:
    try:
        return bool(json.loads(path.read_text()).get("connected"))
    except (OSError, ValueError):
        return False


def _tps(job: Any) -> list[int]:
    return sorted(r.tp for r in job.layout.doc.replicas) if job.layout is not None else []

