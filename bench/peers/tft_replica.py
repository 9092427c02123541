"""One torchft replica group of one process: the peer's side of bench/peers/compare.py.

Run by the driver, not by hand. It trains bench/peers/common.py's model on its data with torchft's
own pieces: a `torchft.Manager` that asks the lighthouse for a quorum every step, torchft's DDP
wrapper (`PureDistributedDataParallel`: gradients averaged over the replica groups in the quorum,
through the manager's fault-tolerant all-reduce) and its gloo process group.
Samples come as torchft's recipe gives them: `torchft.DistributedSampler` shards the data by replica
group, and a group reads the shard at the position of the step it trains (as a dataloader
checkpointed every step would: the most generous case for the peer). Every step it writes one
line (bench/peers/common.py `StepRecord`): committed or not, the replica groups in the quorum and
the sample indices it trained.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers.common import STARTED, STEP_BATCH, StepLog, StepRecord, batch_of, model_config


class _Indices:
    """A map-style dataset of sample indices (the sampler only needs its length)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--group", type=int, required=True)
    p.add_argument("--groups", type=int, required=True)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--log-dir", type=Path, required=True)
    p.add_argument("--pg-timeout", type=float, default=5.0)
    p.add_argument("--wait-go", action="store_true", help="after joining, wait for the driver's `go` file (the "
                   "first quorum then holds every group: the lighthouse waits for those heartbeating)")
    args = p.parse_args()

    import torch
    import torch.distributed as dist
    from torchft import DistributedSampler, Manager, ProcessGroupGloo
    from torchft.ddp import PureDistributedDataParallel

    from ntp_manager.worker.tiny_gpt import TinyGpt

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    torch.manual_seed(0)  # every group starts from the same weights
    model = TinyGpt(model_config())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    def load(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout)), min_replica_size=1,
        load_state_dict=load, state_dict=state, replica_id=f"group{args.group}",
        lighthouse_addr=args.lighthouse, store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=60), use_async_quorum=False)
    # torchft's per-tensor DDP wrapper: its reducer-based one (0.2.0) fails an assertion in its hook
    # when a replica is already gone as the all-reduce starts (the manager then hands out placeholder
    # work without the future the hook expects), which kills the survivor too
    ddp = PureDistributedDataParallel(manager, model)
    sampler = DistributedSampler(_Indices(10_000_000), replica_rank=args.group, num_replica_groups=args.groups,
                                 group_rank=0, num_replicas=1, shuffle=False)
    shard = iter(sampler)
    shard_seen: list[int] = []  # the shard's indices read so far (it is read in order)
    log = StepLog(args.log_dir, f"torchft-group{args.group}", STARTED)

    def shard_slice(step: int) -> list[int]:
        while len(shard_seen) < (step + 1) * STEP_BATCH:
            shard_seen.append(next(shard))
        return shard_seen[step * STEP_BATCH:(step + 1) * STEP_BATCH]

    if args.wait_go:
        (args.log_dir / f"ready-{args.group}").touch()
        while not (args.log_dir / "go").exists():
            time.sleep(0.05)

    while manager.current_step() < args.steps:
        start = time.time()
        opt.zero_grad()
        manager.start_quorum()  # heals from a peer when this group is behind
        step = manager.current_step()
        indices = shard_slice(step)
        x, y = batch_of(indices)
        logits = ddp(x).float()  # through the wrapper: its hooks all-reduce the gradients via the manager
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
        committed = manager.should_commit()
        if committed:
            opt.step()
        log.write(StepRecord("torchft", f"group{args.group}", os.getpid(), step, start, time.time(), committed,
                             manager.num_participants(), indices if committed else []))
    sys.stdout.flush()
    os._exit(0)  # the manager's threads need no orderly end here


if __name__ == "__main__":
    sys.exit(main())
