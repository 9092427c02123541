"""Checkpoint benchmarks (worker/checkpoint.py; gloo on CPU, real processes, AdamW):

1. What an asynchronous save costs the training step, for the ~118M TinyGpt at TP4 x DP2 (8 rank
   processes): the step time without checkpoints (median), the blocking part of a save (the save
   call: what the manifest needs, and the copy of the rank's pieces when it is made on the caller's
   thread, `--saves sync`; by default the writer thread copies them while the next step runs and
   that step's optimizer.step() waits for the copy), the steps that run while the writer threads
   copy, write, hash and complete the checkpoint, and what that adds per checkpoint: the
   overhead on the step at a given interval is (extra seconds per checkpoint) / (interval x step).
   The attempt's name is agreed before the save, as the Runtime agrees it at the previous step's
   commit (before issue 22's item 1 was finished, save() broadcast it: one collective more).
2. The save itself: seconds from the save call to the complete checkpoint (every rank's files
   durable and hashed, metadata merged, manifest written, renamed), and bytes.
3. A restore of that checkpoint into TP3 + TP4 (7 fresh processes): verification (every file's
   SHA-256, shared among the ranks) and the read, seconds and bytes.

    python bench/checkpoint.py [--quick] [--batch 4x64] [--dir DIR] [--saves background,sync,...]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntp_manager.worker.checkpoint import Checkpointer, Retention
from ntp_manager.worker.launch import free_port
from ntp_manager.worker.sync import NtpGradSync, SyncLayout, families_of, replicas_from
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt, tp_plan, unit_counts
from ntp_manager.worker.tp import parallelize

BIG = GptConfig(vocab=8192, seq=64, d_model=1024, heads=16, mlp=4096, layers=8)
SMALL = GptConfig(vocab=1024, seq=32, d_model=256, heads=8, mlp=1024, layers=2)
WORLD = 8


def _layouts(cfg: GptConfig, lb: int) -> tuple[SyncLayout, SyncLayout]:
    u = unit_counts(cfg)
    save = SyncLayout(replicas_from([[0, 1, 2, 3], [4, 5, 6, 7]], [lb, lb]), u)
    restore = SyncLayout(replicas_from([[0, 1, 2], [3, 4, 5, 6]], [lb, lb]), u)
    return save, restore


def _worker(rank: int, port: int, cfg: GptConfig, lb: int, seq: int, plain: int, root: str, modes: list[str],
            q: Any) -> None:
    torch.set_num_threads(1)  # 8 ranks share the machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=dt.timedelta(seconds=600))
    save_l, restore_l = _layouts(cfg, lb)
    groups = {rs: dist.new_group(list(rs)) for lay in (save_l, restore_l) for rs in (r.ranks for r in lay.replicas)}
    members7 = dist.new_group(list(range(7)))
    everyone = dist.new_group(list(range(WORLD)))
    out: dict[str, Any] = {}

    def build(lay: SyncLayout, seed: int) -> tuple[Any, Any, Any, Any]:
        torch.manual_seed(seed)
        model = TinyGpt(cfg)
        plan = tp_plan(cfg)
        fams = families_of(plan, model)
        ri, _ = lay.locate(rank)
        parallelize(model, plan, lay.units_of(rank), group=groups[lay.replicas[ri].ranks])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return model, opt, fams, NtpGradSync(model, lay, rank, fams)

    def step(model: Any, opt: Any, sync: Any, lay: SyncLayout, s: int) -> float:
        t0 = time.perf_counter()
        ri, _ = lay.locate(rank)
        g = torch.Generator().manual_seed(s)
        idx = torch.randint(0, cfg.vocab, (lb * len(lay.replicas), seq), generator=g)[ri * lb : (ri + 1) * lb]
        sync.zero_grad()
        model.loss(idx, torch.roll(idx, -1, 1)).backward()
        sync.sync()
        opt.step()
        return time.perf_counter() - t0

    model, opt, fams, sync = build(save_l, 0)
    s = 0
    for _ in range(2):  # warm-up (first touches of the gradient buffers and optimizer state)
        step(model, opt, sync, save_l, s)
        s += 1
    plain_times = []
    for _ in range(plain):
        plain_times.append(step(model, opt, sync, save_l, s))
        s += 1
    ck = Checkpointer(root, Retention(keep_last=1))
    saves = []
    # the first save allocates the snapshot buffers, later ones reuse them; the copy on the caller's
    # thread (background=False, as before issue 22's item 1 was finished) and on the writer thread
    # (the default) take turns under the same load
    for mode in modes:
        # the attempt's name, agreed before the save as the Runtime does (a random number of rank 0
        # rides on the previous step's commit all_gather): save() itself runs no collective
        name = [uuid.uuid4().hex[:16]]
        dist.broadcast_object_list(name, src=0, group=everyone)
        dist.barrier(everyone)
        t_save = time.perf_counter()
        h = ck.save(s, model, opt, save_l, rank, fams, data_state={"step": s}, attempt=name[0],
                    background=mode == "background")
        blocking = time.perf_counter() - t_save
        during = []
        while True:  # steps go on while the writers work, until every rank's part and the completion are done
            during.append(step(model, opt, sync, save_l, s))
            s += 1
            mine = torch.tensor([1.0 if h.written.done() and (h.completed is None or h.completed.done()) else 0.0])
            dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=everyone)
            if mine.item() > 0:
                break
        done = torch.tensor([0.0])
        if h.completed is not None:  # every rank learns when the coordinator completed it
            h.completed.result()
            done[0] = time.perf_counter() - t_save
        dist.all_reduce(done, group=everyone)
        saves.append({"mode": mode, "blocking": blocking, "snapshot_s": h.snapshot_s, "during": during,
                      "copy_s": h.snapshotted.result(), "complete_s": float(done[0]), "wrote": h.written.result()})
        step(model, opt, sync, save_l, s)  # one step with idle writers between the saves
        s += 1
    out.update(plain=plain_times, saves=saves)
    sync.release()
    del model, opt, sync
    dist.barrier(everyone)
    if rank < 7:  # restore into TP3 + TP4: fresh models, optimizers without state
        m2, o2, f2, s2 = build(restore_l, 1000 + rank)
        dist.barrier(members7)
        t0 = time.perf_counter()
        info = Checkpointer(root).load(m2, o2, restore_l, rank, f2, group=members7)
        out.update(restore_s=time.perf_counter() - t0, restore_bytes=info.bytes_read, restored_step=info.step)
        s2.release()
    else:
        bare = TinyGpt(cfg)  # not in that layout: it only takes part in creating the sync's groups
        NtpGradSync(bare, restore_l, rank, families_of(tp_plan(cfg), bare)).release()
    q.put((rank, out))
    dist.barrier(everyone)
    dist.destroy_process_group()


def run(cfg: GptConfig, lb: int, seq: int, plain: int, root: Path, modes: list[str]) -> dict[str, Any]:
    cfg = GptConfig(**{**cfg.__dict__, "seq": max(cfg.seq, seq)})
    q = mp.get_context("spawn").SimpleQueue()
    ctx = mp.start_processes(_worker, args=(free_port(), cfg, lb, seq, plain, str(root), modes, q), nprocs=WORLD,
                             join=False, start_method="spawn")
    got = dict(q.get() for _ in range(WORLD))
    while not ctx.join():
        pass
    (ck,) = [p for p in root.iterdir() if p.name.startswith("step-")]
    total = sum(f.stat().st_size for f in ck.rglob("*") if f.is_file())
    return {"ranks": got, "bytes": total, "params": sum(p.numel() for p in TinyGpt(cfg).parameters())}


def report(console: Console, res: dict[str, Any], interval: list[int], label: str) -> None:
    r0 = res["ranks"][0]  # steps are in lockstep (collectives), so any rank's step times agree
    step_t = statistics.median(r0["plain"])
    t = Table(title=f"Async checkpoint of {res['params'] / 1e6:.0f}M TinyGpt, AdamW, TP4 x DP2, {label} "
                    f"(8 ranks on {os.cpu_count()} CPUs)")
    for c in ("save", "copy on", "plain step s", "blocking s (worst rank)", "blocking % of step", "copy s (worst)",
              "steps during the write", "their times s", "extra s per checkpoint", "save -> complete s",
              "checkpoint MiB"):
        t.add_column(c, justify="right")
    extras = []
    for i in range(len(r0["saves"])):
        blocking = max(r["saves"][i]["blocking"] for r in res["ranks"].values())
        copy = max(r["saves"][i]["copy_s"] for r in res["ranks"].values())
        during = r0["saves"][i]["during"]
        extra = blocking + sum(x - step_t for x in during)
        mode = r0["saves"][i]["mode"]
        extras.append((i, mode, extra))
        t.add_row(str(i + 1) + (" (fresh buffers)" if i == 0 else ""),
                  "writer thread" if mode == "background" else "caller", f"{step_t:.2f}",
                  f"{blocking:.3f}", f"{100 * blocking / step_t:.1f}%", f"{copy:.3f}", str(len(during)),
                  " ".join(f"{x:.2f}" for x in during), f"{extra:.2f}", f"{r0['saves'][i]['complete_s']:.1f}",
                  f"{res['bytes'] / 2**20:.0f}")
    console.print(t)
    o = Table(title="Overhead on the step at a checkpoint interval: extra / (interval x plain step)")
    o.add_column("interval (steps)", justify="right")
    for i, mode, _ in extras:
        o.add_column(f"save {i + 1} ({mode})", justify="right")
    for n in interval:
        o.add_row(str(n), *(f"{100 * e / (n * step_t):.1f}%" for _, _, e in extras))
    console.print(o)
    rs = [r for r in res["ranks"].values() if "restore_s" in r]
    rt = Table(title="Restore into TP3 + TP4 (7 fresh ranks; verify every file's SHA-256, then read)")
    for c in ("slowest rank s", "MiB read, all ranks", "MiB/s"):
        rt.add_column(c, justify="right")
    slow = max(r["restore_s"] for r in rs)
    mib = sum(r["restore_bytes"] for r in rs) / 2**20
    rt.add_row(f"{slow:.2f}", f"{mib:.0f}", f"{mib / slow:.0f}")
    console.print(rt)
    console.print(f"load average after the run: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", default="4x64", help="samples x tokens per replica, e.g. 1x16")
    ap.add_argument("--plain", type=int, default=4, help="steps timed without a checkpoint")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--saves", default="background,sync,background,sync",
                    help="the saves in order: background (copy on the writer thread) or sync (on the caller)")
    args = ap.parse_args()
    modes = args.saves.split(",")
    if not modes or any(m not in ("background", "sync") for m in modes):
        ap.error("--saves: a comma-separated list of background and sync")
    lb, seq = (int(x) for x in args.batch.split("x"))
    console = Console(width=240)
    console.print(f"torch {torch.__version__}, gloo, {os.cpu_count()} CPUs")
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ntp-ckpt-bench-"))
    root = base / f"run-{int(time.time())}"
    root.mkdir(parents=True)
    try:
        res = run(SMALL if args.quick else BIG, lb, seq, args.plain, root, modes)
        report(console, res, [10, 50, 100, 500], f"{lb}x{seq} tokens per replica")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
