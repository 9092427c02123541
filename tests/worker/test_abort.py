"""Abandoning the doomed step (runtime/abort.py), with real processes on gloo.

TP2 (w0, w1) + TP1 (w2), micro-batches of one sample; w2 is the slow replica in step 2 (its loss
sleeps 1 s per micro-batch there), so without the abort it would learn of a failure only at the gradient
sync, after its whole forward and backward. w1's process is SIGKILLed in step 2 -- inside a
block's forward, inside a block's backward, or just before the gradient sync -- after publishing
the manager's next layout (w0 alone + w2). Whoever learns of it first reports it in the store --
w0 when its TP collective with w1 fails, or the test, as ntp-run does, when it sees w1's process
exit (the only one to know while w0 waits in the sync for the slow replica) -- and w2 abandons
its step at its next block or micro-batch (`StepAborted` in its timeline's failure), not at the
sync. Nothing of the abandoned attempt is kept: the redo draws the same
random numbers (the RNG put back), and every step's loss and the survivors' parameters equal one
process trained on the same global batches."""

from __future__ import annotations

import datetime as dt
import queue
import signal
import time
from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ntp_manager.worker.runtime import RuntimeConfig
from ntp_manager.worker.runtime.abort import install_block_checks
from ntp_manager.worker.runtime.config import StepAborted
from ntp_manager.worker.sources import StoreLayoutSource, report_failure
from ntp_manager.worker.tiny_gpt import tp_plan
from tests.fakes.procs import worker_context
from tests.worker.compare import shard_errors, shard_info, tolerance
from tests.worker.ranks import reap, store_with_layout
from tests.worker.test_runtime import CFG, _get, batch, build, loss_fn, make_opt, reference
from tests.worker.test_samples import _Faulty, _hook

JOB = "once"  # _Faulty publishes under test_samples' job name
STEPS = 5
FIRST = [(["w0", "w1"], 4), (["w2"], 4)]
AFTER = [(["w0"], 2), (["w2"], 4)]


def _worker(wid: str, port: int, q: Any, point: str) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=120))
    cfg = RuntimeConfig(job=JOB, collective_timeout_s=60, rendezvous_timeout_s=60, reconfigure_timeout_s=60,
                        micro_batch_size=1)
    rt: _Faulty = _Faulty(lambda: build("sgd"), tp_plan(CFG), lambda ps: make_opt("sgd", ps),
                          StoreLayoutSource(store, JOB, wid), store, cfg, post_parallelize=lambda m: _hook(rt, m))
    # w1 dies in step 2: at its second micro-batch's forward or backward (4 micro-batches a step), or its sync
    rt.arm(wid, {1: (("w1", point, 2 if point.startswith("sync") else 9, True), AFTER)}, q)
    draws: dict[tuple[int, int], list[float]] = defaultdict(list)

    def loss(model: Any, b: Any) -> torch.Tensor:
        lay = rt.layout
        assert lay is not None
        draws[(rt.step, lay.version)].append(float(torch.rand(1)))  # what a dropout would draw
        if wid == "w2" and (rt.step, lay.version) == (2, 1):
            time.sleep(1.0)  # the slow replica, in the doomed step: 4 s to its sync, unless it abandons the step
        return loss_fn(model, b)

    rt.start()
    while rt.step < STEPS:
        r = rt.train_step(batch, loss)
        q.put(("step", wid, r.step, r.loss, r.global_batch, r.version))
    q.put(("done", wid, {n: p.detach().numpy().copy() for n, p in rt.model.named_parameters()},
           shard_info(rt.model), [(e.what, e.version, e.detail) for e in rt.timeline], dict(draws)))
    rt.close()


@pytest.mark.parametrize("point", ["forward", "backward", "sync-before"])
def test_a_peer_failure_abandons_the_slow_replicas_step_at_its_next_block(point: str) -> None:
    port, store = store_with_layout(JOB, FIRST, 120)
    ctx = worker_context()
    q = ctx.Queue()
    procs = {w: ctx.Process(target=_worker, args=(w, port, q, point)) for w in ("w0", "w1", "w2")}
    for p in procs.values():
        p.start()
    rows: dict[str, list[tuple[int, float, int, int]]] = {"w0": [], "w2": []}
    done: dict[str, Any] = {}
    reported = False
    try:
        deadline = time.monotonic() + 240
        while len(done) < 2:
            if not reported and procs["w1"].exitcode is not None:  # what ntp-run does when a rank dies
                report_failure(store, JOB, 1, f"w1 exited with {procs['w1'].exitcode}")
                reported = True
            try:
                msg = _get(q, min(deadline, time.monotonic() + 0.02))
            except queue.Empty:
                continue
            if msg[0] == "step" and msg[1] in rows:
                rows[msg[1]].append(tuple(msg[2:]))
            elif msg[0] == "done":
                done[msg[1]] = msg[2:]
    finally:
        reap(procs.values())
    assert procs["w1"].exitcode == -signal.SIGKILL and procs["w0"].exitcode == procs["w2"].exitcode == 0
    assert rows["w0"] == rows["w2"]
    assert [(s, gb, v) for s, _, gb, v in rows["w0"]] == [(0, 8, 1), (1, 8, 1), (2, 6, 2), (3, 6, 2), (4, 6, 2)]
    ref_losses, ref_params = reference("sgd", [gb for _, _, gb, _ in rows["w0"]])
    for s, loss, _, _ in rows["w0"]:
        assert abs(loss - ref_losses[s]) <= 1e-5 * abs(ref_losses[s]), (s, loss, ref_losses[s])
    for w, (params, units, timeline, draws) in done.items():
        for name, err in shard_errors(params, units, ref_params, "sgd").items():
            assert err <= tolerance("sgd"), (w, name, err)
        failure = [d for what, v, d in timeline if what == "failure detected"]
        assert len(failure) == 1, timeline
        # the redo of step 2 drew what the abandoned attempt drew (as far as that one got)
        first, redo = draws[(2, 1)], draws[(2, 2)]
        n = min(len(first), len(redo))
        assert n > 0 and redo[:n] == first[:n], (w, first, redo)
        assert draws[(3, 2)][0] != redo[0]
    # the slow replica left its step at a block or between micro-batches, before its sync
    (w2_failure,) = [d for what, _, d in done["w2"][2] if what == "failure detected"]
    assert w2_failure.startswith("StepAborted: step 2 abandoned ") and "gradient sync" not in w2_failure, w2_failure
    assert "before block" in w2_failure or "between micro-batches" in w2_failure


@pytest.mark.parametrize("spec", ["tiny", "llama-gqa", "gpt2"])
def test_the_block_checks_run_before_every_blocks_forward_and_backward(spec: str) -> None:
    """The hooks the runtime puts on a model (one process, no runtime): TinyGpt's `blocks`, HF
    Llama's `layers` and GPT-2's `h` are found; each block's check runs before its forward and
    before its backward; a check that raises stops the pass there, with nothing left hooked twice."""
    from tests.worker import hf_models

    if spec != "tiny":
        pytest.importorskip("transformers")
    model = build("sgd") if spec == "tiny" else hf_models.build(spec, tied=False)
    seen: list[str] = []
    assert install_block_checks(model, seen.append) == 2
    assert install_block_checks(model, seen.append) == 0  # after a reshard: the same modules, already hooked
    if spec == "tiny":
        loss = loss_fn(model, batch(0, 0, 2))
    else:
        ids, labels = hf_models.tokens(0, 2)
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    assert seen == ["before block 0's forward", "before block 1's forward", "before block 1's backward",
                    "before block 0's backward"]

    def stop_at_backward(where: str) -> None:
        if "backward" in where:
            raise StepAborted(f"abandoned {where}")

    fresh = build("sgd")
    install_block_checks(fresh, stop_at_backward)
    with pytest.raises(StepAborted, match="abandoned before block 1's backward"):
        loss_fn(fresh, batch(0, 0, 2)).backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for n, p in fresh.named_parameters() if "blocks" in n)
