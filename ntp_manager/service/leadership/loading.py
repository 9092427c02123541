"""Loading: rebuilds the in-memory world from the store when the manager starts."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from ntp_manager.contract.gpu import GpuState
from ntp_manager.service.core import offloop
from ntp_manager.service.core.state import GpuRec, HealthSource, JobRec, LayoutRec, NodeRec, World
from ntp_manager.specfile import job_and_policy_from_dict
from ntp_manager.store.layouts import chain_length, decode_rows, newest_rows
from ntp_manager.store.models import AllocationRow, DomainRow, GpuRow, JobRow, NodeRow


async def read_world(engine: AsyncEngine, sm: async_sessionmaker[AsyncSession], base_cap: float | None,
                     now_mono: float) -> World:
    """`load_world` in a session of its own. On PostgreSQL its reads run outside any transaction
    (each statement on its own, as READ COMMITTED gives them anyway): between them this manager
    decodes and builds 100,000 GPUs' records, which on a loaded machine took longer than the
    idle-in-transaction timeout (one lease), and the server ended the session under the load. Its
    records are kept out of the garbage collector's passes (they live as long as the process)."""
    if engine.dialect.name == "postgresql":
        async with engine.connect() as c:
            conn = await c.execution_options(isolation_level="AUTOCOMMIT")
            async with sm(bind=conn) as s:
                w = await load_world(s, base_cap, now_mono)
    else:
        async with sm() as s:
            w = await load_world(s, base_cap, now_mono)
    offloop.keep_out_of_gc(every_s=0.0)
    return w


async def load_world(s: AsyncSession, base_cap: float | None, now_mono: float) -> World:
    """Domains, nodes, GPUs, jobs and each job's newest layout. Nodes get a full grace period from
    `now_mono` before they count as silent. Raises CodecError when a stored layout cannot be read
    (the manager does not start on a layout it would have to guess)."""
    w = World(base_cap=base_cap)
    # Core rows on the session's connection, not ORM objects nor the ORM session's rows: ORM object
    # loading was ~13 % of a new leader's samples in a 5,000-node takeover (bench/fleet.py
    # --profile), and the session's row processing still ~10 % at 12,500 nodes; a new leader
    # loads every domain, node and GPU on its way to serving (a failover waits for it)
    conn = await s.connection()
    for domain_id, budget in (await conn.execute(select(DomainRow.id, DomainRow.power_budget_w))).all():
        w.domains[domain_id] = budget
    node_cols = (NodeRow.name, NodeRow.domain_id, NodeRow.last_seq, NodeRow.boot_id, NodeRow.drain_deadline,
                 NodeRow.drain_reason, NodeRow.agent_version)
    for name, domain_id, last_seq, boot_id, drain_deadline, drain_reason, agent_version in (
            await conn.execute(select(*node_cols))).all():
        w.nodes[name] = NodeRec(name, domain_id, [], last_seq, boot_id, now_mono, False, drain_deadline, drain_reason,
                                agent_version)
    gpu_cols = (GpuRow.uuid, GpuRow.node, GpuRow.domain_id, GpuRow.idx, GpuRow.tdp_mw, GpuRow.min_mw,
                GpuRow.max_mw, GpuRow.health, GpuRow.health_reason, GpuRow.health_source, GpuRow.health_since,
                GpuRow.admin, GpuRow.admin_owner, GpuRow.admin_reason, GpuRow.desired_mw, GpuRow.enforced_mw,
                GpuRow.model, GpuRow.memory_bytes, GpuRow.pos, GpuRow.speed)
    states = {st.value: st for st in GpuState}
    sources = {src.value: src for src in HealthSource}
    for (uuid, node, domain, idx, tdp, lo, hi, health, reason, source, since, admin, owner, admin_reason,
         desired, enforced, model, memory, pos, speed) in (await conn.execute(select(*gpu_cols))).all():
        w.gpus[uuid] = GpuRec(
            uuid, node, domain, idx, tdp, lo, hi, states[health], reason, sources[source], since,
            None if admin is None else states[admin], owner, admin_reason, desired, enforced, model, memory, pos,
            speed,
        )
        w.by_pos[pos] = uuid
        w.nodes[node].gpus.append(uuid)
    w.next_pos = max(w.by_pos, default=-1) + 1
    for j in (await s.scalars(select(JobRow))).all():
        w.jobs[j.name] = await job_of(s, j, w, now_mono)
    return w


async def load_job(s: AsyncSession, name: str, w: World, now_mono: float) -> JobRec | None:
    """One job as the store holds it now (None when it is gone): its spec and newest layout, decoded
    against `w`'s GPU positions. What a manager following the leader reloads for every job a
    transaction touched (service/leadership/follow.py); `load_world` builds each job the same way."""
    row = await s.get(JobRow, name, populate_existing=True)
    return None if row is None else await job_of(s, row, w, now_mono)


async def job_of(s: AsyncSession, j: JobRow, w: World, now_mono: float) -> JobRec:
    spec, policy = job_and_policy_from_dict(j.spec)
    job = JobRec(j.name, spec, j.spec, policy=policy, created_at=j.created_at)
    held = (await s.execute(select(AllocationRow.domain_id, AllocationRow.kind, AllocationRow.seq)
                            .where(AllocationRow.job == j.name).order_by(AllocationRow.seq, AllocationRow.domain_id)
                            )).all()
    job.held = {d: kind for d, kind, _ in held}
    job.next_seq = max((seq for _, _, seq in held), default=-1) + 1
    if not job.held:
        job.pending_reason = "waiting for free domains (pending)"
    rows = await newest_rows(s, job.name)
    if rows:
        doc = (await offloop.run(decode_rows, rows, w.uuid_at))[-1]
        row = rows[-1]
        job.layout = LayoutRec(row.job, row.version, row.leader_epoch, doc, row.reason, row.created_at, now_mono,
                               chain_length(rows))
    return job
