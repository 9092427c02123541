"""NTP gradient sync, real processes on gloo: the worked example of docs/references.md (healthy TP4 +
reduced TP2: TP groups [0,1] and [2,3,4,5], DP groups [0,2], [1,3], [4], [5]) with different local
batches; after the sync every rank's gradient equals the single-process gradient of the global
batch (rel. error <= 1e-5)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from ntp_manager.contract.ntp_map import sync_groups
from ntp_manager.worker import sync as sync_mod
from ntp_manager.worker.sync import (
    NtpGradSync,
    ReplicaGroup,
    SyncLayout,
    check_uniform_parameters,
    families_of,
    replicas_from,
)
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt, tp_plan, unit_counts
from ntp_manager.worker.tp import parallelize
from tests.fakes.procs import free_port, worker_context
from tests.worker import devices
from tests.worker.compare import ref_part, shard_info

CFG = GptConfig(vocab=64, seq=16, d_model=48, heads=6, mlp=90, layers=2)



def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, CFG.vocab, (n, CFG.seq), generator=g)
    return idx, torch.randint(0, CFG.vocab, (n, CFG.seq), generator=g)


def _worker(rank: int, world: int, port: int, replicas: list[list[int]], batches: list[int], opts: dict[str, Any],
            q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = devices.setup(opts.pop("device", "cpu"), rank)
    if rank in opts.pop("elsewhere", ()):  # this rank acts as if it ran on another host
        sync_mod._host_key = lambda: "another-host"
    dist.init_process_group("gloo", rank=rank, world_size=world)
    layout = SyncLayout(replicas_from(replicas, batches), unit_counts(CFG))
    tp_groups = [dist.new_group(ranks=r) for r in replicas]
    ri, _ = layout.locate(rank)
    torch.manual_seed(0)
    full = TinyGpt(CFG)
    model = TinyGpt(CFG)
    model.load_state_dict(full.state_dict())
    parallelize(model, tp_plan(CFG), layout.units_of(rank), group=tp_groups[ri])
    model.to(dev)
    sync = NtpGradSync(model, layout, rank, families_of(tp_plan(CFG), model), **opts)
    idx, tgt = data(sum(batches))
    start = sum(batches[:ri])
    model.loss(idx[start : start + batches[ri]].to(dev), tgt[start : start + batches[ri]].to(dev)).backward()
    sync.sync()
    full.loss(idx, tgt).backward()  # the reference: one process, the whole global batch
    ref = dict(full.named_parameters())
    worst = ("", 0.0)
    info = shard_info(model)
    for name, p in model.named_parameters():
        r = ref[name].grad
        assert r is not None and p.grad is not None
        r = ref_part(r, name, info)
        err = float((p.grad.cpu() - r).norm() / max(r.norm().item(), 1e-2))
        if err > worst[1]:
            worst = (name, err)
    n_copies = sum(len(c) for c in sync._copies) if sync.core else len(sync._shm_peers)
    q.put((rank, worst, sum(len(m) for m in sync._msgs), n_copies, devices.staged_ops()))
    dist.destroy_process_group()


def run(replicas: list[list[int]], batches: list[int], **opts: Any) -> dict[int, Any]:
    """rank -> (worst tensor, its relative error, point-to-point messages per sync, shared-memory
    copies per sync (core) or cores copying for it (extra), operations through staging buffers)"""
    world = sum(len(r) for r in replicas)
    q = worker_context().SimpleQueue()
    mp.start_processes(_worker, args=(world, free_port(), replicas, batches, opts, q), nprocs=world, join=True,
                       start_method="forkserver")
    return {rank: (name, err, n, c, st) for rank, (name, err), n, c, st in (q.get() for _ in range(world))}


@pytest.mark.parametrize(("shared_memory", "device"), [(True, "cpu"), (False, "cpu"), (False, "staged"),
                                                       pytest.param(True, "cuda", marks=devices.NEEDS_CUDA)])
def test_worked_example_tp2_plus_tp4(shared_memory, device):
    """Also with every transfer and all-reduce through comm.py's staging buffers ("staged": forced,
    CPU tensors), and with CUDA tensors on gloo (staged; the shared-memory path is CPU-only, so it
    turns itself off and the transfers are messages)."""
    replicas = [[0, 1], [2, 3, 4, 5]]
    assert sync_groups(replicas) == [[0, 2], [1, 3], [4], [5]]
    # the reduced replica has a smaller local batch
    results = run(replicas, batches=[2, 3], shared_memory=shared_memory, device=device)
    for rank, (name, err, _, _, staged) in results.items():
        assert err <= 1e-5, (rank, name, err)
        assert (staged > 0) == (device != "cpu"), (rank, staged)  # staging ran where it should, only there
    messages = [results[r][2] for r in range(6)]
    if device == "cuda":
        assert not any(results[r][3] for r in range(6))  # device memory: no shared-memory copies
        shared_memory = False
    if shared_memory:  # one host: the cores copy from their extras, no message carries data
        assert messages == [0] * 6
        assert all(results[r][3] > 0 for r in (2, 3, 4, 5))
    else:  # this model's transfers are all small: one packed message per bucket and peer
        assert messages == [0, 0, 1, 1, 1, 1]


def test_shared_memory_and_messages_mixed():
    """Extra rank 4 acts as if it ran on another host: its transfers go as messages, extra 5's
    through shared memory, in the same sync."""
    results = run([[0, 1], [2, 3, 4, 5]], batches=[2, 3], elsewhere=[4])
    for rank, (name, err, *_) in results.items():
        assert err <= 1e-5, (rank, name, err)
    assert results[4][2] > 0 and results[4][3] == 0
    assert results[5][2] == 0 and results[5][3] > 0


@pytest.mark.parametrize(("bucket_bytes", "pack_bytes"), [(1, 0), (2048, 300)])
def test_buckets_and_packing(bucket_bytes, pack_bytes):
    """Every tensor its own bucket and every transfer its own message; then buckets of a few
    tensors with some transfers packed and some not (the 48 x 8 attention slices are 1.5 KiB, the
    biases 32 bytes). The gradients are exact either way."""
    replicas = [[0, 1], [2, 3, 4, 5]]
    results = run(replicas, batches=[2, 3], bucket_bytes=bucket_bytes, pack_bytes=pack_bytes,
                  shared_memory=False)
    for rank, (name, err, *_) in results.items():
        assert err <= 1e-5, (rank, name, err)
    assert results[2][2] > 1 and results[4][2] > 1


@pytest.mark.parametrize("replicas", [[[0, 1], [2, 3]], [[0, 1, 2], [3, 4]]])
def test_uniform_and_three_two(replicas):
    for rank, (name, err, *_) in run(replicas, batches=[3, 2]).items():
        assert err <= 1e-5, (rank, name, err)


def test_shared_gradient_memory_is_mapped_by_another_process():
    """What the shared-memory transfers stand on: pool memory another process of the host maps
    at the address `_shared_address` gives, writes that both see, and a descriptor that closes
    when the memory goes."""
    import gc
    import subprocess
    import sys

    block = sync_mod._shared_zeros(64, torch.float32)
    if block is None:
        pytest.skip("no memfd on this platform: the sync keeps to messages")
    home = block[16:48]  # an extra's home is a slice of a pool block
    home.copy_(torch.arange(32, dtype=torch.float32))
    where = sync_mod._shared_address(home)
    assert where is not None
    path, offset, n, _ = where
    assert (offset, n) == (16, 32)
    assert sync_mod._map_shared((path, offset, n, (0, 0)), torch.float32) is None  # not that memory
    mapped = sync_mod._map_shared(where, torch.float32)  # in this process too: the same memory
    assert mapped is not None and mapped.tolist() == home.tolist()
    del mapped
    child = (
        "import sys, torch\n"
        f"t = torch.from_file({path!r}, shared=True, size={offset + n}, dtype=torch.float32)[{offset}:]\n"
        "assert t.tolist() == [float(i) for i in range(32)], t\n"
        "t.mul_(2)\n"
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
    assert home.tolist() == [2.0 * i for i in range(32)]
    assert sync_mod._shared_address(torch.zeros(4)) is None  # ordinary memory: messages
    fd = block.untyped_storage()._ntp_fd
    del block, home
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)


# ---- gradient memory across layouts (no processes) ---------------------------------------------
def test_a_successor_reuses_the_predecessors_gradient_memory_in_large_blocks() -> None:
    """A sync's buckets that are not served by its predecessor's memory are cut from one fresh
    block, and `buffers()` hands a successor the blocks they came from, joined: so a successor
    whose buckets are larger (TP2 -> TP1 doubles a core's chunk) or whose extra rank needs one
    home for all its gradients finds room in memory already touched. Before, every bucket was a
    fresh block of its own, and such a successor touched fresh pages for all of it (on this VM
    ~7x the cost of writing warm memory; the first step after a TP2 -> TP1 failover zeroed
    235 MB of fresh shared memory)."""
    dtype, cpu = torch.float32, torch.device("cpu")
    first = sync_mod._Pool([], shared=True)
    rep = first.take(10, dtype, cpu)
    buckets = first.take_all([40, 30, 30], dtype, cpu)  # a core's chunk of 100 in 3 buckets
    assert first.fresh_elements == 110
    assert len({b.untyped_storage().data_ptr() for b in buckets}) == 1  # one fresh block, not three
    handed = sync_mod._merged([rep, *buckets])
    assert sorted(b.numel() for b in handed) == [10, 100]  # the blocks, joined and largest first
    assert handed[0].numel() == 100
    # the same rank as an extra (one home for all its 100 gradients) reuses them, touching nothing new
    extra = sync_mod._Pool(handed, shared=True)
    assert extra.take(10, dtype, cpu).data_ptr() == rep.data_ptr()  # best fit: the replicated block
    home = extra.take(100, dtype, cpu)
    assert extra.fresh_elements == 0 and home.data_ptr() == buckets[0].data_ptr()
    # a core whose chunk doubles (200 in buckets of 30): the old chunk holds three buckets (90 of
    # its 100); the other four buckets (110) are one fresh block
    grown = sync_mod._Pool(handed, shared=True)
    grown.take(10, dtype, cpu)
    got = grown.take_all([30] * 6 + [20], dtype, cpu)
    assert grown.fresh_elements == 110
    assert sum(g.untyped_storage().data_ptr() == buckets[0].untyped_storage().data_ptr() for g in got) == 3
    assert len({g.untyped_storage().data_ptr() for g in got}) == 2  # the old block, and one fresh block
    # what a pool did not hand out stays available to the next successor
    rest = sync_mod._Pool(handed, shared=True)
    rest.take(10, dtype, cpu)
    rest.take_all([60], dtype, cpu)
    assert [b.numel() for b in rest.rest()] == [40]


def test_a_reshards_replaced_shards_serve_core_buffers_but_never_an_extras_home() -> None:
    """The memory of shards a reshard replaced (`apply_reshard(freed=...)`) is scratch for the
    new sync: a core's buckets may use it (TP2 -> TP1: the survivor's grown chunk then touches
    no fresh pages), an extra rank's home may not (its cores map it: it must be shared memory),
    and what is left of it is let go rather than kept for the layout's lifetime."""
    dtype, cpu = torch.float32, torch.device("cpu")
    old = sync_mod._Pool([], shared=True).take(100, dtype, cpu)  # the old chunk: shared memory
    shard = torch.empty(80)  # a replaced shard: ordinary memory
    core = sync_mod._Pool([old], shared=True, scratch=[shard])
    got = core.take_all([50, 50, 50, 30], dtype, cpu)
    assert core.fresh_elements == 0  # 100 from the old chunk, 80 from the shard
    assert {g.untyped_storage().data_ptr() for g in got} == {old.untyped_storage().data_ptr(),
                                                             shard.untyped_storage().data_ptr()}
    assert core.rest() == []
    extra = sync_mod._Pool([], shared=True, scratch=[torch.empty(200)])
    home = extra.take(100, dtype, cpu, shareable=True)
    assert extra.fresh_elements == 100 and sync_mod._is_shared(home)
    assert extra.rest() == []  # the unused shard memory is not kept


def test_a_model_with_parameters_of_two_dtypes_is_refused_before_any_group_is_made() -> None:
    # the gradient buffers are of one dtype: a bf16 layer beside fp32 ones failed only at the first
    # step, where torch refuses a gradient of another dtype with no word of why
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model[1].to(torch.bfloat16)
    layout = SyncLayout((ReplicaGroup((0,), 1),), {})
    with pytest.raises(ValueError, match=r"parameter 1\.weight is torch\.bfloat16 .* same dtype and device"):
        NtpGradSync(model, layout, 0, {})  # no process group exists: refused before any is needed
    check_uniform_parameters(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)))
