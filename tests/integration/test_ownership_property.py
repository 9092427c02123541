"""Property (issue 41): whatever happens, no GPU is in two jobs' layouts, and every layout lies in the
domains its job owns.

Random sequences (seeded, so a failure replays) of job creations (named domains or none, queued or
not, priorities, preemptible, min_throughput), deletions, GPU failures and repairs (agent reports on
gRPC), cordons and uncordons and priority changes (REST) go through a real manager, on SQLite and on
PostgreSQL. After every step the invariant is checked in the manager's memory at once (a step's
effects are still being planned then), and again once the manager is quiet, together with the store:
the allocation rows equal the memory's holdings, and the newest stored layouts obey it too."""

from __future__ import annotations

import asyncio
import os
import random
from pathlib import Path

import pytest
from sqlalchemy import select

from ntp_manager.service.core.state import World
from ntp_manager.service.leadership.loading import load_world
from ntp_manager.store.models import AllocationRow, AuditRow
from tests.integration.conftest import Service, eventually, running_service
from tests.integration.test_ownership import start_agents

DOMAINS = [f"d{i}" for i in range(6)]
STEPS = 36


def check(w: World, where: str) -> None:
    """The invariant over one world: domains owned once, layouts disjoint and inside their job's domains."""
    owner: dict[str, str] = {}
    for j in w.jobs.values():
        for d in j.held:
            assert d not in owner, f"{where}: domain {d} owned by {owner[d]!r} and {j.name!r}"
            owner[d] = j.name
    user: dict[str, str] = {}
    for j in w.jobs.values():
        if j.layout is None:
            continue
        for u in j.layout.doc.gpus:
            assert u not in user, f"{where}: GPU {u} in the layouts of {user[u]!r} and {j.name!r}"
            user[u] = j.name
            assert w.gpus[u].domain in j.held, (f"{where}: job {j.name!r}'s layout names {u} of domain "
                                                f"{w.gpus[u].domain}, which it does not own ({list(j.held)})")


async def quiet(svc: Service) -> None:
    m = svc.manager
    k, own, share = m.kernel, m.jobs.ownership, m.sharing

    def idle() -> bool:  # a replan takes its job out of the dirty set first: it counts on its own
        return not k.dirty and m.jobs.replanning is None and not own.placing.busy and not share.passes.busy

    for _ in range(3):  # idle three looks in a row: a commit's follow-ups have been scheduled and run
        await eventually(idle, 20)
        await asyncio.sleep(0.03)


async def check_store(svc: Service, where: str) -> None:
    m = svc.manager
    async with m.sm() as s:
        rows = {d: j for d, j in (await s.execute(select(AllocationRow.domain_id, AllocationRow.job))).all()}
        stored = await load_world(s, None, 0.0)
        audit = [(a.action, a.target, a.before, a.after) for a in (await s.scalars(
            select(AuditRow).where(AuditRow.action.like("alloc%") | AuditRow.action.like("job.%"))
            .order_by(AuditRow.id))).all()]
    memory = {d: j.name for j in m.world.jobs.values() for d in j.held}
    assert rows == memory, f"{where}: allocation rows {rows} != memory {memory}; history: {audit}"
    check(stored, f"{where} (store)")


async def drive(svc: Service, seed: int) -> dict[str, int]:
    rnd = random.Random(seed)
    agents = {a.domain: a for a in await start_agents(svc, DOMAINS)}
    failed: set[str] = set()
    cordoned: set[str] = set()
    done: dict[str, int] = {}
    n = 0
    async with svc.client() as c:
        for step in range(STEPS):
            jobs = sorted(svc.manager.world.jobs)
            kind = rnd.choice(["create", "create", "create", "delete", "fail", "repair", "cordon", "policy"])
            if kind == "create":
                n += 1
                tp = rnd.choice([2, 4])
                spec = {"name": f"j{n}", "tp": tp, "replicas": rnd.choice([1, 2, 3]), "local_batch": 8, "min_tp": 1,
                        "heads": 16, "mlp_columns": 64, "spares": rnd.choice([0, 0, 1]), "queue": rnd.random() < 0.5,
                        "priority": rnd.randrange(4), "preemptible": rnd.random() < 0.5,
                        "min_throughput": rnd.choice([0.0, 1.0])}
                if rnd.random() < 0.4:
                    spec["domains"] = rnd.sample(DOMAINS, rnd.choice([1, 2, 2]))
                r = await c.post("/v1/jobs", json=spec)
                assert r.status_code in (201, 409), r.text
                kind = f"create-{r.status_code}"
            elif kind == "delete" and jobs:
                assert (await c.delete(f"/v1/jobs/{rnd.choice(jobs)}")).status_code == 200
            elif kind == "fail" and len(failed) < 3:  # below the circuit breaker's count
                d = rnd.choice(DOMAINS)
                u = rnd.choice(agents[d].gpus)
                failed.add(u)
                await agents[d].report({u: "failed"})
            elif kind == "repair" and failed:
                u = rnd.choice(sorted(failed))
                failed.discard(u)
                await agents[svc.manager.world.gpus[u].domain].report({u: "healthy"})
            elif kind == "cordon":
                d = rnd.choice(DOMAINS)
                u = rnd.choice(agents[d].gpus)
                op = "uncordon" if u in cordoned else "cordon"
                assert (await c.post(f"/v1/gpus/{u}/{op}", json={"reason": "property"})).status_code == 200
                cordoned.symmetric_difference_update({u})
            elif kind == "policy" and jobs:
                r = await c.patch(f"/v1/jobs/{rnd.choice(jobs)}", json={"priority": rnd.randrange(6)})
                assert r.status_code == 200, r.text
            else:
                continue
            done[kind] = done.get(kind, 0) + 1
            where = f"seed {seed} step {step} ({kind})"
            check(svc.manager.world, where)  # at once, while its effects are still being planned
            await quiet(svc)
            check(svc.manager.world, where + ", quiet")
            await check_store(svc, where)
    for a in agents.values():
        await a.close()
    return done


# more seeds to search with: OWNERSHIP_SEEDS=1,2,3,... (CI runs two that grant and return domains)
SEEDS = [int(x) for x in os.environ.get("OWNERSHIP_SEEDS", "1,8").split(",")]


@pytest.mark.parametrize("seed", SEEDS)
async def test_no_gpu_in_two_jobs(db_url: str, tmp_path: Path, seed: int) -> None:
    async with running_service(db_url, tmp_path, breaker_min_gpus=8) as svc:
        done = await drive(svc, seed)
    # the sequence did exercise the paths it is about
    assert done.get("create-201", 0) >= 3 and sum(done.values()) >= STEPS // 2, done
