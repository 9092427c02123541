"""Applying layouts live: the runtime a training process drives step by step.

    rt = Runtime(model_fn, tp_plan, optimizer_fn, source, store, RuntimeConfig(job="llm"))
    rt.start()
    while rt.step < steps:
        result = rt.train_step(batch_fn, loss_fn)

Process groups. Each layout version gets its own default process group, created through a prefix
`ntp/<job>/pg/v<epoch>.<version>` of a TCPStore that lives outside the ranks (the launcher's, or the
test's), with the ranks and world size of that version. Nothing of an old group is reused, so a dead
peer in the old group cannot stall the new one. Before creating the group, members count themselves
in at the prefix and leave for a newer version as soon as one appears, so ranks that learnt of
versions in different orders still meet.

Step boundaries. `train_step` runs forward, backward and the NTP gradient sync, then one small
all-gather that carries each rank's loss and the newest layout version it has seen -- the step's
commit point -- and only then steps the optimizer. When some rank has seen a newer version, all
ranks switch to it right after that step (planned path: they agree through the old group, so the
switch happens at the same step on every rank).

Failures. A collective that fails (a peer's socket closed) or hangs past `collective_timeout_s`
raises inside the step before the optimizer moved; the survivors drop the old group, wait for the
manager's next version, meet at its prefix, exchange (old rank, committed step) and reshard: units a
survivor lacks come from its own replica's survivors or from a DP peer replica; a rank with no state
(a repaired GPU's fresh process, or one that sat out versions) receives its shards, the replicated
parameters and their optimizer state, and the step counter. The failed step is then re-run under
the new layout with the same global sample order.

A rank that dies inside the commit all-gather itself can leave the survivors split: those whose
all-gather completed stepped the optimizer (step s committed), those whose all-gather failed did
not. Every rank had finished its gradient sync before it entered the commit, so the ones behind
hold the step's complete gradients; at the regroup they learn the commit's outcome (its loss and
gradient norm) from a rank that committed and apply that same update themselves ("rolled
forward"), and `train_step` returns that step's result. Only a split that cannot be explained so
(survivors more than one step apart, or behind without the step's gradients) needs a checkpoint:
`_restore_into` loads one, or raises `ReconfigurationError` rather than train on diverged replicas.
"""

from __future__ import annotations

import datetime as dt
import gc
import math
import os
import secrets
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import clip_grads_with_norm_

from ntp_manager.planner.ranks import locate, stage_ranks
from ntp_manager.worker import comm
from ntp_manager.worker import tp as tp_mod
from ntp_manager.worker.checkpoint import (
    Checkpointer,
    CheckpointError,
    NoCheckpoint,
    RestoreInfo,
    Retention,
    SaveHandle,
)
from ntp_manager.worker.optim import check_optimizer, check_scheduler, pack_values, scheduler_json, unpack_values
from ntp_manager.worker.pipeline import (
    SCHEDULES,
    PassResult,
    Pipeline,
    StageLinks,
    micro_batches,
    run_stage,
    stage_plan,
)
from ntp_manager.worker.precision import check_device, check_model, check_precision_name, compute_copies, compute_dtype
from ntp_manager.worker.recompute import enable_recompute
from ntp_manager.worker.reshard import Move, apply_reshard, reshard_moves
from ntp_manager.worker.sources import LayoutSource, RestoreNote, StepWork, WorkerLayout
from ntp_manager.worker.sync import NtpGradSync, ReplicaGroup, SyncLayout, families_of, global_norm
from ntp_manager.worker.tp import ShardedModule, ShardStyle, parallelize, unit_counts

log = structlog.get_logger("ntp.worker")


class ReconfigurationError(RuntimeError):
    """The runtime cannot continue without a restart (no layout arrived, state was lost or diverged)."""


class _Superseded(Exception):
    def __init__(self, newer: WorkerLayout) -> None:
        self.newer = newer


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
    seed: int = 0  # model_fn runs under this seed on every rank, so initial shards agree
    local_rank: int = 0  # this rank's index among the job's ranks on its host
    local_world_size: int = 1  # the job's ranks on this host
    local_gpus: int | None = None  # distinct GPUs those ranks use (None: the GPUs this process sees)
    force_staging: bool = False  # tests: gloo's host staging also for CPU tensors (comm.py)

    # unit-addressed checkpoints (worker/checkpoint.py); None: none. A directory every rank sees.
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


@dataclass
class TimelineEvent:
    at: float  # time.time()
    what: str
    version: int
    detail: str = ""


def is_comm_failure(e: BaseException) -> bool:
    """A failed or timed-out collective (what a dead or hung peer causes), not a bug in the step."""
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


def _step_tensor(value: float, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """Adam's step count as torch's own first step makes it: a float32 scalar on the parameter's
    device when the group is fused or capturable (their kernels read it there), else on the CPU."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(value, dtype=torch.float32, device=p.device)
    return torch.tensor(value)


def ensure_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Create the state a step would create (zeros), so a rank joining after step 0 has the same
    state tensors as its peers before receiving their values."""
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if isinstance(opt, torch.optim.SGD):
                if group.get("momentum", 0) and st.get("momentum_buffer") is None:
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
                if not st:  # `step` where torch's Adam puts it: on the parameter's device if fused/capturable
                    st["step"] = _step_tensor(0.0, p, group)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group.get("amsgrad"):
                        st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            else:
                raise ValueError(f"resharding supports SGD, Adam and AdamW, not {type(opt).__name__}")


@dataclass(frozen=True)
class _StageInfo:
    """What the runtime knows of one pipeline stage, read off the whole model once: the part of
    the TP plan that covers its modules, its families' unit counts, module path -> family."""

    plan: Mapping[str, ShardStyle]
    units: dict[str, int]
    families: dict[str, str]


@dataclass
class _State:
    layout: WorkerLayout | None = None  # the version this rank last applied as a member
    sync_layout: SyncLayout | None = None
    stage: int = 0  # the pipeline stage `model` is
    model: nn.Module | None = None
    opt: torch.optim.Optimizer | None = None
    sched: Any = None  # the LR scheduler of `opt` (scheduler_fn's), if any
    sync: NtpGradSync | None = None
    syncs: list[NtpGradSync] = field(default_factory=list)  # every stage's (only ours is active)
    world: Any = None  # every member of the current version: commit votes, regroup exchanges, activations
    spare: list[torch.Tensor] = field(default_factory=list)  # the last sync's buffers, for the next one
    timeline: list[TimelineEvent] = field(default_factory=list)


class Runtime:
    def __init__(
        self,
        model_fn: Callable[[], nn.Module],
        plan: Mapping[str, ShardStyle] | None,
        optimizer_fn: Callable[[Any], torch.optim.Optimizer],
        source: LayoutSource,
        store: Any,
        cfg: RuntimeConfig,
        on_event: Callable[[TimelineEvent], None] | None = None,
        post_parallelize: Callable[[nn.Module], None] | None = None,
        pipeline: Pipeline | None = None,
        scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
    ) -> None:
        """`plan`: module patterns -> styles of the whole model, or a `plans.ModelPlan`; None takes
        `plans.plan_for(model)` of the first model built. `on_event` sees every timeline event as
        it happens (failure detected, layout received, regrouped, reshard done, first step, ...).
        `post_parallelize(model)` runs after the model is sharded and after every reshard (its
        shards were replaced), before the optimizer sees the parameters: fix-ups that depend on
        the rank's local shapes. After a reshard it must not add, remove or replace parameters.
        `pipeline`: how to cut the model into stages and feed them (pipeline.py); needed for
        layouts with more than one stage, and then `train_step` takes no `loss_fn`.
        `optimizer_fn(params)`: SGD, Adam or AdamW over those parameters, in any number of groups
        (checked when it is first called: optim.py); it is called again for every rank that joins
        or changes stage, whose groups then take their values from a peer. `scheduler_fn(optimizer)`:
        an LR scheduler of that optimizer (torch.optim.lr_scheduler), stepped after every committed
        step and carried like the optimizer; read both through `optimizer` / `scheduler`, never
        through references kept from an earlier step (a rank's optimizer may be replaced)."""
        if pipeline is not None and cfg.micro_batch_size is not None:
            raise ValueError("micro_batch_size is for single-stage replicas; a pipeline cuts its own micro-batches "
                             "(Pipeline(micro_batches=...))")
        self.pipeline = pipeline
        self.on_event = on_event
        self.post_parallelize = post_parallelize
        self._plan = plan
        self.model_fn, self.optimizer_fn, self.scheduler_fn = model_fn, optimizer_fn, scheduler_fn
        self._checked_optimizer = False
        self.source, self.store, self.cfg = source, store, cfg
        # refused here, before anything starts, when the device / backend / host cannot work
        self.features = comm.detect_features()
        self.choice, self.device = cfg.resolve(self.features)
        check_device(cfg.precision, self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # NCCL's object collectives and batched p2p use it
        comm.configure(force_staging=cfg.force_staging, device=self.device)
        log.info("backend chosen", backend=self.choice.backend, device=str(self.device), reason=self.choice.reason)
        self._held: tuple[str, int, int] | None = None  # NCCL: (version key, rank, world) of a kept communicator
        self.step = 0  # committed optimizer steps
        self.s = _State()
        self._groups: list[weakref.ref[Any]] = []  # every group made, to check none outlives a leave
        self._info: dict[int, _StageInfo] = {}  # per stage of the job's pipeline
        self._depth = 0  # the pipeline depth `_info` was read for
        keep = Retention(cfg.checkpoint_keep_last, cfg.checkpoint_keep_every)
        self.checkpointer = (Checkpointer(cfg.checkpoint_dir, keep,
                                          complete_timeout_s=cfg.checkpoint_complete_timeout_s)
                             if cfg.checkpoint_dir else None)
        self.data_state_fn: Callable[[], dict[str, Any]] | None = None  # what save_checkpoint stores as data_state
        self.restored: RestoreInfo | None = None  # the last restore from a checkpoint
        self._saved_step = -1
        self._attempt_nonce: int | None = None  # agreed at the last commit of this layout version
        # the step whose gradients are synced while its commit all-gather runs (None outside it):
        # what a rank whose commit failed can still apply at the regroup (`_roll_forward`)
        self._uncommitted: StepResult | None = None
        self._last_commit: tuple[int, float, float | None] | None = None  # (steps after it, loss, norm)
        self._rolled: StepResult | None = None  # a step completed by `_roll_forward`, for train_step to return
        # where the last layout switch spent its time: (phase, time.time() at its end), from the
        # failure or the agreement on; diagnostics for bench/pipeline.py (not timeline events)
        self.switch_marks: list[tuple[str, float]] = []
        self.last_pass: PassResult | None = None  # the last pipeline pass (bench/pipeline_memory.py)

    @property
    def units(self) -> dict[str, int]:
        """Family -> unit count of this rank's stage."""
        return self._info[self.s.stage].units if self._info else {}

    @property
    def families(self) -> dict[str, str]:
        """Sharded module path -> family, in this rank's stage."""
        return self._info[self.s.stage].families if self._info else {}

    @property
    def plan(self) -> Mapping[str, ShardStyle]:
        assert self._plan is not None, "the plan comes from the first model built (call start() first)"
        return self._plan

    def _fix(self, model: nn.Module, resharded: bool) -> None:
        """The plan's own fix-up (parallelize ran it already; a reshard replaced the shards since)
        and the user's hook."""
        fixup = getattr(self._plan, "fixup", None)
        if resharded and fixup is not None:
            fixup(model)
        if self.post_parallelize is None:
            return
        before = [id(p) for p in model.parameters()]
        self.post_parallelize(model)
        if resharded and [id(p) for p in model.parameters()] != before:
            raise ReconfigurationError("post_parallelize added, removed or replaced parameters after a reshard: "
                                       "the optimizer state moved with the old ones")

    @property
    def _timeout(self) -> dt.timedelta:
        return dt.timedelta(seconds=self.cfg.collective_timeout_s)

    # ---- public ---------------------------------------------------------------------------------
    @property
    def model(self) -> nn.Module:
        assert self.s.model is not None, "call start() first"
        return self.s.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        assert self.s.opt is not None, "call start() first"
        return self.s.opt

    @property
    def scheduler(self) -> Any:
        """The LR scheduler `scheduler_fn` made for the current optimizer (None without one)."""
        return self.s.sched

    @property
    def layout(self) -> WorkerLayout | None:
        return self.s.layout

    @property
    def timeline(self) -> list[TimelineEvent]:
        return self.s.timeline

    @property
    def tp(self) -> int:
        """The TP degree of this rank's group (0 without a place)."""
        lay = self.s.layout
        return 0 if lay is None or lay.rank is None else lay.tp_of(lay.rank)

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.s.stage

    def start(self, timeout: float | None = None) -> None:
        """Wait for a layout that includes this worker and join it (as a fresh rank)."""
        self._join_next(-1, timeout if timeout is not None else self.cfg.reconfigure_timeout_s)

    def train_step(
        self,
        batch_fn: Callable[[int, int, int], Any],
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
    ) -> StepResult:
        """One optimizer step. `batch_fn(step, start, count)` returns samples [start, start+count) of
        the step's global batch (the global order must not depend on the layout); `loss_fn(model,
        batch)` returns the mean loss over those samples. With a `Pipeline` the loss is the
        pipeline's (give no `loss_fn`): the first and last stages call `batch_fn` per
        micro-batch. Survives peer failures (see module doc)."""
        if (self.pipeline is None) == (loss_fn is None):
            raise ValueError("give train_step a loss_fn, or the Runtime a pipeline (whose loss is used), not both")
        while True:
            lay = self.s.layout
            if lay is None or lay.rank is None:
                self._join_next(lay.version if lay else -1, self.cfg.reconfigure_timeout_s)
                continue
            failure = None
            try:
                self._checkpoint_if_due()
                result, agreed = self._try_step(batch_fn, loss_fn)
            except Exception as e:
                if not is_comm_failure(e):
                    raise
                failure = _describe(e)
            if failure is not None:  # outside the except block: no traceback keeps the old groups alive
                self._recover(failure)
                rolled, self._rolled = self._rolled, None
                if rolled is not None:  # the failed step had committed elsewhere and was completed here
                    return rolled
                continue
            if agreed > lay.version:
                try:
                    self._planned_switch(agreed)
                except Exception as e:
                    if not is_comm_failure(e):
                        raise
                    failure = _describe(e)
                if failure is not None:
                    self._recover(failure)
            return result

    def close(self) -> None:
        if self.checkpointer is not None:  # this rank's writes, and (coordinator) their completion
            self.checkpointer.close(self.cfg.checkpoint_complete_timeout_s)
        comm.leave(self.choice.backend, self.features)
        self.source.close()

    # ---- the step -------------------------------------------------------------------------------
    def _try_step(self, batch_fn: Callable[[int, int, int], Any],
                  loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None) -> tuple[StepResult, int]:
        lay, sl = self.s.layout, self.s.sync_layout
        assert lay is not None and lay.rank is not None and sl is not None
        assert self.s.model is not None and self.s.opt is not None and self.s.sync is not None
        t0 = time.perf_counter()
        ri, stage, _ = lay.where(lay.rank)
        tp, lb = lay.degrees[ri][stage], lay.replicas[ri][1]
        last = stage == lay.n_stages - 1
        start = sum(b for _, b in lay.replicas[:ri])
        self.s.sync.zero_grad()  # in place: the gradients stay views of the sync buffers
        t_fb = time.perf_counter()
        tp_mod.TP_WAIT.seconds = 0.0
        with compute_copies(self.s.model, compute_dtype(self.cfg.precision)):  # bf16: the step's copies
            value, lengths = self._forward_backward(batch_fn, loss_fn, lay, start, lb)
        t_fb = time.perf_counter() - t_fb  # real compute only where the host waits for it (CPU)
        tp_wait = tp_mod.TP_WAIT.seconds  # blocked in the TP group's all-reduces (CPU tensors only)
        self.s.sync.sync()
        clip = self.cfg.max_grad_norm
        share = self.s.sync.norm_share() if clip is not None else 0.0
        newest = self.source.latest()
        seen = newest.version if newest is not None else lay.version
        # the last stage's ranks carry the replica's loss, each local_batch / tp of it
        # the third value: a random number of each rank; rank 0's names the next checkpoint attempt
        # (save_checkpoint), so a save needs no collective of its own (52 bits: exact in a float64);
        # the fourth: this rank's share of the squared gradient norm (clipping only)
        mine = torch.tensor([value * lb / tp if last else 0.0, float(seen), float(secrets.randbits(52)), share],
                            dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(lay.world)]
        # from here until the all-gather returns, this step can be completed at a regroup; its
        # result so far (loss unknown; `seconds` holds the step's start until _roll_forward ends it)
        self._uncommitted = StepResult(self.step, math.nan, lay.global_batch, lb, lay.version, tp, t0, stage)
        self._commit_gather(every, mine)  # the commit point
        self._uncommitted = None
        self._attempt_nonce = int(every[0][2].item())
        stacked = torch.stack(every)
        grad_norm = None
        if clip is not None:
            # Every replica's synced gradient is the same, and each replica's ranks hold every
            # stage's units once and its replicated parameters once (norm_share), so the shares
            # sum to replicas x norm^2. Every rank sums the same gathered values exactly (fsum,
            # whatever the host's CPU: sync.global_norm): the norm, and so the clip coefficient, is
            # bit-identical on all of them (a rank-local norm would differ by rounding and let
            # replicas drift apart).
            grad_norm = global_norm(stacked[:, 3].tolist(), len(lay.replicas))
        skipped = self._update(grad_norm)
        step = self.step
        self.step += 1
        gloss = float(stacked[:, 0].sum().item()) / lay.global_batch
        self._last_commit = (self.step, gloss, grad_norm)
        agreed = int(stacked[:, 1].max().item())
        secs = time.perf_counter() - t0
        if self.s.timeline and self.s.timeline[-1].what in ("reshard done", "joined", "restored from checkpoint"):
            self._event("first step", lay.version, f"tp={tp} local_batch={lb} stage={stage}")
        on_cpu = self.choice.device == "cpu"
        self.source.report_step(lay, step, secs, lb, StepWork(
            max(0.0, t_fb - tp_wait) if on_cpu else 0.0, tp_wait if on_cpu else 0.0, sequence_lengths=lengths))
        return StepResult(step, gloss, lay.global_batch, lb, lay.version, tp, secs, stage, grad_norm, skipped), agreed

    def _commit_gather(self, every: list[torch.Tensor], mine: torch.Tensor) -> None:
        """The commit all-gather (a method of its own so that tests can fail it on one rank)."""
        comm.all_gather(every, mine, group=self.s.world)

    def _update(self, grad_norm: float | None) -> bool:
        """Apply a committed step to the synced gradients: clip by `grad_norm` (with max_grad_norm),
        step the optimizer and the schedule. True when the step was skipped (a norm that is not
        finite: the same on every rank, so no rank updates; the step's batch is spent). The commit
        and `_roll_forward` both come here, so a rank that completes a step late does exactly
        what the others did."""
        assert self.s.model is not None and self.s.opt is not None
        clip = self.cfg.max_grad_norm
        if clip is not None and grad_norm is not None:
            if not math.isfinite(grad_norm):
                log.warning("gradient norm not finite: optimizer step skipped", step=self.step, grad_norm=grad_norm)
                return True
            if clip / (grad_norm + 1e-6) < 1.0:  # below 1 only: a coefficient of 1 would only cost a pass
                # clip_grad_norm_'s scaling with the norm given (every rank the same float64)
                clip_grads_with_norm_(self.s.model.parameters(), clip, torch.tensor(grad_norm, dtype=torch.float64))
        self.s.opt.step()
        if self.s.sched is not None:
            self.s.sched.step()
        return False

    def _roll_forward(self, info: list[tuple[float, ...]], survivors: dict[int, int]) -> int | None:
        """Survivors split by a death inside the commit (module doc): when those behind are one
        step behind and hold that step's synced gradients, each of them applies the update the
        others committed (its loss and gradient norm taken from the lowest new rank that committed)
        and the agreed step is returned; None when the split cannot be explained so."""
        steps = {int(info[nr][2]) for nr in survivors}
        lo, hi = min(steps), max(steps)
        behind = [nr for nr in survivors if int(info[nr][2]) == lo]
        ahead = [nr for nr in sorted(survivors) if int(info[nr][2]) == hi and info[nr][6] == 1.0]
        if hi != lo + 1 or not ahead or any(info[nr][3] != 1.0 for nr in behind):
            return None
        _, _, _, _, loss, norm, _, has_norm = info[ahead[0]]
        grad_norm = norm if has_norm == 1.0 else None
        me = self._uncommitted
        if self.step == lo and me is not None and me.step == lo:
            assert self.s.layout is not None
            skipped = self._update(grad_norm)
            self.step = hi
            self._last_commit = (hi, loss, grad_norm)
            self._rolled = StepResult(lo, loss, me.global_batch, me.local_batch, me.version, me.tp,
                                      time.perf_counter() - me.seconds, me.stage, grad_norm, skipped)
            # not reported to the source (report_step): its time ran on through the failure and the
            # wait for the new layout, and a fail-slow detector would read it as a slow step
            self._event("step rolled forward", self.s.layout.version,
                        f"step {lo} committed on {len(survivors) - len(behind)} survivors, not on {len(behind)}: "
                        "completed here from its synced gradients")
        self._uncommitted = None
        return hi

    def _forward_backward(self, batch_fn: Callable[[int, int, int], Any],
                          loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None, lay: WorkerLayout, start: int,
                          lb: int) -> tuple[float, tuple[int, ...] | None]:
        """This rank's forward and backward of the step: `loss_fn` over the local batch in
        micro-batches (single-stage replicas), or its pipeline stage's pass. Gradients accumulate
        in the sync's buffers. Returns the replica's loss (0 off a pipeline's last stage) and the
        samples' sequence lengths where the batches tell them (fail-slow evidence)."""
        assert self.s.model is not None
        if loss_fn is None:
            return self._pipeline_pass(batch_fn, lay, start, lb), None
        size = self.cfg.micro_batch_size
        cuts = micro_batches(lb, -(-lb // size)) if size else [(0, lb)]
        seen_lengths = []
        shares: list[torch.Tensor] = []  # read once after the loop: no host sync per micro-batch
        for off, n in cuts:  # gradients accumulate; each micro-batch's mean loss weighted by its share
            batch = batch_fn(self.step, start + off, n)
            loss = loss_fn(self.s.model, batch)
            torch.autograd.backward(loss if len(cuts) == 1 else loss * (n / lb))  # Tensor.backward: unannotated
            shares.append(loss.detach().double() * (n / lb))
            seen_lengths.append(StepWork.lengths_of(batch))
        value = float(torch.stack(shares).sum().item())
        if all(x is not None for x in seen_lengths):
            return value, tuple(v for x in seen_lengths if x is not None for v in x)
        return value, None

    def _pipeline_pass(self, batch_fn: Callable[[int, int, int], Any], lay: WorkerLayout, start: int,
                       lb: int) -> float:
        """This rank's stage over the replica's micro-batches in the job's schedule
        (`pipeline.run_stage`); the replica's loss on the last stage, 0 elsewhere."""
        pipe, model = self.pipeline, self.s.model
        assert pipe is not None and model is not None and lay.rank is not None
        ri, stage, index = lay.where(lay.rank)
        links = StageLinks.of(lay.group_ranks()[ri], stage, index, self.s.world)
        parts = micro_batches(lb, pipe.micro_batches or lay.n_stages)
        step = self.step
        self.last_pass = run_stage(model, pipe, self.cfg.schedule, links, parts, lb,
                                   lambda off, n: batch_fn(step, start + off, n), self.device)
        return self.last_pass.loss

    # ---- switching layouts ----------------------------------------------------------------------
    def _planned_switch(self, agreed: int) -> None:
        """Every member of the current group runs this after the same step. Agree on a version every
        rank holds (sources may skip versions), then switch to it."""
        lay = self.s.layout
        assert lay is not None
        while True:
            got = self.source.get(agreed) or self._wait_for(agreed)
            newest = self.source.latest()
            mine = torch.tensor([1.0 if got is not None else 0.0, float(newest.version if newest else -1)],
                                dtype=torch.float64)
            every = [torch.zeros_like(mine) for _ in range(lay.world)]
            comm.all_gather(every, mine, group=self.s.world)
            stacked = torch.stack(every)
            if bool((stacked[:, 0] > 0).all()):
                break
            agreed = int(stacked[:, 1].max().item())
        target = self.source.get(agreed)
        assert target is not None
        self._event("layout agreed", target.version, target.reason)
        self.switch_marks = [("layout agreed", time.time())]
        try:
            self._apply(target, planned=True)
        except _Superseded as e:
            self._join_chain(e.newer)

    def _wait_for(self, version: int) -> WorkerLayout | None:
        deadline = time.monotonic() + self.cfg.reconfigure_timeout_s
        while time.monotonic() < deadline:
            got = self.source.get(version)
            if got is not None:
                return got
            newest = self.source.wait_newer(version - 1, 0.05)
            if newest is not None and newest.version > version:
                return None  # skipped: the next round agrees on a newer one
        raise ReconfigurationError(f"layout version {version} never arrived")

    def _recover(self, err: str) -> None:
        lay = self.s.layout
        assert lay is not None
        self._event("failure detected", lay.version, err)
        self.switch_marks = [("failure detected", time.time())]
        log.warning("collective failed; waiting for a new layout", version=lay.version, error=err)
        t = time.perf_counter()
        self._leave_group()
        self._mark("left old group")
        self._event("left old group", lay.version, f"{time.perf_counter() - t:.3f} s")
        self._join_next(lay.version, self.cfg.reconfigure_timeout_s)

    def _join_next(self, after: int, timeout: float) -> None:
        nxt = self.source.wait_newer(after, timeout)
        if nxt is None:
            raise ReconfigurationError(f"no layout newer than version {after} arrived within {timeout:.0f} s")
        self._event("layout received", nxt.version, nxt.reason)
        self._mark("layout received")
        self._join_chain(nxt)

    def _join_chain(self, target: WorkerLayout) -> None:
        """Apply `target`, moving on to newer versions while a regroup cannot complete."""
        while True:
            try:
                self._apply(target)
                return
            except _Superseded as e:
                target = e.newer
            except Exception as e:
                if not is_comm_failure(e):
                    raise
                self._event("regroup failed", target.version, str(e).splitlines()[0][:160])
                self._leave_group()
                nxt = self.source.wait_newer(target.version, self.cfg.reconfigure_timeout_s)
                if nxt is None:
                    raise ReconfigurationError(
                        f"could not regroup at version {target.version} and no newer layout arrived") from e
                target = nxt

    def _leave_group(self, keep: bool = False) -> None:
        """Destroy the current groups. References to them are dropped first: gloo closes a group's
        connections only when its last reference goes, and a closed connection is what tells peers
        still blocked in a collective with us to give up now rather than at their timeout. NCCL
        communicators are aborted (comm.leave). `keep` (NCCL, a planned switch, where torch can
        shrink): the sub-groups go, the version's default communicator stays for the next
        rendezvous to shrink (comm.shrink_plan decides; it is aborted there otherwise)."""
        if self.s.sync is not None:  # its gradient buffers serve the next layout's sync
            self.s.spare = self.s.sync.buffers()
            self.s.sync.release()
        self.s.sync = self.s.world = None
        self.s.syncs = []
        if self.s.model is not None:
            for m in self.s.model.modules():
                if isinstance(m, ShardedModule):
                    m.group = None
        lay = self.s.layout
        if keep and dist.is_initialized() and lay is not None and lay.rank is not None:
            if self._held is None:
                self._held = (f"{lay.epoch}.{lay.version}", lay.rank, lay.world)
            for r in self._groups:
                g = r()
                if g is not None:
                    dist.destroy_process_group(g)
                del g
        elif dist.is_initialized():
            self._held = None
            try:
                comm.leave(self.choice.backend, self.features)
            except Exception as e:  # a broken group may fail to tear down cleanly; it is dropped either way
                log.debug("destroying the old process group failed", error=str(e))
        comm.release_buffers()  # the next layout's messages have other sizes
        self._release_groups()

    def _track(self, *groups: Any) -> None:
        # non-members get a marker (an int), not a group
        self._groups += [weakref.ref(g) for g in groups if isinstance(g, dist.ProcessGroup)]

    def _release_groups(self) -> None:
        """Make sure no old group outlives the leave: a reference left somewhere (a reference cycle
        through a failed collective's traceback, say) would keep its connections open and leave a
        peer blocked on us until its timeout. Cheap when nothing is left; a full collection else."""
        left = [r for r in self._groups if r() is not None]
        self._groups = []
        if not left:
            return
        holders: set[str] = set()
        for r in left:
            g = r()
            holders.update(type(h).__name__ for h in (gc.get_referrers(g) if g is not None else ()))
            del g
        gc.collect()
        still = sum(r() is not None for r in left)
        log.warning("old process groups outlived the leave; collected", groups=len(left), held_by=sorted(holders),
                    still_alive=still)
        self._event("groups outlived leave", self.s.layout.version if self.s.layout else -1,
                    f"{len(left)} groups held by {sorted(holders)}; {still} still alive after a collection")

    def _rendezvous(self, target: WorkerLayout) -> None:
        assert target.rank is not None
        prefix = f"ntp/{self.cfg.job}/pg/v{target.epoch}.{target.version}"
        comm.publish_held(self.store, prefix, target.rank, self._held, self.choice.backend)
        arrivals = comm.arrival_keys(prefix, target.world)
        self.store.set(arrivals[target.rank], "1")  # by rank: a rank that comes twice is counted once
        deadline = time.monotonic() + self.cfg.rendezvous_timeout_s
        while not self.store.check(arrivals):
            newest = self.source.latest()
            if newest is not None and newest.version > target.version:
                raise _Superseded(newest)
            if time.monotonic() > deadline:
                here = sum(bool(self.store.check([k])) for k in arrivals)
                raise ReconfigurationError(f"rendezvous for version {target.version} timed out: "
                                           f"{here} of {target.world} arrived")
            time.sleep(0.005)
        self._mark("all arrived")
        shrinkable = self.choice.backend == "nccl" and self.features.shrink_group
        plan = comm.agree(self.store, prefix, target.world, self.choice.backend, shrinkable)
        self._mark("agreed")
        if plan.kind == "shrink" and self._held is not None and self._held[0] == plan.old_version:
            comm.shrink_default_group(plan.exclude)  # ncclCommShrink: no new communicator from nothing
            self._held = None
            if (dist.get_rank(), dist.get_world_size()) != (target.rank, target.world):
                raise ReconfigurationError(f"shrunk communicator gives rank {dist.get_rank()} of "
                                           f"{dist.get_world_size()}, the layout {target.rank} of {target.world}")
            self._event("communicator shrunk", target.version, plan.reason)
        else:
            if self._held is not None:
                self._held = None
                comm.leave(self.choice.backend, self.features)
            # torch.distributed imports PrefixStore without re-exporting it to type checkers (no `as`)
            comm.init_default_group(self.choice.backend, dist.PrefixStore(prefix, self.store),  # type: ignore[attr-defined]
                                    target.rank, target.world, self._timeout,
                                    self.device if self.device.type == "cuda" else None, self.features)
        self._mark("default group")
        # Nothing runs on the default group: after a failed collective torch 2.13 keeps a reference
        # to it that no collection frees, so its connections stay open after we leave, and a peer
        # blocked in a collective on it would wait for its timeout. Our own groups are released.
        self.s.world = dist.new_group(list(range(target.world)), timeout=self._timeout)
        self._track(self.s.world)
        self._mark("world group")

    def _apply(self, target: WorkerLayout, planned: bool = False) -> None:
        """Leave the current group and join `target`'s: regroup, reshard every stage, ack.

        Pipelines: each stage is resharded on its own, from the survivors that held it (in any
        replica) to the ranks that hold it now. A rank that keeps its stage reshards in place; one
        whose group moved to another stage builds that stage's model, receives its shards, the
        replicated parameters and their optimizer state from that stage's survivors (DP peers),
        and meanwhile serves its old stage's shards to whoever needs them; a fresh rank is the
        same without the serving. When no survivor holds some stage (or some unit of it), every
        rank restores the newest checkpoint instead (`_restore_into`), or raises
        ReconfigurationError naming the stage when there is none; also when the pipeline depth
        changed."""
        old = self.s.layout
        self._attempt_nonce = None  # every rank of the new layout, fresh or not, starts without one
        if self.checkpointer is not None:  # a checkpoint's background copy reads the state a reshard changes
            self.checkpointer.fence()
        if target.n_stages > 1 and self.pipeline is None:
            raise ReconfigurationError(f"layout version {target.version} has {target.n_stages} pipeline stages but the "
                                       "Runtime has no pipeline: give it Runtime(..., pipeline=Pipeline(...))")
        # NCCL on a planned switch: keep the communicator, the next version may shrink it
        self._leave_group(keep=planned and target.rank is not None and self.choice.backend == "nccl"
                          and self.features.shrink_group and comm.can_shrink())
        if target.rank is None:
            self.s.spare = []
            self._event("no place", target.version, "this worker's GPU is not in the layout")
            self.s.layout = target
            self.source.ack(target, True, "no place")
            return
        self._rendezvous(target)
        rank, world, depth = target.rank, target.world, target.n_stages
        # who holds what: old rank and the version it was a member of (-1 when fresh), committed
        # steps; for `_roll_forward`: whether this rank holds the synced gradients of step `step`
        # whose commit it did not see complete, and the outcome (loss, norm) of the commit that
        # made `step` where this rank made it. float64: every integer here is exact.
        held = old is not None and old.rank is not None and self.s.model is not None
        if not held:
            self._uncommitted = None
        pending = self._uncommitted is not None and self._uncommitted.step == self.step
        last = self._last_commit if self._last_commit is not None and self._last_commit[0] == self.step else None
        norm = last[2] if last is not None else None
        mine = torch.tensor([old.rank if held and old else -1, old.version if held and old else -1, self.step,
                             float(pending), last[1] if last else 0.0, norm if norm is not None else 0.0,
                             float(last is not None), float(norm is not None)], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        comm.all_gather(every, mine, group=self.s.world)
        info = [tuple(float(x) for x in t.tolist()) for t in every]
        self._mark("exchanged ranks")
        self._event("regrouped", target.version, f"world={world}")
        src_version = max((int(i[1]) for i in info if i[0] >= 0), default=-1)
        survivors = {nr: int(i[0]) for nr, i in enumerate(info) if i[0] >= 0 and int(i[1]) == src_version}
        steps = {int(info[nr][2]) for nr in survivors}
        if len(steps) > 1:
            agreed = self._roll_forward(info, survivors)
            if agreed is None:
                return self._restore_into(target, f"survivors disagree on the committed step ({sorted(steps)}) in a "
                                          "way a late commit cannot mend")
            steps = {agreed}
        self._uncommitted = None
        if not survivors and max(int(i[2]) for i in info) == 0:
            return self._restore_into(target, None)  # the job's first layout: a checkpoint, or a fresh model
        if not survivors:
            return self._restore_into(target, "no rank of the new layout holds the model state")
        self.step = steps.pop()
        src = min(survivors)
        obj: list[Any] = [(old.replicas, old.degrees) if rank == src and old else None]
        if len(survivors) < world:  # some rank holds no old layout (or an older one): the oldest survivor's
            comm.broadcast_object_list(obj, src=src, group=self.s.world)
        else:  # every rank held version src_version, whose replicas and degrees are the same for all
            assert old is not None
            obj = [(old.replicas, old.degrees)]
        self._mark("old layout")
        old_replicas: tuple[tuple[int, int], ...] = tuple((int(r[0]), int(r[1])) for r in obj[0][0])
        old_degrees = tuple(tuple(int(d) for d in st) for st in obj[0][1])
        if len(old_degrees[0]) != depth:
            raise ReconfigurationError(f"the pipeline depth changed from {len(old_degrees[0])} to {depth} stages: "
                                       "stages cannot be re-cut live; restart from a checkpoint")
        _, stage, _ = target.where(rank)
        old_stage = locate(old_degrees, survivors[rank])[1] if rank in survivors else None
        fresh = self._fresh_model(stage, depth) if old_stage != stage else None  # also reads every stage's plan
        # Each stage: its old layout (new rank numbers for survivors, world + old rank for the
        # gone), its new one, the survivors that held it. Checked on every rank before any
        # message moves, so all refuse together.
        inverse = {r: nr for nr, r in survivors.items()}
        old_groups = stage_ranks(old_degrees)
        old_sl: dict[int, SyncLayout] = {}
        new_sl: dict[int, SyncLayout] = {}
        alive: dict[int, set[int]] = {}
        moves: dict[int, list[Move]] = {}
        for s in range(depth):
            units = self._info[s].units
            old_sl[s] = SyncLayout(tuple(ReplicaGroup(tuple(inverse.get(x, world + x) for x in old_groups[r][s]), b)
                                         for r, (_, b) in enumerate(old_replicas)), units)
            new_sl[s] = target.sync_layout(units, s)
            alive[s] = {nr for nr, r in survivors.items() if locate(old_degrees, r)[1] == s}
            if not alive[s]:
                return self._restore_into(target, f"no surviving rank holds pipeline stage {s}: every rank that held "
                                          "its layers is gone")
            try:
                moves[s] = reshard_moves(old_sl[s], new_sl[s], alive[s])
            except ValueError as e:  # every holder of some unit of the stage is gone
                return self._restore_into(target, f"pipeline stage {s}: {e}")
        self._mark("checked")
        my_tp = self._tp_groups(target)
        self._mark("tp groups")
        held_model, held_opt, held_sched = self.s.model, self.s.opt, self.s.sched  # the old stage's, if held
        if fresh is not None:  # a fresh or stale rank, or a group that changed stage: values from peers
            model = fresh
            parallelize(model, self._info[stage].plan, new_sl[stage].units_of(rank), group=my_tp)
            self._fix(model, resharded=False)
            model.to(self.device)
            opt, sched = self._make_optimizer(model)
            if self.step > 0:
                ensure_optimizer_state(opt)
        else:
            assert held_model is not None and held_opt is not None
            model, opt, sched = held_model, held_opt, self.s.sched
        freed: list[torch.Tensor] = []  # the replaced shards' memory, for the new gradient buffers
        for s in range(depth):  # every rank the same order, so point-to-point pairs match
            if s == stage:
                opt = apply_reshard(model, opt, old_sl[s], new_sl[s], alive[s], rank, self._info[s].families, my_tp,
                                    group=self.s.world, moves=moves[s], freed=freed if fresh is None else None)
            elif s == old_stage:  # a source only: it holds none of this stage any more
                assert held_model is not None and held_opt is not None
                apply_reshard(held_model, held_opt, old_sl[s], new_sl[s], alive[s], rank, self._info[s].families,
                              None, group=self.s.world, moves=moves[s])
        self._mark("reshard moves")
        self._fix(model, resharded=True)
        if rank in alive[stage]:
            # This rank's model now holds `target`'s units of its stage, and its replicated values are
            # its own: from here on a failure (a joiner dying while it receives, say) must find it
            # described as a member of `target`, or the next regroup would move its units by the old
            # layout's unit lists and fill what it no longer holds with garbage. A joiner is marked
            # only once it has received the replicated values too (below).
            self.s.model, self.s.opt, self.s.sched, self.s.stage = model, opt, sched, stage
            self.s.layout, self.s.sync_layout = target, new_sl[stage]
        joiners = 0
        for s in range(depth):
            members = [r for g in target.group_ranks() for r in g[s]]
            new_here = [r for r in members if r not in alive[s]]
            if not new_here:
                continue
            joiners += len(new_here)
            staying = sorted(r for r in alive[s] if r in members)
            giver = staying[0] if staying else min(alive[s])
            if rank == giver:
                gm, go, gs = (model, opt, sched) if stage == s else (held_model, held_opt, held_sched)
                assert gm is not None and go is not None
                self._send_replicated(gm, go, gs, giver, new_here)
            elif rank in new_here:
                self._send_replicated(model, opt, sched, giver, [rank])
        held_model = held_opt = held_sched = None
        self._mark("replicated")
        self.s.model, self.s.opt, self.s.sched, self.s.stage = model, opt, sched, stage
        self.s.sync = self._new_sync(model, target, rank, scratch=freed)
        del freed
        self._mark("sync")
        self.s.layout, self.s.sync_layout = target, new_sl[stage]
        self._event("reshard done", target.version,
                    f"tp={self.tp} stage={stage} joiners={joiners} survivors={len(survivors)}"
                    + (f" stage {old_stage}->{stage}" if old_stage is not None and old_stage != stage else ""))
        self.source.ack(target, True)

    def _tp_groups(self, target: WorkerLayout) -> Any:
        """Create every TP group (each stage of each replica; collectively, in order, as torch
        requires); return ours."""
        assert target.rank is not None
        ri, si, _ = target.where(target.rank)
        mine = None
        for r, rep in enumerate(target.group_ranks()):
            for s, rs in enumerate(rep):
                g = dist.new_group(ranks=list(rs), timeout=self._timeout)
                self._track(g)
                if (r, s) == (ri, si):
                    mine = g
        return mine

    def _new_sync(self, model: nn.Module, target: WorkerLayout, rank: int,
                  scratch: list[torch.Tensor] | None = None) -> NtpGradSync:
        """One NTP sync per stage (each creates its groups on every rank); ours is active."""
        spare, self.s.spare = self.s.spare, []
        _, stage, _ = target.where(rank)
        own = None
        self.s.syncs = []
        for s in range(target.n_stages):
            here = s == stage
            info = self._info[s]
            sync = NtpGradSync(model, target.sync_layout(info.units if here else {}, s), rank,
                               info.families if here else {}, timeout=self._timeout, reuse=spare if here else (),
                               scratch=(scratch or []) if here else ())
            self._track(*sync.dp_groups, sync.layout_group)
            self.s.syncs.append(sync)
            self._mark(f"sync stage {s}")
            if here:
                own = sync
        assert own is not None and own.active
        return own

    def _fresh_model(self, stage: int = 0, depth: int = 1) -> nn.Module:
        """Stage `stage` of a freshly built model (the whole model without a pipeline), built
        under the run's seed so every rank starts from the same values. The first call reads the
        plan and every stage's units off the whole model."""
        torch.manual_seed(self.cfg.seed)
        whole = self.model_fn()
        check_model(whole, self.cfg.precision)  # bf16: fp32 master parameters (precision.py)
        if self.cfg.recompute:
            enable_recompute(whole)  # before the cut: stages and layers carry the switch
        if self._plan is None:
            from ntp_manager.worker.plans import plan_for

            self._plan = plan_for(whole)
        if self.pipeline is None:
            if depth != 1:
                raise ReconfigurationError(f"a layout of {depth} stages needs a Runtime with a pipeline")
            if not self._info:
                self._info = {0: _StageInfo(self.plan, unit_counts(whole, self.plan), families_of(self.plan, whole))}
                self._depth = 1
            return whole
        if self._depth != depth:
            info = {}
            for s in range(depth):  # every stage's, so any rank can check and plan any stage's reshard
                part = self.pipeline.stage(whole, s, depth)
                plan = stage_plan(self.plan, part)
                info[s] = _StageInfo(plan, unit_counts(part, plan), families_of(plan, part))
            self._info, self._depth = info, depth
        return self.pipeline.stage(whole, stage, depth)

    def _build_fresh(self, target: WorkerLayout) -> None:
        assert target.rank is not None
        _, stage, _ = target.where(target.rank)
        model = self._fresh_model(stage, target.n_stages)
        my_tp = self._tp_groups(target)
        sl = target.sync_layout(self._info[stage].units, stage)
        parallelize(model, self._info[stage].plan, sl.units_of(target.rank), group=my_tp)
        self._fix(model, resharded=False)
        model.to(self.device)
        self.s.model, self.s.stage = model, stage
        self.s.opt, self.s.sched = self._make_optimizer(model)
        self.s.sync = self._new_sync(model, target, target.rank)
        self.s.layout, self.s.sync_layout = target, sl

    def _make_optimizer(self, model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
        """`optimizer_fn`'s optimizer over `model` (the first one checked: optim.check_optimizer)
        and `scheduler_fn`'s scheduler of it."""
        opt = self.optimizer_fn(model.parameters())
        if not self._checked_optimizer:
            check_optimizer(opt, model)
        sched = self.scheduler_fn(opt) if self.scheduler_fn is not None else None
        check_scheduler(sched, opt)  # every one: a later scheduler_fn call may bind the wrong optimizer
        if not self._checked_optimizer and self.checkpointer is not None:
            scheduler_json(sched)  # refused now, not at the first checkpoint, if it cannot be stored
        self._checked_optimizer = True
        return opt, sched

    def _send_replicated(self, model: nn.Module, opt: torch.optim.Optimizer, sched: Any, src: int,
                         dsts: list[int]) -> None:
        """Replicated parameters of a stage, their optimizer state and the Adam step count, then the
        parameter groups' values (learning rate...) and the LR scheduler's state, from `src` to
        each of `dsts` (point-to-point on the world group; `src` calls it with every joiner of the
        stage, a joiner with itself). Both ends walk the same stage module, so parameters and
        state keys come in the same order."""
        sharded = {id(p) for m in model.modules() if isinstance(m, ShardedModule) for _, p, _ in m.sharded_params()}
        me = dist.get_rank(self.s.world)
        tensors: list[torch.Tensor] = []
        with torch.no_grad():
            for p in model.parameters():
                if id(p) in sharded:
                    continue
                tensors.append(p.data)
                st = opt.state.get(p, {})
                tensors += [st[k] for k in sorted(st) if isinstance(st[k], torch.Tensor) and st[k].dim() > 0]
        step_val = torch.tensor([-1.0], dtype=torch.float64)
        if me == src:
            s = next((st["step"] for st in opt.state.values() if "step" in st), None)
            if s is not None:
                step_val[0] = float(s)
        tensors.append(step_val)
        if me == src:
            ops = [comm.P2P(True, t.contiguous(), d) for d in dsts for t in tensors]
        else:
            ops = [comm.P2P(False, t, src) for t in tensors]
        comm.wait_all(comm.exchange(ops, self.s.world))
        if me != src and step_val.item() >= 0:
            for group in opt.param_groups:
                for p in group["params"]:
                    st = opt.state.get(p, {})
                    if "step" in st:
                        st["step"] = _step_tensor(step_val.item(), p, group)
        # the values: their size first, then the bytes (a fresh optimizer has optimizer_fn's values)
        blob = pack_values(opt, sched) if me == src else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([blob.numel()], dtype=torch.int64)
        comm.wait_all(comm.exchange([comm.P2P(True, size, d) for d in dsts] if me == src
                                    else [comm.P2P(False, size, src)], self.s.world))
        if me != src:
            blob = torch.empty(int(size.item()), dtype=torch.uint8)
        comm.wait_all(comm.exchange([comm.P2P(True, blob, d) for d in dsts] if me == src
                                    else [comm.P2P(False, blob, src)], self.s.world))
        if me != src:
            unpack_values(blob, opt, sched, f"rank {src}")

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, data_state: dict[str, Any] | None = None) -> SaveHandle:
        """Checkpoint the state after `step` committed steps (worker/checkpoint.py); returns once
        this rank's shards are copied, while they are written. Every rank of the layout calls it
        between the same two steps. `data_state`: JSON describing the data position (default:
        `data_state_fn()` when set)."""
        lay, sl = self.s.layout, self.s.sync_layout
        if self.checkpointer is None:
            raise RuntimeError("no checkpoint_dir in the RuntimeConfig")
        assert lay is not None and lay.rank is not None and sl is not None, "call start() first"
        if data_state is None and self.data_state_fn is not None:
            data_state = self.data_state_fn()
        nonce = self._attempt_nonce  # the attempt's name: agreed at the last commit, else one broadcast
        handle = self.checkpointer.save(self.step, self.model, self.optimizer, sl, lay.rank, self.families,
                                        group=self.s.world, data_state=data_state, job_ranks=range(lay.world),
                                        attempt=None if nonce is None else f"c{nonce:013x}s{self.step}",
                                        scheduler=self.s.sched)
        self._attempt_nonce = None  # one attempt per commit
        self._saved_step = self.step
        log.info("checkpoint started", step=self.step, version=lay.version, snapshot_s=round(handle.snapshot_s, 4))
        return handle

    def restore_checkpoint(self) -> RestoreInfo:
        """Every rank of the current layout loads the newest verified checkpoint into its model
        and optimizer (any layout can load any checkpoint); training goes on from its step.
        Raises CheckpointError when none verifies."""
        lay, sl = self.s.layout, self.s.sync_layout
        if self.checkpointer is None:
            raise RuntimeError("no checkpoint_dir in the RuntimeConfig")
        assert lay is not None and lay.rank is not None and sl is not None, "call start() first"
        self.checkpointer.fence()
        info = self.checkpointer.load(self.model, self.optimizer, sl, lay.rank, self.families, group=self.s.world,
                                      strict=lay.n_stages == 1,  # a stage holds only its part of the checkpoint
                                      scheduler=self.s.sched)
        self.step = self._saved_step = info.step
        self.restored = info
        self._event("restored from checkpoint", lay.version, info.describe())
        return info

    def _checkpoint_if_due(self) -> None:
        n = self.cfg.checkpoint_interval
        if self.checkpointer is not None and n > 0 and self.step > 0 and self.step % n == 0 \
                and self._saved_step != self.step:
            self.save_checkpoint()

    def _restore_into(self, target: WorkerLayout, why: str | None) -> None:
        """Every rank of `target` builds a fresh model for its units and loads the newest verified
        checkpoint into it: state no survivor holds (`why`), or the job's first layout (`why`
        None: without a checkpoint, or with checkpoint_resume off, the fresh model is the start)."""
        self._rolled = self._uncommitted = None  # whatever a roll-forward did, the checkpoint's state replaces it
        ck = self.checkpointer if why is not None or self.cfg.checkpoint_resume else None
        if why is not None and ck is None:
            raise ReconfigurationError(f"{why}; no checkpoint_dir is configured to restore from")
        self._build_fresh(target)
        assert target.rank is not None and self.s.sync_layout is not None
        info = None
        if ck is not None:
            try:
                info = ck.load(self.model, self.optimizer, self.s.sync_layout, target.rank, self.families,
                               group=self.s.world, strict=target.n_stages == 1, max_step=target.restore_step,
                               scheduler=self.s.sched)
            except NoCheckpoint as e:
                if why is not None:
                    raise ReconfigurationError(f"{why}; and {e}") from e
            except CheckpointError as e:
                raise ReconfigurationError(f"{why or 'resuming the job'}: {e}") from e
        if info is None:
            self._event("joined", target.version, f"tp={self.tp}")
            self.source.ack(target, True)
            return
        self.step = self._saved_step = info.step
        self.restored = info
        self._event("restored from checkpoint", target.version, info.describe() + (f" ({why})" if why else ""))
        self.source.ack(target, True, f"restored from step {info.step}",
                        RestoreNote(info.step, info.path.name, why or "", tuple(f"{n}: {w}" for n, w in info.skipped)))

    def _mark(self, phase: str) -> None:
        self.switch_marks.append((phase, time.time()))

    def _event(self, what: str, version: int, detail: str = "") -> None:
        ev = TimelineEvent(time.time(), what, version, detail)
        self.s.timeline.append(ev)
        if self.on_event is not None:
            self.on_event(ev)
        log.info(what, version=version, detail=detail, step=self.step)
