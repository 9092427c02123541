"""Sharded forward and backward equal the unsharded model (fp32, rel. error <= 1e-5), TP 1..4,
contiguous and non-contiguous unit maps; real processes, gloo."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ntp_manager.contract.ntp_map import ntp_map
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt, tp_plan, unit_counts
from ntp_manager.worker.tp import ColwiseUnits, RowwiseUnits, parallelize, unit_major_view, unit_slice
from ntp_manager.worker.tp import unit_counts as counts_of_model
from tests.fakes.procs import free_port, worker_context
from tests.worker import devices
from tests.worker.compare import ref_part, shard_info

CFG = GptConfig(vocab=64, seq=16, d_model=48, heads=6, mlp=96, layers=2)



def unit_lists(tp: int, mode: str) -> list[dict[str, list[int]]]:
    """Per rank, the heads, MLP columns and vocabulary entries it holds."""
    n_sync = tp if mode == "contiguous" else max(1, tp - 1)  # else: a healthy replica's compute
    # partition when syncing with a TP-1 replica (non-contiguous)
    return [{f: ntp_map(n, tp, n_sync).units_of(r) for f, n in unit_counts(CFG).items()} for r in range(tp)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error, with a 1e-7 absolute floor: some gradients are zero in exact arithmetic
    (a key bias shifts every score of a query equally, and softmax ignores that)."""
    return float((a - b).norm() / max(b.norm().item(), 1e-2))


def _worker(rank: int, world: int, port: int, mode: str, q: Any, device: str = "cpu") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = devices.setup(device, rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    full = TinyGpt(CFG)
    sharded = TinyGpt(CFG)
    sharded.load_state_dict(full.state_dict())
    units = unit_lists(world, mode)[rank]
    parallelize(sharded, tp_plan(CFG), units, group=dist.group.WORLD)
    full.to(dev)
    sharded.to(dev)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CFG.vocab, (3, CFG.seq), generator=g).to(dev)
    tgt = torch.randint(0, CFG.vocab, (3, CFG.seq), generator=g).to(dev)
    lf, ls = full.loss(idx, tgt), sharded.loss(idx, tgt)
    lf.backward()
    ls.backward()
    errs = {"loss": rel_err(ls.detach(), lf.detach())}
    fparams = dict(full.named_parameters())
    info = shard_info(sharded)
    for name, p in sharded.named_parameters():
        ref = fparams[name].grad
        assert ref is not None and p.grad is not None
        errs[name] = rel_err(p.grad.cpu(), ref_part(ref.cpu(), name, info))
        # unit-major layout: a unit's features are one contiguous block, in the weight and in the
        # gradient autograd made for it
        mod, _, pname = name.rpartition(".")
        if mod in info and pname in info[mod][0]:
            udim, units, size = info[mod][0][pname], info[mod][1], info[mod][2]
            for t in (p.detach(), p.grad):
                if not unit_slice(t, udim, 0, len(units) * size).is_contiguous():
                    errs[f"{name} layout"] = 1.0
    # the gathered LM head gives the whole logits on every rank
    errs["logits"] = rel_err(sharded(idx).detach(), full(idx).detach())
    q.put((rank, errs, [int(sharded.blocks[0].attn.q.weight.shape[0] // CFG.head_dim), devices.staged_ops()]))
    dist.destroy_process_group()


@pytest.mark.parametrize("device", ["cpu", devices.CUDA])
@pytest.mark.parametrize("mode", ["contiguous", "non-contiguous"])
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_sharded_model_matches_unsharded(tp: int, mode: str, device: str):
    if tp == 1 and mode == "non-contiguous":
        pytest.skip("one rank holds every unit")
    ctx = worker_context()
    q = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(tp, free_port(), mode, q, device), nprocs=tp, join=True,
                       start_method="forkserver")
    results = [q.get() for _ in range(tp)]
    heads_total = 0
    for _rank, errs, (local_heads, staged) in results:
        heads_total += local_heads
        worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, worst
        # CUDA tensors on gloo never reach gloo: every TP all-reduce went through host buffers
        assert (staged > 0) == (device != "cpu" and tp > 1), staged
    assert heads_total == CFG.heads  # every head computed exactly once across the TP group
    if mode == "non-contiguous" and tp >= 3:
        lists = unit_lists(tp, mode)
        assert any(sorted(u["heads"]) != list(range(min(u["heads"]), max(u["heads"]) + 1)) for u in lists) or any(
            sorted(u["mlp"]) != list(range(min(u["mlp"]), max(u["mlp"]) + 1)) for u in lists
        )


def test_sharded_model_with_staged_transport():
    """The TP all-reduces through comm.py's staging buffers (forced, CPU): what gloo on a GPU
    runs, exact all the same."""
    q = worker_context().SimpleQueue()
    mp.start_processes(_worker, args=(3, free_port(), "non-contiguous", q, "staged"), nprocs=3, join=True,
                       start_method="forkserver")
    for _rank, errs, (_, staged) in (q.get() for _ in range(3)):
        worst = max(errs.items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, worst
        assert staged > 0


def test_parallelize_rejects_bad_plans():
    m = TinyGpt(CFG)
    with pytest.raises(ValueError, match="matched no module"):
        parallelize(m, {"nope.*": tp_plan(CFG)["blocks.*.attn.q"]}, {"heads": [0]})
    with pytest.raises(ValueError, match=r"ln1 \(LayerNorm\): ColwiseUnits shards only nn\.Linear"):
        parallelize(TinyGpt(CFG), {"blocks.*.ln1": tp_plan(CFG)["blocks.*.attn.q"]}, {"heads": [0]})
    with pytest.raises(ValueError, match=r"tok \(Embedding\): ColwiseUnits shards only nn\.Linear"):
        parallelize(TinyGpt(CFG), {"tok": ColwiseUnits("vocab")}, {"vocab": [0]})
    normed = TinyGpt(CFG)
    normed.tok = torch.nn.Embedding(CFG.vocab, CFG.d_model, max_norm=1.0)
    with pytest.raises(ValueError, match="without max_norm"):
        parallelize(normed, {"tok": RowwiseUnits("vocab")}, {"vocab": [0]})
    with pytest.raises(ValueError, match="no unit list"):
        parallelize(TinyGpt(CFG), tp_plan(CFG), {"heads": [0]})
    with pytest.raises(ValueError, match="out of range"):
        parallelize(TinyGpt(CFG), tp_plan(CFG), {"heads": [99], "mlp": [0], "vocab": [0]})
    with pytest.raises(ValueError, match="out of range"):
        parallelize(TinyGpt(CFG), tp_plan(CFG), {"heads": [0], "mlp": [0], "vocab": [CFG.vocab]})


def test_unit_slices_agree_whatever_the_layout():
    """A slice on the wire is oriented units-first, so a unit-major tensor and a row-major copy of
    it give the same bytes; on a unit-major tensor the slice is the memory itself."""
    full = torch.arange(5 * 12, dtype=torch.float32).view(5, 12)  # 5 out features, 4 units of 3 inputs
    flat = torch.empty(full.numel())
    col = unit_major_view(flat, (5, 12), udim=1)
    col.copy_(full)
    assert torch.equal(col, full) and col.t().is_contiguous()
    a, b = unit_slice(col, 1, 3, 6), unit_slice(full, 1, 3, 6)
    assert a.is_contiguous() and a.data_ptr() == flat[15:].data_ptr()  # units 1-2: one block, no copy
    assert not b.is_contiguous() and torch.equal(a, b) and torch.equal(a.t(), full[:, 3:9])
    assert torch.equal(a.flatten(), b.contiguous().flatten())
    assert torch.equal(unit_slice(full, 0, 1, 2), full[1:3])


def test_tiny_gpt_unit_counts_match_the_plan():
    """tiny_gpt.unit_counts is written out by hand (no 118M model built to count); it must say what
    the runtime derives from the model and its plan."""
    cfg = GptConfig(vocab=96, seq=8, d_model=48, heads=6, mlp=72, layers=2)
    assert unit_counts(cfg) == counts_of_model(TinyGpt(cfg), tp_plan(cfg))
