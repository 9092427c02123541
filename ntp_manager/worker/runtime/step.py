"""One training step and its commit (see the package doc): forward and backward (one pass, micro-
batches, or a pipeline stage's schedule, 1F1B or GPipe; on bf16 copies of the parameters under
precision "bf16"), the NTP gradient sync, the commit all-gather
that decides the step on every rank, the optimizer update; and the roll-forward, by which a rank
whose commit failed completes a step that other survivors committed."""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.utils import clip_grads_with_norm_

from ntp_manager.worker import comm
from ntp_manager.worker import tp as tp_mod
from ntp_manager.worker.pipeline import StageLinks, micro_batches, run_stage
from ntp_manager.worker.precision import compute_copies, compute_dtype
from ntp_manager.worker.runtime.base import _RuntimeBase, log
from ntp_manager.worker.runtime.config import StepResult
from ntp_manager.worker.sources import StepWork, WorkerLayout
from ntp_manager.worker.sync import global_norm


class _Stepping(_RuntimeBase):
    """A step under the current layout: `_try_step` raises a communication failure before the
    optimizer moved, or returns the committed step and the newest version any rank has seen."""

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
        cursor = self.samples  # the committed cursor: a redo after a failure takes the same one
        self._save_rng()
        self._watch.arm(self._failed_key(lay))  # from here to the sync, a peer's failure abandons the step
        self.s.sync.zero_grad()  # in place: the gradients stay views of the sync buffers
        t_fb = time.perf_counter()
        tp_mod.TP_WAIT.seconds = 0.0
        with compute_copies(self.s.model, compute_dtype(self.cfg.precision)):  # bf16: the step's copies
            value, lengths = self._forward_backward(batch_fn, loss_fn, lay, start, lb)
        t_fb = time.perf_counter() - t_fb  # real compute only where the host waits for it (CPU)
        tp_wait = tp_mod.TP_WAIT.seconds  # blocked in the TP group's all-reduces (CPU tensors only)
        self._sync_grads()
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
        self._watch.disarm()
        self._uncommitted = StepResult(self.step, math.nan, lay.global_batch, lb, lay.version, tp, t0, stage,
                                       cursor=cursor, first_sample=cursor + start)
        self._commit_gather(every, mine)  # the commit point
        self._uncommitted = None
        self._attempt_nonce = int(every[0][2].item())
        self._rng = None  # committed: the RNG goes on from here
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
        self.samples = cursor + lay.global_batch
        gloss = float(stacked[:, 0].sum().item()) / lay.global_batch
        self._last_commit = (self.step, gloss, grad_norm)
        agreed = int(stacked[:, 1].max().item())
        secs = time.perf_counter() - t0
        if self.s.timeline and self.s.timeline[-1].what in ("reshard done", "joined", "restored from checkpoint"):
            self._event("first step", lay.version, f"tp={tp} local_batch={lb} stage={stage}")
        on_cpu = self.choice.device == "cpu"
        self.source.report_step(lay, step, secs, lb, StepWork(
            max(0.0, t_fb - tp_wait) if on_cpu else 0.0, tp_wait if on_cpu else 0.0, sequence_lengths=lengths))
        return StepResult(step, gloss, lay.global_batch, lb, lay.version, tp, secs, stage, grad_norm, skipped,
                          cursor, cursor + start), agreed

    def _sync_grads(self) -> None:
        """The NTP gradient sync of the step (a method of its own so that tests can fail it)."""
        assert self.s.sync is not None
        self._check_abort("before the gradient sync")
        self.s.sync.sync()

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
        loss, norm, _, has_norm = info[ahead[0]][4:8]
        grad_norm = norm if has_norm == 1.0 else None
        me = self._uncommitted
        if self.step == lo and me is not None and me.step == lo:
            assert self.s.layout is not None
            skipped = self._update(grad_norm)
            self.step = hi
            self.samples = me.cursor + me.global_batch
            self._last_commit = (hi, loss, grad_norm)
            self._rolled = StepResult(lo, loss, me.global_batch, me.local_batch, me.version, me.tp,
                                      time.perf_counter() - me.seconds, me.stage, grad_norm, skipped,
                                      me.cursor, me.first_sample)
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
            if off > 0:
                self._check_abort("between micro-batches")
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
