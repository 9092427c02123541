"""Operator actions on GPUs and nodes: owns the admin state (cordoned, draining, maintenance, with
owner and reason), mark-healthy, and node drains. Automation never undoes an operator state: the
effective state is the admin state when set (store/models.py).

Every action runs inside the caller's transaction (the REST edge opens it, with the idempotency
record) and is audited there; the GPU views returned show the state as it will be once it commits.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core.errors import FailedPrecondition, InvalidArgument, NotFound
from ntp_manager.service.core.kernel import Kernel, Tx
from ntp_manager.service.core.state import GpuRec, HealthSource, NodeChange, NodeRec, admin_to, health_to
from ntp_manager.service.ingest.agents import Agents, Drain
from ntp_manager.service.operations.queries import gpu_view


class Operators:
    def __init__(self, kernel: Kernel, agents: Agents) -> None:
        self.kernel = kernel
        self.agents = agents

    def gpu(self, uuid: str) -> GpuRec:
        rec = self.kernel.world.gpus.get(uuid)
        if rec is None:
            raise NotFound(f"unknown GPU {uuid!r}")
        return rec

    def node(self, name: str) -> NodeRec:
        rec = self.kernel.world.nodes.get(name)
        if rec is None:
            raise NotFound(f"unknown node {name!r}")
        return rec

    def set_admin(self, tx: Tx, uuids: list[str], admin: GpuState | None, reason: str,
                  only_if: GpuState | None = None, action: str = "") -> list[str]:
        """Set (or clear, admin=None) the operator state of GPUs; returns those changed."""
        changed = []
        for u in uuids:
            self.gpu(u)
            rec = tx.gpu(u)
            if only_if is not None and rec.admin != only_if:
                continue
            if rec.admin == admin and (admin is None or rec.admin_reason == reason):
                continue
            before = {"state": rec.state, "admin": rec.admin, "owner": rec.admin_owner, "reason": rec.admin_reason}
            change = admin_to(admin, tx.actor, reason)
            tx.audit(tx.now, action or f"gpu.{admin or 'clear'}", u, before=before,
                     after={"admin": admin, "owner": change["admin_owner"], "reason": change["admin_reason"]},
                     reason=reason)
            tx.change_gpu(u, change)
            changed.append(u)
        return changed

    async def cordon(self, tx: Tx, uuid: str, reason: str) -> dict[str, Any]:
        rec = self.gpu(uuid)
        if rec.admin not in (None, GpuState.CORDONED):
            raise FailedPrecondition(f"GPU {uuid} is {rec.admin}; clear that first")
        self.set_admin(tx, [uuid], GpuState.CORDONED, reason, action="gpu.cordon")
        return gpu_view(tx.gpu(uuid))

    async def uncordon(self, tx: Tx, uuid: str, reason: str) -> dict[str, Any]:
        rec = self.gpu(uuid)
        if rec.admin != GpuState.CORDONED:
            raise FailedPrecondition(f"GPU {uuid} is not cordoned (state {rec.state})")
        self.set_admin(tx, [uuid], None, reason, only_if=GpuState.CORDONED, action="gpu.uncordon")
        return gpu_view(tx.gpu(uuid))

    async def mark_healthy(self, tx: Tx, uuid: str, reason: str) -> dict[str, Any]:
        """Clear a health verdict (an operator's evidence); the admin state stays as it is."""
        self.gpu(uuid)
        rec = tx.gpu(uuid)
        before = rec.health
        if before != GpuState.HEALTHY:
            why = f"marked healthy: {reason}"
            tx.event(rec, GpuState.HEALTHY, [reason], source="operator")
            tx.change_gpu(uuid, health_to(GpuState.HEALTHY, why, HealthSource.OPERATOR, tx.now))
        tx.audit(tx.now, "gpu.mark_healthy", uuid, before={"health": before}, after={"health": "healthy"},
                 reason=reason)
        return gpu_view(tx.gpu(uuid))

    async def drain_node(self, tx: Tx, node: str, deadline: datetime, reason: str) -> dict[str, Any]:
        rec = self.node(node)
        if deadline <= tx.now:
            raise InvalidArgument("drain deadline must be in the future")
        tx.change_node(node, NodeChange(drain_deadline=deadline, drain_reason=reason))
        busy = [u for u in rec.gpus if tx.gpu(u).admin not in (GpuState.CORDONED, GpuState.MAINTENANCE)]
        self.set_admin(tx, busy, GpuState.DRAINING, reason, action="gpu.drain")
        tx.audit(tx.now, "node.drain", node, after={"deadline": deadline.isoformat()}, reason=reason)
        tx.after.append(lambda: self.agents.send(node, Drain(deadline, reason)) and None)
        return {"node": node, "drain_deadline": deadline.isoformat(), "reason": reason, "gpus": busy}

    async def undrain_node(self, tx: Tx, node: str, reason: str) -> dict[str, Any]:
        rec = self.node(node)
        tx.change_node(node, NodeChange(drain_deadline=None, drain_reason=None))
        cleared = self.set_admin(tx, list(rec.gpus), None, reason, only_if=GpuState.DRAINING, action="gpu.undrain")
        cleared += self.set_admin(tx, list(rec.gpus), None, reason, only_if=GpuState.MAINTENANCE,
                                  action="gpu.undrain")
        tx.audit(tx.now, "node.undrain", node, reason=reason)
        return {"node": node, "cleared": cleared}
