"""Checkpoints addressed by unit, not by rank: any layout saves them, any layout loads them.

    ckpt = Checkpointer("/shared/ckpt/llm", Retention(keep_last=3, keep_every=1000))
    ckpt.save(step, model, optimizer, layout, rank, families, group=world, data_state={...})
    ...                 # training goes on while the shards are copied (optimizer.step() waits for
                        # the copy) and written
    info = ckpt.load(model, optimizer, new_layout, rank, families, group=world)

**What is stored.** Every sharded tensor (weights, column-wise biases, and their optimizer state:
SGD momentum, Adam/AdamW moments) as one global tensor in torch.distributed.checkpoint (DCP)
format, *units first*: the unsharded tensor with its unit dimension moved to the front (the
transpose of a row-wise weight), so unit u's features are rows [u x unit_size, (u+1) x
unit_size) whatever the layout. Replicated parameters, persistent buffers, the optimizer's step
counts, and, in the manifest, the RNG state, an opaque data-loader position and the layout the
checkpoint was taken under. A rank's unit set need not be contiguous (an NTP extra rank holds
several stretches), and DCP's own sharded types cannot say that (a DTensor shard is one
contiguous block per rank); DCP's chunk metadata can: every stretch of consecutive units is one
DCP chunk (offsets, sizes) of the global tensor, written and read through our own planners
(`_PieceSavePlanner`, `_PieceLoadPlanner`). Loading asks DCP for the chunks of the loading rank's
units; DCP's resharding reads the overlapping parts of whatever chunks were saved. Stage splits
change nothing: tensors are keyed by their module path in the whole model.

**Who writes what** (`write_ranges`, pure): every replica holds every unit, so each unit is
written once: a family's units are cut into one contiguous range per replica, and the rank of
replica r that holds a unit of range r writes it. Replicated tensors: the stage's first rank.

**Asynchronous, without collectives in the background.** `save` takes what must be taken at
once (the manifest's contents, the RNG state, the persistent buffers, the attempt's name) and
returns; the writer thread copies the rank's pieces (the snapshot, into host memory reused across
saves; on a GPU pinned, on a side stream) while the next step's forward and backward run -- they
only read parameters and optimizer state -- and `optimizer.step()` waits for the copy through a
one-shot pre-step hook (`fence()` for anything else that changes them). Then it saves them with DCP
(`dcp_save(no_dist=True)` into `r<rank>/` of the checkpoint's temporary directory: the rank's
own DCP checkpoint, with DCP's fsync of every file), fsyncs the directory, hashes the files
(SHA-256) and leaves a durable marker `done.r<rank>.json` (its files and its tensors: in a
pipeline each stage's ranks hold other tensors, and the manifest lists the union). The
coordinator (the layout's rank 0)
waits for every rank's marker, merges the ranks' DCP metadata into one global `.metadata` (and
checks that every tensor's chunks tile it exactly), writes `manifest.json` (every file's hash and
size, the step, layout, tensors, data position, RNG; and a hash of the manifest itself), fsyncs,
and renames the directory to `step-<step>`: a checkpoint is complete if and only if that name
exists. No thread ever waits on a peer's collective, so a failed peer cannot hang the writers: its
marker never appears, the coordinator gives up after `complete_timeout_s`, and the temporary
directory is never loaded (it is removed by a later completion). The only collective is one small
broadcast in `save` (the attempt's random name, so that nothing left by an earlier run with the
same step can be mistaken for this attempt's files), on the caller's thread.

**Loading** takes the newest complete checkpoint that verifies: its manifest's own hash, then every
file's hash (the group's ranks split the files and agree on the outcome), then the DCP read; a
checkpoint that fails any of these is skipped with the reason logged and returned
(`RestoreInfo.skipped`), and the next older one is tried. A checkpoint of a different model (a
tensor missing or shaped differently) is refused with a `CheckpointError`, not skipped: an older
one would not fit either.

**Retention** (`retention_plan`, pure): keep the newest `keep_last` good checkpoints and every one
whose step is a multiple of `keep_every`; applied by the coordinator after each completion.

The parts, one module each: policy.py (the pure decisions), tensors.py (entries and the DCP
planners), files.py (durable files, hashes, RNG), save.py (a rank's snapshot and write, the
coordinator's completion and retention), restore.py (verify and load); base.py holds
the errors and results they share.
"""

from __future__ import annotations

from ntp_manager.contract.checkpoint_format import MANIFEST, step_dir_name
from ntp_manager.worker.checkpoint.base import (
    DATA_STATE_MAX_BYTES,
    CheckpointError,
    CheckpointRef,
    NoCheckpoint,
    RestoreInfo,
    SaveHandle,
)
from ntp_manager.worker.checkpoint.policy import Retention, RetentionDecision, retention_plan, stretches, write_ranges
from ntp_manager.worker.checkpoint.restore import _Restoring
from ntp_manager.worker.checkpoint.save import _Saving

__all__ = ["DATA_STATE_MAX_BYTES", "MANIFEST", "CheckpointError", "CheckpointRef", "Checkpointer", "NoCheckpoint",
           "RestoreInfo", "Retention", "RetentionDecision", "SaveHandle", "retention_plan", "step_dir_name",
           "stretches", "write_ranges"]


class Checkpointer(_Saving, _Restoring):
    """Saves and loads unit-addressed checkpoints under `root` (a directory every rank sees: a
    shared filesystem when ranks run on several hosts). One per rank; `save` and `load` are
    called by every rank of the layout at the same step."""
