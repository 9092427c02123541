"""Pipeline runtime benchmarks (gloo on CPU, real processes, issue 18):

1. Steady step of PP2 x TP4 x DP2 (16 ranks) with replica 0's stage 1 at TP3 (ntp-pw: the other
   stages at TP4, the batch kept) over the same job with every stage at TP4. The two layouts take
   turns (planned switches), so a slow spell of this shared machine hits both alike; the first
   step after a switch is left out; per step the slowest rank's time counts.
2. Rank killed -> first completed step at the new layout, for a ~118M-parameter TinyGpt cut into
   2 stages, one 16-token sample per replica (as the single-stage figure in bench/worker.py):
   PP2 x TP4 x DP2 (16 ranks; stage 1 of replica 0 goes to TP3) and PP2 x TP2 x DP2 (8 ranks,
   the single-stage benchmark's process count; that stage goes to TP1). Split into detection,
   regroup, reshard and first step.

    python bench/pipeline.py [--quick] [--only steady|failover] [--repeat N]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import show
from ntp_manager.worker.launch import free_port
from ntp_manager.worker.pipeline import Pipeline
from ntp_manager.worker.runtime import Runtime, RuntimeConfig
from ntp_manager.worker.sources import StoreLayoutSource, publish_layout
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt, tp_plan

BIG = GptConfig(vocab=8192, seq=64, d_model=1024, heads=16, mlp=4096, layers=8)  # 118M, as bench/worker.py
STEADY = GptConfig(vocab=2048, seq=64, d_model=384, heads=12, mlp=1536, layers=4)  # 12 heads: TP4 and TP3 even


def _ctx() -> Any:
    ctx = mp.get_context("forkserver")  # torch imported once, ranks forked from it
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ntp_manager.worker.runtime", "bench.pipeline"])
    return ctx


def _pipe() -> Pipeline:
    return Pipeline(inputs=lambda b: b[0], loss=lambda y, b: nn.functional.cross_entropy(
        y.reshape(-1, y.shape[-1]), b[1].reshape(-1)))


def _batch(cfg: GptConfig, seq: int) -> Any:
    def batch(step: int, start: int, count: int) -> Any:
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, cfg.vocab, (16, seq), generator=g)
        return idx[start : start + count], torch.roll(idx, -1, 1)[start : start + count]
    return batch


def _names(tp: int) -> list[list[list[str]]]:
    """[replica][stage] -> worker ids, 2 replicas x 2 stages."""
    return [[[f"r{r}s{s}g{j}" for j in range(tp)] for s in range(2)] for r in range(2)]


def _worker(wid: str, port: int, cfg: GptConfig, seq: int, steps: int, park_at: int, victim: str, q: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=600))
    rt = Runtime(lambda: TinyGpt(cfg), tp_plan(cfg), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                 StoreLayoutSource(store, "bench", wid), store,
                 RuntimeConfig(job="bench", collective_timeout_s=120, rendezvous_timeout_s=600,
                               reconfigure_timeout_s=600), pipeline=_pipe())
    rt.start(timeout=600)
    batch = _batch(cfg, seq)
    while rt.step < steps:
        if wid == victim and rt.step == park_at:
            store.set("bench/parked", "1")
            time.sleep(3600)
        gate = f"bench/gate/{rt.step}"
        if store.check([f"bench/gated/{rt.step}"]):  # the driver publishes the next layout first
            store.wait([gate], dt.timedelta(seconds=600))
        prof = _profiler(wid, rt.step == park_at)
        r = rt.train_step(batch)
        if prof is not None:
            prof()
        q.put(("step", wid, r.step, r.version, r.tp, r.seconds))
    q.put(("timeline", wid, [(e.what, e.version, e.at) for e in rt.timeline], rt.switch_marks))
    rt.close()


def _profiler(wid: str, on: bool) -> Any:
    """With NTP_BENCH_PROFILE=DIR, a cProfile of the failing step (the kill, the switch and the
    first step at the new layout) of every rank into DIR/<worker>.prof; returns the stop function."""
    where = os.environ.get("NTP_BENCH_PROFILE")
    if not where or not on:
        return None
    import cProfile

    prof = cProfile.Profile()
    prof.enable()

    def stop() -> None:
        prof.disable()
        Path(where).mkdir(parents=True, exist_ok=True)
        prof.dump_stats(str(Path(where) / f"{wid}.prof"))

    return stop


# ---- 1. steady step -----------------------------------------------------------------------------
def bench_steady(quick: bool, rounds: int) -> list[tuple[str, ...]]:
    cfg = GptConfig(vocab=512, seq=32, d_model=96, heads=12, mlp=384, layers=2) if quick else STEADY
    per = 3 if quick else 5  # steps per turn; the first after a switch is left out
    n = _names(4)
    uniform = [(rep, 8) for rep in n]
    reduced = [([n[0][0], n[0][1][:3]], 8), (n[1], 8)]  # ntp-pw: the batch stays
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=dt.timedelta(seconds=600))
    publish_layout(store, "bench", 1, uniform, "uniform")
    turns = 2 * rounds + 1  # uniform, reduced, ..., uniform: the rank left out rejoins at the end
    total = turns * per
    ctx = _ctx()
    q = ctx.Queue()
    workers = [w for rep in n for st in rep for w in st]
    procs = [ctx.Process(target=_worker, args=(w, port, cfg, cfg.seq, total, -1, "", q)) for w in workers]
    for p in procs:
        p.start()
    # version v runs steps [(v-1) per, v per); the layout for v+1 is published at step v*per - 1
    for v in range(1, turns):
        store.set(f"bench/gated/{v * per - 1}", "1")
    secs: dict[tuple[int, int], float] = {}
    version_of: dict[int, int] = {}
    published = 1
    done = 0
    while done < len(workers):
        msg = q.get(timeout=1800)
        if msg[0] == "timeline":
            done += 1
            continue
        _, _, step, version, _, s = msg
        secs[step, version] = max(secs.get((step, version), 0.0), s)
        version_of[step] = version
        nxt = step // per + 2  # the version the next turn needs
        if step % per == per - 2 and nxt > published and nxt <= turns:
            publish_layout(store, "bench", nxt, reduced if nxt % 2 == 0 else uniform, "turn")
            published = nxt
            store.set(f"bench/gate/{(nxt - 1) * per - 1}", "1")
    for p in procs:
        p.join(timeout=60)
    by: dict[str, list[float]] = {"uniform": [], "reduced": []}
    for (step, version), s in secs.items():
        if step % per == 0:
            continue  # the first step of a turn follows a switch
        by["reduced" if version % 2 == 0 else "uniform"].append(s)
    u, r = statistics.median(by["uniform"]), statistics.median(by["reduced"])
    params = sum(p.numel() for p in TinyGpt(cfg).parameters())
    return [(f"{params / 1e6:.1f}M", f"{len(by['uniform'])} / {len(by['reduced'])}", f"{u * 1e3:.0f}",
             f"{r * 1e3:.0f}", f"{r / u:.3f}")]


# ---- 2. failure -> first step -------------------------------------------------------------------
def bench_failover(quick: bool, tp: int) -> dict[str, float]:
    cfg = GptConfig(vocab=1024, seq=32, d_model=256, heads=8, mlp=1024, layers=2) if quick else BIG
    n = _names(tp)
    lb = 1  # one 16-token sample per replica
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=dt.timedelta(seconds=600))
    publish_layout(store, "bench", 1, [(rep, lb) for rep in n], "start")
    victim = n[0][1][-1]  # replica 0, stage 1, last TP rank
    ctx = _ctx()
    q = ctx.Queue()
    workers = [w for rep in n for st in rep for w in st]
    procs = {w: ctx.Process(target=_worker, args=(w, port, cfg, 16, 5, 3, victim, q)) for w in workers}
    for p in procs.values():
        p.start()
    while not store.check(["bench/parked"]):
        time.sleep(0.05)
    time.sleep(1.0)  # the peers are inside step 3, blocked on the victim
    t_kill = time.time()
    os.kill(procs[victim].pid, signal.SIGKILL)
    publish_layout(store, "bench", 2, [([n[0][0], n[0][1][:-1]], lb), (n[1], lb)], f"{victim} failed")
    timelines: dict[str, list[tuple[str, int, float]]] = {}
    marks: dict[str, list[tuple[str, float]]] = {}
    before: dict[int, float] = {}
    while len(timelines) < len(workers) - 1:
        msg = q.get(timeout=1800)
        if msg[0] == "timeline":
            timelines[msg[1]] = msg[2]
            marks[msg[1]] = msg[3]
        elif msg[3] == 1 and msg[2] in (1, 2):
            before[msg[2]] = max(before.get(msg[2], 0.0), msg[5])
    for p in procs.values():
        p.join(timeout=60)

    def last(what: str) -> float:
        return max(next(t for w, v, t in tl if w == what and (v == 2 or what == "failure detected"))
                   for tl in timelines.values())

    detect = last("failure detected")
    regroup, reshard, first = last("regrouped"), last("reshard done"), last("first step")
    # inside the switch: by when the last rank had finished each phase (s after the kill)
    phases: dict[str, float] = {}
    for ms in marks.values():
        for name, at in ms:
            phases[name] = max(phases.get(name, 0.0), at - t_kill)
    if os.environ.get("NTP_BENCH_MARKS"):  # every rank's marks and timeline, s after the kill (JSON lines)
        import json

        with open(os.environ["NTP_BENCH_MARKS"], "a") as f:
            f.write(json.dumps({"tp": tp, "marks": {w: [(n, round(at - t_kill, 4)) for n, at in ms]
                                                    for w, ms in sorted(marks.items())},
                                "timeline": {w: [(n, v, round(at - t_kill, 4)) for n, v, at in tl if at >= t_kill]
                                             for w, tl in sorted(timelines.items())}}) + "\n")
    return {"detection": detect - t_kill, "regroup": regroup - detect, "reshard": reshard - regroup,
            "first step": first - reshard, "total": first - t_kill,
            "step before": statistics.median(before.values()) if before else float("nan"),
            "params": float(sum(p.numel() for p in TinyGpt(cfg).parameters())),
            **{f"@{k}": v for k, v in phases.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["steady", "failover"], action="append")
    ap.add_argument("--repeat", type=int, default=3, help="failover runs per shape (median reported)")
    ap.add_argument("--rounds", type=int, default=3, help="steady: turns of each layout")
    ap.add_argument("--shape", choices=["4", "2", "single"], action="append",
                    help="failover: only these jobs (default all three: PP2xTP4xDP2, PP2xTP2xDP2, single stage)")
    args = ap.parse_args()
    parts = set(args.only or ["steady", "failover"])
    console = Console()
    console.print(f"torch {torch.__version__}, gloo, {os.cpu_count()} CPUs")
    if "steady" in parts:
        show(console, "Steady step, PP2 x TP4 x DP2 (16 ranks): replica 0's stage 1 at TP3 vs all stages at TP4 "
             "(median of the slowest rank per step; goal <= 1.15x)",
             ("model", "steps (TP4 / TP3)", "all TP4 ms", "one stage TP3 ms", "ratio"),
             bench_steady(args.quick, args.rounds))
    if "failover" not in parts:
        return
    # the shapes take turns (and the single-stage benchmark of bench/worker.py with them), so that
    # this shared machine's load hits them alike
    from bench.worker import bench_failover as single_stage

    wanted = args.shape or ["4", "2", "single"]
    shapes: dict[str, list[dict[str, float]]] = {k: [] for k in ("4", "2", "single") if k in wanted}
    for _ in range(args.repeat):
        for key in shapes:
            shapes[key].append(single_stage(args.quick, small_batch=True)[1] if key == "single"
                               else bench_failover(args.quick, int(key)))
    rows = []
    for key, runs in shapes.items():
        med = {k: statistics.median(r.get(k, float("nan")) for r in runs) for k in runs[0]}
        size = "2M" if args.quick else "118M"
        label = (f"{size}, 1 stage, TP4xDP2 (8), TP4->3 (bench/worker.py)" if key == "single" else
                 f"{med['params'] / 1e6:.0f}M PP2xTP{key}xDP2 ({4 * int(key)}), TP{key}->{int(key) - 1}")
        rows.append((label, *(f"{med[k]:.2f}" for k in ("detection", "regroup", "reshard", "first step", "total",
                                                        "step before")),
                     f"{max(r['total'] for r in runs):.2f}"))
    pipes = [k for k in ("4", "2") if k in shapes]
    names = list(dict.fromkeys(n for k in pipes for r in shapes[k] for n in r if n.startswith("@")))
    show(console, "Inside the switch: by when the last rank had finished each phase (s after the kill, median)",
         ("phase", *(f"PP2xTP{k}xDP2" for k in pipes)),
         [(n[1:], *(f"{statistics.median(r.get(n, float('nan')) for r in shapes[k]):.3f}" for k in pipes))
          for n in names])
    show(console, f"Rank killed -> first step at the new layout, 2 stages, 1x16 tokens per replica (s, median of "
         f"{args.repeat}; goal <= 2 s)",
         ("job", "detection", "regroup", "reshard", "first step", "total", "step before", "worst total"), rows)


if __name__ == "__main__":
    main()
