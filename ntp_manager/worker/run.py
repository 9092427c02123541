"""`ntp-run`: start a training script once per rank, as torchrun does, for the NTP runtime.

    ntp-run --nproc 8 --replicas 2 train.py --steps 100                     # ntp-run plays the manager
    ntp-run --manager HOST:50051 --token-file worker.token --job llm \\
            --gpus GPU-a,GPU-b,... train.py --steps 100                      # layouts from the manager
    srun --ntasks-per-node=1 ntp-run --slurm --manager HOST:50051 ... train.py   # one per node, under
                                     # Slurm (deploy/slurm/train.sbatch; worker/slurm_env.py)

The script is any program written against the public API (`ntp_manager.worker`): it calls
`worker_env()` for the store, the layout source and the job, and drives a `Runtime` (see
examples/train_hf_llama.py). ntp-run hosts the TCPStore the runtime's process groups meet in (or
joins another ntp-run's with `--store HOST:PORT`), gives every rank its environment (env.py),
and watches the processes:

- Under a manager (`--manager`, or NTP_MANAGER; token from `--token-file`, NTP_TOKEN_FILE or
  NTP_TOKEN; job from `--job` or NTP_JOB; `--gpus` or NTP_GPUS, one rank per GPU UUID) the
  layouts come from the manager's watch stream; on a GPU machine each rank sees only its GPU
  (CUDA_VISIBLE_DEVICES=<uuid>). A rank whose process dies is restarted after `--restart-delay`
  while `--max-restarts` allows (a repaired GPU's fresh process: it waits until the manager gives
  it a place again, then joins by copying its shards from peers). With `--tls-ca` (NTP_TLS_CA)
  the ranks reach the manager over TLS, and with `--tls-cert` + `--tls-key` (NTP_TLS_CERT,
  NTP_TLS_KEY) over mTLS (the manager's TLS listener, docs/security.md); the files are checked
  here and handed to the ranks as NTP_TLS_* (absolute paths).
- Without a manager ntp-run publishes the layouts itself: `--replicas R` equal replicas of
  nproc / R ranks (or `--tp 4,2`), each with local batch `--batch-per-rank` x its TP degree. When
  a rank's process dies and restarts are allowed, it publishes the layout without it (the
  replica goes on at a lower TP degree) and, once the fresh process is up, the whole layout again;
  with no restarts left a dead rank stops the run, as in torchrun. `--fail-at STEP` /
  `--repair-at STEP` inject that failure (SIGKILL of replica 0's last rank once the job has
  completed STEP steps) and its repair, to try the runtime out. On a machine with GPUs rank i
  sees GPU i only; with more ranks than GPUs the ranks share them (gloo, staged through host
  memory: docs/worker.md "Devices and backends"); `--device cpu` runs on the CPU.

Output, as torchrun's (`--log-dir`, `-r/--redirects`, `-t/--tee`, `--local-ranks-filter`):

- On the console every line a rank writes is whole and prefixed with its worker id
  (`[r0g1]: step 3 ...`; stdout lines on ntp-run's stdout, stderr lines on its stderr): each
  rank's pipes are read a line at a time (a line longer than 64 KiB comes in pieces, each
  prefixed), so lines of different ranks never run into each other.
- `--redirects N` (or `LOCAL_RANK:N,...`) sends a rank's stdout (1), stderr (2) or both (3) to
  files instead of the console; `--tee N` to files and the console. The files are
  `<log dir>/<job>_<random>/attempt_<restart>/<local rank>/stdout.log` and `stderr.log`: one per
  rank and restart (a rank's restarts count on their own, not the whole group's as torchrun's
  attempts do). Without `--log-dir` the base is a new temporary directory; `--log-dir` alone
  writes no files (as torchrun: say which streams with --redirects or --tee).
- `--local-ranks-filter 0,3` shows only those local ranks' lines on the console (files keep
  everything).
- ntp-run's own lines and the ranks' logs (structlog, through `worker_env()`) are rendered for
  people on a terminal and as JSON lines otherwise (ntp-run tells its ranks with NTP_LOG_FORMAT,
  after its own stderr, unless that is set already).

Arguments are checked before anything is imported or started (torch is imported only then).

Exit status: 0 when every rank's last process exited 0 (a rank killed by --fail-at and never
repaired excepted), 1 otherwise, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, BinaryIO, NoReturn

import structlog

from ntp_manager.contract.tls import ENV_CA, ENV_CERT, ENV_KEY, TlsFiles
from ntp_manager.worker import slurm_env

log = structlog.get_logger("ntp.run")
MAX_LINE = 64 * 1024  # a longer line reaches the console in pieces of this size, each prefixed
OUT, ERR = 1, 2  # torchrun's Std flags: stdout, stderr (3: both)


class UsageError(Exception):
    pass


@dataclass
class Rank:
    worker: str
    gpu: str = ""
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    restart_at: float | None = None  # when a dead rank's fresh process is due
    injected: bool = False  # killed by --fail-at (an expected exit)
    rc: int | None = None  # the last process's exit status once it is gone for good
    pumps: list[threading.Thread] = field(default_factory=list)  # copying its output, this process's
    starts: int = 0  # processes started (restarts and --repair-at's included): attempt_<starts - 1>


@dataclass(frozen=True)
class Output:
    """Where each rank's stdout and stderr go, by local rank (torchrun's LogsSpecs): `redirects`
    and `tee` hold OUT/ERR bits; `shown` the local ranks whose lines reach the console (None:
    all); `log_dir` the base directory for files (None: a temporary one, made when needed)."""

    log_dir: Path | None = None
    redirects: dict[int, int] = field(default_factory=dict)
    tee: dict[int, int] = field(default_factory=dict)
    shown: frozenset[int] | None = None

    def to_file(self, local_rank: int, std: int) -> bool:
        return bool((self.redirects.get(local_rank, 0) | self.tee.get(local_rank, 0)) & std)

    def to_console(self, local_rank: int, std: int) -> bool:
        if self.shown is not None and local_rank not in self.shown:
            return False
        return not (self.redirects.get(local_rank, 0) & std) or bool(self.tee.get(local_rank, 0) & std)

    @property
    def any_file(self) -> bool:
        return any(self.redirects.values()) or any(self.tee.values())


@dataclass
class Options:
    cmd: list[str]
    nproc: int
    tps: list[int]
    batch_per_rank: int
    job: str
    manager: str
    token: str
    gpus: list[str]
    store: str
    store_host: str
    store_port: int
    fail_at: int
    repair_at: int
    max_restarts: int
    restart_delay: float
    device: str
    pin_gpus: bool
    output: Output = field(default_factory=Output)
    slurm: Any = None  # --slurm: a slurm_env.SlurmRun (the step; the job node 0 registers)
    tls: TlsFiles = field(default_factory=TlsFiles)  # the ranks' channel to the manager (contract/tls.py)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A bad argument is one line (main() prints it), not argparse's usage block."""
        raise UsageError(f"{message} (ntp-run --help)")


def build_parser() -> argparse.ArgumentParser:
    """ntp-run's arguments (tools/doccheck.py checks the docs' ntp-run lines against it)."""
    p = _Parser(
        prog="ntp-run", description="Run a training script once per rank under the NTP runtime (like torchrun).",
        epilog="Environment: NTP_MANAGER, NTP_TOKEN / NTP_TOKEN_FILE, NTP_JOB, NTP_GPUS, NTP_TLS_CA, NTP_TLS_CERT, "
               "NTP_TLS_KEY stand in for the flags.")
    p.add_argument("--nproc", type=int, default=0, help="rank processes (default: one per --gpus entry, else 1)")
    p.add_argument("--replicas", type=int, default=1, help="without a manager: equal DP replicas")
    p.add_argument("--tp", default="", help="without a manager: TP degree of each replica, e.g. 4,2")
    p.add_argument("--batch-per-rank", type=int, default=2, help="without a manager: local batch per TP rank")
    p.add_argument("--job", default=os.environ.get("NTP_JOB", ""), help="the job's name (default: job; with "
                   "--slurm: <SLURM_JOB_NAME>-<SLURM_JOB_ID>)")
    p.add_argument("--manager", default=os.environ.get("NTP_MANAGER", ""), help="the manager's gRPC address")
    p.add_argument("--token-file", default=os.environ.get("NTP_TOKEN_FILE", ""), help="a worker-scope token")
    p.add_argument("--gpus", default=os.environ.get("NTP_GPUS", ""), help="comma-separated GPU UUIDs, one rank each")
    p.add_argument("--tls-ca", default=os.environ.get(ENV_CA, ""),
                   help="CA of the manager's certificate (PEM): the ranks reach the manager over TLS")
    p.add_argument("--tls-cert", default=os.environ.get(ENV_CERT, ""),
                   help="this node's client certificate (PEM): mTLS; with --tls-key")
    p.add_argument("--tls-key", default=os.environ.get(ENV_KEY, ""), help="its private key (PEM)")
    p.add_argument("--store", default="", help="HOST:PORT of another ntp-run's store (multi-node)")
    p.add_argument("--store-host", default="127.0.0.1", help="address the hosted store listens on")
    p.add_argument("--store-port", type=int, default=0, help="port of the hosted store (default: a free one)")
    p.add_argument("--fail-at", type=int, default=-1, help="without a manager: kill replica 0's last rank here")
    p.add_argument("--repair-at", type=int, default=-1, help="without a manager: start it again here")
    p.add_argument("--max-restarts", type=int, default=0, help="per rank, for processes that die")
    p.add_argument("--restart-delay", type=float, default=1.0, help="seconds before a dead rank is restarted")
    p.add_argument("--device", choices=["", "cpu", "cuda"], default="", help="NTP_DEVICE for the ranks")
    p.add_argument("--no-pin-gpus", action="store_true", help="do not set CUDA_VISIBLE_DEVICES per rank")
    p.add_argument("--log-dir", "--log_dir", default="",
                   help="base directory of the rank output files (--redirects/--tee; as torchrun)")
    p.add_argument("-r", "--redirects", default="0",
                   help="rank streams to files only: 1 stdout, 2 stderr, 3 both; or per local rank, e.g. 0:3,1:2")
    p.add_argument("-t", "--tee", default="0", help="rank streams to files and the console (as --redirects)")
    p.add_argument("--local-ranks-filter", "--local_ranks_filter", default="",
                   help="show only these local ranks' output on the console, e.g. 0,3 (files keep all)")
    slurm_env.add_arguments(p)
    p.add_argument("-m", "--module", action="store_true", help="the script is a module name (python -m)")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def parse(argv: Sequence[str]) -> Options:
    a = build_parser().parse_args(list(argv))
    slurm = None
    if a.slurm:
        try:
            slurm = slurm_env.prepare(a, os.environ)  # fills in --gpus, --job and the store from the step
        except slurm_env.SlurmEnvError as e:
            raise UsageError(str(e)) from None
    a.job = a.job or "job"
    gpus = [g for g in a.gpus.split(",") if g]
    if len(set(gpus)) != len(gpus):
        raise UsageError("--gpus lists a GPU twice")
    token = os.environ.get("NTP_TOKEN", "")
    if a.token_file:
        try:
            token = Path(a.token_file).read_text().strip()
        except OSError as e:
            raise UsageError(f"--token-file {a.token_file}: cannot read ({e.strerror})") from None
        except UnicodeDecodeError:
            raise UsageError(f"--token-file {a.token_file}: not a token file (not text)") from None
    try:
        tp_list = [int(x) for x in a.tp.split(",")] if a.tp else []
    except ValueError:
        raise UsageError(f"--tp must be comma-separated integers, not {a.tp!r}") from None
    nproc = a.nproc or len(gpus) or (sum(tp_list) if tp_list else a.replicas)
    try:
        tls = TlsFiles(Path(a.tls_ca) if a.tls_ca else None, Path(a.tls_cert) if a.tls_cert else None,
                       Path(a.tls_key) if a.tls_key else None, labels=("--tls-ca", "--tls-cert", "--tls-key"))
        tls.check()  # the ranks read the files again; a bad one is refused here, once
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    if tls.enabled and not a.manager:
        raise UsageError("--tls-ca/--tls-cert/--tls-key are for runs under a manager (--manager)")
    if a.manager:
        if not gpus:
            raise UsageError("--manager needs --gpus (one rank per GPU UUID)")
        if not token:
            raise UsageError("--manager needs a token (--token-file, NTP_TOKEN_FILE or NTP_TOKEN)")
        if nproc != len(gpus):
            raise UsageError(f"--nproc {nproc} but {len(gpus)} GPUs in --gpus")
        if a.fail_at >= 0 or a.repair_at >= 0:
            raise UsageError("--fail-at/--repair-at are for runs without a manager (under one, failures come "
                             "from the agents)")
        tps: list[int] = []
    else:
        if gpus:
            raise UsageError("--gpus is for runs under a manager (--manager)")
        tps = tp_list or [nproc // max(a.replicas, 1)] * a.replicas
        if a.replicas < 1 or any(t < 1 for t in tps) or sum(tps) != nproc:
            raise UsageError(f"--nproc {nproc} does not split into replicas of TP {tps}")
        if a.repair_at >= 0 and not 0 <= a.fail_at < a.repair_at:
            raise UsageError("--repair-at needs an earlier --fail-at")
        if a.fail_at >= 0 and tps[0] < 2:
            raise UsageError("--fail-at kills a rank of replica 0, which needs TP >= 2 to go on")
    if a.batch_per_rank < 1 or a.max_restarts < 0 or not 0 <= a.restart_delay < 86400:
        raise UsageError("--batch-per-rank must be >= 1, --max-restarts >= 0 and --restart-delay from 0 to 86400 s")
    if a.store:
        host, _, port = a.store.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--store must be HOST:PORT (a port 1-65535), not {a.store!r}")
    if not 0 <= a.store_port < 65536:
        raise UsageError(f"--store-port must be 0-65535 (0: a free one), not {a.store_port}")
    cmd = [sys.executable, "-m", a.script, *a.args] if a.module else [sys.executable, a.script, *a.args]
    if not a.module and not Path(a.script).is_file():
        raise UsageError(f"no such script: {a.script}")
    return Options(cmd=cmd, nproc=nproc, tps=tps, batch_per_rank=a.batch_per_rank, job=a.job, manager=a.manager,
                   token=token, gpus=gpus, store=a.store, store_host=a.store_host, store_port=a.store_port,
                   fail_at=a.fail_at, repair_at=a.repair_at, max_restarts=a.max_restarts,
                   restart_delay=a.restart_delay, device=a.device, pin_gpus=not a.no_pin_gpus,
                   output=_output(a, nproc), slurm=slurm,
                   tls=tls.resolved())


def std_map(flag: str, text: str, nproc: int) -> dict[int, int]:
    """torchrun's stream choice: `N` for every local rank, or `LOCAL_RANK:N,...` (others 0); N is
    0 (none), 1 (stdout), 2 (stderr) or 3 (both). UsageError naming `flag` otherwise."""
    text = text.strip()
    if re.fullmatch(r"[0-3]", text):
        return dict.fromkeys(range(nproc), int(text))
    if not re.fullmatch(r"\d+:[0-3](,\d+:[0-3])*", text):
        raise UsageError(f"{flag} must be 0-3 (1 stdout, 2 stderr, 3 both) or LOCAL_RANK:N,..., not {text!r}")
    out: dict[int, int] = {}
    for part in text.split(","):
        rank, _, value = part.partition(":")
        if int(rank) >= nproc:
            raise UsageError(f"{flag} {text}: local rank {int(rank)}, but there are {nproc} (0-{nproc - 1})")
        out[int(rank)] = int(value)
    return out


def _output(a: argparse.Namespace, nproc: int) -> Output:
    shown = None
    if a.local_ranks_filter.strip():
        try:
            shown = frozenset(int(x) for x in a.local_ranks_filter.split(","))
        except ValueError:
            raise UsageError("--local-ranks-filter must be comma-separated local ranks, e.g. 0,1, not "
                             f"{a.local_ranks_filter!r}") from None
        bad = sorted(r for r in shown if not 0 <= r < nproc)
        if bad:
            raise UsageError(f"--local-ranks-filter: no local rank {bad[0]} (there are {nproc}: 0-{nproc - 1})")
    log_dir = Path(a.log_dir) if a.log_dir else None
    if log_dir is not None and log_dir.exists() and not log_dir.is_dir():
        raise UsageError(f"--log-dir {a.log_dir}: not a directory")
    return Output(log_dir, std_map("--redirects", a.redirects, nproc), std_map("--tee", a.tee, nproc), shown)


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def say(msg: str) -> None:
    """One of ntp-run's own lines that is a sentence, not an event with fields (the Slurm hook's)."""
    log.info(msg)


class _Console:
    """ntp-run's stdout or stderr, written a whole line at a time under one lock shared by both
    (they are often the same terminal or pipe): ranks' lines and ntp-run's own never interleave.
    A console that went away (a closed pipe) is dropped; the ranks' output is still drained."""

    def __init__(self, text: IO[str], lock: threading.RLock) -> None:
        self.text, self.lock = text, lock
        self.raw: BinaryIO | None = getattr(text, "buffer", None)
        self.gone = False

    def line(self, data: bytes) -> None:
        with self.lock:
            if self.gone:
                return
            try:
                if self.raw is not None:
                    self.raw.write(data)
                    self.raw.flush()
                else:
                    self.text.write(data.decode("utf-8", "replace"))
                    self.text.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.gone = True

    # a text stream for structlog's WriteLogger (ntp-run's own lines)
    def write(self, text: str) -> int:
        self.line(text.encode("utf-8", "replace"))
        return len(text)

    def flush(self) -> None:
        pass


def _pump(src: IO[bytes], console: _Console | None, file: BinaryIO | None, prefix: bytes) -> None:
    """Copy one rank stream until it ends: to `file` as it is, to `console` a line at a time with
    `prefix` (a piece without its newline gets one there)."""
    with src, file if file is not None else contextlib.nullcontext():
        for chunk in iter(lambda: src.readline(MAX_LINE), b""):
            if file is not None:
                file.write(chunk)
            if console is not None:
                console.line(prefix + (chunk if chunk.endswith(b"\n") else chunk + b"\n"))


class Launcher:
    """The ranks' processes, the store, and (without a manager) the layouts."""

    def __init__(self, o: Options, stdout: _Console | None = None, stderr: _Console | None = None,
                 log_format: str = "json") -> None:
        import torch.distributed as dist

        self.o = o
        lock = threading.RLock()
        self.stdout = stdout or _Console(sys.stdout, lock)
        self.stderr = stderr or _Console(sys.stderr, lock)
        self.log_format = log_format  # the ranks' (NTP_LOG_FORMAT unless it is set)
        self.run_dir: Path | None = None  # <log dir>/<job>_<random>, made when a stream goes to files
        store_cls: Any = dist.TCPStore  # type: ignore[attr-defined]
        try:
            if o.store:
                host, _, text = o.store.rpartition(":")
                self.store_addr = (host, int(text))
                self.store = store_cls(host, int(text), is_master=False, timeout=dt.timedelta(seconds=60))
            else:
                port = o.store_port or _free_port(o.store_host)
                self.store_addr = (o.store_host, port)
                self.store = store_cls(o.store_host, port, is_master=True, wait_for_workers=False,
                                       timeout=dt.timedelta(seconds=300))
        except (OSError, RuntimeError) as e:  # an address that does not resolve, a port in use, no answer
            where = o.store or f"{o.store_host}:{o.store_port or '(a free port)'}"
            raise UsageError(f"cannot {'reach' if o.store else 'host'} the store at {where}: "
                             f"{' '.join(str(e).split())[:300]}") from None
        if o.manager:
            self.ranks = [Rank(g, gpu=g) for g in o.gpus]
            self.replicas: list[list[str]] = []
        else:
            self.replicas, i = [], 0
            for ri, tp in enumerate(o.tps):
                self.replicas.append([f"r{ri}g{j}" for j in range(tp)])
                i += tp
            self.ranks = [Rank(w) for rep in self.replicas for w in rep]
        self.by_id = {r.worker: r for r in self.ranks}
        # without a manager, rank i runs on GPU i of this machine (when there are enough)
        self.local_gpus = 0
        if not o.manager and o.pin_gpus and o.device != "cpu":
            import torch

            self.local_gpus = torch.cuda.device_count()
            if 0 < self.local_gpus < o.nproc:
                # more ranks than GPUs: not pinned, the ranks share the GPUs (comm.device_index)
                # and the backend choice takes gloo staged through host memory (NCCL cannot)
                log.info("ranks share GPUs (gloo, staged through host memory)", ranks=o.nproc, gpus=self.local_gpus)
                self.local_gpus = 0
        self.down: set[str] = set()  # without a manager: ranks left out of the published layout
        self.version = 0
        self.failed_at: int | None = None

    # ---- layouts (no manager) -------------------------------------------------------------------
    def publish(self, reason: str) -> None:
        from ntp_manager.worker.sources import publish_layout

        reps = [[w for w in rep if w not in self.down] for rep in self.replicas]
        reps = [r for r in reps if r]
        if not reps:  # nothing to train on until a rank restarts (then it is published); none will: the run ends
            log.warning("every rank is down; the next layout comes with the first restart", reason=reason)
            return
        self.version += 1
        publish_layout(self.store, self.o.job, self.version, [(r, self.o.batch_per_rank * len(r)) for r in reps],
                       reason)
        log.info("layout published", version=self.version, tp=[len(r) for r in reps], reason=reason)

    def report_failure(self, why: str) -> None:
        """Tell the ranks still computing a step of the current version that it is lost (they
        abandon it at their next block, runtime/abort.py) -- before any collective of theirs
        would find out."""
        from ntp_manager.worker.sources import report_failure

        if self.version > 0:
            report_failure(self.store, self.o.job, self.version, why)

    # ---- processes ------------------------------------------------------------------------------
    def env_for(self, r: Rank, index: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(NTP_STORE=f"{self.store_addr[0]}:{self.store_addr[1]}", NTP_JOB=self.o.job, NTP_WORKER_ID=r.worker,
                   NTP_LOCAL_RANK=str(index), NTP_NPROC=str(self.o.nproc))
        for k in ("NTP_MANAGER", "NTP_TOKEN", "NTP_GPU_UUID", ENV_CA, ENV_CERT, ENV_KEY):
            env.pop(k, None)
        env.pop("NTP_LOCAL_GPUS", None)
        if self.o.manager:
            env.update(NTP_MANAGER=self.o.manager, NTP_TOKEN=self.o.token, NTP_GPU_UUID=r.gpu, **self.o.tls.env())
            if self.o.pin_gpus and r.gpu.startswith("GPU-"):
                env["CUDA_VISIBLE_DEVICES"] = r.gpu
                # each rank sees its GPU only: tell the backend choice how many GPUs the ranks use
                env["NTP_LOCAL_GPUS"] = str(len({x.gpu for x in self.ranks}))
        elif self.local_gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(index)
            env["NTP_LOCAL_GPUS"] = str(self.o.nproc)
        if self.o.device:
            env["NTP_DEVICE"] = self.o.device
        env.setdefault("NTP_LOG_FORMAT", self.log_format)
        return env

    def make_run_dir(self) -> Path | None:
        """The run's directory for rank output files (torchrun's `<log dir>/<run id>_<random>`),
        made once when any stream goes to files; None when none does."""
        out = self.o.output
        if self.run_dir is None and out.any_file:
            base = out.log_dir or Path(tempfile.mkdtemp(prefix="ntp-run-"))
            base.mkdir(parents=True, exist_ok=True)
            job = "".join(c if c.isalnum() or c in "-_." else "-" for c in self.o.job)[:64]
            self.run_dir = Path(tempfile.mkdtemp(prefix=f"{job}_", dir=base))
        return self.run_dir

    def start(self, r: Rank) -> None:
        """Start rank `r`'s process, its stdout and stderr each to the console (through a thread
        that prefixes its lines), a file, both, or nowhere (`Output`)."""
        index = self.ranks.index(r)
        attempt, r.starts = r.starts, r.starts + 1
        out, files = self.o.output, []
        where: dict[int, Any] = {}
        plan: dict[int, tuple[bool, bool, Path | None]] = {}
        for std, name in ((OUT, "stdout"), (ERR, "stderr")):
            path = None
            if out.to_file(index, std):
                run_dir = self.make_run_dir()
                assert run_dir is not None
                folder = run_dir / f"attempt_{attempt}" / str(index)
                folder.mkdir(parents=True, exist_ok=True)
                path = folder / f"{name}.log"
            shown = out.to_console(index, std)
            plan[std] = (shown, path is not None, path)
            if shown:
                where[std] = subprocess.PIPE
            elif path is not None:
                f = path.open("wb")
                files.append(f)
                where[std] = f
            else:
                where[std] = subprocess.DEVNULL
        try:
            r.proc = subprocess.Popen(self.o.cmd, env=self.env_for(r, index), stdout=where[OUT], stderr=where[ERR])
        finally:
            for f in files:  # the child has its own descriptor
                f.close()
        r.rc, r.restart_at = None, None
        prefix = f"[{r.worker}]: ".encode()
        r.pumps = []
        for std, src in ((OUT, r.proc.stdout), (ERR, r.proc.stderr)):
            shown, _, path = plan[std]
            if shown and src is not None:
                file = path.open("wb", buffering=0) if path is not None else None
                t = threading.Thread(target=_pump, args=(src, self.stdout if std == OUT else self.stderr, file, prefix),
                                     daemon=True, name=f"{r.worker}-{'out' if std == OUT else 'err'}")
                t.start()
                r.pumps.append(t)
        log.info("rank started", worker=r.worker, local_rank=index, pid=r.proc.pid, attempt=attempt)

    def drained(self, r: Rank, timeout: float = 5.0) -> None:
        """Wait (up to `timeout` s) until rank `r`'s exited process's output is all copied: its
        last lines come before what ntp-run says about its end."""
        deadline = time.monotonic() + timeout
        for t in r.pumps:
            t.join(max(0.0, deadline - time.monotonic()))

    def kill(self, r: Rank) -> None:
        if r.proc is not None and r.proc.poll() is None:
            r.proc.send_signal(signal.SIGKILL)
            r.proc.wait()

    def progress(self) -> int:
        """The newest completed step any rank reported (-1 before the first)."""
        from ntp_manager.worker.env import progress_key

        best = -1
        for r in self.ranks:
            key = progress_key(self.o.job, r.worker)
            if self.store.check([key]):
                best = max(best, int(json.loads(self.store.get(key))["step"]))
        return best

    def run(self) -> int:
        if not self.o.manager:
            self.publish("start")
        for r in self.ranks:
            self.start(r)
        fatal = False
        while True:
            now = time.monotonic()
            if not self.o.manager:
                self._inject()
            for r in self.ranks:
                if r.proc is not None and r.rc is None and r.restart_at is None:
                    rc = r.proc.poll()
                    if rc is not None:
                        fatal |= self._exited(r, rc, now)
                if r.restart_at is not None and now >= r.restart_at:
                    self.start(r)
                    r.restarts += 1
                    if not self.o.manager and r.worker in self.down:
                        self.down.discard(r.worker)
                        self.publish(f"{r.worker} restarted")
            if fatal:
                log.warning("stopping every rank")
                self.stop()
                return 1
            if all(r.rc is not None for r in self.ranks):
                bad = [r.worker for r in self.ranks if r.rc != 0 and not (r.injected and r.worker in self.down)]
                (log.warning if bad else log.info)("done", finished_cleanly=len(self.ranks) - len(bad),
                                                   ranks=len(self.ranks), failed=bad)
                return 1 if bad else 0
            time.sleep(0.05)

    def _exited(self, r: Rank, rc: int, now: float) -> bool:
        """A rank's process ended; True when that stops the run."""
        self.drained(r)
        if rc == 0:
            r.rc = 0
            log.info("rank finished", worker=r.worker)
            return False
        if r.injected and r.worker in self.down:
            r.rc = rc
            return False
        log.warning("rank exited", worker=r.worker, status=rc)
        if r.restarts < self.o.max_restarts:
            r.restart_at = now + self.o.restart_delay
            if not self.o.manager and r.worker not in self.down:
                self.down.add(r.worker)
                self.report_failure(f"{r.worker} died")
                self.publish(f"{r.worker} died")
            return False
        r.rc = rc
        return not self.o.manager  # under a manager the others may go on (the manager replans)

    def _inject(self) -> None:
        o = self.o
        if o.fail_at < 0:
            return
        step = self.progress()
        victim = self.by_id[self.replicas[0][-1]]
        if self.failed_at is None and step >= o.fail_at:
            self.failed_at = step
            victim.injected = True
            self.down.add(victim.worker)
            self.kill(victim)
            self.report_failure(f"{victim.worker} killed (--fail-at)")
            log.info("rank killed (--fail-at)", worker=victim.worker, after_step=step)
            self.publish(f"{victim.worker} failed")
            victim.rc = -signal.SIGKILL
        elif self.failed_at is not None and 0 <= o.repair_at <= step and victim.worker in self.down:
            log.info("rank repaired (--repair-at)", worker=victim.worker, after_step=step)
            self.start(victim)
            self.down.discard(victim.worker)
            self.publish(f"{victim.worker} repaired")

    def stop(self) -> None:
        for r in self.ranks:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.terminate()
        deadline = time.monotonic() + 10
        for r in self.ranks:
            if r.proc is not None:
                try:
                    r.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait()
        for r in self.ranks:
            self.drained(r, max(0.1, deadline - time.monotonic()))


def main(argv: Sequence[str] | None = None) -> int:
    from ntp_manager.contract.logs import auto_format, configure_logging

    try:
        o = parse(sys.argv[1:] if argv is None else argv)
    except UsageError as e:
        print(f"ntp-run: error: {e}", file=sys.stderr)
        return 2
    lock = threading.RLock()  # RLock: a signal handler may write while the main thread holds it
    stdout, stderr = _Console(sys.stdout, lock), _Console(sys.stderr, lock)
    fmt = auto_format(sys.stderr)
    configure_logging(fmt, stream=stderr)
    try:
        if o.slurm is not None:
            o.slurm.wait_for_store(say)  # a node up before node 0: wait (bounded) for its store
        launcher = Launcher(o, stdout, stderr, log_format=fmt)
    except slurm_env.SlurmEnvError as e:
        print(f"ntp-run: error: {e}", file=sys.stderr)
        return 2
    except UsageError as e:
        print(f"ntp-run: error: {e}", file=sys.stderr)
        return 2

    def _stop(signum: int, _frame: Any) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):  # the stop below is not cut short by another
            signal.signal(sig, signal.SIG_IGN)
        launcher.stop()
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    run_dir = launcher.make_run_dir()
    log.info("ntp-run started", store=f"{launcher.store_addr[0]}:{launcher.store_addr[1]}", job=o.job, ranks=o.nproc,
             layouts=f"from {o.manager}" if o.manager else "published here",
             **({"rank_output": str(run_dir)} if run_dir else {}),
             **({"note": "--log-dir without --redirects/--tee: no files (as torchrun)"}
                if o.output.log_dir and run_dir is None else {}))
    try:
        if o.slurm is not None:
            try:
                o.slurm.before_ranks(launcher.store, say)  # node 0 registers the job; the others wait for it
            except slurm_env.SlurmEnvError as e:
                print(f"ntp-run: error: {e}", file=sys.stderr)
                return 2
        return launcher.run()
    finally:
        launcher.stop()
        if o.slurm is not None:
            o.slurm.after_ranks(launcher.store, say)


if __name__ == "__main__":
    sys.exit(main())
