"""docker-compose.yml is checked for structure here (no Docker engine on the test machines): the
services a trial needs, their start order, that every file and command they name exists, and that
the job's ranks match the fake GPUs the agents announce."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import yaml
from typer.main import get_command

from ntp_agent.backends.fake import load_scenario
from ntp_manager.specfile import load_job

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_services_and_start_order() -> None:
    c = compose()
    s = c["services"]
    assert set(s) == {"postgres", "bootstrap", "manager", "manager-b", "agent-a", "agent-b", "job"}
    assert s["postgres"]["image"].startswith("postgres:") and "healthcheck" in s["postgres"]
    assert s["bootstrap"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for m in ("manager", "manager-b"):  # two managers: one leads, the other stands by
        assert s[m]["depends_on"] == {"postgres": {"condition": "service_healthy"},
                                      "bootstrap": {"condition": "service_completed_successfully"}}
        assert s[m]["restart"] == "unless-stopped"  # a manager that lost its lease exits, to stand by
        env = s[m]["environment"]
        assert env["NTP_ADVERTISE_GRPC"] == f"{m}:50051" and env["NTP_ADVERTISE_HTTP"] == f"{m}:8080"
    assert s["job"]["environment"]["NTP_URL"] == "http://manager:8080,http://manager-b:8080"
    for a in ("agent-a", "agent-b"):
        assert s[a]["depends_on"]["manager"]["condition"] == "service_healthy"
    assert {"manager", "agent-a", "agent-b"} <= set(s["job"]["depends_on"])
    assert set(c["volumes"]) == {"pgdata", "tokens"}
    for name in ("bootstrap", "manager", "manager-b", "agent-a", "agent-b", "job"):  # the shared app settings
        assert s[name]["build"] == "." and "tokens:/tokens" in s[name]["volumes"]
        url = s[name]["environment"]["NTP_DATABASE_URL"]
        assert url.startswith("postgresql+asyncpg://") and "@postgres:5432/" in url
    assert "8080:8080" in s["manager"]["ports"] and "50051:50051" in s["manager"]["ports"]


def test_commands_name_real_options_and_files() -> None:
    from ntp_agent.main import app as agent_app
    from ntp_manager.cli.manager import app as manager_app

    s = compose()["services"]
    params = {o for p in get_command(manager_app).commands["serve"].params for o in p.opts}  # type: ignore[attr-defined]
    for m in ("manager", "manager-b"):
        serve = s[m]["command"]
        assert serve[:2] == ["ntp-manager", "serve"]
        assert {a for a in serve[2:] if a.startswith("--")} <= params
    agent_params = {o for p in get_command(agent_app).params for o in p.opts}
    for name, node, domain in (("agent-a", "node-a", "nvl-0"), ("agent-b", "node-b", "nvl-1")):
        cmd = s[name]["command"]
        assert cmd[0] == "ntp-agent" and {a for a in cmd[1:] if a.startswith("--")} <= agent_params
        opts = dict(zip(cmd[1::2], cmd[2::2], strict=True))
        assert opts["--manager"] == "manager:50051,manager-b:50051" and opts["--backend"] == "fake"
        sc = load_scenario(ROOT / opts["--scenario"])
        assert (sc.node, sc.domain, opts["--node"], opts["--domain"]) == (node, domain, node, domain)
    for script in ("deploy/bootstrap-tokens.sh", "deploy/run-job.sh"):
        assert (ROOT / script).exists()
    assert s["bootstrap"]["command"] == ["sh", "deploy/bootstrap-tokens.sh"]
    assert s["job"]["command"] == ["sh", "deploy/run-job.sh"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'torch==2.13.0' in dockerfile and "/whl/cpu" in dockerfile
    for copied in re.findall(r"^COPY (\S+)", dockerfile, re.M):
        assert (ROOT / copied).exists(), copied


def test_the_job_runs_one_rank_per_fake_gpu_and_fits_the_domains() -> None:
    script = (ROOT / "deploy/run-job.sh").read_text()
    scenario_files = re.findall(r"examples/scenarios/\S+\.yaml", script)
    assert len(scenario_files) == 2
    gpus = [g.uuid for f in scenario_files for g in load_scenario(ROOT / f).gpu_specs()]
    assert len(gpus) == 8 and all(gpus) and len(set(gpus)) == 8
    job = load_job(ROOT / "examples/specs/job-compose.yaml")
    assert job.tp * job.replicas == len(gpus) and set(job.domains) == {"nvl-0", "nvl-1"}
    # the training model has 6 heads and 96 MLP columns: the spec must say the same
    assert (job.heads, job.mlp_columns) == (6, 96)
    boot = (ROOT / "deploy/bootstrap-tokens.sh").read_text()
    tokens = shlex.split(boot.split("for scope in", 1)[1].split(";")[0])
    assert set(tokens) >= {"worker", "operator", "viewer"}
    # agent tokens speak for one node each: every agent reads the token made for its --node
    nodes = shlex.split(boot.split("for node in", 1)[1].split(";")[0])
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name in ("agent-a", "agent-b"):
        cmd = compose["services"][name]["command"]
        node = cmd[cmd.index("--node") + 1]
        assert node in nodes and cmd[cmd.index("--token-file") + 1] == f"/tokens/agent-{node}"
