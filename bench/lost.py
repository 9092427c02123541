"""The time a failure costs a real `ntp-run` job (issue 42): kill -> first step at the new layout,
less that step's own time and the reshard -- what detection and the regroup cost. Goal <= 0.5 s.

    ntp-run --nproc 4 --replicas 2 --batch-per-rank 16 --fail-at 6 --repair-at 12 --max-restarts 1 \\
        examples/train_hf_llama.py --shape bench --steps 14 --timeline DIR

(an HF Llama: hidden 256, 2 layers, a 32,000-token vocabulary, 128-token sequences; 2 x TP2, local
batch 32). ntp-run kills replica 0's last rank after step 6 and reports it in the store; the
survivors abandon their step (runtime/abort.py), regroup at TP1 + TP2 and go on. The kill's time
is ntp-run's own log line; each rank writes its timeline and its steps (examples/train_hf_llama.py
--timeline). Per survivor: lost = (end of its first step at the new layout - kill) - that step's
seconds - its reshard (regrouped -> reshard done); the table has the slowest survivor's.
`--abort-poll 0` runs the baseline (the watcher off: the example's RuntimeConfig.abort_poll_s).

    python bench/lost.py [--repeat N] [--abort-poll S] [--steps N] [--shape small]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine_line, show

ROOT = Path(__file__).resolve().parents[1]


def run_once(shape: str, steps: int, fail_at: int, repair_at: int, abort_poll: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        r = subprocess.run([sys.executable, "-m", "ntp_manager.worker.run", "--nproc", "4", "--replicas", "2",
                            "--batch-per-rank", "16", "--fail-at", str(fail_at), "--repair-at", str(repair_at),
                            "--max-restarts", "1", "examples/train_hf_llama.py", "--shape", shape, "--steps",
                            str(steps), "--timeline", d, "--collective-timeout", "60", "--abort-poll", str(abort_poll)],
                           cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise SystemExit(f"ntp-run exited with {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        kill = next(json.loads(line) for line in r.stderr.splitlines()
                    if line.startswith("{") and "rank killed (--fail-at)" in line)
        t_kill = dt.datetime.fromisoformat(kill["timestamp"].replace("Z", "+00:00")).timestamp()
        per_rank: list[dict[str, float]] = []
        for f in Path(d).glob("*.json"):
            doc: dict[str, Any] = json.loads(f.read_text())
            events = doc["events"]
            fails = [at for what, _, at in events if what == "failure detected" and at >= t_kill]
            if not fails:  # the killed rank's first process, or the repaired one
                continue
            v2 = min(v for what, v, at in events if what == "reshard done" and at >= t_kill)
            regrouped = next(at for what, v, at in events if what == "regrouped" and v == v2)
            resharded = next(at for what, v, at in events if what == "reshard done" and v == v2)
            _, _, secs, end = min((s for s in doc["steps"] if s[1] == v2), key=lambda s: s[0])
            per_rank.append({"detection": fails[0] - t_kill, "regroup": regrouped - fails[0],
                             "reshard": resharded - regrouped, "first step": secs,
                             "kill -> first step": end - t_kill,
                             "lost": (end - t_kill) - secs - (resharded - regrouped)})
        steady = [s[2] for f in Path(d).glob("*.json") for s in json.loads(f.read_text())["steps"]
                  if 1 <= s[0] < fail_at]
        worst = max(per_rank, key=lambda x: x["lost"])
        return {**worst, "steady step": statistics.median(steady), "survivors": len(per_rank)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--abort-poll", type=float, default=0.05, help="RuntimeConfig.abort_poll_s (0: the baseline)")
    ap.add_argument("--shape", default="bench", choices=["bench", "small"])
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--fail-at", type=int, default=6)
    ap.add_argument("--repair-at", type=int, default=12)
    args = ap.parse_args()
    console = Console()
    console.print(machine_line())
    runs = [run_once(args.shape, args.steps, args.fail_at, args.repair_at, args.abort_poll)
            for _ in range(args.repeat)]
    cols = ("steady step", "detection", "regroup", "reshard", "first step", "kill -> first step", "lost")
    med = {k: statistics.median(r[k] for r in runs) for k in cols}
    show(console, f"ntp-run 2 x TP2 -> TP1 + TP2, HF Llama ({args.shape}), kill after step {args.fail_at}, "
         f"abort poll {args.abort_poll} s: seconds, slowest survivor, median of {len(runs)}",
         (*cols[:-1], "lost (goal <= 0.5)"), [tuple(f"{med[k]:.2f}" for k in cols)])


if __name__ == "__main__":
    main()
