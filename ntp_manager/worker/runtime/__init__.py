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
versions in different orders still meet; one compare-and-set key at the prefix settles, for every
rank alike, whether the version goes ahead or is given up (comm.settle).

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
parameters and their optimizer state, the step counter and the sample cursor. The failed step is
then re-run under the new layout from the same sample cursor (a sample-addressed step takes the
next global batch of samples at the cursor: `train_step(samples=...)`, worker/data.py). A rank
still computing when another has seen the failure abandons its step at its next block, micro-batch
or sync (abort.py) instead of finishing it.

A rank that dies inside the commit all-gather itself can leave the survivors split: those whose
all-gather completed stepped the optimizer (step s committed), those whose all-gather failed did
not. Every rank had finished its gradient sync before it entered the commit, so the ones behind
hold the step's complete gradients; at the regroup they learn the commit's outcome (its loss and
gradient norm) from a rank that committed and apply that same update themselves ("rolled
forward"), and `train_step` returns that step's result. Only a split that cannot be explained so
(survivors more than one step apart, or behind without the step's gradients) needs a checkpoint:
`_restore_into` loads one, or raises `ReconfigurationError` rather than train on diverged replicas.

The parts, one module each: config.py (RuntimeConfig, StepResult, TimelineEvent, errors),
feed.py (the two ways a step reads its samples), abort.py (abandoning a doomed step),
base.py (the shared state and constructor), step.py (a step and its commit, the roll-forward),
switch.py (the failure path and the planned switch: leave, rendezvous, regroup, reshard),
joiners.py (fresh models, TP groups and syncs, optimizers, what a joiner receives, restores).
`Runtime` puts them together with the public methods.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ntp_manager.worker import comm
from ntp_manager.worker.checkpoint import RestoreInfo, SaveHandle
from ntp_manager.worker.data import with_cursor
from ntp_manager.worker.runtime.base import log
from ntp_manager.worker.runtime.config import (
    DataSourceError,
    ReconfigurationError,
    RuntimeConfig,
    StepAborted,
    StepResult,
    TimelineEvent,
    _describe,
    is_comm_failure,
)
from ntp_manager.worker.runtime.feed import Feed
from ntp_manager.worker.runtime.joiners import ensure_optimizer_state
from ntp_manager.worker.runtime.switch import _Switching

__all__ = ["DataSourceError", "ReconfigurationError", "Runtime", "RuntimeConfig", "StepResult", "TimelineEvent",
           "ensure_optimizer_state",
           "is_comm_failure"]


class Runtime(_Switching):
    """The runtime of one training process (see the module doc): the constructor is `_RuntimeBase`'s,
    a step is step.py's, a layout switch switch.py's; here are the methods a training loop calls."""

    def start(self, timeout: float | None = None) -> None:
        """Wait for a layout that includes this worker and join it (as a fresh rank): up to
        `timeout`, else `cfg.standby_timeout_s` (None: as long as it takes)."""
        self._stand_by(-1, timeout if timeout is not None else self.cfg.standby_timeout_s)

    def train_step(
        self,
        batch_fn: Callable[[int, int, int], Any] | None = None,
        loss_fn: Callable[[nn.Module, Any], torch.Tensor] | None = None,
        *,
        samples: Callable[[int, int], Any] | None = None,
    ) -> StepResult:
        """One optimizer step over the next global batch of samples. Give one of:

        - `samples(start, count)` (sample-addressed): global samples [start, start+count), read at
          the runtime's sample cursor -- the step trains samples [cursor, cursor + global batch),
          each replica its contiguous share, so a global batch that shrinks or grows with the
          layout skips and repeats nothing (worker/data.py has ready sources);
        - `batch_fn(step, start, count)` (step-addressed, kept for existing scripts): samples
          [start, start+count) of step `step`'s global batch. The global order must not depend on
          the layout; when the global batch shrinks, the samples past it are never trained
          (docs/worker.md).

        `loss_fn(model, batch)` returns the mean loss over those samples. With a `Pipeline` the
        loss is the pipeline's (give no `loss_fn`): the first and last stages read the batch per
        micro-batch. Survives peer failures (see module doc); a data source that raises, or holds
        fewer samples than a global batch, raises `DataSourceError` on every rank."""
        if (self.pipeline is None) == (loss_fn is None):
            raise ValueError("give train_step a loss_fn, or the Runtime a pipeline (whose loss is used), not both")
        feed = Feed(batch_fn, samples, lambda: self.samples)
        while True:
            lay = self.s.layout
            if lay is None or lay.rank is None:  # a spare: wait until a layout includes it
                self._stand_by(lay.version if lay else -1, self.cfg.standby_timeout_s)
                continue
            failure = None
            data_error = None
            try:
                self._checkpoint_if_due()
                feed.check(lay.global_batch)
                self._prefetch(feed)  # a no-op when the last commit's prefetch holds it
                result, agreed = self._try_step(feed, loss_fn)
            except DataSourceError as e:
                data_error = e
            except Exception as e:
                if not is_comm_failure(e):
                    raise
                failure = _describe(e)
                if not isinstance(e, StepAborted):  # the first to see it: every peer's step is doomed
                    self._watch.announce(self._failed_key(lay), failure)
            self._watch.disarm()
            if data_error is not None:  # its frames may hold the step's groups: dropped (the cause keeps the source's)
                self._data_failed(lay, data_error.with_traceback(None))
            if failure is not None:  # outside the except block: no traceback keeps the old groups alive
                self._peer_data_failed(lay)
                self._recover(failure)
                rolled, self._rolled = self._rolled, None
                if rolled is not None:  # the failed step had committed elsewhere and was completed here
                    self._rng = None
                    return rolled
                self._restore_rng()  # the redo draws what the abandoned attempt drew
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
            self._prefetch(feed)  # the next step's samples, read while this rank goes on
            return result

    def sample_range(self) -> tuple[int, int]:
        """(first global sample index, count) that this rank's replica trains in the next step
        under the current layout: its contiguous share of [samples, samples + global batch), in
        replica order, as many as its local batch. (0, 0) without a place in the layout."""
        lay = self.s.layout
        if lay is None or lay.rank is None:
            return 0, 0
        ri = lay.replica_of(lay.rank)
        return self.samples + sum(b for _, b in lay.replicas[:ri]), lay.replicas[ri][1]

    def _prefetch(self, feed: Feed) -> None:
        """This replica's next samples, on ranks that read them (a pipeline's first and last stages)."""
        lay = self.s.layout
        if lay is None or lay.rank is None:
            return
        stage = lay.where(lay.rank)[1]
        if stage in (0, lay.n_stages - 1):
            feed.prefetch(*self.sample_range())

    def _data_key(self, lay: Any) -> str:
        return f"ntp/{self.cfg.job}/data-error/v{lay.epoch}.{lay.version}"

    def _data_failed(self, lay: Any, e: DataSourceError) -> None:
        """This rank's data source failed: tell the layout's other ranks through the store, then
        leave the groups (their collectives with this rank fail at once; they find the message,
        `_peer_data_failed`), and raise it."""
        log.error("data source failed", version=lay.version, step=self.step, error=str(e))
        try:
            self.store.set(self._data_key(lay), str(e))
            self._watch.announce(self._failed_key(lay), f"its data source failed: {e}")  # peers stop computing
        finally:
            self._leave_group()
        raise e

    def _peer_data_failed(self, lay: Any) -> None:
        """After a failed collective: if some rank of the layout reported a failed data source,
        raise its error here too (no new layout mends it)."""
        key = self._data_key(lay)
        try:
            reported = self.store.check([key])
        except Exception:  # a store that cannot answer: the usual failure path decides
            return
        if reported:
            self._leave_group()
            raise DataSourceError(bytes(self.store.get(key)).decode(errors="replace"))

    def close(self) -> None:
        if self.checkpointer is not None:  # this rank's writes, and (coordinator) their completion
            self.checkpointer.close(self.cfg.checkpoint_complete_timeout_s)
        comm.leave(self.choice.backend, self.features)
        self._watch.close()
        self.source.close()

    # ---- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, data_state: dict[str, Any] | None = None) -> SaveHandle:
        """Checkpoint the state after `step` committed steps (worker/checkpoint/); returns once
        this rank's shards are copied, while they are written. Every rank of the layout calls it
        between the same two steps. `data_state`: JSON describing the data position (default:
        `data_state_fn()` when set)."""
        lay, sl = self.s.layout, self.s.sync_layout
        if self.checkpointer is None:
            raise RuntimeError("no checkpoint_dir in the RuntimeConfig")
        assert lay is not None and lay.rank is not None and sl is not None, "call start() first"
        if data_state is None and self.data_state_fn is not None:
            data_state = self.data_state_fn()
        data_state = with_cursor(data_state, self.samples)
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
        self.samples, info = self._cursor_of(info)
        self.restored = info
        self._event("restored from checkpoint", lay.version, info.describe())
        return info

    def _checkpoint_if_due(self) -> None:
        n = self.cfg.checkpoint_interval
        if self.checkpointer is not None and n > 0 and self.step > 0 and self.step % n == 0 \
                and self._saved_step != self.step:
            self.save_checkpoint()
