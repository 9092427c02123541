"""`ntp-agent`: the node daemon.

    ntp-agent --manager HOST:PORT[,HOST:PORT...] --token-file F --backend nvml|fake [--scenario FILE]
              [--node NAME] [--domain ID] [--metrics-port N]
              [--tls-ca CA.pem [--tls-cert NODE.pem --tls-key NODE.key]]

The token must be an agent token made for this node (`ntp-manager token create --scope agent
--node NAME`); with `--tls-ca` the agent connects over TLS, and with a client certificate over
mTLS (the manager's TLS port; docs/security.md).

    ntp-agent probe [--backend nvml|fake] [--scenario FILE] [--json]

`probe` prints the GPU inventory and one sample of every GPU, then exits: read-only (it never
sets a power limit, registers nothing and needs no manager or token), for recording what a real
node reports. Settings may also come from the environment (prefix NTP_AGENT_). Under systemd (Type=notify) it
sends READY=1 after the backend initialised and the manager accepted its registration, and feeds
the watchdog from the main loop. A malformed scenario or configuration prints one `error:` line and
exits with status 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict
from rich.console import Console

from ntp_agent.backends.base import BackendError, GpuBackend
from ntp_agent.core import Agent, AgentConfig, telemetry_pb
from ntp_agent.policy import HealthPolicy, PolicyError, XidPolicy
from ntp_manager.contract.telemetry import counters

err = Console(stderr=True)


class AgentSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NTP_AGENT_", extra="forbid", allow_inf_nan=False)

    # Every field's description is its line in docs/settings.md (tools/settings_doc.py writes it).
    manager: str = Field("127.0.0.1:50051", description="manager gRPC address HOST:PORT; several managers (one "
                         "leads): HOST:PORT,HOST:PORT")
    token_file: Path | None = Field(None, description="file holding this node's agent-scope token (required)")
    backend: str = Field("nvml", pattern="^(nvml|fake)$", description="GPU backend: `nvml` (nvidia-ml-py) or "
                         "`fake` (a scenario file)")
    scenario: Path | None = Field(None, description="scenario YAML for the fake backend")
    node: str = Field(default_factory=socket.gethostname, description="node name; default: the host name (the fake "
                      "backend: the scenario's node)")
    domain: str | None = Field(None, description="NVLink domain; default: from NVML fabric info (the fake backend: "
                               "the scenario's)")
    metrics_port: int = Field(0, ge=0, le=65535, description="Prometheus metrics port on 127.0.0.1 (0: off)")
    heartbeat_interval_s: float = Field(2.0, gt=0, description="how often a heartbeat is considered: sent when "
                                        "the GPU counters changed materially or the welcome's longest quiet passed; "
                                        "a manager whose welcome asks for a shorter period gets that")
    sample_interval_s: float = Field(1.0, gt=0, description="GPU counters are sampled this often")
    # a per-GPU NVML call slower than this fails the GPU as hung (the loop and other GPUs go on)
    gpu_call_timeout_s: float = Field(3.0, gt=0, le=60, description="a per-GPU NVML call slower than this fails the "
                                      "GPU as hung (the loop and other GPUs go on)")
    xid_policy: dict[str, str] = Field(default_factory=dict, description="XID overrides as JSON, e.g. "
                                       '`{"94": "fail"}` (agent/ntp_agent/policy.py)')
    log_format: str = Field("console", pattern="^(console|json)$", description="`console`, or `json` for production")
    tls_ca: Path | None = Field(None, description="CA of the manager's certificate (PEM): connect over TLS")
    tls_cert: Path | None = Field(None, description="this node's client certificate (PEM): mTLS; with `tls_key`")
    tls_key: Path | None = Field(None, description="its private key (PEM)")
    state_file: Path | None = Field(None, description="local state file (JSON: GPUs with device numbers and "
                                    "verdicts, the connection) for `ntp-run --slurm` and `ntp-agent health`; "
                                    "`{node}` is replaced by the node name; unset: none written")


def fail(msg: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {msg}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def open_backend(kind: str, scenario: Path | None, node: str, domain: str | None) -> tuple[GpuBackend, str, str | None]:
    """The GPU backend, the node name and the NVLink domain (given, else from the backend)."""
    if kind == "fake":
        from ntp_agent.backends.fake import FakeBackend, ScenarioError, load_scenario

        if scenario is None:
            fail("the fake backend needs --scenario FILE")
        try:
            sc = load_scenario(scenario)
        except ScenarioError as e:
            fail(str(e))
        node = node if node != socket.gethostname() or not sc.node else sc.node
        return FakeBackend(sc, node=node), node, domain or sc.domain
    if kind != "nvml":
        fail(f"backend must be nvml or fake, not {kind!r}")
    from ntp_agent.backends.nvml import NvmlBackend

    try:
        nvml = NvmlBackend()
    except BackendError as e:
        fail(f"NVML: {e}")
    return nvml, node, domain or nvml.domain_of_node()


def build(settings: AgentSettings) -> Agent:
    if settings.token_file is None:
        fail("a token file is needed (--token-file or NTP_AGENT_TOKEN_FILE)")
    try:
        token = settings.token_file.read_text().strip()
    except OSError as e:
        fail(f"{settings.token_file}: cannot read the token ({e.strerror})")
    except UnicodeDecodeError:
        fail(f"{settings.token_file}: not a token file (not text)")
    if not token:
        fail(f"{settings.token_file}: the token file is empty")
    try:
        policy = HealthPolicy(XidPolicy.default().with_overrides(settings.xid_policy))
    except PolicyError as e:
        fail(str(e))
    backend, node, domain = open_backend(settings.backend, settings.scenario, settings.node, settings.domain)
    if not domain:
        fail("no NVLink domain: NVML reports no fabric clique, so give --domain")
    if (settings.tls_cert is None) != (settings.tls_key is None):
        fail("--tls-cert and --tls-key go together")
    from ntp_manager.contract.tls import TlsFiles

    try:  # the files are read again at each connection; a bad one is found here, once
        TlsFiles(settings.tls_ca, settings.tls_cert, settings.tls_key,
                 labels=("--tls-ca", "--tls-cert", "--tls-key")).check()
    except OSError as e:
        fail(str(e))
    cfg = AgentConfig(manager=settings.manager, token=token, node=node, domain=domain,
                      heartbeat_interval_s=settings.heartbeat_interval_s,
                      sample_interval_s=settings.sample_interval_s,
                      gpu_call_timeout_s=settings.gpu_call_timeout_s,
                      tls_ca=settings.tls_ca, tls_cert=settings.tls_cert, tls_key=settings.tls_key,
                      state_file=settings.state_file)
    return Agent(backend, cfg, policy)


def serve_metrics(agent: Agent, port: int) -> None:
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class Collector:
        def collect(self):  # type: ignore[no-untyped-def]
            x = CounterMetricFamily("ntp_agent_xids", "XID events seen", labels=["xid"])
            for xid, n in sorted(agent.xid_counts.items()):
                x.add_metric([str(xid)], n)
            yield x
            d = GaugeMetricFamily("ntp_agent_power_limit_watts", "desired and enforced limits", labels=["gpu", "kind"])
            for u, st in agent.power.caps.items():
                if st.desired_mw is not None:
                    d.add_metric([u, "desired"], st.desired_mw / 1000)
                if st.enforced_mw is not None:
                    d.add_metric([u, "enforced"], st.enforced_mw / 1000)
            yield d
            yield CounterMetricFamily("ntp_agent_nvml_errors", "backend errors", value=agent.metrics["nvml_errors"])
            yield GaugeMetricFamily("ntp_agent_last_report_timestamp_seconds", "last report sent",
                                    value=agent.metrics["last_report"])
            yield GaugeMetricFamily("ntp_agent_connected", "1 while connected", value=float(agent.connected.is_set()))

    reg = CollectorRegistry()
    reg.register(Collector())
    start_http_server(port, addr="127.0.0.1", registry=reg)


async def run(agent: Agent) -> None:
    import sdnotify

    notifier = sdnotify.SystemdNotifier()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, agent.stopping.set)

    async def ready() -> None:
        await agent.registered.wait()
        notifier.notify("READY=1")
        print("NTP-AGENT READY", flush=True)

    task = asyncio.create_task(ready())
    try:
        await agent.run(watchdog=lambda: notifier.notify("WATCHDOG=1"))
    finally:
        task.cancel()
        notifier.notify("STOPPING=1")


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def main_cmd(
    manager: Annotated[str | None, typer.Option(
        help="manager gRPC address HOST:PORT; several managers (one leads): HOST:PORT,HOST:PORT")] = None,
    token_file: Annotated[Path | None, typer.Option(help="file holding an agent-scope token")] = None,
    backend: Annotated[str | None, typer.Option(help="nvml | fake")] = None,
    scenario: Annotated[Path | None, typer.Option(help="scenario YAML for the fake backend")] = None,
    node: Annotated[str | None, typer.Option(help="node name (default: host name)")] = None,
    domain: Annotated[str | None, typer.Option(help="NVLink domain (default: from NVML fabric info)")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus port on 127.0.0.1 (0: off)")] = None,
    tls_ca: Annotated[Path | None, typer.Option(help="CA of the manager's certificate (PEM): use TLS")] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="this node's client certificate (PEM): mTLS")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="its private key (PEM)")] = None,
    state_file: Annotated[Path | None, typer.Option(
        help="local state file for ntp-run --slurm and ntp-agent health ({node}: the node name)")] = None,
) -> None:
    """Report this node's GPU health to the manager and apply its power caps."""
    overrides: dict[str, Any] = {"manager": manager, "token_file": token_file, "backend": backend, "scenario": scenario,
                 "node": node, "domain": domain, "metrics_port": metrics_port, "tls_ca": tls_ca,
                 "tls_cert": tls_cert, "tls_key": tls_key, "state_file": state_file}
    try:
        settings = AgentSettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as e:
        first = e.errors()[0]
        fail(f"settings: {'.'.join(str(x) for x in first['loc'])}: {first['msg']}")
    except ValueError as e:  # pydantic-settings: an NTP_AGENT_ value it cannot parse (xid_policy is JSON)
        fail(f"settings: {' '.join(str(e).split())} (NTP_AGENT_XID_POLICY takes JSON, e.g. '{{\"94\": \"fail\"}}')")
    from ntp_manager.contract.logs import configure_logging

    configure_logging(settings.log_format)
    agent = build(settings)
    if settings.metrics_port:
        serve_metrics(agent, settings.metrics_port)
    asyncio.run(run(agent))


def probe(backend: GpuBackend, domain: str | None) -> dict[str, Any]:
    """Inventory and one sample of every GPU, as plain data. Reads only: nothing is set."""
    gpus: list[dict[str, Any]] = []
    for g in backend.gpus():
        entry: dict[str, Any] = {"static": dataclasses.asdict(g)}
        try:
            sample = backend.sample(g.uuid)
            entry["sample"] = dataclasses.asdict(sample)
            # the counters as a heartbeat carries them, and as the agent compares them to decide whether
            # one is due (contract/telemetry.py): read back from the message built from this sample
            entry["heartbeat"] = vars(counters(telemetry_pb(sample)))
        except BackendError as e:
            entry["sample_error"] = f"{type(e).__name__}: {e}"
        gpus.append(entry)
    info = getattr(backend, "info", None)
    out: dict[str, Any] = {"backend": backend.name, "host": socket.gethostname(), "domain": domain, "gpus": gpus}
    if callable(info):
        out["backend_info"] = info()  # after sampling: lists every query that was NotSupported
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        out["nvidia_ml_py"] = importlib.metadata.version("nvidia-ml-py")
    return out


def render_probe(doc: dict[str, Any]) -> None:
    out = Console(highlight=False, soft_wrap=True)
    out.print(f"backend {doc['backend']} on {doc['host']}; NVLink domain: {doc['domain'] or '(none: give --domain)'}")
    for k, v in sorted(doc.get("backend_info", {}).items()):
        out.print(f"  {k}: {v}")

    def w(mw: int | None) -> str:
        return "-" if mw is None else f"{mw / 1000:g} W"

    for e in doc["gpus"]:
        st, sm = e["static"], e.get("sample") or {}
        out.print(f"[bold]GPU {st['index']}[/] {st['uuid']} {st['model']}, {st['memory_bytes'] / 2**30:.0f} GiB, "
                  f"PCI {st['pci_bus_id'] or '-'}, domain {st['domain'] or '-'}")
        out.print(f"  power limits: min {w(st['min_mw'])}, default {w(st['default_mw'])}, max {w(st['max_mw'])}")
        if "sample_error" in e:
            out.print(f"  [red]sample failed: {e['sample_error']}[/]")
            continue
        out.print(f"  enforced {w(sm['limit_mw'])}, usage {w(sm['usage_mw'])}, temperature {sm['temperature_c']} C, "
                  f"ECC corrected {sm['sbe_total']} / uncorrected {sm['dbe_total']}, remap pending "
                  f"{sm['remap_pending']} / failed {sm['remap_failure']}, throttled {sm['throttled']}, "
                  f"NVLinks down {sm['nvlink_down']}")


probe_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@probe_app.command()
def probe_cmd(
    backend: Annotated[str, typer.Option(help="nvml | fake")] = "nvml",
    scenario: Annotated[Path | None, typer.Option(help="scenario YAML for the fake backend")] = None,
    domain: Annotated[str | None, typer.Option(help="NVLink domain, if NVML reports none")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
) -> None:
    """Print this node's GPU inventory and one sample of every GPU. Read-only: never sets a limit."""
    be, _, dom = open_backend(backend, scenario, socket.gethostname(), domain)
    try:
        doc = probe(be, dom)
    finally:
        be.close()
    if as_json:
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        render_probe(doc)


health_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
DEFAULT_STATE_FILE = "/run/ntp-agent/state.json"


@health_app.command()
def health_cmd(
    state_file: Annotated[str, typer.Option(
        envvar="NTP_AGENT_STATE_FILE", help="the running agent's state file ({node}: the node name)",
    )] = DEFAULT_STATE_FILE,
    node: Annotated[str | None, typer.Option(
        help="node name for {node} (default: SLURMD_NODENAME, else the host name)")] = None,
    max_age: Annotated[float, typer.Option(min=1, max=86400, help="seconds the state may be old")] = 30.0,
    max_disconnected: Annotated[float, typer.Option(
        min=0, max=86400, help="seconds the agent may be without a manager")] = 120.0,
    agent_only: Annotated[bool, typer.Option(
        "--agent-only", help="judge the agent only, not the GPUs' verdicts (the manager drains for those)")] = False,
) -> None:
    """Exit 0 when this node is fit for work, else 1 with one line saying why (Slurm's
    HealthCheckProgram, a prolog). Reads the running agent's state file; changes nothing."""
    import os
    import time

    from ntp_agent.state import StateError, expand, judge, read_state

    name = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        doc = read_state(expand(state_file, name))
    except StateError as e:
        print(f"unhealthy: {e}", flush=True)
        raise typer.Exit(1) from None
    verdict = judge(doc, time.time(), max_age_s=max_age, max_disconnected_s=max_disconnected, gpus=not agent_only)
    print(verdict.line if verdict.ok else f"unhealthy: {verdict.line}", flush=True)
    if not verdict.ok:
        raise typer.Exit(1)


power_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@power_app.command()
def power_reset_cmd(
    backend: Annotated[str, typer.Option(help="nvml | fake")] = "nvml",
    scenario: Annotated[Path | None, typer.Option(help="scenario YAML for the fake backend")] = None,
    base_cap: Annotated[float | None, typer.Option(
        min=0.01, max=1.0, help="the fleet base cap, a share of each GPU's maximum limit (the manager's "
        "power_base_cap); unset: each GPU's default limit")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print what would be set; set nothing")] = False,
) -> None:
    """Put every GPU's power limit back to the fleet base cap (a Slurm epilog). One line per GPU;
    exit 1 when a limit could not be set."""
    from ntp_agent.power import PowerController, base_target_mw

    be, _, _ = open_backend(backend, scenario, socket.gethostname(), "-")
    bad = 0
    try:
        pc = PowerController(be)
        for g in be.gpus():
            want = base_target_mw(g, base_cap)
            try:
                now = be.get_limit_mw(g.uuid)
            except BackendError as e:
                print(f"GPU {g.index} {g.uuid}: cannot read the limit: {e}", flush=True)
                bad += 1
                continue
            if want is None:
                print(f"GPU {g.index} {g.uuid}: power limit constraints unknown: left at {now / 1000:g} W", flush=True)
                continue
            if now == want:
                print(f"GPU {g.index} {g.uuid}: at {want / 1000:g} W already", flush=True)
            elif dry_run:
                print(f"GPU {g.index} {g.uuid}: would set {want / 1000:g} W (now {now / 1000:g} W; dry run)",
                      flush=True)
            else:
                st = pc.set(g.uuid, want)
                if st.error:
                    print(f"GPU {g.index} {g.uuid}: {st.error}", flush=True)
                    bad += 1
                else:
                    print(f"GPU {g.index} {g.uuid}: set {want / 1000:g} W (was {now / 1000:g} W)", flush=True)
    finally:
        be.close()
    if bad:
        raise typer.Exit(1)


def main(argv: Sequence[str] | None = None) -> int:
    """The `ntp-agent` console script: the exit status (usage errors are one line, ntp_manager/contract/usage.py)."""
    from ntp_manager.contract.usage import run_app

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["probe"]:
        return run_app(probe_app, args[1:], "ntp-agent probe")
    if args[:1] == ["health"]:
        return run_app(health_app, args[1:], "ntp-agent health")
    if args[:1] == ["power-reset"]:
        return run_app(power_app, args[1:], "ntp-agent power-reset")
    return run_app(app, args, "ntp-agent")


if __name__ == "__main__":
    sys.exit(main())
