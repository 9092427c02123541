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

The console carries the story only: the steps, the timelines, the layouts, the loss table and where
to look. Every process's log goes to a file of its own under `<data>/logs/` (said at the start):
`manager.log`, `agent-<node>.log` (the agents run in this process), `rank-<node>-<gpu>.log` (a rank
process's whole output); `--verbose` prints them on the console instead. Output that is not a
terminal (a CI log, `| tee`) keeps lines whole and wraps table cells rather than cutting them.
Ctrl-C, SIGTERM or SIGHUP stop every process the demo started, in order, and release what it
held (`stop_on_signals`); the data directory is kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import httpx
import structlog
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ntp_agent.local import FakeFleet, FakeNode
from ntp_manager.contract.logs import RoutedFiles, configure_logging

if TYPE_CHECKING:
    from ntp_manager.worker.launch import Launcher

# Lines are never broken (a URL or a token stays whole when the output is a file or a pipe);
# tables fit the width (80 columns when it is not a terminal) by wrapping their cells.
console = Console(soft_wrap=True)
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
    timelines: dict[str, list[tuple[str, float]]] = field(default_factory=dict)  # by label: failure, ..., repair
    reasons: dict[int, str] = field(default_factory=dict)  # version -> the layout's reason
    dashboard: str = ""
    logs: Path | None = None  # where the logs went (None: the console)


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def table(title: str, columns: Sequence[str], right: Sequence[str] = (), lines: bool = False) -> Table:
    """A rich table whose cells wrap (a word longer than its column folds) instead of being cut;
    `lines`: a rule between rows, so a row that wraps still reads as one."""
    t = Table(title=title, show_lines=lines)
    for c in columns:
        t.add_column(c, overflow="fold", justify="right" if c in right else "left")
    return t


@contextlib.contextmanager
def manager_process(data: Path, log: Path | None) -> Iterator[tuple[subprocess.Popen[str], dict[str, Any]]]:
    """`ntp-manager serve` on `data`, its log to the file `log` (None: this process's stderr). It
    runs in a session of its own: a Ctrl-C at the terminal reaches the demo, which stops the
    manager after the agents and ranks that talk to it."""
    with contextlib.ExitStack() as files:
        err = files.enter_context(log.open("a")) if log is not None else None  # the child has its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "ntp_manager.cli", "serve", "--data-dir", str(data), "--http-port", "0",
             "--grpc-port", "0"],
            stdout=subprocess.PIPE, stderr=err, text=True, env=dict(os.environ, NTP_HEARTBEAT_INTERVAL_S="2"),
            start_new_session=True,
        )
    assert proc.stdout is not None
    try:
        info = None
        for line in proc.stdout:
            if line.startswith("NTP-MANAGER READY"):
                info = json.loads(line.split(" ", 2)[2])
                break
        if info is None:
            raise RuntimeError(f"the manager did not start; see {log or 'its output above'}")
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


def start_ranks(launcher: Launcher, gpus: Sequence[str], grpc: str, worker_token: str,
                labels: Mapping[str, str] | None = None) -> None:
    """One rank process per GPU, named by its GPU's UUID, watching its layout at `grpc` (one or
    more manager addresses, comma-separated); `labels` name them in logs (node/index)."""
    for u in gpus:
        start_rank(launcher, u, grpc, worker_token, labels)


def start_rank(launcher: Launcher, gpu: str, grpc: str, worker_token: str,
               labels: Mapping[str, str] | None = None) -> None:
    from ntp_manager.worker.launch import RankSpec

    label = (labels or {}).get(gpu, "")
    launcher.start(RankSpec(gpu, launcher.port, "grpc", grpc, worker_token, gpu, label=label.replace("/", "-gpu")))


class Stopped(BaseException):
    """A signal asked the demo to stop (Ctrl-C, SIGTERM, SIGHUP): raised in the main thread, so the
    demo's `finally` blocks stop what it started. A BaseException, like KeyboardInterrupt: no
    `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """For a demo's entry point: SIGINT, SIGTERM and SIGHUP raise `Stopped` once; while the demo
    stops its processes, further ones are ignored (a second Ctrl-C would cut the clean-up short
    and leave processes and semaphores behind). Ends the program quietly with 128 + the signal's
    number. Main thread only."""
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        for s in sigs:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    old = {s: signal.signal(s, on_signal) for s in sigs}
    try:
        yield
    except (Stopped, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        console.print(f"stopped ({signal.Signals(signum).name}): every process the demo started has ended")
        raise SystemExit(128 + signum) from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def serve_until_interrupted() -> None:
    """Keeps everything up until Ctrl-C (or SIGTERM, with `stop_on_signals`)."""
    console.print("Ctrl-C stops everything.")
    with contextlib.suppress(KeyboardInterrupt, Stopped):
        while True:
            time.sleep(1)


@contextlib.contextmanager
def demo_logs(logs: Path | None) -> Iterator[None]:
    """The demo process's own log lines (its agents'): each node's to `<logs>/agent-<node>.log`,
    anything else to `<logs>/demo.log`; None: to stderr (`--verbose`). The caller's structlog
    and logging configuration is restored at the end (tests run demos in their own process)."""
    saved, root = structlog.get_config(), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    files = None
    try:
        if logs is None:
            configure_logging("console")
        else:
            files = RoutedFiles(logs, key="node", prefix="agent-", default="demo.log")
            files.install()
        yield
    finally:
        if files is not None:
            files.close()
        structlog.configure(**saved)
        root.handlers[:], root.level = handlers, level


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
    logs: Path | None  # where the logs go (None: the console, --verbose)
    labels: dict[str, str]  # GPU UUID -> "node/index"
    launcher: Launcher | None = None

    @property
    def http(self) -> str:
        return f"http://{self.info['http']}"

    def new_launcher(self, train: Any) -> Launcher:
        """A launcher for this demo's ranks (their output to `logs`), stopped when the demo ends."""
        from ntp_manager.worker.launch import Launcher

        self.launcher = Launcher(train, log_dir=self.logs)
        return self.launcher

    def results(self, launcher: Launcher, job: str) -> tuple[list[tuple[int, int, float, float]], list[dict[str, Any]]]:
        """Every step's loss beside the single-process reference (step, version, loss, reference),
        printed as a table, and the job's layout history (the newest 100 versions)."""
        launcher.drain()
        rows, loss_table = launcher.loss_report()
        console.print(loss_table)
        hist = self.api.get(f"/v1/jobs/{job}/layouts", params={"limit": 100}).json()["items"]
        return [(st, v, loss, ref) for st, v, _, loss, ref in rows], list(hist)

    def show_access(self, ntpctl: str, keep_up: bool) -> str:
        """Prints where the dashboard is and an `ntpctl` command line to try, then serves until
        Ctrl-C when `keep_up`; returns the dashboard's address."""
        dashboard = f"{self.http}/?token={self.tokens['viewer']}"
        console.rule()
        console.print(f"dashboard: [bold]{dashboard}[/]")
        console.print(f"ntpctl:    NTP_URL={self.http} NTP_TOKEN={self.tokens['operator']} {ntpctl}")
        console.print(f"logs:      {self.logs if self.logs is not None else 'above (--verbose)'}")
        if keep_up:
            serve_until_interrupted()
        return dashboard


@contextlib.contextmanager
def demo_env(data: Path | None, prefix: str, title: str, nodes: Sequence[FakeNode], agents_what: str,
             verbose: bool = False) -> Iterator[DemoEnv]:
    """Sets a demo up: its data directory (`data`, else a new temporary one named `prefix`...; kept
    at the end, with the logs), the tokens, the manager process and the agents of `nodes` (waited
    for, as `agents_what`); the logs go to `<data>/logs/` (`verbose`: to the console). Tears it all
    down in reverse order when the demo ends, however it ends."""
    root = Path(tempfile.mkdtemp(prefix=prefix)) if data is None else data
    root.mkdir(parents=True, exist_ok=True)
    logs = None if verbose else root / "logs"
    if logs is not None:
        logs.mkdir(exist_ok=True)
    console.rule(title)
    console.print(f"data in {root}; " + (f"logs in {logs}/: manager.log, agent-<node>.log, rank-<node>-gpu<i>.log "
                                         "(--verbose prints them here)" if logs else "logs on the console (--verbose)"))
    tokens = {s: create_token(root, s) for s in ("worker", "operator", "viewer")}
    agent_tokens = {n.name: create_token(root, "agent", n.name) for n in nodes}
    env: DemoEnv | None = None
    agents: FakeFleet | None = None
    with demo_logs(logs), manager_process(root, logs / "manager.log" if logs else None) as (_proc, info):
        http = f"http://{info['http']}"
        api = httpx.Client(base_url=http, headers={"Authorization": f"Bearer {tokens['operator']}"}, timeout=20)
        console.print(f"manager up: REST {http}, gRPC {info['grpc']}")
        try:
            agents = FakeFleet(info["grpc"], agent_tokens, nodes)
            wait(agents.ready, 30, agents_what)
            labels = {u: f"{n.name}/{i}" for n in nodes for i, u in enumerate(agents.gpus(n.name))}
            env = DemoEnv(root, info, tokens, api, agents, logs, labels)
            yield env
        finally:
            if env is not None and env.launcher is not None:
                env.launcher.stop()
            if agents is not None:
                agents.stop()
            api.close()
    console.print("stopped cleanly")


def run_demo(steps_before: int = 6, steps_degraded: int = 6, steps_after: int = 6, data: Path | None = None,
             keep_up: bool = True, step_delay_s: float = 0.0, verbose: bool = False,
             late_restart: bool = False) -> DemoResult:
    """The scenario (module doc). A failed GPU's fresh process starts once the failure is handled
    and waits for a place, as ntp-run restarts a dead rank; `late_restart` starts it only when the
    GPU is repaired instead (bench/demo_repair.py: the survivors then wait for its start)."""
    from ntp_manager.worker.launch import TrainSpec

    res = DemoResult()
    # the ranks train until the demo tells them where to stop (after the repair has been applied)
    train = TrainSpec(job=JOB, steps=1_000_000, step_delay_s=step_delay_s, collective_timeout_s=10, stages=2)
    with demo_env(data, "ntp-demo-", "[bold]ntp-manager demo", NODES, "the agents to register", verbose) as env:
        api, agents, info, tokens = env.api, env.agents, env.info, env.tokens
        console.print("agents: node-a (nvl-0), node-b (nvl-1), node-spare (nvl-2), 4 fake GPUs each")
        job = {"name": JOB, "tp": 2, "groups_per_replica": 2, "replicas": 2, "local_batch": 16, "min_tp": 1,
               "heads": 6, "mlp_columns": 96, "scheme": "ntp-pw", "power": {"max_boost": 1.1},
               "domains": ["nvl-0", "nvl-1"]}
        r = api.post("/v1/jobs", json=job)
        r.raise_for_status()
        # This demo is about failures and repairs: the fail-slow detector only reports here (its own
        # demo is `make slow-demo`). On a shared CPU the step times are noisy (a fresh process's
        # imports slow its neighbours), and acting on that would replan every second.
        api.patch(f"/v1/jobs/{JOB}/slow/options", json={"options": {"dry_run": True}}).raise_for_status()
        first_layout(api, JOB)
        launcher = env.new_launcher(train)
        start_ranks(launcher, agents.gpus("node-a") + agents.gpus("node-b"), info["grpc"], tokens["worker"],
                    env.labels)
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
            _timeline(res, api, launcher, [victim], t_fail, old, new, label)
            _layout_now(api, new)
            # as ntp-run --max-restarts does: a fresh process on the GPU, waiting until the manager
            # gives it a place again (a process start takes seconds: torch's imports, the watch)
            if not late_restart:
                start_rank(launcher, victim, info["grpc"], tokens["worker"], env.labels)
                console.print(f"a fresh process starts on {node}/{idx} and waits for a place (as ntp-run "
                              "--max-restarts restarts a dead rank)")
            old = new
        # ---- the repair ------------------------------------------------------------------------
        def all_waiting() -> bool:
            """Whether every fresh process watches and was told it has no place (yet)."""
            launcher.drain()
            for r in launcher.records:
                if r["kind"] == "error":
                    raise RuntimeError(f"rank {r['worker']} failed: {r['error']}")
            return {r["worker"] for r in launcher.records if r["kind"] == "event" and r["what"] == "no place"
                    } >= set(victims)

        if not late_restart:
            wait(all_waiting, 300, "the fresh processes to wait for a place")
        console.rule("[green]both GPUs repaired")
        t_rep = time.time()
        for (node, idx), victim in zip(HITS, victims, strict=True):
            if late_restart:
                start_rank(launcher, victim, info["grpc"], tokens["worker"], env.labels)
            agents.inject(node, "repair", idx)
        back: set[str] = set()

        def both_back(rec: dict[str, Any]) -> bool:
            if rec["kind"] == "step" and rec["worker"] in victims:
                back.add(rec["worker"])
            return len(back) == len(victims)

        rec = launcher.wait_for(both_back, 300)
        launcher.stop_at(rec["step"] + steps_after)
        _timeline(res, api, launcher, victims, t_rep, old, rec["version"], "repair")
        _layout_now(api, rec["version"])
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
        res.reasons = {x["version"]: x["reason"] for x in hist}
        _layouts_table(hist)
        res.dashboard = env.show_access("ntpctl status", keep_up)
        res.logs = env.logs
    return res


def _timeline(res: DemoResult, api: httpx.Client, launcher: Any, victims: list[str], t0: float, old: int, new: int,
              label: str) -> None:
    """The phases from a fault (or a repair) injected at `t0` to the first step at layout `new`,
    each with its time since `t0` and since the phase before, and what it waited for.

    A failure: the survivors' collective with the dead rank fails, they wait for the new layout
    (pushed over the watch stream), rebuild the process groups and reshard. A repair: nothing
    fails; the survivors take the new layout at their next step boundary (where every rank
    agrees on it), then wait in the rendezvous for the fresh ranks on the repaired GPUs; those
    were started at the failure and were waiting for a place, so they have it as soon as it is
    pushed. When a fresh process came up only after `t0` (a rank restarted late), its start is a
    row of its own: then the survivors wait for it."""
    ev = [e for v in victims for e in api.get("/v1/events", params={"gpu": v, "limit": 5}).json()["items"]]
    state = "healthy" if label == "repair" else "failed"
    report = min((_ts(e["at"]) for e in ev if e["source"] == "agent" and e["new_state"] == state
                  and _ts(e["at"]) >= t0 - 0.5), default=None)
    lay = layout_of(api, JOB, new)
    acks = api.get(f"/v1/jobs/{JOB}").json()["acks"].get(str(new), {})
    evs = [r for r in launcher.records if r["kind"] == "event" and r["at"] >= t0]
    fresh = set(victims) if label == "repair" else set()

    def at(what: str | tuple[str, ...], version: int | None, pick: Any = min,
           fresh_ranks: bool | None = None) -> float | None:
        """The first (`pick`: last) event `what` (or any of several) of `version` (None: any), of
        every rank, the fresh ones (True) or the others (False)."""
        whats = (what,) if isinstance(what, str) else what
        ts = [r["at"] for r in evs if r["what"] in whats and (version is None or r["version"] == version)
              and (fresh_ranks is None or (r["worker"] in fresh) == fresh_ranks)]
        return pick(ts) if ts else None

    def fresh_have() -> float | None:
        """When the last fresh rank had layout `new`: received as its first place, or agreed at a
        step boundary after it had joined an intermediate version (one GPU back before the other)."""
        firsts = [min((r["at"] for r in evs if r["worker"] == w and r["version"] == new
                       and r["what"] in ("layout received", "layout agreed", "regrouped")), default=None)
                  for w in fresh]  # regrouped: it had it by then, whichever way it came
        return None if None in firsts else max(x for x in firsts if x is not None)

    n_fresh = len(fresh)
    rows: list[tuple[str, float | None, str]] = [
        (f"{label} injected", t0, "the GPU cleared" if label == "repair" else "XID 48; its process killed"),
        ("agent report received by the manager", report, "the agent's stream"),
        (f"plan made (layout v{new})", _ts(lay["created_at"]), "the planner (its reason below)"),
    ]
    if label != "repair":
        rows += [
            ("collective failed on a survivor", at("failure detected", None), "a peer of the dead rank"),
            ("layout pushed (first worker has it)", at("layout received", new), "the watch stream"),
        ]
    else:
        rows += [
            ("fresh process up (last)", at("process up", None, max, True),
             "spawn, imports: the survivors wait for it"),
            # agreed at a step boundary; or, when one GPU came back before the other, received while
            # the survivors were meeting for the intermediate version (that switch is superseded)
            ("layout pushed (first worker has it)", at(("layout agreed", "layout received"), new, min, False),
             "the survivors' next step boundary"),
            (f"fresh ranks have it ({n_fresh})", fresh_have(), "they waited for a place"),
        ]
    rows += [
        ("process group rebuilt (last rank)", at("regrouped", new, max), "every rank arrived"),
        ("reshard done (last rank)", at("reshard done", new, max),
         "stages copied from peers" if label == "repair" else "shards moved between ranks"),
        (f"acks at the manager ({acks.get('ok', 0)})", _ts(acks["last_at"]) if acks.get("last_at") else None, ""),
        ("first step at the new layout (last rank)", at("first step", new, max), ""),
    ]
    t = table(f"timeline: {label} (v{old} -> v{new})", ("phase", "t (s)", "took (s)", "waited for"),
              right=("t (s)", "took (s)"), lines=True)
    prev = t0
    timeline = []
    for what, when, why in sorted((r for r in rows if r[1] is not None), key=lambda r: r[1] or 0.0):
        assert when is not None
        t.add_row(what, f"{when - t0:.2f}", f"{max(0.0, when - prev):.2f}", why)
        prev = max(prev, when)
        timeline.append((what, when - t0))
    console.print(t)
    res.timelines[label] = timeline
    res.timeline += timeline
    first_step = at("first step", new, max)
    if label == "second failure" and first_step is not None:
        res.stall2_s = first_step - t0
    if label == "failure" and first_step is not None:
        res.stall_s = first_step - t0
        res.split = {
            "detection": (report or t0) - t0,
            "plan": _ts(lay["created_at"]) - (report or t0),
            "push + regroup": (at("regrouped", new, max) or t0) - _ts(lay["created_at"]),
            "reshard": (at("reshard done", new, max) or t0) - (at("regrouped", new, max) or t0),
            "first step": first_step - (at("reshard done", new, max) or t0),
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
    console.print(f"  reason: {escape(lay['reason'])}")
    for r in lay["replicas"]:
        for g in r["moved"]:
            console.print(f"  group {g['group']}: replica {g['from_replica']} stage {g['from_stage']} -> "
                          f"replica {r['id']} stage {g['stage']}"
                          + ("  [bold](changes stage: fetches its layers from DP peers)[/]"
                             if g["from_stage"] != g["stage"] else ""))


def _layouts_table(hist: list[dict[str, Any]]) -> None:
    t = table("layout versions (replica: stages x TP, local batch)",
              ("version", "replicas", "groups changing stage", "reason"), lines=True)
    for x in sorted(hist, key=lambda x: x["version"]):
        t.add_row(str(x["version"]), _replicas_text(x), str((x.get("moves") or {}).get("stage_changed", "")),
                  escape(x["reason"]))  # data, not rich markup: "[...]" is printed as it is
    console.print(t)


VERBOSE = typer.Option(False, "--verbose", help="every process's log on the console instead of files")
DATA_DIR = typer.Option(None, "--data-dir", help="the demo's data and logs (default: a new temporary directory)")


def main(
    no_wait: bool = typer.Option(False, "--no-wait", help="exit after the scenario instead of serving until Ctrl-C"),
    step_delay: float = typer.Option(0.3, help="pause between steps, so the dashboard can be watched"),
    verbose: bool = VERBOSE,
    data_dir: Path | None = DATA_DIR,
) -> None:
    """The failure demo (`make demo`); the fail-slow one is `make slow-demo` (ntp_manager/demos/demo_slow.py)."""
    with stop_on_signals():
        res = run_demo(keep_up=not no_wait, step_delay_s=step_delay, verbose=verbose, data=data_dir)
    worst = max((abs(a - b) / abs(b) for _, _, a, b in res.losses), default=0.0)
    console.print(f"failure to first step: {res.stall_s:.2f} s (one stage reduced), {res.stall2_s:.2f} s (groups "
                  f"changing stage); worst loss difference vs reference {worst:.1e}")


if __name__ == "__main__":
    typer.run(main)
