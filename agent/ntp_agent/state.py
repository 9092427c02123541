"""The agent's local state file, and the health verdict read from it.

A running agent writes one small JSON file (`state_file`, e.g. /run/ntp-agent/state.json): the
node, its NVLink domain, every GPU (NVML index, device minor number, UUID, PCI bus id, the agent's
current verdict and its reasons), whether a manager has the agent connected, and when the file was
written. It is rewritten whenever a verdict or the connection changes, and at least every
`STATE_EVERY_S` seconds, atomically (a temporary file renamed over it), so a reader never sees half
a file. Two readers on the node use it:

- `ntp-run --slurm` maps the GPUs Slurm gave a job step (SLURM_STEP_GPUS: device minor numbers, in
  gres.conf order) to GPU UUIDs (ntp_manager/worker/slurm_env.py reads the file on its own: the
  worker side does not import the agent);
- `ntp-agent health` (Slurm's HealthCheckProgram, a prolog) judges the node from it: `judge()`.

A path may hold `{node}`, replaced by the node name, so that several agents on one host (a test
cluster with several slurmd) keep their files apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_FORMAT = 1
STATE_EVERY_S = 5.0  # the file is rewritten at least this often: its age says whether the agent runs
MAX_STATE_BYTES = 1 << 20  # a state file larger than this is not the agent's


class StateError(ValueError):
    """The state file is missing, unreadable or not the agent's (the message says which)."""


def expand(template: str | Path, node: str) -> Path:
    """`template` with `{node}` replaced by the node name."""
    return Path(str(template).replace("{node}", node))


def write_state(path: Path, doc: Mapping[str, Any]) -> None:
    """Write `doc` as JSON to `path` atomically (same directory, then rename). Blocking: the agent
    calls it on a worker thread. Creates the directory when missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.chmod(tmp, 0o644)  # the job's user (ntp-run) reads it; nothing in it is secret
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def read_state(path: Path) -> dict[str, Any]:
    """The state document at `path`. Raises StateError naming the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        raise StateError(f"no ntp-agent state file at {path} (is ntp-agent running with --state-file?)") from None
    except OSError as e:
        raise StateError(f"{path}: cannot read the ntp-agent state ({e.strerror})") from None
    if len(raw) > MAX_STATE_BYTES:
        raise StateError(f"{path}: larger than {MAX_STATE_BYTES} bytes: not an ntp-agent state file")
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise StateError(f"{path}: not JSON: not an ntp-agent state file") from None
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT or not isinstance(doc.get("gpus"), list):
        raise StateError(f"{path}: not an ntp-agent state file of format {STATE_FORMAT}")
    return doc


@dataclass(frozen=True)
class Health:
    ok: bool
    line: str  # one line: what is wrong, or a summary when healthy


def judge(doc: Mapping[str, Any], now: float, *, max_age_s: float, max_disconnected_s: float,
          gpus: bool = True) -> Health:
    """Whether the node is fit for work, from its agent's state `doc` at wall time `now`.

    Unhealthy when: the file is older than `max_age_s` (the agent stopped or hangs); no manager has
    had the agent connected for more than `max_disconnected_s` (the manager cannot see this node's
    failures); with `gpus`, a GPU's verdict is `failed` (named with its index and first reason).
    The first problem found is the line."""
    age = now - float(doc.get("written_at", 0.0))
    if age > max_age_s:
        return Health(False, f"ntp-agent state is {age:.0f}s old (limit {max_age_s:g}s): the agent is not running "
                             "or hangs")
    if not doc.get("connected"):
        since = float(doc.get("since", 0.0))
        off = now - since
        if off > max_disconnected_s:
            return Health(False, f"ntp-agent has not been connected to a manager for {off:.0f}s (limit "
                                 f"{max_disconnected_s:g}s): the manager cannot see this node's GPUs")
    gpu_list = doc.get("gpus", [])
    if gpus:
        for g in gpu_list:
            if g.get("state") == "failed":
                why = (g.get("reasons") or ["no reason given"])[0]
                return Health(False, f"GPU {g.get('index')} ({g.get('uuid')}) failed: {why}")
    states: dict[str, int] = {}
    for g in gpu_list:
        states[str(g.get("state"))] = states.get(str(g.get("state")), 0) + 1
    summary = ", ".join(f"{n} {s}" for s, n in sorted(states.items()))
    return Health(True, f"ok: node {doc.get('node')}, {len(gpu_list)} GPUs ({summary or 'none'}), "
                        f"{'connected' if doc.get('connected') else 'not connected'}")
