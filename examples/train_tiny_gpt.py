"""The smallest training script for `ntp-run`: the repo's TinyGpt (ntp_manager/worker/tiny_gpt.py)
on its synthetic bigram stream, written against the public worker API. Small enough that a test can
run it under Slurm on a CPU; examples/train_hf_llama.py is the same with a Hugging Face model.

    # ntp-run publishes the layouts: 2 replicas x TP2; replica 0 loses a rank after step 4, gets
    # it back after step 8; every rank checks its losses against one process at the end
    .venv/bin/ntp-run --nproc 4 --replicas 2 --fail-at 4 --repair-at 8 --max-restarts 1 \\
        examples/train_tiny_gpt.py --steps 12 --check

    # under Slurm, one ntp-run per node, layouts from the manager (docs/slurm.md)
    sbatch -N 2 --gres=gpu:2 deploy/slurm/train.sbatch examples/train_tiny_gpt.py --steps 30 --check

Every rank's loss at a step is the loss of the whole global batch, so it equals a single process
trained on the same global batches (`--check` compares them, step by step, after the run).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--check", action="store_true", help="compare every step's loss with one process at the end")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep after each step (to watch it)")
    p.add_argument("--collective-timeout", type=float, default=10.0)
    args = p.parse_args()
    if "NTP_STORE" not in os.environ:
        p.error("start it with ntp-run (see the docstring)")

    import time

    import structlog
    import torch

    from ntp_manager.worker import TimelineEvent, worker_env
    from ntp_manager.worker.launch import DEMO_MODEL, TrainSpec, batch, reference_losses
    from ntp_manager.worker.tiny_gpt import TinyGpt, tiny_loss, tp_plan

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(1)
    env = worker_env()
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    spec = TrainSpec(job=env.job, cfg=DEMO_MODEL)

    def on_event(ev: TimelineEvent) -> None:
        if ev.what in ("failure detected", "reshard done", "joined", "no place"):
            print(f"[{env.worker_id[:12]}] {ev.what} (v{ev.version}) {ev.detail[:80]}", flush=True)

    rt = env.runtime(lambda: TinyGpt(spec.cfg), lambda ps: torch.optim.SGD(ps, lr=spec.lr, momentum=spec.momentum),
                     tp_plan(spec.cfg), on_event=on_event, collective_timeout_s=args.collective_timeout,
                     reconfigure_timeout_s=300)
    losses: dict[int, float] = {}
    try:
        rt.start()
        while rt.step < args.steps:
            r = rt.train_step(lambda s, a, n: batch(spec.cfg, s, a, n), tiny_loss)
            losses[r.step] = r.loss
            env.store.set(f"ntp/{env.job}/example/gb/{r.step}", str(r.global_batch))
            if env.local_rank == 0:
                print(f"step {r.step:3d}  layout v{r.version}  tp {r.tp}  global batch {r.global_batch:3d}  "
                      f"loss {r.loss:.5f}", flush=True)
            if args.step_delay:
                time.sleep(args.step_delay)
    finally:
        rt.close()
    if not args.check:
        return 0
    gbs = [int(env.store.get(f"ntp/{env.job}/example/gb/{s}")) for s in range(args.steps)]
    ref = reference_losses(spec, gbs)
    worst = max(abs(loss - ref[s]) / abs(ref[s]) for s, loss in losses.items())
    ok = worst <= 1e-5
    print(f"[{env.worker_id[:12]}] check {'ok' if ok else 'FAILED'}: {len(losses)} steps, worst loss {worst:.1e} "
          "(rel. to one process)", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
