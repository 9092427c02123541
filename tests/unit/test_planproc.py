"""service/planning/planproc.py: a replan made in the planner process is the one a thread makes (layout,
stored body, summary, reason), through failures, a degraded GPU, a worker that lost what it was
sent and a worker that died; planner errors reach the caller; without a process, a thread plans."""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ntp_manager.contract.gpu import GpuState
from ntp_manager.planner import PlanError
from ntp_manager.service.core.state import LayoutRec
from ntp_manager.service.planning import planning, planproc, planwire
from ntp_manager.topology import Cluster, TopologyError
from tests.fakes.builders import cluster_from_counts, job


def pos_map(cluster: Cluster) -> dict[str, int]:
    # positions deliberately not the flat order: the codec must use the manager's
    return {u: 1000 - i for i, u in enumerate(cluster.flat_uuids)}


def rec(d: planning.Draft, version: int, chain: int) -> LayoutRec:
    return LayoutRec("t", version, 1, d.doc, d.why, dt.datetime.now(dt.UTC), 0.0, chain)


def same(a: planning.Draft, b: planning.Draft) -> None:
    assert a.doc == b.doc and a.unchanged == b.unchanged and a.encoded == b.encoded
    assert a.summary == b.summary and a.why == b.why


@pytest.fixture(scope="module")
def pp() -> Iterator[planproc.PlanProcess]:
    p = planproc.PlanProcess(True)
    yield p
    p.close()


def test_replans_in_the_process_equal_the_thread_path_through_failures_and_a_degraded_gpu(
        pp: planproc.PlanProcess) -> None:
    cluster = cluster_from_counts([8, 8, 8, 8, 8, 8])
    pos = pos_map(cluster)
    spec = job(tp=4, pp=2, replicas=6, min_tp=2)

    async def main() -> None:
        prev: LayoutRec | None = None
        c = cluster
        steps = [{}, {c.domains[0].gpus[1].uuid: GpuState.FAILED}, {c.domains[3].gpus[5].uuid: GpuState.FAILED},
                 {}, {c.domains[0].gpus[1].uuid: GpuState.HEALTHY}]
        for k, change in enumerate(steps):
            c = c.with_states(change) if change else c
            if k == 3:  # a degraded GPU with a measured speed: a state, power and speed the worker must mirror
                c = c.with_states({c.domains[2].gpus[0].uuid: GpuState.DEGRADED}, {c.domains[2].gpus[0].uuid: 0.5})
            got = await pp.draft(c, spec, prev, pos.__getitem__, "")
            same(got, planning.draft(c, spec, prev, pos.__getitem__, ""))
            assert got.doc.gpus and all(u in pos for u in got.doc.gpus)
            if not got.unchanged:
                assert got.encoded is not None
                prev = rec(got, (prev.version if prev else 0) + 1, got.encoded.chain)
        assert prev is not None and prev.version >= 4 and prev.chain >= 3  # deltas, each on the last
        dry = await pp.plan(c, spec, pos.__getitem__, (c.domains[5].gpus[2].uuid,))
        assert dry == planning.plan_layout(c, spec, (c.domains[5].gpus[2].uuid,))

    asyncio.run(main())


def test_a_worker_that_lost_or_died_is_sent_everything_again(pp: planproc.PlanProcess) -> None:
    cluster = cluster_from_counts([8, 8, 8, 8])
    pos = pos_map(cluster)
    spec = job(tp=4, pp=1, replicas=8, min_tp=2)
    down = cluster.with_states({cluster.domains[1].gpus[0].uuid: GpuState.FAILED})

    async def main() -> None:
        first = await pp.draft(cluster, spec, None, pos.__getitem__)
        v1 = rec(first, 1, 0)
        # a new worker holds neither the shape nor the layout this side believes it sent
        pp.close()
        after = await pp.draft(down, spec, v1, pos.__getitem__)
        same(after, planning.draft(down, spec, v1, pos.__getitem__))
        assert after.encoded is not None and after.encoded.base_version == 1
        # the worker is killed: a new one is started and sent everything
        pool = pp._executor()
        assert pool is not None
        await pp.plan(cluster, spec, pos.__getitem__)  # make sure it runs
        for p in list(pool._processes.values()):
            assert p.pid is not None
            os.kill(p.pid, signal.SIGKILL)
        await asyncio.sleep(0.2)
        again = await pp.draft(down, spec, v1, pos.__getitem__)
        same(again, after)

    asyncio.run(main())


def test_planner_errors_reach_the_caller_and_without_a_process_a_thread_plans(pp: planproc.PlanProcess) -> None:
    cluster = cluster_from_counts([4, 4])
    pos = pos_map(cluster)

    async def main() -> None:
        with pytest.raises(PlanError):
            await pp.draft(cluster, job(tp=8, pp=1, replicas=1), None, pos.__getitem__)
        with pytest.raises(TopologyError):
            await pp.plan(cluster, job(tp=4, pp=1, replicas=2), pos.__getitem__, ("no-such-gpu",))
        threaded = planproc.PlanProcess(False)
        spec = job(tp=4, pp=1, replicas=2)
        same(await threaded.draft(cluster, spec, None, pos.__getitem__),
             await pp.draft(cluster, spec, None, pos.__getitem__))
        assert threaded._pool is None

    asyncio.run(main())


def test_stop_kills_a_worker_mid_plan_and_the_caller_still_gets_its_layout(pp: planproc.PlanProcess) -> None:
    # a manager's shutdown must not wait for a long plan: the worker is killed; a caller still
    # waiting (another manager of this process) is served by a new worker
    cluster = cluster_from_counts([72] * 60)
    pos = pos_map(cluster)
    spec = job(tp=1, pp=1, replicas=72 * 60, batch=1)

    async def main() -> None:
        pp.stop()  # idle: nothing to kill
        pool = pp._executor()
        assert pool is not None
        task = asyncio.ensure_future(pp.draft(cluster, spec, None, pos.__getitem__))
        for _ in range(500):
            if pp._running:
                break
            await asyncio.sleep(0.01)
        procs = list(pool._processes.values())
        pp.stop()
        got = await task
        for p in procs:
            p.join(5)
            assert p.exitcode is not None and p.exitcode != 0  # killed, not finished
        same(got, planning.draft(cluster, spec, None, pos.__getitem__))

    asyncio.run(main())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_worker_is_started_by_this_process_not_by_a_forkserver(pp: planproc.PlanProcess) -> None:
    # a forkserver is one per process and keeps the preload list of whoever starts it first: started
    # by the planner, it took the torch preload away from a test process's rank processes
    # (tests/fakes/procs.worker_context), which then imported torch each (~2.5 s of CPU)
    asyncio.run(pp.warm())
    pool = pp._executor()
    assert pool is not None and pool._processes
    for p in pool._processes.values():
        ppid = int(Path(f"/proc/{p.pid}/stat").read_text().rpartition(")")[2].split()[1])
        assert ppid == os.getpid()


@pytest.fixture
def own_pp() -> Iterator[planproc.PlanProcess]:
    """A planner process of the test's own (the module's shared one must not be stopped), killed
    at the end whatever the test left running."""
    pp = planproc.PlanProcess(True)
    yield pp
    pp.close(kill=True)


def test_a_call_still_queued_when_the_worker_is_stopped_is_served_again_not_cancelled(
        own_pp: planproc.PlanProcess) -> None:
    # stop() shuts the pool down with cancel_futures: a call not yet handed to the worker (one runs,
    # one waits in the executor's call queue, this third one in its pending list) was cancelled, and
    # its caller -- not cancelled itself -- got CancelledError (seen once in CI as a failure of the
    # test above on a loaded machine); it gets Missing("restarted"), which _run answers by retrying
    pp = own_pp

    async def main() -> None:
        busy = asyncio.ensure_future(pp._call(time.sleep, 30))
        queued = asyncio.ensure_future(pp._call(planwire.ready))
        pending = asyncio.ensure_future(pp._call(planwire.ready))
        for _ in range(1000):
            if len(pp._running) == 3:
                break
            await asyncio.sleep(0.01)
        pp.stop()
        results = await asyncio.gather(busy, queued, pending, return_exceptions=True)
        assert isinstance(results[2], planproc.Missing), results
        assert not any(isinstance(r, asyncio.CancelledError) for r in results), results

    asyncio.run(main())


def test_a_call_whose_pool_is_stopped_between_lookup_and_submit_is_served_again(
        own_pp: planproc.PlanProcess) -> None:
    # the other interleaving of stop() with a call: the pool is shut down after _call looked it up
    # and before its submit ran (in a thread); submit then raises "cannot schedule new futures after
    # shutdown", a RuntimeError that reached the caller as if planning had failed
    pp = own_pp
    pool = pp._executor()
    assert pool is not None
    real_submit = pool.submit

    def stopped_first(fn: Any, /, *args: Any) -> Any:
        pp.close()  # what stop() does to an idle pool's owner, run while this call was on its way
        return real_submit(fn, *args)

    pool.submit = stopped_first  # type: ignore[method-assign]

    async def main() -> None:
        with pytest.raises(planproc.Missing, match="restarted"):
            await pp._call(planwire.ready)
        assert await pp._call(planwire.ready) is None  # a new pool serves the retry

    asyncio.run(main())


def test_tokens_are_never_reused_across_workers(own_pp: planproc.PlanProcess) -> None:
    # the record of what a worker holds starts afresh with each worker; a call the old worker
    # answered can still adopt its result into the new record, so a token must never come back
    # (numbering that restarted could name another layout in the new worker: a wrong previous
    # layout for a draft, silently)
    pp = own_pp
    assert pp._executor() is not None
    first, new = pp._sent.token(pp._sent.shapes, object())
    assert new
    pp.close()
    assert not pp._sent.shapes  # a new worker holds nothing
    second, _ = pp._sent.token(pp._sent.shapes, object())
    assert second > first
    assert next(pp._sent.tokens) > second  # an output token too


def test_a_primed_worker_plans_from_what_it_was_sent_ahead(own_pp: planproc.PlanProcess) -> None:
    """A standby sends the shape and the running layout ahead (`prime`): the takeover's draft then
    sends neither, and its result is the one a thread makes; a second prime sends nothing."""
    cluster = cluster_from_counts([8, 8, 8, 8])
    pos = pos_map(cluster)
    spec = job(tp=4, pp=1, replicas=8, min_tp=2)
    running = rec(planning.draft(cluster, spec, None, pos.__getitem__), 1, 0)
    down = cluster.with_states({cluster.domains[2].gpus[3].uuid: GpuState.FAILED})

    async def main() -> None:
        assert await own_pp.prime(cluster, pos.__getitem__, [running.doc]) == 2  # the shape and the layout
        assert await own_pp.prime(cluster, pos.__getitem__, [running.doc]) == 0
        sent: list[tuple[Any, ...]] = []
        real = own_pp._call

        async def spy(fn: Any, *args: Any) -> Any:
            sent.append(args)
            return await real(fn, *args)

        own_pp._call = spy  # type: ignore[method-assign]
        got = await own_pp.draft(down, spec, running, pos.__getitem__)
        same(got, planning.draft(down, spec, running, pos.__getitem__))
        shape_msg, prev = sent[0][1], sent[0][4]
        assert shape_msg is None and prev is not None and prev[1] is None  # neither sent again

    asyncio.run(main())


def test_a_state_seen_for_the_first_time_rebuilds_only_its_domain_in_the_worker() -> None:
    """The variant table only grows, so a GPU failing for the first time (a new variant) leaves
    every other GPU's code as it was: the worker's snapshot reuses every other domain, and equals
    the manager's."""
    c0 = cluster_from_counts([8] * 40)
    pos = pos_map(c0)
    shape = planwire.Shape(planwire.shape_blobs(c0, pos.__getitem__))
    v0 = planwire.gpu_variants(c0)
    w0 = shape.cluster(v0)
    failed = c0.domains[7].gpus[3].uuid
    c1 = c0.with_states({failed: GpuState.FAILED})
    v1 = planwire.gpu_variants(c1, v0[1])
    assert v1[1][:len(v0[1])] == v0[1] and len(v1[1]) == len(v0[1]) + 1  # appended, not renumbered
    w1 = shape.cluster(v1)
    assert [d.gpus for d in w1.domains] == [d.gpus for d in c1.domains]
    assert [k for k, (a, b) in enumerate(zip(w0.domains, w1.domains, strict=True)) if a is not b] == [7]
    # a table made afresh (the manager's started again at MAX_VARIANTS): the snapshot still equals it
    w2 = shape.cluster(planwire.gpu_variants(c1))
    assert [d.gpus for d in w2.domains] == [d.gpus for d in c1.domains]


def test_variants_since_a_snapshot_are_the_variants_read_afresh() -> None:
    """Through random state changes (failures, repairs, degraded GPUs with speeds), the variants
    made from the last ones (reading only the domains a change replaced) are those read afresh."""
    import random

    rng = random.Random(5)
    cluster = cluster_from_counts([8] * 30)
    sent = planwire.gpu_variants(cluster)
    uuids = list(cluster.flat_uuids)
    for _ in range(25):
        changed = {u: rng.choice([GpuState.FAILED, GpuState.HEALTHY, GpuState.DEGRADED, GpuState.SUSPECT])
                   for u in rng.sample(uuids, rng.randint(1, 12))}
        nxt = cluster.with_states(changed, {u: rng.choice([None, 0.5, 0.75]) for u in changed})
        since = planwire.gpu_variants_since(nxt, cluster, sent)
        assert since == planwire.gpu_variants(nxt, sent[1])
        cluster, sent = nxt, since


def half_sent_result(flag: str, die: bool = False) -> None:
    """In the planner worker: write the head of a 1 MiB result and 100 of its bytes to the pool's
    result pipe, as a worker killed in the middle of sending one leaves them, say so in `flag`,
    then wait to be killed (`die`: kill itself, as the kernel's out-of-memory killer would)."""
    f = sys._getframe()
    while f is not None and "result_queue" not in f.f_locals:
        f = f.f_back
    assert f is not None, "not called by a process pool's worker"
    f.f_locals["result_queue"]._writer._send(struct.pack("!i", 1 << 20) + b"x" * 100)
    Path(flag).write_text("sent")
    if die:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)


HALF_SENT = """
import asyncio, sys, time
from pathlib import Path
from ntp_manager.service.planning import planproc
from tests.unit.test_planproc import half_sent_result

async def main() -> None:
    pp = planproc.PlanProcess(True)
    die = sys.argv[2] == "dies"
    call = asyncio.ensure_future(pp._call(half_sent_result, sys.argv[1], die))
    for _ in range(3000):
        if Path(sys.argv[1]).exists():
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)  # the pool's thread reads the head, then waits for the rest
    if not die:
        pp.stop()
    try:
        await asyncio.wait_for(call, 20)
    except planproc.Missing as e:
        print("served again:", e, flush=True)
    except TimeoutError:
        print("the call never ended", flush=True)

asyncio.run(main())
"""


@pytest.mark.parametrize("how", ["stopped", "dies"])
def test_a_worker_killed_in_the_middle_of_sending_a_result_holds_neither_its_caller_nor_the_exit(
        tmp_path: Path, how: str) -> None:
    # stop() kills a busy worker (and the kernel may kill one for memory). One killed while it
    # wrote a large result (a 100K-GPU layout) left the pool's thread reading the rest for ever:
    # the caller never heard back (the manager would never plan again) and the interpreter's exit
    # waited on that thread (a bench hung at its end in 2 runs of 5)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", HALF_SENT, str(tmp_path / "sent"), how], cwd=root,
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "served again: restarted" in proc.stdout, (proc.stdout, proc.stderr[-3000:])


def test_the_worker_plans_with_the_collector_off_and_collects_rarely_between_calls(
        pp: planproc.PlanProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    # a 96,000-GPU draft set off ~120 collections (a sixth of its CPU) in the middle of a takeover
    cluster = cluster_from_counts([8, 8, 8, 8])
    pos = pos_map(cluster)
    spec = job(tp=4, pp=2, replicas=4, min_tp=2)
    seen: list[bool] = []
    real = planning.plan_layout

    def spy(*a: Any, **k: Any) -> Any:
        seen.append(gc.isenabled())
        return real(*a, **k)

    monkeypatch.setattr(planwire.planning, "plan_layout", spy)
    assert gc.isenabled()
    blobs, _ = planwire.work(10**9, planwire.shape_blobs(cluster, pos.__getitem__), planwire.gpu_variants(cluster),
                             spec, None, "", 10**9 + 1, False, None)
    assert seen == [False] and gc.isenabled()  # off while it planned, on again after
    assert planwire.unpack_doc(blobs, cluster) == real(cluster, spec)
    # the worker process itself: the young generation is collected every 50,000 allocations
    assert asyncio.run(pp._call(gc.get_threshold)) == (50_000, 20, 20)
