"""Warm standbys (service/leadership/follow.py): a standby keeps its own world current from the
leader's world log and takes over without loading it; a row it cannot apply is quarantined and its
world loaded again; a standby behind the log is given no new clients until it has caught up.
Real managers on one PostgreSQL database, in process."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from ntp_manager.api.app import create_app
from ntp_manager.service.core.changes import GPU_FIELDS, NODE_FIELDS
from ntp_manager.service.core.state import World
from ntp_manager.service.leadership import loading as loading_mod
from ntp_manager.service.manager import GpuInventory, GpuReport, Manager
from ntp_manager.store import layout_codec, worldlog
from tests.integration.test_leader import needs_pg, pg_url, settings

pytestmark = needs_pg

JOB = {"name": "j", "tp": 2, "replicas": 2, "local_batch": 4, "min_tp": 1, "heads": 8, "mlp_columns": 32}


def snapshot(w: World) -> dict[str, Any]:
    """Everything of a world that is stored, in comparable form (layouts by their encoded body)."""
    jobs = {}
    for name, rec in w.jobs.items():
        lay = rec.layout
        jobs[name] = (rec.raw, dict(rec.held), None if lay is None else (lay.version, lay.leader_epoch, lay.reason,
                                                           layout_codec.encode(lay.doc, w.pos_of)))
    return {"gpus": {u: tuple(getattr(g, f) for f in GPU_FIELDS) for u, g in w.gpus.items()},
            "nodes": {n: (tuple(getattr(r, f) for f in NODE_FIELDS), sorted(r.gpus)) for n, r in w.nodes.items()},
            "domains": dict(w.domains), "jobs": jobs, "by_pos": dict(w.by_pos)}


async def stored_world(m: Manager) -> World:
    async with m.sm() as s:
        return await loading_mod.load_world(s, None, 0.0)


async def head(m: Manager) -> int:
    async with m.engine.connect() as c:
        return await worldlog.head(c)


async def caught_up(standby: Manager, leader: Manager, within_s: float = 10.0) -> None:
    """The standby has applied the leader's log up to its head, and read back what it named."""
    assert standby.follower is not None
    for _ in range(int(within_s / 0.05)):
        if standby.follower.cursor >= await head(leader) and snapshot(standby.world) == snapshot(leader.world):
            return
        await asyncio.sleep(0.05)
    assert snapshot(standby.world) == snapshot(leader.world)


async def layout_at_its_epoch(m: Manager, job: str, tries: int = 200) -> None:
    """Wait (at most `tries` x 50 ms) for `job`'s layout to be one `m` published at its own epoch."""
    for _ in range(tries):
        lay = m.world.jobs[job].layout
        if lay is not None and lay.leader_epoch == m.epoch:
            return
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def leader_and_standby(tmp_path: Path) -> AsyncIterator[tuple[Manager, Manager]]:
    """Managers a (leading) and b (standing by) on a database of their own, both stopped after."""
    async with pg_url(tmp_path) as url:
        a, b = Manager(settings(tmp_path, url, "a")), Manager(settings(tmp_path, url, "b"))
        await a.start()
        await b.start()
        try:
            yield a, b
        finally:
            await a.stop()
            await b.stop()


async def leader_with_job(a: Manager) -> None:
    """Two nodes of 4 GPUs registered, the job created, its first layout published."""
    for n in range(2):
        gpus = [GpuInventory(f"G{n}{i}", i) for i in range(4)]
        await a.register_agent(f"n{n}", f"d{n}", gpus, "boot", "v1")
    async with a.mutation("test") as tx:
        await a.create_job(tx, JOB)
    for _ in range(100):
        if a.world.jobs["j"].layout is not None:
            break
        await asyncio.sleep(0.05)


async def busy_leader(a: Manager) -> None:
    """Hellos, a job and its layout, a cordon, a failure report, a drain: every kind of write."""
    await leader_with_job(a)
    async with a.mutation("test") as tx:
        await a.cordon(tx, "G13", "bad cable")
    await a.apply_report("n0", 1, [GpuReport("G01", "failed", ["XID 79"], [79])])
    async with a.mutation("test") as tx:
        await a.drain_node(tx, "n1", datetime.now(UTC) + timedelta(hours=1), "maintenance")


async def test_a_standby_follows_the_leader_and_takes_over_without_loading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with leader_and_standby(tmp_path) as (a, b):
        assert a.leading and not b.leading and b.follower is not None and b.follower.loads == 1
        await busy_leader(a)
        await caught_up(b, a)
        layout = b.world.jobs["j"].layout
        assert layout is not None and b.world.gpus["G13"].admin is not None
        assert b.world.gpus["G01"].health == "failed" and b.world.nodes["n1"].drain_reason == "maintenance"
        assert b.follower.applied > 0 and b.follower.quarantined == [] and not b.follower.behind
        assert b.world.owners() == a.world.owners() and set(b.world.owners().values()) == {"j"}
        # the standby's copy is what the store holds, record for record
        assert snapshot(b.world) == snapshot(await stored_world(b))

        loads: list[int] = []
        real = loading_mod.load_world

        async def counted(*args: Any, **kw: Any) -> World:
            loads.append(1)
            return await real(*args, **kw)

        monkeypatch.setattr(loading_mod, "load_world", counted)
        await a.stop()  # gives the lease up
        await asyncio.wait_for(b.wait_leading(), 15)
        assert loads == [] and b.acting  # took over on the world it followed
        # and leads on it: a report is applied, the job replanned at the new epoch
        await b.apply_report("n0", 2, [GpuReport("G02", "failed", ["XID 79"], [79])])
        await layout_at_its_epoch(b, "j")
        lay = b.world.jobs["j"].layout
        assert lay is not None and lay.leader_epoch == b.epoch and lay.version > layout.version
        assert snapshot(b.world) == snapshot(await stored_world(b))


async def test_a_row_a_standby_cannot_apply_is_quarantined_and_its_world_loaded_again(tmp_path: Path) -> None:
    async with leader_and_standby(tmp_path) as (a, b):
        assert b.follower is not None
        await a.register_agent("n0", "d0", [GpuInventory("G0", 0)], "boot", "v1")
        await caught_up(b, a)
        bad = ['{"v": 1, "gpus": [["X", "nowhere", "d0", 0, 700000, 100000, 700000, "healthy", "", "agent", '
               'null, null, null, null, null, null, "", 0, 99, null]]}', '{"v": 99}', '[1, 2]']
        for n, body in enumerate(bad, 1):  # one at a time: each reload starts past the rows before it
            async with a.sm() as s, s.begin():  # not the leader's: the rows stand for a corrupted log
                await s.execute(text("INSERT INTO world_log (epoch, body, created_at) "
                                     "VALUES (1, CAST(:b AS json), now())"), {"b": body})
                await s.execute(text("SELECT pg_notify('ntp_world', '0')"))
            for _ in range(200):
                if len(b.follower.quarantined) == n and not b.follower.stale:
                    break
                await asyncio.sleep(0.05)
        reasons = [r for _, r in b.follower.quarantined]
        assert len(reasons) == 3, reasons
        assert "unknown node 'nowhere'" in reasons[0] and "version 99" in reasons[1]
        assert "not an object" in reasons[2]
        assert "X" not in b.world.gpus and b.follower.loads >= 2  # never left wrong: loaded again
        # and it follows on from there
        await a.register_agent("n1", "d1", [GpuInventory("G1", 0)], "boot", "v1")
        await caught_up(b, a)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(b)), base_url="http://b") as c:
            world = (await c.get("/readyz")).json()["world"]
        assert world["quarantined"] == 3 and world["warm"] and not world["behind"]


async def test_a_standby_behind_the_log_takes_no_new_clients_until_it_catches_up(tmp_path: Path) -> None:
    async with pg_url(tmp_path) as url:
        a = Manager(settings(tmp_path, url, "a"))
        b = Manager(settings(tmp_path, url, "b", fleet_follow_max_lag_rows=5))
        await a.start()
        await b.start()
        try:
            assert b.follower is not None and b.serving()[0]
            # the leader's notification says the log is 50 rows ahead of what this standby applied
            b.follower.notify(str(b.follower.cursor + 50))
            assert b.follower.behind and not b.serving()[0]
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(b)), base_url="http://b") as c:
                r = await c.get("/readyz")
                assert r.status_code == 503 and r.json()["world"]["lag_rows"] >= 50
                assert "behind the leader's log" in r.json()["detail"]
                # its read finds nothing more committed: caught up, clients again
                for _ in range(100):
                    if not b.follower.behind:
                        break
                    await asyncio.sleep(0.05)
                r = await c.get("/readyz")
                assert r.status_code == 200 and r.json()["world"]["lag_rows"] == 0
        finally:
            await a.stop()
            await b.stop()


async def test_a_standby_whose_rows_were_pruned_loads_the_world_again(tmp_path: Path) -> None:
    async with leader_and_standby(tmp_path) as (a, b):
        assert b.follower is not None
        await b.follower.stop()  # paused: it misses what follows
        await a.register_agent("n0", "d0", [GpuInventory("G0", 0)], "boot", "v1")
        await a.register_agent("n1", "d0", [GpuInventory("G1", 0)], "boot", "v1")
        async with a.sm() as s, s.begin():
            now = datetime.now(UTC)
            assert await worldlog.prune(s, now + timedelta(seconds=5), a.epoch, now) >= 1
        async with a.mutation("test") as tx:  # one row after the pruned ones
            await a.cordon(tx, "G0", "x")
        b.follower.start_following()
        await caught_up(b, a)
        assert b.follower.loads == 2 and b.world.gpus["G0"].admin is not None and "G1" in b.world.gpus


async def test_the_followers_driver_statements_read_what_a_session_reads(tmp_path: Path) -> None:
    """A follower reads the log and the pruned mark as one statement each on a kept connection
    (store/worldlog.py `read_after_kept`, `pruned_upto_kept`): the same as the session's queries,
    before and after a prune."""
    from ntp_manager.store.db import KeptConnection

    async with leader_and_standby(tmp_path) as (a, _standby):
        kept = KeptConnection(a.engine, 5.0)
        try:
            for pruned in (False, True):
                await a.register_agent(f"n{int(pruned)}", "d0", [GpuInventory(f"G{int(pruned)}", 0)], "boot", "v1")
                if pruned:
                    async with a.sm() as s, s.begin():
                        now = datetime.now(UTC)
                        assert await worldlog.prune(s, now + timedelta(seconds=5), a.epoch, now) >= 1
                    async with a.mutation("test") as tx:
                        await a.cordon(tx, "G0", "x")
                async with a.engine.connect() as c:
                    upto = await worldlog.pruned_upto(c)
                    want = [await worldlog.read_after(c, after, 3) for after in (0, 1, upto, upto + 1)]
                assert (upto > 0) == pruned and await worldlog.pruned_upto_kept(kept) == upto
                assert [await worldlog.read_after_kept(kept, after, 3) for after in (0, 1, upto, upto + 1)] == want
                assert any(want)
        finally:
            await kept.close()


async def test_a_standby_plans_ahead_so_the_takeovers_replan_of_an_unchanged_world_is_free(tmp_path: Path) -> None:
    """A standby plans every job on its world ahead (publishing nothing): the new leader's replan of
    every job at the takeover then asks its planner nothing while no GPU changed state; the first
    state change is planned as usual."""
    async with leader_and_standby(tmp_path) as (a, b):
        await leader_with_job(a)
        await caught_up(b, a)
        assert b.follower is not None
        await b.follower.prime()
        assert b.follower.verified >= 1
        assert snapshot(b.world) == snapshot(a.world)  # planning ahead published nothing

        drafts: list[str] = []
        real = b.jobs.planner.draft

        async def counted(*args: Any, **kw: Any) -> Any:
            drafts.append("draft")
            return await real(*args, **kw)

        b.jobs.planner.draft = counted  # type: ignore[method-assign]
        before = b.world.jobs["j"].layout
        await a.stop()
        await asyncio.wait_for(b.wait_leading(), 15)
        for _ in range(100):  # the takeover's replan of every job has run
            if not b.kernel.dirty:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert drafts == [] and b.world.jobs["j"].layout is before
        await b.apply_report("n0", 1, [GpuReport("G01", "failed", ["XID 79"], [79])])
        await layout_at_its_epoch(b, "j")
        assert drafts and b.world.jobs["j"].layout is not before


async def test_a_standby_rebuilds_its_planner_snapshot_no_more_often_than_its_spacing(tmp_path: Path) -> None:
    """While a cluster registers, a standby applies every row at once but rebuilds and sends its
    planner's snapshot only once the spacing after the last time has passed (PRIME_SPACING)."""
    import time

    async with leader_and_standby(tmp_path) as (a, b):
        f = b.follower
        assert f is not None
        await a.register_agent("n0", "d0", [GpuInventory("G00", 0)], "boot", "v1")
        for _ in range(100):  # the log quiet for a second: the first rebuild and send
            if f.primed:
                break
            await asyncio.sleep(0.05)
        assert f.primed

        def prepared() -> tuple[float, float]:  # what /metrics says of them
            reg = b.metrics.registry
            return (reg.get_sample_value("ntp_world_follow_prepared_total") or 0.0,
                    reg.get_sample_value("ntp_world_follow_prepare_seconds_total") or 0.0)

        for _ in range(100):  # counted once prime() has returned
            if prepared()[0] >= 1.0:
                break
            await asyncio.sleep(0.05)
        count, seconds = prepared()
        assert count >= 1.0 and seconds > 0
        await asyncio.sleep(0.2)  # a rebuild under way ends (it sets the spacing when it does)
        f._prime_after = time.monotonic() + 3600  # as if the last one had taken 400 s
        sent, count = f.primed, prepared()[0]
        for n in range(1, 4):
            await a.register_agent(f"n{n}", f"d{n}", [GpuInventory(f"G{n}0", 0)], "boot", "v1")
        await caught_up(b, a)
        await asyncio.sleep(1.5)  # quiet for longer than SETTLE_S
        assert f.primed == sent and len(b.world.gpus) == 4  # the rows applied, no rebuild sent
        assert prepared()[0] == count
        f._prime_after = 0.0  # the spacing has passed (the rebuild was put off until then)
        f._settle_at = time.monotonic()
        f.wake.set()
        for _ in range(100):
            if f.primed > sent:
                break
            await asyncio.sleep(0.05)
        assert f.primed > sent  # the new shape, sent once the spacing has passed
        for _ in range(100):
            if prepared()[0] > count:
                break
            await asyncio.sleep(0.05)
        assert prepared()[0] == count + 1


async def test_a_standby_reads_the_jobs_back_in_bounded_time_while_rows_keep_coming(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The jobs the rows name are read back once the log is quiet, and no later than SETTLE_MAX_S
    after the first row that named one however busy it stays (here: never quiet long enough)."""
    from ntp_manager.service.leadership import follow

    monkeypatch.setattr(follow, "SETTLE_S", 3600.0)
    monkeypatch.setattr(follow, "SETTLE_MAX_S", 0.5)
    async with leader_and_standby(tmp_path) as (a, b):
        await leader_with_job(a)
        for _ in range(200):
            if "j" in b.world.jobs and b.world.jobs["j"].layout is not None:
                break
            await asyncio.sleep(0.05)
        assert "j" in b.world.jobs and b.world.jobs["j"].layout is not None
