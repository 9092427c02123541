"""`ntp-manager simulate`: what would failures cost this cluster under each scheme?

Static mode (default): sweep failed fractions with random placements.
Trace mode (`--days`): event-driven failures and repairs at the model's rates.
Multi-job mode (`--jobs PRESET`): several jobs on one cluster and one trace, private spares
against the shared pool (sim/multijob.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ntp_manager.cli.common import fail
from ntp_manager.planner import PAPER_POWER_CURVE, JobSpec, PlanError, Scheme
from ntp_manager.sim import (
    PRESETS,
    SimError,
    SimSetup,
    make_trace,
    min_spares_never_pause,
    preset,
    preset_cluster,
    replay,
    static_sweep,
)
from ntp_manager.sim.engine import healthy_step_s
from ntp_manager.sim.failures import FailureModel
from ntp_manager.sim.multijob import MultiResult, MultiSetup, pool_needed, private_spares_needed, run
from ntp_manager.sim.presets import MULTI_PRESETS, PAPER_STEP, Preset, multi_preset, multi_setup
from ntp_manager.sim.stall import StallModel, stall_preset
from ntp_manager.specfile import SpecError, load_cluster, load_job
from ntp_manager.topology import Cluster, PowerLimits, TopologyError

DEFAULT_SWEEP = "0:0.004:9"


def parse_fractions(text: str) -> list[float]:
    """'a,b,c' or 'start:stop:count' (inclusive)."""
    try:
        if ":" in text:
            a, b, n = text.split(":")
            count = int(n)
            if count < 1:
                raise ValueError
            values = [float(x) for x in np.linspace(float(a), float(b), count)]
        else:
            values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SimError(f"--failed-fraction {text!r}: use 'a,b,c' or 'start:stop:count'") from None
    if not values:
        raise SimError("--failed-fraction: no values")
    for v in values:
        if not 0 <= v < 1:
            raise SimError(f"failed fraction must be in [0, 1), got {v}")
    return values


def parse_power(text: str | None) -> PowerLimits:
    """'DEFAULT,MIN,MAX' in watts -> PowerLimits (None: the presets' 1000 W, 200-1300 W)."""
    if text is None:
        return PowerLimits()
    try:
        default, lo, hi = (float(x) for x in text.split(","))
        return PowerLimits(default, lo, hi)
    except ValueError as e:
        raise SimError(f"--gpu-power {text!r}: use 'DEFAULT,MIN,MAX' watts with 0 < MIN <= DEFAULT <= MAX ({e})") \
            from None


def parse_ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SimError(f"{what} {text!r}: use a comma-separated list of integers") from None
    if not values or any(v < 0 for v in values):
        raise SimError(f"{what} must be non-negative integers")
    return values


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True, disable=not console.is_terminal,
    )


def parse_power_curve(text: str) -> dict[str, Any]:
    """'paper' | 'law:EXPONENT' | 'P:S,P:S,...' (power ratio : speed ratio) -> PowerModel fields."""
    t = text.strip()
    if t == "paper":
        return {"curve": PAPER_POWER_CURVE}
    try:
        if t.startswith("law:"):
            return {"curve": (), "exponent": float(t[4:])}
        points = tuple((float(a), float(b)) for a, b in (x.split(":") for x in t.split(",") if x.strip()))
    except ValueError:
        raise SimError(
            f"--power-curve {text!r}: use 'paper', 'law:EXPONENT' or 'P:S,P:S,...' (power ratio:speed ratio)"
        ) from None
    return {"curve": points}


# Options that only mean something in one mode: (flag, what it applies to). Given in the other mode
# they would be ignored, so the command refuses them instead.
_TRACE_ONLY = {
    "fixed_minibatch": "--fixed-minibatch",
    "find_spares": "--find-spares",
    "seeds": "--seeds",
    "warmup_days": "--warmup-days",
    "repair_days": "--repair-days",
    "software_repair_hours": "--software-repair-hours",
    "rate_multiplier": "--rate-multiplier",
    "failure_rate": "--failure-rate",
    "stall": "--stall",
    "step_seconds": "--step-seconds",
}
_STATIC_ONLY = {"failed_fraction": "--failed-fraction", "placements": "--placements"}


def refuse_inert_options(given: dict[str, Any], trace: bool, custom_cluster: bool) -> None:
    """Raise SimError naming the first option that would do nothing with the others given.

    `given` maps option names to their values, None where the option was not given."""
    if given.get("pool_size") is not None:
        raise SimError("--pool applies to multi-job mode (--jobs)")
    if trace:
        for name, flag in _STATIC_ONLY.items():
            if given.get(name) is not None:
                raise SimError(f"{flag} applies to the static sweep; trace mode (--days) does not use it")
    else:
        for name, flag in _TRACE_ONLY.items():
            if given.get(name) is not None:
                raise SimError(f"{flag} applies to trace mode (--days); the static sweep does not use it")
        spares = given.get("spares")
        if spares is not None and "," in spares:
            raise SimError("--spares takes one value in the static sweep (a list only in trace mode, --days)")
    if given.get("max_spares") is not None and not given.get("find_spares"):
        raise SimError("--max-spares bounds --find-spares; without it the option does nothing")
    if custom_cluster:
        if given.get("preset_name") is not None and given.get("job") is not None:
            raise SimError("--preset names a cluster and a job; with --cluster and --job it would do nothing")
        if given.get("gpu_power") is not None or given.get("base_cap") is not None:
            raise SimError(
                "--gpu-power and --base-cap apply to presets; with --cluster set "
                "defaults.tdp_w/min_w/max_w/base_cap in the cluster file"
            )


_POWER_ONLY = {
    "power_curve": "--power-curve",
    "rack_headroom": "--rack-headroom",
    "max_boost": "--max-boost",
    "gpu_power": "--gpu-power",
    "base_cap": "--base-cap",
}


def refuse_scheme_inert_options(given: dict[str, Any], schemes: list[Scheme], redo_steps: float) -> None:
    """Power options only act on ntp-pw; --step-seconds only on a stall model that redoes a step."""
    if Scheme.NTP_PW not in schemes:
        for name, flag in _POWER_ONLY.items():
            if given.get(name) is not None:
                raise SimError(f"{flag} only changes ntp-pw (power boost); add --scheme ntp-pw or drop it")
    if given.get("step_seconds") is not None and not redo_steps:
        raise SimError("--step-seconds is what a redone step costs; only --stall live redoes one")


def simulate(
    preset_name: Annotated[
        str | None, typer.Option("--preset", help=f"{' | '.join(PRESETS)} (default paper-32k)")
    ] = None,
    cluster: Annotated[Path | None, typer.Option("--cluster", help="cluster YAML instead of a preset")] = None,
    job: Annotated[Path | None, typer.Option("--job", help="job YAML instead of the preset's")] = None,
    scheme: Annotated[list[str] | None, typer.Option("--scheme", help="dp-drop | ntp | ntp-pw | all")] = None,
    failed_fraction: Annotated[
        str | None, typer.Option(help=f"static sweep: 'a,b,c' or 'start:stop:count' (default {DEFAULT_SWEEP})")
    ] = None,
    placements: Annotated[int | None, typer.Option(help="static sweep: random placements per point (100)")] = None,
    days: Annotated[float | None, typer.Option(help="trace mode: simulate this many days")] = None,
    spares: Annotated[str | None, typer.Option(help="spare TP groups (a comma list in trace mode); 0")] = None,
    fixed_minibatch: Annotated[
        bool | None, typer.Option("--fixed-minibatch", help="trace mode: pause while the global batch is below target")
    ] = None,
    find_spares: Annotated[
        bool | None, typer.Option("--find-spares", help="trace mode: fewest spares that never pause")
    ] = None,
    max_spares: Annotated[int | None, typer.Option(help="largest spare pool --find-spares considers (160)")] = None,
    seeds: Annotated[int | None, typer.Option(help="trace mode: number of traces (seed, seed+1, ...); 1")] = None,
    warmup_days: Annotated[
        float | None, typer.Option(help="trace mode: run this long first (default 2x hardware repair)")
    ] = None,
    repair_days: Annotated[float | None, typer.Option(help="trace mode: hardware repair time in days")] = None,
    software_repair_hours: Annotated[
        float | None, typer.Option(help="trace mode: software repair time in hours")
    ] = None,
    rate_multiplier: Annotated[float | None, typer.Option(help="trace mode: multiply the per-GPU failure rate")] = None,
    failure_rate: Annotated[
        float | None, typer.Option(help="trace mode: failures per GPU-hour (default Llama 3)")
    ] = None,
    blast_node: Annotated[float, typer.Option(help="probability a failure takes its node")] = 0.0,
    blast_domain: Annotated[float, typer.Option(help="probability a failure takes its domain")] = 0.0,
    gpu_power: Annotated[
        str | None, typer.Option(help="preset GPUs' power limits 'DEFAULT,MIN,MAX' in watts (H100: 700,200,700)")
    ] = None,
    base_cap: Annotated[
        float | None, typer.Option(help="fleet base power cap, a share of each GPU's maximum limit, in (0, 1]")
    ] = None,
    power_curve: Annotated[
        str | None,
        typer.Option(help="speed vs power: 'paper' (measured 1.1x->1.069x, 1.2x->1.122x), 'law:0.7', 'P:S,...'"),
    ] = None,
    rack_headroom: Annotated[
        float | None, typer.Option(help="rack power budget as a multiple of its GPUs' nominal sum")
    ] = None,
    max_boost: Annotated[float | None, typer.Option(help="highest per-GPU power, a multiple of nominal")] = None,
    stall: Annotated[
        str | None,
        typer.Option(help="trace mode: what a layout change costs: none | restart | ft-hsdp | live"),
    ] = None,
    step_seconds: Annotated[
        float | None, typer.Option(help="trace mode: healthy step time for the stall model (default: the job's)")
    ] = None,
    step_model: Annotated[
        str | None,
        typer.Option(help="'paper': size reduced replicas and throughput by the 480B-on-B200 step model "
                          "(TP32 x 8 stages, 12 interleaved chunks); 'paper-v1': without interleaving"),
    ] = None,
    packing: Annotated[
        str, typer.Option(help="stable (the resource manager repacks) | none (home replicas stay: no manager)")
    ] = "stable",
    jobs: Annotated[str | None, typer.Option(help=f"multi-job mode: {' | '.join(MULTI_PRESETS)}")] = None,
    pool_size: Annotated[int | None, typer.Option("--pool", help="multi-job mode: spare domains")] = None,
    seed: Annotated[int, typer.Option(help="random seed")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print results as JSON")] = False,
    plot: Annotated[Path | None, typer.Option(help="write a PNG plot here")] = None,
) -> None:
    """Simulate failures against the real planner: static sweeps or event-driven traces.

    An option that would do nothing with the others given (a trace option in a static sweep, a
    preset option with a custom cluster) is refused, not ignored."""
    given, console = dict(locals()), Console(stderr=as_json)
    if jobs is not None:
        run_multi(console, given)
        return
    trace_mode = days is not None
    try:
        _refuse_non_finite(given)
        refuse_inert_options(given, trace_mode, cluster is not None)
        p = preset(preset_name or "paper-32k")
        model = _failure_model(p.model, rate_multiplier, blast_node, blast_domain, failure_rate, repair_days,
                               software_repair_hours)
        schemes = _schemes(scheme)
        refuse_scheme_inert_options(given, schemes, stall_preset(stall or "none").redo_steps)
        spare_list = parse_ints(spares or "0", "--spares")
        n_placements, n_seeds = _at_least_one(placements, 100, "--placements"), _at_least_one(seeds, 1, "--seeds")
        if plot is not None and not plot.parent.is_dir():  # before the run, not after it
            raise SimError(f"--plot {plot}: no such directory {plot.parent}")
        pool = max(max(spare_list), (160 if max_spares is None else max_spares) if find_spares else 0)
        job_spec = _job_spec(load_job(job) if job else p.job, power_curve, rack_headroom, max_boost, step_model)
        c, name = _cluster(p, cluster, job_spec, job is not None, pool, gpu_power, base_cap)
        if packing not in ("stable", "none"):
            raise SimError(f"--packing must be 'stable' or 'none', got {packing!r}")
        setup = SimSetup.create(c, job_spec, model, pool, packing)  # type: ignore[arg-type]
        if Scheme.NTP_PW in schemes:
            console.print(f"ntp-pw power model: {job_spec.power.describe()}", highlight=False)
        if not trace_mode:
            fractions = parse_fractions(failed_fraction or DEFAULT_SWEEP)
            result = _run_static(console, setup, schemes, fractions, n_placements, seed, spare_list[0], plot, name)
        else:
            assert days is not None
            if days <= 0:
                raise SimError(f"--days must be positive, got {days}")
            warm = 2 * model.hardware_repair_h / 24 if warmup_days is None else warmup_days
            stall_model = stall_preset(stall or "none")
            step_s = _stall_step_s(stall_model, step_seconds, job_spec, None if job or cluster else p.step_s)
            result = _run_trace(
                console, setup, schemes, days, warm, seed, n_seeds, spare_list, bool(fixed_minibatch),
                bool(find_spares), plot, name, stall_model, step_s,
            )
    except (SimError, PlanError, SpecError, TopologyError) as e:
        fail(str(e))
    result["model"] = dataclasses.asdict(model)
    result["power"] = {"gpu_power": gpu_power, "base_cap": base_cap, "model": dataclasses.asdict(job_spec.power),
                       "describe": job_spec.power.describe()}
    result.update(preset=p.name if not (cluster or job) else None, name=name)
    if as_json:
        sys.stdout.write(json.dumps(result, indent=2) + "\n")


def _refuse_non_finite(given: dict[str, Any]) -> None:
    """nan ran a trace forever; inf and nan made meaningless tables."""
    for name, value in given.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise SimError(f"--{name.replace('_', '-')} must be a finite number, got {value}")


def _at_least_one(value: int | None, default: int, flag: str) -> int:
    n = default if value is None else value
    if n < 1:
        raise SimError(f"{flag} must be >= 1")
    return n


def _cluster(p: Preset, cluster: Path | None, job_spec: JobSpec, custom_job: bool, pool: int, gpu_power: str | None,
             base_cap: float | None) -> tuple[Cluster, str]:
    """The cluster file given, else the preset's cluster sized for the spare pool; and its name."""
    if cluster:
        c = load_cluster(cluster)
        return c, f"job {job_spec.name} on cluster {c.name}"
    per_domain = p.domain_size // job_spec.tp if job_spec.tp <= p.domain_size else 1
    power = parse_power(gpu_power).with_base_cap(base_cap)
    c = preset_cluster(p, -(-pool // max(per_domain, 1)), power)
    return c, p.name if not custom_job else f"job {job_spec.name} on preset {p.name}'s cluster"


def _failure_model(base: FailureModel, rate_multiplier: float | None, blast_node: float, blast_domain: float,
                   failure_rate: float | None, repair_days: float | None,
                   software_repair_hours: float | None) -> FailureModel:
    """The preset's failure model (`base`) with the options given on the command line."""
    model = dataclasses.replace(
        base,
        rate_multiplier=base.rate_multiplier if rate_multiplier is None else rate_multiplier,
        blast_node=blast_node,
        blast_domain=blast_domain,
        rate_per_gpu_hour=base.rate_per_gpu_hour if failure_rate is None else failure_rate,
        hardware_repair_h=base.hardware_repair_h if repair_days is None else repair_days * 24,
        software_repair_h=base.software_repair_h if software_repair_hours is None else software_repair_hours,
    )
    model.validate()
    return model


def _job_spec(job_spec: JobSpec, power_curve: str | None, rack_headroom: float | None, max_boost: float | None,
              step_model: str | None) -> JobSpec:
    """The job with the power and step-model options given on the command line."""
    power_fields: dict[str, Any] = {}
    if power_curve is not None:
        power_fields.update(parse_power_curve(power_curve))
    if rack_headroom is not None:
        power_fields["rack_headroom"] = rack_headroom
    if max_boost is not None:
        power_fields["max_boost"] = max_boost
    if power_fields:
        job_spec = dataclasses.replace(job_spec, power=dataclasses.replace(job_spec.power, **power_fields))
    if step_model is not None:
        if step_model not in ("paper", "paper-v1"):
            raise SimError(f"--step-model must be 'paper' or 'paper-v1', got {step_model!r}")
        sm = PAPER_STEP if step_model == "paper" else dataclasses.replace(
            PAPER_STEP, layout=dataclasses.replace(PAPER_STEP.layout, interleave=1))
        job_spec = dataclasses.replace(job_spec, step_model=sm)
        job_spec.validate()
    return job_spec


def _stall_step_s(stall_model: StallModel, step_seconds: float | None, job_spec: JobSpec,
                  preset_step_s: float | None) -> float:
    """The healthy step time the stall model charges for a redone step: --step-seconds, else the
    job's step model, else the preset's (`preset_step_s`, None with a custom job or cluster)."""
    step_s = step_seconds if step_seconds is not None else healthy_step_s(job_spec)
    if step_s is None:
        step_s = preset_step_s
    if stall_model.redo_steps and step_s is None:
        raise SimError(f"--stall {stall_model.name} redoes a step: give --step-seconds (the job has no step model)")
    if step_seconds is not None and step_seconds < 0:
        raise SimError("--step-seconds must be >= 0")
    return step_s or 0.0


def _schemes(names: list[str] | None) -> list[Scheme]:
    if not names or "all" in names:
        return list(Scheme)
    out = []
    for n in names:
        try:
            out.append(Scheme(n))
        except ValueError:
            raise SimError(f"unknown scheme {n!r}; choose dp-drop, ntp, ntp-pw or all") from None
    return out


def _run_static(
    console: Console, setup: SimSetup, schemes: list[Scheme], fractions: list[float], placements: int,
    seed: int, spares: int, plot: Path | None, name: str,
) -> dict[str, Any]:
    with _progress(console) as prog:
        task = prog.add_task("placements", total=len(fractions) * placements)
        points = static_sweep(
            setup, schemes, fractions, placements, seed, spares, progress=lambda n: prog.advance(task, n)
        )
    table = Table(title=f"throughput loss vs failed fraction ({name}, {placements} placements, spares {spares})")
    table.add_column("failed %", justify="right")
    table.add_column("failed GPUs", justify="right")
    T = setup.job.tp
    table.add_column(f"hit groups 1-(1-f)^{T}", justify="right")
    for s in schemes:
        table.add_column(f"{s.value} mean (max)", justify="right")
    by = {(pt.fraction, pt.scheme): pt for pt in points}
    for f in fractions:
        row = [f"{100 * f:.3f}", str(by[(f, schemes[0])].failed_gpus), f"{100 * (1 - (1 - f) ** T):.2f}%"]
        row += [f"{100 * by[(f, s)].mean_loss:.2f}% ({100 * by[(f, s)].max_loss:.2f}%)" for s in schemes]
        table.add_row(*row)
    console.print(table)
    if plot:
        from ntp_manager.sim.plots import plot_static

        try:
            plot_static(points, plot, f"{name}: throughput loss vs failed GPUs")
        except OSError as e:
            raise SimError(f"--plot {plot}: cannot write ({e.strerror})") from None
        console.print(f"plot written to {plot}")
    return {
        "mode": "static",
        "placements": placements,
        "seed": seed,
        "spares": spares,
        "points": [
            {"fraction": pt.fraction, "failed_gpus": pt.failed_gpus, "scheme": pt.scheme.value,
             "mean_loss": pt.mean_loss, "max_loss": pt.max_loss, "min_loss": min(pt.losses)}
            for pt in points
        ],
    }


def _run_trace(
    console: Console, setup: SimSetup, schemes: list[Scheme], days: float, warmup: float, seed: int, seeds: int,
    spare_list: list[int], fixed: bool, find: bool, plot: Path | None, name: str,
    stall: StallModel | None = None, step_s: float = 0.0,
) -> dict[str, Any]:
    traces = [make_trace(setup, days, seed + k, warmup) for k in range(seeds)]
    configs = [(s, sp) for s in schemes for sp in spare_list]
    runs: list[dict[str, Any]] = []
    with _progress(console) as prog:
        total = sum(len(t.events) for t in traces) * (1 + (len(schemes) if find else 0))
        task = prog.add_task(f"{seeds} trace(s) of {days:g} days", total=total)
        for k, tr in enumerate(traces):
            stats = replay(setup, tr, configs, fixed, progress=lambda n: prog.advance(task, n), stall=stall,
                           step_s=step_s)
            needed = {}
            if find:
                for s in schemes:
                    needed[s.value] = min_spares_never_pause(setup, tr, s, progress=lambda n: prog.advance(task, n))
            runs.append({"seed": seed + k, "trace": tr, "stats": stats, "spares_needed": needed})

    mtbf = 1 / (setup.model.effective_rate * setup.n_gpus)
    console.print(
        f"{name}: {setup.n_gpus:,} simulated GPUs, a failure every {mtbf:.2f} h on average, hardware repair "
        f"{setup.model.hardware_repair_h / 24:g} d, software repair {setup.model.software_repair_h:g} h, "
        f"steady-state failed fraction ~{100 * setup.model.steady_state_failed_fraction():.3f}%; "
        f"warm-up {warmup:g} d before the window"
    )
    t1 = Table(title=f"traces ({days:g} days)")
    for col in ("seed", "failures", "peak failed GPUs", "time with > 0.1% failed"):
        t1.add_column(col, justify="right")
    for r in runs:
        tr = r["trace"]
        t1.add_row(str(r["seed"]), str(tr.failures), str(tr.peak_failed()), f"{100 * tr.time_share_above(0.001):.1f}%")
    console.print(t1)
    t2 = Table(title="throughput over the trace" + (" (fixed minibatch)" if fixed else ""))
    # In fixed-minibatch mode a plan below the target batch pauses training; otherwise it trains on a
    # smaller batch, and the column says how long that lasted.
    below = "paused" if fixed else "time below target batch"
    stalls = stall is not None and stall.name != "none"
    cols = ["seed", "scheme", "spares", "mean throughput", "min", below, "per-GPU throughput"]
    if stalls:
        cols += ["changes", "stalled", "effective"]
    for col in cols:
        t2.add_column(col, justify="right")
    for r in runs:
        for s in r["stats"]:
            row = [
                str(r["seed"]), s.scheme.value, str(s.spares), f"{100 * s.mean_throughput:.2f}%",
                f"{100 * s.min_throughput:.2f}%", f"{100 * s.paused_share:.2f}%", f"{100 * s.per_gpu_throughput:.2f}%",
            ]
            if stalls:
                row += [str(s.changes), f"{100 * s.stalled_share:.3f}%", f"{100 * s.effective_throughput:.2f}%"]
            t2.add_row(*row)
    if stalls:
        assert stall is not None
        console.print(f"stall model {stall.name}: {stall}; healthy step {step_s:.2f} s", highlight=False)
    console.print(t2)
    if find:
        t3 = Table(title="spare groups needed never to pause (fixed minibatch)")
        t3.add_column("scheme")
        for r in runs:
            t3.add_column(f"seed {r['seed']}", justify="right")
        t3.add_column("max", justify="right")
        for s in schemes:
            vals = [r["spares_needed"][s.value] for r in runs]
            shown = ["> max" if v is None else str(v) for v in vals]
            worst = "> max" if any(v is None for v in vals) else str(max(vals))
            t3.add_row(s.value, *shown, worst)
        console.print(t3)
    if plot:
        from ntp_manager.sim.plots import plot_trace

        try:
            plot_trace(runs[0]["trace"], runs[0]["stats"], plot,
                       f"{name}: {days:g}-day trace, seed {runs[0]['seed']}")
        except OSError as e:
            raise SimError(f"--plot {plot}: cannot write ({e.strerror})") from None
        console.print(f"plot written to {plot}")
    return {
        "mode": "trace",
        "days": days,
        "warmup_days": warmup,
        "fixed_minibatch": fixed,
        "runs": [
            {
                "seed": r["seed"],
                "failures": r["trace"].failures,
                "peak_failed_gpus": r["trace"].peak_failed(),
                "time_share_above_0.1pct": r["trace"].time_share_above(0.001),
                "stats": [
                    {"scheme": s.scheme.value, "spares": s.spares, "mean_throughput": s.mean_throughput,
                     "min_throughput": s.min_throughput, "paused_share": s.paused_share,
                     "per_gpu_throughput": s.per_gpu_throughput, "replans": s.replans, "stall": s.stall,
                     "changes": s.changes, "stalled_share": s.stalled_share,
                     "effective_throughput": s.effective_throughput}
                    for s in r["stats"]
                ],
                "spares_needed": r["spares_needed"],
            }
            for r in runs
        ],
    }


# ---- multi-job mode -------------------------------------------------------------------------------

# What `--jobs` leaves out: a preset's or file's single job, the static sweep, the single-job trace's
# spares and stalls, and the power options (the jobs carry the presets' power model).
_NOT_MULTI = {
    "preset_name": "--preset", "cluster": "--cluster", "job": "--job", "failed_fraction": "--failed-fraction",
    "placements": "--placements", "spares": "--spares (use --pool)", "fixed_minibatch": "--fixed-minibatch",
    "seeds": "--seeds", "step_model": "--step-model",
    "gpu_power": "--gpu-power", "base_cap": "--base-cap", "power_curve": "--power-curve",
    "rack_headroom": "--rack-headroom", "max_boost": "--max-boost",
}


def refuse_multi_options(given: dict[str, Any]) -> None:
    """Raise SimError naming the first option multi-job mode would ignore, or a bad value."""
    for name, flag in _NOT_MULTI.items():
        if given.get(name) is not None:
            raise SimError(f"{flag} does not apply to multi-job mode (--jobs)")
    if given.get("packing") != "stable":
        raise SimError("--packing does not apply to multi-job mode (--jobs): the jobs are repacked")
    if given.get("max_spares") is not None and not given.get("find_spares"):
        raise SimError("--max-spares bounds --find-spares; without it the option does nothing")
    if len(given.get("scheme") or []) > 1:
        raise SimError("multi-job mode takes one --scheme (applied to every job)")
    if given.get("find_spares") and given.get("stall") not in (None, "none"):
        raise SimError("--find-spares compares effective times without stalls; drop --stall or --find-spares")


def run_multi(console: Console, given: dict[str, Any]) -> None:
    """`simulate --jobs`: both policies over one trace, the table, the searches, the plot."""
    console = Console(stderr=bool(given["as_json"]), width=max(180, console.width))  # up to 15 columns
    try:
        _refuse_non_finite(given)
        refuse_multi_options(given)
        mp = multi_preset(given["jobs"])
        model = _failure_model(mp.model, given["rate_multiplier"], given["blast_node"], given["blast_domain"],
                               given["failure_rate"], given["repair_days"], given["software_repair_hours"])
        mp = dataclasses.replace(mp, model=model)
        if given["scheme"]:
            s = _schemes(given["scheme"])
            if len(s) != 1:
                raise SimError("multi-job mode takes one --scheme (applied to every job)")
            mp = dataclasses.replace(mp, jobs=tuple(
                dataclasses.replace(e, job=dataclasses.replace(e.job, scheme=s[0])) for e in mp.jobs))
        plot: Path | None = given["plot"]
        if plot is not None and not plot.parent.is_dir():
            raise SimError(f"--plot {plot}: no such directory {plot.parent}")
        days = 15.0 if given["days"] is None else given["days"]
        if days <= 0:
            raise SimError(f"--days must be positive, got {days}")
        warm = 2 * model.hardware_repair_h / 24 if given["warmup_days"] is None else given["warmup_days"]
        setup = multi_setup(mp, given["pool_size"])
        stall = stall_preset(given["stall"] or "none")
        if given["step_seconds"] is not None and not stall.redo_steps:
            raise SimError("--step-seconds is what a redone step costs; only --stall live redoes one")
        step_s = _stall_step_s(stall, given["step_seconds"], mp.jobs[0].job, mp.step_s)
        result = _multi_runs(console, setup, days, warm, given["seed"], bool(given["find_spares"]),
                             given["max_spares"], stall if stall.name != "none" else None, step_s)
        _multi_tables(console, setup, result)
        if plot is not None:
            from ntp_manager.sim.plots import plot_multijob

            try:
                plot_multijob(result["private"], result["shared"], setup, plot,
                              f"{mp.name}: {days:g}-day trace, seed {given['seed']}")
            except OSError as e:
                raise SimError(f"--plot {plot}: cannot write ({e.strerror})") from None
            console.print(f"plot written to {plot}")
    except (SimError, PlanError, TopologyError) as e:
        fail(str(e))
    if given["as_json"]:
        sys.stdout.write(json.dumps(_multi_json(mp.name, setup, result), indent=2) + "\n")


def _multi_runs(console: Console, setup: MultiSetup, days: float, warm: float, seed: int, find: bool,
                max_spares: int | None, stall: StallModel | None, step_s: float) -> dict[str, Any]:
    trace = make_trace(setup.sim, days, seed, warm)
    out: dict[str, Any] = {"trace": trace, "days": days, "warmup_days": warm, "seed": seed, "stall": stall,
                           "step_s": step_s}
    with _progress(console) as prog:
        task = prog.add_task(f"2 policies over {len(trace.events)} events", total=2 * len(trace.events))
        for policy in ("private", "shared"):
            out[policy] = run(setup, trace, policy, progress=lambda n: prog.advance(task, n), stall=stall,
                              step_s=step_s)
        if find:
            search = prog.add_task("searching for equal effective time (replays)", total=None)

            def tick(n: int) -> None:
                prog.advance(search, n)

            private: MultiResult = out["private"]
            shared: MultiResult = out["shared"]
            cap = 4 * setup.pool if max_spares is None else max_spares
            goals = [r.effective for r in private.jobs]
            cache = {setup.pool: shared}
            out["pool_needed"] = pool_needed(setup, trace, goals, _room(setup), tick, cache=cache)
            if any(e.preemptible for e in setup.jobs):
                kept = [None if e.preemptible else g for e, g in zip(setup.jobs, goals, strict=True)]
                out["pool_needed_kept"] = pool_needed(setup, trace, kept, _room(setup), tick, cache=cache)
            out["private_needed"] = [
                private_spares_needed(setup, trace, j, r.effective, cap, tick) for j, r in enumerate(shared.jobs)
            ]
            out["cap"] = cap
    return out


def _room(setup: MultiSetup) -> int:
    """The largest pool the cluster holds after the jobs' home domains."""
    return len(setup.cluster.domain_sizes) - sum(len(h) for h in setup.home)


def _gpus_of(setup: MultiSetup, j: int) -> int:
    return len(setup.home[j]) * setup.domain_size


def _weighted(setup: MultiSetup, res: MultiResult) -> float:
    total = sum(_gpus_of(setup, j) for j in range(len(setup.jobs)))
    return sum(r.effective * _gpus_of(setup, j) for j, r in enumerate(res.jobs)) / total


def _multi_tables(console: Console, setup: MultiSetup, result: dict[str, Any]) -> None:
    trace = result["trace"]
    private: MultiResult = result["private"]
    shared: MultiResult = result["shared"]
    size = setup.domain_size
    console.print(
        f"{setup.cluster.name}: {setup.n_gpus:,} GPUs in {len(setup.cluster.domain_sizes):,} domains of {size}, "
        f"{len(setup.jobs)} jobs on {sum(len(h) for h in setup.home):,} home domains, a pool of {setup.pool} "
        f"spare domains ({setup.pool * size:,} GPUs); {result['days']:g}-day trace (seed {result['seed']}, "
        f"warm-up {result['warmup_days']:g} d): {trace.failures} failures, peak {trace.peak_failed()} GPUs failed",
        highlight=False,
    )
    t = Table(title="effective training time per job: private spares vs the shared pool (same spare GPUs; "
                    "spares in domains; 'all' is GPU-weighted)")
    stall: StallModel | None = result["stall"]
    cols = ["job", "GPUs", "scheme", "prio", "preemptible", "min thr", "reserved", "private spares", "private eff.",
            "shared eff.", "peak extra", "grants", "preempted"]
    if stall is not None:
        cols += ["changes priv. / shared", "stalled priv. / shared"]
        console.print(f"stall model {stall.name}: {stall}; healthy step {result['step_s']:.2f} s", highlight=False)
    for col in cols:
        t.add_column(col, justify="right")
    for j, e in enumerate(setup.jobs):
        p, s = private.jobs[j], shared.jobs[j]
        row = [e.name, f"{_gpus_of(setup, j):,}", e.job.scheme.value, str(e.priority),
               "yes" if e.preemptible else "no", f"{e.min_throughput:g}", str(s.spare_domains),
               str(p.spare_domains), f"{100 * p.effective:.3f}%", f"{100 * s.effective:.3f}%",
               str(s.peak_held), str(s.grants), str(s.preempted)]
        if stall is not None:
            row += [f"{p.changes} / {s.changes}", f"{100 * p.stalled_share:.3f}% / {100 * s.stalled_share:.3f}%"]
        t.add_row(*row)
    t.add_row("all", f"{sum(_gpus_of(setup, j) for j in range(len(setup.jobs))):,}", "", "", "", "",
              str(sum(r.spare_domains for r in shared.jobs)), str(setup.pool),
              f"{100 * _weighted(setup, private):.3f}%", f"{100 * _weighted(setup, shared):.3f}%",
              *[""] * (len(cols) - 10))
    console.print(t)
    if "pool_needed" in result:
        found = result["pool_needed"].pool
        t2 = Table(title="spare GPUs each policy needs for equal effective time (within 0.01 points)")
        for col in ("job", "private spares (domains)", "private spares to reach its shared time"):
            t2.add_column(col, justify="right")
        needed = result["private_needed"]
        for j, e in enumerate(setup.jobs):
            t2.add_row(e.name, str(private.jobs[j].spare_domains), "> " + str(result["cap"]) if needed[j] is None
                       else str(needed[j]))
        total_needed = "> max" if any(n is None for n in needed) else f"{sum(needed) * size:,} GPUs"
        t2.add_row("private total", f"{setup.pool * size:,} GPUs", total_needed)
        t2.add_row("shared pool: every job reaches its private time", f"{setup.pool * size:,} GPUs",
                   _pool_text(found, setup))
        if "pool_needed_kept" in result:
            t2.add_row("shared pool: every job but the preemptible ones", f"{setup.pool * size:,} GPUs",
                       _pool_text(result["pool_needed_kept"].pool, setup))
        console.print(t2)


def _pool_text(found: int | None, setup: MultiSetup) -> str:
    if found is None:
        return f"> {_room(setup)} domains (all the cluster holds)"
    return f"{found} domains = {found * setup.domain_size:,} GPUs"


def _multi_json(name: str, setup: MultiSetup, result: dict[str, Any]) -> dict[str, Any]:
    trace = result["trace"]
    out: dict[str, Any] = {
        "mode": "multi-job", "preset": name, "days": result["days"], "warmup_days": result["warmup_days"],
        "seed": result["seed"], "gpus": setup.n_gpus, "pool_domains": setup.pool, "domain_size": setup.domain_size,
        "failures": trace.failures, "peak_failed_gpus": trace.peak_failed(),
        "model": dataclasses.asdict(setup.model), "jobs": [],
        "stall": None if result["stall"] is None else dataclasses.asdict(result["stall"]), "step_s": result["step_s"],
    }
    for j, e in enumerate(setup.jobs):
        out["jobs"].append({
            "name": e.name, "gpus": _gpus_of(setup, j), "scheme": e.job.scheme.value, "priority": e.priority,
            "preemptible": e.preemptible, "min_throughput": e.min_throughput,
            **{policy: dataclasses.asdict(result[policy].jobs[j]) for policy in ("private", "shared")},
        })
    if "pool_needed" in result:
        out["pool_needed_domains"] = result["pool_needed"].pool
        out["pool_tried"] = [list(x) for x in result["pool_needed"].tried]
        out["private_spares_needed"] = result["private_needed"]
        if "pool_needed_kept" in result:
            out["pool_needed_domains_without_preemptible"] = result["pool_needed_kept"].pool
        out["search_cap"] = result["cap"]
    return out
