"""`ntp-manager` command line: plan, cluster generation, simulation (and later the service).

Every failure the user can cause prints one `error: ...` line on stderr and exits with status 2;
no traceback reaches the terminal.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.table import Table

from ntp_manager.cli.common import fail
from ntp_manager.cli.simulate import simulate
from ntp_manager.contract.gpu import GpuState
from ntp_manager.contract.usage import run_app
from ntp_manager.planner import GroupPlan, Plan, PlanError, PreviousLayout, ReplicaPlan, make_plan
from ntp_manager.planner.export import plan_to_dict
from ntp_manager.settings import Settings
from ntp_manager.specfile import SpecError, load_cluster, load_job
from ntp_manager.topology import Cluster, TopologyError

app = typer.Typer(
    name="ntp-manager",
    help="Cluster resource manager for nonuniform tensor parallelism.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
cluster_app = typer.Typer(help="Cluster spec files.", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")

def apply_failures(cluster: Cluster, fail_uuids: list[str], fail_random: int, seed: int) -> Cluster:
    changes: dict[str, GpuState] = {}
    for u in fail_uuids:
        if u not in cluster:
            raise TopologyError(f"unknown GPU {u!r} in --fail")
        changes[u] = GpuState.FAILED
    if fail_random:
        healthy = [g.uuid for g in cluster.gpus() if g.state.placeable and g.uuid not in changes]
        if fail_random > len(healthy):
            raise TopologyError(f"--fail-random {fail_random} exceeds the {len(healthy)} placeable GPUs")
        for u in random.Random(seed).sample(healthy, fail_random):
            changes[u] = GpuState.FAILED
    return cluster.with_states(changes)


def render_plan(plan: Plan, console: Console) -> None:
    table = Table(title=f"plan for job {plan.job} ({plan.scheme.value}, healthy TP{plan.tp})")
    table.add_column("replica", justify="right")
    table.add_column("TP", justify="right")
    table.add_column("local batch", justify="right")
    table.add_column("groups")
    table.add_column("boosted GPUs", justify="right")
    table.add_column("rel. throughput", justify="right")
    def show(r: ReplicaPlan, g: GroupPlan) -> str:
        text = f"{g.group_id}@{g.tp}" if g.tp < plan.tp else g.group_id
        if plan.moves is not None and (g.prev_replica, g.prev_stage) != (r.replica_id, g.stage):
            text += " (new)" if g.prev_replica is None else f" (from r{g.prev_replica}/s{g.prev_stage})"
        return text

    for r in plan.replicas:
        degraded = r.tp < plan.tp or r.relative_throughput < 1.0 or r.boosted
        style = "yellow" if degraded else None
        groups = ", ".join(show(r, g) for g in r.groups)
        table.add_row(
            str(r.replica_id), str(r.tp), str(r.local_batch), groups, str(len(r.boosted)),
            f"{r.relative_throughput:.3f}", style=style,
        )
    console.print(table)
    for s in plan.dropped:
        console.print(f"[red]dropped[/] {s.group_id}: {s.reason}", highlight=False)
    idle_spares = sum(1 for s in plan.idle if s.spare)
    console.print(
        f"[bold]{len(plan.replicas)} replicas[/], global batch {plan.global_batch}/{plan.target_batch} "
        f"→ relative throughput [bold]{plan.relative_throughput:.4f}[/]; "
        f"{len(plan.dropped)} dropped, {len(plan.idle)} idle ({idle_spares} spare) groups, "
        f"{len(plan.spares_used)} spares used, {len(plan.power_caps_w)} GPUs boosted",
        highlight=False,
    )
    if plan.moves is not None:
        console.print(plan.moves.describe(), highlight=False)


@app.command()
def plan(
    cluster: Annotated[Path, typer.Option("--cluster", "-c", help="cluster spec YAML")],
    job: Annotated[Path, typer.Option("--job", "-j", help="job spec YAML")],
    fail_gpu: Annotated[list[str] | None, typer.Option("--fail", help="mark this GPU UUID failed")] = None,
    fail_random: Annotated[int, typer.Option("--fail-random", min=0, help="fail N random GPUs")] = 0,
    seed: Annotated[int, typer.Option("--seed", help="seed for --fail-random")] = 0,
    previous: Annotated[
        Path | None, typer.Option("--previous", help="plan JSON of the layout running now: keep its groups in place")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON")] = False,
) -> None:
    """Plan a job on a cluster (optionally with injected failures) and print the plan.

    With --previous (the output of an earlier `plan --json`), groups stay in their replica and stage
    where the best packing allows, and the plan shows what moves."""
    try:
        c = apply_failures(load_cluster(cluster), fail_gpu or [], fail_random, seed)
        prev = None if previous is None else PreviousLayout.from_dict(_read_json(previous))
        p = make_plan(c, load_job(job), prev)
    except (SpecError, PlanError, TopologyError) as e:
        fail(str(e))
    if as_json:
        sys.stdout.write(json.dumps(plan_to_dict(p), indent=2) + "\n")
    else:
        render_plan(p, Console())


def _read_json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except OSError as e:
        raise SpecError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise SpecError(f"{path}: not a text file (not UTF-8)") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"{path}: malformed JSON at line {e.lineno}: {e.msg}") from None
    if not isinstance(doc, dict):
        raise SpecError(f"{path}: expected a plan JSON object")
    return doc


@cluster_app.command("generate")
def cluster_generate(
    domains: Annotated[int, typer.Option(min=1, help="number of scale-up domains")],
    domain_size: Annotated[int, typer.Option(min=1, help="GPUs per domain")],
    gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs per node")] = 4,
    name: Annotated[str, typer.Option(help="cluster name (seeds the GPU UUIDs)")] = "generated",
    tdp_w: Annotated[float, typer.Option(min=1.0, max=100_000.0, help="per-GPU TDP in watts")] = 1000.0,
    output: Annotated[Path | None, typer.Option("--output", "-o", help="write here, not stdout")] = None,
) -> None:
    """Write a cluster spec: DOMAINS domains of DOMAIN_SIZE GPUs, GPUS_PER_NODE per node."""
    if domain_size % gpus_per_node:
        fail(f"domain size {domain_size} is not a multiple of GPUs per node {gpus_per_node}")
    doc = {
        "cluster": {
            "name": name,
            "defaults": {"tdp_w": tdp_w},
            "generate": {"domains": domains, "domain_size": domain_size, "gpus_per_node": gpus_per_node},
        }
    }
    text = yaml.safe_dump(doc, sort_keys=False)
    if output is None:
        sys.stdout.write(text)
    else:
        try:
            output.write_text(text)
        except OSError as e:
            fail(f"{output}: cannot write ({e.strerror})")


db_app = typer.Typer(help="Database migrations.", no_args_is_help=True)
token_app = typer.Typer(help="API tokens (run against the manager's database).", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(token_app, name="token")


def _settings(**overrides: object) -> Settings:
    from pydantic import ValidationError

    try:
        given: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
        return Settings(**given)
    except ValidationError as e:
        first = e.errors()[0]
        fail(f"settings: {'.'.join(str(x) for x in first['loc'])}: {first['msg']}")
    except (ValueError, yaml.YAMLError) as e:  # NTP_CONFIG_FILE missing or not YAML; a malformed NTP_ value
        fail(f"settings: {' '.join(str(e).split())}")


def _run_db(coro_fn: Callable[[], Awaitable[Any]], settings: Settings) -> Any:
    import asyncio

    from alembic.util import CommandError
    from sqlalchemy.exc import SQLAlchemyError

    async def go() -> Any:
        if settings.effective_database_url.startswith("sqlite"):
            settings.data_dir.mkdir(parents=True, exist_ok=True)
        return await coro_fn()

    try:
        return asyncio.run(go())
    except (SQLAlchemyError, OSError) as e:
        fail(f"database {settings.effective_database_url!r}: {str(e).splitlines()[0]}")
    except CommandError as e:  # alembic: no such revision, and the like
        fail(f"migrations: {str(e).splitlines()[0]}")


DataDir = Annotated[Path | None, typer.Option("--data-dir", help="data directory (SQLite file lives here)")]
DbUrl = Annotated[str | None, typer.Option("--database-url", help="SQLAlchemy URL (default: SQLite in data dir)")]


@app.command()
def serve(
    data_dir: DataDir = None,
    database_url: DbUrl = None,
    http_host: Annotated[str | None, typer.Option(help="REST bind address")] = None,
    http_port: Annotated[int | None, typer.Option(help="REST port (0: any free)")] = None,
    grpc_host: Annotated[str | None, typer.Option(help="gRPC bind address")] = None,
    grpc_port: Annotated[int | None, typer.Option(help="gRPC port (0: any free)")] = None,
    grpc_tls_port: Annotated[int | None, typer.Option(help="gRPC TLS port (with --grpc-tls-cert; 0: any)")] = None,
    grpc_tls_cert: Annotated[Path | None, typer.Option(help="server certificate (PEM) for gRPC TLS")] = None,
    grpc_tls_key: Annotated[Path | None, typer.Option(help="its private key (PEM)")] = None,
    grpc_tls_client_ca: Annotated[Path | None, typer.Option(
        help="CA (PEM) that signs agents' client certificates: mTLS, required of agents")] = None,
    slurm_drain: Annotated[bool, typer.Option(
        "--slurm-drain", help="drain Slurm nodes whose GPUs need a person, resume them when fixed (docs/slurm.md)",
    )] = False,
    slurm_dry_run: Annotated[bool, typer.Option(
        "--slurm-dry-run", help="with --slurm-drain: only log and audit what would be done")] = False,
) -> None:
    """Run the manager: REST API, gRPC for agents and workers, and the control loop."""
    import asyncio

    from ntp_manager.server import loop_factory, run_service

    settings = _settings(data_dir=data_dir, database_url=database_url, http_host=http_host, http_port=http_port,
                         grpc_host=grpc_host, grpc_port=grpc_port, grpc_tls_port=grpc_tls_port,
                         grpc_tls_cert=grpc_tls_cert, grpc_tls_key=grpc_tls_key,
                         grpc_tls_client_ca=grpc_tls_client_ca, slurm_drain=slurm_drain or None,
                         slurm_dry_run=slurm_dry_run or None)
    from ntp_manager.service.leadership.leader import AnotherManager

    try:
        factory = loop_factory(settings)
    except RuntimeError as e:
        fail(str(e))
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            code = runner.run(run_service(settings))
    except OSError as e:
        fail(f"cannot start: {e}")
    except AnotherManager as e:
        fail(str(e))
    if code:
        raise typer.Exit(code)


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument(help="target revision")] = "head", data_dir: DataDir = None,
               database_url: DbUrl = None) -> None:
    """Apply migrations up to REVISION (default head)."""
    from ntp_manager.service.core import schema

    settings = _settings(data_dir=data_dir, database_url=database_url)
    at = _run_db(lambda: schema.migrate(settings.effective_database_url, revision), settings)
    print(f"database at revision {at}")


@db_app.command("downgrade")
def db_downgrade(revision: Annotated[str, typer.Argument(help="target revision (base: an empty schema)")] = "base",
                 data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """Revert migrations down to REVISION (default base: an empty schema)."""
    from ntp_manager.service.core import schema

    settings = _settings(data_dir=data_dir, database_url=database_url)
    at = _run_db(lambda: schema.migrate(settings.effective_database_url, revision, down=True), settings)
    print(f"database at revision {at}")


def _with_manager(settings: Settings, fn: Callable[[Any], Awaitable[Any]]) -> Any:
    from ntp_manager.service.core import schema
    from ntp_manager.service.core.errors import ServiceError
    from ntp_manager.service.manager import Manager

    async def go() -> Any:
        await schema.migrate(settings.effective_database_url)
        m = Manager(settings)
        try:
            return await fn(m)
        finally:
            await m.engine.dispose()

    try:
        return _run_db(go, settings)
    except ServiceError as e:
        fail(e.message)


@token_app.command("create")
def token_create(
    scope: Annotated[str, typer.Option(help="viewer | operator | admin | agent | worker")],
    name: Annotated[str | None, typer.Option(help="who or what holds it (default: cli, or the node)")] = None,
    node: Annotated[str | None, typer.Option(help="agent tokens: the one node it may speak for (required)")] = None,
    fingerprint: Annotated[str | None, typer.Option(
        help="agent tokens: SHA-256 of the client certificate the node must present (mTLS)")] = None,
    nodes_from: Annotated[Path | None, typer.Option(
        help="agent tokens for a fleet: one node name per line ('-': stdin); prints one JSON line per node")] = None,
    data_dir: DataDir = None,
    database_url: DbUrl = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Create a token and print it once (only its hash is stored). A running manager sees it
    within a second (NTP_TOKEN_POLL_S)."""
    settings = _settings(data_dir=data_dir, database_url=database_url)
    if nodes_from is not None:
        if scope != "agent" or node or fingerprint:
            fail("--nodes-from makes agent tokens (--scope agent), one per listed node, without --node")
        try:
            text = sys.stdin.read() if str(nodes_from) == "-" else nodes_from.read_text()
        except OSError as e:
            fail(f"{nodes_from}: cannot read ({e.strerror})")
        except UnicodeDecodeError:
            fail(f"{nodes_from}: not a text file (not UTF-8)")
        nodes = [line.strip() for line in text.splitlines() if line.strip()]
        made = _with_manager(settings, lambda m: m.token_service.create_agents(nodes, "cli"))
        for n, tok in made.items():
            print(json.dumps({"node": n, "token": tok, "scope": "agent"}))
        return
    label = name or (f"agent-{node}" if node else "cli")
    token = _with_manager(settings, lambda m: m.create_token(label, scope, node=node, fingerprint=fingerprint))
    if as_json:
        print(json.dumps({"token": token, "scope": scope, "name": label, "node": node}))
    else:
        print(token)


@token_app.command("list")
def token_list(data_dir: DataDir = None, database_url: DbUrl = None) -> None:
    """List tokens (ids, names, scopes; never the secrets)."""
    settings = _settings(data_dir=data_dir, database_url=database_url)
    rows = _with_manager(settings, lambda m: m.list_tokens())
    print(json.dumps(rows, indent=2))


@token_app.command("revoke")
def token_revoke(
    token_ids: Annotated[list[str], typer.Argument(help="token ids (the 8 characters after `ntp_`)")],
    data_dir: DataDir = None, database_url: DbUrl = None,
) -> None:
    """Revoke tokens by id. A running manager stops accepting them, and ends the streams opened
    with them, within a second (NTP_TOKEN_POLL_S)."""
    settings = _settings(data_dir=data_dir, database_url=database_url)

    async def go(m: Any) -> None:
        for tid in token_ids:
            await m.revoke_token(tid)

    _with_manager(settings, go)
    for tid in token_ids:
        print(f"revoked {tid}")


app.command("simulate")(simulate)


def main(argv: Sequence[str] | None = None) -> int:
    """The `ntp-manager` console script: the exit status (usage errors are one line, ntp_manager/contract/usage.py)."""
    return run_app(app, argv, "ntp-manager")


if __name__ == "__main__":
    sys.exit(main())
