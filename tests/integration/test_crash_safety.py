"""SIGKILL the manager while agents report and workers watch; restart on the same database.

Nothing acknowledged may be lost: every acked report, the job, every layout version and its audit
record survive; watchers reconnect and get the same current version; versions never go backwards.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import subprocess
from pathlib import Path

import grpc
import httpx

from ntp_manager.contract.layout import WireLayout
from ntp_manager.contract.proto.ntp.v1 import worker_pb2, worker_pb2_grpc
from tests.fakes.agent_client import ScriptedAgent, gpu_uuids
from tests.fakes.procs import create_agent_tokens, create_token, free_port, start_manager, stop_process
from tests.integration.conftest import eventually

JOB = {"name": "llm", "tp": 4, "replicas": 2, "local_batch": 8, "min_tp": 2, "heads": 16, "mlp_columns": 64}


def start(data: Path, http: int, grpc_port: int) -> subprocess.Popen[str]:
    return start_manager(data, http, grpc_port, env={"NTP_SUSPECT_AFTER_S": "60", "NTP_FAIL_AFTER_S": "120"})[0]


async def test_sigkill_loses_nothing_acknowledged(tmp_path: Path):
    data = tmp_path / "data"
    tokens = {s: create_token(data, s) for s in ("operator", "worker")}
    tokens.update({n: create_token(data, "agent", node=n) for n in ("node-0", "node-1")})
    http, gport = free_port(), free_port()
    proc = start(data, http, gport)
    target = f"127.0.0.1:{gport}"
    base = f"http://127.0.0.1:{http}"
    try:
        async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {tokens['operator']}"}) as c:
            agents = []
            for d in range(2):
                a = ScriptedAgent(target, tokens[f"node-{d}"], f"node-{d}", f"nvl-{d}", gpu_uuids(f"node-{d}", 4))
                await a.connect()
                await a.wait_for(lambda a=a: a.welcome is not None)
                agents.append(a)
            assert (await c.post("/v1/jobs", json=JOB)).status_code == 201

            seen: list[tuple[int, int]] = []
            shown: dict[int, list[tuple[int, int, list[int]]]] = {}  # version -> replicas as pushed

            async def watch() -> None:
                while True:
                    try:
                        async with grpc.aio.insecure_channel(target) as ch:
                            stub = worker_pb2_grpc.WorkerServiceStub(ch)
                            call = stub.WatchLayout(
                                worker_pb2.WatchLayoutRequest(job="llm", worker_id="w", gpu_uuid="GPU-node-0-0"),
                                metadata=(("authorization", f"Bearer {tokens['worker']}"),))
                            async for msg in call:
                                seen.append((msg.stamp.leader_epoch, msg.stamp.version))
                                shown[msg.stamp.version] = [(r.replica_id, r.tp, list(r.stage_tps))
                                                            for r in WireLayout.decode(msg).replicas]
                    except grpc.aio.AioRpcError:
                        await asyncio.sleep(0.2)  # manager gone: retry

            watcher = asyncio.create_task(watch())
            await eventually(lambda: len(seen) >= 1)

            # Flip a GPU back and forth: every report changes health, so layouts keep changing.
            acked: list[int] = []
            flip = ["failed", "healthy"]

            async def pump(a: ScriptedAgent) -> None:
                i = 0
                while True:
                    before = len(a.acks)
                    await a.report({f"GPU-{a.node}-3": flip[i % 2]}, wait=False)
                    try:
                        await a.wait_for(lambda b=before: len(a.acks) > b or a.error is not None, timeout=2)
                    except TimeoutError:
                        return
                    if a.error is not None or len(a.acks) == before:
                        return
                    acked.append((a.node, a.acks[-1]))  # type: ignore[arg-type]
                    i += 1

            pumps = [asyncio.create_task(pump(a)) for a in agents]
            await eventually(lambda: len(acked) >= 20 and len(seen) >= 3, timeout=30)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            await asyncio.gather(*pumps, return_exceptions=True)
            last_seen = max(seen)
            acked_by_node: dict[str, int] = {}
            for node, seq in acked:  # type: ignore[misc]
                acked_by_node[node] = max(acked_by_node.get(node, 0), seq)

            # --- the database after the crash, read directly -------------------------------------
            conn = sqlite3.connect(data / "ntp-manager.db")
            for node, seq in acked:  # type: ignore[misc]
                assert conn.execute("select count(*) from health_events where node=? and seq=?",
                                    (node, seq)).fetchone()[0] == 1, f"acked report {node}#{seq} lost"
            assert conn.execute("select count(*) from jobs where name='llm'").fetchone()[0] == 1
            versions = [v for (v,) in conn.execute("select version from layouts where job='llm' order by version")]
            assert versions == list(range(1, len(versions) + 1))
            assert last_seen[1] <= versions[-1], "a pushed layout version is missing after the crash"
            audited = conn.execute("select count(*) from audit_log where action='layout.update'").fetchone()[0]
            assert audited == len(versions)
            current = conn.execute("select leader_epoch, version from layouts where job='llm' "
                                   "order by version desc limit 1").fetchone()
            conn.close()

            # --- restart on the same database ------------------------------------------------------
            n_before = len(seen)
            proc = start(data, http, gport)
            await eventually(lambda: len(seen) > n_before, timeout=30)
            # the first message after reconnecting is the current layout as stored: same epoch, version
            assert seen[n_before] == tuple(current)
            assert seen[n_before] >= last_seen, "versions went backwards after restart"
            assert seen == sorted(seen), "a watcher saw a version go backwards"

            # agents reconnect and learn what was applied; nothing acked is asked again
            for a in agents:
                await a.close()
            for d in range(2):
                node = f"node-{d}"
                a = ScriptedAgent(target, tokens[node], node, f"nvl-{d}", gpu_uuids(node, 4))
                await a.connect()
                await a.wait_for(lambda a=a: a.welcome is not None)
                assert a.welcome.last_applied_seq >= acked_by_node.get(node, 0)
                await a.close()
            r = await c.get("/v1/jobs/llm/layout")
            assert r.status_code == 200 and r.json()["version"] >= versions[-1]
            # every stored version (a keyframe, then deltas) reads back as the layout that was pushed
            # when it was current (tests/integration/test_layout_store.py crosses keyframes)
            history = (await c.get("/v1/jobs/llm/layouts", params={"limit": 1000})).json()["items"]
            read = {h["version"]: [(x["id"], x["tp"], x["stage_tp"]) for x in h["replicas"]] for h in history}
            assert set(versions) <= set(read)
            assert all(read[v] == shown[v] for v in shown), "a stored version reads back differently"
            watcher.cancel()
    finally:
        stop_process(proc)


BURST_NODES, BURST_PER_NODE = 10, 100  # 1,000 reports


def burst_state(seq: int) -> tuple[int, str]:
    """Report `seq` of a node sets GPU (seq % 4) to failed on odd rounds, healthy on even ones."""
    return seq % 4, ("failed" if (seq // 4) % 2 == 0 else "healthy")


async def test_sigkill_mid_burst_of_1000_reports_loses_nothing_acknowledged(tmp_path: Path):
    """1,000 reports from 10 agents, sent without waiting for acks (they are group-committed); the
    manager is killed mid-burst. Every acknowledged report is in the store, each node's reports are
    stored without a gap, each GPU's stored health is what its last stored report said; after a
    restart the agents resend what was not applied and end where the script ends."""
    data = tmp_path / "data"
    nodes = [f"node-{i}" for i in range(BURST_NODES)]
    tokens = create_agent_tokens(data, nodes)
    env = {"NTP_SUSPECT_AFTER_S": "60", "NTP_FAIL_AFTER_S": "120", "NTP_BREAKER_MIN_GPUS": "100000"}
    http, gport = free_port(), free_port()
    proc = start_manager(data, http, gport, env=env)[0]
    target = f"127.0.0.1:{gport}"
    try:
        agents = []
        for i, n in enumerate(nodes):
            a = ScriptedAgent(target, tokens[n], n, f"nvl-{i // 2}", gpu_uuids(n, 4))
            await a.connect()
            await a.wait_for(lambda a=a: a.welcome is not None)
            agents.append(a)
        for seq in range(1, BURST_PER_NODE + 1):
            for a in agents:
                gpu, state = burst_state(seq)
                await a.report({f"GPU-{a.node}-{gpu}": state}, seq=seq, wait=False)
        # acks are cumulative (ack n: reports 1..n applied), one per commit: count what they cover
        while sum(max(a.acks, default=0) for a in agents) < 200:
            await asyncio.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        acked = {a.node: list(range(1, max(a.acks, default=0) + 1)) for a in agents}
        total = sum(len(v) for v in acked.values())
        assert total < BURST_NODES * BURST_PER_NODE, "the kill came after the burst: nothing was tested mid-burst"
        for a in agents:
            await a.close()

        conn = sqlite3.connect(data / "ntp-manager.db")
        for n in nodes:
            stored = [s for (s,) in conn.execute("select seq from health_events where node=? and seq is not null "
                                                 "order by seq", (n,))]
            assert stored == list(range(1, len(stored) + 1)), f"{n}: stored reports have a gap or a duplicate"
            lost = sorted(set(acked[n]) - set(stored))
            assert not lost, f"{n}: acknowledged reports lost: {lost}"
            (last,) = conn.execute("select last_seq from nodes where name=?", (n,)).fetchone()
            assert last == len(stored)
            want: dict[int, str] = {}
            for seq in stored:
                gpu, state = burst_state(seq)
                want[gpu] = state
            for gpu, state in want.items():
                (health,) = conn.execute("select health from gpus where uuid=?", (f"GPU-{n}-{gpu}",)).fetchone()
                assert health == state, (n, gpu)
        conn.close()

        # restart: each agent learns what was applied and resends the rest
        proc = start_manager(data, http, gport, env=env)[0]
        again = []
        for i, n in enumerate(nodes):
            a = ScriptedAgent(target, tokens[n], n, f"nvl-{i // 2}", gpu_uuids(n, 4))
            await a.connect()
            await a.wait_for(lambda a=a: a.welcome is not None)
            assert a.welcome.last_applied_seq >= max(acked[n], default=0)
            for seq in range(a.welcome.last_applied_seq + 1, BURST_PER_NODE + 1):
                gpu, state = burst_state(seq)
                await a.report({f"GPU-{n}-{gpu}": state}, seq=seq, wait=False)
            again.append(a)
        for a in again:
            await a.wait_for(lambda a=a: (a.acks and a.acks[-1] == BURST_PER_NODE) or a.error is not None, timeout=30)
            assert a.error is None
            await a.close()
        conn = sqlite3.connect(data / "ntp-manager.db")
        final = {burst_state(s)[0]: burst_state(s)[1] for s in range(1, BURST_PER_NODE + 1)}
        for n in nodes:
            assert conn.execute("select count(*) from health_events where node=? and seq is not null",
                                (n,)).fetchone()[0] == BURST_PER_NODE
            for gpu, state in final.items():
                assert conn.execute("select health from gpus where uuid=?", (f"GPU-{n}-{gpu}",)).fetchone()[0] == state
        conn.close()
    finally:
        stop_process(proc)
