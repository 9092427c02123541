"""Layout answers of bounded size: a layout's replicas one page at a time, its other lists capped,
and `counts` that always say how many there are in all.

The largest accepted job has 100,000 replicas (one per GPU of a `max_cluster_gpus` cluster): its
whole plan JSON is ~25 MB, twenty versions of its history as replica summaries ~100 MB. Making and
freeing that many dicts holds the interpreter, and with it the manager's event loop, for up to
seconds whichever thread does it, and nobody reads such an answer whole. So:

- an answer that lists one layout's replicas lists a page of them: `limit` (default
  REPLICAS_DEFAULT, at most REPLICAS_MAX) from `offset`, in replica id order; the plan's
  `power_caps_w` then lists the page's GPUs only;
- a list of jobs or of layout versions lists the first `replicas_limit` replicas of each item
  (default SUMMARY_REPLICAS, and `limit` x `replicas_limit` at most SUMMARY_ENTRIES_MAX);
- `dropped`, `idle`, `spares_used` and `reasons` list their first LIST_MAX entries;
- `counts` gives every total and the replicas per TP degree.

The cost of an answer is then O(its page + LIST_MAX) records, plus one C-level count of the
replicas' TP degrees. Pure functions of an immutable `LayoutDoc`: run them in a worker thread.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.service.core.errors import InvalidArgument

REPLICAS_DEFAULT = 100  # replicas of one layout per page
REPLICAS_MAX = 1000
LIST_MAX = 1000  # entries of dropped / idle / spares_used / reasons listed (the rest are counted)
SUMMARY_REPLICAS = 16  # replicas listed per job or per layout version in a list of them
SUMMARY_ENTRIES_MAX = 20_000  # limit x replicas_limit of such a list


def check_summary_page(limit: int, replicas_limit: int) -> None:
    """InvalidArgument (naming `replicas_limit`) when a list of `limit` items with
    `replicas_limit` replicas each could list more than SUMMARY_ENTRIES_MAX replicas."""
    if limit * replicas_limit > SUMMARY_ENTRIES_MAX:
        raise InvalidArgument(
            f"replicas_limit: limit x replicas_limit may list at most {SUMMARY_ENTRIES_MAX:,} replicas "
            f"({limit} x {replicas_limit} asked); page the replicas of one version with "
            f"GET /v1/jobs/{{name}}/layouts/{{version}}")


def counts(doc: LayoutDoc) -> dict[str, Any]:
    """How many replicas, groups, GPUs and list entries the layout has, and replicas per TP
    degree (keys are the degrees as strings, ascending)."""
    by_tp = Counter(doc.replica_tps)
    return {"replicas": len(doc.replica_ids), "groups": len(doc.group_ids), "gpus": len(doc.gpus),
            "tp_counts": {str(t): by_tp[t] for t in sorted(by_tp)}, "dropped": len(doc.dropped),
            "idle": len(doc.idle), "spares_used": len(doc.spares_used), "power_caps": len(doc.power_caps_w),
            "reasons": len(doc.reasons)}


def plan_page(doc: LayoutDoc, limit: int, offset: int) -> dict[str, Any]:
    """`limit`, `offset`, `counts` and `plan`: the plan JSON (docs/plan-json.md) with the replicas
    at indices offset .. offset + limit - 1 (none past the end)."""
    return {"limit": limit, "offset": offset, "counts": counts(doc),
            "plan": doc.to_dict(offset, offset + limit, LIST_MAX)}


def replica_summaries(doc: LayoutDoc, start: int, stop: int) -> list[dict[str, Any]]:
    """The replicas at indices start .. stop - 1 as a job and its history show them: TP degree
    (the lowest stage's), batch, each stage's TP degree, and the groups that moved into it (replica
    or stage changed) with where they were."""
    out = []
    for r in doc.replicas[start:stop]:
        out.append({"id": r.id, "tp": r.tp, "local_batch": r.local_batch, "stage_tp": list(r.stage_tp),
                    "moved": [m._asdict() for m in doc.moved_into(r)]})
    return out


def summary(doc: LayoutDoc, replicas_limit: int) -> dict[str, Any]:
    """A layout in a list of them: throughput, batch, moves, counts and its first replicas."""
    return {"relative_throughput": doc.relative_throughput, "global_batch": doc.global_batch,
            "moves": None if doc.moves is None else doc.moves._asdict(), "counts": counts(doc),
            "replicas": replica_summaries(doc, 0, replicas_limit)}
