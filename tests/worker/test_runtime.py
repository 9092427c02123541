"""The live runtime with real processes on gloo: two DP replicas at TP4 train; one rank's process is
SIGKILLed mid-run; the survivors' collectives fail, they wait for the next layout (TP3 for the hit
replica, smaller local batch), regroup under a new store prefix, fetch the lost shards from the peer
replica and re-run the step; then a fresh process for the repaired GPU joins, receives its shards,
the replicated parameters and optimizer state, and the replica is back at TP4.

Every step's loss and the final parameters equal a single-process reference trained on the same
global batches (rel. <= 1e-5), including the steps with the reduced local batch."""

from __future__ import annotations

import datetime as dt
import math
import os
import signal
import time
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ntp_manager.worker import comm
from ntp_manager.worker.runtime import ReconfigurationError, Runtime, RuntimeConfig
from ntp_manager.worker.sources import StoreLayoutSource, publish_layout, read_acks
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt, tp_plan
from tests.fakes.procs import worker_context
from tests.worker import devices
from tests.worker.compare import (
    BF16_LOSS,
    BF16_UPDATE,
    random_batches,
    shard_errors,
    shard_info,
    tolerance,
    train_reference,
    update_errors,
)
from tests.worker.ranks import reap, store_with_layout

CFG = GptConfig(vocab=64, seq=16, d_model=48, heads=6, mlp=90, layers=2)
JOB = "rt"
MAX_BATCH = 8
STEPS = 8
A = ["w0", "w1", "w2", "w3"]
B = ["w4", "w5", "w6", "w7"]


batch = random_batches(CFG.vocab, CFG.seq, MAX_BATCH, seed=1000)


def loss_fn(model: Any, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    dev = next(model.parameters()).device  # the batch comes on the CPU; the model may be on a GPU
    return model.loss(*(t.to(dev) for t in b))


CLIP = 0.2  # below every step's gradient norm in these runs: "sgd-clip" clips on every step


def build(kind: str) -> TinyGpt:
    """The model of a run; "sgd-clip" ties the LM head to the token embedding (both cut by
    vocabulary rows: one shard Parameter), so the clipping case has replicated parameters (norms,
    row-wise biases, positions) and a tied weight whose gradient the norm must count once."""
    m = TinyGpt(CFG)
    if kind == "sgd-clip":
        m.head.weight = m.tok.weight
        torch.nn.init.normal_(m.tok.weight, std=0.1)  # as small as a head's (N(0, 1) logits: loss ~33)
    return m


def make_opt(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind in ("sgd", "sgd-clip"):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    if kind == "adamw-groups":  # the usual LLM set-up: decay on matrices only; amsgrad for its extra state
        ps = list(params)
        return torch.optim.AdamW([{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1},
                                  {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}],
                                 lr=0.01, amsgrad=True)
    if kind == "adamw-bf16-rc":  # lr 1e-3: updates of weights near 1 below bf16's spacing (compare.BF16_UPDATE)
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _opt_fn(kind: str) -> Any:
    return lambda params: make_opt(kind, params)


def warmup_cosine(step: int) -> float:
    return min(1.0, (step + 1) / 3) * 0.5 * (1 + math.cos(math.pi * step / STEPS))


def make_sched(kind: str, opt: torch.optim.Optimizer) -> Any:
    """"adamw-groups" runs under a schedule that moves the learning rate every step: a rank that
    joins with optimizer_fn's values, or a schedule left on a replaced optimizer, is visible."""
    return torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine) if kind == "adamw-groups" else None


def _sched_fn(kind: str) -> Any:
    return (lambda opt: make_sched(kind, opt)) if kind == "adamw-groups" else None


def _worker(wid: str, port: int, kind: str, q: Any, park_at: int | None, device: str = "cpu", steps: int = STEPS,
            index: int = 0) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=120))
    src = StoreLayoutSource(store, JOB, wid)
    # "cuda": CUDA tensors, gloo (the ranks share the GPUs there are), staged through host memory;
    # "staged": CPU tensors with that staging forced
    dev = {"cuda": dict(device="cuda", backend="gloo", local_rank=index, local_world_size=8),
           "nccl": dict(device="cuda", backend="nccl", local_rank=index, local_world_size=4),
           "staged": dict(force_staging=True)}.get(device, {})
    cfg = RuntimeConfig(job=JOB, collective_timeout_s=15, rendezvous_timeout_s=90, reconfigure_timeout_s=90,
                        max_grad_norm=CLIP if kind == "sgd-clip" else None,
                        micro_batch_size=1 if kind in ("sgd-clip", "adamw-bf16-rc") else None,
                        precision="bf16" if "bf16" in kind else "fp32", recompute=kind.endswith("-rc"),
                        **dev)  # type: ignore[arg-type]
    rt = Runtime(lambda: build(kind), tp_plan(CFG), _opt_fn(kind), src, store, cfg, scheduler_fn=_sched_fn(kind))
    rt.start()
    while rt.step < steps:
        if park_at is not None and rt.step == park_at:
            q.close()  # its messages so far reach the test before it parks: a put only hands them to a
            q.join_thread()  # feeder thread, and the kill could otherwise lose the last step's
            store.set("test/parked", wid)
            time.sleep(3600)  # the test SIGKILLs this process here, while its peers are inside a step
        r = rt.train_step(batch, loss_fn)
        q.put(("step", wid, r.step, r.loss, r.global_batch, r.version, r.tp))
    units = shard_info(rt.model)
    params = {n: p.detach().cpu().numpy().copy() for n, p in rt.model.named_parameters()}
    q.put(("done", wid, params, units, [(e.what, e.version) for e in rt.timeline],
           (rt.choice.backend, str(next(rt.model.parameters()).device), comm.stats.staged_ops)))
    rt.close()


def reference(kind: str, batches: list[int]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the global batches; under bf16 each step's pass on bf16 copies of the fp32
    parameters (torch.func.functional_call), the gradients and the optimizer fp32."""
    torch.manual_seed(0)
    m = build(kind)
    opt = make_opt(kind, m.parameters())

    def loss(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if "bf16" not in kind:
            return m.loss(*b)
        copies = {n: p.to(torch.bfloat16) for n, p in m.named_parameters()}
        out: torch.Tensor = torch.func.functional_call(m, copies, (b[0],))
        return torch.nn.functional.cross_entropy(out.float().flatten(0, 1), b[1].flatten())

    return train_reference(m, opt, (batch(s, 0, gb) for s, gb in enumerate(batches)), loss,
                           make_sched(kind, opt), CLIP if kind == "sgd-clip" else None)


def _get(q: Any, deadline: float) -> Any:
    left = deadline - time.monotonic()
    if left <= 0:
        raise AssertionError("the workers stopped making progress")
    return q.get(timeout=left)


def kill_and_rejoin(kind: str, device: str, a: list[str], b: list[str], steps: int) -> None:
    """Replicas `a` and `b` (local batch = TP degree) train; `a`'s last rank is SIGKILLed at the
    step-2 boundary while its peers are inside step 2; the manager's replan takes `a` to one rank
    less; a fresh process for it rejoins and `a` is whole again. Every step's loss and the final
    parameters equal a single-process reference on the same global batches."""
    victim = a[-1]
    port, store = store_with_layout(JOB, [(a, len(a)), (b, len(b))], 120)
    ctx = worker_context()
    q = ctx.Queue()
    index = {w: i for i, w in enumerate(a + b)}

    def spawn(w: str, park: int | None) -> Any:
        return ctx.Process(target=_worker, args=(w, port, kind, q, park, device, steps, index[w]))

    procs = {w: spawn(w, 2 if w == victim else None) for w in a + b}
    for p in procs.values():
        p.start()
    steps_of: dict[str, list[tuple[int, float, int, int, int]]] = {w: [] for w in a + b}
    done: dict[str, Any] = {}
    deadline = time.monotonic() + 240
    try:
        # 1. the victim parks at the step-2 boundary; its peers enter step 2 and block on it. The
        # kill waits until every peer has finished step 1 (its commit point included): a rank that
        # dies while a peer is still inside step 1's commit all-gather is another case (a split
        # commit, test_switch_failures.py), which no fixed pause can rule out on a loaded machine.
        peers = [w for w in a + b if w != victim]
        while not all(any(row[0] == 1 for row in steps_of[w]) for w in peers):
            _kind, wid, *rest = _get(q, deadline)
            steps_of[wid].append(tuple(rest))  # type: ignore[arg-type]
        while not store.check(["test/parked"]):
            assert time.monotonic() < deadline, "the victim never reached the step-2 boundary"
            time.sleep(0.05)
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].join()
        # 2. the "manager" publishes the replan: replica a one rank down, its local batch with it
        publish_layout(store, JOB, 2, [(a[:-1], len(a) - 1), (b, len(b))], f"{victim} failed")
        while not any(v == 2 and s >= 3 for w in steps_of for s, _, _, v, _ in steps_of[w]):
            _kind, wid, *rest = _get(q, deadline)
            steps_of[wid].append(tuple(rest))  # type: ignore[arg-type]
        # 3. the GPU is repaired: a fresh process for it, and the layout takes it back
        procs[victim] = spawn(victim, None)
        procs[victim].start()
        publish_layout(store, JOB, 3, [(a, len(a)), (b, len(b))], f"{victim} repaired")
        while len(done) < len(a) + len(b):
            msg = _get(q, deadline)
            if msg[0] == "step":
                steps_of[msg[1]].append(tuple(msg[2:]))
            else:
                done[msg[1]] = msg[2:]
    finally:
        reap(procs.values())

    assert all(p.exitcode == 0 for p in procs.values()), {w: p.exitcode for w, p in procs.items()}
    acks2 = read_acks(store, JOB, 2, a[:-1] + b)
    acks3 = read_acks(store, JOB, 3, a + b)
    assert set(acks2.values()) == {"ok"} and len(acks2) == len(a) + len(b) - 1
    assert set(acks3.values()) == {"ok"} and len(acks3) == len(a) + len(b)

    # every survivor saw the same steps, losses and batches; TP degrees n -> n-1 -> n on replica a
    first = a[0]
    ref_rows = sorted(steps_of[first])
    assert [s for s, *_ in ref_rows] == list(range(steps))
    for w in [*a[1:-1], *b]:
        assert [(s, gb, v) for s, _, gb, v, _ in sorted(steps_of[w])] == [(s, gb, v) for s, _, gb, v, _ in ref_rows]
    versions = [v for *_, v, _ in ref_rows]
    assert versions[:2] == [1, 1] and 2 in versions and versions[-1] == 3
    assert {(v, tp) for _, _, _, v, tp in ref_rows} == {(1, len(a)), (2, len(a) - 1), (3, len(a))}
    assert {(v, tp) for _, _, _, v, tp in steps_of[b[0]]} == {(1, len(b)), (2, len(b)), (3, len(b))}
    assert {gb for _, _, gb, v, _ in ref_rows if v == 2} == {len(a) - 1 + len(b)}
    rows = sorted(steps_of[victim])
    before, after = [r for r in rows if r[0] < 2], [r for r in rows if r[0] >= 2]
    assert [s for s, *_ in before] == [0, 1]  # the first process, until it was killed
    assert after and all(v == 3 for *_, v, _ in after) and after[-1][0] == steps - 1  # the fresh one
    # the survivors' timeline: failure detected, new layout, regroup, reshard, first step at n-1
    tl = [what for what, v in done[first][2] if v == 2]
    assert tl == ["layout received", "regrouped", "reshard done", "first step"], tl
    assert any(what == "failure detected" for what, _ in done[first][2])
    # every old group was gone when its rank left (else peers blocked on it wait for their timeout)
    assert not [(w, what) for w, (_, _, tl, _) in done.items() for what, _ in tl if what == "groups outlived leave"]
    # the transport: gloo with device tensors (or forced staging) always through host buffers;
    # NCCL carries the device tensors itself and only the CPU commit votes through device copies
    for w, (_, _, _, (backend, where, staged)) in done.items():
        assert backend == ("nccl" if device == "nccl" else "gloo"), (w, backend)
        assert where.startswith("cuda" if device in ("cuda", "nccl") else "cpu"), (w, where)
        assert (staged > 0) == (device != "cpu"), (w, staged)

    ref_losses, ref_params = reference(kind, [gb for _, _, gb, _, _ in ref_rows])
    bf16 = "bf16" in kind
    for s, loss, *_ in ref_rows:
        assert abs(loss - ref_losses[s]) <= (BF16_LOSS if bf16 else 1e-5) * abs(ref_losses[s]), (s, loss, ref_losses[s])
    family = "adamw" if kind.startswith("adamw") else kind.removesuffix("-clip")
    torch.manual_seed(0)
    start = {n: p.detach().clone() for n, p in build(kind).named_parameters()}
    for w, (params, units, _, _) in done.items():
        errs = update_errors(params, units, ref_params, start) if bf16 else shard_errors(params, units, ref_params,
                                                                                         family)
        for name, err in errs.items():
            assert err <= (BF16_UPDATE[family] if bf16 else tolerance(family)), (w, name, err)


@pytest.mark.parametrize("device", ["cpu", devices.CUDA])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_kill_a_rank_survivors_continue_at_tp3_then_the_repaired_rank_rejoins(kind: str, device: str) -> None:
    """Two replicas at TP4 -> TP3 + TP4 -> TP4 + TP4. "cuda": CUDA tensors on gloo, the ranks
    sharing the GPUs there are (one GPU runs all eight), every message staged through host memory."""
    kill_and_rejoin(kind, device, A, B, STEPS)


@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 4 and dist.is_nccl_available()),
                    reason="the NCCL runtime case needs 4 CUDA GPUs (a GPU per rank) and a torch with NCCL")
def test_kill_and_rejoin_on_nccl() -> None:
    """TP2 + TP2 on four GPUs with NCCL: the SIGKILLed rank's peers time out (blocking wait), abort
    their communicators, regroup on fresh ones, fetch the lost shards and go on; the fresh process
    rejoins."""
    kill_and_rejoin("adamw", "nccl", ["w0", "w1"], ["w2", "w3"], STEPS)


def test_kill_and_rejoin_with_staged_transport() -> None:
    """The same path with every collective and message through comm.py's staging buffers (forced,
    CPU tensors: what gloo runs on a GPU), on a smaller job to keep CI short: TP2 + TP2 -> TP1 +
    TP2 (sync with transfers to the extra rank, units fetched from the peer replica) -> TP2 + TP2
    (the fresh rank receives shards, replicated parameters and AdamW state)."""
    kill_and_rejoin("adamw", "staged", ["w0", "w1"], ["w2", "w3"], STEPS)


def test_kill_and_rejoin_with_parameter_groups_amsgrad_and_a_schedule() -> None:
    """AdamW in two parameter groups (weight decay on matrices only) with amsgrad, under a warmup +
    cosine LambdaLR: TP2 + TP2 -> TP1 + TP2 -> TP2 + TP2. The survivors' reshard keeps each
    parameter in its group and moves max_exp_avg_sq with the moments; the fresh rank's optimizer
    takes its groups' learning rates and the schedule's position from a peer. (Before: the reshard
    refused a second group mid-run; a joiner stepped with optimizer_fn's learning rate.)"""
    kill_and_rejoin("adamw-groups", "cpu", ["w0", "w1"], ["w2", "w3"], STEPS)


def test_kill_and_rejoin_with_gradient_clipping_and_micro_batches() -> None:
    """max_grad_norm, active on every step: TP2 + TP2 -> TP1 + TP2 -> TP2 + TP2, the norm taken
    over both replicas' shares (sharded units once per replica, replicated parameters on one rank
    of each, the tied embedding once) equals clip_grad_norm_ of one process, so every loss and
    parameter still equals the reference's. (A rank clipping by its own shard's norm, which is all
    clip_grad_norm_ over rt.model sees, misses the reference at the first step.) Each replica feeds
    its local batch one sample at a time (micro_batch_size=1), gradients accumulated: the reference
    takes each step's global batch in one pass."""
    kill_and_rejoin("sgd-clip", "cpu", ["w0", "w1"], ["w2", "w3"], STEPS)


def test_kill_and_rejoin_in_bf16_with_recomputation_and_micro_batches() -> None:
    """RuntimeConfig(precision="bf16", recompute=True), one sample per micro-batch, AdamW:
    TP2 + TP2 -> TP1 + TP2 -> TP2 + TP2. The fp32 parameters and Adam moments are what the reshard
    moves and the fresh rank fetches; every step computes on bf16 copies, recomputing each block in
    the backward, the micro-batches' gradients added in fp32. Equal to one process's bf16 compute
    with fp32 master state at compare.BF16_UPDATE / BF16_LOSS (the pipeline tests have the negative
    control)."""
    kill_and_rejoin("adamw-bf16-rc", "cpu", ["w0", "w1"], ["w2", "w3"], STEPS)


def _clipped_solo(port: int, q: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=60))
    torch.manual_seed(0)
    rt = Runtime(lambda: TinyGpt(CFG), tp_plan(CFG), _opt_fn("sgd"), StoreLayoutSource(store, "clip", "c0"), store,
                 RuntimeConfig(job="clip", max_grad_norm=CLIP))
    rt.start()
    out = []
    for s in range(3):  # step 1's loss is NaN: every gradient too
        r = rt.train_step(batch, lambda m, b, s=s: loss_fn(m, b) * (float("nan") if s == 1 else 1.0))
        out.append((r.grad_norm, r.skipped, {n: p.detach().numpy().copy() for n, p in rt.model.named_parameters()}))
    q.put(out)
    rt.close()


def run_alone(job: str, wid: str, target: Any) -> Any:
    """One rank, alone in `job` (local batch 2): `target(port, q)` runs in its own process; returns
    the one message it puts on `q`."""
    port, _store = store_with_layout(job, [([wid], 2)], 60)
    ctx = worker_context()
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(port, q))
    p.start()
    try:
        out = q.get(timeout=120)
        p.join(timeout=60)
    finally:
        reap([p])
    return out


def test_grad_norm_is_reported_and_a_non_finite_norm_skips_the_step() -> None:
    (n0, skip0, after0), (n1, skip1, after1), (n2, skip2, after2) = run_alone("clip", "c0", _clipped_solo)
    torch.manual_seed(0)
    m = TinyGpt(CFG)
    m.loss(*batch(0, 0, 2)).backward()
    assert n0 is not None and abs(n0 - float(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP))) <= 1e-5 * n0
    assert (skip0, skip1, skip2) == (False, True, False) and n1 is not None and not math.isfinite(n1)
    assert all((after0[k] == after1[k]).all() for k in after0)  # no update from the NaN step
    assert n2 is not None and math.isfinite(n2) and all(np.isfinite(v).all() for v in after2.values())
    assert any((after1[k] != after2[k]).any() for k in after1)


def test_a_hung_peer_times_out_and_no_new_layout_is_a_clear_error() -> None:
    """A peer that stops answering (SIGSTOP: its sockets stay open) makes the next collective hang;
    it times out after `collective_timeout_s` and surfaces as a reconfiguration. When the manager
    publishes no new layout, the survivor raises ReconfigurationError instead of hanging."""
    port, _store = store_with_layout("lonely", [(["x0", "x1"], 2)], 60)
    ctx = worker_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_lonely, args=(w, port, q)) for w in ("x0", "x1")]
    for p in procs:
        p.start()
    try:
        outcome = None
        while outcome is None:
            wid, what = q.get(timeout=120)
            if wid == "x0" and what != "stepped":
                outcome = what
        procs[0].join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert outcome.startswith("ReconfigurationError: no layout newer than version 1"), outcome
    assert "failure detected" in outcome  # the timeline shows the timed-out collective


def _lonely(wid: str, port: int, q: Any) -> None:
    from ntp_manager.worker.runtime import ReconfigurationError

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=60))
    cfg = RuntimeConfig(job="lonely", collective_timeout_s=3, reconfigure_timeout_s=2)
    rt = Runtime(lambda: TinyGpt(CFG), tp_plan(CFG), _opt_fn("sgd"), StoreLayoutSource(store, "lonely", wid),
                 store, cfg)
    rt.start()
    rt.train_step(batch, loss_fn)
    if wid == "x1":
        os.kill(os.getpid(), signal.SIGSTOP)  # hangs at the boundary with its connections open
    q.put((wid, "stepped"))
    try:
        rt.train_step(batch, loss_fn)
        q.put((wid, "no error"))
    except ReconfigurationError as e:
        events = [f"{ev.what}: {ev.detail}" for ev in rt.timeline]
        q.put((wid, f"ReconfigurationError: {e} | {events}"))


class _Recording(StoreLayoutSource):
    def __init__(self, *a: Any, q: Any) -> None:
        super().__init__(*a)
        self.q = q

    def report_step(self, layout: Any, step: int, step_time_s: float, tokens: int, work: Any = None) -> None:
        self.q.put((step, step_time_s, tokens, work))


def test_step_report_carries_cpu_compute_time_and_the_batchs_sequence_lengths() -> None:
    """Issue 21: the runtime passes a StepWork with the host-timed forward+backward (CPU: real
    compute) and the sequence lengths the batch names."""
    step, secs, tokens, work = run_alone("solo", "s0", _solo)
    assert (step, tokens) == (0, 2)
    assert 0 < work.compute_s <= secs and work.comm_wait_s == 0.0
    assert work.sequence_lengths == (5, 11)


def _solo(port: int, q: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=60))
    rt = Runtime(lambda: TinyGpt(CFG), tp_plan(CFG), _opt_fn("sgd"), _Recording(store, "solo", "s0", q=q),
                 store, RuntimeConfig(job="solo", device="cpu", backend="gloo"))
    rt.start()

    class Batch(tuple):  # type: ignore[type-arg]
        sequence_lengths = (5, 11)

    rt.train_step(lambda s, st, n: Batch(batch(s, st, n)), lambda m, b: loss_fn(m, tuple(b)))
    rt.close()


def test_tp_wait_is_measured_per_rank_and_a_slow_rank_makes_its_peer_wait() -> None:
    """Issue 21: on CPU the runtime times each rank's blocking TP all-reduces (comm_wait_s) and
    reports the forward+backward without them (compute_s). Rank "b" sleeps 2 s before its
    forward on step 1 (after step 0's commit point lined the two up): it reports the sleep as
    compute, and "a", whose first TP all-reduce cannot finish before "b" joins it, reports it as
    communication wait. (The sleep is long, 2 s, and only lower bounds are checked: on a loaded
    machine both ranks also wait for each other by a second or more, so "a waited more than b"
    would be a race.)"""
    port, _store = store_with_layout("pair", [(["a", "b"], 2)], 60)
    ctx = worker_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_pair, args=(port, wid, q)) for wid in ("a", "b")]
    for p in procs:
        p.start()
    try:
        got = {}
        for _ in range(2):
            wid, work = q.get(timeout=120)
            got[wid] = work
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    a, b = got["a"], got["b"]
    assert b.compute_s >= 2.0, (a, b)  # the sleep is the slow rank's own time
    assert a.comm_wait_s >= 1.0, (a, b)  # its peer waited for it in the TP collectives


def _pair(port: int, wid: str, q: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=60))
    reports: Any = []

    class Keep(StoreLayoutSource):
        def report_step(self, layout: Any, step: int, step_time_s: float, tokens: int, work: Any = None) -> None:
            reports.append(work)

    rt = Runtime(lambda: TinyGpt(CFG), tp_plan(CFG), _opt_fn("sgd"), Keep(store, "pair", wid), store,
                 RuntimeConfig(job="pair", device="cpu", backend="gloo"))
    rt.start()
    for step in range(2):
        def slow_loss(m: Any, b: Any, step: int = step) -> torch.Tensor:
            if wid == "b" and step == 1:
                time.sleep(2.0)
            return loss_fn(m, b)

        rt.train_step(batch, slow_loss)
    q.put((wid, reports[1]))
    rt.close()


@pytest.mark.parametrize(("field", "value"), [("max_grad_norm", 0.0), ("max_grad_norm", -1.0),
                                              ("max_grad_norm", float("nan")), ("max_grad_norm", float("inf")),
                                              ("micro_batch_size", 0), ("micro_batch_size", 2.5),
                                              ("micro_batch_size", True)])
def test_nonsense_clipping_and_micro_batch_settings_are_refused(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        RuntimeConfig(job="x", **{field: value})


def test_a_spare_waits_past_the_reconfigure_timeout_until_a_layout_includes_it() -> None:
    """A rank the layout leaves out is a spare, not a survivor of a failure: it waits for a layout
    that includes it however long that takes (`standby_timeout_s` None), here four times
    `reconfigure_timeout_s`, then trains; with a `standby_timeout_s` it gives up, saying so."""
    port, store = store_with_layout("spare", [(["s0"], 2)], 60)  # s0 never runs: s1 is the spare
    ctx = worker_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_spare, args=(port, q, limit)) for limit in (None, 1.0)]
    for p in procs:
        p.start()
    try:
        got = {q.get(timeout=120) for _ in range(3)}  # the processes' messages interleave in any order
        assert got == {("started", None), ("started", 1.0),
                       (1.0, "ReconfigurationError: no layout newer than version 1 arrived within 1 s")}, got
        time.sleep(2.0)  # the other spare (no limit) waits on: 4x its reconfigure_timeout_s in all
        publish_layout(store, "spare", 2, [(["s1"], 2)], "the spare takes over")
        assert q.get(timeout=120) == (None, "trained step 0 at version 2")
    finally:
        reap(procs)


def _spare(port: int, q: Any, limit: float | None) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=dt.timedelta(seconds=60))
    cfg = RuntimeConfig(job="spare", collective_timeout_s=3, reconfigure_timeout_s=0.5, standby_timeout_s=limit)
    rt = Runtime(lambda: TinyGpt(CFG), tp_plan(CFG), _opt_fn("sgd"), StoreLayoutSource(store, "spare", "s1"),
                 store, cfg)
    try:
        rt.start(timeout=5)  # layout 1 leaves s1 out: start returns with no rank
        q.put(("started", limit))
        r = rt.train_step(batch, loss_fn)
        q.put((limit, f"trained step {r.step} at version {r.version}"))
    except ReconfigurationError as e:
        q.put((limit, f"ReconfigurationError: {e}"))
    finally:
        rt.close()
