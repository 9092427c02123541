"""Building a rank's state from nothing or from peers: a fresh model under the run's seed (and
every stage's plan read off it), its TP groups and NTP syncs, its optimizer and scheduler; what a
joining rank receives besides its shards (replicated parameters, their optimizer state, the step
count, the groups' values and the scheduler); and a restore from the newest checkpoint when no
survivor holds the state."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ntp_manager.worker import comm
from ntp_manager.worker.checkpoint import CheckpointError, NoCheckpoint, RestoreInfo
from ntp_manager.worker.data import split_cursor
from ntp_manager.worker.optim import check_optimizer, check_scheduler, pack_values, scheduler_json, unpack_values
from ntp_manager.worker.pipeline import stage_plan
from ntp_manager.worker.precision import check_model
from ntp_manager.worker.recompute import enable_recompute
from ntp_manager.worker.runtime.base import _RuntimeBase, _StageInfo
from ntp_manager.worker.runtime.config import ReconfigurationError
from ntp_manager.worker.sources import RestoreNote, WorkerLayout
from ntp_manager.worker.sync import NtpGradSync, families_of
from ntp_manager.worker.tp import ShardedModule, parallelize, unit_counts


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



class _Joining(_RuntimeBase):
    """Making a rank's model, groups, syncs and optimizer; feeding a joiner; restoring a checkpoint."""

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


    @staticmethod
    def _cursor_of(info: RestoreInfo) -> tuple[int, RestoreInfo]:
        """A restored checkpoint's sample cursor, and its RestoreInfo with the user's data_state only."""
        cursor, user = split_cursor(info.data_state, info.step, info.layout)
        return cursor, dataclasses.replace(info, data_state=user)

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
            self.samples = 0
            self._event("joined", target.version, f"tp={self.tp}")
            self.source.ack(target, True)
            return
        self.step = self._saved_step = info.step
        self.samples, info = self._cursor_of(info)
        self.restored = info
        self._event("restored from checkpoint", target.version, info.describe() + (f" ({why})" if why else ""))
        self.source.ack(target, True, f"restored from step {info.step}",
                        RestoreNote(info.step, info.path.name, why or "", tuple(f"{n}: {w}" for n, w in info.skipped)))

