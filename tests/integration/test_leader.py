"""Leader election and fencing, in process: two managers on one PostgreSQL database (one leads, the
other stands by and takes over), a write that finds another epoch in the database commits nothing,
and SQLite refuses a second manager. The subprocess fault tests are in test_ha.py."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import uvicorn
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import ValidationError
from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError

from ntp_manager.api.app import create_app
from ntp_manager.contract.gpu import GpuState
from ntp_manager.contract.proto.ntp.v1 import worker_pb2, worker_pb2_grpc
from ntp_manager.rpc import server as rpc_server
from ntp_manager.rpc.server import HEALTH_SERVICES, RpcServer
from ntp_manager.service.leadership import follow as follow_mod
from ntp_manager.service.leadership import leader as leader_mod
from ntp_manager.service.leadership import loading as loading_mod
from ntp_manager.service.leadership.leader import AnotherManager, NotLeader
from ntp_manager.service.manager import GpuInventory, GpuReport, Manager
from ntp_manager.settings import Settings
from ntp_manager.store import db, lease
from ntp_manager.store.models import AuditRow, HealthEventRow, LeaderRow
from tests.fakes.clock import FakeClock
from tests.fakes.partition import Partition
from tests.integration.conftest import PG, _Server, database

needs_pg = pytest.mark.skipif(not PG, reason="NTP_TEST_POSTGRES_URL is not set (no PostgreSQL server to test against)")
SHORT = {"lease_ttl_s": 6.0, "lease_renew_s": 0.5, "takeover_grace_s": 0.0}  # a clean stop hands over at once


@contextlib.asynccontextmanager
async def pg_url(tmp_path: Path) -> AsyncIterator[str]:
    async with database("postgres", tmp_path) as url:
        yield url


def settings(tmp_path: Path, url: str, name: str, **kw: Any) -> Settings:
    return Settings(data_dir=tmp_path / name, database_url=url, leader_id=name, **{**SHORT, **kw})


async def three_managers(tmp_path: Path, url: str, **kw: Any) -> tuple[Manager, Manager, Manager]:
    """Managers "a" (started first: it leads), "b" and "c" (standbys) on one database."""
    a, b, c = (Manager(settings(tmp_path, url, name, **kw)) for name in "abc")
    for m in (a, b, c):
        await m.start()
    return a, b, c


async def lease_row(m: Manager) -> tuple[int, str]:
    async with m.sm() as s:
        row = await s.get(LeaderRow, 1)
        assert row is not None
        return row.epoch, row.holder


def cold_takeovers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Standbys take over as if their world were not current (never loaded, or being loaded again):
    the takeover loads it, the path these tests are about."""
    async def cold(self: follow_mod.Follower) -> bool:
        await self.stop()
        return False

    monkeypatch.setattr(follow_mod.Follower, "take_over", cold)


async def watch_refusal(addr: str, worker_token: str) -> grpc.aio.AioRpcError:
    """The error a layout watch for job "j" on the manager at `addr` ends with."""
    md = (("authorization", f"Bearer {worker_token}"),)
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)  # type: ignore[no-untyped-call]
        call = stub.WatchLayout(worker_pb2.WatchLayoutRequest(job="j", worker_id="w"), metadata=md)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
    return err.value


@needs_pg
async def test_one_leads_the_other_stands_by_and_takes_over_when_it_stops(tmp_path: Path) -> None:
    async with pg_url(tmp_path) as url:
        a, b = Manager(settings(tmp_path, url, "a")), Manager(settings(tmp_path, url, "b"))
        await asyncio.gather(a.start(), b.start())  # both at once: exactly one leads
        leaders = [m for m in (a, b) if m.leading]
        assert len(leaders) == 1
        first, standby = leaders[0], (b if leaders[0] is a else a)
        assert first.ready and not standby.ready
        epoch, holder = await lease_row(first)
        assert (epoch, holder) == (first.epoch, first.settings.leader_id)
        # the standby knows who leads, and refuses writes naming it
        await asyncio.sleep(0.3)
        assert standby.leadership.leader is not None and standby.leadership.leader.holder == holder
        with pytest.raises(NotLeader, match=f"the leader is {holder}"):
            async with standby.mutation("t") as tx:
                tx.audit(tx.now, "test.write", "x")
        await first.stop()  # a clean stop gives the lease up: no waiting for it to expire
        await asyncio.wait_for(standby.wait_leading(), 10)
        assert standby.epoch == epoch + 1
        assert await lease_row(standby) == (epoch + 1, standby.settings.leader_id)
        await standby.stop()


@needs_pg
async def test_a_takeover_whose_state_loads_for_longer_than_the_lease_keeps_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new leader renews the lease while it loads the world: a load that takes longer than
    lease_ttl_s (100,000 GPUs on a loaded machine) is not overtaken by the next standby (before,
    renewals began once the world was loaded; the bench saw two takeovers in a row)."""
    async with pg_url(tmp_path) as url:
        a, b, c = await three_managers(tmp_path, url, lease_ttl_s=1.5, lease_renew_s=0.2)
        assert a.leading and not b.leading and not c.leading
        real = loading_mod.load_world
        cold_takeovers(monkeypatch)

        async def slow_load(*args: Any, **kw: Any) -> Any:
            await asyncio.sleep(3.0)  # two leases long
            return await real(*args, **kw)

        monkeypatch.setattr(loading_mod, "load_world", slow_load)
        epoch, _ = await lease_row(a)
        try:
            await a.stop()  # gives the lease up: one of b and c takes it and loads for 3 s
            await asyncio.wait_for(asyncio.wait({asyncio.ensure_future(b.wait_leading()),
                                                 asyncio.ensure_future(c.wait_leading())},
                                                return_when=asyncio.FIRST_COMPLETED), 30)
            new = b if b.ready else c
            other = c if new is b else b
            await asyncio.sleep(1.0)  # a lease and a half more: the other would have taken it by now
            assert new.acting and not new.lost.is_set() and not other.leading
            assert new.epoch == epoch + 1 and await lease_row(new) == (epoch + 1, new.settings.leader_id)
        finally:
            await b.stop()
            await c.stop()


@needs_pg
async def test_a_takeover_that_cannot_load_gives_the_lease_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new leader whose state will not load does not sit on the lease (its renewals would go on
    while it never acts): it gives the lease up and stops as a lost leader does, and the next
    standby takes over at once, long before the 30 s lease would have expired."""
    async with pg_url(tmp_path) as url:
        a, b, c = await three_managers(tmp_path, url, lease_ttl_s=30.0, lease_renew_s=0.2)
        real = loading_mod.load_world
        cold_takeovers(monkeypatch)
        failed: list[int] = []

        async def fails_once(*args: Any, **kw: Any) -> Any:
            if not failed:
                failed.append(1)
                raise OSError("connection reset while loading")
            return await real(*args, **kw)

        monkeypatch.setattr(loading_mod, "load_world", fails_once)
        epoch, _ = await lease_row(a)
        try:
            await a.stop()  # gives the lease up: one of b and c takes it, cannot load, gives it up
            await asyncio.wait_for(asyncio.wait({asyncio.ensure_future(b.lost.wait()),
                                                 asyncio.ensure_future(c.lost.wait())},
                                                return_when=asyncio.FIRST_COMPLETED), 15)
            gave_up, other = (b, c) if b.lost.is_set() else (c, b)
            assert "could not load the state" in gave_up.leadership.lost_reason
            assert not gave_up.acting and gave_up.epoch == epoch + 1
            await asyncio.wait_for(other.wait_leading(), 15)  # well inside the 30 s lease
            assert other.acting and other.epoch == epoch + 2
            assert await lease_row(other) == (epoch + 2, other.settings.leader_id)
        finally:
            await b.stop()
            await c.stop()


async def test_a_manager_whose_state_will_not_load_does_not_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At start-up a load that fails is the start's error (the CLI prints it and exits non-zero),
    with the lease given up as in a takeover."""
    async def broken(*_: Any, **__: Any) -> Any:
        raise OSError("the disk went away")

    monkeypatch.setattr(loading_mod, "load_world", broken)
    m = Manager(Settings(data_dir=tmp_path))
    try:
        with pytest.raises(OSError, match="the disk went away"):
            await m.start()
        assert m.lost.is_set() and "could not load the state" in m.leadership.lost_reason and not m.acting
    finally:
        await m.stop()


@needs_pg
async def test_a_takeover_whose_load_idles_past_the_lease_still_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new leader's reads run outside a transaction: a pause between them longer than the
    idle-in-transaction timeout (one lease; a starved machine building 100,000 GPUs' records)
    does not get its session ended under the load."""
    async with pg_url(tmp_path) as url:
        short = {"lease_ttl_s": 1.5, "lease_renew_s": 0.2}
        a = Manager(settings(tmp_path, url, "a", **short))
        await a.start()
        b = Manager(settings(tmp_path, url, "b", **short))
        await b.start()
        await a.register_agent("n0", "d0", [GpuInventory("G0", 0)], "boot", "v")
        real_load = b.breaker.load

        async def after_a_pause(s: Any) -> None:
            await asyncio.sleep(3.0)  # two leases, after load_world's reads on the same session
            await real_load(s)

        monkeypatch.setattr(b.breaker, "load", after_a_pause)
        try:
            await a.stop()
            await asyncio.wait_for(b.wait_leading(), 20)
            assert b.acting and not b.lost.is_set() and "G0" in b.world.gpus
        finally:
            await b.stop()


@needs_pg
async def test_a_write_that_finds_another_epoch_commits_nothing(tmp_path: Path) -> None:
    """A leader is overtaken while a transaction of its own is open (it was paused, say): that
    transaction and every later one are refused, its memory is untouched, and it knows it lost."""
    async with pg_url(tmp_path) as url:
        a = Manager(settings(tmp_path, url, "a", lease_ttl_s=30.0, lease_renew_s=10.0))
        await a.start()
        try:
            await a.register_agent("n0", "d0", [GpuInventory("G0", 0), GpuInventory("G1", 1)], "boot", "v")
            refused = a.leadership.refused
            with pytest.raises(NotLeader):
                async with a.mutation("t") as tx:
                    tx.audit(tx.now, "test.write", "G0")
                    # another manager takes over while this transaction is open (its own connection)
                    async with a.leadership.engine.begin() as conn:
                        await conn.execute(text("UPDATE leader SET epoch = epoch + 1, holder = 'b' WHERE id = 1"))
            assert a.lost.is_set() and not a.leading
            # later writes are refused without even asking: a report, and an operator action
            with pytest.raises(NotLeader):
                await a.apply_report("n0", 1, [GpuReport("G0", "failed", ["XID 79"], [79])])
            assert a.leadership.refused == refused + 2
            assert a.world.gpus["G0"].health == GpuState.HEALTHY and a.world.nodes["n0"].last_seq == 0
            async with a.sm() as s:
                audits = await s.scalar(select(func.count()).select_from(AuditRow)
                                        .where(AuditRow.action == "test.write"))
                events = await s.scalar(select(func.count()).select_from(HealthEventRow)
                                        .where(HealthEventRow.gpu_uuid == "G0"))
                node_seq = (await s.execute(text("SELECT last_seq FROM nodes WHERE name = 'n0'"))).scalar_one()
            assert (audits, events, node_seq) == (0, 0, 0)
        finally:
            await a.stop()
        assert await lease_row(a) == (a.epoch + 1, "b")  # its stop did not release another's lease


@needs_pg
async def test_the_fence_holds_off_a_takeover_but_not_a_renewal(tmp_path: Path) -> None:
    """The row locks of store/lease.py: while a write transaction holds the fence, the leader's
    renewal goes through at once, and a takeover of the expired lease waits until that transaction
    ends (its lock_timeout fires meanwhile); once it ends, the takeover bumps the epoch and the
    transaction's fence, had it come later, would have seen the new one."""
    async with pg_url(tmp_path) as url:
        a = Manager(settings(tmp_path, url, "a", lease_ttl_s=30.0, lease_renew_s=10.0))
        await a.start()
        try:
            epoch = a.epoch
            eng = a.leadership.engine
            async with a.sm() as s, s.begin():
                assert await lease.fence(s) == epoch  # held until this block ends
                async with eng.begin() as conn:
                    await conn.exec_driver_sql("SET LOCAL lock_timeout = 2000")
                    assert await lease.renew(conn, "a", epoch, 30.0)  # not blocked (FOR SHARE blocked it)
                async with eng.begin() as conn:  # the lease runs out (as if "a" had stopped renewing)
                    await conn.exec_driver_sql("SET LOCAL lock_timeout = 2000")
                    await conn.execute(text("UPDATE leader SET expires_at = clock_timestamp() WHERE id = 1"))
                with pytest.raises(DBAPIError, match="lock timeout"):
                    async with eng.begin() as conn:
                        await conn.exec_driver_sql("SET LOCAL lock_timeout = 300")
                        await lease.acquire(conn, "b", 30.0, "", "")
            async with eng.begin() as conn:
                assert await lease.acquire(conn, "b", 30.0, "", "") == epoch + 1
            async with a.sm() as s, s.begin():
                assert await lease.fence(s) == epoch + 1
        finally:
            await a.stop()


@needs_pg
async def test_a_leader_inside_a_long_write_keeps_its_lease(tmp_path: Path) -> None:
    """A write transaction of the leader's that runs longer than the lease (a big batch on a loaded
    machine) does not hold up the renewals: the leader still leads when it commits."""
    async with pg_url(tmp_path) as url:
        a = Manager(settings(tmp_path, url, "a", lease_ttl_s=1.5, lease_renew_s=0.2))
        await a.start()
        try:
            async with a.mutation("t") as tx:
                tx.audit(tx.now, "test.long-write", "x")
                await a.leadership.fence(tx.session)
                await tx.session.execute(text("SELECT pg_sleep(3)"))  # two leases, busy (not idle)
            assert a.leading and not a.lost.is_set()
            async with a.sm() as s:
                assert await s.scalar(select(func.count()).select_from(AuditRow)
                                      .where(AuditRow.action == "test.long-write")) == 1
        finally:
            await a.stop()


@needs_pg
async def test_a_leader_whose_loop_is_held_keeps_renewing(tmp_path: Path) -> None:
    """The renewals run in a thread of their own (service/leadership/leader.py): while the manager's event loop
    is held for two leases (a starved process: every ready callback before a renewal), the lease
    in the database stays live and the leader still leads afterwards."""
    async with pg_url(tmp_path) as url:
        a = Manager(settings(tmp_path, url, "a", lease_ttl_s=1.5, lease_renew_s=0.2))
        await a.start()
        try:
            seen: list[lease.LeaseView | None] = []

            async def read() -> lease.LeaseView | None:
                eng = db.make_engine(url, "test reader", pool_size=1)
                try:
                    async with eng.connect() as c:
                        return await lease.read(c)
                finally:
                    await eng.dispose()

            def read_later() -> None:
                time.sleep(2.5)
                seen.append(asyncio.run(read()))

            reader = threading.Thread(target=read_later)
            reader.start()
            time.sleep(3.0)  # holds this loop: a renewal on it could not run
            reader.join()
            view = seen[0]
            assert view is not None and (view.epoch, view.holder) == (a.epoch, "a")
            assert view.remaining_s is not None and view.remaining_s > 0
            await asyncio.sleep(0.5)
            assert a.leading and not a.lost.is_set()
        finally:
            await a.stop()


@needs_pg
async def test_a_leader_whose_loop_is_wedged_stops_renewing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The renewal thread keeps a slow loop's lease, not a wedged one's: past max(lease,
    LOOP_STUCK_S) without a turn of the manager's loop it stops renewing and the lease is lost."""
    monkeypatch.setattr(leader_mod, "LOOP_STUCK_S", 0.0)  # the lease (1.5 s) bounds it here
    async with pg_url(tmp_path) as url:
        a = Manager(settings(tmp_path, url, "a", lease_ttl_s=1.5, lease_renew_s=0.2))
        await a.start()
        try:
            time.sleep(3.0)  # holds this loop past the lease
            await asyncio.sleep(0.1)
            assert a.lost.is_set() and "wedged" in a.leadership.lost_reason
        finally:
            await a.stop()


@needs_pg
async def test_a_leader_whose_renewals_find_another_epoch_stops(tmp_path: Path) -> None:
    async with pg_url(tmp_path) as url:
        a = Manager(settings(tmp_path, url, "a"))
        await a.start()
        try:
            async with a.leadership.engine.begin() as conn:
                await conn.execute(text("UPDATE leader SET epoch = epoch + 1, holder = 'b' WHERE id = 1"))
            await asyncio.wait_for(a.lost.wait(), 10)  # the next renewal finds the lease taken over
            assert not a.ready and "taken over" in a.leadership.lost_reason
        finally:
            await a.stop()


@needs_pg
async def test_a_leader_cut_off_from_the_database_stops_leading(tmp_path: Path) -> None:
    """A partition that drops packets: the renewal hangs rather than fails. The leader does not
    wait on it past its lease: it stops acting (its clients go elsewhere) while the call hangs."""
    async with pg_url(tmp_path) as url:
        proxy = Partition.to(url)
        await proxy.start()
        a = Manager(settings(tmp_path, proxy.url(url), "a", lease_ttl_s=2.0, lease_renew_s=0.5))
        await a.start()
        try:
            assert a.leading
            proxy.cut()
            await asyncio.wait_for(a.lost.wait(), 30)
            assert not a.leading and not a.acting and "no renewal got through" in a.leadership.lost_reason
        finally:
            proxy.heal()
            await a.stop()
            await proxy.stop()


async def test_sqlite_refuses_a_second_manager(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path)
    a = Manager(s)
    await a.start()
    b = Manager(Settings(data_dir=tmp_path))
    try:
        with pytest.raises(AnotherManager, match=r"SQLite holds one manager.*PostgreSQL"):
            await b.start()
        assert a.leading and a.ready
    finally:
        await b.engine.dispose()
        await a.stop()
    c = Manager(Settings(data_dir=tmp_path))  # the lock goes with the manager that held it
    await c.start()
    assert c.leading and c.epoch == a.epoch + 1
    await c.stop()


def test_the_lease_settings_are_checked() -> None:
    with pytest.raises(ValidationError, match=r"lease_renew_s .* at most half of lease_ttl_s"):
        Settings(lease_ttl_s=2, lease_renew_s=1.5)
    with pytest.raises(ValidationError, match="lease_ttl_s"):
        Settings(lease_ttl_s=0)


@contextlib.asynccontextmanager
async def serving(s: Settings) -> AsyncIterator[tuple[Manager, str, str]]:
    """A manager with its gRPC and REST servers on loopback, leading or standing by."""
    m = Manager(s)
    rpc = RpcServer(m)
    gport = await rpc.start("127.0.0.1", 0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    http, grpc_addr = f"127.0.0.1:{sock.getsockname()[1]}", f"127.0.0.1:{gport}"
    m.leadership.advertise(http, grpc_addr)
    server = _Server(uvicorn.Config(create_app(m), log_level="warning", lifespan="off"))  # before the lease
    await m.start()
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield m, http, grpc_addr
    finally:
        await m.begin_shutdown()
        await rpc.stop(0.2)
        server.should_exit = True
        await task
        await m.stop()


@contextlib.asynccontextmanager
async def behind_proxy(tmp_path: Path, proxied: str = "a") -> AsyncIterator[
        tuple[Partition, tuple[Manager, str, str], tuple[Manager, str, str]]]:
    """Two served managers on one PostgreSQL database with a short lease (2 s, renewed every 0.4 s):
    `a`, started first and so the leader, and the standby `b`; the one named `proxied` reaches the
    database through a proxy the test can cut, the other directly. Yields the proxy and each
    manager with its REST and gRPC addresses."""
    async with pg_url(tmp_path) as url:
        proxy = Partition.to(url)
        await proxy.start()
        fast = {"lease_ttl_s": 2.0, "lease_renew_s": 0.4}
        via = {name: proxy.url(url) if name == proxied else url for name in "ab"}
        try:
            async with serving(settings(tmp_path, via["a"], "a", **fast)) as a, \
                    serving(settings(tmp_path, via["b"], "b", **fast)) as b:
                try:
                    yield proxy, a, b
                finally:
                    proxy.heal()  # before the managers stop: their shutdown reaches the database
        finally:
            proxy.heal()
            await proxy.stop()


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


async def health_of(addr: str) -> dict[str, int]:
    """The gRPC health status of the server and of each ntp.v1 service at `addr`."""
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return {svc: (await stub.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5)).status
                for svc in HEALTH_SERVICES}


CLIENT_SERVICES = ("", rpc_server.AGENT_SERVICE, rpc_server.WORKER_SERVICE)
STANDBY = {**{svc: SERVING for svc in CLIENT_SERVICES}, rpc_server.LEADER_SERVICE: NOT_SERVING}


async def health_becomes(addr: str, want: dict[str, int], within_s: float = 10.0) -> None:
    """Health at `addr` reaches `want` (it follows the manager's state within a poll period)."""
    seen: dict[str, int] = {}
    for _ in range(int(within_s / 0.1)):
        seen = await health_of(addr)
        if seen == want:
            return
        await asyncio.sleep(0.1)
    assert seen == want


@needs_pg
async def test_a_standby_serves_clients_and_says_so(tmp_path: Path) -> None:
    """Every manager on PostgreSQL takes agents and watches, and its health says so: gRPC health
    SERVING for the agent and worker services (and the server) on leader and standby alike,
    `ntp.leader` on the leader only, following a takeover; /readyz 200 on both, /readyz?part=leader
    only on the leader. Operators' REST calls to a standby still go to the leader."""
    async with pg_url(tmp_path) as url, serving(settings(tmp_path, url, "a")) as (a, a_http, a_grpc):
        token = await a.create_token("op", "operator")
        worker = await a.create_token("w", "worker")
        async with serving(settings(tmp_path, url, "b")) as (b, b_http, b_grpc):
            assert a.leading and not b.leading
            hdr = {"Authorization": f"Bearer {token}"}
            async with httpx.AsyncClient(base_url=f"http://{b_http}", timeout=10) as c:
                health, ready = (await c.get("/healthz")), (await c.get("/readyz"))
                assert (health.status_code, health.json()["role"]) == (200, "standby")
                assert ready.status_code == 200, ready.text
                assert ready.json()["role"] == "standby" and ready.json()["serves"] == ["clients"]
                assert ready.json()["leader"] == {"epoch": a.epoch, "holder": "a", "http": a_http, "grpc": a_grpc}
                lead = await c.get("/readyz", params={"part": "leader"})
                assert (lead.status_code, lead.json()["ready"]) == (503, False)
                assert (await c.get("/readyz", params={"part": "everything"})).status_code == 422
                r = await c.get("/v1/gpus?limit=5", headers=hdr)  # a read: redirected, query kept
                assert r.status_code == 307 and r.headers["location"] == f"http://{a_http}/v1/gpus?limit=5"
                r = await c.post("/v1/jobs", json={"name": "j", "tp": 1, "replicas": 1, "local_batch": 1,
                                                   "heads": 1}, headers=hdr)  # a write: refused, naming a
                assert r.status_code == 503 and r.headers["x-ntp-leader"] == f"http://{a_http}"
                assert r.json()["leader"]["http"] == a_http and "standby" in r.json()["detail"]
            async with httpx.AsyncClient(base_url=f"http://{a_http}", timeout=10) as c:
                ready = (await c.get("/readyz")).json()
                assert (ready["ready"], ready["role"], ready["serves"]) == (True, "leader", ["clients", "leader"])
                assert (await c.get("/readyz", params={"part": "leader"})).status_code == 200
                assert (await c.get("/v1/status", headers=hdr)).status_code == 200
            # the standby answers the watch itself (no such job), not by sending it to the leader
            err = await watch_refusal(b_grpc, worker)
            assert err.code() == grpc.StatusCode.NOT_FOUND, err.details()
            await health_becomes(a_grpc, {svc: SERVING for svc in HEALTH_SERVICES})
            await health_becomes(b_grpc, STANDBY)
            async with grpc.aio.insecure_channel(b_grpc) as ch:
                watch = health_pb2_grpc.HealthStub(ch).Watch(
                    health_pb2.HealthCheckRequest(service=rpc_server.LEADER_SERVICE))
                assert (await watch.read()).status == NOT_SERVING
                # the leader goes: the standby takes over and adds the leader's part
                await a.stop()
                await asyncio.wait_for(b.wait_leading(), 10)
                assert (await asyncio.wait_for(watch.read(), 10)).status == SERVING  # flipped on takeover
                watch.cancel()
            assert await health_of(b_grpc) == {svc: SERVING for svc in HEALTH_SERVICES}
            async with httpx.AsyncClient(base_url=f"http://{b_http}", timeout=10) as c:
                assert (await c.get("/readyz")).json()["role"] == "leader"
                assert (await c.get("/v1/status", headers=hdr)).json()["leader_epoch"] == a.epoch + 1


@needs_pg
async def test_a_standby_cut_off_from_the_store_stops_serving_clients(tmp_path: Path) -> None:
    """A standby that cannot reach PostgreSQL for a lease says NOT_SERVING for the agent and worker
    services and 503 on /readyz (a load balancer stops sending it clients); once the store is back
    it serves again. The leader is not affected."""
    async with behind_proxy(tmp_path, proxied="b") as (proxy, (a, _, a_grpc), (b, b_http, b_grpc)):
        assert a.leading and not b.leading
        await health_becomes(b_grpc, STANDBY)
        proxy.cut()
        await health_becomes(b_grpc, {svc: NOT_SERVING for svc in HEALTH_SERVICES})
        async with httpx.AsyncClient(base_url=f"http://{b_http}", timeout=10) as c:
            r = await c.get("/readyz")
            assert r.status_code == 503 and "out of touch" in r.json()["detail"]
        assert await health_of(a_grpc) == {svc: SERVING for svc in HEALTH_SERVICES}
        proxy.heal()
        await health_becomes(b_grpc, STANDBY)
        assert not b.leading and a.leading


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=needs_pg)])
async def test_a_new_leader_gives_agents_the_grace_to_reconnect(kind: str, tmp_path: Path) -> None:
    """A takeover loads every node as seen `takeover_grace_s` from then: with suspect 6 s, fail 20 s
    and a grace of 30 s, no GPU of a silent node is suspect before 36 s or failed before 50 s
    (without the grace they would be failed at 21 s: a failover would look like a mass failure and
    trip the breaker, whose minimum here is 2 GPUs). A node whose agent comes back is judged from
    its hello on; one that never does is failed on schedule after the grace."""
    clock = FakeClock()
    async with database(kind, tmp_path) as url:
        opts = {"data_dir": tmp_path, "database_url": url, "suspect_after_s": 6, "fail_after_s": 20,
                "breaker_min_gpus": 2, "breaker_share": 0.1, **SHORT, "takeover_grace_s": 30}
        a = Manager(Settings(**opts, leader_id="a"), clock)
        await a.start()
        for n in range(2):
            await a.register_agent(f"n{n}", "d0", [GpuInventory(f"G{n}-{i}", i) for i in range(4)], "boot", "v")
        await a.stop()
        b = Manager(Settings(**opts, leader_id="b"), clock)
        await b.start()
        try:
            assert b.leading and b.epoch == a.epoch + 1
            health = lambda: {u: g.health for u, g in b.world.gpus.items()}  # noqa: E731
            for _ in range(35):  # one monitor pass a second, as the monitor loop does
                clock.advance(1)
                await b.check_heartbeats()
            assert set(health().values()) == {GpuState.HEALTHY}  # 35 s: within grace + suspect
            assert not b.breaker_open
            await b.register_agent("n0", "d0", [GpuInventory(f"G0-{i}", i) for i in range(4)], "boot", "v")
            for _ in range(16):  # to 51 s: n1 never came back
                clock.advance(1)
                b.heartbeat("n0")
                await b.check_heartbeats()
            h = health()
            assert {h[f"G0-{i}"] for i in range(4)} == {GpuState.HEALTHY}
            assert {h[f"G1-{i}"] for i in range(4)} == {GpuState.FAILED}
        finally:
            await b.stop()
