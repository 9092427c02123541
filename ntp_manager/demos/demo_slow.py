"""`make slow-demo` (`python -m ntp_manager.demos.demo_slow`): a fail-slow GPU found and planned around,
live (issue 21 item 5).

The same machinery as `make demo` (a real manager process on SQLite, a real agent on the fake GPU
backend, one training process per GPU on the manager's gRPC watch stream), with a single-stage job:
2 DP replicas of one TP2 group each on NVLink domain nvl-0 (4 GPUs), TinyGpt on CPU. Every step
report carries the step's compute time, TP communication wait and sequence lengths.

From step `slow_from`, one rank (node-a GPU 1, replica 0) runs `factor` x slower: its process sleeps
inside its timed forward (worker/launch.py `SlowRank`, through NTP_DEMO_SLOW_RANK), as a throttled
GPU would compute. Nothing else is told. Then, as it happens on the console:

1. the manager's detector (service/planning/failslow.py) compares each rank's compute with what its work
   should take and with its peers; after `enter_count` of `enter_window` slow steps it calls the GPU
   slow, with its factor and evidence (its TP peer waits for it in the all-reduces);
2. the GPU becomes `degraded` at its measured speed (1 / factor);
3. the planner weighs keeping it (the group at its pace) against dropping it (the group at TP1, full
   speed) by its throughput model and publishes a layout whose reason starts with the decision
   (`fail-slow: group ...: exclude`); the survivors reshard live and keep training.

The detector's thresholds are set for this job at runtime through the REST API (as an operator
would with `ntpctl slow set`): a shorter warm-up, so it is ready after a few steps, and a 50%
margin, because on a shared CPU a healthy rank's millisecond steps are noisy. The per-rank factors
and the verdict are on the dashboard (Jobs: "fail-slow") and at GET /v1/jobs/slow/slow.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import typer
from rich.markup import escape

from ntp_agent.local import FakeNode
from ntp_manager.demos.demo import (
    DATA_DIR,
    VERBOSE,
    console,
    demo_env,
    first_layout,
    layout_of,
    start_ranks,
    stop_on_signals,
    table,
)

JOB = "slow"
NODES = (FakeNode("node-a", "nvl-0"),)  # one NVLink domain of 4 fake GPUs
VICTIM = ("node-a", 1)  # replica 0's TP group holds node-a GPUs 0 and 1
# the detector's options for the demo job (set at runtime, PATCH /v1/jobs/slow/slow/options)
DEMO_OPTIONS = {"warmup_rows": 8, "enter_margin": 0.5, "exit_margin": 0.25}


@dataclass
class SlowDemoResult:
    victim: str = ""
    labels: dict[str, str] = field(default_factory=dict)  # GPU uuid -> "node-a/1"
    verdicts: list[dict[str, Any]] = field(default_factory=list)  # oldest first
    victim_state: str = ""
    victim_speed: float | None = None
    versions: list[int] = field(default_factory=list)
    reasons: dict[int, str] = field(default_factory=dict)
    tp_by_version: dict[int, list[int]] = field(default_factory=dict)  # per replica (by id)
    gpus_by_version: dict[int, list[str]] = field(default_factory=dict)
    steps_after: int = 0  # steps completed at the new layout
    losses: list[tuple[int, int, float, float]] = field(default_factory=list)  # step, version, loss, reference
    factors: list[tuple[int, dict[str, float]]] = field(default_factory=list)  # detector step, GPU -> factor
    dashboard_slow: dict[str, Any] | None = None  # the job's fail-slow part of a dashboard snapshot
    dashboard: str = ""


def run_slow_demo(factor: float = 3.0, slow_from: int = 6, steps_after: int = 3, data: Path | None = None,
                  keep_up: bool = True, step_delay_s: float = 0.0, timeout_s: float = 300.0,
                  verbose: bool = False) -> SlowDemoResult:
    from ntp_manager.worker.launch import SLOW_ENV, TrainSpec

    res = SlowDemoResult()
    train = TrainSpec(job=JOB, steps=1_000_000, step_delay_s=step_delay_s, collective_timeout_s=10, stages=1)
    env_before = os.environ.get(SLOW_ENV)
    with demo_env(data, "ntp-slow-demo-", "[bold]ntp-manager fail-slow demo", NODES, "the agent to register",
                  verbose) as env:
        api, info, tokens = env.api, env.info, env.tokens
        try:
            gpus = env.agents.gpus("node-a")
            res.labels = {u: f"node-a/{i}" for i, u in enumerate(gpus)}
            res.victim = victim = gpus[VICTIM[1]]
            job = {"name": JOB, "tp": 2, "groups_per_replica": 1, "replicas": 2, "local_batch": 16, "min_tp": 1,
                   "heads": 6, "mlp_columns": 96, "scheme": "ntp-pw", "power": {"max_boost": 1.1},
                   "domains": ["nvl-0"]}
            api.post("/v1/jobs", json=job).raise_for_status()
            r = api.patch(f"/v1/jobs/{JOB}/slow/options", json={"options": DEMO_OPTIONS})
            r.raise_for_status()
            console.print(f"detector options for job {JOB!r} (set at runtime): "
                          + ", ".join(f"{k}={v}" for k, v in r.json()["changed"].items()))
            first = first_layout(api, JOB)
            _print_layout(api, first, res)
            launcher = env.new_launcher(train)
            os.environ[SLOW_ENV] = f"{victim}:{factor:g}@{slow_from}"  # the spawned ranks read it at start
            try:
                start_ranks(launcher, gpus, info["grpc"], tokens["worker"], env.labels)
            finally:
                _restore_env(SLOW_ENV, env_before)
            console.print(f"training: 4 rank processes (2 replicas x TP2, one stage), TinyGpt; "
                          f"{SLOW_ENV}={victim}:{factor:g}@{slow_from}: "
                          f"[bold]{res.labels[victim]}[/] runs {factor:g}x slower from step {slow_from}")
            new = _watch(api, launcher, res, first, timeout_s)
            # ---- a few steps at the new layout, then stop -------------------------------------------
            rec = launcher.wait_for(lambda rec: rec["kind"] == "step" and rec["version"] == new, timeout_s)
            last = launcher.wait_for(lambda rec, s=rec["step"]: rec["kind"] == "step" and rec["version"] == new
                                     and rec["step"] >= s + steps_after - 1, timeout_s)
            res.steps_after = last["step"] - rec["step"] + 1
            console.print(f"training goes on at layout v{new} without {res.labels[victim]} "
                          f"(step {last['step']})")
            res.dashboard_slow = _dashboard_slow(env.http, tokens["viewer"], timeout_s)
            if res.dashboard_slow is not None:
                flagged = ", ".join(res.labels.get(u, u) for u in res.dashboard_slow["flagged"])
                console.print(f"dashboard (fail-slow part of the job): flagged {flagged or 'none'}; "
                              + "; ".join(f"{res.labels.get(r['gpu'], r['gpu'][:10])} step "
                                          f"{_ms(r['step_time_s'])}, factor {_fmt(r['factor']).strip()}"
                                          for r in res.dashboard_slow["ranks"]))
            launcher.stop()
            res.losses, hist = env.results(launcher, JOB)
            res.versions = sorted(x["version"] for x in hist)
            for x in hist:
                reps = sorted(x["replicas"], key=lambda r: r["id"])
                res.tp_by_version[x["version"]] = [r["tp"] for r in reps]
                res.reasons[x["version"]] = x["reason"]
            _layouts_table(hist)
            res.dashboard = env.show_access(f"ntpctl slow show {JOB}", keep_up)
        finally:
            _restore_env(SLOW_ENV, env_before)
    return res


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _new_verdicts(view: dict[str, Any], res: SlowDemoResult, seen: int) -> int:
    """Record and print the verdicts of a detector view not seen yet; returns how many are seen."""
    verdicts = list(reversed(view["verdicts"]))  # oldest first
    for v in verdicts[seen:]:
        res.verdicts.append(v)
        who = res.labels.get(v.get("gpu", ""), v.get("gpu") or v.get("group", ""))
        console.rule(f"[red]verdict: {v['kind']} {who}" + (f" factor {v['factor']:.2f}" if "factor" in v else ""))
        console.print(escape(v.get("reason", "")))
    return len(verdicts)


def _victim_health(api: httpx.Client, res: SlowDemoResult, shown: str) -> str:
    """Record the slowed GPU's health, printing it when it differs from `shown`; returns it."""
    g = api.get(f"/v1/gpus/{res.victim}").json()
    if g["state"] != shown:
        res.victim_state, res.victim_speed = g["state"], g.get("speed")
        console.print(f"GPU {res.labels[res.victim]}: {g['state']}"
                      + (f" at speed {g['speed']}" if g.get("speed") is not None else "")
                      + (f" ({g.get('health_reason')})" if g.get("health_reason") else ""))
    return str(g["state"])


def _watch(api: httpx.Client, launcher: Any, res: SlowDemoResult, old: int, timeout_s: float) -> int:
    """Follow the detector (per-rank factors, each step it has observed), its verdicts, the victim's
    health and the layout, printing as they come, until a layout after `old` gives a fail-slow
    decision that runs without the victim (one that keeps it, boosted, is shown and followed).
    Returns that layout's version."""
    deadline = time.monotonic() + timeout_s
    shown_step: int | None = None
    seen_verdicts = 0
    state = ""
    while time.monotonic() < deadline:
        launcher.drain()
        _check_ranks(launcher)
        view = api.get(f"/v1/jobs/{JOB}/slow").json()
        if view["step"] is not None and view["step"] != shown_step and view["ranks"]:
            shown_step = view["step"]
            factors = {r["gpu"]: r["factor"] for r in view["ranks"]}
            res.factors.append((shown_step, factors))
            line = "  ".join(
                f"{res.labels.get(r['gpu'], r['gpu'][:10])} {_fmt(r['factor'])}{'*' if r['slow'] else ''}"
                for r in sorted(view["ranks"], key=lambda r: res.labels.get(r["gpu"], r["gpu"])))
            console.print(f"detector step {shown_step:>3} (observed {view['observed_steps']}): {line}")
        seen_verdicts = _new_verdicts(view, res, seen_verdicts)
        state = _victim_health(api, res, state)
        version = int(api.get(f"/v1/jobs/{JOB}").json()["layout_version"] or 0)
        if version and version > old:
            reason = layout_of(api, JOB, version)["reason"]
            console.rule(f"[bold]layout v{version}")
            console.print(escape(reason))
            _print_layout(api, version, res)
            old = version
            # a first decision may keep the GPU (boosted) while its measured factor is still low
            # (a loaded machine dilutes the slowdown); the story ends once a layout plans around it
            if "fail-slow:" in reason and res.victim not in res.gpus_by_version.get(version, [res.victim]):
                # the verdict, the GPU's new health and this layout can all land between this poll's
                # first read and the layout read: read the detector once more so the verdict behind
                # the layout is shown and recorded before it
                _new_verdicts(api.get(f"/v1/jobs/{JOB}/slow").json(), res, seen_verdicts)
                _victim_health(api, res, state)
                return version
        time.sleep(0.5)
    raise TimeoutError(f"no fail-slow layout within {timeout_s:.0f} s (verdicts: {res.verdicts})")


def _dashboard_slow(http: str, viewer: str, timeout_s: float) -> dict[str, Any] | None:
    """The job's fail-slow part of the dashboard's event stream, as the page gets it (a one-time
    ticket for the viewer token, then the stream): the first snapshot that shows a step time at
    the current layout (the stream sends a new snapshot when anything changes), or the last one
    seen when none does within `timeout_s`."""
    part: dict[str, Any] | None = None
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=http, timeout=20) as c:
        r = c.post("/v1/stream/tickets", headers={"Authorization": f"Bearer {viewer}"})
        r.raise_for_status()
        with c.stream("GET", "/v1/stream", params={"ticket": r.json()["ticket"]}) as s:
            event = ""
            for line in s.iter_lines():
                if line.startswith("event: "):
                    event = line[7:]
                elif line.startswith("data: ") and event == "snapshot":
                    snap = json.loads(line[6:])
                    job = next((j for j in snap["jobs"] if j["name"] == JOB), None)
                    part = None if job is None else job.get("slow")
                    if part is not None and any(r["step_time_s"] for r in part["ranks"]):
                        break
                if time.monotonic() > deadline:
                    break
    return part


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def _check_ranks(launcher: Any) -> None:
    for rec in launcher.records:
        if rec["kind"] == "error":
            raise RuntimeError(f"rank {rec['worker']} failed: {rec['error']}")


def _fmt(x: float | None) -> str:
    return "  -  " if x is None else f"{x:5.2f}"


def _print_layout(api: httpx.Client, version: int, res: SlowDemoResult) -> None:
    """The current layout (GET /v1/jobs/slow/layout: its GPUs), as replicas of named GPUs."""
    cur = api.get(f"/v1/jobs/{JOB}/layout").json()
    version = int(cur["version"])
    parts = []
    gpus: list[str] = []
    for r in sorted(cur["plan"]["replicas"], key=lambda r: r["id"]):
        members = [u for g in r["groups"] for u in g["gpus"]]
        gpus += members
        names = ", ".join(res.labels.get(u, u[:10]) for u in members)
        parts.append(f"r{r['id']}: TP{len(members)} b{r['local_batch']} [{names}]")
    res.gpus_by_version[version] = gpus
    console.print(escape(f"layout v{version}: " + "   ".join(parts)))  # "[node-a/0, ...]" is no markup


def _layouts_table(hist: list[dict[str, Any]]) -> None:
    t = table("layout versions", ("version", "replicas (TP, local batch)", "reason"), lines=True)
    for x in sorted(hist, key=lambda x: x["version"]):
        reps = ", ".join(f"r{r['id']} TP{r['tp']} b{r['local_batch']}" for r in sorted(x["replicas"],
                                                                                   key=lambda r: r["id"]))
        t.add_row(str(x["version"]), reps, escape(x["reason"]))
    console.print(t)


def main(
    no_wait: bool = typer.Option(False, "--no-wait", help="exit after the scenario instead of serving until Ctrl-C"),
    step_delay: float = typer.Option(0.3, help="pause between steps, so the console can be followed"),
    factor: float = typer.Option(3.0, min=1.0, max=100.0, help="how many times slower the slow rank runs"),
    slow_from: int = typer.Option(6, min=0, help="the step from which it runs slow"),
    verbose: bool = VERBOSE,
    data_dir: Path | None = DATA_DIR,
) -> None:
    """`make slow-demo`: one rank made slow is detected, its GPU degraded, the layout changed."""
    with stop_on_signals():
        res = run_slow_demo(factor=factor, slow_from=slow_from, keep_up=not no_wait, step_delay_s=step_delay,
                            verbose=verbose, data=data_dir)
    v = next((x for x in res.verdicts if x["kind"] == "slow" and x.get("gpu") == res.victim), None)
    if v is not None:
        last = res.versions[-1]
        console.print(f"slow GPU {res.labels[res.victim]} found at step {v['step']} (slow since step "
                      f"{v['since_step']}), measured factor {v['factor']:.2f}; it is {res.victim_state}; "
                      f"layout v{last}: replicas at TP {res.tp_by_version[last]}")


if __name__ == "__main__":
    typer.run(main)
