"""`ntp-run --slurm --job-spec`: node 0 registers the job with a real manager (REST on loopback), which
checks the spec's fields with the model `POST /v1/jobs` uses. The worker keeps no copy of that
model (issue 35), so a bad field is refused by the manager -- in one line naming the field, before
any rank starts, with nothing created -- and a good spec registers the job over the allocation's
NVLink domains.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from ntp_manager.worker.slurm_env import SlurmEnvError, SlurmRun, load_spec, read_step
from tests.integration.conftest import Service, eventually
from tests.integration.test_agent import make_agent, running

STEP = {"SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "j", "SLURMD_NODENAME": "sn1", "SLURM_NODEID": "0",
        "SLURM_JOB_NODELIST": "sn1", "SLURM_STEP_GPUS": "0,1,2,3", "SLURM_LAUNCH_NODE_IPADDR": "127.0.0.1"}
GOOD = "tp: 2\nreplicas: 2\nlocal_batch: 4\nmin_tp: 1\nheads: 6\nmlp_columns: 96\n"


async def test_the_manager_checks_the_spec_fields_and_a_good_spec_registers(
        sqlite_service: Service, tmp_path: Path) -> None:
    svc = sqlite_service
    a = make_agent(svc.grpc, await svc.agent_token("sn1"), "sn1", "nvl-0", [])
    async with running(a):
        await eventually(lambda: a.registered.is_set())
        said: list[str] = []
        spec_file = tmp_path / "job.yaml"

        def run_for(text: str) -> SlurmRun:
            spec_file.write_text(text)
            return SlurmRun(read_step(STEP), "j-7", spec=load_spec(str(spec_file), "j-7"), http=svc.http,
                            token=svc.tokens["operator"])

        # a field missing, and one out of its bounds: refused by the manager, named, nothing created
        for text, field in [("tp: 2\nlocal_batch: 4\n", "replicas"), (GOOD.replace("tp: 2", "tp: -1"), "tp")]:
            run = run_for(text)
            with pytest.raises(SlurmEnvError, match=rf"refused job j-7 \(422\).*{field}") as e:
                await asyncio.to_thread(run.register, said.append)
            assert "\n" not in str(e.value)
            async with svc.client() as c:
                assert (await c.get("/v1/jobs/j-7")).status_code == 404
        # a good one: registered over the node's domain
        run = run_for(GOOD)
        assert await asyncio.to_thread(run.register, said.append) is True
        async with svc.client() as c:
            r = await c.get("/v1/jobs/j-7")
            assert r.status_code == 200 and r.json()["spec"]["domains"] == ["nvl-0"], r.json()
        assert said[-1] == "job j-7: registered over nvl-0"


async def test_a_registration_over_another_jobs_domain_is_refused_naming_it(
        sqlite_service: Service, tmp_path: Path) -> None:
    """Issue 41: Slurm gave this allocation a node whose domain another job owns (a job from
    elsewhere, or a stale one): the registration is refused with the owner's name, and nothing is
    created."""
    svc = sqlite_service
    a = make_agent(svc.grpc, await svc.agent_token("sn1"), "sn1", "nvl-0", [])
    async with running(a):
        await eventually(lambda: a.registered.is_set())
        async with svc.client() as c:
            other = {"name": "other", "tp": 2, "replicas": 1, "local_batch": 4, "heads": 6, "mlp_columns": 96,
                     "domains": ["nvl-0"]}
            assert (await c.post("/v1/jobs", json=other)).status_code == 201
        spec_file = tmp_path / "job.yaml"
        spec_file.write_text(GOOD)
        run = SlurmRun(read_step(STEP), "j-7", spec=load_spec(str(spec_file), "j-7"), http=svc.http,
                       token=svc.tokens["operator"])
        with pytest.raises(SlurmEnvError, match=r"refused job j-7 \(409\).*job 'other' owns \['nvl-0'\]"):
            await asyncio.to_thread(run.register, lambda _: None)
        async with svc.client() as c:
            assert (await c.get("/v1/jobs/j-7")).status_code == 404
