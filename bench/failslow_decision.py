"""Fail-slow decisions in the simulator: job throughput with slow GPUs, doing nothing vs the planner.

Setup: 32 + 2 NVL8 domains (272 GPUs); a job of 32 TP8 replicas, local batch 16, 32 heads and
256 MLP columns (attention share 0.4, so TP7 runs floor(16 / 1.19375) = 13 samples), min_tp 4,
with 0 or 2 spare groups. 1 or 4 GPUs, drawn at random (seeded, `--placements` draws per row),
run 10%, 20% or 40% slow (time factor 1.1 / 1.2 / 1.4). Throughput is relative to the healthy job
(ntp_manager/sim/slow.py): doing nothing, every replica waits for the slowest GPU; the planner
degrades the slow GPUs at their speed and replans (keep at a smaller batch, ntp-pw power boost,
exclude, or a spare). The episode column is the mean over 300 steps from the onset: the detector's
delay (3 steps at >= 20%, 7 at 10%: bench/failslow.py's p50), 5 steps lost to the reshard, then
the new layout. Pure computation: the figures do not depend on the machine.

Usage: python bench/failslow_decision.py [--placements N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
from collections import Counter
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ntp_manager.planner import JobSpec, Scheme
from ntp_manager.sim.slow import slow_outcome
from ntp_manager.topology import generate_cluster

LEVELS = [0.1, 0.2, 0.4]
DETECT = {0.1: 7, 0.2: 3, 0.4: 3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--placements", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    cluster = generate_cluster(34, 8, 4)
    primary = [g.uuid for d in cluster.domains[:32] for g in d.gpus]
    t = Table(title="fail-slow: relative throughput, doing nothing vs the planner's decision",
              title_justify="left")
    for col in ("scheme", "spares", "slowdown", "slow GPUs", "nothing", "planner", "episode (300 steps)",
                "gain", "decisions"):
        t.add_column(col)
    out = []
    for scheme in (Scheme.NTP, Scheme.NTP_PW):
        for spares in (0, 2):
            job = JobSpec(name="j", tp=8, groups_per_replica=1, replicas=32, local_batch=16, min_tp=4, heads=32,
                          mlp_columns=256, scheme=scheme, spares=spares)
            for level in LEVELS:
                for count in (1, 4):
                    rng = random.Random(f"{scheme}/{spares}/{level}/{count}")
                    sums = [0.0, 0.0, 0.0]
                    actions: Counter[str] = Counter()
                    for _ in range(args.placements):
                        slow = dict.fromkeys(rng.sample(primary, count), round(1 / (1 + level), 6))
                        o = slow_outcome(cluster, job, slow, detect_steps=DETECT[level])
                        sums[0] += o.nothing
                        sums[1] += o.planner
                        sums[2] += o.episode
                        actions[o.action] += 1
                    n = args.placements
                    nothing, planner, episode = (x / n for x in sums)
                    acts = ", ".join(f"{k} {v}" for k, v in sorted(actions.items()))
                    t.add_row(scheme.value, str(spares), f"{level:.0%}", str(count), f"{nothing:.3f}",
                              f"{planner:.3f}", f"{episode:.3f}", f"{planner / nothing:.2f}x", acts)
                    out.append({"scheme": scheme.value, "spares": spares, "slowdown": level, "slow_gpus": count,
                                "nothing": nothing, "planner": planner, "episode": episode, "decisions": dict(actions)})
    Console(width=200).print(t)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
