"""Activation memory per pipeline stage (issue 34): GPipe vs 1F1B vs 1F1B + activation recomputation,
the ~118M TinyGpt cut into 4 stages (PP4 x TP1 x DP1: 4 ranks, the runtime itself, gloo), M
micro-batches of one sample each per step.

What each rank measures on every step (the first, which allocates the optimizer state and the
gradient buffers, is left out):

- live micro-batches: the most micro-batches whose forward has run and whose backward has not
  (`Runtime.last_pass.peak_live`, counted by the schedule as it runs);
- saved tensors: what autograd keeps for the backward, counted through
  `torch.autograd.graph.saved_tensors_hooks` around the step -- each saved tensor's storage once,
  parameters not counted -- live count and bytes, their peak over the step. These are the
  activations the schedule keeps alive. Under recomputation the outer hooks see only what each
  block keeps (its input); the block's own activations exist again while its backward runs, so the
  "+ one block" column adds one block's saved bytes for one micro-batch (measured the same way,
  once, in this process): the honest peak;
- on CUDA (`--device cuda`): `torch.cuda.max_memory_allocated()` during the step minus what was
  allocated at its start (parameters, gradients and optimizer state), i.e. everything the step
  adds: activations, the recomputation's transients, messages, the optimizer's temporaries;
- the step time: per step the slowest rank's `StepResult.seconds`; the median over the steps.

Goals: 1F1B's live micro-batches per stage <= the number of stages (GPipe: M); recomputation
cuts the activation bytes >= 3x.

    python bench/pipeline_memory.py [--quick] [--device cpu|cuda] [--steps N] [--micro M] [--seq T]
                                    [--mode gpipe|1f1b|1f1b+recompute] [--precision fp32|bf16]

It changes no device setting: on CUDA the four ranks share the GPUs there are (gloo, staged
through host memory, as the runtime chooses when ranks outnumber GPUs).
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import show
from ntp_manager.worker.launch import free_port
from ntp_manager.worker.pipeline import Pipeline
from ntp_manager.worker.runtime import Runtime, RuntimeConfig
from ntp_manager.worker.sources import StoreLayoutSource, publish_layout
from ntp_manager.worker.tiny_gpt import Block, GptConfig, TinyGpt, tp_plan

BIG = GptConfig(vocab=8192, seq=64, d_model=1024, heads=16, mlp=4096, layers=8)  # 118M, as bench/worker.py
QUICK = GptConfig(vocab=512, seq=32, d_model=128, heads=4, mlp=512, layers=4)
STAGES = 4
MODES = {"gpipe": ("gpipe", False), "1f1b": ("1f1b", False), "1f1b+recompute": ("1f1b", True)}


class SavedBytes:
    """Pack/unpack hooks that count the storages autograd keeps for the backward (each once, the
    parameters' not at all), live and at their peak. `model`'s parameters are read at the first
    saved tensor, inside the step: under bf16 they are then the step's bf16 copies."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.exclude: set[int] | None = None
        self.refs: dict[int, int] = {}  # storage address -> saved tensors holding it
        self.size: dict[int, int] = {}
        self.bytes = self.peak_bytes = self.peak_count = 0

    def pack(self, t: torch.Tensor) -> Any:
        if self.exclude is None:
            self.exclude = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr in self.exclude or st.nbytes() == 0:
            return t
        return _Held(self, t, ptr, st.nbytes())

    @staticmethod
    def unpack(h: Any) -> torch.Tensor:
        return h.t if isinstance(h, _Held) else h

    def add(self, ptr: int, n: int) -> None:
        if self.refs.get(ptr, 0) == 0:
            self.size[ptr] = n
            self.bytes += n
        self.refs[ptr] = self.refs.get(ptr, 0) + 1
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.peak_count = max(self.peak_count, sum(1 for r in self.refs.values() if r))

    def drop(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if self.refs[ptr] == 0:
            self.bytes -= self.size.pop(ptr)
            del self.refs[ptr]


class _Held:
    """A saved tensor, counted while autograd holds it (the graph drops it after its backward)."""

    __slots__ = ("owner", "ptr", "t")

    def __init__(self, owner: SavedBytes, t: torch.Tensor, ptr: int, n: int) -> None:
        self.owner, self.t, self.ptr = owner, t, ptr
        owner.add(ptr, n)

    def __del__(self) -> None:
        self.owner.drop(self.ptr)


def _batch(cfg: GptConfig, seq: int, size: int) -> Any:
    def batch(step: int, start: int, count: int) -> Any:
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(0, cfg.vocab, (size, seq), generator=g)
        return idx[start : start + count], torch.roll(idx, -1, 1)[start : start + count]
    return batch


def _rank(wid: str, index: int, port: int, cfg: GptConfig, seq: int, micro: int, steps: int, mode: str, device: str,
          precision: str, q: Any) -> None:
    torch.set_num_threads(1 if device == "cpu" else 4)
    store = dist.TCPStore("127.0.0.1", port, is_master=False,  # type: ignore[attr-defined]
                          timeout=dt.timedelta(seconds=600))
    schedule, recompute = MODES[mode]
    dev = torch.device("cuda") if device == "cuda" else torch.device("cpu")  # batches come on the CPU
    pipe = Pipeline(inputs=lambda b: b[0].to(dev), micro_batches=micro, loss=lambda y, b: nn.functional.cross_entropy(
        y.float().reshape(-1, y.shape[-1]), b[1].to(y.device).reshape(-1)))
    rt = Runtime(lambda: TinyGpt(cfg), tp_plan(cfg), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                 StoreLayoutSource(store, mode, wid), store,
                 RuntimeConfig(job=mode, schedule=schedule, recompute=recompute, device=device, precision=precision,
                               local_rank=index, local_world_size=STAGES, collective_timeout_s=300,
                               rendezvous_timeout_s=600, reconfigure_timeout_s=600), pipeline=pipe)
    rt.start(timeout=600)
    batch = _batch(cfg, seq, micro)
    cuda = rt.device.type == "cuda"
    for _ in range(steps + 1):
        counter = SavedBytes(rt.model)
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
            r = rt.train_step(batch)
        gpu = (torch.cuda.max_memory_allocated() - base) if cuda else -1
        assert rt.last_pass is not None
        q.put((mode, wid, r.stage, r.step, r.seconds, rt.last_pass.peak_live, counter.peak_count, counter.peak_bytes,
               gpu))
    rt.close()


def run_mode(mode: str, cfg: GptConfig, seq: int, micro: int, steps: int, device: str,
             precision: str) -> list[tuple[Any, ...]]:
    """One job of 4 ranks, one per stage, `steps` + 1 steps; every rank's records."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "ntp_manager.worker.runtime", "bench.pipeline_memory"])
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,  # type: ignore[attr-defined]
                          timeout=dt.timedelta(seconds=600))
    names = [f"s{s}" for s in range(STAGES)]
    publish_layout(store, mode, 1, [([[w] for w in names], micro)], "start")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(w, i, port, cfg, seq, micro, steps, mode, device, precision, q))
             for i, w in enumerate(names)]
    for p in procs:
        p.start()
    out: list[tuple[Any, ...]] = []
    try:
        deadline = time.monotonic() + 1800
        while len(out) < STAGES * (steps + 1):
            try:
                out.append(q.get(timeout=5))
            except Exception as e:
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    raise RuntimeError(f"{mode}: a rank failed ({[p.exitcode for p in procs]}) or time ran out") from e
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return out


def one_block_bytes(cfg: GptConfig, seq: int, dtype: torch.dtype) -> int:
    """What one block keeps for the backward of one micro-batch (one sample): the activations a
    recomputed block holds again while its backward runs."""
    torch.manual_seed(0)
    blk = Block(cfg).to(dtype)
    counter = SavedBytes(blk)
    x = torch.randn(1, seq, cfg.d_model, dtype=dtype, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        y = blk(x)
    return counter.peak_bytes if y is not None else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 1.5M model (checks the script, not the figures)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per mode, after one warm-up step")
    ap.add_argument("--micro", type=int, default=8, help="micro-batches per step (one sample each)")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sample")
    ap.add_argument("--mode", choices=list(MODES), action="append", help="default: all three")
    ap.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = ap.parse_args()
    base = QUICK if args.quick else BIG
    cfg = GptConfig(**{**base.__dict__, "seq": max(base.seq, args.seq)})
    console = Console(width=160)
    params = sum(p.numel() for p in TinyGpt(cfg).parameters())
    load = os.getloadavg()
    console.print(f"torch {torch.__version__}, {args.device}, {os.cpu_count()} CPUs, load {load[0]:.2f} "
                  f"{load[1]:.2f} {load[2]:.2f}; TinyGpt {params / 1e6:.1f}M, PP{STAGES} x TP1 x DP1, "
                  f"{args.micro} micro-batches of 1 x {args.seq} tokens, {args.precision}")
    block = one_block_bytes(cfg, args.seq, torch.bfloat16 if args.precision == "bf16" else torch.float32)
    per: dict[str, dict[int, dict[str, float]]] = {}
    times: dict[str, float] = {}
    for mode in args.mode or list(MODES):
        recs = [r for r in run_mode(mode, cfg, args.seq, args.micro, args.steps, args.device, args.precision)
                if r[3] >= 1]
        by_step: dict[int, float] = {}
        for _, _, _, step, secs, *_ in recs:
            by_step[step] = max(by_step.get(step, 0.0), secs)
        times[mode] = statistics.median(by_step.values())
        per[mode] = {}
        for _, _, stage, _, _, live, count, nbytes, gpu in recs:
            d = per[mode].setdefault(stage, {"live": 0, "count": 0, "bytes": 0, "gpu": -1})
            d["live"], d["count"] = max(d["live"], live), max(d["count"], count)
            d["bytes"], d["gpu"] = max(d["bytes"], nbytes), max(d["gpu"], gpu)
        # as each job ends, so that a run cut short (a time limit) keeps what it measured
        console.print(f"{mode}: step {times[mode]:.3f} s; per stage (live micro-batches, saved MiB, CUDA peak MiB): "
                      + ", ".join(f"{d['live']:.0f} / {d['bytes'] / (1 << 20):.1f} / "
                                  + (f"{d['gpu'] / (1 << 20):.1f}" if d["gpu"] >= 0 else "-")
                                  for _, d in sorted(per[mode].items())))
    mib = 1 << 20
    rows: list[tuple[str, ...]] = []
    for mode, stages in per.items():
        rc = MODES[mode][1]
        for s, d in sorted(stages.items()):
            honest = d["bytes"] + (block if rc else 0)
            rows.append((mode, str(s), f"{d['live']:.0f}", str(STAGES if mode != "gpipe" else args.micro),
                         f"{d['count']:.0f}", f"{d['bytes'] / mib:.1f}", f"{honest / mib:.1f}",
                         f"{d['gpu'] / mib:.1f}" if d["gpu"] >= 0 else "-"))
    show(console, f"Activations per stage, peak over a step ({args.device}; live micro-batches: goal <= "
         f"{STAGES} stages for 1F1B, {args.micro} for GPipe)",
         ("schedule", "stage", "live micro-batches", "bound", "saved tensors", "saved MiB", "+ one block MiB",
          "CUDA peak MiB"), rows)
    summary: list[tuple[str, ...]] = []
    for mode, stages in per.items():
        worst = max(d["bytes"] + (block if MODES[mode][1] else 0) for d in stages.values())
        ref = max(d["bytes"] for d in per["1f1b"].values()) if "1f1b" in per else float("nan")
        gpu = max(d["gpu"] for d in stages.values())
        ref_gpu = max(d["gpu"] for d in per["1f1b"].values()) if "1f1b" in per else float("nan")
        summary.append((mode, f"{times[mode]:.2f}", f"{worst / mib:.1f}", f"{ref / worst:.2f}x",
                        f"{ref_gpu / gpu:.2f}x" if gpu > 0 else "-"))
    show(console, "Summary: steady step (median of the slowest rank) and the worst stage's activation bytes "
         "(recomputation: + one block; goal: 1F1B / (1F1B + recompute) >= 3x)",
         ("schedule", "step s", "worst stage MiB", "1F1B / this", "CUDA: 1F1B / this"), summary)


if __name__ == "__main__":
    main()
