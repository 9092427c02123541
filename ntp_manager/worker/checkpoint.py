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
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from ntp_manager.checkpoint_format import (
    FORMAT,
    MANIFEST,
    STEP_DIR,
    TMP_PREFIX,
    canonical,
    manifest_problem,
    step_dir_name,
)
from ntp_manager.planner.ntp_map import even_chunks
from ntp_manager.worker import comm
from ntp_manager.worker.optim import (
    OptimizerError,
    check_group_values,
    check_scheduler_state,
    group_values,
    load_scheduler,
    scheduler_json,
    set_group_values,
)
from ntp_manager.worker.reshard import STATE_KEYS
from ntp_manager.worker.sync import SyncLayout
from ntp_manager.worker.tp import ShardedModule, unit_slice

log = structlog.get_logger("ntp.worker.checkpoint")

_STEP_DIR, _TMP_PREFIX = STEP_DIR, TMP_PREFIX  # the names on disk: ntp_manager/checkpoint_format.py
DATA_STATE_MAX_BYTES = 1 << 20  # the data-loader position is a small JSON document
# dcp_save(no_dist=True) warns on every call that it saves "in a single process": intended here
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointError(RuntimeError):
    """No checkpoint can be used: none complete and verified, or one of a different model."""


class NoCheckpoint(CheckpointError):
    """There is no complete checkpoint at all (a new job), as opposed to none that verifies."""


# ---- pure parts ---------------------------------------------------------------------------------
def write_ranges(layout: SyncLayout, rank: int) -> dict[str, tuple[int, int]]:
    """Family -> the units [start, stop) that `rank`'s replica writes: a family's units cut into
    one contiguous range per replica (sizes differ by at most one). Within the replica exactly one
    rank holds each unit, so every unit is written once in the job."""
    ri, _ = layout.locate(rank)
    return {f: even_chunks(n, len(layout.replicas))[ri] for f, n in layout.units.items()}


def stretches(units: Sequence[int], lo: int = 0, hi: int | None = None) -> list[tuple[int, int, int]]:
    """(first unit, its position in `units`, count) of every stretch of units in [lo, hi) that
    are consecutive both as unit numbers and as positions in `units` (a shard's unit list, so a
    stretch is one contiguous slice of the shard), in unit order."""
    pairs = sorted((u, i) for i, u in enumerate(units) if u >= lo and (hi is None or u < hi))
    out: list[tuple[int, int, int]] = []
    for u, i in pairs:
        if out and out[-1][0] + out[-1][2] == u and out[-1][1] + out[-1][2] == i:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((u, i, 1))
    return out


@dataclass(frozen=True)
class Retention:
    """Keep the newest `keep_last` good checkpoints, and also every one whose step is a multiple
    of `keep_every` (0: none). Steps, not positions, so the choice does not shift as checkpoints
    are removed."""

    keep_last: int = 3
    keep_every: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(f"keep_last must be a positive integer, got {self.keep_last!r}")
        if not isinstance(self.keep_every, int) or self.keep_every < 0:
            raise ValueError(f"keep_every must be a non-negative integer, got {self.keep_every!r}")


@dataclass(frozen=True)
class RetentionDecision:
    keep: tuple[int, ...]
    delete: tuple[int, ...]
    reasons: dict[int, str]


def retention_plan(steps: Iterable[int], policy: Retention, bad: Iterable[int] = ()) -> RetentionDecision:
    """Which complete checkpoints (by step) to keep and which to delete, with a reason for each.
    `bad` ones (a load found them corrupt) do not count towards `keep_last` and are deleted
    unless `keep_every` keeps them -- a kept multiple is kept as evidence even when bad."""
    bad_set = set(bad)
    ordered = sorted(set(steps), reverse=True)
    good = [s for s in ordered if s not in bad_set]
    newest = set(good[: policy.keep_last])
    keep, delete, reasons = [], [], {}
    for s in ordered:
        if s in newest:
            keep.append(s)
            reasons[s] = f"one of the newest {policy.keep_last} good"
        elif policy.keep_every and s % policy.keep_every == 0:
            keep.append(s)
            reasons[s] = f"a multiple of keep_every={policy.keep_every}"
        else:
            delete.append(s)
            reasons[s] = "failed verification" if s in bad_set else f"older than the newest {policy.keep_last} good"
    return RetentionDecision(tuple(sorted(keep)), tuple(sorted(delete)), reasons)


# ---- what a model and optimizer hold -----------------------------------------------------------
@dataclass(frozen=True)
class _Shard:
    family: str
    unit_size: int
    udim: int  # the dimension the units run along in the rank's tensor (0 or 1)
    units: tuple[int, ...]  # the shard's units, in the tensor's order
    n_units: int  # the family's unit count


@dataclass(frozen=True)
class _Entry:
    key: str  # the DCP name: model/<param>, optim/<param>/<state>, buffer/<name>
    tensor: torch.Tensor  # the live tensor
    shard: _Shard | None  # None: replicated (every rank of the stage holds all of it)

    def global_shape(self) -> tuple[int, ...]:
        """The shape stored: the unsharded tensor, units first."""
        t, sh = self.tensor, self.shard
        if sh is None:
            return tuple(t.shape)
        rest = tuple(t.shape[1:]) if sh.udim == 0 else (int(t.shape[0]),)
        return (sh.n_units * sh.unit_size, *rest)


def _shards(model: nn.Module, units: Mapping[str, int], families: Mapping[str, str]) -> dict[int, _Shard]:
    """id(parameter) -> how it is sharded, for every sharded parameter of `model`."""
    out: dict[int, _Shard] = {}
    same: dict[tuple[int, ...], tuple[int, ...]] = {}
    for path, mod in model.named_modules():
        if not isinstance(mod, ShardedModule):
            continue
        for _name, p, udim in mod.sharded_params():
            fam = families.get(path)
            if fam is None or fam not in units:
                raise ValueError(f"{path}: a sharded module with no unit family in the layout ({fam!r})")
            if p.dim() > 2 or udim not in (0, 1) or (udim == 1 and p.dim() != 2):
                raise ValueError(f"{path}.{_name}: checkpoints store 1-D and 2-D shards (units along dim 0 or 1), "
                                 f"not shape {tuple(p.shape)} with units along dim {udim}")
            us = tuple(mod.units)
            us = same.setdefault(us, us)  # one tuple per distinct unit list: `_pieces` caches by identity
            out.setdefault(id(p), _Shard(fam, mod.unit_size, udim, us, units[fam]))
    return out


def _part_key(model: nn.Module) -> str:
    """Which part of the model a rank holds, the same on every rank of a pipeline stage and across
    TP layouts: its first parameter's name (stages hold disjoint parameters under the whole model's
    names)."""
    return next((n for n, _ in model.named_parameters()), "")


def _scalar(v: Any) -> torch.Tensor:
    return v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v))


def _entries(model: nn.Module, optimizer: torch.optim.Optimizer | None, units: Mapping[str, int],
             families: Mapping[str, str]) -> list[_Entry]:
    """Every tensor a checkpoint holds for this rank, in a fixed order. Raises ValueError for
    optimizer state it cannot place (anything but SGD momentum, Adam moments and step)."""
    shards = _shards(model, units, families)
    state = optimizer.state if optimizer is not None else {}
    out: list[_Entry] = []
    for fqn, p in model.named_parameters():
        sh = shards.get(id(p))
        out.append(_Entry(f"model/{fqn}", p.detach(), sh))
        st = state.get(p, {})
        for k in sorted(st):
            v = st[k]
            if k in STATE_KEYS and isinstance(v, torch.Tensor) and v.shape == p.shape:
                out.append(_Entry(f"optim/{fqn}/{k}", v, sh))
            elif k == "step":
                out.append(_Entry(f"optim/{fqn}/step", _scalar(v), None))
            else:
                raise ValueError(f"optimizer state {k!r} of {fqn} ({type(optimizer).__name__}): checkpoints store "
                                 f"{', '.join(STATE_KEYS)} and step")
    seen: set[int] = set()
    for path, mod in model.named_modules():
        for name, b in mod._buffers.items():
            if b is None or name in mod._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out.append(_Entry(f"buffer/{path + '.' if path else ''}{name}", b.detach(), None))
    return out


# ---- DCP planners: chunks of units-first global tensors ---------------------------------------
@dataclass(frozen=True)
class _Chunk:
    key: str  # the DCP tensor it belongs to
    offsets: tuple[int, ...]
    size: tuple[int, ...]  # the global tensor's


class _PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with one change: a state-dict entry may be a chunk (given
    offsets) of a larger tensor named by `chunks[entry]`; everything else is a whole tensor."""

    def __init__(self, chunks: Mapping[str, _Chunk]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._chunks = dict(chunks)
        self._by_index: dict[tuple[str, tuple[int, ...]], str] = {}

    def create_local_plan(self) -> SavePlan:
        items = []
        for name, t in self.state_dict.items():
            c = self._chunks.get(name, _Chunk(name, (0,) * t.dim(), tuple(t.shape)))
            self._by_index[(c.key, c.offsets)] = name
            items.append(WriteItem(
                index=MetadataIndex(c.key, c.offsets),
                type=WriteItemType.SHARD if name in self._chunks else WriteItemType.TENSOR,
                tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(c.offsets), t.shape),
                                            properties=TensorProperties.create_from_tensor(t),
                                            size=torch.Size(c.size)),
            ))
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.state_dict[self._by_index[(index.fqn, tuple(index.offset or ()))]]


class _PieceLoadPlanner(LoadPlanner):
    """Reads, for every tensor named in `targets`, the listed chunks (offsets, destination) of the
    stored global tensor, from whatever chunks were saved (DCP's resharding)."""

    def __init__(self, targets: Mapping[str, list[tuple[tuple[int, ...], torch.Tensor]]]) -> None:
        self.targets = targets
        self.metadata: Metadata | None = None

    def set_up_planner(self, state_dict: Any, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items: list[ReadItem] = []
        for key, chunks in self.targets.items():
            md = self.metadata.state_dict_metadata[key]
            assert isinstance(md, TensorStorageMetadata)
            local = [ChunkStorageMetadata(torch.Size(off), dst.shape) for off, dst in chunks]
            items += create_read_items_for_chunk_list(key, md, local)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(f"unexpected non-tensor entry {read_item.dest_index.fqn} in the checkpoint")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        idx = read_item.dest_index
        assert idx.index is not None
        dst = self.targets[idx.fqn][idx.index][1]
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            dst = dst.narrow(d, o, n)
        return dst

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


# ---- files -------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durable(path: Path, data: bytes) -> None:
    """`data` at `path`, durably and atomically: a temporary file, fsync, rename, fsync of the directory."""
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


_canonical = canonical


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
                           "python": _jsonable(random.getstate())}
    if torch.cuda.is_available():
        out["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np

        st: Any = np.random.get_state()
        out["numpy"] = [st[0], st[1].tolist(), int(st[2]), int(st[3]), float(st[4])]
    except ImportError:  # numpy is optional
        pass
    return out


def _jsonable(x: Any) -> Any:
    return [_jsonable(v) for v in x] if isinstance(x, tuple | list) else x


def _tuples(x: Any) -> Any:
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _set_rng_state(rng: Mapping[str, Any]) -> None:
    def tensor(b64: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8)

    torch.set_rng_state(tensor(rng["torch"]))
    random.setstate(_tuples(rng["python"]))
    cuda = rng.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([tensor(s) for s in cuda])
    if "numpy" in rng:
        try:
            import numpy as np

            kind, keys, pos, has_gauss, cached = rng["numpy"]
            np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        except ImportError:
            pass


# ---- results -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointRef:
    step: int
    path: Path


@dataclass(frozen=True)
class RestoreInfo:
    step: int  # committed optimizer steps the checkpoint holds (training goes on from this step)
    path: Path
    data_state: dict[str, Any] | None  # what the saver passed as data_state
    layout: dict[str, Any]  # the layout it was taken under (replicas: ranks and local batch; units)
    skipped: tuple[tuple[str, str], ...]  # newer checkpoints passed over: (name, why)
    bytes_read: int
    seconds: float

    def describe(self) -> str:
        s = f"restored from step {self.step} ({self.path.name})"
        if self.skipped:
            s += "; skipped " + "; ".join(f"{n}: {why}" for n, why in self.skipped)
        return s


@dataclass
class SaveHandle:
    """One save as seen by one rank. `written`: this rank's files are durable (or the error).
    `completed`: the coordinator's view -- the checkpoint's path once complete; None elsewhere."""

    step: int
    name: str  # the attempt's temporary directory
    written: Future[int]  # bytes this rank wrote
    completed: Future[Path] | None = None
    snapshot_s: float = 0.0  # what save() cost the caller
    pieces: int = 0
    # the rank's pieces are copied: from here on the model and optimizer may change (the seconds the
    # copy took on the writer thread)
    snapshotted: Future[float] = field(default_factory=Future)


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


class Checkpointer:
    """Saves and loads unit-addressed checkpoints under `root` (a directory every rank sees: a
    shared filesystem when ranks run on several hosts). One per rank; `save` and `load` are
    called by every rank of the layout at the same step."""

    def __init__(self, root: str | os.PathLike[str], retention: Retention | None = None, *,
                 complete_timeout_s: float = 600.0) -> None:
        self.root = Path(root)
        self.retention = retention or Retention()
        self.complete_timeout_s = complete_timeout_s
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ntp-ckpt-write")
        self._last: SaveHandle | None = None
        self._pending: dict[str, Future[Path]] = {}  # coordinator: attempts not complete yet
        self._lock = threading.Lock()
        self._buffers: dict[str, torch.Tensor] = {}  # snapshot memory, reused across saves
        self._step_hook: Any = None  # the optimizer's pre-step hook that waits for the last copy
        self.failures: list[str] = []
        self._bad: set[int] = set()  # steps a load found corrupt (retention does not count them)
        self.test_hook: Any = None  # tests: called by the writer thread with (stage, attempt)

    # ---- listing ---------------------------------------------------------------------------------
    def complete(self) -> list[CheckpointRef]:
        """Complete checkpoints, newest first (complete: renamed into place, so every file was durable)."""
        if not self.root.is_dir():
            return []
        out = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / MANIFEST).is_file():
                out.append(CheckpointRef(int(m.group(1)), p))
        return sorted(out, key=lambda r: r.step, reverse=True)

    # ---- saving ----------------------------------------------------------------------------------
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

    def _hook(self, stage: str, att: _Attempt) -> None:
        if self.test_hook is not None:
            self.test_hook(stage, att)

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

    # ---- loading ---------------------------------------------------------------------------------
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


def _match_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]) -> None:
    """Give every parameter exactly the state entries the checkpoint has for it (zeros where new,
    shaped and placed as the optimizer's own first step would make them); the values come next."""
    for fqn, p in model.named_parameters():
        st = optimizer.state[p]
        want = [k for k in (*STATE_KEYS, "step") if f"optim/{fqn}/{k}" in saved]
        for k in list(st):
            if k not in want:
                del st[k]
        for k in want:
            if k == "step":
                if not isinstance(st.get(k), torch.Tensor):
                    grp = next((g for g in optimizer.param_groups if any(q is p for q in g["params"])), {})
                    on_dev = grp.get("capturable") or grp.get("fused")
                    st[k] = torch.zeros((), dtype=torch.float32, device=p.device if on_dev else "cpu")
            elif not isinstance(st.get(k), torch.Tensor) or st[k].shape != p.shape:
                st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if not st:
            del optimizer.state[p]


def _merge_metadata(parts: Mapping[int, Metadata]) -> Metadata:
    """One DCP metadata for the whole checkpoint from every rank's (`r<rank>/.metadata`): the
    chunks of each tensor side by side, every storage entry's path prefixed with its rank's
    directory. Raises CheckpointError when two ranks disagree on a tensor's size or type."""
    sd: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    version = None
    for r, md in sorted(parts.items()):
        version = version or md.version
        for key, tmd in md.state_dict_metadata.items():
            if not isinstance(tmd, TensorStorageMetadata):
                raise CheckpointError(f"rank {r} saved a non-tensor entry {key}")
            cur = sd.get(key)
            if cur is None:
                sd[key] = TensorStorageMetadata(tmd.properties, tmd.size, list(tmd.chunks))
            elif cur.size != tmd.size or cur.properties.dtype != tmd.properties.dtype:
                raise CheckpointError(f"{key}: rank {r} saved {tuple(tmd.size)} {tmd.properties.dtype}, "
                                      f"another rank {tuple(cur.size)} {cur.properties.dtype}")
            else:
                cur.chunks.extend(tmd.chunks)
        for idx, info in md.storage_data.items():
            where = f"r{r}/{info.relative_path}"
            storage[MetadataIndex(idx.fqn, idx.offset)] = dataclasses.replace(info, relative_path=where)
    return Metadata(state_dict_metadata=sd, storage_data=storage, version=version)


def _check_tiling(md: Metadata) -> None:
    """Every tensor's chunks cover it exactly once (they are cut along dim 0 only). Raises
    CheckpointError naming the tensor otherwise: a unit written twice or by nobody."""
    for key, tmd in md.state_dict_metadata.items():
        assert isinstance(tmd, TensorStorageMetadata)
        size = tuple(tmd.size)
        if not size:
            if len(tmd.chunks) != 1:
                raise CheckpointError(f"{key}: a scalar saved {len(tmd.chunks)} times")
            continue
        at = 0
        for c in sorted(tmd.chunks, key=lambda c: c.offsets[0]):
            if (c.offsets[0] != at or tuple(c.offsets[1:]) != (0,) * (len(size) - 1)
                    or tuple(c.sizes[1:]) != size[1:]):
                raise CheckpointError(f"{key}: chunks do not tile the tensor {size} (at row {at}: a chunk at "
                                      f"{tuple(c.offsets)} of {tuple(c.sizes)})")
            at += c.sizes[0]
        if at != size[0]:
            raise CheckpointError(f"{key}: chunks cover rows [0, {at}) of {size[0]}")


def _remove(path: Path) -> None:
    """Remove a checkpoint directory: renamed out of the listing first, so that a removal cut
    short never leaves a complete-looking checkpoint with files missing."""
    aside = path.with_name(f".removing-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)
