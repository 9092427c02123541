"""Liveness: owns turning a node's silence into its GPUs' health (suspect, then failed).

Each monitor pass asks `policy.liveness` about every GPU of every node not heard from within
`suspect_after_s`, and submits the transitions as one group-committed transaction (a report that
lands in the same batch is taken into account: the decision is made again on the transaction's
view). A returning agent's GPUs are healed at registration (`policy.reconnect`, service/agents.py).

A manager that has just become the leader (a start, a failover) loads every node as seen
`takeover_grace_s` from now: agents are reconnecting to it then, and their silence says nothing
about their GPUs. So a failover fails no GPU by silence, and never trips the breaker, before
`takeover_grace_s + fail_after_s`, nor makes one suspect before `takeover_grace_s +
suspect_after_s`; an agent that registers with the new leader is judged from then on, as always.
"""

from __future__ import annotations

from ntp_manager.service import policy
from ntp_manager.service.kernel import Kernel, Tx
from ntp_manager.service.state import HealthSource, health_to
from ntp_manager.settings import Settings


class Liveness:
    def __init__(self, kernel: Kernel, settings: Settings) -> None:
        self.kernel = kernel
        self.options = policy.LivenessOptions(settings.suspect_after_s, settings.fail_after_s)
        self.quiet_until = 0.0  # monotonic; nodes loaded at a takeover count as seen at this time

    async def check(self) -> int:
        """One monitor pass; returns how many GPUs changed health."""
        now = self.kernel.clock.monotonic()
        w = self.kernel.world
        todo: list[tuple[str, str, float]] = []  # (gpu, node, last seen)
        for node in w.nodes.values():
            if now - node.last_seen <= self.options.suspect_after_s:
                continue
            for u in node.gpus:
                if policy.liveness(now, node.last_seen, node.name, w.gpus[u].health, self.options).health:
                    todo.append((u, node.name, node.last_seen))
        if not todo:
            return 0

        async def write(tx: Tx) -> int:
            changed = 0
            for u, node, seen in todo:
                g = tx.gpu(u)
                d = policy.liveness(now, seen, node, g.health, self.options)
                if d.health is None:
                    continue
                tx.event(g, d.health, [d.reason], source="heartbeat")
                tx.change_gpu(u, health_to(d.health, d.reason, HealthSource.HEARTBEAT, tx.now))
                changed += 1
            return changed

        return await self.kernel.submit("heartbeat-monitor", write)
