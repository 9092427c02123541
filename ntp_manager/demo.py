"""`make demo`: the whole system on one machine.

A real manager process (SQLite), real agents on the fake GPU backend for three nodes (two NVLink
domains of 4 GPUs for the job, plus a spare node), and a CPU training job of 2 DP replicas, each a
pipeline of 2 stages, each stage a TP2 group (a domain holds one replica: its stage 0 on GPUs 0-1,
its stage 1 on GPUs 2-3), one process per GPU, using the worker runtime over the manager's gRPC
watch stream. The job runs ntp-pw with at most 1.1x power, too little to restore a reduced group's
speed. Then:

1. a GPU of replica 0's stage 1 fails (XID 48 injected into the fake backend; the process driving it
   dies, as it would); the agent reports, the manager replans: that stage runs at TP1, the
   replica's stage 0 stays at TP2 (its local batch shrinks), the layout is pushed, the survivors
   reshard that stage live and keep training;
2. a GPU of replica 1's stage 1 fails: the planner packs the two full groups into one replica and
   the two reduced ones into the other, so one group of each kind changes stage; their ranks fetch
   the other stage's layers and optimizer state from DP peers, without restarting;
3. both GPUs are repaired, the agents report them healthy, fresh processes start on them, the
   manager replans back to TP2 everywhere and the new ranks join by copying their stage from peers.

It prints the timeline with durations and the loss curve beside a single-process reference on the
same global batches, then leaves the dashboard up until Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import typer
from rich.console import Console
from rich.table import Table

from agent.local import FakeFleet, FakeNode

if TYPE_CHECKING:
    from ntp_manager.worker.launch import Launcher

console = Console()
JOB = "demo"
HITS = (("node-a", 3), ("node-b", 3))  # stage 1 of replica 0, then stage 1 of replica 1


@dataclass
class DemoResult:
    versions: list[int] = field(default_factory=list)
    tp_by_version: dict[int, list[int]] = field(default_factory=dict)
    stages_by_version: dict[int, list[list[int]]] = field(default_factory=dict)  # per replica, each stage's TP
    stage_changes: dict[int, int] = field(default_factory=dict)  # version -> groups that changed stage
    losses: list[tuple[int, int, float, float]] = field(default_factory=list)  # step, version, loss, reference
    timeline: list[tuple[str, float]] = field(default_factory=list)  # what, seconds since the failure
    stall_s: float = 0.0  # the first failure
    stall2_s: float = 0.0  # the second one (a packing that moves groups across stages)
    split: dict[str, float] = field(default_factory=dict)
    dashboard: str = ""


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


@contextlib.contextmanager
def manager_process(data: Path) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    with (data / "manager.log").open("w") as err:  # the child has its own descriptor of it
        proc = subprocess.Popen(
            [sys.executable, "-m", "ntp_manager.cli", "serve", "--data-dir", str(data), "--http-port", "0",
             "--grpc-port", "0"],
            stdout=subprocess.PIPE, stderr=err, text=True, env=dict(os.environ, NTP_HEARTBEAT_INTERVAL_S="2"),
        )
    assert proc.stdout is not None
    try:
        info = None
        for line in proc.stdout:
            if line.startswith("NTP-MANAGER READY"):
                info = json.loads(line.split(" ", 2)[2])
                break
        if info is None:
            raise RuntimeError(f"the manager did not start; see {data / 'manager.log'}")
        yield proc, info
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        proc.stdout.close()


NODES = (FakeNode("node-a", "nvl-0"), FakeNode("node-b", "nvl-1"), FakeNode("node-spare", "nvl-2"))


def create_token(data: Path, scope: str, node: str | None = None) -> str:
    """One token; agent tokens speak for one node each."""
    cmd = [sys.executable, "-m", "ntp_manager.cli", "token", "create", "--name", f"demo-{node or scope}", "--scope",
           scope, "--json", "--data-dir", str(data)] + (["--node", node] if node else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return str(json.loads(out.stdout)["token"])


def wait(pred: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


def first_layout(api: httpx.Client, job: str, timeout: float = 30) -> int:
    """Waits until the manager has made job `job`'s first layout; returns its version."""
    return int(wait(lambda: api.get(f"/v1/jobs/{job}").json()["layout_version"], timeout, "the first layout"))


def layout_of(api: httpx.Client, job: str, version: int) -> dict[str, Any]:
    """Layout `version` of job `job` from its history (one of the newest ten)."""
    items = api.get(f"/v1/jobs/{job}/layouts", params={"limit": 10}).json()["items"]
    return dict(next(x for x in items if x["version"] == version))


def start_ranks(launcher: Launcher, gpus: Sequence[str], grpc: str, worker_token: str) -> None:
    """One rank process per GPU, named by its GPU's UUID, watching its layout at `grpc` (one or
    more manager addresses, comma-separated)."""
    from ntp_manager.worker.launch import RankSpec

    for u in gpus:
        launcher.start(RankSpec(u, launcher.port, "grpc", grpc, worker_token, u))


def serve_until_interrupted() -> None:
    """Keeps everything up until Ctrl-C."""
    console.print("Ctrl-C stops everything.")
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            time.sleep(1)


@dataclass
class DemoEnv:
    """What a demo runs on: a manager process on its own data directory, a token per scope, an
    operator's REST client and the fake-backend agents. A launcher the demo sets here is stopped
    first when the demo ends."""

    root: Path
    info: dict[str, Any]  # the manager's READY line: its REST and gRPC addresses
    tokens: dict[str, str]  # worker, operator, viewer
    api: httpx.Client
    agents: FakeFleet
    launcher: Launcher | None = None

    @property
    def http(self) -> str:
        return f"http://{self.info['http']}"

    def results(self, launcher: Launcher, job: str) -> tuple[list[tuple[int, int, float, float]], list[dict[str, Any]]]:
        """Every step's loss beside the single-process reference (step, version, loss, reference),
        printed as a table, and the job's layout history (the newest 100 versions)."""
        launcher.drain()
        rows, table = launcher.loss_report()
        console.print(table)
        hist = self.api.get(f"/v1/jobs/{job}/layouts", params={"limit": 100}).json()["items"]
        return [(st, v, loss, ref) for st, v, _, loss, ref in rows], list(hist)

    def show_access(self, ntpctl: str, keep_up: bool) -> str:
        """Prints where the dashboard is and an `ntpctl` command line to try, then serves until
        Ctrl-C when `keep_up`; returns the dashboard's address."""
        dashboard = f"{self.http}/?token={self.tokens['viewer']}"
        console.rule()
        console.print(f"dashboard: [bold]{dashboard}[/]")
        console.print(f"ntpctl:    NTP_URL={self.http} NTP_TOKEN={self.tokens['operator']} {ntpctl}")
        if keep_up:
            serve_until_interrupted()
        return dashboard


@contextlib.contextmanager
def demo_env(data: Path | None, prefix: str, title: str, nodes: Sequence[FakeNode], agents_what: str
             ) -> Iterator[DemoEnv]:
    """Sets a demo up: its data directory (`data`, else a temporary one named `prefix`...), the
    tokens, the manager process and the agents of `nodes` (waited for, as `agents_what`); tears it
    all down in reverse order when the demo ends, removing a temporary directory on a clean end."""
    tmp = tempfile.TemporaryDirectory(prefix=prefix) if data is None else None
    root = Path(tmp.name) if tmp else data
    assert root is not None
    root.mkdir(parents=True, exist_ok=True)
    console.rule(title)
    tokens = {s: create_token(root, s) for s in ("worker", "operator", "viewer")}
    agent_tokens = {n.name: create_token(root, "agent", n.name) for n in nodes}
    env: DemoEnv | None = None
    agents: FakeFleet | None = None
    with manager_process(root) as (_proc, info):
        http = f"http://{info['http']}"
        api = httpx.Client(base_url=http, headers={"Authorization": f"Bearer {tokens['operator']}"}, timeout=20)
        console.print(f"manager up: REST {http}, gRPC {info['grpc']} (data in {root})")
        try:
            agents = FakeFleet(info["grpc"], agent_tokens, nodes)
            wait(agents.ready, 30, agents_what)
            env = DemoEnv(root, info, tokens, api, agents)
            yield env
        finally:
            if env is not None and env.launcher is not None:
                env.launcher.stop()
            if agents is not None:
                agents.stop()
            api.close()
    if tmp is not None:
        tmp.cleanup()
    console.print("stopped cleanly")


def run_demo(steps_before: int = 6, steps_degraded: int = 6, steps_after: int = 6, data: Path | None = None,
             keep_up: bool = True, step_delay_s: float = 0.0) -> DemoResult:
    from ntp_manager.worker.launch import Launcher, RankSpec, TrainSpec

    res = DemoResult()
    # the ranks train until the demo tells them where to stop (after the repair has been applied)
    train = TrainSpec(job=JOB, steps=1_000_000, step_delay_s=step_delay_s, collective_timeout_s=10, stages=2)
    with demo_env(data, "ntp-demo-", "[bold]ntp-manager demo", NODES, "the agents to register") as env:
        api, agents, info, tokens = env.api, env.agents, env.info, env.tokens
        console.print("agents: node-a (nvl-0), node-b (nvl-1), node-spare (nvl-2), 4 fake GPUs each")
        job = {"name": JOB, "tp": 2, "groups_per_replica": 2, "replicas": 2, "local_batch": 16, "min_tp": 1,
               "heads": 6, "mlp_columns": 96, "scheme": "ntp-pw", "power": {"max_boost": 1.1},
               "domains": ["nvl-0", "nvl-1"]}
        r = api.post("/v1/jobs", json=job)
        r.raise_for_status()
        first_layout(api, JOB)
        env.launcher = launcher = Launcher(train)
        start_ranks(launcher, agents.gpus("node-a") + agents.gpus("node-b"), info["grpc"], tokens["worker"])
        console.print(f"training: 8 rank processes (2 replicas x 2 stages x TP2), TinyGpt, store on port "
                      f"{launcher.port}")

        def step_at_least(n: int, version: int | None = None) -> Any:
            return lambda rec: rec["kind"] == "step" and rec["step"] >= n and (
                version is None or rec["version"] == version)

        launcher.wait_for(step_at_least(steps_before - 1), 300)
        old = api.get(f"/v1/jobs/{JOB}").json()["layout_version"]
        victims = []
        for k, (node, idx) in enumerate(HITS):  # ---- the failures -----------------------------
            victim = agents.gpus(node)[idx]
            victims.append(victim)
            label = "failure" if k == 0 else "second failure"
            console.rule(f"[red]GPU {node}/{idx} fails (XID 48)")
            t_fail = time.time()
            agents.inject(node, "xid", idx, xid=48)
            launcher.kill(victim)  # the process on a dead GPU dies with it
            rec = launcher.wait_for(lambda rec, old=old: rec["kind"] == "step" and rec["version"] > old, 300)
            new = rec["version"]
            launcher.wait_for(step_at_least(rec["step"] + steps_degraded - 1, new), 300)
            _timeline(res, api, launcher, victim, t_fail, old, new, label)
            _layout_now(api, new)
            old = new
        # ---- the repair ------------------------------------------------------------------------
        console.rule("[green]both GPUs repaired")
        t_rep = time.time()
        for (node, idx), victim in zip(HITS, victims, strict=True):
            launcher.start(RankSpec(victim, launcher.port, "grpc", info["grpc"], tokens["worker"], victim))
            agents.inject(node, "repair", idx)
        back: set[str] = set()

        def both_back(rec: dict[str, Any]) -> bool:
            if rec["kind"] == "step" and rec["worker"] in victims:
                back.add(rec["worker"])
            return len(back) == len(victims)

        rec = launcher.wait_for(both_back, 300)
        launcher.stop_at(rec["step"] + steps_after)
        _timeline(res, api, launcher, victims[0], t_rep, old, rec["version"], "repair")
        done: set[str] = set()

        def all_done(rec: dict[str, Any]) -> bool:
            if rec["kind"] == "done":
                done.add(rec["worker"])
            return len(done) == 8

        launcher.wait_for(all_done, 600)
        time.sleep(0.3)
        res.losses, hist = env.results(launcher, JOB)
        res.versions = sorted(x["version"] for x in hist)
        res.tp_by_version = {x["version"]: sorted(r["tp"] for r in x["replicas"]) for x in hist}
        res.stages_by_version = {x["version"]: _stage_tps(x) for x in hist}
        res.stage_changes = {x["version"]: (x.get("moves") or {}).get("stage_changed", 0) for x in hist}
        _layouts_table(hist)
        res.dashboard = env.show_access("ntpctl status", keep_up)
    return res


def _timeline(res: DemoResult, api: httpx.Client, launcher: Any, victim: str, t0: float, old: int, new: int,
              label: str) -> None:
    ev = api.get("/v1/events", params={"gpu": victim, "limit": 5}).json()["items"]
    report = min((_ts(e["at"]) for e in ev if e["source"] == "agent" and _ts(e["at"]) >= t0 - 1), default=None)
    lay = layout_of(api, JOB, new)
    acks = api.get(f"/v1/jobs/{JOB}").json()["acks"].get(str(new), {})
    evs = [r for r in launcher.records if r["kind"] == "event" and r["at"] >= t0]

    def first(what: str, version: int | None = None) -> float | None:
        ts = [r["at"] for r in evs if r["what"] == what and (version is None or r["version"] == version)]
        return min(ts) if ts else None

    def last(what: str, version: int) -> float | None:
        ts = [r["at"] for r in evs if r["what"] == what and r["version"] == version]
        return max(ts) if ts else None

    rows = [
        (f"{label} injected", t0),
        ("agent report received by the manager", report),
        (f"plan made (layout v{new}: {lay['reason'][:50]})", _ts(lay["created_at"])),
        ("collective failed on a survivor", first("failure detected")),
        ("layout pushed (first worker has it)", first("layout received", new)),
        ("process group rebuilt (last rank)", last("regrouped", new)),
        ("reshard done (last rank)", last("reshard done", new)),
        (f"acks at the manager ({acks.get('ok', 0)})", _ts(acks["last_at"]) if acks.get("last_at") else None),
        ("first step at the new layout (last rank)", last("first step", new)),
    ]
    t = Table(title=f"timeline: {label} (v{old} -> v{new})")
    for c in ("event", "t (s)", "since previous (s)"):
        t.add_column(c)
    prev = t0
    for what, at in rows:
        if at is None:
            continue
        t.add_row(what, f"{at - t0:.2f}", f"{max(0.0, at - prev):.2f}")
        prev = max(prev, at)
        res.timeline.append((what, at - t0))
    console.print(t)
    first_step = last("first step", new)
    if label == "second failure" and first_step is not None:
        res.stall2_s = first_step - t0
    if label == "failure" and first_step is not None:
        res.stall_s = first_step - t0
        res.split = {
            "detection": (report or t0) - t0,
            "plan": _ts(lay["created_at"]) - (report or t0),
            "push + regroup": (last("regrouped", new) or t0) - _ts(lay["created_at"]),
            "reshard": (last("reshard done", new) or t0) - (last("regrouped", new) or t0),
            "first step": first_step - (last("reshard done", new) or t0),
        }


def _stage_tps(lay: dict[str, Any]) -> list[list[int]]:
    """Per replica (by id), the TP degree of each stage."""
    return [list(r["stage_tp"]) for r in sorted(lay["replicas"], key=lambda r: r["id"])]


def _replicas_text(lay: dict[str, Any]) -> str:
    out = []
    for r in sorted(lay["replicas"], key=lambda r: r["id"]):
        stages = " -> ".join(f"s{s} TP{tp}" for s, tp in enumerate(r["stage_tp"]))
        out.append(f"r{r['id']}: {stages} (b{r['local_batch']})")
    return "   ".join(out)


def _layout_now(api: httpx.Client, version: int) -> None:
    """The replicas as stages x TP groups, and which groups moved (replica or stage)."""
    lay = layout_of(api, JOB, version)
    console.print(f"layout v{version}: {_replicas_text(lay)}")
    for r in lay["replicas"]:
        for g in r["moved"]:
            console.print(f"  group {g['group']}: replica {g['from_replica']} stage {g['from_stage']} -> "
                          f"replica {r['id']} stage {g['stage']}"
                          + ("  [bold](changes stage: fetches its layers from DP peers)[/]"
                             if g["from_stage"] != g["stage"] else ""))


def _layouts_table(hist: list[dict[str, Any]]) -> None:
    t = Table(title="layout versions (replica: stages x TP, local batch)")
    for c in ("version", "replicas", "groups changing stage", "reason"):
        t.add_column(c)
    for x in sorted(hist, key=lambda x: x["version"]):
        t.add_row(str(x["version"]), _replicas_text(x), str((x.get("moves") or {}).get("stage_changed", "")),
                  x["reason"][:60])
    console.print(t)


def main(
    no_wait: bool = typer.Option(False, "--no-wait", help="exit after the scenario instead of serving until Ctrl-C"),
    step_delay: float = typer.Option(0.3, help="pause between steps, so the dashboard can be watched"),
) -> None:
    """The failure demo (`make demo`); the fail-slow one is `make slow-demo` (ntp_manager/demo_slow.py)."""
    res = run_demo(keep_up=not no_wait, step_delay_s=step_delay)
    worst = max((abs(a - b) / abs(b) for _, _, a, b in res.losses), default=0.0)
    console.print(f"failure to first step: {res.stall_s:.2f} s (one stage reduced), {res.stall2_s:.2f} s (groups "
                  f"changing stage); worst loss difference vs reference {worst:.1e}")


if __name__ == "__main__":
    typer.run(main)
