"""One rank under ntp-run: this project's side of bench/peers/compare.py.

Run by the driver through `ntp-run --nproc 2 --replicas 2 ...`, not by hand. The same model
and data as bench/peers/tft_replica.py, trained with the runtime's sample-addressed step: each
step takes the next global batch at the runtime's sample cursor, each replica its share. Every
committed step writes one line (bench/peers/common.py `StepRecord`) with the sample indices this
rank's replica trained and the time the step spent changing layout (regroup and reshard).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers.common import STARTED, StepLog, StepRecord, batch_of, model_config


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--log-dir", type=Path, required=True)
    args = p.parse_args()

    import structlog
    import torch

    from ntp_manager.worker import worker_env
    from ntp_manager.worker.runtime import TimelineEvent
    from ntp_manager.worker.tiny_gpt import TinyGpt, tiny_loss, tp_plan

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    env = worker_env()
    cfg = model_config()
    marks: dict[str, float] = {}  # the newest time of each switch event since the last step
    switch = [0.0]

    def on_event(ev: TimelineEvent) -> None:
        if ev.what == "regrouped":
            marks["regrouped"] = ev.at
        elif ev.what == "reshard done" and "regrouped" in marks:
            switch[0] += ev.at - marks.pop("regrouped")

    def samples(start: int, count: int) -> Any:
        return batch_of(list(range(start, start + count)))

    rt = env.runtime(lambda: TinyGpt(cfg), lambda ps: torch.optim.AdamW(ps, lr=3e-3), tp_plan(cfg),
                     on_event=on_event, reconfigure_timeout_s=300)
    log = StepLog(args.log_dir, f"ntp-{env.worker_id}", STARTED)
    try:
        rt.start()
        while rt.step < args.steps:
            start = time.time()
            switch[0] = 0.0
            r = rt.train_step(loss_fn=tiny_loss, samples=samples)
            replicas = max(1, r.global_batch // max(1, r.local_batch))
            log.write(StepRecord("ntp", env.worker_id, os.getpid(), r.step, start, time.time(), True, replicas,
                                 list(range(r.first_sample, r.first_sample + r.local_batch)), switch[0]))
    finally:
        rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
