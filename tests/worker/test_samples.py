"""Exactly-once samples through failures, repairs and a checkpoint restore (real rank processes on
gloo, the runtime's real step / commit / regroup / reshard path).

Three rank processes train TinyGpt on a `MapSource` through a random walk of layouts whose global
batch changes (4, 6, 9: TP1, TP2 and TP3 replicas, a worker left out and taken back). Every
layout version ends in an injected failure of one rank at a random point -- inside the forward
(a block's forward hook), inside the backward (a hook on a block's output gradient), before or
after the gradient sync, before or after the commit all-gather (after: the others commit and the
victim rolls the step forward at the regroup) -- at its first or second step there. The victim
publishes the next layout (the manager's part) and raises what gloo raises when a peer's socket
closes; from there everything is the runtime's own: it leaves its groups, the others' collectives
fail, all regroup at the next version, reshard, and redo the step. Some failures are real
(SIGKILL of the victim's process; the test starts a fresh one, which joins when a layout names it
again). Phase 1 ends in a checkpoint; phase 2 restores it into another layout (a different global
batch) in fresh processes and goes on failing.

Every rank logs the global sample indices its data source served in each step attempt, and each
committed step's result (its cursor, global batch, the replica's first sample): the indices of
the committed steps are [0, total) exactly once, no gap, every replica's its share. The same run
with the step-addressed form (`batch_fn(step, start, count)`, the global batch of step s being
samples [s * MAX, s * MAX + MAX) of a fixed maximum) trains nothing past each shrunken global
batch: it loses exactly sum(MAX - global batch) samples (asserted).
"""

from __future__ import annotations

import datetime as dt
import os
import random
import signal
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from ntp_manager.worker.data import MapSource
from ntp_manager.worker.runtime import Runtime, RuntimeConfig
from ntp_manager.worker.sources import StoreLayoutSource, publish_layout
from ntp_manager.worker.tiny_gpt import TinyGpt, tp_plan
from tests.fakes.procs import worker_context
from tests.worker.ranks import reap, store_with_layout
from tests.worker.test_runtime import CFG

JOB = "once"
WORKERS = ["w0", "w1", "w2"]
# layouts over the three workers: (workers of a replica, its local batch); the global batch changes
LAYOUTS: dict[str, list[Any]] = {
    "A": [(["w0", "w1"], 4), (["w2"], 2)],  # 6
    "B": [(["w0"], 2), (["w2"], 2)],  # 4, w1 out
    "C": [(["w1"], 2), (["w2"], 2)],  # 4, w0 out
    "D": [(["w0", "w1"], 4)],  # 4, w2 out
    "E": [(["w0"], 2), (["w1", "w2"], 4)],  # 6
    "F": [(["w0"], 3), (["w1"], 3), (["w2"], 3)],  # 9
    "G": [(["w0", "w1", "w2"], 6)],  # 6, TP3
}
MAX_GB = 9
POINTS = ["forward", "backward", "sync-before", "sync-after", "commit-before", "commit-after"]
SAMPLES = 97  # the dataset's length: the cursor runs through several epochs


def _members(doc: list[Any]) -> set[str]:
    return {w for ws, _ in doc for w in ws}


def schedule(seed: int, first: str, faults: int, kills: int) -> list[tuple[str, Any]]:
    """Layout names for versions 1..faults+1 and the fault ending each of the first `faults`:
    (victim, point, which of its passes there fails, killed). The next layout keeps some replica
    of the current one whole -- one without the victim when the victim's process is killed -- so
    the survivors hold every unit; the last one has every worker and no fault."""
    rng = random.Random(seed)
    kill_from = sorted(rng.sample(range(2, faults - 2), kills))
    out: list[tuple[str, Any]] = []
    cur = first
    for v in range(faults):
        victim = rng.choice(sorted(_members(LAYOUTS[cur])))
        # a kill where another replica survives it (the first chance from each drawn version on)
        kill = bool(kill_from) and v >= kill_from[0] and len(LAYOUTS[cur]) > 1 and v < faults - 1
        if kill:
            kill_from.pop(0)
        keep = [set(ws) for ws, _ in LAYOUTS[cur] if not (kill and victim in ws)]
        ok = [n for n in LAYOUTS if n != cur and any(k <= _members(LAYOUTS[n]) for k in keep)]
        if v == faults - 1:  # A again when the walk is there (a version of the same layout)
            ok = ["A"]
        point = "backward" if kill else rng.choice(POINTS)
        out.append((cur, (victim, point, rng.choice([0, 0, 1]), kill)))
        cur = rng.choice(ok)
    assert not kill_from, "every kill found a layout to happen in"
    assert cur == "A", "the walk must end with every worker"
    out.append((cur, None))
    return out


class _Tokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """SAMPLES token sequences, sample i drawn from a generator seeded with i."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(5000 + i)
        t = torch.randint(0, CFG.vocab, (CFG.seq + 1,), generator=g)
        return t[:-1], t[1:]


def _loss(model: Any, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    out: torch.Tensor = model.loss(*b)
    return out


class _Faulty(Runtime):
    """The runtime with one rank's failure injected per layout version (module doc)."""

    wid = ""
    faults: dict[int, tuple[tuple[str, str, int, bool], list[Any]]] = {}
    q: Any = None

    def arm(self, wid: str, faults: dict[int, tuple[tuple[str, str, int, bool], list[Any]]], q: Any) -> None:
        self.wid, self.faults, self.q = wid, faults, q
        self.passes: dict[tuple[int, str], int] = defaultdict(int)
        self.served: dict[tuple[int, int], list[int]] = defaultdict(list)  # (step, version) -> indices read

    def report(self, r: Any) -> None:
        """A committed step as this rank trained it: its result, and the indices its source served."""
        self.q.put(("step", self.wid, r.step, r.version, r.cursor, r.global_batch, r.first_sample, r.local_batch,
                    sorted(self.served.get((r.step, r.version), []))))

    def fault(self, point: str) -> None:
        lay = self.layout
        assert lay is not None
        got = self.faults.get(lay.version)
        if got is None or got[0][0] != self.wid or got[0][1] != point:
            return
        (_, _, nth, kill), nxt = got
        self.passes[(lay.version, point)] += 1
        if self.passes[(lay.version, point)] != nth + 1:
            return
        publish_layout(self.store, JOB, lay.version + 1, nxt, f"{self.wid} failed at {point}")
        if point == "commit-after":
            # its part of the commit went out: the others commit the step with this rank's
            # gradients, so its samples were trained, whether or not it rolls the step forward
            # itself (it does not when the next layout leaves it out)
            assert self._uncommitted is not None
            self.report(self._uncommitted)
        if kill:
            self.q.close()  # what it reported reaches the test before it dies
            self.q.join_thread()
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"Connection closed by peer (test: {self.wid} failed at {point}, "
                           f"version {lay.version})")

    def _sync_grads(self) -> None:
        self.fault("sync-before")
        super()._sync_grads()
        self.fault("sync-after")

    def _commit_gather(self, every: list[torch.Tensor], mine: torch.Tensor) -> None:
        self.fault("commit-before")
        super()._commit_gather(every, mine)
        self.fault("commit-after")


def _hook(rt: _Faulty, model: Any) -> None:
    """post_parallelize: fault points inside the last block's forward and backward (once per model)."""
    blk = model.blocks[-1]
    if getattr(blk, "_fault_hooked", False):
        return
    blk._fault_hooked = True

    def on_grad(g: torch.Tensor) -> torch.Tensor:
        rt.fault("backward")
        return g

    def after_forward(_m: Any, _inp: Any, out: torch.Tensor) -> None:
        rt.fault("forward")
        if out.requires_grad:
            out.register_hook(on_grad)

    blk.register_forward_hook(after_forward)


def _worker(wid: str, port: int, q: Any, plan: list[tuple[str, Any]], first_version: int, form: str,
            ckpt: str, save_at_end: bool) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=120))
    cfg = RuntimeConfig(job=JOB, collective_timeout_s=20, rendezvous_timeout_s=60, reconfigure_timeout_s=60,
                        checkpoint_dir=ckpt)
    faults = {first_version + i: (f, LAYOUTS[plan[i + 1][0]]) for i, (_, f) in enumerate(plan) if f is not None}
    final = first_version + len(plan) - 1
    rt: _Faulty = _Faulty(lambda: TinyGpt(CFG), tp_plan(CFG), lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                          StoreLayoutSource(store, JOB, wid), store, cfg,
                          post_parallelize=lambda m: _hook(rt, m))
    rt.arm(wid, faults, q)
    source = MapSource(_Tokens(), seed=11)

    def samples(start: int, count: int) -> Any:
        lay = rt.layout
        assert lay is not None
        rt.served[(rt.step, lay.version)].extend(range(start, start + count))
        return source(start, count)

    samples.prefetch = source.prefetch  # type: ignore[attr-defined]  # the runtime's prefetch reaches the source

    def batch_fn(step: int, start: int, count: int) -> Any:  # the docs' step-addressed form
        return samples(step * MAX_GB + start, count)

    rt.start()
    at_final = 0
    while at_final < 2:
        r = rt.train_step(loss_fn=_loss, samples=samples) if form == "samples" else rt.train_step(batch_fn, _loss)
        rt.report(r)
        at_final += r.version == final
    if save_at_end:
        rt.save_checkpoint()
    q.put(("done", wid, rt.step, rt.samples, source.prefetch_hits))
    rt.close()
    source.close()


Report = tuple[str, int, int, int, int, int, int, list[int]]


def run_phase(plan: list[tuple[str, Any]], form: str, ckpt: Path, save_at_end: bool, seconds: float) -> list[Report]:
    """The three workers through `plan` (layout versions from 1); a process SIGKILLed by its fault
    is started again at once (a repaired GPU's fresh process). Returns every committed step's report."""
    port, store = store_with_layout(JOB, LAYOUTS[plan[0][0]], 120)
    ctx = worker_context()
    q = ctx.Queue()
    procs: dict[str, Any] = {}
    starts = 0

    def start(w: str) -> None:
        nonlocal starts
        procs[w] = ctx.Process(target=_worker, args=(w, port, q, plan, 1, form, str(ckpt), save_at_end))
        procs[w].start()
        starts += 1

    for w in WORKERS:
        start(w)
    rows: list[Report] = []
    done: dict[str, Any] = {}
    deadline = time.monotonic() + seconds
    try:
        while len(done) < len(WORKERS):
            assert time.monotonic() < deadline, f"no progress: {len(rows)} reports, done {sorted(done)}"
            for w, p in list(procs.items()):
                if w not in done and p.exitcode == -signal.SIGKILL:
                    start(w)  # the repair
                elif w not in done and p.exitcode not in (None, 0):
                    raise AssertionError(f"{w} exited with {p.exitcode}")
            try:
                msg = q.get(timeout=0.2)
            except Exception:
                continue
            if msg[0] == "step":
                rows.append(tuple(msg[1:]))
            else:
                done[msg[1]] = msg[2:]
    finally:
        reap(procs.values(), join_s=30 if len(done) == len(WORKERS) else 1)
    kills = sum(f is not None and f[3] for _, f in plan)
    assert starts == len(WORKERS) + kills
    assert all(p.exitcode == 0 for p in procs.values()), {w: p.exitcode for w, p in procs.items()}
    assert len({(s, n) for s, n, _ in done.values()}) == 1, done  # every rank ends at the same step and cursor
    if form == "samples":  # the runtime's prefetch (after each commit) served reads
        assert all(hits > 0 for _, _, hits in done.values()), done
    del store
    return rows


def committed(rows: list[Report]) -> list[tuple[int, int, int, list[list[int]]]]:
    """Per committed step: (step, cursor, global batch, every replica's served indices), checking
    that all ranks agree on the step (its newest version's reports) and that the TP ranks of a
    replica served the same samples."""
    by_step: dict[int, list[Report]] = defaultdict(list)
    for r in rows:
        by_step[r[1]].append(r)
    out = []
    for s in sorted(by_step):
        # A step committed only by ranks that all leave the next layout (the survivors were behind
        # it) is redone by the survivors at the newer version, and the job goes on from theirs:
        # the newest version's reports of a step are the ones training continued from.
        newest = max(r[2] for r in by_step[s])
        rs = [r for r in by_step[s] if r[2] == newest]
        assert len({(v, c, gb) for _, _, v, c, gb, _, _, _ in rs}) == 1, rs
        _, _, _, cursor, gb, _, _, _ = rs[0]
        replicas: dict[int, list[int]] = {}
        for _, _, _, _, _, first, lb, idx in rs:
            assert replicas.setdefault(first, idx) == idx, (s, first)
            assert first - cursor + lb <= MAX_GB
        out.append((s, cursor, gb, list(replicas.values())))
    return out


@pytest.mark.timeout(600)
def test_every_sample_exactly_once_through_200_failures_and_a_restore_into_another_layout(tmp_path: Path) -> None:
    one = schedule(seed=1, first="A", faults=130, kills=1)
    two = schedule(seed=2, first="F", faults=70, kills=1)  # restores phase 1's checkpoint into 3 x TP1 (9)
    assert sum(f is not None for _, f in one + two) == 200
    rows = run_phase(one, "samples", tmp_path, True, 400)
    rows2 = run_phase(two, "samples", tmp_path, False, 300)
    steps = committed(rows) + committed(rows2)
    # phase 2 went on from phase 1's last step and cursor (the checkpoint)
    assert [s for s, *_ in steps] == list(range(len(steps)))
    assert len({gb for _, _, gb, _ in steps}) >= 3  # the global batch changed (4, 6, 9)
    cursor = 0
    trained: list[int] = []
    for s, c, gb, reps in steps:
        assert c == cursor, (s, c, cursor)
        got = sorted(i for idx in reps for i in idx)
        assert got == list(range(c, c + gb)), (s, got)  # exactly once within the step, each replica its share
        trained += got
        cursor += gb
    assert sorted(trained) == list(range(cursor))  # every index once, no gap, over all steps


def test_the_step_addressed_form_loses_the_samples_past_a_shrunken_global_batch(tmp_path: Path) -> None:
    plan = schedule(seed=3, first="A", faults=12, kills=0)
    steps = committed(run_phase(plan, "step", tmp_path, False, 240))
    trained = sorted(i for _, _, _, reps in steps for idx in reps for i in idx)
    n = len(steps)
    lost = sorted(set(range(n * MAX_GB)) - set(trained))
    assert len(trained) == len(set(trained))  # nothing twice ...
    assert len(lost) == sum(MAX_GB - gb for _, _, gb, _ in steps) > 0  # ... but every step past its batch is lost
