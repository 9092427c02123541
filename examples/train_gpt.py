"""Train the repo's small GPT with the NTP worker runtime, one process per (simulated) GPU.

Standalone (this script plays the manager: it publishes layouts into the store itself):

    python examples/train_gpt.py --replicas 2 --tp 4 --steps 30 --fail-at 10 --repair-at 20

kills one rank's process at step 10 (the survivors continue at TP3), starts a fresh one at step 20
(back to TP4), and checks every step's loss against a single-process reference.

Against a running manager (the layouts come from its gRPC watch stream; one rank per GPU UUID):

    python examples/train_gpt.py --manager 127.0.0.1:50051 --token-file t --job llm --gpus U1,U2,...
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntp_manager.worker.launch import Launcher, RankSpec, TrainSpec
from ntp_manager.worker.sources import publish_layout

app = typer.Typer(add_completion=False)
console = Console()


@app.command()
def main(
    replicas: int = typer.Option(2, min=1, max=8),
    tp: int = typer.Option(4, min=1, max=6, help="TP degree of each replica (the model has 6 heads)"),
    steps: int = typer.Option(30, min=1),
    fail_at: int = typer.Option(-1, help="kill the last rank of replica 0 when this step completes"),
    repair_at: int = typer.Option(-1, help="start a fresh process for it when this step completes"),
    manager: str = typer.Option("", help="manager gRPC address; layouts then come from the manager"),
    token_file: Path | None = typer.Option(None, help="file holding a worker-scope token"),
    job: str = typer.Option("demo"),
    gpus: str = typer.Option("", help="comma-separated GPU UUIDs, one rank each (with --manager)"),
) -> None:
    train = TrainSpec(job=job, steps=steps)
    launcher = Launcher(train)
    try:
        if manager:
            if token_file is None or not gpus:
                console.print("[red]error:[/] --manager needs --token-file and --gpus")
                raise typer.Exit(2)
            token = token_file.read_text().strip()
            for u in gpus.split(","):
                launcher.start(RankSpec(u, launcher.port, "grpc", manager, token, u))
            launcher.wait_for(lambda r: r["kind"] == "done", timeout=3600)
        else:
            _standalone(launcher, replicas, tp, steps, fail_at, repair_at)
    finally:
        launcher.stop()
    _report(launcher, train)


def _standalone(launcher: Launcher, replicas: int, tp: int, steps: int, fail_at: int, repair_at: int) -> None:
    groups = [[f"r{i}g{j}" for j in range(tp)] for i in range(replicas)]
    lb = 4  # samples per TP rank: a replica's local batch follows its degree
    publish_layout(launcher.store, launcher.train.job, 1, [(g, lb * len(g)) for g in groups], "start")
    for g in groups:
        for w in g:
            launcher.start(RankSpec(w, launcher.port, "store"))
    victim = groups[0][-1]
    if 0 <= fail_at < steps:
        launcher.wait_for(lambda r: r["kind"] == "step" and r["step"] >= fail_at, timeout=600)
        launcher.kill(victim)
        console.print(f"[red]killed[/] {victim} after step {fail_at}")
        hit = [(g[:-1] if i == 0 else g) for i, g in enumerate(groups)]
        publish_layout(launcher.store, launcher.train.job, 2, [(g, lb * len(g)) for g in hit if g],
                       f"{victim} failed")
        if fail_at < repair_at < steps:
            launcher.wait_for(lambda r: r["kind"] == "step" and r["step"] >= repair_at, timeout=600)
            launcher.start(RankSpec(victim, launcher.port, "store"))
            publish_layout(launcher.store, launcher.train.job, 3, [(g, lb * len(g)) for g in groups],
                           f"{victim} repaired")
            console.print(f"[green]repaired[/] {victim} after step {repair_at}")
    survivors = [w for g in groups for w in g if w != victim]
    done: set[str] = set()
    launcher.wait_for(lambda r: r["kind"] == "done" and (done.add(r["worker"]) or done >= set(survivors)),
                      timeout=3600)
    time.sleep(0.5)
    launcher.drain()


def _report(launcher: Launcher, train: TrainSpec) -> None:
    if not any(r["kind"] == "step" for r in launcher.records):
        console.print("[red]no step completed[/]")
        raise typer.Exit(1)
    rows, table = launcher.loss_report()
    console.print(table)
    worst = max((abs(loss - ref) / abs(ref) for *_, loss, ref in rows), default=float("nan"))
    events = sorted((r for r in launcher.records if r["kind"] == "event" and r["what"] != "process up"),
                    key=lambda r: r["at"])
    if events:
        t0 = events[0]["at"]
        seen = set()
        t = Table(title="timeline (first rank to reach each event)")
        for c in ("t (s)", "version", "event", "detail"):
            t.add_column(c, overflow="fold")  # wrapped, never cut
        for e in events:
            key = (e["what"], e["version"])
            if key in seen:
                continue
            seen.add(key)
            t.add_row(f"{e['at'] - t0:.2f}", str(e["version"]), e["what"], escape(e["detail"]))
        console.print(t)
    console.print(f"{len(rows)} steps; worst relative loss difference vs reference: {worst:.1e}")
    if worst > 1e-5:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
