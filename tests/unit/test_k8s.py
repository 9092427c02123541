"""deploy/k8s/ is checked on paper (no Kubernetes API server here; docs/slurm.md says what a real
cluster test would check): every manifest parses, is marked untested, and agrees with the code —
the NTP_ settings it sets exist, its commands and options exist, its probes are routes the manager
serves, every Secret and key it names is defined, Services select pods and target named ports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from typer.main import get_command

from ntp_agent.main import AgentSettings
from ntp_manager.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"


def docs() -> list[dict[str, Any]]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        text = f.read_text()
        assert "UNTESTED" in text, f"{f.name} must say it is untested"
        out += [d for d in yaml.safe_load_all(text) if d]
    return out


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs() if d["kind"] == kind}


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    return list(workload["spec"]["template"]["spec"]["containers"])


def test_the_set_is_complete_and_namespaced() -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs())
    assert kinds == [("DaemonSet", "ntp-agent"), ("Deployment", "ntp-manager"), ("Namespace", "ntp-system"),
                     ("Secret", "ntp-agent-tokens"), ("Secret", "ntp-database"), ("Secret", "ntp-postgres"),
                     ("Service", "ntp-manager"), ("Service", "ntp-postgres"), ("StatefulSet", "ntp-postgres")]
    assert all(d["metadata"].get("namespace") == "ntp-system" for d in docs() if d["kind"] != "Namespace")


def test_settings_commands_and_probes_exist() -> None:
    from ntp_agent.main import app as agent_app
    from ntp_agent.main import health_app
    from ntp_manager.api.app import create_app
    from ntp_manager.cli.manager import app as manager_app
    from ntp_manager.service.manager import Manager

    manager_vars = {f"NTP_{k.upper()}" for k in Settings.model_fields}
    agent_vars = {f"NTP_AGENT_{k.upper()}" for k in AgentSettings.model_fields}
    (mgr,) = containers(by_kind("Deployment")["ntp-manager"])
    (agent,) = containers(by_kind("DaemonSet")["ntp-agent"])
    for c, known in ((mgr, manager_vars), (agent, agent_vars)):
        ntp = {e["name"] for e in c["env"] if e["name"].startswith("NTP_")}
        assert ntp and ntp <= known, ntp - known
    serve = {o for p in get_command(manager_app).commands["serve"].params for o in p.opts}  # type: ignore[attr-defined]
    assert mgr["command"] == ["ntp-manager", "serve"] and {a for a in mgr["args"] if a.startswith("--")} <= serve
    assert agent["command"] == ["ntp-agent"]
    health = {o for p in get_command(health_app).params for o in p.opts}
    probe = agent["livenessProbe"]["exec"]["command"]
    assert probe[:2] == ["ntp-agent", "health"] and {a for a in probe if a.startswith("--")} <= health
    assert get_command(agent_app) is not None
    routes = {getattr(r, "path", None) for r in create_app(Manager(Settings(data_dir=ROOT / "nowhere"))).routes}
    for probe_kind in ("livenessProbe", "readinessProbe"):
        assert mgr[probe_kind]["httpGet"]["path"] in routes
    ports = {p["name"]: p["containerPort"] for p in mgr["ports"]}
    args = dict(zip(mgr["args"][::2], mgr["args"][1::2], strict=True))
    assert (ports["http"], ports["grpc"]) == (int(args["--http-port"]), int(args["--grpc-port"]))
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert env["NTP_AGENT_MANAGER"] == f"ntp-manager.ntp-system.svc:{ports['grpc']}"
    assert env["NTP_AGENT_BACKEND"] == "nvml" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"


def test_secrets_volumes_and_services_fit_together() -> None:
    secrets = by_kind("Secret")
    for w in [*by_kind("Deployment").values(), *by_kind("DaemonSet").values(), *by_kind("StatefulSet").values()]:
        spec = w["spec"]["template"]["spec"]
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]]["stringData"], ref
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes or m["name"] in {t["metadata"]["name"] for t in
                                                             w["spec"].get("volumeClaimTemplates", [])}, m
        for v in volumes.values():
            if "secret" in v:
                assert v["secret"]["secretName"] in secrets
    workloads = [*by_kind("Deployment").values(), *by_kind("StatefulSet").values()]
    for svc in by_kind("Service").values():
        (target,) = [w for w in workloads if svc["spec"]["selector"].items()
                     <= w["spec"]["template"]["metadata"]["labels"].items()]
        named = {p["name"] for c in containers(target) for p in c["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= named
    # the agent: its token file is the node's key of the mounted Secret; its state file on the host
    agent_spec = by_kind("DaemonSet")["ntp-agent"]["spec"]["template"]["spec"]
    (agent,) = agent_spec["containers"]
    env = {e["name"]: e.get("value") for e in agent["env"]}
    mounts = {m["name"]: m["mountPath"] for m in agent["volumeMounts"]}
    assert env["NTP_AGENT_TOKEN_FILE"] == f"{mounts['tokens']}/$(NODE_NAME)"
    assert env["NTP_AGENT_NODE"] == "$(NODE_NAME)"
    assert str(Path(env["NTP_AGENT_STATE_FILE"]).parent) == mounts["state"]
    host = {v["name"]: v for v in agent_spec["volumes"]}["state"]["hostPath"]["path"]
    assert host == mounts["state"] and agent["securityContext"]["privileged"] is True
