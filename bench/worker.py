"""Worker runtime benchmarks (gloo on CPU, real processes):

1. NTP gradient sync time over uniform sync time, same model and gradient bytes: 2 replicas at TP4
   (uniform) vs TP4 + TP3 (the TP4 replica's extra rank hands its borrowed units to its cores:
   through shared memory, the default on one host, and as messages), median of repeated syncs.
2. Reshard time against bytes moved (TP4 -> TP3, the failed rank's units fetched from the DP peer).
3. Failure to first completed step at the new TP degree for a ~100M-parameter model, split into
   detection (kill -> survivors' collective fails), regroup (dropping the old group, the layout, the
   rendezvous and the new process group),
   reshard, first step.
4. What gradient clipping (max_grad_norm) adds to a step: the rank's share of the norm and the
   scaling pass, on one rank holding the whole model.
5. (`--only switch`, on request) A layout switch alone (issue 32): 2 x TP4 with AdamW, one rank
   killed, kill -> first step at TP3 + TP4 against the steady step, each phase, and the reshard's
   bytes and GB/s per rank; `--size` 118m / 150m / 500m, `--device cuda`, `--staged`.

    python bench/worker.py [--quick]
    python bench/worker.py --only switch --size 118m --staged --repeat 3
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from torch.nn.utils import clip_grads_with_norm_

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import swprof
from bench.common import FAILOVER_PARTS, failover_row, kill_parked, last_event, show
from ntp_manager.worker.comm import P2P
from ntp_manager.worker.launch import free_port
from ntp_manager.worker.reshard import apply_reshard, reshard_moves
from ntp_manager.worker.runtime import Runtime, RuntimeConfig
from ntp_manager.worker.sources import StoreLayoutSource, publish_layout
from ntp_manager.worker.sync import DEFAULT_BUCKET_BYTES, NtpGradSync, SyncLayout, families_of, replicas_from
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt, tp_plan, unit_counts
from ntp_manager.worker.tp import ShardedModule, parallelize


def _init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)  # 8 ranks share this machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


# ---- 1. sync ratio -------------------------------------------------------------------------------
def _sync_worker(rank: int, world: int, port: int, cfg: GptConfig, reps: int, bucket: int, q: Any) -> None:
    _init(rank, world, port)
    units = unit_counts(cfg)
    # uniform TP3 + TP3 all-reduces the same bytes per core rank as the NTP layout (its sync degree is 3)
    # "ntp": the extra's transfers through shared memory (the default on one host, as NVLink in a
    # GPU domain); "ntp_msg": as point-to-point messages over loopback (what crosses hosts)
    configs = {"uniform": [[0, 1, 2, 3], [4, 5, 6, 7]], "ntp": [[0, 1, 2], [4, 5, 6, 7]],
               "ntp_msg": [[0, 1, 2], [4, 5, 6, 7]], "uniform3": [[0, 1, 2], [4, 5, 6]]}
    syncs = {}
    for name, ranks in configs.items():
        lay = SyncLayout(replicas_from(ranks, [len(r) for r in ranks]), units)
        torch.manual_seed(0)
        model = TinyGpt(cfg)
        fams = families_of(tp_plan(cfg), model)
        tps = [dist.new_group(ranks=r) for r in ranks]
        active = any(rank in r for r in ranks)
        if active:
            parallelize(model, tp_plan(cfg), lay.units_of(rank), group=tps[lay.locate(rank)[0]])
        syncs[name] = NtpGradSync(model, lay, rank, fams, bucket_bytes=bucket, shared_memory=name != "ntp_msg")
        if active:
            for p in model.parameters():
                p.grad = torch.randn_like(p)
    # the layouts take turns, so that a slow spell of this shared machine hits them alike
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(reps):
        for name, sync in syncs.items():
            dist.barrier()
            t = time.perf_counter()
            sync.sync()
            times[name].append(time.perf_counter() - t)
    dist.barrier()
    out = {name: (statistics.median(ts), syncs[name].bytes_all_reduced / reps) for name, ts in times.items()}
    q.put((rank, out))
    dist.destroy_process_group()


def bench_sync(quick: bool, bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20) -> list[tuple[str, ...]]:
    rows = []
    for cfg in ([GptConfig(vocab=512, seq=32, d_model=256, heads=8, mlp=1024, layers=2)] if quick else
                [GptConfig(vocab=512, seq=32, d_model=256, heads=8, mlp=1024, layers=2),
                 GptConfig(vocab=1024, seq=32, d_model=512, heads=8, mlp=2048, layers=4)]):
        q = mp.get_context("spawn").SimpleQueue()
        args = (8, free_port(), cfg, 5 if quick else 30, int(bucket_mb * 2**20), q)
        ctx = mp.start_processes(_sync_worker, args=args, nprocs=8, join=False, start_method="spawn")
        res = [q.get() for _ in range(8)]
        while not ctx.join():
            pass
        # the slowest rank bounds the step
        uni = max(r[1]["uniform"][0] for r in res)
        ntp = max(r[1]["ntp"][0] for r in res if r[0] != 3)
        msg = max(r[1]["ntp_msg"][0] for r in res if r[0] != 3)
        uni3 = max(r[1]["uniform3"][0] for r in res if r[0] not in (3, 7))
        params = sum(p.numel() for p in TinyGpt(cfg).parameters())
        rows.append((f"{params / 1e6:.1f}M", f"{1000 * uni:.1f}", f"{1000 * uni3:.1f}", f"{1000 * ntp:.1f}",
                     f"{1000 * msg:.1f}", f"{ntp / uni:.2f}x", f"{msg / uni:.2f}x", f"{ntp / uni3:.2f}x"))
    return rows


# ---- 2. reshard time vs bytes ---------------------------------------------------------------------
def _reshard_worker(rank: int, world: int, port: int, cfg: GptConfig, q: Any) -> None:
    _init(rank, world, port)
    units = unit_counts(cfg)
    old = SyncLayout(replicas_from([[0, 1, 2, 3], [4, 5, 6, 7]], [4, 4]), units)
    new = SyncLayout(replicas_from([[0, 1, 2], [4, 5, 6, 7]], [3, 4]), units)
    torch.manual_seed(0)
    model = TinyGpt(cfg)
    fams = families_of(tp_plan(cfg), model)
    tps = [dist.new_group(ranks=list(r.ranks)) for r in old.replicas]
    parallelize(model, tp_plan(cfg), old.units_of(rank), group=tps[old.locate(rank)[0]])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # momentum buffers exist: they move too
    tps2 = [dist.new_group(ranks=list(r.ranks)) for r in new.replicas]
    mine = next((g for g, r in zip(tps2, new.replicas, strict=True) if rank in r.ranks), None)
    alive = {0, 1, 2, 4, 5, 6, 7}
    dist.barrier()
    t = time.perf_counter()
    if rank != 3:
        apply_reshard(model, opt, old, new, alive, rank, fams, mine)
    else:  # the failed rank takes no part; a barrier group without it would be needed in real life
        pass
    el = time.perf_counter() - t
    moves = reshard_moves(old, new, alive)
    q.put((rank, el, moves))
    dist.destroy_process_group()


def unit_bytes(cfg: GptConfig) -> dict[str, int]:
    """Bytes per unit of each family: every sharded tensor of it (weights, biases), with SGD
    momentum, fp32 -- what a reshard moves per unit."""
    plan = tp_plan(cfg)
    model = parallelize(TinyGpt(cfg), plan, {f: list(range(n)) for f, n in unit_counts(cfg).items()})
    fams = families_of(plan, model)
    out = dict.fromkeys(unit_counts(cfg), 0)
    for path, m in model.named_modules():
        if isinstance(m, ShardedModule):
            out[fams[path]] += sum(2 * p.element_size() * p.numel() // len(m.units) for _, p, _ in m.sharded_params())
    return out


def bench_reshard(quick: bool) -> list[tuple[str, ...]]:
    rows = []
    cfgs = [GptConfig(vocab=512, seq=32, d_model=256, heads=8, mlp=1024, layers=2),
            GptConfig(vocab=1024, seq=32, d_model=512, heads=8, mlp=2048, layers=4)]
    if not quick:
        cfgs.append(GptConfig(vocab=1024, seq=32, d_model=1024, heads=16, mlp=4096, layers=4))
    for cfg in cfgs:
        q = mp.get_context("spawn").SimpleQueue()
        ctx = mp.start_processes(_reshard_worker, args=(8, free_port(), cfg, q), nprocs=8, join=False,
                                 start_method="spawn")
        res = [q.get() for _ in range(8)]
        while not ctx.join():
            pass
        el = max(r[1] for r in res if r[0] != 3)
        moves = res[0][2]
        # every survivor of the TP3 replica gets a new unit assignment, so more than the lost quarter moves
        row = unit_bytes(cfg)
        moved = sum(row[m.family] * len(m.units) for m in moves)
        params = sum(p.numel() for p in TinyGpt(cfg).parameters())
        rows.append((f"{params / 1e6:.1f}M", f"{moved / 2**20:.1f}", f"{1000 * el:.0f}",
                     f"{moved / 2**20 / el:.0f}"))
    return rows


# ---- 3. failure -> first step ---------------------------------------------------------------------
BIG = GptConfig(vocab=8192, seq=64, d_model=1024, heads=16, mlp=4096, layers=8)


def _rt_worker(wid: str, port: int, cfg: GptConfig, park_at: int, victim: str, steps: int, q: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=300))

    def batch(step: int, start: int, count: int) -> Any:
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, cfg.vocab, (8, cfg.seq), generator=g)
        return idx[start : start + count], torch.roll(idx, -1, 1)[start : start + count]

    rt = Runtime(lambda: TinyGpt(cfg), tp_plan(cfg), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                 StoreLayoutSource(store, "bench", wid), store,
                 RuntimeConfig(job="bench", collective_timeout_s=60, rendezvous_timeout_s=300,
                               reconfigure_timeout_s=300))
    rt.start(timeout=300)
    while rt.step < steps:
        if wid == victim and rt.step == park_at:
            store.set("bench/parked", "1")
            time.sleep(3600)
        r = rt.train_step(batch, lambda m, b: m.loss(*b))
        q.put(("step", wid, r.step, r.tp, r.seconds))
    q.put(("timeline", wid, [(e.what, e.version, e.at) for e in rt.timeline]))
    rt.close()


def bench_failover(quick: bool, small_batch: bool = False) -> tuple[list[tuple[str, ...]], dict[str, float]]:
    """`small_batch`: one 16-token sample per replica, so compute bounds the stall less (the
    detection waits for the survivors' compute to reach the dead rank's collective; the first step
    is a step)."""
    cfg = GptConfig(vocab=1024, seq=32, d_model=256, heads=8, mlp=1024, layers=2) if quick else BIG
    if small_batch:
        cfg = GptConfig(**{**cfg.__dict__, "seq": 16})
    lb = 1 if small_batch else 4
    params = sum(p.numel() for p in TinyGpt(cfg).parameters())
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=dt.timedelta(seconds=300))
    a, b = ["w0", "w1", "w2", "w3"], ["w4", "w5", "w6", "w7"]
    publish_layout(store, "bench", 1, [(a, lb), (b, lb)], "start")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = {w: ctx.Process(target=_rt_worker, args=(w, port, cfg, 3, "w3", 5, q)) for w in a + b}
    for p in procs.values():
        p.start()
    t_kill = kill_parked(store, procs["w3"].pid)  # the peers are inside step 3, blocked on it
    # the manager's part (detection, planning) is measured end to end in bench/e2e.py
    publish_layout(store, "bench", 2, [(a[:3], max(1, 3 * lb // 4)), (b, lb)], "w3 failed")
    timelines: dict[str, list[tuple[str, int, float]]] = {}
    step_secs: list[float] = []
    while len(timelines) < 7:
        msg = q.get(timeout=900)
        if msg[0] == "timeline":
            timelines[msg[1]] = msg[2]
        elif msg[3] == 4 and msg[2] < 3:
            step_secs.append(msg[4])
    for p in procs.values():
        p.join(timeout=60)

    detect, received = last_event(timelines, "failure detected"), last_event(timelines, "layout received")
    regroup, reshard = last_event(timelines, "regrouped"), last_event(timelines, "reshard done")
    first = last_event(timelines, "first step")
    split = {"detection": detect - t_kill, "regroup": regroup - detect, "layout wait": received - detect,
             "reshard": reshard - regroup, "first step": first - reshard, "total": first - t_kill,
             "step before": statistics.median(step_secs) if step_secs else float("nan")}
    rows = [(f"{params / 1e6:.0f}M", *(f"{split[k]:.2f}" for k in FAILOVER_PARTS))]
    return rows, split


# ---- 4. what gradient clipping adds to a step ------------------------------------------------------
def _clip_worker(_index: int, port: int, cfg: GptConfig, q: Any) -> None:
    _init(0, 1, port)
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(0)
    model = TinyGpt(cfg)
    lay = SyncLayout(replicas_from([[0]], [4]), unit_counts(cfg))
    fams = families_of(tp_plan(cfg), model)
    parallelize(model, tp_plan(cfg), lay.units_of(0), group=None)
    sync = NtpGradSync(model, lay, 0, fams)
    idx = torch.randint(0, cfg.vocab, (4, cfg.seq))

    def timed(fn: Any, reps: int) -> float:
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return statistics.median(out)

    def fwd_bwd() -> None:
        sync.zero_grad()
        model.loss(idx, torch.roll(idx, -1, 1)).backward()
        sync.sync()

    fwd_bwd()
    step = timed(fwd_bwd, 3)
    norm = timed(sync.norm_share, 10)
    # the runtime's scaling: clip_grads_with_norm_ with the agreed norm (here one that clips)
    big = torch.tensor(1e3, dtype=torch.float64)
    scale = timed(lambda: clip_grads_with_norm_(model.parameters(), 1.0, big), 10)
    params = sum(p.numel() for p in model.parameters())
    q.put((params, step, norm, scale))
    dist.destroy_process_group()


def bench_clip(quick: bool) -> list[tuple[str, ...]]:
    """The work max_grad_norm adds on one rank holding the whole model (TP1: the most a rank can
    hold): its share of the norm and the scaling pass, against forward + backward + sync of 4
    samples. The norm's all-gather costs nothing extra (it rides in the commit vote)."""
    cfg = GptConfig(vocab=1024, seq=32, d_model=256, heads=8, mlp=1024, layers=2) if quick else BIG
    q = mp.get_context("spawn").SimpleQueue()
    ctx = mp.start_processes(_clip_worker, args=(free_port(), cfg, q), nprocs=1, join=False, start_method="spawn")
    params, step, norm, scale = q.get()
    while not ctx.join():
        pass
    return [(f"{params / 1e6:.0f}M", f"{step * 1e3:.0f}", f"{norm * 1e3:.1f}", f"{scale * 1e3:.1f}",
             f"{(norm + scale) / step:.1%}")]


# ---- 5. a layout switch alone: kill -> first step, with its phases and the reshard's GB/s -------
# TinyGpt sizes: "118m" is BIG (the CPU figures of issue 32), "150m" and "500m" stand in for the
# 157M / 500M Llamas of the H200 run (hidden 1024 / 2048, 8 layers, a 24,000-token vocabulary)
SWITCH_SIZES = {
    "quick": GptConfig(vocab=1024, seq=32, d_model=256, heads=8, mlp=1024, layers=2),
    "118m": BIG,
    "150m": GptConfig(vocab=24000, seq=64, d_model=1024, heads=16, mlp=4096, layers=8),
    "500m": GptConfig(vocab=24000, seq=64, d_model=2048, heads=16, mlp=8192, layers=8),
}
SWITCH_PHASES = (("detected", "failure detected"), ("left", "left old group"), ("layout", "layout received"),
                 ("groups", "world group"), ("old layout", "old layout"), ("checked", "checked"),
                 ("tp groups", "tp groups"), ("reshard moves", "reshard moves"), ("replicated", "replicated"),
                 ("sync", "sync"))


def _switch_worker(wid: str, index: int, port: int, cfg: GptConfig, device: str, staged: bool, chunk: int | None,
                   per_tensor: bool, park_at: int, victim: str, steps: int, q: Any, abort_poll: float = 0.05) -> None:
    from ntp_manager.worker import comm

    torch.set_num_threads(1)
    if chunk is not None:
        comm.configure(chunk_bytes=chunk)
    comm.configure(coalesce=not per_tensor)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=300))

    def batch(step: int, start: int, count: int) -> Any:
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, cfg.vocab, (8, cfg.seq), generator=g)
        return idx[start : start + count], torch.roll(idx, -1, 1)[start : start + count]

    rt = Runtime(lambda: TinyGpt(cfg), tp_plan(cfg), lambda p: torch.optim.AdamW(p, lr=1e-4),
                 StoreLayoutSource(store, "bench", wid), store,
                 RuntimeConfig(job="bench", collective_timeout_s=60, rendezvous_timeout_s=300,
                               reconfigure_timeout_s=300, device=device, force_staging=staged, abort_poll_s=abort_poll,
                               local_rank=index, local_world_size=8))
    rt.start(timeout=300)
    before = (0, 0)
    while rt.step < steps:
        if wid == victim and rt.step == park_at:
            store.set("bench/parked", "1")
            time.sleep(3600)
        if rt.step == park_at:
            before = (comm.stats.flat_bytes, comm.stats.flat_messages)
        r = rt.train_step(batch, lambda m, b: m.loss(*b))
        q.put(("step", wid, r.step, r.tp, r.seconds))
    moved = (comm.stats.flat_bytes - before[0], comm.stats.flat_messages - before[1])
    # (per_tensor: nothing went through FlatExchange, 0 bytes counted: the moves carry the same
    # bytes as the coalesced run's, compare the reshard-moves seconds)
    q.put(("timeline", wid, [(e.what, e.version, e.at) for e in rt.timeline], rt.switch_marks, moved,
           rt.choice.backend, str(rt.device)))
    rt.close()


def bench_switch(size: str, device: str, staged: bool, chunk: int | None = None, per_tensor: bool = False,
                 park_at: int = 4, profile: Path | None = None, abort_poll: float = 0.05) -> dict[str, Any]:
    """2 replicas x TP4, AdamW; w3 is killed inside step `park_at`; the survivors go to TP3 + TP4.
    Returns the seconds of each phase (the last rank to reach it), the steady step (median over the
    steps before the failure, slowest rank, after one warm-up step), and the reshard's bytes and
    GB/s per rank (sent + received, over the rank's own reshard-moves phase). With `profile` (a
    folder) py-spy samples each survivor from the kill until it reports its first step at the new
    layout (bench/swprof.py), one speedscope file per rank; the samplers attach while the victim is
    parked, 6 s before the kill (so their symbols are loaded by then): the profile's "detection wait"
    holds those seconds too (the phase table's detection is from the kill)."""
    cfg = SWITCH_SIZES[size]
    params = sum(p.numel() for p in TinyGpt(cfg).parameters())
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=dt.timedelta(seconds=300))
    a, b = ["w0", "w1", "w2", "w3"], ["w4", "w5", "w6", "w7"]
    publish_layout(store, "bench", 1, [(a, 4), (b, 4)], "start")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = {w: ctx.Process(target=_switch_worker, args=(w, i, port, cfg, device, staged, chunk, per_tensor,
                                                          park_at, "w3", park_at + 2, q, abort_poll))
             for i, w in enumerate(a + b)}
    for p in procs.values():
        p.start()
    spies: dict[str, Any] = {}

    def attach() -> None:  # before the kill: py-spy --native resolves symbols for seconds after attaching
        assert profile is not None
        spies.update({w: swprof.attach(p.pid, profile / f"{w}.json") for w, p in procs.items()
                      if w != "w3" and p.pid is not None})

    t_kill = kill_parked(store, procs["w3"].pid, attach if profile else None, 6.0 if profile else 1.0)
    publish_layout(store, "bench", 2, [(a[:3], 3), (b, 4)], "w3 failed")
    done: dict[str, tuple[Any, ...]] = {}
    steps: dict[int, list[float]] = {}
    while len(done) < 7:
        msg = q.get(timeout=1800)
        if msg[0] == "timeline":
            done[msg[1]] = msg[2:]
        elif msg[2] >= park_at and msg[1] in spies:  # its first step at the new layout: stop sampling
            swprof.signal_stop(spies[msg[1]])
        elif msg[2] < park_at:
            steps.setdefault(msg[2], []).append(msg[4])
    for spy in spies.values():
        swprof.stop(spy)
    for p in procs.values():
        p.join(timeout=60)
    timelines = {w: d[0] for w, d in done.items()}
    detect, regroup = last_event(timelines, "failure detected"), last_event(timelines, "regrouped")
    reshard, first = last_event(timelines, "reshard done"), last_event(timelines, "first step")
    steady = statistics.median(max(s) for k, s in steps.items() if k >= 1)
    # per rank: its reshard-moves phase, the bytes it sent and received in it
    rates, moved, msgs, moves_s = [], [], [], []
    for _, marks, (nbytes, nmsgs), *_ in done.values():
        at = dict(marks)
        secs = at["reshard moves"] - at["tp groups"]
        moves_s.append(secs)
        moved.append(nbytes)
        msgs.append(nmsgs)
        if nbytes > 0:
            rates.append(nbytes / secs / 1e9)
    # by when the last rank finished each phase, after the kill
    phases = {label: max(dict(d[1]).get(mark, float("nan")) for d in done.values()) - t_kill
              for label, mark in SWITCH_PHASES}
    backend, dev = next(iter(done.values()))[3:5]
    return {"size": size, "per_tensor": per_tensor, "params": params, "device": dev, "backend": backend,
            "staged": staged or dev != "cpu",
            "steady": steady, "detection": detect - t_kill, "regroup": regroup - detect,
            "reshard": reshard - regroup, "first step": first - reshard, "total": first - t_kill,
            "over steady": first - t_kill - steady, "reshard moves": max(moves_s),
            # the time lost to the failure (issue 42): kill -> first step, less that step's own
            # time and the reshard -- what detection and the regroup cost (goal <= 0.5 s)
            "lost": (first - t_kill) - (first - reshard) - (reshard - regroup),
            "bytes max": max(moved), "messages max": max(msgs),
            "GB/s busiest": max(moved) / moves_s[moved.index(max(moved))] / 1e9 if max(moved) else float("nan"),
            "GB/s min": min(rates) if rates else float("nan"),
            "GB/s median": statistics.median(rates) if rates else float("nan"), "phases": phases,
            "moved by rank": {w: d[2][0] for w, d in done.items()}, "profile": profile}


def show_switch(console: Console, runs: list[dict[str, Any]]) -> None:
    med = {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items() if isinstance(v, float | int)
           and not isinstance(v, bool)}
    r0 = runs[0]
    where = f"{r0['device']}, {r0['backend']}" + (", staged" if r0["staged"] else "")
    where += ", one message per tensor slice (old path)" if r0["per_tensor"] else ", coalesced"
    show(console, f"Layout switch TP4+TP4 -> TP3+TP4, {r0['size']} ({r0['params'] / 1e6:.0f}M parameters), AdamW, "
         f"{where}: seconds, median of {len(runs)}",
         ("steady step", "detection", "regroup", "reshard", "first step", "kill -> first step", "- steady",
          "lost (goal <= 0.5)",
          "reshard moves (slowest rank)", "MB moved (busiest rank)", "its messages", "its GB/s",
          "GB/s per rank (min / median)"),
         [(f"{med['steady']:.2f}", f"{med['detection']:.2f}", f"{med['regroup']:.2f}", f"{med['reshard']:.2f}",
           f"{med['first step']:.2f}", f"{med['total']:.2f}", f"{med['over steady']:.2f}", f"{med['lost']:.2f}",
           f"{med['reshard moves']:.2f}", f"{med['bytes max'] / 1e6:.0f}", f"{med['messages max']:.0f}",
           f"{med['GB/s busiest']:.2f}",
           f"{med['GB/s min']:.2f} / {med['GB/s median']:.2f}")])
    ph = {k: statistics.median(r["phases"][k] for r in runs) for k in r0["phases"]}
    show(console, "  by when the last rank finished each phase (s after the kill, median)",
         tuple(ph), [tuple(f"{v:.2f}" for v in ph.values())])
    for r in runs:
        if r["profile"] is not None:
            show_profile(console, r["profile"], r["moved by rank"])


def show_profile(console: Console, folder: Path, moved: dict[str, int]) -> None:
    """The per-rank categories of the switch's py-spy profile, the busiest rank (most bytes moved)
    and the median one first, then the busiest rank's top leaf frames."""
    profs = {p.rank: p for p in (swprof.load(f) for f in sorted(folder.glob("w*.json")))}
    order = sorted(profs, key=lambda w: moved.get(w, 0), reverse=True)
    if not order:
        console.print(f"no profiles in {folder}")
        return
    busiest, median = order[0], order[len(order) // 2]
    rows = swprof.table([profs[w] for w in order])
    rows = [(r[0] + (" (busiest)" if r[0] == busiest else " (median)" if r[0] == median else ""),
             f"{moved.get(r[0], 0) / 1e6:.0f}", *r[1:]) for r in rows]
    show(console, f"  where each rank's time went, kill -> its first step (py-spy {swprof.RATE:g} Hz, share (s))",
         ("rank", "MB moved", "s sampled", *swprof.CATEGORIES), rows)
    for w in (busiest, median):
        top = profs[w].top(12)
        show(console, f"  {w}: top leaf frames from the switch's start to the first step (s)",
             ("frame", "s"), [(f[:110], f"{n:.2f}") for f, n in top])


# ---- 6. the transport alone: a pair of ranks swapping a reshard's worth of tensors ----------------
def _exchange_worker(rank: int, world: int, port: int, mb: int, pieces: int, q: Any) -> None:
    from ntp_manager.worker import comm

    _init(rank, world, port)
    n = mb * 2**20 // 4 // pieces
    out = {}
    for staged in (False, True):
        comm.configure(force_staging=staged)
        for coalesce in (False, True):
            sends = [torch.full((n,), float(rank + i)) for i in range(pieces)]
            recvs = [torch.empty(n) for _ in range(pieces)]
            ops = [P2P(True, t, 1 - rank) for t in sends] + [P2P(False, t, 1 - rank) for t in recvs]
            times = []
            for _ in range(4):
                dist.barrier()
                t = time.perf_counter()
                if coalesce:
                    comm.FlatExchange(ops).start().wait()
                else:
                    comm.wait_all(comm.exchange(ops))
                times.append(time.perf_counter() - t)
            assert all(r[0].item() == float(1 - rank + i) for i, r in enumerate(recvs))
            out[(staged, coalesce)] = statistics.median(times[1:])  # the first allocates the buffers
    q.put((rank, out))
    dist.destroy_process_group()


def bench_exchange(mb: int = 256, pieces: int = 64) -> list[tuple[str, ...]]:
    """Two ranks swap `mb` MiB each way as `pieces` tensors: per tensor vs coalesced, direct vs
    staged. GB/s per rank counts the bytes it sent and received."""
    q = mp.get_context("spawn").SimpleQueue()
    ctx = mp.start_processes(_exchange_worker, args=(2, free_port(), mb, pieces, q), nprocs=2, join=False,
                             start_method="spawn")
    res = [q.get() for _ in range(2)]
    while not ctx.join():
        pass
    rows: list[tuple[str, ...]] = []
    for key in res[0][1]:
        secs = max(r[1][key] for r in res)
        rows.append(("staged" if key[0] else "direct", "coalesced" if key[1] else "per tensor", f"{mb}",
                     f"{pieces}", f"{secs * 1e3:.0f}", f"{2 * mb * 2**20 / secs / 1e9:.2f}"))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=["sync", "reshard", "failover", "clip", "switch", "exchange"], action="append")
    ap.add_argument("--size", choices=list(SWITCH_SIZES), action="append",
                    help="switch: model size (repeat for several; default 118m, quick with --quick)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="switch: the tensors' device")
    ap.add_argument("--staged", action="store_true", help="switch: force gloo's host staging for CPU tensors")
    ap.add_argument("--chunk-mb", type=float, help="switch: FlatExchange chunk size (default comm.CHUNK_BYTES)")
    ap.add_argument("--abort-poll", type=float, default=0.05,
                    help="switch: RuntimeConfig.abort_poll_s (0: no doomed-step abort, the baseline)")
    ap.add_argument("--per-tensor", action="store_true",
                    help="switch: the old reshard transport, one message per tensor slice (for comparison)")
    ap.add_argument("--profile", type=Path, metavar="DIR",
                    help="switch: py-spy each surviving rank from the kill to its first step, write DIR/<run>/w*.json")
    ap.add_argument("--repeat", type=int, default=3, help="failover runs per batch size (median reported)")
    ap.add_argument("--bucket-mb", type=float, action="append",
                    help="DP all-reduce bucket size for the sync part (repeat it to compare sizes)")
    args = ap.parse_args()
    parts = set(args.only or ["sync", "reshard", "failover", "clip"])  # "switch": on request
    console = Console()
    console.print(f"torch {torch.__version__}, gloo, {os.cpu_count()} CPUs")
    if "sync" in parts:
        show(console, "NTP gradient sync (TP4+TP3) vs uniform TP4+TP4 (same model) and TP3+TP3 (same all-reduce"
             " bytes per rank); median, slowest rank",
             ("bucket MiB", "model", "TP4+TP4 ms", "TP3+TP3 ms", "NTP ms", "NTP msgs ms", "NTP / TP4",
              "NTP msgs / TP4", "NTP / TP3 (same bytes)"),
             [(f"{mb:g}", *row) for mb in (args.bucket_mb or [DEFAULT_BUCKET_BYTES / 2**20])
              for row in bench_sync(args.quick, mb)])
    if "reshard" in parts:
        show(console, "Reshard TP4 -> TP3 (weights + momentum), slowest rank",
             ("model", "MiB moved", "ms", "MiB/s"), bench_reshard(args.quick))
    if "clip" in parts:
        show(console, "Gradient clipping (max_grad_norm): added work on one rank holding the whole model (TP1)",
             ("model", "fwd+bwd+sync ms (4 samples)", "norm share ms", "scale ms", "added"), bench_clip(args.quick))
    if "exchange" in parts:
        show(console, "Point to point, 2 ranks on gloo swapping 256 MiB each way as 64 tensors (median of 3)",
             ("path", "messages", "MiB each way", "tensors", "ms", "GB/s per rank (sent + received)"),
             bench_exchange())
    if "switch" in parts:
        chunk = int(args.chunk_mb * 2**20) if args.chunk_mb else None
        for size in args.size or (["quick"] if args.quick else ["118m"]):
            show_switch(console, [bench_switch(size, args.device, args.staged, chunk, args.per_tensor,
                                               profile=args.profile / f"{size}-{i}" if args.profile else None,
                                               abort_poll=args.abort_poll)
                                  for i in range(args.repeat)])
    if "failover" not in parts:
        return
    rows = []
    for small in (False, True):
        runs = [bench_failover(args.quick, small_batch=small)[1] for _ in range(args.repeat)]
        params = sum(p.numel() for p in TinyGpt(BIG).parameters()) if not args.quick else None
        label = f"{params / 1e6:.0f}M" if params else "quick"
        label += " (1x16 tokens/replica)" if small else " (4x64 tokens/replica)"
        rows.append(failover_row(label, runs))
    show(console, f"Rank killed -> first step at TP3 (s, median of {args.repeat}; 8 ranks on {os.cpu_count()} CPUs)",
         ("model", "detection", "regroup", "reshard", "first step", "total", "step before", "worst total"), rows)


if __name__ == "__main__":
    main()
