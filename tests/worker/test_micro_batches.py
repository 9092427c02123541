"""Micro-batches of a single-stage replica (RuntimeConfig.micro_batch_size) cut unevenly: two TP1
replicas with local batches 3 and 5 under micro_batch_size=2 feed (2, 1) and (2, 2, 1) samples per
pass. Each pass's mean loss weighted by its share of the local batch gives the gradient of one pass
over the global batch; weighting the passes equally (1/2, 1/3 each) would not. Real gloo processes;
the reference is one process taking each step's global batch of 8 in one pass."""

from __future__ import annotations

import datetime as dt
from typing import Any

import torch
import torch.distributed as dist

from ntp_manager.worker.runtime import Runtime, RuntimeConfig
from ntp_manager.worker.sources import StoreLayoutSource
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt, tp_plan
from tests.fakes.procs import worker_context
from tests.worker.compare import random_batches, shard_errors, shard_info, tolerance, train_reference
from tests.worker.ranks import reap, store_with_layout

CFG = GptConfig(vocab=64, seq=16, d_model=32, heads=4, mlp=64, layers=1)
JOB = "mb"
BATCHES = {"m0": 3, "m1": 5}
STEPS = 3
batch = random_batches(CFG.vocab, CFG.seq, sum(BATCHES.values()), seed=77)


def _opt(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _rank(wid: str, port: int, q: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False,  # type: ignore[attr-defined]
                          timeout=dt.timedelta(seconds=60))
    fed: list[int] = []

    def loss(model: Any, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        fed.append(len(b[0]))
        out: torch.Tensor = model.loss(*b)
        return out

    rt = Runtime(lambda: TinyGpt(CFG), tp_plan(CFG), _opt, StoreLayoutSource(store, JOB, wid), store,
                 RuntimeConfig(job=JOB, micro_batch_size=2, collective_timeout_s=30, rendezvous_timeout_s=60))
    rt.start()
    losses = [rt.train_step(batch, loss).loss for _ in range(STEPS)]
    assert rt.model is not None
    q.put((wid, losses, fed, {n: p.detach().numpy().copy() for n, p in rt.model.named_parameters()},
           shard_info(rt.model)))
    rt.close()


def test_uneven_micro_batches_equal_one_pass_over_the_global_batch() -> None:
    port, _store = store_with_layout(JOB, [([w], b) for w, b in BATCHES.items()], 60)
    ctx = worker_context()
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(w, port, q)) for w in BATCHES]
    for p in procs:
        p.start()
    try:
        got = {w: (losses, fed, params, units) for w, losses, fed, params, units in
               (q.get(timeout=120) for _ in procs)}
        for p in procs:
            p.join(timeout=60)
    finally:
        reap(procs)
    assert all(p.exitcode == 0 for p in procs)
    assert got["m0"][1] == [2, 1] * STEPS and got["m1"][1] == [2, 2, 1] * STEPS  # the cuts the test is about
    torch.manual_seed(0)  # RuntimeConfig.seed: model_fn runs under it
    m = TinyGpt(CFG)
    ref_losses, ref_params = train_reference(m, _opt(m.parameters()),
                                             (batch(s, 0, sum(BATCHES.values())) for s in range(STEPS)),
                                             lambda b: m.loss(*b))
    for w, (losses, _, params, units) in got.items():
        for s, (a, r) in enumerate(zip(losses, ref_losses, strict=True)):
            assert abs(a - r) <= 1e-5 * abs(r), (w, s, a, r)
        for name, err in shard_errors(params, units, ref_params, "sgd").items():
            assert err <= tolerance("sgd"), (w, name, err)
