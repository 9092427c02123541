"""Fleet mode (issue 30) on a real PostgreSQL: real `ntp-manager serve` processes with
PostgreSQL, real agents (fake GPU backend) over gRPC on loopback.

- A report a standby acknowledged is applied by the leader (and replans the job there).
- A leader change moves only the planner role: the agents' streams on the standby stay (no
  reconnect), the new leader applies the outbox from the cursor the old one left, and publishes.
- A leader paused past its lease applies nothing when it wakes (no row of the leader's tables,
  the outbox cursor included, from its sessions after the takeover) and exits.
- A report stored twice (re-sent to another manager) is applied once; a row that cannot be
  applied is quarantined with its reason and does not hold up the rows after it.
- A manager that dies drops only its own streams; their agents move, the others stay.
- A standby cut off from PostgreSQL acknowledges nothing it cannot store: it answers UNAVAILABLE,
  and the agent re-sends to another manager.
- `agent_commands` stays bounded: rows older than the retention are deleted, fenced (a manager
  that does not lead deletes nothing).
- PostgreSQL restarted (a throwaway cluster of the test's own: `initdb`/`pg_ctl`, skipped when
  absent) while an agent reports a failure: the report is acknowledged once the server is back,
  applied once, the layout follows; a leader that lost its lease meanwhile wrote nothing after.
Each checks the counters: no report applied twice, none acknowledged and lost, nothing quarantined.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import grpc
import pytest

from ntp_manager.contract.proto.ntp.v1 import agent_pb2, agent_pb2_grpc, common_pb2
from ntp_manager.manager_process import ManagerProcess
from ntp_manager.store import write_log
from tests.integration.conftest import PG, database
from tests.integration.fleet_fixtures import (
    FLEET,
    LEADER_TABLES,
    agents_on,
    applied_all,
    counters,
    failed_on,
    fleet,
    layout,
    leader_and_cut_off_standby,
    settled,
    started,
)
from tests.integration.test_ha import (
    check_reports,
    eventually,
    get,
    job_on,
    lease_since,
    make_agent,
    prepare,
    stop_agents,
)

pytestmark = pytest.mark.skipif(not PG, reason="NTP_TEST_POSTGRES_URL is not set (no PostgreSQL server to test with)")

async def test_a_report_a_standby_acknowledged_is_applied_by_the_leader(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        a, b = await started(c, "a", "b")
        op = c["tokens"]["operator"]
        agents, backends, tasks = await agents_on(c, [[b.grpc, a.grpc], [b.grpc, a.grpc]])
        try:
            assert all(x.target == b.grpc for x in agents)  # the standby took them: no redirect
            await job_on(a.http, op, agents)

            async def two_replicas() -> bool:
                lay = await layout(a.http, op)
                return lay is not None and lay["counts"]["replicas"] == 2

            await eventually(two_replicas, what="a layout on both nodes (hellos applied by the leader)")
            backends[1].inject("xid", 0, xid=79)  # node-1 fails; its agent reports to b
            await eventually(lambda: agents[1].last_acked >= 1, what="report acknowledged by the standby")
            await eventually(lambda: failed_on(a.http, op), what="the leader applied it")
            assert await failed_on(a.http, op) == {g.uuid for g in agents[1].statics}

            async def one_replica() -> bool:
                lay = await layout(a.http, op)
                return lay is not None and lay["counts"]["replicas"] == 1

            await eventually(one_replica, what="the leader replanned")
            await eventually(lambda: applied_all(c["pg"]), what="the outbox applied")
            assert (await counters(c["pg"]))["quarantined"] == 0
            assert all(x.failovers == 0 for x in agents)
            await eventually(lambda: settled(c["pg"], agents[1]), what="acknowledged reports applied")
            await check_reports(c["pg"], agents[1])
        finally:
            await stop_agents(agents, tasks)


async def test_a_leader_change_moves_only_the_planner_role(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        a, b = await started(c, "a", "b")
        op = c["tokens"]["operator"]
        agents, backends, tasks = await agents_on(c, [[b.grpc, a.grpc], [b.grpc, a.grpc]])
        try:
            await job_on(a.http, op, agents)
            await eventually(lambda: layout(a.http, op), what="first layout")
            first = await layout(a.http, op)
            assert first is not None and first["counts"]["replicas"] == 2
            before = await counters(c["pg"])
            a.proc.kill()  # SIGKILL the leader: the agents' streams are on b and stay there
            backends[1].inject("xid", 0, xid=79)
            # b stores and acknowledges it while nobody leads
            await eventually(lambda: agents[1].last_acked >= 1, what="report acknowledged with no leader")
            took = await b.leading()
            assert took["epoch"] > first["leader_epoch"]

            async def new_layout() -> bool:
                lay = await layout(b.http, op)
                return lay is not None and lay["leader_epoch"] == took["epoch"] and lay["counts"]["replicas"] == 1

            await eventually(new_layout, what="a layout at the new epoch without the failed node")
            assert await failed_on(b.http, op) == {g.uuid for g in agents[1].statics}
            await eventually(lambda: applied_all(c["pg"]), what="the outbox applied")
            after = await counters(c["pg"])
            assert after["cursor"] > before["cursor"] and after["epoch"] == took["epoch"]  # replayed from the cursor
            assert after["quarantined"] == 0
            assert all(x.failovers == 0 and x.target == b.grpc for x in agents)  # no stream reconnected
            await eventually(lambda: settled(c["pg"], agents[1]), what="acknowledged reports applied")
            await check_reports(c["pg"], agents[1])
        finally:
            await stop_agents(agents, tasks)


async def test_a_deposed_leader_applies_nothing_when_it_wakes(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        a, b = await started(c, "a", "b")
        op = c["tokens"]["operator"]
        agents, backends, tasks = await agents_on(c, [[b.grpc, a.grpc], [b.grpc, a.grpc]])
        try:
            await job_on(a.http, op, agents)
            await eventually(lambda: layout(a.http, op), what="first layout")
            a.proc.send_signal(signal.SIGSTOP)
            took = await b.leading()
            backends[1].inject("xid", 0, xid=79)  # stored by b; a would apply it if it could
            await eventually(lambda: agents[1].last_acked >= 1, what="report acknowledged")
            a.proc.send_signal(signal.SIGCONT)
            rc = await asyncio.to_thread(a.proc.wait, 60)
            assert rc == 75, a.log.read_text()[-3000:]
            since = await lease_since(c["pg"], "b")
            assert await write_log.writes_since(c["url"], "a", since) == 0  # the cursor included

            async def new_layout() -> bool:
                lay = await layout(b.http, op)
                return lay is not None and lay["leader_epoch"] == took["epoch"] and lay["counts"]["replicas"] == 1

            await eventually(new_layout, what="b's layout")
            await eventually(lambda: applied_all(c["pg"]), what="the outbox applied")
            assert (await counters(c["pg"]))["quarantined"] == 0
            assert await write_log.writes_since(c["url"], "b", since) > 0  # the log counts
            await eventually(lambda: settled(c["pg"], agents[1]), what="acknowledged reports applied")
            await check_reports(c["pg"], agents[1])
        finally:
            await stop_agents(agents, tasks)


async def _stream(target: str, token: str, node: str, gpus: list[str], seq: int) -> tuple[int, int]:
    """One agent stream by hand: hello, one report of seq `seq` (the first GPU failed); the welcome's
    last applied seq and the seq acknowledged."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = agent_pb2_grpc.AgentServiceStub(ch)  # type: ignore[no-untyped-call]
        q: asyncio.Queue[agent_pb2.AgentMessage | None] = asyncio.Queue()
        await q.put(agent_pb2.AgentMessage(hello=agent_pb2.Hello(
            node=node, domain="nvl-0", agent_version="t", boot_id="boot",
            gpus=[common_pb2.GpuInfo(uuid=u, index=i) for i, u in enumerate(gpus)])))

        async def requests() -> AsyncIterator[agent_pb2.AgentMessage]:
            while (m := await q.get()) is not None:
                yield m

        call = stub.Connect(requests(), metadata=(("authorization", f"Bearer {token}"),))
        welcome = await call.read()
        await q.put(agent_pb2.AgentMessage(report=agent_pb2.HealthReport(seq=seq, gpus=[agent_pb2.GpuHealth(
            uuid=gpus[0], state=common_pb2.GPU_STATE_FAILED, reasons=["test"])])))
        while True:
            msg = await call.read()
            if msg.WhichOneof("body") == "ack":
                await q.put(None)
                call.cancel()
                return int(welcome.welcome.last_applied_seq), int(msg.ack.seq)


async def test_a_report_stored_twice_is_applied_once(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        a, b = await started(c, "a", "b")
        tok = c["tokens"]["node-0"]
        gpus = ["GPU-dup-0", "GPU-dup-1"]
        assert await _stream(b.grpc, tok, "node-0", gpus, 1) == (0, 1)
        # the agent did not see that ack and re-sends report 1 to the leader: acknowledged, not stored
        # again (its welcome may say 1 already: then the agent would not even re-send)
        last, acked = await _stream(a.grpc, tok, "node-0", gpus, 1)
        assert acked == 1 and last in (0, 1)
        await eventually(lambda: applied_all(c["pg"]), what="the outbox applied")
        conn = await asyncpg.connect(c["pg"])
        try:
            assert await conn.fetchval("SELECT count(*) FROM outbox WHERE kind = 'report'") == 1
            assert await conn.fetchval("SELECT count(*) FROM health_events WHERE node = 'node-0' AND seq = 1") == 1
            assert await conn.fetchval("SELECT last_seq FROM nodes WHERE name = 'node-0'") == 1
            assert await conn.fetchval("SELECT health FROM gpus WHERE uuid = 'GPU-dup-0'") == "failed"
            assert await conn.fetchval("SELECT count(*) FROM outbox_quarantine") == 0
            # a row that cannot be applied (a report of a node that never said hello) is quarantined
            # with its reason and an audit row, and the rows after it are applied
            await conn.execute("INSERT INTO outbox (kind, node, report_seq, payload, idem_key, manager, created_at) "
                               "VALUES ('report', 'node-1', 1, '{\"gpus\": []}', 'bad-1', 'test', now())")
        finally:
            await conn.close()
        assert (await _stream(b.grpc, tok, "node-0", gpus, 2))[1] == 2
        await eventually(lambda: applied_all(c["pg"]), what="the outbox applied past the bad row")
        conn = await asyncpg.connect(c["pg"])
        try:
            reasons = [r["reason"] for r in await conn.fetch("SELECT reason FROM outbox_quarantine")]
            assert len(reasons) == 1 and "has not registered" in reasons[0], reasons
            assert await conn.fetchval("SELECT count(*) FROM audit_log WHERE action = 'outbox.quarantine'") == 1
            # the audit row keeps what was refused (the row stays in the outbox too: never pruned)
            after = json.loads(await conn.fetchval("SELECT after FROM audit_log WHERE action = 'outbox.quarantine'"))
            assert after["payload"] == {"gpus": []} and after["kind"] == "report" and after["report_seq"] == 1
            assert after["node"] == "node-1" and after["manager"] == "test" and "payload_cut" not in after
            assert await conn.fetchval("SELECT count(*) FROM outbox WHERE idem_key = 'bad-1'") == 1
            assert await conn.fetchval("SELECT last_seq FROM nodes WHERE name = 'node-0'") == 2
        finally:
            await conn.close()


async def test_a_manager_that_dies_drops_only_its_own_streams(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c:
        a, b, s = await started(c, "a", "b", "c")
        op = c["tokens"]["operator"]
        agents, backends, tasks = await agents_on(c, [[b.grpc, s.grpc], [s.grpc, b.grpc]])
        try:
            assert [x.target for x in agents] == [b.grpc, s.grpc]
            await job_on(a.http, op, agents)
            await eventually(lambda: layout(a.http, op), what="first layout")
            b.proc.kill()  # a standby dies: node-0's stream moves to c, node-1's stays
            await eventually(lambda: agents[0].failovers >= 1 and agents[0].connected.is_set()
                             and agents[0].target == s.grpc, what="node-0 served by c")
            backends[0].inject("xid", 0, xid=79)
            await eventually(lambda: agents[0].last_acked >= 1, what="report acknowledged by c")
            await eventually(lambda: failed_on(a.http, op), what="the leader applied it")
            assert await failed_on(a.http, op) == {g.uuid for g in agents[0].statics}
            assert agents[1].failovers == 0 and agents[1].target == s.grpc
            assert a.proc.poll() is None and (await get(a.http, op, "/v1/status"))["leader_epoch"] == a.info["epoch"]
            await eventually(lambda: applied_all(c["pg"]), what="the outbox applied")
            assert (await counters(c["pg"]))["quarantined"] == 0
            await eventually(lambda: settled(c["pg"], agents[0]), what="acknowledged reports applied")
            await check_reports(c["pg"], agents[0])
        finally:
            await stop_agents(agents, tasks)


async def test_a_standby_cut_off_from_the_database_acknowledges_nothing(tmp_path: Path) -> None:
    async with fleet(tmp_path) as c, leader_and_cut_off_standby(c) as (a, b, proxy):
        op = c["tokens"]["operator"]
        agents, backends, tasks = await agents_on(c, [[a.grpc, b.grpc], [b.grpc, a.grpc]])
        try:
            assert [x.target for x in agents] == [a.grpc, b.grpc]
            await job_on(a.http, op, agents)
            await eventually(lambda: layout(a.http, op), what="first layout")
            proxy.cut()  # b cannot reach PostgreSQL; nobody is told, its calls hang
            backends[1].inject("xid", 0, xid=79)
            await eventually(lambda: agents[1].sent_upto >= 1, what="report sent to the cut-off standby")
            # b could not store it, so it answered UNAVAILABLE (never an ack); the agent went to a
            await eventually(lambda: agents[1].last_acked >= 1, what="report acknowledged by a")
            assert agents[1].failovers >= 1 and agents[1].target == a.grpc
            await eventually(lambda: failed_on(a.http, op), what="the leader applied it")
            assert await failed_on(a.http, op) == {g.uuid for g in agents[1].statics}
            assert agents[0].failovers == 0
            await eventually(lambda: applied_all(c["pg"]), what="the outbox applied")
            assert (await counters(c["pg"]))["quarantined"] == 0
            await eventually(lambda: settled(c["pg"], agents[1]), what="acknowledged reports applied")
            await check_reports(c["pg"], agents[1])
        finally:
            await stop_agents(agents, tasks)


# ---- PostgreSQL restarted: a throwaway cluster, so that the shared server other tests use stays up ----
PG_BIN = sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1:] or [""]
INITDB, PG_CTL = os.path.join(PG_BIN[0], "initdb"), os.path.join(PG_BIN[0], "pg_ctl")


class Cluster:
    """A PostgreSQL cluster in a temporary directory on a free port (trust auth, no fsync), run as
    the `postgres` user when this process is root (initdb refuses root)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ntp-pgc-"))
        with socket.socket() as so:
            so.bind(("127.0.0.1", 0))
            self.port = so.getsockname()[1]
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self.data = self.dir / "data"
        self.opts = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"

    def _run(self, *args: str) -> None:
        subprocess.run([*self.as_user, *args], check=True, capture_output=True, timeout=60)

    def init(self) -> None:
        self._run(INITDB, "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
        self.start()

    def start(self) -> None:
        self._run(PG_CTL, "-D", str(self.data), "-l", str(self.dir / "log"), "-w", "-o", self.opts, "start")

    def stop(self, mode: str = "fast") -> None:
        self._run(PG_CTL, "-D", str(self.data), "-w", "-m", mode, "stop")

    def remove(self) -> None:
        with contextlib.suppress(Exception):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"


def _can_run_cluster() -> str | None:
    if not (os.access(INITDB, os.X_OK) and os.access(PG_CTL, os.X_OK)):
        return "no initdb/pg_ctl under /usr/lib/postgresql/*/bin"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "root without runuser: initdb refuses root"
    return None


@pytest.mark.skipif(_can_run_cluster() is not None, reason=str(_can_run_cluster()))
async def test_postgres_restarted_while_an_agent_reports(tmp_path: Path) -> None:
    cluster = Cluster()
    procs: list[ManagerProcess] = []
    try:
        await asyncio.to_thread(cluster.init)
        url = cluster.url
        pg = url.replace("postgresql+asyncpg://", "postgresql://")
        tokens = await prepare(url)
        await write_log.install(url, LEADER_TABLES)
        names = iter(("a", "b"))

        def start() -> ManagerProcess:
            n = next(names)
            p = ManagerProcess(n, url, tmp_path / f"manager-{n}.log", FLEET)
            procs.append(p)
            return p

        a = start()
        await a.ready_async()
        b = start()
        assert (await b.ready_async())["role"] == "standby"
        op = tokens["operator"]
        agents, backends = [], []
        for i in range(2):
            ag, be = make_agent(f"node-{i}", f"nvl-{i}", tokens[f"node-{i}"], [b.grpc, a.grpc])
            agents.append(ag)
            backends.append(be)
        tasks = [asyncio.create_task(x.run()) for x in agents]
        try:
            await job_on(a.http, op, agents)
            await eventually(lambda: layout(a.http, op), what="first layout")
            first = await layout(a.http, op)
            assert first is not None and first["counts"]["replicas"] == 2
            await eventually(lambda: applied_all(pg), what="the hellos applied")
            before = await counters(pg)

            await asyncio.to_thread(cluster.stop)  # every session of every manager ends
            backends[1].inject("xid", 0, xid=79)
            await eventually(lambda: agents[1].sent_upto >= 1, what="report sent while the database is down")
            await asyncio.sleep(1.0)
            assert agents[1].last_acked == 0  # nothing durable, nothing acknowledged
            await asyncio.to_thread(cluster.start)

            try:
                await eventually(lambda: agents[1].last_acked >= 1, timeout=60, what="acknowledged after the restart")
            except AssertionError as e:  # seen once under CI load and never alone: say where everything was
                ag = agents[1]
                state = (f"agent: target {ag.target}, connected {ag.connected.is_set()}, sent {ag.sent_upto}, "
                         f"acked {ag.last_acked}, failovers {ag.failovers}")
                logs = "\n".join(f"--- manager {p.name} (exit {p.proc.poll()}):\n"
                                 f"{p.log.read_text(errors='replace')[-4000:]}" for p in procs)
                raise AssertionError(f"{e}\n{state}\n{logs}") from None
            conn = await asyncpg.connect(pg)
            try:
                holder = await conn.fetchval("SELECT holder FROM leader WHERE id = 1")
            finally:
                await conn.close()
            if holder != "a":  # a lost its lease while the server was down: it must have stopped
                rc = await asyncio.to_thread(a.proc.wait, 60)
                assert rc == 75, a.log.read_text()[-3000:]
                assert await write_log.writes_since(url, "a", await lease_since(pg, str(holder))) == 0
            leader = a if holder == "a" else b

            async def one_replica() -> bool:
                lay = await layout(leader.http, op)
                return lay is not None and lay["counts"]["replicas"] == 1

            await eventually(one_replica, timeout=60, what="a layout without the failed node")
            assert await failed_on(leader.http, op) == {g.uuid for g in agents[1].statics}
            await eventually(lambda: applied_all(pg), what="the outbox applied")
            after = await counters(pg)
            assert after["cursor"] > before["cursor"] and after["quarantined"] == 0
            await eventually(lambda: settled(pg, agents[1]), what="acknowledged reports applied")
            await check_reports(pg, agents[1])
        finally:
            await stop_agents(agents, tasks)
    finally:
        for p in procs:
            p.stop(graceful=False)
        await asyncio.to_thread(cluster.remove)


async def test_agent_commands_older_than_the_retention_are_pruned_by_the_leader_only(tmp_path: Path) -> None:
    from datetime import UTC, datetime, timedelta

    from ntp_manager.service.leadership.leader import NotLeader
    from ntp_manager.service.manager import Manager
    from ntp_manager.settings import Settings
    from ntp_manager.store import outbox

    async with database("postgres", tmp_path) as url:
        await prepare(url)
        m = Manager(Settings(database_url=url, fleet_command_retention_s=60))
        try:
            now = datetime.now(UTC)
            async with m.sm() as s, s.begin():
                old = now - timedelta(seconds=120)
                await outbox.push_commands(s, [("node-0", {"release_power": "g0"})] * 3, 1, old)
                await outbox.push_commands(s, [("node-1", {"release_power": "g1"})] * 2, 1, now)
            assert m.shared is not None
            with pytest.raises(NotLeader):  # a standby (or a deposed leader) deletes nothing
                await m.shared.prune_commands()
            async with m.sm() as s:
                assert len(await outbox.commands_after(s, 0)) == 5
                want = await outbox.commands_after(s, 2, limit=2)
            # the deliver loop's driver statement (store/db.py KeptConnection) reads what the session does
            from ntp_manager.store.db import KeptConnection

            reader = KeptConnection(m.engine, 5.0)
            try:
                assert await outbox.commands_after_kept(reader, 2, limit=2) == want
                assert [c for _, _, c in want] == [{"release_power": "g0"}, {"release_power": "g1"}]
            finally:
                await reader.close()
            assert await m.leadership.try_acquire()
            assert await m.shared.prune_commands() == 3  # the old ones only
            async with m.sm() as s:
                left = await outbox.commands_after(s, 0)
            assert [n for _, n, _ in left] == ["node-1", "node-1"]
            assert await m.shared.prune_commands() == 0
        finally:
            await m.leadership.release()
            await m.engine.dispose()


async def test_a_manager_stuck_inside_its_append_is_cut_off_and_the_others_store(tmp_path: Path) -> None:
    """The append lock orders every manager's appends. A manager stopped halfway through sending its
    append (SIGSTOP, a frozen VM) keeps its connection and the lock, and its session is not idle in
    the transaction, so the server's idle timeout never ends it: in the 2,000-agent bench every
    manager left answered 'took too long' to every report for minutes after a SIGSTOP. Another
    manager whose append times out on the lock now ends that session (nothing of it was committed,
    so nothing was acknowledged), and its next group commit stores."""
    from ntp_manager.clock import SystemClock
    from ntp_manager.service.core.errors import Unavailable
    from ntp_manager.service.ingest.outbox import Ingest
    from ntp_manager.store import db, outbox

    async with database("postgres", tmp_path) as url:
        await prepare(url)
        pg = url.replace("postgresql+asyncpg://", "postgresql://")
        stuck = await asyncpg.connect(pg, server_settings={"idle_in_transaction_session_timeout": "0"})
        await stuck.execute("BEGIN")
        await stuck.execute("SELECT pg_advisory_xact_lock($1)", outbox.APPEND_LOCK)  # and stops here
        engine = db.make_engine(url)
        ing = Ingest(db.sessionmaker(engine), "b", SystemClock(), 0.0, 1.0)
        ing.start()
        try:
            stored, attempts = False, 0
            while not stored:  # an agent re-sends what was answered UNAVAILABLE
                attempts += 1
                assert attempts <= 20, "the stuck append was never cut off"
                try:
                    await ing.submit(outbox.Entry(outbox.SEEN, "node-1", {"nodes": ["node-1"]}, "seen:node-1:1"))
                    stored = True
                except Unavailable:
                    pass
            assert ing.stuck_ended == 1
            assert stuck.is_closed() or not await _alive(stuck)
            async with db.sessionmaker(engine)() as s:
                assert [r.node for r in await outbox.read_after(s, 0, 10)] == ["node-1"]
        finally:
            await ing.stop()
            await engine.dispose()
            with contextlib.suppress(Exception):
                await stuck.close(timeout=1)


async def _alive(conn: asyncpg.Connection) -> bool:
    try:
        await conn.fetchval("SELECT 1", timeout=2)
    except Exception:
        return False
    return True


async def test_a_hellos_one_statement_view_reads_what_the_four_reads_did(tmp_path: Path) -> None:
    """A standby checks a hello against one autocommit statement (service/ingest/outbox.py): the node's
    domain, the owners of the GPUs it names, its last durable seq (the larger of the applied one and
    the one stored in the outbox, not applied yet) and the epoch; the same as the reads it replaces."""
    from datetime import UTC, datetime

    from sqlalchemy import insert

    from ntp_manager.contract.gpu import GpuState
    from ntp_manager.service.core.kernel import DOMAINS, GPUS, NODES
    from ntp_manager.service.core.state import HealthSource
    from ntp_manager.service.ingest.outbox import StoreHelloView
    from ntp_manager.store import db, outbox

    async with database("postgres", tmp_path) as url:
        await prepare(url)
        engine = db.make_engine(url)
        sm = db.sessionmaker(engine)
        now = datetime.now(UTC)
        try:
            async with sm() as s, s.begin():
                await s.execute(insert(DOMAINS), [{"id": "nvl-0", "power_budget_w": None, "created_at": now}])
                await s.execute(insert(NODES), [
                    {"name": n, "domain_id": "nvl-0", "boot_id": "b", "agent_version": "v", "last_seq": seq,
                     "drain_deadline": None, "drain_reason": None, "registered_at": now}
                    for n, seq in (("node-0", 4), ("node-1", 9))])
                await s.execute(insert(GPUS), [
                    {"uuid": f"g-{n}-{i}", "pos": k * 2 + i, "node": n, "domain_id": "nvl-0", "idx": i, "model": "m",
                     "memory_bytes": 1, "tdp_mw": 700_000, "min_mw": 200_000, "max_mw": 700_000,
                     "health": GpuState.HEALTHY, "health_reason": "", "health_source": HealthSource.AGENT,
                     "health_since": now, "admin": None, "admin_owner": None, "admin_reason": None,
                     "desired_mw": None, "enforced_mw": None, "speed": None}
                    for k, n in enumerate(("node-0", "node-1")) for i in range(2)])
                await outbox.append(s, [outbox.Entry(outbox.REPORT, "node-0", {"gpus": []}, "r:node-0:7", 7)],
                                    "b", now)
            one = StoreHelloView(sm, engine)
            four = StoreHelloView(sm)  # the reads one by one
            asked = ["g-node-0-0", "g-node-1-1", "g-new-0"]
            for view in (one, four):
                assert await view("node-0", asked) == (
                    "nvl-0", {"g-node-0-0": "node-0", "g-node-1-1": "node-1"}, 7, 0)  # stored seq 7 > applied 4
                assert await view("node-1", []) == ("nvl-0", {}, 9, 0)  # epoch 0: nobody has led yet
                assert await view("node-9", ["g-new-0"]) == (None, {}, 0, 0)
                await view.close()
        finally:
            await engine.dispose()


async def test_the_leaders_outbox_read_on_its_kept_connection_reads_what_a_session_reads(tmp_path: Path) -> None:
    """The consumer's read (service/ingest/outbox.py `Ingest.read`) is one statement on the driver
    over a kept connection: the same rows as the session's query, every kind and payload; a
    database it cannot read is an OSError (the consumer tries again), never the driver's own error."""
    from datetime import UTC, datetime

    from ntp_manager.clock import SystemClock
    from ntp_manager.service.ingest.outbox import Ingest
    from ntp_manager.store import db, outbox

    async with database("postgres", tmp_path) as url:
        await prepare(url)
        engine = db.make_engine(url)
        sm = db.sessionmaker(engine)
        now = datetime.now(UTC)
        port = Ingest(sm, "m-test", SystemClock(), 0.0, 5.0, engine)
        try:
            async with sm() as s, s.begin():
                await outbox.append(s, [
                    outbox.Entry(outbox.HELLO, "node-0", {"domain": "d", "gpus": [["g", 0, "m", 1, 2, 1, 3]],
                                                          "peer": "Überhitzt ✗"}, "h:node-0"),
                    *(outbox.Entry(outbox.REPORT, "node-0", {"gpus": [["g", "failed", ["x", "é"], [79], None]]},
                                   f"r:node-0:{k}", k) for k in range(1, 6)),
                    outbox.Entry(outbox.SEEN, "", {"nodes": ["node-0", "node-1"]}, "seen:1"),
                    outbox.Entry(outbox.POWER, "node-0", {"readings": [["g", 2**40]]}, "p:1")], "m-test", now)
            assert port._rows is not None  # the kept connection is what reads
            for after, limit in ((0, 100), (2, 3), (7, 10), (8, 10)):
                async with sm() as s:
                    want = await outbox.read_after(s, after, limit)
                assert await port.read(after, limit) == want
            assert [r.kind for r in await port.read(0, 100)] == [outbox.HELLO, *[outbox.REPORT] * 5, outbox.SEEN,
                                                                  outbox.POWER]
        finally:
            await port.stop()
            await engine.dispose()
    gone = db.make_engine(url)  # its database was dropped
    port = Ingest(db.sessionmaker(gone), "m-test", SystemClock(), 0.0, 5.0, gone)
    try:
        with pytest.raises(OSError, match="cannot read the outbox"):
            await port.read(0, 10)
    finally:
        await port.stop()
        await gone.dispose()
