"""The runtime's model fix-ups, in one rank process (gloo, a real store and real layout switches):
with no plan it takes `plan_for(model)`; `post_parallelize` runs after the model is sharded and
again after every reshard, before the optimizer sees the parameters; a hook that replaces a
parameter after a reshard is refused (the optimizer state moved with the old one)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ntp_manager.worker import ReconfigurationError, Runtime, RuntimeConfig, StoreLayoutSource, publish_layout
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt
from tests.fakes.procs import free_port, worker_context

CFG = GptConfig(vocab=32, seq=8, d_model=24, heads=4, mlp=40, layers=1)


def batch(step: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, CFG.vocab, (4, CFG.seq), generator=g)
    return idx[start : start + count], idx[start : start + count]


def _rank(_index: int, port: int, q: Any) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=dt.timedelta(seconds=60))
    calls: list[tuple[str, int]] = []
    replace = {"now": False}

    def hook(model: nn.Module) -> None:
        from ntp_manager.worker import ShardedModule

        calls.append((type(model.blocks[0].attn.q).__name__, len(model.blocks[0].attn.q.units)))
        assert isinstance(model.head, ShardedModule)
        if replace["now"]:
            model.ln.weight = nn.Parameter(model.ln.weight.detach().clone())

    publish_layout(store, "hooks", 1, [(["w0"], 2)], "start")
    rt = Runtime(lambda: TinyGpt(CFG), None, lambda ps: torch.optim.SGD(ps, lr=0.1),
                 StoreLayoutSource(store, "hooks", "w0"), store,
                 RuntimeConfig(job="hooks", collective_timeout_s=20, reconfigure_timeout_s=20),
                 post_parallelize=hook)
    out: dict[str, Any] = {}
    try:
        rt.start()
        out["plan"] = getattr(rt.plan, "kind", None)
        rt.train_step(batch, lambda m, b: m.loss(*b))
        out["after start"] = list(calls)
        publish_layout(store, "hooks", 2, [(["w0"], 3)], "switch")
        rt.train_step(batch, lambda m, b: m.loss(*b))  # sees v2, switches after the step: a reshard
        rt.train_step(batch, lambda m, b: m.loss(*b))
        out["after switch"] = list(calls)
        out["optimizer sees the model"] = {id(p) for p in rt.optimizer.param_groups[0]["params"]} == {
            id(p) for p in rt.model.parameters()}
        replace["now"] = True
        publish_layout(store, "hooks", 3, [(["w0"], 2)], "switch again")
        try:
            rt.train_step(batch, lambda m, b: m.loss(*b))
            out["refused"] = ""
        except ReconfigurationError as e:
            out["refused"] = str(e)
    finally:
        rt.close()
        q.put(out)


def test_post_parallelize_runs_after_sharding_and_after_every_reshard() -> None:
    q = worker_context().SimpleQueue()
    mp.start_processes(_rank, args=(free_port(), q), nprocs=1, join=True, start_method="forkserver")
    out = q.get()
    assert out["plan"] == "tiny_gpt"  # plan None: plan_for(model)
    assert out["after start"] == [("ColwiseLinear", 4)]
    assert out["after switch"] == [("ColwiseLinear", 4)] * 2
    assert out["optimizer sees the model"]
    assert "post_parallelize added, removed or replaced parameters after a reshard" in out["refused"]
