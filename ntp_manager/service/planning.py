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

from dataclasses import dataclass
from typing import Any

from ntp_manager.planner import JobSpec, make_plan
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


def fingerprint(doc: dict[str, Any]) -> str:
    """What decides whether a new plan differs from the current layout."""
    return dumps_in_pieces(
        {"replicas": doc["replicas"], "power_caps_w": doc["power_caps_w"], "global_batch": doc["global_batch"]},
        sort_keys=True,
    )


def draft(cluster: Cluster, spec: JobSpec, fail: tuple[str, ...] = ()) -> Draft:
    """Plan `spec` on `cluster` (with the GPUs in `fail` treated as failed). Raises PlanError or
    TopologyError (an unknown GPU in `fail`). Pure apart from CPU time: call it in a thread."""
    if fail:
        cluster = cluster.with_states(dict.fromkeys(fail, GpuState.FAILED))
    doc = plan_to_dict(make_plan(cluster, spec))
    summary = {
        "replicas": [[r["id"], r["tp"], r["local_batch"]] for r in doc["replicas"]],
        "relative_throughput": doc["relative_throughput"],
    }
    return Draft(StoredJson(doc), fingerprint(doc), summary)
