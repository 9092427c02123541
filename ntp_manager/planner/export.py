"""Plan -> plain JSON-able dict. The shape is documented in docs/plan-json.md; keep it additive.

The shape is `LayoutDoc.to_dict` (planner/layout.py): a plan and the layout the manager keeps of it
are written by the same function."""

from __future__ import annotations

from typing import Any

from ntp_manager.planner.layout import PLAN_SCHEMA_VERSION, LayoutDoc
from ntp_manager.planner.plan import Plan

__all__ = ["PLAN_SCHEMA_VERSION", "plan_to_dict"]


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    return LayoutDoc.of(plan).to_dict()
