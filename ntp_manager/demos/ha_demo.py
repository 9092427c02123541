"""`make ha-demo`: two managers on PostgreSQL, the leader killed while the demo job trains.

Everything runs on this machine (no Docker needed; docker-compose.yml has the same with
containers): a fresh database on the PostgreSQL server named by NTP_HA_DEMO_POSTGRES (default
postgresql+asyncpg://postgres@127.0.0.1:5432/postgres), two `ntp-manager serve` processes (a
3-second lease), three agents on the fake GPU backend and the demo's CPU training job (2 replicas
x 2 stages x TP2, one process per GPU); agents and ranks are given both managers' addresses.

1. the job trains under manager `a` (the leader; `b` stands by and sends clients to `a`);
2. `a` is SIGKILLed: training goes on with the layout in hand; `b` takes the lease over when it
   expires, loads the state, and the agents and the ranks' layout watches move to it;
3. a GPU fails (XID 48): `b` replans and pushes a layout at its epoch, and the ranks reshard live;
4. `a` is started again and stands by.

It prints the timeline, then leaves both dashboards up (the standby's redirects to the leader)
until Ctrl-C; the database is dropped at the end. The logs go to files in a temporary directory
(said at the start; `--verbose`: the agents' and ranks' logs on the console): `managers.log`,
`agent-<node>.log`, `rank-<node>-gpu<i>.log`. Ctrl-C or SIGTERM stop everything it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import tempfile
import time
from pathlib import Path

import httpx
import typer
from rich.console import Console

from ntp_agent.local import FakeFleet
from ntp_manager.demos.demo import (
    JOB,
    NODES,
    demo_logs,
    serve_until_interrupted,
    start_ranks,
    stop_on_signals,
    table,
    wait,
)
from ntp_manager.manager_process import LEADING, ManagerProcess

console = Console(soft_wrap=True)  # lines never broken (URLs, tokens), tables wrap their cells
LEASE = {"NTP_LEASE_TTL_S": "3", "NTP_LEASE_RENEW_S": "0.5", "NTP_TAKEOVER_GRACE_S": "15",
         "NTP_HEARTBEAT_INTERVAL_S": "1"}


def _manager(name: str, url: str, log: Path) -> ManagerProcess:
    p = ManagerProcess(name, url, log, LEASE)
    p.ready()
    return p


async def _database(admin: str) -> tuple[str, dict[str, str]]:
    """A fresh database beside `admin`, migrated, with the demo's tokens."""
    from ntp_manager.service.manager import Manager
    from ntp_manager.settings import Settings
    from ntp_manager.store import db

    name = f"ntp_ha_demo_{secrets.token_hex(4)}"
    await _admin(admin, f'CREATE DATABASE "{name}"')
    url = f"{admin.rsplit('/', 1)[0]}/{name}"
    m = Manager(Settings(database_url=url))
    try:
        await db.upgrade(m.engine)
        tokens = {s: await m.create_token(f"demo-{s}", s) for s in ("worker", "operator", "viewer")}
        tokens.update(await m.token_service.create_agents([n.name for n in NODES], "demo"))
    finally:
        await m.engine.dispose()
    return url, tokens


async def _admin(admin: str, sql: str) -> None:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(admin, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            await conn.execute(text(sql))
    finally:
        await engine.dispose()


async def _drop(admin: str, url: str) -> None:
    await _admin(admin, f'DROP DATABASE IF EXISTS "{url.rsplit("/", 1)[1]}" WITH (FORCE)')


def run(admin: str, keep_up: bool, steps: int, verbose: bool = False) -> dict[str, float]:
    log_dir = Path(tempfile.mkdtemp(prefix="ntp-ha-demo-"))
    with demo_logs(None if verbose else log_dir):  # this process's log (the agents', the set-up's)
        try:
            url, tokens = asyncio.run(_database(admin))
        except (OSError, Exception) as e:  # no server, no permission: say so in one line
            console.print(f"[red]error:[/] cannot make a database on {admin} ({type(e).__name__}: {e}); "
                          "set NTP_HA_DEMO_POSTGRES to an admin URL of a PostgreSQL server")
            raise typer.Exit(2) from None
        return _run(admin, url, tokens, log_dir, keep_up, steps, verbose)


def _run(admin: str, url: str, tokens: dict[str, str], log_dir: Path, keep_up: bool, steps: int,
         verbose: bool) -> dict[str, float]:
    from ntp_manager.worker.launch import Launcher, TrainSpec

    procs: list[ManagerProcess] = []
    times: dict[str, float] = {}
    launcher: Launcher | None = None
    agents: FakeFleet | None = None
    console.rule("[bold]ntp-manager: two managers, one leads")
    console.print(f"logs in {log_dir}/: managers.log"
                  + (" (the agents' and ranks' on the console: --verbose)" if verbose
                     else ", agent-<node>.log, rank-<node>-gpu<i>.log (--verbose prints those here)"))
    try:
        a = _manager("a", url, log_dir / "managers.log")
        procs.append(a)
        b = _manager("b", url, log_dir / "managers.log")
        procs.append(b)
        grpcs = f"{a.info['grpc']},{b.info['grpc']}"
        for p in (a, b):
            console.print(f"manager {p.name}: {p.info['role']:8} REST http://{p.info['http']}  gRPC {p.info['grpc']}"
                          f"  dashboard http://{p.info['http']}/?token={tokens['viewer']}")
        api = httpx.Client(base_url=f"http://{a.info['http']}",
                           headers={"Authorization": f"Bearer {tokens['operator']}"}, timeout=20)
        agents = FakeFleet(grpcs, tokens, NODES)
        wait(agents.ready, 60, "the agents to register")
        job = {"name": JOB, "tp": 2, "groups_per_replica": 2, "replicas": 2, "local_batch": 16, "min_tp": 1,
               "heads": 6, "mlp_columns": 96, "domains": ["nvl-0", "nvl-1"]}
        api.post("/v1/jobs", json=job).raise_for_status()
        wait(lambda: api.get(f"/v1/jobs/{JOB}").json()["layout_version"], 60, "the first layout")
        launcher = Launcher(TrainSpec(job=JOB, steps=1_000_000, step_delay_s=0.2, collective_timeout_s=10, stages=2),
                            log_dir=None if verbose else log_dir)
        gpus = agents.gpus("node-a") + agents.gpus("node-b")
        labels = {u: f"{n.name}/{i}" for n in NODES[:2] for i, u in enumerate(agents.gpus(n.name))}
        start_ranks(launcher, gpus, grpcs, tokens["worker"], labels)
        console.print("training: 8 rank processes (2 replicas x 2 stages x TP2), layouts watched on both managers")
        rec = launcher.wait_for(lambda r: r["kind"] == "step" and r["step"] >= steps, 600)
        # ---- the leader dies ----------------------------------------------------------------------
        console.rule("[red]SIGKILL the leader (manager a)")
        t0 = time.time()
        step_at_kill = rec["step"]
        a.proc.kill()
        during = launcher.wait_for(lambda r: r["kind"] == "step" and r["step"] > step_at_kill, 120)
        times[f"no leader, training goes on (step {during['step']} done)"] = time.time() - t0
        took = b.wait_line(LEADING, 120)
        times["b leads (lease expired, state loaded)"] = time.time() - t0
        api.close()
        api = httpx.Client(base_url=f"http://{b.info['http']}",
                           headers={"Authorization": f"Bearer {tokens['operator']}"}, timeout=20)
        wait(lambda: api.get("/v1/status").json()["nodes_connected"] == len(NODES), 60, "the agents to move to b")
        times["every agent reconnected to b"] = time.time() - t0
        old = api.get(f"/v1/jobs/{JOB}").json()["layout_version"]
        # ---- then a GPU fails: the new leader acts on it ------------------------------------------
        console.rule("[red]GPU node-a/3 fails (XID 48)")
        victim = agents.gpus("node-a")[3]
        t1 = time.time()
        agents.inject("node-a", "xid", 3, xid=48)
        launcher.kill(victim)
        rec = launcher.wait_for(lambda r, old=old: r["kind"] == "step" and r["version"] > old, 300)
        times["failure -> ranks train on b's new layout"] = time.time() - t1
        lay = api.get(f"/v1/jobs/{JOB}/layout").json()
        console.print(f"layout v{lay['version']} at epoch {lay['leader_epoch']} (b's: {took['epoch']}); training at "
                      f"step {rec['step']}")
        a2 = _manager("a", url, log_dir / "managers.log")  # back, as a standby
        procs.append(a2)
        t = table("failover timeline (seconds since the kill / the failure)", ("what", "s"), right=("s",))
        for k, v in times.items():
            t.add_row(k, f"{v:.2f}")
        console.print(t)
        console.print(f"manager a restarted: {a2.info['role']}; status on b: {api.get('/v1/status').json()['breaker']}")
        console.print(f"dashboard (leader b): http://{b.info['http']}/?token={tokens['viewer']}")
        console.print(f"ntpctl:  NTP_URL=http://{a2.info['http']},http://{b.info['http']} "
                      f"NTP_TOKEN={tokens['operator']} ntpctl status")
        console.print(f"logs: {log_dir}")
        api.close()
        if keep_up:
            serve_until_interrupted()
    finally:
        if launcher is not None:
            launcher.stop()
        if agents is not None:
            agents.stop()
        for p in procs:
            p.stop()
        with contextlib.suppress(Exception):
            asyncio.run(_drop(admin, url))
    return times


def main(
    no_wait: bool = typer.Option(False, "--no-wait", help="exit after the scenario instead of serving until Ctrl-C"),
    steps: int = typer.Option(8, help="steps trained before the leader is killed"),
    verbose: bool = typer.Option(False, "--verbose", help="the agents' and ranks' logs on the console, not files"),
) -> None:
    admin = os.environ.get("NTP_HA_DEMO_POSTGRES", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres")
    with stop_on_signals():
        run(admin, not no_wait, steps, verbose)


if __name__ == "__main__":
    typer.run(main)
