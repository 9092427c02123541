"""Planning off the event loop.

Planning a job is O(GPUs + replicas): ~20 ms for 100K GPUs, then as much again to turn the plan
into its stored document, fingerprint it and serialize it (bench/RESULTS.md). The manager's one
event loop also answers /healthz, heartbeats and signals, so all of that runs here, in a worker
thread, on immutable inputs (a frozen `Cluster` snapshot and a frozen `JobSpec`): the loop only
waits for the result. A plan made on a snapshot that a state change has since overtaken is still
a valid plan for that snapshot; the change marks the job dirty and the control loop replans it.

The stored document is serialized here too: `StoredJson` is the document with its JSON text
attached, and the store's JSON serializer (store/db.py) writes that text instead of encoding the
dict again on the loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ntp_manager.planner import JobSpec, PlanError, PreviousLayout, make_plan
from ntp_manager.planner.export import plan_to_dict
from ntp_manager.store.db import StoredJson, dumps_in_pieces
from ntp_manager.topology import Cluster, GpuState


@dataclass(frozen=True)
class Draft:
    """A plan ready to persist: its document (with JSON text), the fingerprint a replan compares,
    and the summary its audit record carries."""

    doc: StoredJson
    fingerprint: str
    summary: dict[str, Any]


# Per-group fields that say where a group was in the plan before; two identical layouts made from
# different previous plans differ in them, so they never count as a change (docs/planner.md).
HISTORY_FIELDS = frozenset({"prev_replica", "prev_stage"})


def fingerprint(doc: Mapping[str, Any]) -> str:
    """What decides whether a new plan differs from the current layout: replicas (without the
    groups' previous places), power caps and global batch. Moves and reasons are left out."""
    replicas = [
        {**{k: v for k, v in r.items() if k != "groups"},
         "groups": [{k: v for k, v in g.items() if k not in HISTORY_FIELDS} for g in r["groups"]]}
        for r in doc["replicas"]
    ]
    return dumps_in_pieces(
        {"replicas": replicas, "power_caps_w": doc["power_caps_w"], "global_batch": doc["global_batch"]},
        sort_keys=True,
    )


def previous_of(doc: Mapping[str, Any] | None) -> PreviousLayout | None:
    """The assignments of a stored plan, for the planner to keep groups in place; None when there
    is no plan or it cannot be read (an old document: the planner then plans from the home
    layout, which is still a valid plan, and says nothing of moves)."""
    if doc is None:
        return None
    try:
        return PreviousLayout.from_dict(doc)
    except PlanError:
        return None


def draft(cluster: Cluster, spec: JobSpec, fail: tuple[str, ...] = (),
          previous: Mapping[str, Any] | None = None) -> Draft:
    """Plan `spec` on `cluster` (with the GPUs in `fail` treated as failed), keeping the groups of
    `previous` (the stored plan running now) in place where the best packing allows. Raises
    PlanError or TopologyError (an unknown GPU in `fail`). Pure apart from CPU time: call it in a
    thread."""
    if fail:
        cluster = cluster.with_states(dict.fromkeys(fail, GpuState.FAILED))
    doc = plan_to_dict(make_plan(cluster, spec, previous_of(previous)))
    summary: dict[str, Any] = {
        "replicas": [[r["id"], r["tp"], r["local_batch"]] for r in doc["replicas"]],
        "relative_throughput": doc["relative_throughput"],
    }
    if doc.get("moves") is not None:
        summary["moves"] = doc["moves"]
    return Draft(StoredJson(doc), fingerprint(doc), summary)


def moves_text(moves: Mapping[str, Any] | None) -> str:
    """The move summary of a stored plan in a few words ("" without one)."""
    if not moves:
        return ""
    size = "" if moves.get("bytes") is None else f", ~{human_bytes(int(moves['bytes']))} to load"
    return (f"{moves['moved']} group(s) moved, {moves['stage_changed']} changing stage "
            f"({moves['joined']} newly placed), {moves['left']} left{size}")


def human_bytes(n: int) -> str:
    x = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if x < 1000 or unit == "TB":
            return f"{x:.0f} B" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    raise AssertionError("unreachable")


def why(old: Mapping[str, Any] | None, new: Mapping[str, Any], given: str = "") -> str:
    """A layout's reason: `given` (an operator's) or what changed, then what moved."""
    if given:
        text = given
    elif old is None:
        text = f"initial layout: {len(new['replicas'])} replicas, throughput {new['relative_throughput']:.4f}"
    else:
        old_tp = sorted(r["tp"] for r in old["replicas"])
        new_tp = sorted(r["tp"] for r in new["replicas"])
        text = (
            f"replanned: replicas {len(old['replicas'])} -> {len(new['replicas'])}, TP degrees {old_tp} -> "
            f"{new_tp}, throughput {old['relative_throughput']:.4f} -> {new['relative_throughput']:.4f}"
        )
    moves = moves_text(new.get("moves"))
    return f"{text}; moves: {moves}" if moves else text
