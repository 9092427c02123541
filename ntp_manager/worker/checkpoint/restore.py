"""Loading: the newest complete checkpoint that verifies (its manifest's own hash, every file's
hash, shared among the group's ranks, who agree on the outcome), read through DCP into whatever
layout loads it; a checkpoint that fails is skipped with the reason, one of another model refused."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ntp_manager.contract.checkpoint_format import MANIFEST, manifest_problem
from ntp_manager.worker import comm
from ntp_manager.worker.checkpoint.base import (
    CheckpointError,
    CheckpointRef,
    NoCheckpoint,
    RestoreInfo,
    _CheckpointerBase,
    log,
)
from ntp_manager.worker.checkpoint.files import _set_rng_state, _sha256
from ntp_manager.worker.checkpoint.policy import stretches
from ntp_manager.worker.checkpoint.tensors import _entries, _match_optimizer_state, _part_key, _PieceLoadPlanner
from ntp_manager.worker.optim import (
    OptimizerError,
    check_group_values,
    check_scheduler_state,
    load_scheduler,
    set_group_values,
)
from ntp_manager.worker.sync import SyncLayout
from ntp_manager.worker.tp import unit_slice


class _Restoring(_CheckpointerBase):
    """Verify and load."""

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, layout: SyncLayout, rank: int,
             families: Mapping[str, str], *, group: Any = None, strict: bool = True,
             restore_rng: bool = True, max_step: int | None = None, scheduler: Any = None) -> RestoreInfo:
        """Fill `model` (sharded for `rank` of `layout`) and `optimizer` (fresh or not: its state
        is made to match the checkpoint's) from the newest complete checkpoint that verifies.
        Every rank of `group` calls it; they agree on the checkpoint. `strict`: every tensor the
        checkpoint holds must be in the model too (a pipeline stage's model holds a part: False).
        `max_step`: only checkpoints of this step or older (the manager's `Layout.restore_step`).
        The optimizer's parameter groups get the stored values (learning rate...) and `scheduler`
        the stored state (checkpoints from before these were stored leave both as they are).
        Raises CheckpointError when no checkpoint verifies, or when one does not fit the model."""
        t0 = time.perf_counter()
        refs = self.complete()
        if group is not None:
            box: list[Any] = [refs]
            comm.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
            refs = box[0]
        if max_step is not None and refs:
            newer = [r.step for r in refs if r.step > max_step]
            if newer:
                log.info("checkpoints newer than the layout's restore step passed over", restore_step=max_step,
                         steps=newer)
            refs = [r for r in refs if r.step <= max_step]
            if not refs:
                raise CheckpointError(f"no complete checkpoint at or before step {max_step} (the layout's "
                                      f"restore step) in {self.root}; newer: {newer}")
        if not refs:
            raise NoCheckpoint(f"no complete checkpoint in {self.root}")
        skipped: list[tuple[str, str]] = []
        for ref in refs:
            why = self._verify(ref, group)
            if why is None:
                doc = json.loads((ref.path / MANIFEST).read_bytes())
                values = _stored_values(doc, model) if optimizer is not None else None
                # checked on every rank before anything is read into the model: all refuse together,
                # and none is left with the checkpoint's tensors but its own groups and schedule
                problem = None
                if optimizer is not None and values is not None:
                    try:
                        if values[0] is not None:
                            check_group_values(optimizer, values[0], "the checkpoint")
                        if values[1]:
                            check_scheduler_state(scheduler, values[2], "the checkpoint")
                    except OptimizerError as e:
                        problem = str(e)
                problem = _agree(problem, group)
                if problem is not None:
                    raise CheckpointError(problem)
                targets = self._targets(doc, model, optimizer, layout, rank, families, strict)
                why, nbytes = self._read(ref, targets, group)
                if why is None:
                    if optimizer is not None and values is not None:
                        if values[0] is not None:
                            set_group_values(optimizer, values[0], "the checkpoint")
                        if values[1]:
                            load_scheduler(scheduler, values[2], "the checkpoint")
                    if restore_rng:
                        _set_rng_state(doc["rng"])
                    info = RestoreInfo(ref.step, ref.path, doc["data_state"], doc["layout"], tuple(skipped), nbytes,
                                       time.perf_counter() - t0)
                    log.info("checkpoint restored", step=ref.step, path=str(ref.path), skipped=len(skipped))
                    return info
            skipped.append((ref.path.name, why))
            self._bad.add(ref.step)
            log.warning("checkpoint skipped", path=str(ref.path), reason=why)
        tried = "; ".join(f"{n}: {w}" for n, w in skipped)
        raise CheckpointError(f"no usable checkpoint in {self.root} ({tried})")

    def _verify(self, ref: CheckpointRef, group: Any) -> str | None:
        """Why `ref` cannot be trusted (the manifest, then the files' hashes; the group's ranks
        share the files and agree), or None."""
        why: str | None = None
        try:
            doc = json.loads((ref.path / MANIFEST).read_bytes())
            why = manifest_problem(doc, ref.step)  # its own hash, format and step
        except (OSError, ValueError, AttributeError) as e:
            why = f"manifest.json unreadable: {type(e).__name__}: {e}"
        if why is None:
            me, n = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
            for i, (rel, f) in enumerate(sorted(doc["files"].items())):
                if i % n != me:
                    continue
                p = ref.path / rel
                try:
                    size = p.stat().st_size
                    if size != f["bytes"]:
                        why = f"{rel}: {size} bytes, the manifest says {f['bytes']}"
                    elif (got := _sha256(p)) != f["sha256"]:
                        why = f"{rel}: sha256 {got[:12]}... differs from the manifest's {f['sha256'][:12]}..."
                except OSError as e:
                    why = f"{rel}: {type(e).__name__}: {e.strerror or e}"
                if why is not None:
                    break
        return _agree(why, group)

    def _targets(self, doc: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 layout: SyncLayout, rank: int, families: Mapping[str, str],
                 strict: bool) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
        """The chunks this rank reads, into its live tensors; optimizer state is created (zeros,
        as a first step would) or dropped to match the checkpoint. Raises CheckpointError, naming
        the first few differences, when the checkpoint is of a different model."""
        saved: dict[str, Any] = doc["tensors"]
        if optimizer is not None:
            _match_optimizer_state(model, optimizer, saved)
        entries = _entries(model, optimizer, layout.units, families)
        problems = []
        for e in entries:
            s = saved.get(e.key)
            if s is None:
                problems.append(f"{e.key} is not in the checkpoint")
                continue
            want = {"shape": list(e.global_shape()), "family": e.shard.family if e.shard else None,
                    "unit_size": e.shard.unit_size if e.shard else None}
            got = {"shape": s["shape"], "family": s.get("family"), "unit_size": s.get("unit_size")}
            if want != got:
                problems.append(f"{e.key}: the checkpoint has {got}, the model {want}")
        if strict:
            mine = {e.key for e in entries}
            problems += [f"{k} is in the checkpoint but not in the model" for k in sorted(saved) if k not in mine]
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise CheckpointError(f"the checkpoint does not fit this model: {'; '.join(problems[:5])}{more}")
        targets: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        for e in entries:
            sh = e.shard
            if sh is None:
                targets[e.key] = [((0,) * e.tensor.dim(), e.tensor)]
                continue
            us, nd = sh.unit_size, len(e.global_shape())
            targets[e.key] = [((u * us,) + (0,) * (nd - 1), unit_slice(e.tensor, sh.udim, pos * us, n * us))
                              for u, pos, n in stretches(sh.units)]
        return targets

    def _read(self, ref: CheckpointRef, targets: Mapping[str, list[tuple[tuple[int, ...], torch.Tensor]]],
              group: Any) -> tuple[str | None, int]:
        why: str | None = None
        nbytes = 0
        try:
            with torch.no_grad():
                dcp_load({}, storage_reader=FileSystemReader(ref.path), planner=_PieceLoadPlanner(targets),
                         no_dist=True)
            nbytes = sum(dst.numel() * dst.element_size() for chunks in targets.values() for _, dst in chunks)
        except Exception as e:  # an unreadable file after a good hash: still the data's fault
            why = f"reading failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return _agree(why, group), nbytes



def _stored_values(doc: Mapping[str, Any], model: nn.Module) -> tuple[list[dict[str, Any]] | None, bool, Any]:
    """What the checkpoint holds for this rank's part (pipeline stage) besides tensors: the groups'
    values (None: a checkpoint from before they were stored), whether it stored a scheduler entry,
    and that entry (a state, or None for "no scheduler"). A checkpoint without parts per stage
    gives the coordinator's."""
    mine = doc.get("optimizer_parts", {}).get(_part_key(model))
    if mine is not None:
        return mine["groups"], True, mine["scheduler"]
    return doc.get("optimizer_groups"), "scheduler" in doc, doc.get("scheduler")


def _agree(why: str | None, group: Any) -> str | None:
    """Every rank of `group` learns every rank's finding; the first one (by rank) is the reason."""
    if group is None:
        return why
    every: list[Any] = [None] * dist.get_world_size(group)
    comm.all_gather_object(every, why, group=group)
    return next((w for w in every if w is not None), None)
