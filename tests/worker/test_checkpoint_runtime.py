"""The runtime's fallback to a checkpoint, with real processes on gloo: when every holder of a unit
is gone, the survivors restore the newest verified checkpoint into the new layout and go on.

Two replicas at TP2 train with a checkpoint every 2 steps. Both ranks at TP index 1 (the only
holders of the upper half of every unit family) are SIGKILLed while their peers are inside step 5;
the "manager" publishes TP1 x DP2 with the step to restore from (2). No survivor holds the lost
units, so instead of stopping (ReconfigurationError) both survivors load that checkpoint into TP1
(passing over a newer one) and train on from its step. Every loss after the restore and the final
parameters equal one process trained straight through on the same global batches (rel. <= 1e-5):
nothing of the lost steps leaks in, and the optimizer state (AdamW moments and step, in two parameter
groups) and the LR schedule's position came back."""

from __future__ import annotations

import datetime as dt
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ntp_manager.worker.runtime import Runtime, RuntimeConfig
from ntp_manager.worker.sources import RestoreNote, StoreLayoutSource, publish_layout, read_acks
from ntp_manager.worker.tiny_gpt import TinyGpt, tp_plan
from tests.fakes.procs import worker_context
from tests.worker.ckpt_cases import CFG, make_opt
from tests.worker.compare import random_batches, shard_errors, shard_info, train_reference
from tests.worker.ranks import reap, store_with_layout

pytestmark = pytest.mark.slow

JOB = "ckrt"
GLOBAL = 8
STEPS = 7
KILL_AT = 5
A, B = ["w0", "w1"], ["w2", "w3"]


batch = random_batches(CFG.vocab, CFG.seq, GLOBAL, seed=500)


def loss_fn(model: Any, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model.loss(*b)


class _Acks(StoreLayoutSource):
    """The store source, telling the test what each ack says about a restore (the manager's
    record of it: tests/integration/test_checkpoint_restore.py)."""

    def __init__(self, *a: Any, q: Any) -> None:
        super().__init__(*a)
        self.q = q

    def ack(self, layout: Any, ok: bool, detail: str = "", restored: RestoreNote | None = None) -> None:
        super().ack(layout, ok, detail, restored)
        if restored is not None:
            self.q.put(("restore note", self.worker_id, layout.version, restored))


def _worker(wid: str, port: int, root: str, q: Any) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=120))
    cfg = RuntimeConfig(job=JOB, collective_timeout_s=20, rendezvous_timeout_s=90, reconfigure_timeout_s=90,
                        checkpoint_dir=root, checkpoint_interval=2, checkpoint_keep_last=2,
                        checkpoint_complete_timeout_s=30)
    rt = Runtime(lambda: TinyGpt(CFG), tp_plan(CFG), make_groups, _Acks(store, JOB, wid, q=q), store, cfg,
                 scheduler_fn=make_schedule)
    rt.data_state_fn = lambda: {"next_step": rt.step}
    rt.start()
    while rt.step < STEPS:
        if wid in ("w1", "w3") and rt.step == KILL_AT:
            assert rt.checkpointer is not None
            rt.checkpointer.wait(60)  # its part of step 4's checkpoint is on disk (the usual case)
            q.close()  # its messages so far reach the test before it parks (a put hands them to a
            q.join_thread()  # feeder thread that the kill could stop before it wrote them)
            store.add("test/parked", 1)
            time.sleep(3600)  # SIGKILLed here, while its peers are inside step 5
        r = rt.train_step(batch, loss_fn)
        q.put(("step", wid, r.step, r.loss, r.version, r.tp))
    assert rt.restored is not None
    q.put(("done", wid, {n: p.detach().numpy().copy() for n, p in rt.model.named_parameters()}, shard_info(rt.model),
           [(e.what, e.version, e.detail) for e in rt.timeline], rt.restored.step, rt.restored.data_state))
    rt.close()


def make_groups(params: Any) -> torch.optim.Optimizer:
    """make_opt's AdamW in two groups: no weight decay on biases and norms."""
    ps = list(params)
    return make_opt("adamw", [{"params": [p for p in ps if p.ndim >= 2]},
                              {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}])


def make_schedule(opt: torch.optim.Optimizer) -> Any:
    """A learning rate that moves every step: a restore that left the schedule at its start (or the
    groups at optimizer_fn's values) would show in every loss after it."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    m = TinyGpt(CFG)
    opt = make_groups(m.parameters())
    return train_reference(m, opt, (batch(s, 0, GLOBAL) for s in range(STEPS)), lambda b: m.loss(*b),
                           make_schedule(opt))


def test_losing_every_holder_of_a_unit_restores_the_checkpoint_into_the_new_layout(tmp_path: Path) -> None:
    port, store = store_with_layout(JOB, [(A, 4), (B, 4)], 120)
    ctx = worker_context()
    q = ctx.Queue()
    procs = {w: ctx.Process(target=_worker, args=(w, port, str(tmp_path), q)) for w in A + B}
    for p in procs.values():
        p.start()
    steps: dict[str, list[tuple[int, float, int, int]]] = {w: [] for w in A + B}
    done: dict[str, Any] = {}
    notes: dict[str, Any] = {}
    deadline = time.monotonic() + 240
    try:
        # the kill waits until both survivors have finished step 4 (its commit point included), so
        # that they are at or inside step 5 (waiting for their peers), never still inside step 4
        while not all(any(row[0] == KILL_AT - 1 for row in steps[w]) for w in ("w0", "w2")):
            msg = q.get(timeout=max(deadline - time.monotonic(), 1))
            assert msg[0] == "step", msg
            steps[msg[1]].append(tuple(msg[2:]))
        while store.add("test/parked", 0) < 2:
            assert time.monotonic() < deadline, "the victims never reached step 5"
            time.sleep(0.05)
        for w in ("w1", "w3"):
            os.kill(procs[w].pid, signal.SIGKILL)  # type: ignore[arg-type]
            procs[w].join()
        # the manager's layout names the step to restore from (Layout.restore_step): step 2, though
        # step 4's checkpoint may be complete too
        publish_layout(store, JOB, 2, [(["w0"], 4), (["w2"], 4)], "w1 and w3 failed", restore_step=2)
        while len(done) < 2:
            msg = q.get(timeout=max(deadline - time.monotonic(), 1))
            if msg[0] == "step":
                steps[msg[1]].append(tuple(msg[2:]))
            elif msg[0] == "restore note":
                notes[msg[1]] = msg[2:]
            else:
                done[msg[1]] = msg[2:]
    finally:
        reap(procs.values())
    assert procs["w0"].exitcode == 0 and procs["w2"].exitcode == 0
    assert read_acks(store, JOB, 2, ["w0", "w2"]) == {"w0": "ok", "w2": "ok"}

    ref_losses, ref_params = reference()
    for w in ("w0", "w2"):
        params, units, timeline, restored_step, data_state = done[w]
        assert restored_step == 2, restored_step
        assert data_state == {"next_step": restored_step}
        version, note = notes[w]  # what the ack tells the manager
        assert version == 2 and note.step == restored_step and note.checkpoint == f"step-{restored_step:012d}"
        assert "has no surviving holder" in note.reason, note
        (ev,) = [(v, d) for what, v, d in timeline if what == "restored from checkpoint"]
        assert ev[0] == 2 and ev[1].startswith(f"restored from step {restored_step} ")
        assert "has no surviving holder" in ev[1], ev
        # steps before the kill at TP2 (version 1); from the restored step on at TP1 (version 2)
        rows = sorted(set(steps[w]))
        assert [(s, v, tp) for s, _, v, tp in rows if v == 2] == [(s, 2, 1) for s in range(restored_step, STEPS)]
        assert [s for s, _, v, _ in rows if v == 1] == list(range(KILL_AT))
        for s, loss, _, _ in rows:
            assert abs(loss - ref_losses[s]) <= 1e-5 * abs(ref_losses[s]), (w, s, loss, ref_losses[s])
        for name, err in shard_errors(params, units, ref_params, "sgd").items():  # every parameter
            assert err <= 1e-5, (w, name, err)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))[-1] == "step-000000000006"
