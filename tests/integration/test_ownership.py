"""One cluster, many jobs (issue 41): the manager owns the GPUs, a whole domain per job.

Real managers (SQLite, and PostgreSQL when NTP_TEST_POSTGRES_URL is set) with scripted agents on
gRPC: admission (named domains, chosen domains, 409 naming the owner, 422 naming the field, queue),
release on delete, the database's own refusal of a second owner when two writers race, the
allocation view, its ntpctl table and gauges; spares as reservations in the pool (admission that
keeps them covered, grants against them, their release on delete)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from ntp_manager.clock import SystemClock
from ntp_manager.service.core.errors import Conflict
from ntp_manager.service.core.kernel import Kernel
from ntp_manager.service.leadership.loading import load_world
from ntp_manager.service.planning.ownership import Ownership
from ntp_manager.specfile import job_and_policy_from_dict
from ntp_manager.store import db
from ntp_manager.store.models import AllocationRow, JobRow, LayoutRow
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.integration.conftest import Service, eventually
from tests.integration.test_ntpctl import ctl

JOB = {"name": "a", "tp": 4, "replicas": 1, "local_batch": 8, "min_tp": 2, "heads": 16, "mlp_columns": 64}


async def start_agents(svc: Service, domains: list[str], per_node: int = 4) -> list[ScriptedAgent]:
    agents = []
    for d in domains:
        node = f"node-{d}"
        a = ScriptedAgent(svc.grpc, await svc.agent_token(node), node, d, gpu_uuids(node, per_node))
        await a.connect()
        await a.wait_for(lambda a=a: a.welcome is not None)
        agents.append(a)
    await svc.manager.settled()
    return agents


def layout_domains(svc: Service, job: str) -> set[str]:
    lay = svc.manager.world.jobs[job].layout
    assert lay is not None
    return {svc.manager.world.gpus[u].domain for u in lay.doc.gpus}


async def allocations(svc: Service) -> dict[str, str]:
    async with svc.manager.sm() as s:
        return {d: j for d, j in (await s.execute(select(AllocationRow.domain_id, AllocationRow.job))).all()}


async def test_admission_refusal_queue_and_release(service: Service) -> None:
    svc = service
    agents = await start_agents(svc, ["dom-a", "dom-b"])
    async with svc.client() as c:
        r = await c.post("/v1/jobs", json=dict(JOB, domains=["dom-a"]))
        assert r.status_code == 201 and r.json()["state"] == "placed" and r.json()["domains"] == ["dom-a"]
        # the second job over the same domain: refused, naming the owner and the free GPUs
        r = await c.post("/v1/jobs", json=dict(JOB, name="b", domains=["dom-a"]))
        assert r.status_code == 409, r.text
        detail = r.json()["detail"]
        assert "job 'a' owns ['dom-a']" in detail and "4 free GPUs in 1 domain(s) ['dom-b']" in detail
        assert (await c.get("/v1/jobs/b")).status_code == 404  # nothing half-created
        # a job naming no domain gets a free one (not dom-a's GPUs)
        r = await c.post("/v1/jobs", json=dict(JOB, name="c"))
        assert r.status_code == 201 and r.json()["domains"] == ["dom-b"]
        # the cluster is full: refused, or pending when it asks to wait
        r = await c.post("/v1/jobs", json=dict(JOB, name="d"))
        assert r.status_code == 409 and "0 free GPUs" in r.json()["detail"] and "queue: true" in r.json()["detail"]
        r = await c.post("/v1/jobs", json=dict(JOB, name="d", queue=True, priority=1))
        assert r.status_code == 201 and r.json()["state"] == "pending"
        r = await c.post("/v1/jobs", json=dict(JOB, name="e", queue=True))
        assert r.status_code == 201 and r.json()["state"] == "pending"
        await eventually(lambda: svc.manager.world.jobs["a"].layout is not None
                         and svc.manager.world.jobs["c"].layout is not None)
        assert layout_domains(svc, "a") == {"dom-a"} and layout_domains(svc, "c") == {"dom-b"}
        assert await allocations(svc) == {"dom-a": "a", "dom-b": "c"}
        alloc = (await c.get("/v1/cluster/allocation")).json()
        assert [(x["domain"], x["job"]) for x in alloc["items"]] == [("dom-a", "a"), ("dom-b", "c")]
        assert alloc["pool"]["gpus"] == 0 and alloc["pending"] == ["d", "e"]  # priority first
        snap = (await c.get("/v1/snapshot")).json()  # the dashboard colours each domain by its job
        assert {d["id"]: d["job"] for d in snap["domains"]} == {"dom-a": "a", "dom-b": "c"}
        metrics = (await c.get("/metrics")).text
        assert "ntp_pool_gpus 0.0" in metrics and "ntp_jobs_pending 2.0" in metrics
        # deleting a frees its domain at once; the higher-priority pending job takes it
        assert (await c.delete("/v1/jobs/a")).status_code == 200
        await eventually(lambda: svc.manager.world.jobs["d"].held == {"dom-a": "own"})
        await eventually(lambda: svc.manager.world.jobs["d"].layout is not None)
        assert layout_domains(svc, "d") == {"dom-a"} and not svc.manager.world.jobs["e"].held
        assert await allocations(svc) == {"dom-a": "d", "dom-b": "c"}
        acts = [x["action"] for x in (await c.get("/v1/audit", params={"limit": 100})).json()["items"]]
        assert {"alloc.own", "alloc.release", "alloc.pending"} <= set(acts)
    for a in agents:
        await a.close()


async def test_bad_specs_name_the_field(service: Service) -> None:
    agents = await start_agents(service, ["dom-a"])
    async with service.client() as c:
        for bad, field in ((dict(JOB, priority=-1), "priority"), (dict(JOB, min_throughput=1.5), "min_throughput"),
                           (dict(JOB, min_throughput=-0.1), "min_throughput"), (dict(JOB, queue="yes"), "queue"),
                           (dict(JOB, preemptible=2), "preemptible")):
            r = await c.post("/v1/jobs", json=bad)
            assert r.status_code == 422 and field in r.text, (bad, r.text)
        r = await c.post("/v1/jobs", json=dict(JOB, domains=["dom-a", "nowhere"]))
        assert r.status_code == 422 and "unknown domain 'nowhere'" in r.json()["detail"]
        assert (await c.get("/v1/jobs")).json()["total"] == 0
        assert await allocations(service) == {}
    for a in agents:
        await a.close()


async def test_racing_creations_for_the_last_domain(service: Service) -> None:
    agents = await start_agents(service, ["dom-a", "dom-b"])
    async with service.client() as c:
        assert (await c.post("/v1/jobs", json=dict(JOB, name="first"))).status_code == 201
        rs = await asyncio.gather(*(c.post("/v1/jobs", json=dict(JOB, name=f"r{i}")) for i in range(4)))
        assert sorted(r.status_code for r in rs) == [201, 409, 409, 409]
        assert len(set((await allocations(service)).values())) == 2
    for a in agents:
        await a.close()


async def _writer(url: str) -> Kernel:
    """A second writer on the same database with its own view of the world (no fence: as if two
    managers both believed they led)."""
    engine = db.make_engine(url, "race", 5.0)
    k = Kernel(db.sessionmaker(engine), SystemClock())
    async with k.sm() as s:
        k.world = await load_world(s, None, 0.0)
    return k


async def test_two_writers_race_the_database_refuses_a_second_owner(service: Service) -> None:
    """Both writers see dom-a free in memory; the allocations table's primary key lets exactly one
    commit, on either store; the other's create fails as a Conflict with nothing written."""
    agents = await start_agents(service, ["dom-a"])
    url = service.manager.settings.effective_database_url
    k1, k2 = await _writer(url), await _writer(url)

    async def create(k: Kernel, name: str) -> str:
        spec, policy = job_and_policy_from_dict(dict(JOB, name=name))
        try:
            async with k.exclusive("race") as tx:
                tx.session.add(JobRow(name=name, spec=dict(JOB, name=name), created_at=tx.now, created_by="t"))
                await Ownership(k).admit(tx, name, spec, policy)
                await asyncio.sleep(0.2)  # hold the transaction open: the other writer's insert meets it
        except Conflict:
            return "conflict"
        return "won"

    outcomes = await asyncio.gather(create(k1, "x1"), create(k2, "x2"))
    assert sorted(outcomes) == ["conflict", "won"]
    async with service.manager.sm() as s:
        assert await s.scalar(select(func.count()).select_from(AllocationRow)) == 1
        assert await s.scalar(select(func.count()).select_from(JobRow)) == 1  # the loser left no job row
    for k in (k1, k2):
        engine = k.sm.kw["bind"]
        await engine.dispose()
    for a in agents:
        await a.close()


async def test_ntpctl_alloc_table(sqlite_service: Service, tmp_path: Path) -> None:
    svc = sqlite_service
    agents = await start_agents(svc, ["dom-a", "dom-b"])
    async with svc.client() as c:
        assert (await c.post("/v1/jobs", json=dict(JOB, priority=3, domains=["dom-a"]))).status_code == 201
        assert (await c.post("/v1/jobs", json=dict(JOB, name="big", replicas=4, queue=True))).status_code == 201
    rc, out, err = await ctl(svc.http, "alloc", token=svc.tokens["viewer"])
    assert rc == 0, err
    lines = out.splitlines()
    assert any("dom-a" in ln and " a " in ln and "own" in ln for ln in lines), out
    assert any("dom-b" in ln and "(pool)" in ln for ln in lines), out
    assert "pool: 4 GPUs in 1 free domain(s), 0 of them held for reservations, 4 unreserved; pending: big" in out
    for a in agents:
        await a.close()


async def settle(svc: Service, pred: Any, timeout: float = 10.0) -> None:
    """`eventually`, naming every job's domains, layout and throughput when it is not met."""
    try:
        await eventually(pred, timeout)
    except AssertionError:
        w = svc.manager.world
        state = {n: (j.held, sorted(layout_domains(svc, n)) if j.layout else None, thr(svc, n), j.pending_reason)
                 for n, j in w.jobs.items()}
        raise AssertionError(f"not met in time: {state}") from None


def thr(svc: Service, job: str) -> float:
    lay = svc.manager.world.jobs[job].layout
    return -1.0 if lay is None else lay.doc.relative_throughput


async def test_pool_grant_then_preemption_by_priority(service: Service) -> None:
    """A high-priority job that falls below its min_throughput gets a free domain from the pool;
    once the pool is empty, a preemptible lower-priority job gives up a domain (its new layout
    without it and the allocation's move in one transaction); a non-preemptible job never does."""
    svc, m = service, service.manager
    agents = await start_agents(svc, ["dom-a", "dom-b", "dom-c", "dom-d", "dom-e"])
    by_domain = {a.domain: a for a in agents}
    async with svc.client() as c:
        hi = dict(JOB, name="hi", priority=5, min_throughput=1.0, domains=["dom-a"], scheme="ntp")
        assert (await c.post("/v1/jobs", json=hi)).status_code == 201
        steady = dict(JOB, name="steady", replicas=1, domains=["dom-e"])  # not preemptible: never a victim
        assert (await c.post("/v1/jobs", json=steady)).status_code == 201
        lo = dict(JOB, name="lo", replicas=2, preemptible=True, domains=["dom-b", "dom-c"])
        assert (await c.post("/v1/jobs", json=lo)).status_code == 201
        await settle(svc, lambda: all(thr(svc, j) == 1.0 for j in ("hi", "lo", "steady")))
        # a failure in hi: the pool (dom-d) helps it
        await by_domain["dom-a"].report({by_domain["dom-a"].gpus[1]: "failed"})
        await settle(svc, lambda: m.world.jobs["hi"].held.get("dom-d") == "grant" and thr(svc, "hi") == 1.0)
        assert "dom-d" in layout_domains(svc, "hi") and m.sharing.grants == 1
        # the granted domain's node is cordoned: the pool is empty, lo (preemptible, lower priority) gives a
        # replica up
        for u in by_domain["dom-d"].gpus:
            assert (await c.post(f"/v1/gpus/{u}/cordon", json={"reason": "test"})).status_code == 200
        await settle(svc, lambda: m.world.jobs["hi"].held.get("dom-c") == "borrowed" and thr(svc, "hi") == 1.0)
        await settle(svc, lambda: m.world.jobs["lo"].layout is not None
                         and len(m.world.jobs["lo"].layout.doc.replica_ids) == 1)
        assert layout_domains(svc, "lo") == {"dom-b"} and m.world.jobs["lo"].held == {"dom-b": "own"}
        assert m.world.jobs["steady"].held == {"dom-e": "own"} and m.sharing.preemptions == 1
        # hi's layout no longer uses the cordoned granted domain and it meets its goal: dom-d goes back to the pool
        await settle(svc, lambda: "dom-d" not in m.world.jobs["hi"].held)

        async def stored() -> bool:
            return await allocations(svc) == {"dom-a": "hi", "dom-b": "lo", "dom-c": "hi", "dom-e": "steady"}

        await settle(svc, stored)
        acts = [x["action"] for x in (await c.get("/v1/audit", params={"limit": 200})).json()["items"]]
        assert {"alloc.grant", "alloc.preempt", "alloc.return"} <= set(acts)
        # steering: a policy change is checked like the spec
        r = await c.patch("/v1/jobs/lo", json={"priority": -2})
        assert r.status_code == 422 and "priority" in r.text
        r = await c.patch("/v1/jobs/lo", json={"priority": 9})
        assert r.status_code == 200 and r.json()["priority"] == 9 and m.world.jobs["lo"].policy.priority == 9
    for a in agents:
        await a.close()


async def test_a_preemption_that_fails_mid_transaction_changes_nothing(service: Service) -> None:
    """The victim's new layout and the allocation's move are one transaction: when it fails before
    its commit (as a manager killed mid-grant), neither the store nor the memory holds half of it;
    the next pass makes the whole move."""
    svc, m = service, service.manager
    agents = await start_agents(svc, ["dom-a", "dom-b", "dom-c"])
    by_domain = {a.domain: a for a in agents}
    broken = True
    crashed: list[str] = []

    async def crash(tx: Any) -> None:
        if broken and any(a["action"] == "alloc.preempt" for a in tx._audits):
            crashed.append(tx.actor)
            raise RuntimeError("the manager dies here")

    m.kernel.before_commit.append(crash)
    async with svc.client() as c:
        hi = dict(JOB, name="hi", priority=5, min_throughput=1.0, domains=["dom-a"], scheme="ntp")
        lo = dict(JOB, name="lo", replicas=2, preemptible=True, domains=["dom-b", "dom-c"])
        for spec in (hi, lo):
            assert (await c.post("/v1/jobs", json=spec)).status_code == 201
        await settle(svc, lambda: thr(svc, "hi") == 1.0 and thr(svc, "lo") == 1.0)
        lo_version = m.world.jobs["lo"].layout.version  # type: ignore[union-attr]
        await by_domain["dom-a"].report({by_domain["dom-a"].gpus[1]: "failed"})
        await settle(svc, lambda: thr(svc, "hi") < 1.0)
        await settle(svc, lambda: bool(crashed))  # the sharing pass tried, and its transaction failed
        assert m.world.jobs["lo"].held == {"dom-b": "own", "dom-c": "own"} and "dom-c" not in m.world.jobs["hi"].held
        assert m.world.jobs["lo"].layout.version == lo_version  # type: ignore[union-attr]
        assert await allocations(svc) == {"dom-a": "hi", "dom-b": "lo", "dom-c": "lo"}
        async with m.sm() as s:
            assert await s.scalar(select(func.max(LayoutRow.version)).where(LayoutRow.job == "lo")) == lo_version
        broken = False
        m.sharing.later()
        await settle(svc, lambda: m.world.jobs["hi"].held.get("dom-c") == "borrowed" and thr(svc, "hi") == 1.0)
        assert await allocations(svc) == {"dom-a": "hi", "dom-b": "lo", "dom-c": "hi"}
    for a in agents:
        await a.close()


async def test_jobs_from_before_ownership_adopt_the_domains_they_run_on(db_url: str, tmp_path: Path) -> None:
    """An upgraded store has jobs and layouts but no allocation rows: the new leader gives each such
    job the domains its layout runs on (no replan, no move), and a new job cannot take them."""
    from sqlalchemy import delete

    from tests.integration.conftest import running_service

    async with running_service(db_url, tmp_path) as svc:
        agents = await start_agents(svc, ["dom-a", "dom-b", "dom-c"])
        async with svc.client() as c:
            assert (await c.post("/v1/jobs", json=dict(JOB, name="old"))).status_code == 201
        await eventually(lambda: svc.manager.world.jobs["old"].layout is not None)
        version = svc.manager.world.jobs["old"].layout.version  # type: ignore[union-attr]
        ran_on = layout_domains(svc, "old")
        async with svc.manager.sm() as s, s.begin():
            await s.execute(delete(AllocationRow))  # as a store from before 0011 holds it
        for a in agents:
            await a.close()
    async with running_service(db_url, tmp_path) as svc:
        agents = await start_agents(svc, ["dom-a", "dom-b", "dom-c"])
        await eventually(lambda: set(svc.manager.world.jobs["old"].held) == ran_on)
        assert svc.manager.world.jobs["old"].layout.version == version  # type: ignore[union-attr]
        assert set((await allocations(svc)).keys()) == ran_on
        async with svc.client() as c:
            r = await c.post("/v1/jobs", json=dict(JOB, name="new", domains=sorted(ran_on)))
            assert r.status_code == 409 and "job 'old' owns" in r.json()["detail"]
        for a in agents:
            await a.close()


async def test_admission_keeps_the_reservations_covered_and_delete_releases_them(service: Service) -> None:
    """A job's spares are reserved in the pool, not owned: another job may take free domains only
    while the rest still covers every outstanding reservation (a job naming its domains too), and
    deleting the job releases its reservation at once."""
    svc, m = service, service.manager
    agents = await start_agents(svc, ["dom-a", "dom-b", "dom-c"])
    async with svc.client() as c:
        r = await c.post("/v1/jobs", json=dict(JOB, name="r", spares=1))
        assert r.status_code == 201 and r.json()["domains"] == ["dom-a"]  # its replica only, not its spare
        alloc = (await c.get("/v1/cluster/allocation")).json()
        assert alloc["pool"] == {"domains": 2, "gpus": 8, "reserved_gpus": 4, "unreserved_gpus": 4,
                                 "first_domains": ["dom-b", "dom-c"]}
        view = {j["name"]: j for j in alloc["jobs"]["items"]}
        assert view["r"]["reservation"] == {"groups": 1, "granted_groups": 0, "domains": 0}
        assert "ntp_pool_reserved_gpus 4.0" in (await c.get("/metrics")).text
        # one unreserved domain is left: a job without spares takes it
        r = await c.post("/v1/jobs", json=dict(JOB, name="x"))
        assert r.status_code == 201 and r.json()["domains"] == ["dom-b"]
        # what is left is r's reservation: refused naming it, whether it names the domain or not
        for spec in (dict(JOB, name="y"), dict(JOB, name="y", domains=["dom-c"])):
            r = await c.post("/v1/jobs", json=spec)
            assert r.status_code == 409, r.text
            assert "job 'r' reserves 1 group(s) of tp=4" in r.json()["detail"], r.text
            assert "4 free GPUs in 1 domain(s)" in r.json()["detail"]
        # a job with spares of its own that the pool cannot also cover is refused the same way
        r = await c.post("/v1/jobs", json=dict(JOB, name="z", spares=1))
        assert r.status_code == 409 and "reserves 1 spare group(s)" in r.json()["detail"], r.text
        assert (await c.get("/v1/jobs/y")).status_code == 404
        assert await allocations(svc) == {"dom-a": "r", "dom-b": "x"}
        r = await c.post("/v1/jobs", json=dict(JOB, name="y", queue=True))
        assert r.status_code == 201 and r.json()["state"] == "pending"
        assert "job 'r' reserves" in r.json()["pending_reason"]
        # deleting r releases its domain and its reservation: y is placed, nothing is reserved
        assert (await c.delete("/v1/jobs/r")).status_code == 200
        await settle(svc, lambda: bool(m.world.jobs["y"].held))
        alloc = (await c.get("/v1/cluster/allocation")).json()
        assert alloc["pool"]["reserved_gpus"] == 0 and alloc["pool"]["unreserved_gpus"] == 4
        assert "ntp_pool_reserved_gpus 0.0" in (await c.get("/metrics")).text
    for a in agents:
        await a.close()


async def test_a_failure_is_helped_from_the_pool_up_to_the_reservation_not_beyond(service: Service) -> None:
    """A job with spares and min_throughput 0 that falls below full throughput is granted a free
    domain against its reservation (kind `reserved`) and switches to it live; a second failure once
    its reservation is all granted gets nothing more (the unreserved domain stays in the pool)."""
    svc, m = service, service.manager
    agents = await start_agents(svc, ["dom-a", "dom-b", "dom-c", "dom-d"])
    by_domain = {a.domain: a for a in agents}
    async with svc.client() as c:
        s = dict(JOB, name="s", replicas=2, spares=1, scheme="ntp")
        r = await c.post("/v1/jobs", json=s)
        assert r.status_code == 201 and r.json()["domains"] == ["dom-a", "dom-b"], r.text
        await settle(svc, lambda: thr(svc, "s") == 1.0)
        assert layout_domains(svc, "s") == {"dom-a", "dom-b"}
        await by_domain["dom-a"].report({by_domain["dom-a"].gpus[1]: "failed"})
        await settle(svc, lambda: m.world.jobs["s"].held.get("dom-c") == "reserved" and thr(svc, "s") == 1.0)
        assert "dom-c" in layout_domains(svc, "s") and m.sharing.grants == 1
        alloc = (await c.get("/v1/cluster/allocation")).json()
        assert alloc["jobs"]["items"][0]["reservation"] == {"groups": 1, "granted_groups": 1, "domains": 1}
        assert alloc["pool"]["reserved_gpus"] == 0 and alloc["pool"]["unreserved_gpus"] == 4
        acts = (await c.get("/v1/audit", params={"limit": 100})).json()["items"]
        grant = next(x for x in acts if x["action"] == "alloc.grant")
        assert "against its reservation" in grant["reason"], grant
        # the granted domain fails too (3 of its GPUs: too few for a group): its reservation is all
        # granted and it asks for no min_throughput, so the unreserved dom-d stays in the pool
        await by_domain["dom-c"].report(dict.fromkeys(by_domain["dom-c"].gpus[1:], "failed"))
        await settle(svc, lambda: thr(svc, "s") < 1.0)
        assert not await m.sharing.step()  # nothing to do: not beyond its reservation
        assert m.world.jobs["s"].held == {"dom-a": "own", "dom-b": "own", "dom-c": "reserved"}
        assert m.sharing.grants == 1 and m.sharing.returns == 0
        assert await allocations(svc) == {"dom-a": "s", "dom-b": "s", "dom-c": "s"}
        # all repaired: the one of dom-a and dom-c its layout leaves idle goes back to the pool (dom-a: it owns
        # dom-c in its place), and its reservation is outstanding again
        await by_domain["dom-c"].report(dict.fromkeys(by_domain["dom-c"].gpus[1:], "healthy"))
        await by_domain["dom-a"].report({by_domain["dom-a"].gpus[1]: "healthy"})
        await settle(svc, lambda: len(m.world.jobs["s"].held) == 2 and thr(svc, "s") == 1.0)
        held = m.world.jobs["s"].held
        assert set(held.values()) == {"own"} and "dom-b" in held and m.sharing.returns == 1
        assert layout_domains(svc, "s") == set(held) and await allocations(svc) == dict.fromkeys(held, "s")
        view = (await c.get("/v1/cluster/allocation")).json()
        assert view["jobs"]["items"][0]["reservation"] == {"groups": 1, "granted_groups": 0, "domains": 0}
        assert view["pool"]["reserved_gpus"] == 4 and view["pool"]["unreserved_gpus"] == 4
        # deleting it releases everything it held and its reservation
        assert (await c.delete("/v1/jobs/s")).status_code == 200
        assert await allocations(svc) == {}
        view = (await c.get("/v1/cluster/allocation")).json()
        assert view["pool"]["reserved_gpus"] == 0 and view["pool"]["unreserved_gpus"] == 16
    for a in agents:
        await a.close()
