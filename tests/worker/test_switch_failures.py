"""Deaths inside a layout switch's delicate moments, with real processes on gloo.

A rank dies inside a step's commit all-gather and splits the survivors: some saw the commit
complete and stepped their optimizers, one saw its all-gather fail and did not. TP2 + TP2,
clipping on every step. At step 2's commit the victim (w1) dies right after its all-gather, and
w2's all-gather "fails" after exchanging its data (a rank whose socket to the victim closed before
the victim's data arrived; the one thing the test forces). w0 and w3 committed step 2 and fail in
step 3; w2 is one step behind, holding step 2's synced gradients. At the regroup w2 completes step
2 from those gradients with the committed ranks' gradient norm, `train_step` returns it, and every
survivor's losses and parameters equal a single-process reference -- no checkpoint needed.
(Before: "survivors disagree on the committed step" and, with no checkpoint_dir, every rank
stopped.) The refusals of splits a late commit cannot mend are checked on `_roll_forward` itself.

A repaired GPU's fresh process dies while it joins: TP1 + TP2 -> TP2 + TP2 with a fresh w1 that
receives its shards and dies before the replicated values reach it -> TP1 + TP2 again. w0 had
already resharded to half its units; the next regroup must move units by what it holds now, not
by the layout it trained in last. (Before: w0 still described itself by the old layout, where it
held every unit, so nothing was sent to it and the half it had given up came back uninitialised.)"""

from __future__ import annotations

import datetime as dt
import os
import signal
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from ntp_manager.worker import comm
from ntp_manager.worker.runtime import Runtime, RuntimeConfig
from ntp_manager.worker.sources import StoreLayoutSource, WorkerLayout, publish_layout, read_acks
from ntp_manager.worker.tiny_gpt import tp_plan
from tests.fakes.procs import worker_context
from tests.worker import pipeline_jobs as pj
from tests.worker.compare import shard_errors, shard_info, tolerance
from tests.worker.ranks import reap, store_with_layout
from tests.worker.test_runtime import CFG, CLIP, _get, _opt_fn, batch, build, loss_fn, reference

JOB = "split"
SPLIT_AT = 2  # the step whose commit splits the survivors
STEPS = 6
A, B = ["w0", "w1"], ["w2", "w3"]
VICTIM, LAGGER = "w1", "w2"


class _Faulty(Runtime):
    """The runtime with step SPLIT_AT's commit cut on two ranks, after the real all-gather
    (roles "victim", "lagger"), or dying when a joiner is about to receive the replicated values
    ("dies joining")."""

    role = ""

    def _send_replicated(self, model: Any, opt: Any, sched: Any, src: int, dsts: list[int]) -> None:
        if self.role == "dies joining" and dist.get_rank(self.s.world) != src:
            os.kill(os.getpid(), signal.SIGKILL)
        super()._send_replicated(model, opt, sched, src, dsts)

    def _rendezvous(self, target: WorkerLayout) -> None:
        if self.role == "late" and target.version == 2:  # comes to version 2 after the others left it
            arrived = comm.arrival_keys(f"ntp/{JOB}/pg/v{target.epoch}.3", target.world)
            deadline = time.monotonic() + 120
            while sum(self.store.check([k]) for k in arrived) < target.world - 1:
                assert time.monotonic() < deadline, "the other ranks never came to version 3"
                time.sleep(0.01)
        super()._rendezvous(target)

    def _commit_gather(self, every: list[torch.Tensor], mine: torch.Tensor) -> None:
        super()._commit_gather(every, mine)
        if self.step != SPLIT_AT:
            return
        if self.role == "victim":  # dies after its part of the commit went out
            os.kill(os.getpid(), signal.SIGKILL)
        if self.role == "lagger":  # what gloo raises when a peer's socket closes mid-collective
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer (test: the victim died "
                               "before its part of the commit arrived)")


def _worker(wid: str, port: int, q: Any, role: str = "", pipelined: bool = False) -> None:
    """A rank of the job: TinyGpt with TP, or (`pipelined`) the pipeline tests' TinyGpt cut into
    stages (tests/worker/pipeline_jobs.py); SGD with momentum, clipping on every step."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=120))
    cfg = RuntimeConfig(job=JOB, collective_timeout_s=15, rendezvous_timeout_s=90, reconfigure_timeout_s=90,
                        max_grad_norm=pj.CLIP if pipelined else CLIP)
    src = StoreLayoutSource(store, JOB, wid)
    if pipelined:
        rt = _Faulty(lambda: pj.build("gpt"), None, lambda p: pj.optimizer("gpt-sgd-clip", p), src, store, cfg,
                     pipeline=pj.pipeline())
    else:
        rt = _Faulty(lambda: build("sgd-clip"), tp_plan(CFG), _opt_fn("sgd-clip"), src, store, cfg)
    rt.role = role
    rt.start()
    while rt.step < STEPS:
        r = rt.train_step(pj.batch) if pipelined else rt.train_step(batch, loss_fn)
        if not role.startswith(("victim", "dies")):  # killed while its queue's feeder writes, it could break it
            q.put(("step", wid, r.step, r.loss, r.global_batch, r.version, r.grad_norm))
    params = {n: p.detach().cpu().numpy().copy() for n, p in rt.model.named_parameters()}
    q.put(("done", wid, params, shard_info(rt.model), [(e.what, e.version) for e in rt.timeline]))
    rt.close()


Row = tuple[int, float, int, int, float | None]  # step, loss, global batch, version, grad norm


class _Job:
    """Rank processes of one test job on a store holding its first layout, and what they report:
    every survivor's step rows and its final parameters, shards and timeline."""

    def __init__(self, first: list[Any], survivors: list[str], pipelined: bool = False) -> None:
        self.pipelined = pipelined
        self.port, self.store = store_with_layout(JOB, first, 120)
        self.ctx = worker_context()
        self.q = self.ctx.Queue()
        self.procs: dict[str, Any] = {}
        self.survivors = survivors
        self.rows: dict[str, list[Row]] = {w: [] for w in survivors}
        self.done: dict[str, Any] = {}
        self.deadline = time.monotonic() + 240

    def __enter__(self) -> _Job:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:  # the test failed while the ranks ran: none is left behind
            reap(self.procs.values(), join_s=1)

    def start(self, wid: str, role: str = "") -> None:
        self.procs[wid] = self.ctx.Process(target=_worker, args=(wid, self.port, self.q, role, self.pipelined))
        self.procs[wid].start()

    def died(self, wid: str) -> None:
        """Wait for `wid`'s process to kill itself (its role)."""
        self.procs[wid].join(timeout=180)
        assert self.procs[wid].exitcode == -signal.SIGKILL, self.procs[wid].exitcode

    def take(self) -> None:
        msg = _get(self.q, self.deadline)
        if msg[0] == "step":
            self.rows[msg[1]].append(tuple(msg[2:]))
        else:
            self.done[msg[1]] = msg[2:]

    def finish(self, version: int) -> list[Row]:
        """Every survivor ran to the end and acknowledged `version`; each returned every step once,
        the same rows (loss, batch, version, norm) on all; their losses and parameters equal the
        reference's. Returns the rows."""
        try:
            while len(self.done) < len(self.survivors):
                self.take()
        finally:
            reap(self.procs.values())
        procs = self.procs
        assert all(procs[w].exitcode == 0 for w in self.survivors), {w: p.exitcode for w, p in procs.items()}
        assert set(read_acks(self.store, JOB, version, self.survivors).values()) == {"ok"}
        ref_rows = sorted(self.rows[self.survivors[0]])
        assert [s for s, *_ in ref_rows] == list(range(STEPS))
        for w in self.survivors[1:]:
            assert sorted(self.rows[w]) == ref_rows, w
        gbs = [gb for _, _, gb, _, _ in ref_rows]
        ref_losses, ref_params = pj.reference("gpt-sgd-clip", gbs) if self.pipelined else reference("sgd-clip", gbs)
        for s, loss, _, _, norm in ref_rows:
            assert abs(loss - ref_losses[s]) <= 1e-5 * abs(ref_losses[s]), (s, loss, ref_losses[s])
            assert norm is not None and norm > (pj.CLIP if self.pipelined else CLIP)  # clipping on every step
        for w in self.survivors:
            params, units, _ = self.done[w]
            for name, err in shard_errors(params, units, ref_params, "sgd").items():
                assert err <= tolerance("sgd"), (w, name, err)
        return ref_rows

    def timeline(self, wid: str) -> list[tuple[str, int]]:
        return list(self.done[wid][2])


def test_a_rank_behind_a_split_commit_completes_the_step_from_its_synced_gradients() -> None:
    job = _Job([(A, 2), (B, 2)], ["w0", "w2", "w3"])
    with job:
        for w in A + B:
            job.start(w, {VICTIM: "victim", LAGGER: "lagger"}.get(w, ""))
        job.died(VICTIM)
        publish_layout(job.store, JOB, 2, [(["w0"], 1), (B, 2)], f"{VICTIM} failed")  # the manager's replan
        rows = job.finish(2)
    assert [(gb, v) for _, _, gb, v, _ in rows] == [(4, 1)] * 3 + [(3, 2)] * 3
    # only the rank behind rolled forward; nobody restored or re-ran step 2
    rolled = {w: [what for what, _ in job.timeline(w) if what == "step rolled forward"] for w in job.survivors}
    assert rolled == {"w0": [], "w2": ["step rolled forward"], "w3": []}
    assert not any(what == "restored from checkpoint" for w in job.survivors for what, _ in job.timeline(w))


def test_a_split_commit_in_a_pipeline_is_mended_the_same_way() -> None:
    """PP2 x TP1 x DP2: the victim holds replica A's stage 1 and dies after the commit; B's stage-0
    rank is the one behind. The replan keeps one replica, its stage 0 at TP2 (A's stage-0 rank
    joins B's) and its stage 1 at TP1: the rank behind rolls forward, then every stage reshards."""
    job = _Job([([["w0"], ["w1"]], 4), ([["w2"], ["w3"]], 4)], ["w0", "w2", "w3"], pipelined=True)
    with job:
        for w in A + B:
            job.start(w, {VICTIM: "victim", LAGGER: "lagger"}.get(w, ""))
        job.died(VICTIM)
        publish_layout(job.store, JOB, 2, [([["w2", "w0"], ["w3"]], 8)], f"{VICTIM} failed")
        rows = job.finish(2)
    assert [(gb, v) for _, _, gb, v, _ in rows] == [(8, 1)] * 3 + [(8, 2)] * 3
    rolled = {w: [what for what, _ in job.timeline(w) if what == "step rolled forward"] for w in job.survivors}
    assert rolled == {"w0": [], "w2": ["step rolled forward"], "w3": []}


def test_a_joiner_dying_mid_join_leaves_the_others_described_by_what_they_hold() -> None:
    job = _Job([(["w0"], 1), (B, 2)], ["w0", "w2", "w3"])
    with job:
        for w in job.survivors:
            job.start(w)
        while not any(s >= 1 for s, *_ in job.rows["w0"]):
            job.take()
        job.start(VICTIM, "dies joining")
        publish_layout(job.store, JOB, 2, [(A, 2), (B, 2)], f"{VICTIM} repaired")
        job.died(VICTIM)
        publish_layout(job.store, JOB, 3, [(["w0"], 1), (B, 2)], f"{VICTIM} failed while joining")
        rows = job.finish(3)
    assert {v for *_, v, _ in rows} == {1, 3}  # no step ran at version 2
    # w0 had resharded to version 2's units (half of them) when the join failed, and knew it
    tl = job.timeline("w0")
    assert ("regrouped", 2) in tl and ("failure detected", 2) in tl and ("reshard done", 2) not in tl, tl


def test_a_rank_late_to_a_superseded_version_follows_the_others_to_the_newer_one() -> None:
    """Versions 2 and 3 in quick succession (a repair reported in two parts): w0, w1 and w3 meet
    at version 2, version 3 comes out while w2 is still on its way, and they leave for it. Then
    w2 arrives at version 2, where every rank's arrival key is present. It must follow them to
    version 3 at once. (Before: counting the keys, it found everyone in, built version 2's groups
    alone and waited out its collective timeout, then recovered through the failure path.)"""
    job = _Job([(A, 2), (B, 2)], A + B)
    with job:
        for w in A + B:
            job.start(w, "late" if w == "w2" else "")
        while not any(s >= 1 for s, *_ in job.rows["w0"]):
            job.take()
        publish_layout(job.store, JOB, 2, [(["w1", "w0"], 2), (B, 2)], "replanned")
        v2 = comm.arrival_keys(f"ntp/{JOB}/pg/v0.2", 4)
        while not job.store.check([v2[0], v2[1], v2[3]]):  # w1, w0 and w3 are in; w2 holds back
            assert time.monotonic() < job.deadline, "the ranks never met at version 2"
            time.sleep(0.01)
        publish_layout(job.store, JOB, 3, [(A, 2), (["w3", "w2"], 2)], "replanned again")
        rows = job.finish(3)
    assert {v for *_, v, _ in rows} == {1, 3}  # no step ran at version 2
    for w in A + B:
        tl = job.timeline(w)
        assert not any(what in ("failure detected", "regroup failed") for what, _ in tl), (w, tl)
        assert ("regrouped", 2) not in tl and ("regrouped", 3) in tl, (w, tl)
    late = job.timeline("w2")
    assert late.index(("layout agreed", 2)) < late.index(("layout received", 3)), late


def _info(step: int, pending: bool, last: tuple[float, float | None] | None) -> tuple[float, ...]:
    """One rank's row of the regroup exchange: old rank, old version, step, pending, loss, norm,
    has last commit, has norm (runtime._apply)."""
    loss, norm = last if last else (0.0, None)
    return (0.0, 1.0, float(step), float(pending), loss, norm or 0.0, float(last is not None), float(norm is not None))


def _me(step: int) -> Any:
    """A rank that is not behind (no update of its own to make): `_roll_forward` only reads the rows."""
    return SimpleNamespace(step=step, _uncommitted=None)


def test_splits_a_late_commit_cannot_mend_are_refused() -> None:
    survivors = {0: 0, 1: 1}
    mendable = [_info(3, False, (2.5, 0.7)), _info(2, True, None)]
    assert Runtime._roll_forward(_me(3), mendable, survivors) == 3  # type: ignore[arg-type]
    # two steps apart: more than one commit is missing
    assert Runtime._roll_forward(_me(4), [_info(4, False, (2.5, 0.7)), _info(2, True, None)],  # type: ignore[arg-type]
                                 survivors) is None
    # behind without the step's synced gradients (its failure came before the commit)
    assert Runtime._roll_forward(_me(3), [_info(3, False, (2.5, 0.7)), _info(2, False, None)],  # type: ignore[arg-type]
                                 survivors) is None
    # ahead, but no rank knows the commit's outcome (it was restored or joined at that step)
    assert Runtime._roll_forward(_me(3), [_info(3, False, None), _info(2, True, None)],  # type: ignore[arg-type]
                                 survivors) is None

