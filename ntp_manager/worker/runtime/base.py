"""The state every part of the Runtime shares (base of step.py, joiners.py, switch.py): the
constructor, what the runtime holds (`_State`), the per-stage facts read off the whole model once
(`_StageInfo`), and the small helpers all parts use (events, switch marks, fix-ups, group tracking)."""

from __future__ import annotations

import datetime as dt
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn

from ntp_manager.worker import comm
from ntp_manager.worker.checkpoint import Checkpointer, RestoreInfo, Retention
from ntp_manager.worker.pipeline import PassResult, Pipeline
from ntp_manager.worker.precision import check_device
from ntp_manager.worker.runtime.abort import AbortWatch, install_block_checks
from ntp_manager.worker.runtime.config import (
    ReconfigurationError,
    RuntimeConfig,
    StepAborted,
    StepResult,
    TimelineEvent,
)
from ntp_manager.worker.sources import LayoutSource, WorkerLayout, failed_key
from ntp_manager.worker.sync import NtpGradSync, SyncLayout
from ntp_manager.worker.tp import ShardStyle

log = structlog.get_logger("ntp.worker")


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


class _RuntimeBase:
    """The constructor and the state every part reads and writes; the parts are mixins of it."""

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
        # the global sample cursor: samples trained by the committed steps (every rank the same,
        # carried through regroups, joins and checkpoints); step `step` takes the next global batch
        self.samples = 0
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
        # a peer's reported failure, watched while a step computes (runtime/abort.py)
        self._watch = AbortWatch(store, cfg.abort_poll_s)
        self._rng: tuple[torch.Tensor, torch.Tensor | None] | None = None  # the RNG as the step found it

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

    def _failed_key(self, lay: WorkerLayout) -> str:
        return failed_key(self.cfg.job, lay.version, lay.epoch)

    def _check_abort(self, where: str) -> None:
        """Abandon the step here when a rank of its layout version has reported a failure."""
        why = self._watch.doomed()
        if why is not None:
            raise StepAborted(f"step {self.step} abandoned {where}: a rank reported {why}")

    def _save_rng(self) -> None:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        self._rng = (torch.get_rng_state(), cuda)

    def _restore_rng(self) -> None:
        """Put the RNG back where the abandoned step found it: its redo draws the same numbers."""
        if self._rng is not None:
            torch.set_rng_state(self._rng[0])
            if self._rng[1] is not None:
                torch.cuda.set_rng_state(self._rng[1], self.device)
            self._rng = None

    def _fix(self, model: nn.Module, resharded: bool) -> None:
        """The plan's own fix-up (parallelize ran it already; a reshard replaced the shards since),
        the user's hook, and the doomed-step checks on the model's blocks (runtime/abort.py)."""
        if self.cfg.abort_poll_s > 0:
            install_block_checks(model, self._check_abort)
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


    def _track(self, *groups: Any) -> None:
        # non-members get a marker (an int), not a group
        self._groups += [weakref.ref(g) for g in groups if isinstance(g, dist.ProcessGroup)]

    def _mark(self, phase: str) -> None:
        self.switch_marks.append((phase, time.time()))

    def _event(self, what: str, version: int, detail: str = "") -> None:
        ev = TimelineEvent(time.time(), what, version, detail)
        self.s.timeline.append(ev)
        if self.on_event is not None:
            self.on_event(ev)
        log.info(what, version=version, detail=detail, step=self.step)
