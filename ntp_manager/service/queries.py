"""Read views of the service's state for the edges (REST, dashboard, CLI): plain dicts and lists,
built from memory or read from the store. Nothing here changes anything."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from ntp_manager.service.state import GpuRec
from ntp_manager.store.models import MaintenanceRow


def gpu_view(g: GpuRec) -> dict[str, Any]:
    return {
        "uuid": g.uuid, "node": g.node, "domain": g.domain, "index": g.idx,
        "state": g.state, "health": g.health, "health_reason": g.health_reason,
        "admin": g.admin, "admin_owner": g.admin_owner if g.admin else None,
        "admin_reason": g.admin_reason if g.admin else None,
        "tdp_w": g.tdp_mw / 1000, "min_w": g.min_mw / 1000, "max_w": g.max_mw / 1000,
        "desired_w": None if g.desired_mw is None else g.desired_mw / 1000,
        "enforced_w": None if g.enforced_mw is None else g.enforced_mw / 1000,
    }


def aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def maintenance_view(row: MaintenanceRow) -> dict[str, Any]:
    return {
        "id": row.id, "target_kind": row.target_kind, "target": row.target,
        "starts_at": aware(row.starts_at).isoformat(), "ends_at": aware(row.ends_at).isoformat(),
        "reason": row.reason, "owner": row.owner, "cancelled": row.cancelled,
    }
