"""One training step, CPU against CUDA, for the same model (issue 15):

1. One process, the whole model (no parallelism): forward, backward, optimizer step. The device
   alone.
2. The runtime: 2 replicas x TP2 (4 rank processes, gloo unless said), one step of
   forward/backward/NTP sync/commit/optimizer, for each transport the runtime can take here:
   CPU tensors on gloo; CPU tensors with comm.py's staging forced (what the staging costs, without
   a GPU); CUDA tensors on gloo, staged through pinned host memory (ranks share the GPUs there
   are); CUDA tensors on NCCL (only with a GPU per rank, >= 4 GPUs).

Rows that need CUDA (or 4 GPUs) are skipped with a message where there is none. Medians of the
steps after a warm-up; timings are the slowest rank's.

    python bench/devices.py [--quick] [--steps N]
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
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntp_manager.worker.launch import free_port
from ntp_manager.worker.runtime import Runtime, RuntimeConfig
from ntp_manager.worker.sources import StoreLayoutSource, publish_layout
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt, tp_plan

MODEL = GptConfig(vocab=4096, seq=64, d_model=512, heads=8, mlp=2048, layers=4)
QUICK = GptConfig(vocab=1024, seq=32, d_model=128, heads=4, mlp=512, layers=2)
BATCH = 8  # samples per step (global)


def _data(cfg: GptConfig, step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, cfg.vocab, (n, cfg.seq), generator=g)
    return idx, torch.roll(idx, -1, 1)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def single_step(cfg: GptConfig, device: torch.device, steps: int) -> float:
    """Median seconds of one forward/backward/AdamW step of the whole model on `device`."""
    torch.manual_seed(0)
    model = TinyGpt(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for s in range(steps + 2):
        idx, tgt = (t.to(device) for t in _data(cfg, s, BATCH))
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad()
        model.loss(idx, tgt).backward()  # type: ignore[no-untyped-call]
        opt.step()
        _sync(device)
        if s >= 2:  # warm-up: allocator, kernels, optimizer state
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(wid: str, index: int, port: int, cfg: GptConfig, mode: str, steps: int, q: Any) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 4))
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=300))
    modes: dict[str, dict[str, Any]] = {"cpu": {}, "cpu staged": {"force_staging": True},
                                        "cuda gloo": {"device": "cuda", "backend": "gloo"},
                                        "cuda nccl": {"device": "cuda", "backend": "nccl"}}
    opts = modes[mode]
    rt = Runtime(lambda: TinyGpt(cfg), tp_plan(cfg), lambda p: torch.optim.AdamW(p, lr=1e-3),
                 StoreLayoutSource(store, "devbench", wid), store,
                 RuntimeConfig(job="devbench", collective_timeout_s=120, rendezvous_timeout_s=300,
                               reconfigure_timeout_s=300, local_rank=index, local_world_size=4, **opts))
    rt.start(timeout=300)

    def batch(step: int, start: int, count: int) -> Any:
        idx, tgt = _data(cfg, step, BATCH)
        return idx[start : start + count], tgt[start : start + count]

    def loss(model: Any, b: Any) -> torch.Tensor:
        dev = next(model.parameters()).device
        out: torch.Tensor = model.loss(*(t.to(dev) for t in b))
        return out

    secs = []
    while rt.step < steps + 2:
        r = rt.train_step(batch, loss)
        _sync(rt.device)
        if r.step >= 2:
            secs.append(r.seconds)
    q.put((wid, statistics.median(secs), rt.choice.backend))
    rt.close()


def runtime_step(cfg: GptConfig, mode: str, steps: int) -> tuple[float, str]:
    """Median step seconds of the slowest rank, 2 replicas x TP2; and the backend used."""
    port = free_port()
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=300))
    a, b = ["d0", "d1"], ["d2", "d3"]
    publish_layout(store, "devbench", 1, [(a, BATCH // 2), (b, BATCH // 2)], "start")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(w, i, port, cfg, mode, steps, q)) for i, w in enumerate(a + b)]
    for p in procs:
        p.start()
    got = [q.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return max(s for _, s, _ in got), got[0][2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a small model")
    ap.add_argument("--steps", type=int, default=5, help="timed steps after 2 warm-up steps")
    ap.add_argument("--only", choices=["single", "runtime"], action="append")
    args = ap.parse_args()
    parts = set(args.only or ["single", "runtime"])
    cfg = QUICK if args.quick else MODEL
    params = sum(p.numel() for p in TinyGpt(cfg).parameters())
    console = Console()
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    gpu_name = torch.cuda.get_device_name(0) if cuda else "none"
    console.print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, GPUs: {gpus} ({gpu_name}); "
                  f"model {params / 1e6:.1f}M parameters, {BATCH} x {cfg.seq} tokens per step")
    if not cuda:
        console.print("[yellow]no CUDA device here: the CUDA rows are skipped (run this where a GPU is)[/yellow]")
    if "single" in parts:
        t = Table(title="One process, whole model: one AdamW step (median)")
        for c in ("device", "ms", "vs CPU"):
            t.add_column(c, justify="right")
        cpu_s = single_step(cfg, torch.device("cpu"), args.steps)
        t.add_row("cpu", f"{cpu_s * 1e3:.1f}", "1.00x")
        if cuda:
            gpu_s = single_step(cfg, torch.device("cuda", 0), args.steps)
            t.add_row(f"cuda ({gpu_name})", f"{gpu_s * 1e3:.1f}", f"{cpu_s / gpu_s:.2f}x faster")
        else:
            t.add_row("cuda", "skipped: no CUDA", "")
        console.print(t)
    if "runtime" in parts:
        t = Table(title="Runtime, 2 replicas x TP2 (4 ranks): one step incl. NTP sync (median, slowest rank)")
        for c in ("transport", "backend", "ms", "vs CPU"):
            t.add_column(c, justify="right")
        base, backend = runtime_step(cfg, "cpu", args.steps)
        t.add_row("cpu", backend, f"{base * 1e3:.1f}", "1.00x")
        s, backend = runtime_step(cfg, "cpu staged", args.steps)
        t.add_row("cpu, staging forced", backend, f"{s * 1e3:.1f}", f"{s / base:.2f}x")
        for mode, need in (("cuda gloo", 1), ("cuda nccl", 4)):
            if gpus >= need:
                s, backend = runtime_step(cfg, mode, args.steps)
                t.add_row(mode, backend, f"{s * 1e3:.1f}", f"{s / base:.2f}x")
            else:
                t.add_row(mode, "", f"skipped: needs {need} GPU(s), {gpus} here", "")
        console.print(t)


if __name__ == "__main__":
    main()
