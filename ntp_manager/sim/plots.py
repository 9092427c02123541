"""Plots for the simulator (matplotlib, Agg backend; writes PNG files)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from ntp_manager.planner import Scheme
from ntp_manager.sim.engine import StaticPoint, Trace, TraceStats
from ntp_manager.sim.multijob import MultiResult, MultiSetup

COLORS = {Scheme.DP_DROP: "#d62728", Scheme.NTP: "#1f77b4", Scheme.NTP_PW: "#2ca02c"}


def plot_static(points: Sequence[StaticPoint], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for scheme in Scheme:
        pts = sorted((p for p in points if p.scheme is scheme), key=lambda p: p.fraction)
        if not pts:
            continue
        xs = [100 * p.fraction for p in pts]
        ax.plot(xs, [100 * p.mean_loss for p in pts], "o-", color=COLORS[scheme], label=f"{scheme.value} (mean)")
        ax.fill_between(
            xs, [100 * min(p.losses) for p in pts], [100 * p.max_loss for p in pts],
            color=COLORS[scheme], alpha=0.15, linewidth=0,
        )
    ax.set_xlabel("failed GPUs (%)")
    ax.set_ylabel("throughput loss (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_trace(trace: Trace, stats: Sequence[TraceStats], path: Path, title: str) -> None:
    spares = sorted({s.spares for s in stats})
    panels = 2 if len(spares) > 1 else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), dpi=120, squeeze=False)
    ax = axes[0][0]
    xs, ys = [], []
    for a, b, f in trace.failed_fraction_profile():
        xs += [a / 24, b / 24]
        ys += [100 * f, 100 * f]
    ax.plot(xs, ys, color="black", linewidth=1)
    ax.axhline(0.1, color="grey", linestyle="--", linewidth=1, label="0.1% failed")
    ax.set_xlabel("day")
    ax.set_ylabel("failed GPUs (%)")
    ax.set_title(f"failed fraction; > 0.1% for {100 * trace.time_share_above(0.001):.0f}% of the time")
    ax.grid(alpha=0.3)
    ax.legend()
    if panels == 2:
        ax2 = axes[0][1]
        for scheme in Scheme:
            rows = sorted((s for s in stats if s.scheme is scheme), key=lambda s: s.spares)
            if rows:
                ax2.plot(
                    [r.spares for r in rows], [100 * r.per_gpu_throughput for r in rows], "o-",
                    color=COLORS[scheme], label=scheme.value,
                )
        ax2.set_xlabel("spare TP groups (domains)")
        ax2.set_ylabel("per-GPU throughput (% of healthy, spares counted)")
        ax2.set_title("spares vs per-GPU throughput")
        ax2.grid(alpha=0.3)
        ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_multijob(private: MultiResult, shared: MultiResult, setup: MultiSetup, path: Path, title: str) -> None:
    """Per job: effective training time with private spares and with the shared pool (bars)."""
    names = [e.name for e in setup.jobs]
    xs = range(len(names))
    width = 0.38
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(names) + 2), 4.5), dpi=120)
    priv = [100 * r.effective for r in private.jobs]
    shar = [100 * r.effective for r in shared.jobs]
    ax.bar([x - width / 2 for x in xs], priv, width, color="#d62728", label=f"private spares ({private.pool} split)")
    ax.bar([x + width / 2 for x in xs], shar, width, color="#1f77b4", label=f"shared pool ({shared.pool} domains)")
    labels = [f"{e.name}\n{len(h) * setup.domain_size:,}, p{e.priority}{'*' if e.preemptible else ''}"
              for e, h in zip(setup.jobs, setup.home, strict=True)]
    ax.set_xticks(list(xs), labels)
    low = min(priv + shar)
    ax.set_ylim(max(0.0, low - 0.25 * (100 - low) - 0.05), 100.0 + 0.05 * (100 - low) + 0.01)
    ax.set_ylabel("effective training time (% of healthy)")
    ax.set_xlabel("job (GPUs, priority; * preemptible)")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
