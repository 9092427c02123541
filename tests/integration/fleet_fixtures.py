"""Fleet mode (issue 30) set-up shared by the fleet tests (test_fleet.py, test_fleet_watch.py):
a fresh PostgreSQL database with tokens and the write log, real `ntp-manager serve` processes with
PostgreSQL (`fleet`, `started`), agents on chosen managers (`agents_on`), and the outbox
counters each test checks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg

from ntp_agent.core import Agent
from ntp_manager.manager_process import ManagerProcess
from ntp_manager.store import write_log
from tests.fakes.partition import Partition
from tests.integration.test_ha import LEASE, cluster, eventually, get, make_agent

# balance off unless a test turns it on: the tests place their clients on chosen managers
FLEET = {**LEASE, "NTP_FLEET_POLL_S": "0.2", "NTP_FLEET_BALANCE_S": "0"}
LEADER_TABLES = (*write_log.TABLES, "outbox_state", "outbox_quarantine", "agent_commands")


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    """test_ha's cluster with fleet mode on and the outbox's leader tables in the write log."""
    async with cluster(tmp_path, FLEET, LEADER_TABLES) as c:
        yield c


@contextlib.asynccontextmanager
async def leader_and_cut_off_standby(c: dict[str, Any]) -> AsyncIterator[tuple[ManagerProcess, ManagerProcess,
                                                                               Partition]]:
    """Manager a leading, and standby b reaching PostgreSQL through a proxy the test can cut
    (`proxy.cut()`: nobody is told, b's calls hang) with a 1 s store timeout."""
    proxy = Partition.to(c["url"])
    await proxy.start()
    try:
        a = c["start"]("a")
        await a.ready_async()
        b = c["start"]("b", via=proxy.url(c["url"]), NTP_FLEET_STORE_TIMEOUT_S="1")
        assert (await b.ready_async())["role"] == "standby"
        yield a, b, proxy
    finally:
        await proxy.stop()


async def started(c: dict[str, Any], *names: str, **extra: str) -> list[ManagerProcess]:
    """Managers started one after the other (with the settings `extra` besides FLEET): the first leads."""
    out = []
    for n in names:
        p = c["start"](n, **extra)
        await p.ready_async()
        out.append(p)
    assert out[0].info["role"] == "leader" and all(p.info["role"] == "standby" for p in out[1:])
    return out


async def agents_on(c: dict[str, Any], lists: list[list[str]]) -> tuple[list[Agent], list[Any], list[Any]]:
    agents, backends, tasks = [], [], []
    for i, managers in enumerate(lists):
        a, b = make_agent(f"node-{i}", f"nvl-{i}", c["tokens"][f"node-{i}"], managers)
        agents.append(a)
        backends.append(b)
        tasks.append(asyncio.create_task(a.run()))
    await eventually(lambda: all(a.connected.is_set() for a in agents), what="agents connected")
    return agents, backends, tasks


async def counters(pg: str) -> dict[str, int]:
    """The outbox's state: rows, the leader's cursor, quarantined rows."""
    conn = await asyncpg.connect(pg)
    try:
        head = await conn.fetchval("SELECT coalesce(max(seq), 0) FROM outbox")
        cursor = await conn.fetchval("SELECT coalesce(max(last_seq), 0) FROM outbox_state WHERE consumer = 'leader'")
        quarantined = await conn.fetchval("SELECT count(*) FROM outbox_quarantine")
        epoch = await conn.fetchval("SELECT coalesce(max(epoch), 0) FROM outbox_state")
    finally:
        await conn.close()
    return {"head": head, "cursor": cursor, "quarantined": quarantined, "epoch": epoch}


async def applied_all(pg: str) -> bool:
    c = await counters(pg)
    return bool(c["cursor"] == c["head"])


async def settled(pg: str, agent: Agent) -> bool:
    """Every report the agent has had acknowledged is applied: the node's stored seq caught up with
    it and the outbox is drained (an ack means durable, not yet applied by the leader)."""
    conn = await asyncpg.connect(pg)
    try:
        last_seq = await conn.fetchval("SELECT last_seq FROM nodes WHERE name = $1", agent.cfg.node)
    finally:
        await conn.close()
    return bool(last_seq == agent.last_acked) and await applied_all(pg)


async def layout(base: str, tok: str) -> dict[str, Any] | None:
    with contextlib.suppress(Exception):
        return dict(await get(base, tok, "/v1/jobs/llm/layout"))
    return None


async def failed_on(base: str, tok: str) -> set[str]:
    return {g["uuid"] for g in (await get(base, tok, "/v1/gpus?state=failed"))["items"]}
