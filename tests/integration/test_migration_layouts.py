"""Migration 0004 (compact layouts) on existing data, on SQLite and on PostgreSQL: GPUs get
positions, plan-JSON layout versions become compact keyframes that read back the same layout, a
version naming a GPU the store no longer holds keeps its JSON and still reads, and a downgrade
writes every version's plan JSON back as it was."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import make_plan
from ntp_manager.planner.export import plan_to_dict
from ntp_manager.planner.layout import LayoutDoc
from ntp_manager.store import db
from ntp_manager.store import layout_codec as codec
from ntp_manager.store.layouts import chain_length, decode_rows, rows_for
from ntp_manager.store.models import GpuRow, LayoutRow
from tests.fakes.builders import cluster_from_counts, job

NOW = datetime(2026, 11, 23, tzinfo=UTC)


def legacy_plans() -> tuple[list[str], list[dict[str, Any]]]:
    """Three versions of a 2-stage job on 4 domains of 4 GPUs, as the manager stored them before."""
    cluster = cluster_from_counts([4, 4, 4, 4])
    spec = job(tp=4, pp=2, replicas=2, min_tp=2)
    p1 = make_plan(cluster, spec)
    c2 = cluster.with_states({"GPU-0-3": GpuState.FAILED})
    p2 = make_plan(c2, spec, p1)
    p3 = make_plan(c2.with_states({"GPU-2-1": GpuState.FAILED}), spec, p2)
    uuids = [g.uuid for d in cluster.domains for g in d.gpus]
    return uuids, [plan_to_dict(p) for p in (p1, p2, p3)]


async def seed_0003(engine: Any, uuids: list[str], plans: list[dict[str, Any]], lost: dict[str, Any]) -> None:
    meta = sa.MetaData()
    domains = sa.Table("domains", meta, sa.Column("id", sa.String), sa.Column("power_budget_w", sa.Float),
                       sa.Column("created_at", sa.DateTime(timezone=True)))
    nodes = sa.Table("nodes", meta, sa.Column("name", sa.String), sa.Column("domain_id", sa.String),
                     sa.Column("boot_id", sa.String), sa.Column("agent_version", sa.String),
                     sa.Column("last_seq", sa.BigInteger), sa.Column("registered_at", sa.DateTime(timezone=True)))
    gpus = sa.Table("gpus", meta, sa.Column("uuid", sa.String), sa.Column("node", sa.String),
                    sa.Column("domain_id", sa.String), sa.Column("idx", sa.Integer), sa.Column("model", sa.String),
                    sa.Column("memory_bytes", sa.BigInteger), sa.Column("tdp_mw", sa.Integer),
                    sa.Column("min_mw", sa.Integer), sa.Column("max_mw", sa.Integer), sa.Column("health", sa.String),
                    sa.Column("health_reason", sa.Text), sa.Column("health_since", sa.DateTime(timezone=True)))
    layouts = sa.Table("layouts", meta, sa.Column("job", sa.String), sa.Column("version", sa.BigInteger),
                       sa.Column("leader_epoch", sa.BigInteger), sa.Column("plan", sa.JSON),
                       sa.Column("reason", sa.Text), sa.Column("created_at", sa.DateTime(timezone=True)))
    async with engine.begin() as conn:
        # registered in reverse: positions follow (domain, node, index), not insertion order
        doms = sorted({u.split("-")[1] for u in uuids})
        await conn.execute(domains.insert(), [{"id": f"d{d}", "power_budget_w": None, "created_at": NOW} for d in doms])
        await conn.execute(nodes.insert(), [{"name": f"n{d}", "domain_id": f"d{d}", "boot_id": "", "agent_version": "",
                                             "last_seq": 0, "registered_at": NOW} for d in doms])
        await conn.execute(gpus.insert(), [
            {"uuid": u, "node": f"n{u.split('-')[1]}", "domain_id": f"d{u.split('-')[1]}", "idx": int(u.split("-")[2]),
             "model": "", "memory_bytes": 0, "tdp_mw": 1_000_000, "min_mw": 200_000, "max_mw": 1_300_000,
             "health": "healthy", "health_reason": "", "health_since": NOW} for u in reversed(uuids)])
        await conn.execute(layouts.insert(), [
            {"job": "t", "version": v + 1, "leader_epoch": 1, "plan": p, "reason": f"v{v + 1}", "created_at": NOW}
            for v, p in enumerate(plans)])
        await conn.execute(layouts.insert(), [{"job": "lost", "version": 1, "leader_epoch": 1, "plan": lost,
                                               "reason": "names a GPU that is gone", "created_at": NOW}])


async def test_0004_converts_layouts_to_compact_keyframes_and_back(db_url: str) -> None:
    uuids, plans = legacy_plans()
    lost = {**copy.deepcopy(plans[0]), "job": "lost"}
    lost["replicas"][0]["groups"][0]["gpus"] = ["GPU-gone", *lost["replicas"][0]["groups"][0]["gpus"][1:]]
    engine = db.make_engine(db_url)
    sm = db.sessionmaker(engine)
    try:
        await db.upgrade(engine, "0003")
        await seed_0003(engine, uuids, plans, lost)
        await db.upgrade(engine)
        assert await db.current_revision(engine) == "0011"  # head: 0004, 0006, 0005, 0007, 0008, 0009, 0010, 0011

        async with sm() as s:
            pos = {g.uuid: g.pos for g in (await s.scalars(sa.select(GpuRow))).all()}
            # numbered in (domain, node, index) order, from 0
            assert [u for u, _ in sorted(pos.items(), key=lambda x: x[1])] == uuids
            rows = await rows_for(s, "t", 1, 3)
            lost_rows = await rows_for(s, "lost", 1, 1)
        at = {p: u for u, p in pos.items()}.__getitem__
        assert [(r.version, r.base_version, r.plan, r.body is not None) for r in rows] == [
            (1, None, None, True), (2, None, None, True), (3, None, None, True)]
        assert [d.to_dict() for d in decode_rows(rows, at)] == plans
        assert chain_length(rows) == 0
        # the version that names an unknown GPU kept its plan JSON, and reads as before
        assert lost_rows[0].body is None and lost_rows[0].plan == lost
        assert decode_rows(lost_rows, at)[0] == LayoutDoc.from_dict(lost)
        # a stored body is a fraction of the plan JSON even for this tiny job
        assert all(len(r.body or b"") < len(db.json_text(p)) / 2 for r, p in zip(rows, plans, strict=True))

        # the manager appends a delta after a converted keyframe; a downgrade writes it back as JSON too
        docs = decode_rows(rows, at)
        d4 = LayoutDoc.from_dict({**plans[1], "reasons": ["back again"]})
        async with sm() as s, s.begin():
            s.add(LayoutRow(job="t", version=4, leader_epoch=1, plan=None, body=codec.encode(d4, pos.__getitem__,
                                                                                              docs[-1]),
                            base_version=3, reason="v4", created_at=NOW))
        async with sm() as s:
            rows4 = await rows_for(s, "t", 4, 4)
        assert [r.version for r in rows4] == [3, 4] and chain_length(rows4) == 1
        assert decode_rows(rows4, at)[-1] == d4

        await db.downgrade(engine, "0003")
        layouts = sa.table("layouts", sa.column("job", sa.String), sa.column("version", sa.BigInteger),
                           sa.column("plan", sa.JSON))
        async with engine.connect() as conn:
            back = (await conn.execute(sa.select(layouts.c.job, layouts.c.version, layouts.c.plan)
                                       .order_by(layouts.c.job, layouts.c.version))).all()
            cols = await conn.run_sync(lambda c: {x["name"] for x in sa.inspect(c).get_columns("gpus")})
        assert [(j, v) for j, v, _ in back] == [("lost", 1), ("t", 1), ("t", 2), ("t", 3), ("t", 4)]
        assert [p for _, _, p in back] == [lost, *plans, d4.to_dict()]
        assert "pos" not in cols
    finally:
        await engine.dispose()
