"""What a Runtime is given and what it gives back: its configuration (and the backend and device
that follow from it), a step's result, the timeline's events, and the one error that means the
runtime cannot go on. Also the test that tells a failed collective (a dead or hung peer: regroup)
from a bug in the step (raise)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ntp_manager.worker import comm
from ntp_manager.worker.pipeline import SCHEDULES
from ntp_manager.worker.precision import check_precision_name


class ReconfigurationError(RuntimeError):
    """The runtime cannot continue without a restart (no layout arrived, state was lost or diverged)."""


class StepAborted(RuntimeError):
    """A step abandoned at one of its cheap points because some rank of its layout version has
    reported a failure (runtime/abort.py): a communication failure, handled like one."""


class DataSourceError(Exception):
    """A step's samples could not be read: the data source raised, or it holds fewer samples than
    one global batch. Raised on every rank of the layout (the rank that saw it tells the others
    through the store and leaves its groups, so none of them waits on it), naming the source and
    the sample range. Not a communication failure: no new layout mends it."""


@dataclass
class RuntimeConfig:
    """`backend` "auto" picks per device (`comm.choose_backend`): NCCL on CUDA when every rank of
    this host has a GPU of its own, gloo staged through host memory when ranks share GPUs, gloo on
    CPU. An explicit combination that cannot work (nccl on CPU, nccl with more ranks than GPUs on
    a host, cuda without CUDA) is refused when the Runtime is built (comm.BackendError)."""

    job: str
    backend: str = "auto"  # "auto" | "gloo" | "nccl"
    device: str = "cpu"  # "cpu" | "cuda" (this rank's GPU: comm.device_index)
    collective_timeout_s: float = 30.0
    rendezvous_timeout_s: float = 60.0
    reconfigure_timeout_s: float = 120.0  # how long survivors wait for the manager's next layout
    # how long a rank the layout leaves out (a fresh one, or one set aside as a spare) waits for a
    # layout that includes it; None: until the process is stopped or the manager ends the watch
    standby_timeout_s: float | None = None
    seed: int = 0  # model_fn runs under this seed on every rank, so initial shards agree
    local_rank: int = 0  # this rank's index among the job's ranks on its host
    local_world_size: int = 1  # the job's ranks on this host
    local_gpus: int | None = None  # distinct GPUs those ranks use (None: the GPUs this process sees)
    force_staging: bool = False  # tests: gloo's host staging also for CPU tensors (comm.py)

    # unit-addressed checkpoints (worker/checkpoint/); None: none. A directory every rank sees.
    checkpoint_dir: str | None = None
    checkpoint_interval: int = 0  # steps between automatic checkpoints (0: only save_checkpoint())
    checkpoint_keep_last: int = 3
    checkpoint_keep_every: int = 0  # also keep checkpoints whose step is a multiple of this
    checkpoint_resume: bool = True  # a job's first layout restores the newest checkpoint if there is one
    checkpoint_complete_timeout_s: float = 300.0  # how long the coordinator waits for every rank's part
    # single-stage replicas: feed the local batch in micro-batches of at most this many samples,
    # gradients accumulated (memory); a pipeline cuts its own (Pipeline.micro_batches). None: one pass
    micro_batch_size: int | None = None
    # clip the whole model's gradient to this L2 norm before each optimizer step, as
    # torch.nn.utils.clip_grad_norm_ over one process's model would (None: no clipping)
    max_grad_norm: float | None = None
    # a pipeline's schedule (worker/pipeline.py, schedule_ops): "1f1b" keeps at most as many
    # micro-batches' activations per stage as there are stages, "gpipe" all of them
    schedule: str = "1f1b"
    # recompute each layer's activations in the backward instead of keeping them (worker/recompute.py)
    recompute: bool = False
    # "fp32", or "bf16": bf16 compute with fp32 master parameters, gradients and optimizer state
    # (worker/precision.py); "fp16" is refused (no loss scaling)
    precision: str = "fp32"
    # while a step computes, how often a rank looks for a peer's reported failure, to abandon the
    # doomed step at its next block, micro-batch or sync (runtime/abort.py); 0: never (the step
    # then runs until one of its collectives fails)
    abort_poll_s: float = 0.05

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            raise comm.BackendError(f"backend must be 'auto', 'gloo' or 'nccl', not {self.backend!r}")
        if self.device not in ("cpu", "cuda"):
            raise comm.BackendError(f"device must be 'cpu' or 'cuda', not {self.device!r}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise comm.BackendError(f"local_rank {self.local_rank} is not among {self.local_world_size} local ranks")
        if self.micro_batch_size is not None and (isinstance(self.micro_batch_size, bool)
                                                  or not isinstance(self.micro_batch_size, int)
                                                  or self.micro_batch_size < 1):
            raise ValueError(f"micro_batch_size must be a positive integer or None, not {self.micro_batch_size!r}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number or None, not {self.max_grad_norm!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, not {self.schedule!r}")
        if not isinstance(self.recompute, bool):
            raise ValueError(f"recompute must be True or False, not {self.recompute!r}")
        check_precision_name(self.precision)

    def resolve(self, features: comm.CommFeatures | None = None) -> tuple[comm.BackendChoice, torch.device]:
        """The backend and this rank's device; raises comm.BackendError for what cannot work."""
        feats = features or comm.detect_features()
        gpus = self.local_gpus if self.local_gpus is not None else feats.cuda_devices
        choice = comm.choose_backend(self.device, self.backend, self.local_world_size, gpus, feats)
        if choice.backend == "nccl":
            comm.check_nccl_env(os.environ)
        if choice.device == "cpu":
            return choice, torch.device("cpu")
        return choice, torch.device("cuda", comm.device_index(self.local_rank, feats.cuda_devices))


@dataclass(frozen=True)
class StepResult:
    step: int  # the step just completed (0-based)
    loss: float  # the global loss, sample-weighted over replicas
    global_batch: int
    local_batch: int
    version: int
    tp: int  # the TP degree of this rank's group (its stage's, in a pipeline)
    seconds: float
    stage: int = 0  # this rank's pipeline stage
    grad_norm: float | None = None  # the whole model's gradient norm before clipping (with max_grad_norm)
    skipped: bool = False  # the gradient norm was not finite: no rank updated (with max_grad_norm)
    # the global sample cursor: samples committed before this step (its global batch is samples
    # [cursor, cursor + global_batch)), and this rank's replica's part of them, [first, first + local_batch)
    cursor: int = 0
    first_sample: int = 0


@dataclass
class TimelineEvent:
    at: float  # time.time()
    what: str
    version: int
    detail: str = ""


def is_comm_failure(e: BaseException) -> bool:
    """A failed or timed-out collective (what a dead or hung peer causes), not a bug in the step."""
    if isinstance(e, StepAborted):
        return True
    if isinstance(e, ReconfigurationError):
        return "rendezvous" in str(e)  # a rendezvous that timed out may succeed at a newer version
    if isinstance(e, dist.DistError):
        return True
    if isinstance(e, RuntimeError):
        msg = str(e)
        return any(s in msg for s in ("gloo", "Gloo", "Connection closed", "Connection reset", "Timed out",
                                      "timed out", "NCCL", "Broken pipe", "connection"))
    return False


def _describe(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


