"""Loading the world a new leader starts from (service/leadership/loading.py): what the store holds of a node
comes back as it was stored (nodes are read as plain rows, not ORM objects)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import insert

from ntp_manager.service.core.kernel import DOMAINS, NODES
from ntp_manager.service.leadership.loading import load_world
from ntp_manager.service.manager import Manager
from ntp_manager.settings import Settings
from ntp_manager.store import db


async def test_a_drained_node_loads_with_its_drain_and_sequence(db_url: str) -> None:
    m = Manager(Settings(database_url=db_url))
    try:
        await db.upgrade(m.engine)
        now = datetime.now(UTC).replace(microsecond=0)
        async with m.sm() as s, s.begin():
            await s.execute(insert(DOMAINS), [{"id": "nvl-0", "power_budget_w": None, "created_at": now}])
            await s.execute(insert(NODES), [
                {"name": "node-0", "domain_id": "nvl-0", "boot_id": "b1", "agent_version": "1.2", "last_seq": 41,
                 "drain_deadline": now + timedelta(hours=1), "drain_reason": "bios update", "registered_at": now},
                {"name": "node-1", "domain_id": "nvl-0", "boot_id": "b2", "agent_version": "1.3", "last_seq": 0,
                 "drain_deadline": None, "drain_reason": None, "registered_at": now}])
        async with m.sm() as s:
            w = await load_world(s, None, 123.0)
        a, b = w.nodes["node-0"], w.nodes["node-1"]
        assert (a.name, a.domain, a.last_seq, a.boot_id, a.agent_version) == ("node-0", "nvl-0", 41, "b1", "1.2")
        assert a.drain_deadline == now + timedelta(hours=1) and a.drain_reason == "bios update"
        assert a.last_seen == 123.0 and a.connected is False and a.gpus == []
        assert b.drain_deadline is None and b.drain_reason is None and b.last_seq == 0
    finally:
        await m.engine.dispose()
