"""Where a rank's time goes during a layout switch (issue 32): py-spy samples of each surviving rank
from the kill to its first completed step at the new layout, bucketed into categories.

py-spy (`record --format speedscope --idle --native`) writes, per thread, the samples in the order
they were taken, each a list of frame indices from the root to the leaf. The window on the main
thread falls into three stretches by the runtime's own frames: before the first sample inside
`_recover` (the failed step, blocked on the dead peer until detection), the switch itself (samples
under `_recover`), and after the last one (the first step at the new layout). Inside the switch a
sample is a copy, a gloo send/recv wait, reshard planning or the rest (rendezvous, groups, Python)
by its leaf-most recognisable frame.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CATEGORIES = ("detection wait", "copies", "gloo waits", "reshard planning", "switch other", "first step")

# leaf-most match decides; native frames (libc, torch, gloo) and the Python ones of the transport
_COPY = re.compile(r"memcpy|memmove|copy_|\bcat\b|_copy_stretches|\bclone\b|contiguous|_Staged|\bpack|unpack|"
                   r"_finish|index_select|index_copy|narrow_copy|at::native::copy|cpu_kernel|vectorized_loop")
_WAIT = re.compile(r"\bwait\b|wait\(|::wait|recv|send|gloo|poll|futex|pthread_cond|nanosleep|select\b|"
                   r"__lll_lock|read\b|epoll|_Stream|barrier")
_PLAN = re.compile(r"\breshard_moves\b|\b_subtract\b|\b_cover\b|\b_runs\b|\b_in\b|\b_sharded_modules\b")


RATE = 25.0  # samples a second: 7 samplers share the 2 cores with the ranks


def attach(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """Starts py-spy sampling process `pid` (all its threads, idle ones too, native frames) into
    `out` (speedscope JSON) until `stop`."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([exe, "record", "--pid", str(pid), "--rate", f"{RATE:g}", "--idle", "--native",
                             "--threads", "--format", "speedscope", "--output", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def signal_stop(spy: subprocess.Popen[bytes]) -> None:
    """Tells a sampler to stop (SIGINT: it writes its file), without waiting for it."""
    if spy.poll() is None:
        spy.send_signal(signal.SIGINT)


def stop(spy: subprocess.Popen[bytes]) -> None:
    """Stops a sampler and waits for its file."""
    signal_stop(spy)
    _, err = spy.communicate(timeout=120)
    if spy.returncode not in (0, -signal.SIGINT):
        print(f"py-spy exited {spy.returncode}: {err.decode(errors='replace')[-500:]}", file=sys.stderr)


def frame_name(frame: dict[str, Any]) -> str:
    """A speedscope frame as "name (file)"."""
    f = frame.get("file")
    return f"{frame['name']} ({f})" if f else str(frame["name"])


def switch_category(stack: Sequence[str]) -> str:
    """The category of one sample taken inside the switch (stack from root to leaf)."""
    if any(_PLAN.search(f) for f in stack):
        return "reshard planning"
    for f in reversed(stack):
        if _COPY.search(f):
            return "copies"
        if _WAIT.search(f):
            return "gloo waits"
    return "switch other"


@dataclass
class RankProfile:
    """Seconds of samples (py-spy's speedscope weights) by category, and by leaf frame."""

    rank: str
    seconds: float = 0.0
    by_category: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))  # category -> seconds
    # leaf frame -> seconds, from the switch to the first step
    own: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))

    def share(self, cat: str) -> float:
        return self.by_category[cat] / self.seconds if self.seconds else 0.0

    def top(self, n: int) -> list[tuple[str, float]]:
        """The `n` leaf frames with most seconds."""
        return sorted(self.own.items(), key=lambda kv: kv[1], reverse=True)[:n]


_RECOVER = re.compile(r"^(\w+\.)?_recover ")  # py-spy names methods Class.method
_RUNTIME = re.compile(r"^(\w+\.)?(_recover|train_step) ")


def _in_recover(stack: Sequence[str]) -> bool:
    return any(_RECOVER.match(f) for f in stack)


Sample = tuple[list[str], float]  # frames root -> leaf, seconds


def classify(samples: Sequence[Sample], rank: str = "") -> RankProfile:
    """Buckets the main thread's samples, in time order, into CATEGORIES."""
    inside = [i for i, (s, _) in enumerate(samples) if _in_recover(s)]
    prof = RankProfile(rank, sum(w for _, w in samples))
    if not inside:  # no switch seen: all of it is the wait of the failed step
        prof.by_category["detection wait"] = prof.seconds
        return prof
    first, last = inside[0], inside[-1]
    for i, (s, w) in enumerate(samples):
        if i < first:
            cat = "detection wait"
        elif i > last:
            cat = "first step"
        else:
            cat = switch_category(s) if _in_recover(s) else "switch other"
        prof.by_category[cat] += w
        if i >= first and s:
            prof.own[s[-1]] += w
    return prof


def main_thread_samples(doc: dict[str, Any]) -> list[Sample]:
    """The samples of the thread that ran the runtime (the profile with most `_recover` or
    `train_step` samples) of a py-spy speedscope document: frame names root to leaf, seconds."""
    frames = [frame_name(f) for f in doc["shared"]["frames"]]
    best: list[Sample] = []
    best_hits = -1
    for prof in doc["profiles"]:
        samples = [([frames[i] for i in s], float(w)) for s, w in zip(prof["samples"], prof["weights"], strict=True)]
        hits = sum(1 for s, _ in samples if any(_RUNTIME.match(f) for f in s))
        if hits > best_hits:
            best, best_hits = samples, hits
    return best


def load(path: Path) -> RankProfile:
    doc = json.loads(path.read_text())
    return classify(main_thread_samples(doc), path.stem)


def table(profiles: Sequence[RankProfile]) -> list[tuple[str, ...]]:
    """Rows: rank, seconds sampled, then each category's share (seconds)."""
    return [(p.rank, f"{p.seconds:.1f}", *(f"{p.share(c):.0%} ({p.by_category[c]:.1f})" for c in CATEGORIES))
            for p in profiles]
