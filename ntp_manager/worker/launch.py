"""A local launcher: one process per GPU (rank), the TCPStore the runtime's process groups meet in,
and the records the ranks send back. Used by examples/train_gpt.py, `make demo` and the tests.

Each rank trains `TinyGpt` on a synthetic, learnable token stream (a fixed random bigram table with
a little noise), so the loss falls and any divergence between layouts would show. The global sample
order depends only on the step number: `batch(step, start, count)` is the same slice whatever the
layout, which is what makes runs comparable with a single-process reference.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.table import Table
from torch import nn

from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt, tiny_loss, tp_plan

MAX_BATCH = 64
DEMO_MODEL = GptConfig(vocab=64, seq=16, d_model=48, heads=6, mlp=96, layers=2)


@dataclass(frozen=True)
class TrainSpec:
    job: str
    cfg: GptConfig = DEMO_MODEL
    steps: int = 30
    lr: float = 0.05
    momentum: float = 0.9
    step_delay_s: float = 0.0  # slows steps down to a pace people can follow (demo)
    collective_timeout_s: float = 10.0
    reconfigure_timeout_s: float = 120.0
    stages: int = 1  # pipeline depth the layouts will have (> 1: the ranks run TinyGpt as stages)
    micro_batches: int = 0  # per replica and step in a pipeline (0: as many as stages)


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)[:100]


# What the launcher's fork server imports before it forks any rank (every rank needs all of it).
RANK_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",  # the first optimizer a process builds imports it (torch.optim's decorator)
    "ntp_manager.worker.runtime",
    "ntp_manager.worker.checkpoint",
    "ntp_manager.worker.sources",
    "ntp_manager.worker.pipeline",
    "ntp_manager.worker.launch",
)


@contextlib.contextmanager
def _no_sigint() -> Iterator[None]:
    """SIGINT ignored while a rank process is started: the fork server, started by the first
    rank, begins with it ignored (an ignored signal stays ignored across exec, and Python then
    installs no KeyboardInterrupt handler), and so does every rank it forks, so a Ctrl-C at a
    terminal prints no traceback from any of them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bigram_table(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(12345)
    return torch.randint(0, vocab, (vocab,), generator=g)


class Batch(NamedTuple):
    """Inputs and next-token targets of some samples. It names its sequences' lengths, so the
    runtime's step reports carry tokens and the sum of squared lengths (the fail-slow detector's
    measure of the work, issue 21). The synthetic stream has no padding: every sequence is full."""

    inputs: torch.Tensor
    targets: torch.Tensor

    @property
    def sequence_lengths(self) -> tuple[int, ...]:
        return (int(self.inputs.shape[1]),) * int(self.inputs.shape[0])


def batch(cfg: GptConfig, step: int, start: int, count: int) -> Batch:
    """Samples [start, start+count) of step `step`'s global batch."""
    g = torch.Generator().manual_seed(10_000 + step)
    nxt = bigram_table(cfg.vocab)
    seq = torch.empty(MAX_BATCH, cfg.seq + 1, dtype=torch.long)
    seq[:, 0] = torch.randint(0, cfg.vocab, (MAX_BATCH,), generator=g)
    noise = torch.rand(MAX_BATCH, cfg.seq, generator=g) < 0.1
    rand = torch.randint(0, cfg.vocab, (MAX_BATCH, cfg.seq), generator=g)
    for i in range(cfg.seq):
        seq[:, i + 1] = torch.where(noise[:, i], rand[:, i], nxt[seq[:, i]])
    return Batch(seq[start : start + count, :-1], seq[start : start + count, 1:])


SLOW_ENV = "NTP_DEMO_SLOW_RANK"
BACKWARD_PER_FORWARD = 2.0  # a backward pass costs about twice its forward
T = TypeVar("T")


@dataclass(frozen=True)
class SlowRank:
    """A rank made slow on purpose (the fail-slow demo, issue 21): from step `from_step` on, the
    worker `worker` runs its forward and backward `factor` times slower, as a throttled GPU would.
    Set by the environment variable NTP_DEMO_SLOW_RANK="<worker id>:<factor>[@<from step>]"
    (e.g. "GPU-1234:3@6"), read by each rank process when it starts.

    How: after the forward (inside the runtime's timed forward + backward), the rank sleeps
    (factor - 1) x (1 + BACKWARD_PER_FORWARD) x its forward's own time (TP waits left out), so its
    measured compute rises about `factor` x with the work. Nothing waits on a device: on CPU the
    host's time is the compute. Its TP peers then wait for it in their all-reduces (their
    communication wait rises, their compute does not), which is what a slow GPU looks like."""

    worker: str
    factor: float
    from_step: int = 0

    @classmethod
    def parse(cls, text: str) -> SlowRank:
        """`<worker id>:<factor>[@<from step>]`; ValueError naming the variable and what is wrong."""
        head, _, frm = text.strip().partition("@")
        worker, sep, fac = head.rpartition(":")
        if not sep or not worker:
            raise ValueError(f"{SLOW_ENV}={text!r}: expected <worker id>:<factor>[@<from step>]")
        try:
            factor = float(fac)
            from_step = int(frm) if frm else 0
        except ValueError:
            raise ValueError(f"{SLOW_ENV}={text!r}: factor must be a number and the step an integer") from None
        if not 1.0 <= factor <= 100.0:  # NaN fails too
            raise ValueError(f"{SLOW_ENV}={text!r}: factor must be in [1, 100], got {factor}")
        if from_step < 0:
            raise ValueError(f"{SLOW_ENV}={text!r}: from step must be >= 0, got {from_step}")
        return cls(worker, factor, from_step)

    @classmethod
    def from_env(cls, worker: str) -> SlowRank | None:
        """The slowdown the environment asks of `worker` (None: none, or another worker's)."""
        text = os.environ.get(SLOW_ENV, "")
        if not text.strip():
            return None
        slow = cls.parse(text)
        return slow if slow.worker == worker else None

    def run(self, step: int, fn: Callable[[], T]) -> T:
        """`fn()` (a forward), then the sleep that makes this step's compute `factor` x slower."""
        if step < self.from_step or self.factor <= 1.0:
            return fn()
        from ntp_manager.worker import tp as tp_mod

        t0, w0 = time.perf_counter(), tp_mod.TP_WAIT.seconds
        out = fn()
        busy = max(0.0, time.perf_counter() - t0 - (tp_mod.TP_WAIT.seconds - w0))
        time.sleep((self.factor - 1.0) * (1.0 + BACKWARD_PER_FORWARD) * busy)
        return out


def reference_losses(spec: TrainSpec, global_batches: list[int], seed: int = 0) -> list[float]:
    """The single-process run on the same global batches."""
    torch.manual_seed(seed)
    m = TinyGpt(spec.cfg)
    opt = torch.optim.SGD(m.parameters(), lr=spec.lr, momentum=spec.momentum)
    out = []
    for s, gb in enumerate(global_batches):
        opt.zero_grad()
        loss = m.loss(*batch(spec.cfg, s, 0, gb))
        torch.autograd.backward(loss)  # Tensor.backward is unannotated in torch 2.13
        opt.step()
        out.append(loss.item())
    return out


@dataclass(frozen=True)
class RankSpec:
    worker_id: str
    store_port: int
    source: str  # "store" | "grpc"
    manager: str = ""
    token: str = ""
    gpu_uuid: str = ""
    label: str = ""  # a short name for its log lines and log file (default: the worker id)

    @property
    def name(self) -> str:
        return self.label or self.worker_id


def _rank_output(rank: RankSpec, log: str, fmt: str) -> None:
    """Where a rank's output goes. With a `log` file, everything the process writes (its log, a
    traceback, what torch or gloo print from C++) is appended there: its stdout and stderr
    descriptors are pointed at the file. The log itself is structlog's, to stderr, every line
    naming the rank (`worker=<name>`); `fmt` as `configure_logging` takes it."""
    from ntp_manager.contract.logs import configure_logging

    if log:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    configure_logging(fmt, fields={"worker": rank.name})


def rank_main(train: TrainSpec, rank: RankSpec, q: Any, log: str = "", log_format: str = "console",
              env: dict[str, str] | None = None) -> None:
    """The body of one rank's process: output to `log` (a file; "": the launcher's stderr), in the
    launcher's environment `env` as it was when the rank was started."""
    # the launcher stops its ranks (SIGTERM); Ctrl-C at a terminal reaches every process of the
    # foreground group, and must not print a traceback from each of them
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    _rank_output(rank, log, log_format)
    q.put({"kind": "event", "worker": rank.worker_id, "what": "process up", "version": -1, "detail": "",
           "at": time.time()})
    from ntp_manager.worker.runtime import Runtime, RuntimeConfig, TimelineEvent
    from ntp_manager.worker.sources import GrpcLayoutSource, LayoutSource, StoreLayoutSource

    torch.set_num_threads(1)
    try:  # a bad value stops the rank here, saying why
        slow = SlowRank.from_env(rank.worker_id)
        if slow is not None and train.stages > 1:
            raise ValueError(f"{SLOW_ENV} slows single-stage runs only (stage 1 of a pipeline would wait for "
                             f"stage 0 inside its compute); this run has {train.stages} stages")
    except ValueError as e:
        q.put({"kind": "error", "worker": rank.worker_id, "error": f"ValueError: {e}"})
        raise
    # torch.distributed imports TCPStore without re-exporting it to type checkers (no `as`)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", rank.store_port, is_master=False, timeout=dt.timedelta(seconds=300))
    source: LayoutSource
    if rank.source == "grpc":
        source = GrpcLayoutSource(rank.manager, rank.token, train.job, rank.gpu_uuid, rank.worker_id)
    else:
        source = StoreLayoutSource(store, train.job, rank.worker_id)
    cfg = RuntimeConfig(job=train.job, collective_timeout_s=train.collective_timeout_s,
                        rendezvous_timeout_s=max(60.0, 2 * train.collective_timeout_s),
                        reconfigure_timeout_s=train.reconfigure_timeout_s)

    def on_event(ev: TimelineEvent) -> None:
        q.put({"kind": "event", "worker": rank.worker_id, "what": ev.what, "version": ev.version,
               "detail": ev.detail, "at": ev.at})

    pipeline = None
    if train.stages > 1:
        from ntp_manager.worker.pipeline import Pipeline

        pipeline = Pipeline(inputs=lambda b: b[0], loss=lambda logits, b: nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), b[1].reshape(-1)), micro_batches=train.micro_batches)
    rt = Runtime(lambda: TinyGpt(train.cfg), tp_plan(train.cfg),
                 lambda p: torch.optim.SGD(p, lr=train.lr, momentum=train.momentum), source, store, cfg,
                 on_event=on_event, pipeline=pipeline)
    try:
        rt.start()
        stop_key = f"ntp/{train.job}/stop_at"
        while rt.step < train.steps:
            if store.check([stop_key]) and rt.step >= int(store.get(stop_key)):
                break  # the launcher set a last step; every rank reads the same number
            if pipeline is None and slow is not None:
                r = rt.train_step(lambda s, a, n: batch(train.cfg, s, a, n),
                                  lambda m, b: slow.run(rt.step, lambda: tiny_loss(m, b)))
            elif pipeline is None:
                r = rt.train_step(lambda s, a, n: batch(train.cfg, s, a, n), tiny_loss)
            else:
                r = rt.train_step(lambda s, a, n: batch(train.cfg, s, a, n))
            q.put({"kind": "step", "worker": rank.worker_id, "step": r.step, "loss": r.loss,
                   "global_batch": r.global_batch, "local_batch": r.local_batch, "version": r.version,
                   "tp": r.tp, "stage": r.stage, "seconds": r.seconds, "at": time.time()})
            if train.step_delay_s:
                time.sleep(train.step_delay_s)
        q.put({"kind": "done", "worker": rank.worker_id, "step": rt.step})
    except Exception as e:
        q.put({"kind": "error", "worker": rank.worker_id, "error": f"{type(e).__name__}: {e}"})
        raise
    finally:
        rt.close()


@dataclass
class Launcher:
    """Hosts the store; starts, kills and restarts rank processes; drains their records. With a
    `log_dir`, each rank's output goes to `<log_dir>/rank-<name>.log` (a restarted rank appends to
    its file); without one, to this process's stderr, each log line naming its rank."""

    train: TrainSpec
    port: int = 0
    procs: dict[str, Any] = field(default_factory=dict)
    records: list[dict[str, Any]] = field(default_factory=list)
    log_dir: Path | None = None
    log_format: str = "console"  # the ranks' log lines (configure_logging's fmt)

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.store = dist.TCPStore(  # type: ignore[attr-defined]  # (see rank_main)
            "127.0.0.1", self.port, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=300))
        # Rank processes come from a fork server that has imported the runtime once (RANK_PRELOAD):
        # a rank, a restarted one too, starts in milliseconds instead of importing torch again
        # (2-4 CPU seconds each). The server runs only imports (no threads of ours, no groups).
        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(list(RANK_PRELOAD))
        # one queue per rank: a rank SIGKILLed while writing can wedge only its own queue's lock
        self.queues: dict[str, Any] = {}
        self._examined = 0  # records already shown to wait_for predicates

    def log_path(self, rank: RankSpec) -> Path | None:
        """The file rank `rank`'s output goes to (None: this process's stderr)."""
        return None if self.log_dir is None else self.log_dir / f"rank-{_file_name(rank.name)}.log"

    def start(self, rank: RankSpec) -> None:
        q = self.ctx.Queue()
        log = self.log_path(rank)
        # the environment as it is now (a forked rank would see the server's, from its start)
        p = self.ctx.Process(target=rank_main, args=(self.train, rank, q, str(log or ""), self.log_format,
                                                     dict(os.environ)),
                             daemon=True, name=f"rank-{rank.worker_id}")
        with _no_sigint():
            p.start()
        self.procs[rank.worker_id], self.queues[rank.worker_id] = p, q

    def kill(self, worker_id: str) -> None:
        p = self.procs[worker_id]
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=10)
        q = self.queues.pop(worker_id, None)
        if q is not None:  # not read again: the rank may have died inside a write
            q.close()

    def _poll(self) -> list[dict[str, Any]]:
        got = []
        for q in list(self.queues.values()):
            while True:
                try:
                    got.append(q.get_nowait())
                except queue.Empty:
                    break
        got.sort(key=lambda r: r.get("at", 0.0))
        self.records.extend(got)
        return got

    def drain(self) -> list[dict[str, Any]]:
        return self._poll()

    def wait_for(self, pred: Any, timeout: float) -> dict[str, Any]:
        """Examine records (each once, in arrival order, across calls) until `pred(record)` holds for
        one and return it; raises TimeoutError, or RuntimeError when a rank reports an error or every
        rank process has exited."""
        deadline = time.monotonic() + timeout
        while True:
            self._poll()
            while self._examined < len(self.records):
                rec = self.records[self._examined]
                self._examined += 1
                if rec["kind"] == "error":
                    raise RuntimeError(f"rank {rec['worker']} failed: {rec['error']}")
                if pred(rec):
                    return rec
            if time.monotonic() > deadline:
                raise TimeoutError("the ranks did not get there in time")
            if self.procs and not any(p.is_alive() for p in self.procs.values()):
                if self._poll():
                    continue  # what they sent just before exiting
                raise RuntimeError("every rank process has exited")
            time.sleep(0.02)

    def stop_at(self, step: int) -> None:
        """Ranks stop once `step` steps have completed (set it a few steps ahead of the newest record,
        `newest_step`: every rank must read it before getting there, or one that has passed it stops
        while its peers are in the next step's collectives)."""
        self.store.set(f"ntp/{self.train.job}/stop_at", str(step))

    def newest_step(self) -> int:
        """The highest step any rank has reported so far (0 before any); `wait_for` still examines
        every record."""
        self._poll()
        return max((int(r["step"]) for r in self.records if r["kind"] == "step"), default=0)

    def alive(self) -> list[str]:
        return [w for w, p in self.procs.items() if p.is_alive()]

    def stop(self) -> None:
        """Stop every rank (SIGTERM, SIGKILL after 10 s) and release the queues' semaphores and
        pipes; records already received stay in `records`."""
        for p in self.procs.values():
            if p.is_alive():
                p.terminate()
        for p in self.procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        self._poll()
        for q in self.queues.values():
            q.close()
            q.join_thread()
        self.queues.clear()

    def loss_report(self) -> tuple[list[tuple[int, int, int, float, float]], Table]:
        """Every completed step (step, layout version, global batch, loss, reference loss) beside a
        single-process run on the same global batches, and the same as a rich table. The reference
        needs every step from 0; with a gap its column is NaN."""
        by_step: dict[int, dict[str, Any]] = {}
        for r in self.records:
            if r["kind"] == "step":
                by_step.setdefault(r["step"], r)
        steps = sorted(by_step)
        gbs = [by_step[s]["global_batch"] for s in steps]
        ref = reference_losses(self.train, gbs) if steps == list(range(len(steps))) else [float("nan")] * len(steps)
        rows = [(s, by_step[s]["version"], by_step[s]["global_batch"], by_step[s]["loss"], ref[i])
                for i, s in enumerate(steps)]
        t = Table(title=f"job {self.train.job}: loss per step (reference: one process, same global batches)")
        for c in ("step", "layout", "global batch", "loss", "reference", "rel. diff"):
            t.add_column(c, justify="right")
        for s, v, gb, loss, rv in rows:
            t.add_row(str(s), f"v{v}", str(gb), f"{loss:.5f}", f"{rv:.5f}", f"{abs(loss - rv) / abs(rv):.1e}")
        return rows, t
