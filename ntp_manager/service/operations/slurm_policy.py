"""What ntp-manager does to Slurm nodes: pure decisions (no clock read, nothing run), tested like
functions with made-up times. The component that gathers the state and runs Slurm's commands is
service/operations/slurm.py; docs/slurm.md is the operator's view.

A node is drained when one of its GPUs needs a person (`node_causes`):
- its agent failed it (the XID policy's `fail`, uncorrectable ECC, a lost GPU, ...): health
  `failed` on the agent's own evidence. A GPU failed because its node went silent is not a cause:
  Slurm sees a dead node itself (slurmd stops answering), and an agent restart must not drain it;
- it is in maintenance (a maintenance window, or a node drain whose deadline passed);
- it has been degraded (fail-slow, or the agent's evidence such as throttling) for at least
  `degraded_after_s`: a slow GPU the planner works around for that long wants a person too.
An operator's cordon or drain inside ntp-manager is left out: the operator decides about Slurm then.

The drain's reason starts with `MARKER`; that is how ntp-manager knows its own drains. It resumes a
node only when the node is drained with a reason that starts with the marker and no GPU of the node
needs a person any more. A node drained for any other reason (an operator, a health check) is never
resumed and never re-drained over.

`decide` turns what the manager wants and what Slurm shows into actions, under three limits:
- while the manager's circuit breaker is open (a systemic fault, service/planning/breaker.py) nothing is
  drained or resumed: automation stops as the replanning does;
- at most `max_drains` drains within `window_s` (the breaker's window): a rack event cannot drain a
  partition at once; the rest wait their turn, in node-name order;
- a node that ntp-manager drained and someone resumed while its causes still hold is not drained
  again until its causes change (the person decided).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.state import SILENCE_SOURCES, HealthSource

MARKER = "ntp-manager:"
REASON_MAX = 240  # characters of a drain reason (Slurm keeps more; people read it in `sinfo -R`)
SINFO_FORMAT = "%N|%T|%E"  # node, state, reason: `sinfo -h -N -t drain -o SINFO_FORMAT`


@dataclass(frozen=True, slots=True)
class GpuFacts:
    """What the decision needs of one GPU (a copy of its record's fields)."""

    uuid: str
    idx: int
    health: GpuState
    health_source: HealthSource
    health_reason: str
    health_since: float | None  # wall seconds (None: unknown)
    admin: GpuState | None
    admin_reason: str | None


class CauseKind(StrEnum):
    FAILED = "failed"
    MAINTENANCE = "maintenance"
    DEGRADED = "degraded"


@dataclass(frozen=True, slots=True)
class Cause:
    """A GPU of the node that needs a person, and why."""

    gpu: str
    idx: int
    kind: CauseKind
    detail: str  # the agent's reason (with the XID), the window's reason, or the slowness

    @property
    def key(self) -> str:
        return f"{self.gpu}:{self.kind}"

    def text(self) -> str:
        return f"GPU {self.idx} {self.gpu} {self.kind}: {self.detail}" if self.detail else \
            f"GPU {self.idx} {self.gpu} {self.kind}"


def node_causes(now: float, gpus: Sequence[GpuFacts], degraded_after_s: float) -> tuple[Cause, ...]:
    """The GPUs of one node that need a person at wall time `now` (see the module docstring), in
    index order. `degraded_after_s` <= 0: degraded GPUs never drain."""
    out = []
    for g in sorted(gpus, key=lambda g: g.idx):
        if g.admin == GpuState.MAINTENANCE:
            out.append(Cause(g.uuid, g.idx, CauseKind.MAINTENANCE, g.admin_reason or ""))
        elif g.health == GpuState.FAILED and g.health_source not in SILENCE_SOURCES:
            out.append(Cause(g.uuid, g.idx, CauseKind.FAILED, g.health_reason))
        elif (g.health == GpuState.DEGRADED and degraded_after_s > 0 and g.health_since is not None
              and now - g.health_since >= degraded_after_s):
            out.append(Cause(g.uuid, g.idx, CauseKind.DEGRADED,
                             f"{g.health_reason} (for {now - g.health_since:.0f}s)".strip()))
    return tuple(out)


def causes_key(causes: Sequence[Cause]) -> frozenset[str]:
    return frozenset(c.key for c in causes)


def drain_reason(causes: Sequence[Cause], audit_link: str) -> str:
    """The reason set on a drained node: the marker, the first cause (GPU, XID or verdict), how many
    more, and the audit record's link; at most REASON_MAX characters (the cause is cut, never the
    marker or the link)."""
    if not causes:
        raise ValueError("a drain needs a cause")
    more = f" (+{len(causes) - 1} more GPUs)" if len(causes) > 1 else ""
    tail = f"{more}; audit {audit_link}"
    head = f"{MARKER} {causes[0].text()}"
    head = " ".join(head.replace("|", "/").split())  # one line, and no `|` (sinfo's field separator here)
    room = REASON_MAX - len(tail)
    if len(head) > room:
        head = head[: max(len(MARKER), room - 3)] + "..."
    return head + tail


def owned(reason: str) -> bool:
    """Whether a Slurm drain reason is one of ntp-manager's."""
    return reason.startswith(MARKER)


@dataclass(frozen=True, slots=True)
class SlurmNode:
    """A drained (or draining) node as sinfo shows it."""

    name: str
    state: str
    reason: str


def parse_sinfo(text: str) -> dict[str, SlurmNode]:
    """`sinfo -h -N -o SINFO_FORMAT` output by node (a node in several partitions is listed once per
    partition: the first line wins). Raises ValueError naming a line that is not NAME|STATE|REASON."""
    out: dict[str, SlurmNode] = {}
    for line in text.splitlines():
        if not line.strip():
            continue
        parts = line.split("|", 2)
        if len(parts) != 3 or not parts[0]:
            raise ValueError(f"sinfo printed {line[:200]!r}, not NAME|STATE|REASON")
        name, state, reason = parts
        out.setdefault(name, SlurmNode(name, state.strip(), "" if reason == "none" else reason))
    return out


class ActionKind(StrEnum):
    DRAIN = "drain"
    RESUME = "resume"


@dataclass(frozen=True, slots=True)
class Action:
    kind: ActionKind
    node: str
    causes: tuple[Cause, ...]  # a drain's causes (a resume: none)
    why: str


@dataclass(frozen=True, slots=True)
class SlurmOptions:
    max_drains: int  # within window_s
    window_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    actions: tuple[Action, ...]
    held: tuple[tuple[str, str], ...]  # (node, why nothing is done to it now)


def decide(now: float, wanted: Mapping[str, tuple[Cause, ...]], drained: Mapping[str, SlurmNode],
           known: Collection[str], recent_drains: Sequence[float], ours_before: Mapping[str, frozenset[str]],
           refused: Mapping[str, frozenset[str]], breaker_open: bool, options: SlurmOptions) -> Decision:
    """The drains and resumes to make now (monotonic `now`; `recent_drains`: when earlier drains
    were made, same clock).

    wanted       node -> the causes that want it drained (nodes without any are absent)
    drained      what sinfo lists as drained or draining, by node
    known        the nodes the manager knows (it resumes nothing it cannot judge)
    ours_before  nodes ntp-manager drained in this run -> the causes it drained them for
    refused      nodes Slurm refused to drain (it does not know them) -> the causes then
    """
    if breaker_open:
        names = sorted(set(wanted) | {n for n, s in drained.items() if owned(s.reason)})
        return Decision((), tuple((n, "the circuit breaker is open: Slurm nodes are left as they are until an "
                                      "operator resets it") for n in names))
    actions: list[Action] = []
    held: list[tuple[str, str]] = []
    to_drain: list[str] = []
    for node in sorted(wanted):
        causes = wanted[node]
        key = causes_key(causes)
        s = drained.get(node)
        if s is not None:
            if not owned(s.reason):
                held.append((node, f"drained by someone else ({s.reason or 'no reason'}): left alone"))
        elif refused.get(node) == key:
            held.append((node, "Slurm does not know this node name: not drained"))
        elif ours_before.get(node) == key:
            held.append((node, "ntp-manager drained it and someone resumed it while its GPUs still need a "
                               "person: not drained again until that changes"))
        else:
            to_drain.append(node)
    used = sum(1 for t in recent_drains if now - t < options.window_s)
    room = max(0, options.max_drains - used)
    for node in to_drain[:room]:
        actions.append(Action(ActionKind.DRAIN, node, wanted[node], "; ".join(c.text() for c in wanted[node])))
    for node in to_drain[room:]:
        held.append((node, f"rate cap: {options.max_drains} drains within {options.window_s:g}s; waits its turn"))
    for node in sorted(drained):
        s = drained[node]
        if not owned(s.reason) or node in wanted:
            continue
        if node not in known:
            held.append((node, "drained by ntp-manager, but the manager does not know this node now: left drained"))
            continue
        actions.append(Action(ActionKind.RESUME, node, (), "no GPU of the node needs a person any more"))
    return Decision(tuple(actions), tuple(held))
