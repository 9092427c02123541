"""Saving: what `save` takes at once (manifest, RNG, buffers, the attempt's name), the background
copy of the rank's pieces (the snapshot) that `optimizer.step()` and `fence()` wait for, the
writer thread's DCP write of the rank's part, hashed, with its durable marker; and the
coordinator's completion: wait for every rank's marker, merge the ranks' DCP metadata, write the
manifest, rename the attempt into place (a checkpoint is complete if and only if its
`step-<step>` name exists), apply the retention policy."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ntp_manager.contract.checkpoint_format import FORMAT, MANIFEST, step_dir_name
from ntp_manager.worker import comm
from ntp_manager.worker.checkpoint.base import (
    _TMP_PREFIX,
    DATA_STATE_MAX_BYTES,
    CheckpointError,
    SaveHandle,
    _CheckpointerBase,
    log,
)
from ntp_manager.worker.checkpoint.files import _canonical, _fsync_dir, _remove, _rng_state, _sha256, _write_durable
from ntp_manager.worker.checkpoint.policy import retention_plan, stretches, write_ranges
from ntp_manager.worker.checkpoint.tensors import (
    _check_tiling,
    _Chunk,
    _entries,
    _Entry,
    _merge_metadata,
    _part_key,
    _PieceSavePlanner,
)
from ntp_manager.worker.optim import group_values, scheduler_json
from ntp_manager.worker.sync import SyncLayout
from ntp_manager.worker.tp import unit_slice


@dataclass
class _Attempt:
    step: int
    tmp: Path
    rank: int
    ranks: tuple[int, ...]  # every rank that leaves a marker
    coordinator: bool
    doc: dict[str, Any]  # the manifest, less files and hashes (coordinator only)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    chunks: dict[str, _Chunk] = field(default_factory=dict)


class _Saving(_CheckpointerBase):
    """A rank's part of a save (snapshot, write, marker) and the coordinator's completion."""

    def _hook(self, stage: str, att: _Attempt) -> None:
        if self.test_hook is not None:
            self.test_hook(stage, att)

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer | None, layout: SyncLayout,
             rank: int, families: Mapping[str, str], *, group: Any = None, data_state: Mapping[str, Any] | None = None,
             job_ranks: Sequence[int] | None = None, attempt: str | None = None,
             background: bool = True, scheduler: Any = None) -> SaveHandle:
        """Start saving the state after `step` committed steps; returns at once, while the writer
        thread copies this rank's pieces (the snapshot, into host memory reused across saves) and
        writes them. Every rank of the layout calls it at the same step.

        `background` (default): the copy of the parameters and optimizer state runs on the writer
        thread, overlapping the next step's forward and backward, which only read them. Until it
        is done (`handle.snapshotted`) nothing may change them: `optimizer.step()` waits for it by
        itself (a pre-step hook this call registers, removed once the copy is done), and anything
        else that changes them in place must call `fence()` first (the Runtime does, before a
        reshard or restore). Persistent buffers (a forward pass may update them) are copied here.
        `background=False`: everything is copied before the call returns.
 `group`: a process group over those ranks, for the attempt's name (one
        broadcast); without one (a single process) the name is drawn here. `data_state`: a JSON
        document of where the data loader is (the coordinator's is stored; it should describe the
        global position). `job_ranks`: every rank that saves (all stages; default: the layout's).
        `attempt`: the attempt's name, when the caller agrees on one itself (instead of `group`;
        it must differ between attempts, e.g. a random string every rank received). `scheduler`:
        the optimizer's LR scheduler, whose state is stored (with every parameter group's values,
        which are stored always).
        Raises ValueError, naming the problem, for state it cannot store."""
        if self._last is not None:  # one snapshot in memory at a time: wait for this rank's last write
            with contextlib.suppress(Exception):  # a failure was logged by the writer; this save starts afresh
                self._last.written.result()
        t0 = time.perf_counter()
        entries = _entries(model, optimizer, layout.units, families)
        doc = self._manifest_doc(step, entries, optimizer, layout, families, data_state)
        if optimizer is not None:  # the values, not the counts: a pipeline stage's groups hold its part
            doc["optimizer_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in group_values(optimizer)]
            doc["scheduler"] = scheduler_json(scheduler)
            # each pipeline stage's own values too (its groups and schedule may differ from the
            # coordinator's stage): the markers carry them to the manifest, keyed by the stage's part
            doc["optimizer_parts"] = {_part_key(model): {"groups": doc["optimizer_groups"],
                                                         "scheduler": doc["scheduler"]}}
        nonce = [attempt or uuid.uuid4().hex[:16]]
        if attempt is None and group is not None:
            comm.broadcast_object_list(nonce, src=dist.get_global_rank(group, 0), group=group)
        if not re.fullmatch(r"[A-Za-z0-9_.]{1,64}", nonce[0]):
            raise ValueError(f"attempt must be 1-64 letters, digits, '_' or '.', not {nonce[0]!r}")
        ranks = tuple(sorted(job_ranks if job_ranks is not None else (r for rep in layout.replicas for r in rep.ranks)))
        att = _Attempt(step, self.root / f"{_TMP_PREFIX}{step:012d}-{nonce[0]}", rank, ranks, rank == ranks[0], doc)
        views, now = self._pieces(att, entries, layout, rank)
        wanted = {n for n, _ in views + now}  # the last write is done: its host copies are free
        self._buffers = {n: b for n, b in self._buffers.items() if n in wanted}
        snapshotted: Future[float] = Future()
        if background:
            self._copy(att, now, None)  # buffers (a forward pass may change them): here, they are small
            ready = _after_current_stream(views)
            written = self._writer.submit(self._snapshot_then_write, att, views, ready, snapshotted)
            if optimizer is not None:
                self._fence_step(optimizer, snapshotted)
        else:
            self._copy(att, now + views, snapshotted)
            written = self._writer.submit(self._write, att)
        handle = SaveHandle(step, att.tmp.name, written, snapshot_s=time.perf_counter() - t0,
                            pieces=len(views) + len(now), snapshotted=snapshotted)
        if att.coordinator:
            done: Future[Path] = Future()
            with self._lock:
                self._pending[att.tmp.name] = done
            threading.Thread(target=self._complete, args=(att, done, written), name="ntp-ckpt-complete",
                             daemon=True).start()
            handle.completed = done
        self._last = handle
        return handle

    def _manifest_doc(self, step: int, entries: list[_Entry], optimizer: torch.optim.Optimizer | None,
                      layout: SyncLayout, families: Mapping[str, str],
                      data_state: Mapping[str, Any] | None) -> dict[str, Any]:
        if data_state is not None:
            try:
                blob = json.dumps(dict(data_state), allow_nan=False)
            except (TypeError, ValueError) as e:
                raise ValueError(f"data_state must be a JSON document (dict of str, numbers, lists): {e}") from None
            if len(blob) > DATA_STATE_MAX_BYTES:
                raise ValueError(f"data_state is {len(blob)} bytes as JSON; the limit is {DATA_STATE_MAX_BYTES}")
        tensors = {}
        for ent in entries:
            sh = ent.shard
            dtype = str(ent.tensor.dtype).removeprefix("torch.")
            tensors[ent.key] = {"shape": list(ent.global_shape()), "dtype": dtype,
                                **({"family": sh.family, "unit_size": sh.unit_size} if sh else {})}
        return {
            "format": FORMAT, "step": step,
            "layout": {"replicas": [{"ranks": list(r.ranks), "local_batch": r.local_batch} for r in layout.replicas],
                       "units": dict(layout.units)},
            "families": dict(families),
            "optimizer": type(optimizer).__name__ if optimizer is not None else None,
            "tensors": tensors,
            "data_state": None if data_state is None else dict(data_state),
            "rng": _rng_state(),
        }

    def _pieces(self, att: _Attempt, entries: list[_Entry], layout: SyncLayout,
                rank: int) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
        """The live tensors (views) this rank writes: (parameters and optimizer state, buffers).
        Records each piece's chunk of its global tensor in `att.chunks`."""
        ranges = write_ranges(layout, rank)
        replicated_writer = rank == layout.replicas[0].ranks[0]
        views: list[tuple[str, torch.Tensor]] = []
        bufs: list[tuple[str, torch.Tensor]] = []
        # stretches per distinct unit list (by identity: `_shards` makes equal lists one tuple), as a
        # parameter's optimizer state and the layers' shards of a family share them
        runs: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
        for e in entries:
            sh = e.shard
            if sh is None:
                if replicated_writer:
                    (bufs if e.key.startswith("buffer/") else views).append((e.key, e.tensor))
                continue
            lo, hi = ranges[sh.family]
            us = sh.unit_size
            size = e.global_shape()
            key = (id(sh.units), lo, hi)  # `entries` keeps every tuple alive meanwhile
            if key not in runs:
                runs[key] = stretches(sh.units, lo, hi)
            for u, pos, n in runs[key]:
                name = f"{e.key}#{u}"
                views.append((name, unit_slice(e.tensor, sh.udim, pos * us, n * us)))
                att.chunks[name] = _Chunk(e.key, (u * us,) + (0,) * (len(size) - 1), size)
        return views, bufs

    def _copy(self, att: _Attempt, views: list[tuple[str, torch.Tensor]], done: Future[float] | None,
              stream: Any = None) -> None:
        """Copy `views` into host memory (pinned on a GPU; reused across saves when shapes match)
        and put the copies in `att.state`; sets `done` to the seconds it took."""
        t0 = time.perf_counter()
        pin = torch.cuda.is_available()
        cuda = False
        with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
            for name, v in views:
                buf = self._buffers.get(name)
                if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                    buf = torch.empty(v.shape, dtype=v.dtype, device="cpu", pin_memory=pin and v.is_cuda)
                    self._buffers[name] = buf
                buf.copy_(v, non_blocking=v.is_cuda)
                cuda |= v.is_cuda
                att.state[name] = buf
        if cuda:
            if stream is not None:
                stream.synchronize()
            else:
                torch.cuda.synchronize()
        if done is not None:
            done.set_result(time.perf_counter() - t0)

    def _snapshot_then_write(self, att: _Attempt, views: list[tuple[str, torch.Tensor]], ready: Any,
                             done: Future[float]) -> int:
        """The writer thread: the background copy (released to the caller as soon as it is done),
        then the write."""
        try:
            self._hook("snapshot", att)
            stream = None
            if ready is not None:  # a GPU: copy on a side stream, after what the caller queued before save()
                event, device = ready
                stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
                stream.wait_event(event)
            self._copy(att, views, done, stream)
        except BaseException as e:
            if not done.done():
                done.set_exception(e)
            msg = f"step {att.step}: rank {att.rank} could not copy its part: {type(e).__name__}: {e}"
            log.error("checkpoint snapshot failed", step=att.step, rank=att.rank, error=str(e))
            self.failures.append(msg)
            raise
        return self._write(att)

    def _fence_step(self, optimizer: torch.optim.Optimizer, snapshotted: Future[float]) -> None:
        """Make `optimizer.step()` wait until the background copy is done. The hook stays until
        the next save or fence (removing it from inside the step would change the optimizer's
        hook table while the step goes through it); once the copy is done it costs a check."""
        self._unhook()

        def wait(*_: Any) -> None:
            if not snapshotted.done():
                with contextlib.suppress(Exception):  # a failed copy was logged; the step goes on
                    snapshotted.result()

        self._step_hook = optimizer.register_step_pre_hook(wait)

    def _unhook(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def fence(self, timeout: float | None = None) -> None:
        """Wait until the last save's background copy is done: call before changing the model's
        parameters or the optimizer's state other than by `optimizer.step()` (which waits by
        itself). A failed copy does not raise here (the writer logged it in `failures`)."""
        if self._last is not None:
            with contextlib.suppress(Exception):
                self._last.snapshotted.result(timeout)
            if self._last.snapshotted.done():
                self._unhook()

    def _write(self, att: _Attempt) -> int:
        """The writer thread: this rank's DCP files, durable, hashed, and its marker."""
        try:
            rdir = att.tmp / f"r{att.rank}"
            rdir.mkdir(parents=True, exist_ok=False)
            _fsync_dir(att.tmp)
            self._hook("writing", att)
            writer = FileSystemWriter(rdir, single_file_per_rank=True, sync_files=True, overwrite=False)
            planner = _PieceSavePlanner(att.chunks)
            if self.test_hook is not None:  # tests: stop in the middle of the data
                inner = planner.resolve_data

                def resolve(item: WriteItem) -> Any:
                    self._hook("item", att)
                    return inner(item)

                planner.resolve_data = resolve  # type: ignore[method-assign,assignment]
            dcp_save(att.state, storage_writer=writer, planner=planner, no_dist=True)
            _fsync_dir(rdir)
            files: dict[str, dict[str, Any]] = {
                f"r{att.rank}/{p.name}": {"sha256": _sha256(p), "bytes": p.stat().st_size}
                for p in sorted(rdir.iterdir()) if p.is_file()}
            self._hook("written", att)
            # the rank's tensors too: in a pipeline every stage holds others, and the manifest lists them all
            _write_durable(att.tmp / f"done.r{att.rank}.json", _canonical(
                {"rank": att.rank, "files": files, "tensors": att.doc["tensors"], "families": att.doc["families"],
                 "optimizer_parts": att.doc.get("optimizer_parts", {})}))
            att.state = {}  # the snapshot buffers stay in self._buffers for the next save
            return sum(f["bytes"] for f in files.values())
        except Exception as e:
            msg = f"step {att.step}: rank {att.rank} could not write its part: {type(e).__name__}: {e}"
            log.error("checkpoint write failed", step=att.step, rank=att.rank, error=str(e))
            self.failures.append(msg)
            raise


    def _complete(self, att: _Attempt, done: Future[Path], own: Future[int]) -> None:
        """The coordinator: wait for its own part (copy and write: it fails or ends), then up to
        `complete_timeout_s` for every other rank's marker; then merge, manifest, rename, retention."""
        try:
            own.result()  # raises when this rank's part failed: the attempt cannot complete
            deadline = time.monotonic() + self.complete_timeout_s
            markers = {r: att.tmp / f"done.r{r}.json" for r in att.ranks}
            delay = 0.01
            while True:
                missing = [r for r, p in markers.items() if not p.is_file()]
                if not missing:
                    break
                if time.monotonic() > deadline:
                    raise CheckpointError(f"ranks {missing} did not finish their part within "
                                          f"{self.complete_timeout_s:.0f} s")
                time.sleep(delay)
                delay = min(delay * 2, 0.25)
            files: dict[str, dict[str, Any]] = {}
            tensors: dict[str, Any] = dict(att.doc["tensors"])
            families: dict[str, str] = dict(att.doc["families"])
            parts: dict[str, Any] = dict(att.doc.get("optimizer_parts", {}))
            for r, p in markers.items():
                mark = json.loads(p.read_bytes())
                files.update(mark["files"])
                for key, values in mark.get("optimizer_parts", {}).items():  # every stage's optimizer values
                    parts.setdefault(key, values)
                for key, meta in mark.get("tensors", {}).items():  # every stage's tensors
                    if tensors.setdefault(key, meta) != meta:
                        raise CheckpointError(f"rank {r} saved {key} as {meta}, another rank as {tensors[key]}")
                families.update(mark.get("families", {}))
            merged = _merge_metadata({r: FileSystemReader(att.tmp / f"r{r}").read_metadata() for r in att.ranks})
            _check_tiling(merged)
            _write_durable(att.tmp / ".metadata", pickle.dumps(merged))
            meta = att.tmp / ".metadata"
            files[".metadata"] = {"sha256": _sha256(meta), "bytes": meta.stat().st_size}
            doc = dict(att.doc, files=files, bytes=sum(int(f["bytes"]) for f in files.values()),
                       completed_at=time.time(), tensors=dict(sorted(tensors.items())),
                       families=dict(sorted(families.items())))
            if parts:
                doc["optimizer_parts"] = dict(sorted(parts.items()))
            doc["manifest_sha256"] = hashlib.sha256(_canonical(doc)).hexdigest()
            _write_durable(att.tmp / MANIFEST, json.dumps(doc, indent=1, sort_keys=True).encode())
            self._hook("manifest", att)
            final = self.root / step_dir_name(att.step)
            if final.exists():  # an earlier timeline reached this step too: this one replaces it
                aside = self.root / f".replaced-{final.name}-{uuid.uuid4().hex[:8]}"
                os.replace(final, aside)
                shutil.rmtree(aside, ignore_errors=True)
            os.replace(att.tmp, final)
            _fsync_dir(self.root)
            log.info("checkpoint complete", step=att.step, path=str(final), bytes=doc["bytes"])
            try:
                self._retain(att.step)
            except OSError as e:  # the checkpoint is complete all the same
                log.warning("retention failed", step=att.step, error=str(e))
            done.set_result(final)
        except Exception as e:
            msg = f"step {att.step}: checkpoint not completed (it will never be loaded): {type(e).__name__}: {e}"
            log.warning("checkpoint incomplete", step=att.step, error=str(e))
            self.failures.append(msg)
            if not done.done():
                done.set_exception(e)
        finally:
            with self._lock:
                self._pending.pop(att.tmp.name, None)

    def _retain(self, completed_step: int) -> None:
        refs = {r.step: r.path for r in self.complete()}
        decision = retention_plan(refs, self.retention, self._bad & set(refs))
        for s in decision.delete:
            log.info("checkpoint removed", step=s, reason=decision.reasons[s])
            _remove(refs[s])
        with self._lock:
            pending = set(self._pending)
        for p in self.root.iterdir():  # attempts of earlier steps that never completed
            if p.name.startswith(_TMP_PREFIX) and p.name not in pending:
                try:
                    step = int(p.name[len(_TMP_PREFIX):].split("-")[0])
                except ValueError:
                    continue
                if step <= completed_step:
                    _remove(p)

    def wait(self, timeout: float | None = None) -> list[str]:
        """Wait for this rank's writes and (coordinator) completions; returns the failures so far."""
        if self._last is not None:
            with contextlib.suppress(Exception):
                self._last.written.result(timeout)
        with self._lock:
            pending = list(self._pending.values())
        for f in pending:
            with contextlib.suppress(Exception):
                f.result(timeout)
        return list(self.failures)

    def close(self, timeout: float | None = None) -> None:
        self.wait(timeout)
        self._writer.shutdown(wait=True)


def _after_current_stream(views: Sequence[tuple[str, torch.Tensor]]) -> Any:
    """(a CUDA event recorded on the current stream, its device) when some view is on a GPU (the
    background copy starts after the work queued so far: the optimizer step that made these
    values), else None."""
    dev = next((v.device for _, v in views if v.is_cuda), None)
    if dev is None:
        return None
    ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ev.record(torch.cuda.current_stream(dev))
    return ev, dev
