"""Plan -> plain JSON-able dict. The shape is documented in docs/plan-json.md; keep it additive."""

from __future__ import annotations

from typing import Any

from ntp_manager.planner.plan import Plan, SetAside

PLAN_SCHEMA_VERSION = 1


def _aside(s: SetAside) -> dict[str, Any]:
    return {"group": s.group_id, "domain": s.domain, "usable": s.usable, "spare": s.spare, "reason": s.reason}


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return {
        "schema": PLAN_SCHEMA_VERSION,
        "job": plan.job,
        "scheme": plan.scheme.value,
        "tp": plan.tp,
        "global_batch": plan.global_batch,
        "target_batch": plan.target_batch,
        "relative_throughput": round(plan.relative_throughput, 6),
        "meets_target": plan.meets_target,
        "replicas": [
            {
                "id": r.replica_id,
                "tp": r.tp,
                "local_batch": r.local_batch,
                "relative_throughput": round(r.relative_throughput, 6),
                "groups": [
                    {
                        "group": g.group_id,
                        "domain": g.domain,
                        "stage": g.stage,
                        "tp": g.tp,
                        "usable": g.usable,
                        "spare": g.spare,
                        "power_ratio": g.power_ratio,
                        "gpus": list(g.gpus),
                        "prev_replica": g.prev_replica,
                        "prev_stage": g.prev_stage,
                    }
                    for g in r.groups
                ],
            }
            for r in plan.replicas
        ],
        "dropped": [_aside(s) for s in plan.dropped],
        "idle": [_aside(s) for s in plan.idle],
        "spares_used": list(plan.spares_used),
        "power_caps_w": dict(sorted(plan.power_caps_w.items())),
        "reasons": list(plan.reasons),
        "moves": None
        if plan.moves is None
        else {
            "moved": plan.moves.moved,
            "stage_changed": plan.moves.stage_changed,
            "joined": plan.moves.joined,
            "left": plan.moves.left,
            "bytes": plan.moves.bytes,
        },
    }
