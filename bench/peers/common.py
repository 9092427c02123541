"""What both sides of the peer comparison share: the model, the data and the step log.

The data is addressed by sample index: sample i is a sequence of tokens drawn from a generator
seeded with i, so two trainers that train the same indices train the same tokens, and which
indices a trainer covered says exactly what it skipped or repeated.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SEQ = 64
VOCAB = 256
STEP_BATCH = 8  # samples per replica per step at full strength


def model_config() -> Any:
    from ntp_manager.worker.tiny_gpt import GptConfig

    return GptConfig(vocab=VOCAB, seq=SEQ, d_model=384, heads=8, mlp=1536, layers=4)


def batch_of(indices: list[int]) -> tuple[Any, Any]:
    """(inputs, targets) of the samples `indices`: each sample's tokens come from its own seed."""
    import torch

    rows = []
    for i in indices:
        g = torch.Generator().manual_seed(1_000_003 * (i + 1))
        rows.append(torch.randint(0, VOCAB, (SEQ + 1,), generator=g))
    x = torch.stack(rows) if rows else torch.zeros((0, SEQ + 1), dtype=torch.long)
    return x[:, :-1], x[:, 1:]


@dataclass
class StepRecord:
    """One step a replica finished (committed or not), as the driver reads it back."""

    side: str  # "torchft" | "ntp"
    replica: str
    pid: int
    step: int
    start: float  # wall clock (time.time) when the step began
    end: float
    committed: bool
    participants: int  # replicas in the step
    indices: list[int] = field(default_factory=list)  # the samples this replica trained in it
    switch_s: float = 0.0  # time inside the step spent changing layout (regroup and reshard)


class StepLog:
    """Append-only JSON lines, one per step (a file per process, so a SIGKILL loses no other's);
    the first line says when the process started (`process_starts`)."""

    def __init__(self, directory: Path, name: str, started: float) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{name}-{os.getpid()}.jsonl"
        self._f = self.path.open("a")
        self._f.write(json.dumps({"process": name, "pid": os.getpid(), "started": started}) + "\n")
        self._f.flush()

    def write(self, rec: StepRecord) -> None:
        self._f.write(json.dumps(asdict(rec)) + "\n")
        self._f.flush()


def read_logs(directory: Path) -> list[StepRecord]:
    out: list[StepRecord] = []
    for p in sorted(directory.glob("*.jsonl")):
        for line in p.read_text().splitlines():
            if line.strip():
                try:
                    out.append(StepRecord(**json.loads(line)))
                except (ValueError, TypeError):
                    continue  # the process line, or a line cut by a kill
    return sorted(out, key=lambda r: r.end)


def process_starts(directory: Path) -> dict[int, float]:
    """pid -> when that process started (its script's first line ran)."""
    out: dict[int, float] = {}
    for p in directory.glob("*.jsonl"):
        lines = p.read_text().splitlines()
        if lines:
            with contextlib.suppress(ValueError, KeyError):
                head = json.loads(lines[0])
                out[int(head["pid"])] = float(head["started"])
    return out


STARTED = time.time()  # when the importing script began (the process started just before)
