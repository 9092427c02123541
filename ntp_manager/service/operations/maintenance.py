"""Maintenance windows and drain deadlines: owns when GPUs enter and leave maintenance by time.

Operators add and cancel windows (a GPU, a node or a domain, over [starts_at, ends_at)); each
monitor pass asks `policy.maintenance` what every open window does now and `policy.drain_due`
whether a node's drain has run out, and carries that out through the operator states
(service/operations/operators.py), in one transaction per window or node.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core import policy
from ntp_manager.service.core.errors import InvalidArgument, NotFound
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.state import NodeChange
from ntp_manager.service.operations.operators import Operators
from ntp_manager.service.operations.queries import aware, maintenance_view
from ntp_manager.store.models import MaintenanceRow


class Maintenance:
    def __init__(self, kernel: Kernel, operators: Operators) -> None:
        self.kernel = kernel
        self.ops = operators

    def targets(self, kind: str, target: str) -> list[str]:
        """The GPUs of a window's target; NotFound when it names nothing known."""
        w = self.kernel.world
        if kind == "gpu":
            self.ops.gpu(target)
            return [target]
        if kind == "node":
            return list(self.ops.node(target).gpus)
        if target not in w.domains:
            raise NotFound(f"unknown domain {target!r}")
        return w.gpus_of_domain(target)  # every monitor tick, per window: not a walk of every GPU

    async def add(self, tx: Tx, kind: str, target: str, starts: datetime, ends: datetime,
                  reason: str) -> dict[str, Any]:
        if kind not in ("gpu", "node", "domain"):
            raise InvalidArgument("target_kind must be gpu, node or domain")
        self.targets(kind, target)
        if ends <= starts:
            raise InvalidArgument("a maintenance window must end after it starts")
        row = MaintenanceRow(target_kind=kind, target=target, starts_at=starts, ends_at=ends, reason=reason,
                             owner=tx.actor, cancelled=False)
        tx.session.add(row)
        await tx.session.flush()
        tx.audit(tx.now, "maintenance.create", f"{kind}:{target}",
                 after={"id": row.id, "starts_at": starts.isoformat(), "ends_at": ends.isoformat()}, reason=reason)
        tx.after.append(self.kernel.wake.set)
        return maintenance_view(row)

    async def cancel(self, tx: Tx, window_id: int) -> dict[str, Any]:
        row = await tx.session.get(MaintenanceRow, window_id)
        if row is None or row.cancelled:
            raise NotFound(f"no active maintenance window {window_id}")
        row.cancelled = True
        uuids = self.targets(row.target_kind, row.target)
        self.ops.set_admin(tx, uuids, None, f"maintenance {window_id} cancelled", only_if=GpuState.MAINTENANCE,
                           action="gpu.maintenance_end")
        tx.audit(tx.now, "maintenance.cancel", f"{row.target_kind}:{row.target}", before={"id": row.id})
        return maintenance_view(row)

    async def apply_windows(self) -> None:
        """Start and end the windows whose time has come."""
        now = self.kernel.clock.now()
        async with self.kernel.sm() as s:
            rows = (await s.scalars(select(MaintenanceRow).where(MaintenanceRow.cancelled.is_(False)))).all()
        w = self.kernel.world
        for row in rows:
            try:
                uuids = self.targets(row.target_kind, row.target)
            except NotFound:
                continue
            d = policy.maintenance(now, aware(row.starts_at), aware(row.ends_at), row.id, row.reason,
                                   [(u, w.gpus[u].admin) for u in uuids])
            if d.action is policy.WindowAction.START:
                async with self.kernel.exclusive(f"maintenance:{row.id}") as tx:
                    self.ops.set_admin(tx, list(d.gpus), GpuState.MAINTENANCE, d.reason,
                                       action="gpu.maintenance_start")
            elif d.action is policy.WindowAction.END:
                async with self.kernel.exclusive(f"maintenance:{row.id}") as tx:
                    self.ops.set_admin(tx, list(d.gpus), None, d.reason, only_if=GpuState.MAINTENANCE,
                                       action="gpu.maintenance_end")
                    r = await tx.session.get(MaintenanceRow, row.id)
                    if r is not None:
                        r.cancelled = True

    async def apply_drain_deadlines(self) -> None:
        """Nodes whose drain deadline has passed: their draining GPUs enter maintenance."""
        now = self.kernel.clock.now()
        # every monitor tick, on the loop: look at draining nodes only (a policy call for each of
        # 12,500 nodes held the loop for tens of milliseconds)
        for node in [n for n in self.kernel.world.nodes.values() if n.drain_deadline is not None]:
            d = policy.drain_due(now, aware(node.drain_deadline) if node.drain_deadline else None, node.drain_reason)
            if not d.done:
                continue
            async with self.kernel.exclusive("drain-deadline") as tx:
                todo = [u for u in node.gpus if tx.gpu(u).admin == GpuState.DRAINING]
                self.ops.set_admin(tx, todo, GpuState.MAINTENANCE, d.reason, only_if=GpuState.DRAINING,
                                   action="gpu.drain_done")
                tx.change_node(node.name, NodeChange(drain_deadline=None))
                tx.audit(tx.now, "node.drain_done", node.name, reason=node.drain_reason or "")
