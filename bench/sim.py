"""Simulator benchmark and the long runs behind docs/simulation.md (issue 23).

Sections (`--only NAME[,NAME]`, default all):

speed     the paper-32k preset: a 15-day trace replayed for the three schemes (goal <= 30 s) and
          the 0-0.4% static sweep with 100 placements (goal <= 60 s); prints what they computed.
headroom  NTP-PW loss as a function of the rack budget (1.00-1.30 x the GPUs' nominal sum), for
          the paper's measured power curve and speed = power^0.7, with the per-layer unit work
          rule and with proportional work (the paper's); at 0.1% and 0.4% failed. Writes the
          figure docs/img/ntp-pw-headroom.png.
abstract  what reproduces the abstract's "~10% at 0.1% failed for large TP": repacking vs no
          repacking (a failure idles the whole pipeline replica), NVL64/TP64 and NVL72/TP64 with
          its leftover GPUs, and where the leftovers stop hiding failures.
steptime  per-GPU utilisation of the best layout per scale-up domain size at 32K GPUs (the
          paper: 87% NVL32 vs 68% NVL8), its sensitivity to the stated inputs, and the loss of
          each scheme when the step model sets the reduced batch (the paper's layout).
stall     effective training time (throughput x time not stalled) over a 15-day trace for every
          scheme x stall model (restart, FT-HSDP, live) at 32K and 100K GPUs.

Machine and date go with the results into bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ntp_manager.planner import PAPER_POWER_CURVE, PowerModel, Scheme
from ntp_manager.planner.steptime import Hardware, ModelShape, best_layout
from ntp_manager.sim import FailureModel, SimSetup, make_trace, preset, preset_cluster, replay, static_sweep
from ntp_manager.sim.presets import PAPER_STEP
from ntp_manager.sim.stall import STALL_PRESETS

ROOT = Path(__file__).resolve().parent.parent
console = Console(width=140)


def pct(x: float, digits: int = 2) -> str:
    return f"{100 * x:.{digits}f}%"


# ---- speed ---------------------------------------------------------------------------------------


def speed(placements: int) -> dict[str, Any]:
    p = preset("paper-32k")
    setup = SimSetup.create(preset_cluster(p), p.job, p.model)
    schemes = list(Scheme)
    t0 = time.perf_counter()
    trace = make_trace(setup, 15, seed=0, warmup_days=6)
    stats = replay(setup, trace, [(s, 0) for s in schemes])
    trace_s = time.perf_counter() - t0
    fractions = [i * 0.0005 for i in range(9)]
    t0 = time.perf_counter()
    points = static_sweep(setup, schemes, fractions, placements, seed=0)
    sweep_s = time.perf_counter() - t0
    table = Table(title="simulator speed (paper-32k, 32,768 GPUs)")
    for col in ("run", "work", "wall s", "goal s"):
        table.add_column(col, justify="right")
    table.add_row("15-day trace, 3 schemes", f"{len(trace.events)} events x 3 plans", f"{trace_s:.1f}", "30")
    table.add_row("0-0.4% sweep, 3 schemes", f"9 points x {placements} placements x 3 plans", f"{sweep_s:.1f}", "60")
    console.print(table)
    res = Table(title="static sweep (mean, max in brackets) and 15-day mean throughput")
    for col in ("failed", "dp-drop", "ntp", "ntp-pw", "hit domains"):
        res.add_column(col, justify="right")
    by = {(pt.fraction, pt.scheme): pt for pt in points}
    for f in fractions:
        res.add_row(pct(f), *[f"{pct(by[(f, s)].mean_loss)} ({pct(by[(f, s)].max_loss)})" for s in schemes],
                    pct(1 - (1 - f) ** 32))
    res.add_row("15-day mean throughput", *[pct(s.mean_throughput) for s in stats], "")
    console.print(res)
    return {
        "trace_s": trace_s, "sweep_s": sweep_s,
        "sweep": [{"fraction": pt.fraction, "scheme": pt.scheme.value, "mean": pt.mean_loss, "max": pt.max_loss}
                  for pt in points],
        "trace_mean": {s.scheme.value: s.mean_throughput for s in stats},
    }


# ---- headroom -------------------------------------------------------------------------------------

HEADROOMS = [round(1.0 + 0.01 * i, 2) for i in range(31)]


def headroom(placements: int, plot: bool) -> dict[str, Any]:
    p = preset("paper-32k")
    cluster = preset_cluster(p)
    curves = {"paper curve": PAPER_POWER_CURVE, "power^0.7": ()}
    fractions = [0.001, 0.004]
    out: dict[str, Any] = {"headrooms": HEADROOMS, "series": {}}
    ntp_ref: dict[str, list[float]] = {}
    for balance in ("layer", "stage"):
        job = dataclasses.replace(p.job, balance=balance)
        setup = SimSetup.create(cluster, job, p.model)
        ntp_ref[balance] = [pt.mean_loss for pt in static_sweep(setup, [Scheme.NTP], fractions, placements, 0)]
        for cname, curve in curves.items():
            losses: dict[float, list[float]] = {f: [] for f in fractions}
            for h in HEADROOMS:
                pm = PowerModel(max_boost=1.3, rack_headroom=h, curve=curve)
                s2 = SimSetup.create(cluster, dataclasses.replace(job, power=pm), p.model)
                for pt in static_sweep(s2, [Scheme.NTP_PW], fractions, placements, 0):
                    losses[pt.fraction].append(pt.mean_loss)
            out["series"][f"{cname}, {balance}"] = {str(f): v for f, v in losses.items()}
            console.print(f"headroom: {cname}, work per {balance} done", highlight=False)
    out["ntp"] = {b: {str(f): v for f, v in zip(fractions, ls, strict=True)} for b, ls in ntp_ref.items()}
    table = Table(title=f"NTP-PW mean loss vs rack budget (paper-32k, {placements} placements); ntp for reference")
    table.add_column("rack budget x nominal", justify="right")
    keys = list(out["series"])
    for k in keys:
        for f in fractions:
            table.add_column(f"{k} @{pct(f, 1)}", justify="right")
    for i, h in enumerate(HEADROOMS):
        if round(h * 100) % 2 and h not in (1.13, 1.15, 1.17):
            continue
        table.add_row(f"{h:.2f}", *[pct(out["series"][k][str(f)][i]) for k in keys for f in fractions])
    table.add_row("ntp", *[pct(out["ntp"][k.split(", ")[1]][str(f)]) for k in keys for f in fractions])
    console.print(table)
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120, sharey=True)
        styles = {"paper curve": "-", "power^0.7": "--"}
        colors = {"layer": "#1f77b4", "stage": "#2ca02c"}
        for ax, f in zip(axes, fractions, strict=True):
            for k in keys:
                cname, balance = k.split(", ")
                label = f"{cname}, {'unit work per layer' if balance == 'layer' else 'proportional work (paper)'}"
                ax.plot(HEADROOMS, [100 * x for x in out["series"][k][str(f)]], styles[cname], color=colors[balance],
                        label=label, marker="o", markersize=2.5)
            for balance, color in colors.items():
                ax.axhline(100 * out["ntp"][balance][str(f)], color=color, linestyle=":", linewidth=1)
            ax.axvline(1.15, color="grey", linestyle="-.", linewidth=1)
            ax.text(1.151, ax.get_ylim()[1] * 0.05 if ax.get_ylim()[1] else 0.1, "default 1.15", color="grey",
                    fontsize=8)
            ax.set_title(f"{pct(f, 1)} of GPUs failed (dotted: NTP without boost)")
            ax.set_xlabel("rack power budget (x the rack's nominal GPU power)")
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("NTP-PW throughput loss (%)")
        axes[1].legend(fontsize=8)
        fig.suptitle("paper-32k: NTP-PW loss vs rack headroom")
        fig.tight_layout()
        path = ROOT / "docs" / "img" / "ntp-pw-headroom.png"
        fig.savefig(path)
        plt.close(fig)
        console.print(f"figure written to {path}")
    return out


# ---- abstract -------------------------------------------------------------------------------------


def abstract(placements: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []

    def run(label: str, name: str, job_changes: dict[str, Any], packing: str, fractions: list[float],
            model: FailureModel | None = None) -> None:
        p = preset(name)
        job = dataclasses.replace(p.job, **job_changes)
        setup = SimSetup.create(preset_cluster(p), job, model or p.model, 0, packing)  # type: ignore[arg-type]
        gpus = job.tp * job.groups_per_replica
        for pt in static_sweep(setup, [Scheme.DP_DROP, Scheme.NTP], fractions, placements, 0):
            rows.append({"setup": label, "packing": packing, "fraction": pt.fraction, "scheme": pt.scheme.value,
                         "mean": pt.mean_loss, "max": pt.max_loss, "gpus_per_replica": gpus, "tp": job.tp})

    tp64 = {"min_tp": 56}
    run("NVL64, TP64, 1 stage", "uniform-tp64", tp64, "stable", [0.001])
    for P in (2, 8):
        ch = {**tp64, "groups_per_replica": P, "replicas": 512 // P, "local_batch": 2 * P}
        run(f"NVL64, TP64 x {P} stages", "uniform-tp64", ch, "stable", [0.001])
        run(f"NVL64, TP64 x {P} stages", "uniform-tp64", ch, "none", [0.001])
    run("NVL32, TP32 x 3 stages", "paper-32k", {"groups_per_replica": 3, "replicas": 341, "local_batch": 8}, "none",
        [0.001])
    run("NVL32, TP32 x 8 stages (paper-32k)", "paper-32k", {}, "stable", [0.001])
    run("NVL32, TP32 x 8 stages (paper-32k)", "paper-32k", {}, "none", [0.001])
    fr = [0.001, 0.01, 0.02, 0.03, 0.05, 0.08]
    run("NVL72, TP64 (nvl72-tp64)", "nvl72-tp64", {}, "stable", fr)
    run("NVL72, TP64, every failure a 4-GPU tray", "nvl72-tp64", {}, "stable", fr[:4], FailureModel(blast_node=1.0))
    run("NVL72, TP64 x 8 stages", "nvl72-tp64", {"groups_per_replica": 8, "replicas": 56, "local_batch": 16}, "none",
        fr[:5])
    table = Table(title=f"the abstract's ~10% at 0.1% failed ({placements} placements; closed form 1-(1-f)^n)")
    for col in ("setup", "repacking", "failed", "dp-drop mean (max)", "ntp mean (max)", "closed form, n = GPUs hit"):
        table.add_column(col, justify="right")
    by: dict[tuple[str, str, float], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["setup"], r["packing"], r["fraction"]), {})[r["scheme"]] = r
    for (label, packing, f), d in by.items():
        n = d["dp-drop"]["gpus_per_replica"] if packing == "none" else d["dp-drop"]["tp"]
        cf = "" if "NVL72" in label else f"{pct(1 - (1 - f) ** n)} (n={n})"
        table.add_row(label, "yes" if packing == "stable" else "no", pct(f, 1),
                      f"{pct(d['dp-drop']['mean'])} ({pct(d['dp-drop']['max'])})",
                      f"{pct(d['ntp']['mean'])} ({pct(d['ntp']['max'])})", cf)
    console.print(table)
    return {"rows": rows}


# ---- steptime -------------------------------------------------------------------------------------


def steptime(placements: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = ModelShape()
    base = Hardware()
    t1 = Table(title="best layout per scale-up domain at 32,768 GPUs, 1,024 x 16K-token sequences per step (B200)")
    for col in ("domain", "layout (TP x PP x DP, chunks, recompute)", "utilisation", "step s", "compute",
                "TP comm", "bubble", "PP sends", "DP sync", "memory GB"):
        t1.add_column(col, justify="right")
    out["domains"] = {}
    for d in (8, 16, 32, 64, 72):
        b = best_layout(model, base, 32_768, d, 1024)
        assert b is not None
        bd, lay = b.breakdown, b.layout
        out["domains"][d] = {"layout": dataclasses.asdict(lay), "utilisation": bd.utilisation, "step_s": bd.total}
        t1.add_row(f"NVL{d}", f"TP{lay.tp} x PP{lay.pp} x DP{lay.dp}, v{lay.interleave}, {lay.recompute}",
                   pct(bd.utilisation, 1), f"{bd.total:.2f}", f"{bd.compute:.2f}", f"{bd.tp_comm:.2f}",
                   f"{bd.bubble:.2f}", f"{bd.pp_comm:.3f}", f"{bd.dp_sync:.3f}", f"{bd.memory_bytes / 1e9:.0f}")
    console.print(t1)
    t2 = Table(title="sensitivity: utilisation NVL8 / NVL32 at 32K GPUs when one input changes")
    for col in ("input", "NVL8", "NVL32", "gap (points)"):
        t2.add_column(col, justify="right")
    changes: list[tuple[str, dict[str, Any]]] = [
        ("MFU 0.4", {"mfu": 0.4}), ("MFU 0.6", {"mfu": 0.6}), ("no comm-GEMM overlap", {"tp_overlap": 0.0}),
        ("half comm-GEMM overlap", {"tp_overlap": 0.5}), ("links at 60%", {"link_efficiency": 0.6}),
        ("links at 100%", {"link_efficiency": 1.0}), ("800 Gb/s NIC per GPU", {"scaleout_bw": 100e9}),
        ("NVLink 1.8 TB/s per direction", {"nvlink_bw": 1800e9}),
    ]
    variants = [("stated defaults", base)] + [(label, dataclasses.replace(base, **ch)) for label, ch in changes]
    out["sensitivity"] = {}
    for label, hw in variants:
        u8 = best_layout(model, hw, 32_768, 8, 1024)
        u32 = best_layout(model, hw, 32_768, 32, 1024)
        assert u8 is not None and u32 is not None
        a, b2 = u8.breakdown.utilisation, u32.breakdown.utilisation
        out["sensitivity"][label] = [a, b2]
        t2.add_row(label, pct(a, 1), pct(b2, 1), f"{100 * (b2 - a):.1f}")
    console.print(t2)
    # the paper's layout, and what the step model does to each scheme there
    p = preset("paper-32k")
    t3 = Table(title=f"paper layout TP32 x PP8 x DP128, 8 sequences per replica; loss with the step model "
                     f"({placements} placements)")
    for col in ("layout", "utilisation", "step s", "TP31 batch", "TP30", "TP28", "failed", "dp-drop", "ntp", "ntp-pw"):
        t3.add_column(col, justify="right")
    out["paper_layout"] = []
    for v in (12, 1):
        sm = dataclasses.replace(PAPER_STEP, layout=dataclasses.replace(PAPER_STEP.layout, interleave=v))
        job = dataclasses.replace(p.job, step_model=sm)
        bd = sm.breakdown(8)
        setup = SimSetup.create(preset_cluster(p), job, p.model)
        pts = static_sweep(setup, list(Scheme), [0.001, 0.004], placements, 0)
        by = {(pt.fraction, pt.scheme): pt.mean_loss for pt in pts}
        for f in (0.001, 0.004):
            t3.add_row(f"v = {v}", pct(bd.utilisation, 1), f"{bd.total:.2f}", str(job.reduced_batch(31)),
                       str(job.reduced_batch(30)), str(job.reduced_batch(28)), pct(f, 1),
                       *[pct(by[(f, s)]) for s in Scheme])
        out["paper_layout"].append({"interleave": v, "utilisation": bd.utilisation, "step_s": bd.total,
                                    "losses": {f"{s.value}@{f}": by[(f, s)] for f in (0.001, 0.004) for s in Scheme}})
    console.print(t3)
    return out


# ---- stall ----------------------------------------------------------------------------------------


def stall(seeds: int) -> dict[str, Any]:
    models = ["none", "restart", "ft-hsdp", "live"]
    slow_regroup = dataclasses.replace(STALL_PRESETS["live"], name="live, regroup 30 s", regroup_s=30.0)
    out: dict[str, Any] = {"rows": []}
    table = Table(title="effective training time over 15 days (throughput x time not stalled), mean over seeds")
    for col in ("GPUs", "stall model", "scheme", "throughput", "stalled", "effective", "changes", "stall per change s"):
        table.add_column(col, justify="right")
    for name in ("paper-32k", "paper-100k"):
        p = preset(name)
        setup = SimSetup.create(preset_cluster(p), p.job, p.model)
        traces = [make_trace(setup, 15, seed=s, warmup_days=6) for s in range(seeds if name == "paper-32k" else 1)]
        for mname in [*models, "live, regroup 30 s"]:
            model = slow_regroup if mname == "live, regroup 30 s" else STALL_PRESETS[mname]
            t0 = time.perf_counter()
            acc: dict[str, list[Any]] = {s.value: [] for s in Scheme}
            for tr in traces:
                for st in replay(setup, tr, [(s, 0) for s in Scheme], stall=model, step_s=p.step_s):
                    acc[st.scheme.value].append(st)
            for scheme, sts in acc.items():
                k = len(sts)
                thr = sum(s.mean_throughput for s in sts) / k
                stl = sum(s.stalled_share for s in sts) / k
                eff = sum(s.effective_throughput for s in sts) / k
                ch = sum(s.changes for s in sts) / k
                per = stl * 15 * 24 * 3600 / ch if ch else 0.0
                out["rows"].append({"preset": name, "gpus": setup.n_gpus, "stall": mname, "scheme": scheme,
                                    "throughput": thr, "stalled": stl, "effective": eff, "changes": ch,
                                    "stall_per_change_s": per, "seeds": k})
                table.add_row(f"{setup.n_gpus:,}", mname, scheme, pct(thr), pct(stl, 3), pct(eff), f"{ch:.0f}",
                              f"{per:.1f}")
            console.print(f"{name} / {mname}: {time.perf_counter() - t0:.0f} s", highlight=False)
    console.print(table)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="speed,headroom,abstract,steptime,stall")
    ap.add_argument("--placements", type=int, default=100, help="speed: static placements")
    ap.add_argument("--sens-placements", type=int, default=20, help="headroom/abstract/steptime placements")
    ap.add_argument("--seeds", type=int, default=3, help="stall: 15-day traces at 32K (one at 100K)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--json", type=Path)
    args, _ = ap.parse_known_args()
    results: dict[str, Any] = {}
    for name in args.only.split(","):
        t0 = time.perf_counter()
        console.rule(name)
        if name == "speed":
            results[name] = speed(args.placements)
        elif name == "headroom":
            results[name] = headroom(args.sens_placements, not args.no_plot)
        elif name == "abstract":
            results[name] = abstract(args.sens_placements)
        elif name == "steptime":
            results[name] = steptime(args.sens_placements)
        elif name == "stall":
            results[name] = stall(args.seeds)
        else:
            raise SystemExit(f"unknown section {name!r}")
        console.print(f"{name}: {time.perf_counter() - t0:.0f} s wall", highlight=False)
    console.print(f"machine: {platform.machine()}, python {platform.python_version()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
