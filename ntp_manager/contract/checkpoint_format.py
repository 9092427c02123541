"""The on-disk names of unit-addressed checkpoints, and a listing that needs no torch.

The workers write checkpoints (worker/checkpoint/, which takes its names from here); the manager
lists them for operators (`ntpctl checkpoints`, GET /v1/jobs/{name}/checkpoints) and tells the
planner the newest usable step. Under a job's checkpoint directory:

    step-<12 digits>/          complete: renamed into place after every file was durable
        manifest.json          format, step, layout, tensors, every file's SHA-256 and size, and
                               `manifest_sha256`, the hash of the manifest itself (canonical JSON)
    .tmp-step-<12 digits>-<attempt>/   a save in progress, or one that never completed

What the listing checks (`verified`): the manifest's own hash, its format and step, and that every
file it lists is there with the size it records. It does not hash the shards' contents (that
reads the whole checkpoint; the workers do it when they load one, and fall back to an older one
when a hash differs). Everything is bounded: directory entries looked at, manifest bytes, files
per manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMAT = "ntp-checkpoint/1"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d{12})$")
TMP_PREFIX = ".tmp-step-"
ENTRIES_MAX = 100_000  # directory entries a listing looks at
MANIFEST_MAX_BYTES = 64 * 2**20
FILES_MAX = 1_000_000  # files one manifest may list


def step_dir_name(step: int) -> str:
    return f"step-{step:012d}"


def canonical(doc: Mapping[str, Any]) -> bytes:
    """The bytes a manifest's own hash is taken over (and what the rank markers hold)."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def manifest_problem(doc: Any, step: int) -> str | None:
    """Why a parsed manifest of checkpoint `step` cannot be trusted (its own hash, format, step),
    or None. Does not look at the files."""
    if not isinstance(doc, dict):
        return "manifest.json is not a JSON object"
    body = {k: v for k, v in doc.items() if k != "manifest_sha256"}
    if doc.get("manifest_sha256") != hashlib.sha256(canonical(body)).hexdigest():
        return "manifest.json does not match its own hash"
    if doc.get("format") != FORMAT or doc.get("step") != step:
        return f"manifest format {doc.get('format')!r} step {doc.get('step')!r} (expected {FORMAT}, {step})"
    return None


@dataclass(frozen=True)
class Listed:
    """One checkpoint directory as the listing sees it."""

    step: int
    name: str
    complete: bool  # renamed into place (step-N); an attempt in progress or abandoned is not
    verified: bool  # manifest intact and every file present at its recorded size (not content-hashed)
    problem: str  # why not verified ("" when verified; "in progress or abandoned" when not complete)
    at: float | None  # completion time from the manifest (seconds since the epoch); else the mtime
    bytes: int  # the files' total size, from the manifest (0 when unknown)
    files: int

    def view(self) -> dict[str, Any]:
        return {"step": self.step, "name": self.name, "complete": self.complete, "verified": self.verified,
                "problem": self.problem, "at": self.at, "bytes": self.bytes, "files": self.files}


def _scan(root: Path) -> tuple[list[tuple[int, str, bool]], bool]:
    """(step, name, complete) of the checkpoint directories under `root`, and whether the scan
    stopped at ENTRIES_MAX."""
    out: list[tuple[int, str, bool]] = []
    with os.scandir(root) as it:
        for i, e in enumerate(it):
            if i >= ENTRIES_MAX:
                return out, True
            m = STEP_DIR.match(e.name)
            if m:
                out.append((int(m.group(1)), e.name, True))
            elif e.name.startswith(TMP_PREFIX):
                head = e.name[len(TMP_PREFIX):].split("-")[0]
                if head.isdigit():
                    out.append((int(head), e.name, False))
    return out, False


def _inspect(root: Path, step: int, name: str) -> Listed:
    path = root / name
    try:
        mtime = path.stat().st_mtime
    except OSError:
        mtime = None
    if not name.startswith("step-"):
        return Listed(step, name, False, False, "in progress or abandoned (never completed)", mtime, 0, 0)
    try:
        fd = os.open(path / MANIFEST, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO named so must not hang us
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError("not a regular file")
            raw = f.read(MANIFEST_MAX_BYTES + 1)
        if len(raw) > MANIFEST_MAX_BYTES:
            return Listed(step, name, True, False, f"manifest.json is over {MANIFEST_MAX_BYTES} bytes", mtime, 0, 0)
        doc = json.loads(raw)
    except (OSError, ValueError) as e:
        return Listed(step, name, True, False, f"manifest.json unreadable: {type(e).__name__}", mtime, 0, 0)
    problem = manifest_problem(doc, step)
    files = doc.get("files") if isinstance(doc, dict) else None
    if problem is None and (not isinstance(files, dict) or len(files) > FILES_MAX):
        problem = "manifest.json lists no files, or too many"
    at = doc.get("completed_at") if isinstance(doc, dict) else None
    at = float(at) if isinstance(at, int | float) else mtime
    if problem is not None:
        return Listed(step, name, True, False, problem, at, 0, 0)
    assert isinstance(files, dict)
    total = 0
    for rel, meta in sorted(files.items()):
        want = meta.get("bytes") if isinstance(meta, dict) else None
        p = path / rel
        if not isinstance(want, int) or ".." in Path(rel).parts or Path(rel).is_absolute():
            problem = f"{rel}: a malformed entry in the manifest"
        else:
            try:
                size = p.stat().st_size
            except OSError as e:
                problem = f"{rel}: {e.strerror or type(e).__name__}"
            else:
                if size != want:
                    problem = f"{rel}: {size} bytes, the manifest says {want}"
        if problem is not None or not isinstance(want, int):
            break
        total += want
    return Listed(step, name, True, problem is None, problem or "", at, total, len(files))


@dataclass(frozen=True)
class Listing:
    root: str
    exists: bool
    items: list[Listed]  # newest first
    total: int  # checkpoint directories found (complete or not)
    truncated: bool  # the directory held more than ENTRIES_MAX entries: not all were looked at

    def newest_verified(self) -> int | None:
        return next((c.step for c in self.items if c.verified), None)

    def view(self) -> dict[str, Any]:
        return {"root": self.root, "exists": self.exists, "items": [c.view() for c in self.items],
                "total": self.total, "truncated": self.truncated}


def list_checkpoints(root: str | os.PathLike[str], limit: int = 100, *, verified_only: bool = False) -> Listing:
    """The newest `limit` checkpoint directories under `root` (complete and not), newest first,
    each inspected (see the module doc). With `verified_only`, inspects from the newest until it
    finds one that verifies, and lists just that one (or none). Blocking file I/O: call it off
    the event loop. A missing directory is an empty listing (no checkpoint yet); other OSErrors
    propagate."""
    path = Path(root)
    try:
        found, truncated = _scan(path)
    except FileNotFoundError:
        return Listing(str(path), False, [], 0, False)
    found.sort(key=lambda t: (t[0], t[2]), reverse=True)  # a complete one before an attempt at the same step
    items: list[Listed] = []
    for step, name, _ in found:
        if verified_only:
            c = _inspect(path, step, name)
            if c.verified:
                items.append(c)
                break
        elif len(items) < limit:
            items.append(_inspect(path, step, name))
        else:
            break
    return Listing(str(path), True, items, len(found), truncated)
