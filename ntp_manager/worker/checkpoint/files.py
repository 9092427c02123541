"""Files on disk: durable writes (fsync of file and directory, atomic renames), hashes, the RNG
state as JSON, and removing a checkpoint so that a removal cut short never looks complete."""

from __future__ import annotations

import base64
import hashlib
import os
import random
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ntp_manager.contract.checkpoint_format import canonical


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


def _remove(path: Path) -> None:
    """Remove a checkpoint directory: renamed out of the listing first, so that a removal cut
    short never leaves a complete-looking checkpoint with files missing."""
    aside = path.with_name(f".removing-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)
