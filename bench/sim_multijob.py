"""Multi-job simulator benchmark (issue 41, item 7): eight jobs on 32K and on 100K GPUs.

For each preset (jobs-32k, jobs-100k; `--presets`), one 15-day trace at Llama 3 rates after a
6-day warm-up, replayed under both spare policies (sim/multijob.py):

- private: the pool split once among the jobs (reservation, then in proportion to size);
- shared: one pool, granted by priority, with reservations, min_throughput and preemption.

Then the two searches for equal effective time: the smallest shared pool that gives every job at
least its private effective time (also counting only the non-preemptible jobs, and with nobody
preemptible), and per job the fewest private spare domains that reach its shared effective time.
Prints the tables and each step's wall time; `--plot DIR` writes docs-style PNGs
(multijob-<preset>.png); `--json` the figures. "Equal" is within 0.01 percentage points
(multijob.EQUAL). Last, both policies again under each stall model of `--stalls` (default ft-hsdp
and live): what the pool's extra layout changes cost. Goal: the 100K run, searches included, in a
few minutes on the 2-core VM.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ntp_manager.planner import Scheme
from ntp_manager.sim import make_trace
from ntp_manager.sim.multijob import MultiSetup, pool_needed, private_spares_needed, run
from ntp_manager.sim.presets import multi_preset, multi_setup
from ntp_manager.sim.stall import STALL_PRESETS

console = Console(width=160)


def pct(x: float) -> str:
    return f"{100 * x:.3f}%"


def one(name: str, seed: int, scheme: Scheme | None, plot_dir: Path | None, stall_models: list[str]) -> dict[str, Any]:
    p = multi_preset(name)
    if scheme is not None:
        p = dataclasses.replace(p, jobs=tuple(
            dataclasses.replace(e, job=dataclasses.replace(e.job, scheme=scheme)) for e in p.jobs))
    walls: dict[str, float] = {}
    t0 = time.perf_counter()
    setup: MultiSetup = multi_setup(p)
    trace = make_trace(setup.sim, 15, seed=seed, warmup_days=6)
    walls["setup + trace"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    private = run(setup, trace, "private")
    walls["private replay"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    shared = run(setup, trace, "shared")
    walls["shared replay"] = time.perf_counter() - t0
    room = len(setup.cluster.domain_sizes) - sum(len(h) for h in setup.home)
    goals = [r.effective for r in private.jobs]
    t0 = time.perf_counter()
    cache = {setup.pool: shared}  # replays shared by the searches on this setup
    pool_all = pool_needed(setup, trace, goals, room, cache=cache)
    kept = [None if e.preemptible else g for e, g in zip(setup.jobs, goals, strict=True)]
    pool_kept = pool_needed(setup, trace, kept, room, cache=cache)
    calm = dataclasses.replace(setup, jobs=tuple(dataclasses.replace(e, preemptible=False) for e in setup.jobs))
    calm_shared = run(calm, trace, "shared")
    pool_calm = pool_needed(calm, trace, goals, room, cache={setup.pool: calm_shared})
    walls["pool searches"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    cap = 4 * setup.pool
    needed = [private_spares_needed(setup, trace, j, r.effective, cap) for j, r in enumerate(shared.jobs)]
    walls["private spare search"] = time.perf_counter() - t0
    size = setup.domain_size

    label = f"{name}{'' if scheme is None else ' / ' + scheme.value}, seed {seed}"
    console.print(
        f"{label}: {setup.n_gpus:,} GPUs, {len(setup.jobs)} jobs on {sum(len(h) for h in setup.home):,} home "
        f"domains, pool {setup.pool} domains ({setup.pool * size:,} GPUs); 15-day trace: {trace.failures} "
        f"failures, {len(trace.events)} events, peak {trace.peak_failed()} GPUs failed", highlight=False)
    t = Table(title=f"{label}: effective training time per job")
    for col in ("job", "GPUs", "prio", "preemptible", "reserved", "private spares", "private eff.", "shared eff.",
                "shared peak extra", "grants", "preempted", "private spares for shared eff."):
        t.add_column(col, justify="right")
    gpus = [len(h) * size for h in setup.home]
    for j, e in enumerate(setup.jobs):
        pr, sh = private.jobs[j], shared.jobs[j]
        t.add_row(e.name, f"{gpus[j]:,}", str(e.priority), "yes" if e.preemptible else "no", str(sh.spare_domains),
                  str(pr.spare_domains), pct(pr.effective), pct(sh.effective), str(sh.peak_held), str(sh.grants),
                  str(sh.preempted), "> cap" if needed[j] is None else str(needed[j]))
    weighted = {pol: sum(r.effective * g for r, g in zip(res.jobs, gpus, strict=True)) / sum(gpus)
                for pol, res in (("private", private), ("shared", shared))}
    t.add_row("all", f"{sum(gpus):,}", "", "", "", str(setup.pool), pct(weighted["private"]), pct(weighted["shared"]),
              "", "", "", "> cap" if None in needed else str(sum(n for n in needed if n is not None)))
    console.print(t)

    def pool_text(k: int | None) -> str:
        return f"> {room} (all the cluster holds)" if k is None else f"{k} domains = {k * size:,} GPUs"

    console.print(f"shared pool for every job's private effective time: {pool_text(pool_all.pool)} "
                  f"(tried {list(pool_all.tried)})", highlight=False)
    console.print(f"  ... for every non-preemptible job: {pool_text(pool_kept.pool)} (tried {list(pool_kept.tried)})",
                  highlight=False)
    console.print(f"  ... for every job, nobody preemptible: {pool_text(pool_calm.pool)} "
                  f"(tried {list(pool_calm.tried)}); at the preset's pool without preemption: "
                  + ", ".join(f"{r.name} {pct(r.effective)}" for r in calm_shared.jobs), highlight=False)
    total_needed = None if None in needed else sum(n for n in needed if n is not None)
    console.print(f"private spares for every job's shared effective time: "
                  f"{'> cap' if total_needed is None else f'{total_needed} domains = {total_needed * size:,} GPUs'}"
                  f" (the pool: {setup.pool} domains = {setup.pool * size:,} GPUs)", highlight=False)
    stalls: dict[str, Any] = {}
    for mname in stall_models:
        t0 = time.perf_counter()
        model = STALL_PRESETS[mname]
        res = {pol: run(setup, trace, pol, stall=model, step_s=p.step_s or 0.0)  # type: ignore[arg-type]
               for pol in ("private", "shared")}
        walls[f"both policies, stall {mname}"] = time.perf_counter() - t0
        st = Table(title=f"{label}: stall model {mname} ({model})")
        for col in ("job", "private eff.", "shared eff.", "changes private / shared", "stalled private / shared"):
            st.add_column(col, justify="right")
        for j, e in enumerate(setup.jobs):
            a, b = res["private"].jobs[j], res["shared"].jobs[j]
            st.add_row(e.name, pct(a.effective), pct(b.effective), f"{a.changes} / {b.changes}",
                       f"{pct(a.stalled_share)} / {pct(b.stalled_share)}")
        w_eff = {pol: sum(r.effective * g for r, g in zip(res[pol].jobs, gpus, strict=True)) / sum(gpus)
                 for pol in res}
        st.add_row("all", pct(w_eff["private"]), pct(w_eff["shared"]), "", "")
        console.print(st)
        stalls[mname] = {"weighted": w_eff,
                         "jobs": {pol: [dataclasses.asdict(r) for r in res[pol].jobs] for pol in res}}
    w = Table(title=f"{label}: wall time (replans: private {private.replans}, shared {shared.replans})")
    w.add_column("step")
    w.add_column("wall s", justify="right")
    for k, v in walls.items():
        w.add_row(k, f"{v:.1f}")
    w.add_row("total", f"{sum(walls.values()):.1f}")
    console.print(w)
    if plot_dir is not None:
        from ntp_manager.sim.plots import plot_multijob

        path = plot_dir / f"multijob-{name.removeprefix('jobs-')}.png"
        plot_multijob(private, shared, setup, path, f"{name}: 15-day trace, seed {seed}, Llama 3 rates")
        console.print(f"plot written to {path}")
    return {
        "preset": name, "scheme": None if scheme is None else scheme.value, "seed": seed, "gpus": setup.n_gpus,
        "pool": setup.pool, "failures": trace.failures, "events": len(trace.events),
        "jobs": [{"name": e.name, "gpus": gpus[j], "private": dataclasses.asdict(private.jobs[j]),
                  "shared": dataclasses.asdict(shared.jobs[j]), "private_spares_needed": needed[j]}
                 for j, e in enumerate(setup.jobs)],
        "weighted": weighted, "pool_needed": pool_all.pool, "pool_needed_non_preemptible": pool_kept.pool,
        "pool_needed_no_preemption": pool_calm.pool,
        "shared_no_preemption": [r.effective for r in calm_shared.jobs], "pool_tried": pool_all.tried,
        "walls": walls, "replans": {"private": private.replans, "shared": shared.replans}, "stalls": stalls,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="jobs-32k,jobs-100k")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scheme", choices=[s.value for s in Scheme], help="every job's scheme (default: the preset's)")
    ap.add_argument("--plot", type=Path, help="directory for the PNGs")
    ap.add_argument("--stalls", default="ft-hsdp,live", help="stall models to replay both policies with ('' for none)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    scheme = None if args.scheme is None else Scheme(args.scheme)
    out = []
    for name in args.presets.split(","):
        t0 = time.perf_counter()
        out.append(one(name, args.seed, scheme, args.plot, [m for m in args.stalls.split(",") if m]))
        console.print(f"{name}: {time.perf_counter() - t0:.0f} s wall", highlight=False)
    console.print(f"machine: {platform.machine()}, python {platform.python_version()}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()
