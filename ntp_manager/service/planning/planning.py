"""Planning off the event loop.

Planning a job is O(GPUs + replicas): ~20 ms for 100K GPUs, then about as much again to turn the
plan into its typed layout, compare it with the running one and encode its stored body
(bench/RESULTS.md). The manager's one event loop also answers /healthz, heartbeats and signals, so
all of that runs here, in a worker thread, on immutable inputs (a frozen `Cluster` snapshot, a
frozen `JobSpec`, the running `LayoutDoc`): the loop only waits for the result. A plan made on a
snapshot that a state change has since overtaken is still a valid plan for that snapshot; the
change marks the job dirty and the control loop replans it.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import JobSpec, PlanError, PreviousLayout, make_plan
from ntp_manager.planner.layout import LayoutDoc, MovesDoc
from ntp_manager.planner.restore import restore_step
from ntp_manager.service.core.state import LayoutRec
from ntp_manager.store import layout_codec as codec
from ntp_manager.topology import Cluster


@dataclass(frozen=True)
class Encoded:
    """A layout version's stored body: a keyframe (`base_version` None) or a delta."""

    body: bytes
    base_version: int | None
    chain: int  # deltas from its keyframe


@dataclass(frozen=True)
class Draft:
    """A replan's result: the layout, whether it is the one running already, and (when it is not)
    its stored body and the summary its audit record carries."""

    doc: LayoutDoc
    unchanged: bool
    encoded: Encoded | None
    summary: dict[str, Any]
    why: str
    restore: str = ""  # issue 22: why the layout needs a checkpoint ("" when every unit has a survivor)


# `previous_of` of the last layouts asked for: a running layout is replanned again and again (a
# standby plans it ahead of a takeover, the takeover replans it), and at 100,000 GPUs its
# assignments took a tenth of a takeover's CPU. Keyed by the document's identity, which the entry
# keeps alive; documents are immutable. An entry of a 96,000-GPU layout holds 2.8 MB.
PREVIOUS_KEPT = 16
_previous: OrderedDict[int, tuple[LayoutDoc, PreviousLayout | None]] = OrderedDict()
_previous_lock = threading.Lock()


def previous_of(doc: LayoutDoc | None) -> PreviousLayout | None:
    """The assignments of the running layout, for the planner to keep groups in place; None when
    there is none or it cannot be used (the planner then plans from the home layout, which is
    still a valid plan, and says nothing of moves)."""
    if doc is None:
        return None
    with _previous_lock:
        hit = _previous.get(id(doc))
        if hit is not None and hit[0] is doc:
            _previous.move_to_end(id(doc))
            return hit[1]
    try:
        prev: PreviousLayout | None = doc.previous()
    except PlanError:
        prev = None
    with _previous_lock:
        _previous[id(doc)] = (doc, prev)
        while len(_previous) > PREVIOUS_KEPT:
            _previous.popitem(last=False)
    return prev


def plan_layout(cluster: Cluster, spec: JobSpec, fail: tuple[str, ...] = (),
                previous: LayoutDoc | None = None) -> LayoutDoc:
    """Plan `spec` on `cluster` (with the GPUs in `fail` treated as failed), keeping the groups of
    `previous` (the layout running now) in place where the best packing allows. Raises PlanError
    or TopologyError (an unknown GPU in `fail`). Pure apart from CPU time: call it in a thread."""
    if fail:
        cluster = cluster.with_states(dict.fromkeys(fail, GpuState.FAILED))
    return LayoutDoc.of(make_plan(cluster, spec, previous_of(previous)))


def encode_for(doc: LayoutDoc, previous: LayoutRec | None, pos_of: codec.PosOf) -> Encoded:
    """The body `doc` is stored as when it follows `previous`: a delta on it, or a keyframe when
    there is none or its chain is `KEYFRAME_EVERY - 1` deltas long. CodecError for a GPU without
    a position."""
    if previous is None or previous.chain + 1 >= codec.KEYFRAME_EVERY:
        return Encoded(codec.encode(doc, pos_of), None, 0)
    return Encoded(codec.encode(doc, pos_of, previous.doc), previous.version, previous.chain + 1)


def draft(cluster: Cluster, spec: JobSpec, previous: LayoutRec | None, pos_of: codec.PosOf,
          reason: str = "", checkpoint_step: int | None = None) -> Draft:
    """Replan: the new layout, compared with `previous` and encoded after it, with its reason
    (`reason`, an operator's, or what changed). When no GPU of `previous` that the new layout
    keeps holds some unit of the spec's families (planner/restore.py), the layout carries
    `checkpoint_step` (the newest verified checkpoint the manager knows of) as its `restore_step`,
    the reason says so, and `Draft.restore` is that note. Call it in a thread."""
    doc = plan_layout(cluster, spec, (), previous.doc if previous is not None else None)
    if previous is not None and previous.doc.same_layout(doc):  # the same GPUs: nothing to restore either
        return Draft(doc, True, None, {}, "")
    note = ""
    if previous is not None:
        step, note = restore_step(previous.doc, doc, {"heads": spec.heads, "mlp_columns": spec.mlp_columns},
                                  checkpoint_step)
        if note:
            doc = doc.replace(restore_step=step, reasons=(*doc.reasons, note))
    d = follow(doc, previous, pos_of, reason)
    return dataclasses.replace(d, why=f"{d.why}; {note}", restore=note) if note and not d.unchanged else d


def follow(doc: LayoutDoc, previous: LayoutRec | None, pos_of: codec.PosOf, reason: str = "") -> Draft:
    """`doc` as the version after `previous`: unchanged, or its body, summary and reason."""
    if previous is not None and previous.doc.same_layout(doc):
        return Draft(doc, True, None, {}, "")
    return Draft(doc, False, encode_for(doc, previous, pos_of), summary(doc, previous.doc if previous else None),
                 why(previous.doc if previous is not None else None, doc, reason))


AUDITED = 64  # replicas an audit record lists one by one


def summary(doc: LayoutDoc, old: LayoutDoc | None) -> dict[str, Any]:
    """What a layout's audit record says of it: replicas per TP degree, batch, throughput, moves,
    and the replicas that are new or changed since `old` ([id, TP, local batch], the first
    AUDITED of them; `changed` counts them all). Its size does not grow with the job: the layout
    itself is in the layouts table."""
    changed = doc.changed_since(old)
    removed = sorted(set(old.replica_ids) - set(doc.replica_ids)) if old is not None else []
    by_tp = Counter(doc.replica_tps)
    out: dict[str, Any] = {
        "replicas": len(doc.replica_ids), "tp_counts": {str(t): by_tp[t] for t in sorted(by_tp)},
        "global_batch": doc.global_batch, "relative_throughput": doc.relative_throughput,
        "changed": len(changed),
        "changed_replicas": [[doc.replica_ids[i], doc.replica_tps[i], doc.local_batches[i]] for i in changed[:AUDITED]],
        "removed_replicas": removed[:AUDITED],
    }
    if doc.moves is not None:
        out["moves"] = doc.moves._asdict()
    return out


def moves_text(moves: MovesDoc | None) -> str:
    """The move summary of a layout in a few words ("" without one)."""
    if not moves:
        return ""
    size = "" if moves.bytes is None else f", ~{human_bytes(moves.bytes)} to load"
    return (f"{moves.moved} group(s) moved, {moves.stage_changed} changing stage "
            f"({moves.joined} newly placed), {moves.left} left{size}")


def human_bytes(n: int) -> str:
    x = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if x < 1000 or unit == "TB":
            return f"{x:.0f} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    raise AssertionError("unreachable")


LISTED = 16  # replicas whose TP degrees a reason lists one by one


def tps_text(doc: LayoutDoc) -> str:
    """The replicas' TP degrees, ascending ("[3, 4]"), or counted for a large job ("TP7 x 1,
    TP8 x 12499"): a reason travels with every layout message, so its size must not grow with
    the job."""
    if len(doc.replica_tps) <= LISTED:
        return str(sorted(doc.replica_tps))
    by_tp = Counter(doc.replica_tps)
    return ", ".join(f"TP{t} x {by_tp[t]}" for t in sorted(by_tp))


def why(old: LayoutDoc | None, new: LayoutDoc, given: str = "") -> str:
    """A layout's reason: `given` (an operator's) or what changed, then what moved."""
    if given:
        text = given
    elif old is None:
        text = f"initial layout: {len(new.replica_ids)} replicas, throughput {new.relative_throughput:.4f}"
    else:
        text = (
            f"replanned: replicas {len(old.replica_ids)} -> {len(new.replica_ids)}, TP degrees {tps_text(old)} -> "
            f"{tps_text(new)}, throughput {old.relative_throughput:.4f} -> {new.relative_throughput:.4f}"
        )
    slow = [r for r in new.reasons if "degraded" in r]  # fail-slow decisions (planner/slow.py)
    if slow:
        more = f" (+{len(slow) - MAX_SLOW_REASONS} more)" if len(slow) > MAX_SLOW_REASONS else ""
        text += "; fail-slow: " + "; ".join(slow[:MAX_SLOW_REASONS]) + more
    moves = moves_text(new.moves)
    return f"{text}; moves: {moves}" if moves else text


MAX_SLOW_REASONS = 8  # fail-slow decisions quoted in a layout's reason
