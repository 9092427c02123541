"""What every part of the Checkpointer shares: the errors, the results a caller gets back (a
save's handle, a restore's info), one save attempt as the writer sees it, and the constructor
and the listing of complete checkpoints."""

from __future__ import annotations

import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from ntp_manager.contract.checkpoint_format import MANIFEST, STEP_DIR, TMP_PREFIX
from ntp_manager.worker.checkpoint.policy import Retention

log = structlog.get_logger("ntp.worker.checkpoint")

_STEP_DIR, _TMP_PREFIX = STEP_DIR, TMP_PREFIX  # the names on disk: ntp_manager/contract/checkpoint_format.py
DATA_STATE_MAX_BYTES = 1 << 20  # the data-loader position is a small JSON document
# dcp_save(no_dist=True) warns on every call that it saves "in a single process": intended here
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointError(RuntimeError):
    """No checkpoint can be used: none complete and verified, or one of a different model."""


class NoCheckpoint(CheckpointError):
    """There is no complete checkpoint at all (a new job), as opposed to none that verifies."""


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


class _CheckpointerBase:
    """The constructor and the state the parts share; `Checkpointer` puts the parts together."""

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
