"""Fleet mode (issue 30): workers on every manager. Real `ntp-manager serve` processes
on a real PostgreSQL, real agents (fake GPU backend) and real workers'
layout watches (`GrpcLayoutSource`) over gRPC on loopback.

- A worker's layout watch on a standby gets the leader's layouts (NOTIFY ntp_layouts, read from
  PostgreSQL); its acks and step reports, taken by the standby, reach the leader (the outbox).
- The leader is killed: the watch on the standby stays connected (no reconnect, same manager) and
  gets the new leader's layout at the new epoch.
- A standby that dies drops only its own watches, which reconnect to another manager; the others
  stay where they are.
- GPU counters (the fail-slow detector's evidence) of agents on a standby reach the leader.
- A standby cut off from PostgreSQL ends its watches with UNAVAILABLE (it cannot know of new
  layouts); they go to another manager and get the next layout there.
- In process: a standby reads a new layout version (a keyframe, then a delta on it) when the
  leader's NOTIFY names it, not by polling, and decodes it to what the leader holds.
- A manager holding more than its share of agents and watches tells the extra ones to move
  (`ntp-move-to`), and they go to the manager holding fewer; nothing moves back.
- In process: a leader behind on the outbox publishes its backlog and is sent no clients until it
  has caught up.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from ntp_manager.service.core.errors import NotFound
from ntp_manager.service.ingest.agents import AgentSession
from ntp_manager.service.ingest.consumer import Consumer
from ntp_manager.service.manager import GpuInventory, Manager
from ntp_manager.settings import Settings
from ntp_manager.store import outbox
from ntp_manager.worker.sources import GrpcLayoutSource, WorkerLayout
from tests.integration.conftest import PG, database
from tests.integration.fleet_fixtures import (
    agents_on,
    applied_all,
    counters,
    failed_on,
    fleet,
    layout,
    leader_and_cut_off_standby,
    started,
)
from tests.integration.test_ha import JOB, eventually, get, job_on, stop_agents

pytestmark = pytest.mark.skipif(not PG, reason="NTP_TEST_POSTGRES_URL is not set (no PostgreSQL server to test with)")


async def watch(c: dict[str, Any], managers: list[str], gpu: str) -> GrpcLayoutSource:
    """A worker's layout watch on the first of `managers` (the others to move to), once it has a layout."""
    return await asyncio.to_thread(GrpcLayoutSource, managers, c["tokens"]["worker"], "llm", gpu, None, 60.0)


async def newer(w: GrpcLayoutSource, than: WorkerLayout, what: str, timeout: float = 60) -> WorkerLayout:
    got = await asyncio.to_thread(w.wait_newer, than.version, timeout)
    assert got is not None, f"{what}: no layout after version {than.version} in {timeout} s ({w.history.error})"
    return got


async def test_a_watch_on_a_standby_stays_through_a_leader_change(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        a, b = await started(c, "a", "b")
        op = c["tokens"]["operator"]
        agents, backends, tasks = await agents_on(c, [[b.grpc, a.grpc], [b.grpc, a.grpc]])
        watches: list[GrpcLayoutSource] = []
        try:
            await job_on(a.http, op, agents)
            await eventually(lambda: layout(a.http, op), what="first layout")
            first = await layout(a.http, op)
            assert first is not None
            gpu = agents[0].statics[0].uuid
            w = await watch(c, [b.grpc, a.grpc], gpu)  # on the standby
            watches.append(w)
            got = w.latest()
            assert got is not None and w.target == b.grpc
            if (got.epoch, got.version) != (first["leader_epoch"], first["version"]):  # a newer one meanwhile
                lay = await layout(a.http, op)
                assert lay is not None and (got.epoch, got.version) == (lay["leader_epoch"], lay["version"])
            assert got.rank is not None  # the standby built this GPU's view of the layout

            # an ack and a step report taken by the standby reach the leader through the outbox
            w.ack(got, True)
            w.report_step(got, 7, 0.25, 1024)

            async def acked() -> bool:
                job = await get(a.http, op, "/v1/jobs/llm")
                return bool(job["acks"].get(str(got.version), {}).get("ok") == 1)

            await eventually(acked, what="the standby's ack applied by the leader")

            async def stepped() -> bool:
                steps = await get(a.http, op, "/v1/jobs/llm/steps")
                return any(s["step"] == 7 for s in steps["recent"])

            await eventually(stepped, what="the standby's step report applied by the leader")

            # the agents' GPU counters (the fail-slow detector's evidence) reach the leader too
            async def counters_on_leader() -> bool:
                return (await get(a.http, op, f"/v1/gpus/{gpu}"))["telemetry"] is not None

            await eventually(counters_on_leader, what="telemetry of an agent on the standby at the leader")

            # the leader dies; a GPU fails while nobody leads; b takes over and replans
            a.proc.kill()
            backends[1].inject("xid", 0, xid=79)
            took = await b.leading()
            assert took["epoch"] > got.epoch
            nxt = await newer(w, got, "the new leader's layout")
            while nxt.epoch < took["epoch"]:
                nxt = await newer(w, nxt, "the new leader's layout")
            assert nxt.epoch == took["epoch"] and len(nxt.replicas) == 1
            assert w.failovers == 0 and w.target == b.grpc  # the watch never reconnected
            assert all(x.failovers == 0 for x in agents)
            await eventually(lambda: applied_all(c["pg"]), what="the outbox applied")
            assert (await counters(c["pg"]))["quarantined"] == 0
        finally:
            for x in watches:
                x.close()
            await stop_agents(agents, tasks)


async def test_a_standby_that_dies_drops_only_its_own_watches(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        a, b, s = await started(c, "a", "b", "c")
        op = c["tokens"]["operator"]
        agents, backends, tasks = await agents_on(c, [[s.grpc, a.grpc], [s.grpc, a.grpc]])
        watches: list[GrpcLayoutSource] = []
        try:
            await job_on(a.http, op, agents)
            await eventually(lambda: layout(a.http, op), what="first layout")
            gpus = [agents[0].statics[0].uuid, agents[1].statics[0].uuid]
            on_b = await watch(c, [b.grpc, s.grpc], gpus[0])
            watches.append(on_b)
            on_c = await watch(c, [s.grpc, b.grpc], gpus[1])
            watches.append(on_c)
            assert (on_b.target, on_c.target) == (b.grpc, s.grpc)
            before_b, before_c = on_b.latest(), on_c.latest()
            assert before_b is not None and before_c is not None

            b.proc.kill()  # a standby dies: its watch moves to c, c's stays
            backends[1].inject("xid", 0, xid=79)  # a new layout, from the same leader
            got_b = await newer(on_b, before_b, "the moved watch's next layout")
            got_c = await newer(on_c, before_c, "the staying watch's next layout")
            assert got_b.epoch == got_c.epoch == a.info["epoch"]
            assert on_b.failovers >= 1 and on_b.target == s.grpc
            assert on_c.failovers == 0 and on_c.target == s.grpc
            assert a.proc.poll() is None and s.proc.poll() is None
        finally:
            for x in watches:
                x.close()
            await stop_agents(agents, tasks)


async def test_a_manager_over_its_share_tells_clients_to_move(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        a, b = await started(c, "a", "b", NTP_FLEET_BALANCE_S="1")
        op = c["tokens"]["operator"]
        agents, backends, tasks = await agents_on(c, [[b.grpc, a.grpc], [b.grpc, a.grpc]])  # both start on b
        watches: list[GrpcLayoutSource] = []
        try:
            await eventually(lambda: sorted(x.target for x in agents) == sorted([a.grpc, b.grpc])
                             and all(x.connected.is_set() for x in agents), what="one agent moved to a")
            moved = next(x for x in agents if x.target == a.grpc)
            assert moved.failovers == 1 and sum(x.failovers for x in agents) == 1
            await job_on(a.http, op, agents)
            await eventually(lambda: layout(a.http, op), what="first layout")
            for x in agents:
                watches.append(await watch(c, [b.grpc, a.grpc], x.statics[0].uuid))
            await eventually(lambda: sorted(w.target for w in watches) == sorted([a.grpc, b.grpc]),
                             what="one watch moved to a")
            before = [w.latest() for w in watches]
            # both keep working where they are: a GPU of the moved agent fails, both watches get the layout
            backends[agents.index(moved)].inject("xid", 0, xid=79)
            await eventually(lambda: failed_on(a.http, op), what="the moved agent's report applied")
            for w, old in zip(watches, before, strict=True):
                assert old is not None
                await newer(w, old, "the layout after the failure")
            assert sum(x.failovers for x in agents) == 1  # nothing moved back
            assert sorted(w.failovers for w in watches) == [0, 1]
            assert (await counters(c["pg"]))["quarantined"] == 0
        finally:
            for x in watches:
                x.close()
            await stop_agents(agents, tasks)


async def test_a_standby_reads_a_new_layout_when_the_leader_notifies_it(tmp_path: Path) -> None:
    async with database("postgres", tmp_path) as url:
        # a poll every 10 s: a layout read before then came with a notification
        kw: dict[str, Any] = {"fleet_poll_s": 10.0, "fleet_balance_s": 0,
                              "lease_ttl_s": 6.0, "lease_renew_s": 0.5, "takeover_grace_s": 0.0}
        a = Manager(Settings(data_dir=tmp_path / "a", database_url=url, leader_id="a", **kw))
        await a.start()
        b = Manager(Settings(data_dir=tmp_path / "b", database_url=url, leader_id="b", **kw))
        await b.start()
        try:
            assert a.acting and not b.leading and b.fleet is not None
            feed = b.fleet.feed
            with pytest.raises(NotFound):
                await feed.current("llm")
            for n in range(2):  # GPUs the standby has never seen: it reads their positions when it decodes
                await a.register_agent(f"node-{n}", f"nvl-{n}", [
                    GpuInventory(f"GPU-{n}-{i}", i, "H100", 80 << 30, 700_000, 200_000, 700_000) for i in range(4)],
                    "boot", "t")
            async with a.mutation("test") as tx:
                await a.create_job(tx, dict(JOB))
            await feed.current("llm")  # the job exists now: followed from here on
            first = await asyncio.wait_for(feed.wait("llm", (-1, -1)), 60)
            assert first is not None
            lead = a.world.jobs["llm"].layout
            assert lead is not None and (first.leader_epoch, first.version) == (lead.leader_epoch, lead.version)
            assert first.doc.to_dict() == lead.doc.to_dict()
            async with a.mutation("test") as tx:  # a new version: a delta on the one the standby holds
                await a.cordon(tx, "GPU-1-0", "test")
            second = await asyncio.wait_for(feed.wait("llm", (first.leader_epoch, first.version)), 60)
            assert second is not None
            lead = a.world.jobs["llm"].layout
            assert lead is not None and second.version == lead.version == first.version + 1
            assert second.doc.to_dict() == lead.doc.to_dict() and second.chain == lead.chain
            assert feed.read_on_notify == 2 and feed.read_on_poll == 0 and feed.notified >= 2
        finally:
            await b.stop()
            await a.stop()


async def test_a_standby_cut_off_from_the_database_ends_its_watches(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c, leader_and_cut_off_standby(c) as (a, b, proxy):
        op = c["tokens"]["operator"]
        agents, backends, tasks = await agents_on(c, [[a.grpc, b.grpc], [a.grpc, b.grpc]])
        watches: list[GrpcLayoutSource] = []
        try:
            await job_on(a.http, op, agents)
            await eventually(lambda: layout(a.http, op), what="first layout")
            w = await watch(c, [b.grpc, a.grpc], agents[0].statics[0].uuid)
            watches.append(w)
            old = w.latest()
            assert old is not None and w.target == b.grpc
            proxy.cut()  # b cannot reach PostgreSQL: it would never see a new layout
            await eventually(lambda: w.target == a.grpc and w.failovers >= 1, what="the watch moved to a")
            backends[1].inject("xid", 0, xid=79)
            got = await newer(w, old, "the next layout, from a")
            assert len(got.replicas) == 1 and w.target == a.grpc
        finally:
            for x in watches:
                x.close()
            await stop_agents(agents, tasks)


async def test_a_leader_behind_on_the_outbox_is_sent_no_clients_until_it_catches_up(tmp_path: Path) -> None:
    """In process: the leader's consumer stopped with outbox rows after its cursor; the leader
    publishes that backlog in `fleet_members`, and a standby over its share moves nothing to it;
    once the consumer has applied them, the standby's next pass moves agents there."""
    async with database("postgres", tmp_path) as url:
        kw: dict[str, Any] = {"fleet_poll_s": 0.2, "fleet_balance_s": 0,
                              "fleet_balance_busy_rows": 10, "lease_ttl_s": 6.0, "lease_renew_s": 0.5,
                              "takeover_grace_s": 0.0}
        a = Manager(Settings(data_dir=tmp_path / "a", database_url=url, leader_id="a", **kw))
        await a.start()
        b = Manager(Settings(data_dir=tmp_path / "b", database_url=url, leader_id="b", **kw))
        await b.start()
        try:
            assert a.acting and a.shared is not None and b.shared is not None and not b.leading
            # the addresses they publish (in process: no gRPC server, so none is set)
            a.leadership.grpc, b.leadership.grpc = "127.0.0.1:1", "127.0.0.1:2"
            consumer = next(t for t in a.fleet._tasks if t.get_name() == "fleet-consumer")
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await consumer
            async with a.sm() as s, s.begin():  # 40 rows after the cursor (liveness rows: harmless)
                await outbox.append(s, [outbox.Entry(outbox.SEEN, "", {"nodes": []}, f"seen:test:{i}")
                                        for i in range(40)], "b", a.clock.now())
            for i in range(4):  # b holds four agent streams, a none
                b.agents.sessions[f"node-{i}"] = AgentSession(f"node-{i}")

            async def backlogs() -> dict[str, int]:
                await a.shared.balance.publish()
                await b.shared.balance.publish()
                return {m.address: m.backlog for m in await b.shared.balance.members()}

            assert await backlogs() == {a.leadership.grpc: 40, b.leadership.grpc: 0}
            await b.shared.balance.balance()
            assert b.shared.balance.moved_agents == 0 and b.shared.balance.busy_passes == 1
            assert not any(x.closed for x in b.agents.sessions.values())

            a.fleet.consumer = Consumer(a)  # caught up: the next pass sends it agents
            a.fleet._tasks.append(asyncio.create_task(a.fleet.consumer.run(), name="fleet-consumer"))
            await asyncio.wait_for(a.fleet.consumer.caught_up.wait(), 30)
            assert a.fleet.consumer.applied == 40
            assert await backlogs() == {a.leadership.grpc: 0, b.leadership.grpc: 0}
            await b.shared.balance.balance()
            assert b.shared.balance.moved_agents == 2 and b.shared.balance.busy_passes == 1
            assert sum(x.closed or not x.outbox.empty() for x in b.agents.sessions.values()) == 2
        finally:
            b.agents.sessions.clear()
            await b.stop()
            await a.stop()
