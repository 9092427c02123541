"""Two DP replicas at TP4 train; rank 3 fails; the survivors reshard to TP3 (its shards come from
the DP peer replica) and keep training with a smaller local batch. Every step's loss and the final
parameters equal a single-process reference trained on the same global batches (rel. <= 1e-5),
for SGD with momentum and (parameters within 1e-4, see below) for AdamW. Real processes, gloo."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ntp_manager.worker import comm
from ntp_manager.worker.reshard import apply_reshard, reshard_moves
from ntp_manager.worker.sync import NtpGradSync, SyncLayout, families_of, replicas_from
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt, tp_plan, unit_counts
from ntp_manager.worker.tp import RowwiseLinear, parallelize
from tests.fakes.procs import free_port, worker_context
from tests.worker import devices
from tests.worker.compare import shard_errors, shard_info, tolerance, train_reference

CFG = GptConfig(vocab=64, seq=16, d_model=48, heads=6, mlp=90, layers=2)
UNITS = unit_counts(CFG)
L0 = SyncLayout(replicas_from([[0, 1, 2, 3], [4, 5, 6, 7]], [4, 4]), UNITS)
L1 = SyncLayout(replicas_from([[0, 1, 2], [4, 5, 6, 7]], [3, 4]), UNITS)  # rank 3 failed
STEPS = [L0, L0, L1, L1]



def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, CFG.vocab, (n, CFG.seq), generator=g)
    return idx, torch.randint(0, CFG.vocab, (n, CFG.seq), generator=g)


def make_opt(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def reference(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    m = TinyGpt(CFG)
    opt = make_opt(kind, m.parameters())
    return train_reference(m, opt, (batch(s, lay.global_batch) for s, lay in enumerate(STEPS)), lambda b: m.loss(*b))


def _worker(rank: int, world: int, port: int, kind: str, q: Any, device: str = "cpu") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dev = devices.setup(device, rank)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = TinyGpt(CFG)
    fams = families_of(tp_plan(CFG), model)
    tp0 = [dist.new_group(ranks=list(r.ranks)) for r in L0.replicas]
    parallelize(model, tp_plan(CFG), L0.units_of(rank), group=tp0[L0.locate(rank)[0]])
    model.to(dev)
    sync = NtpGradSync(model, L0, rank, fams)
    opt = make_opt(kind, model.parameters())
    losses = []
    current = L0
    reused = None
    reshard_staged = 0
    for s, lay in enumerate(STEPS):
        if lay is not current:  # the failure: everyone learns the new layout at a step boundary
            alive = {r for rep in lay.replicas for r in rep.ranks}
            tp1 = [dist.new_group(ranks=list(r.ranks)) for r in lay.replicas]
            mine = next((g for g, r in zip(tp1, lay.replicas, strict=True) if rank in r.ranks), None)
            if rank >= 4:
                # the sources of rank 3's units hold their row-wise optimizer state row-major
                # (shards are column-major): messages must still carry the same bytes
                for m in model.modules():
                    if isinstance(m, RowwiseLinear):
                        st = opt.state[m.weight]
                        for k in [k for k in st if isinstance(st[k], torch.Tensor) and st[k].dim() == 2]:
                            st[k] = st[k].contiguous()
                            assert not st[k].t().is_contiguous()
            before = devices.staged_ops()
            opt = apply_reshard(model, opt, current, lay, alive, rank, fams, mine)
            reshard_staged = devices.staged_ops() - before
            # the new sync reuses the old one's gradient memory (already touched pages)
            spare, old_rep = sync.buffers(), sync.rep_flat.data_ptr()
            sync.release()
            sync = NtpGradSync(model, lay, rank, fams, reuse=spare)
            reused = sync.active and sync.rep_flat.data_ptr() == old_rep
            current = lay
        if not sync.active:
            continue  # the failed rank does nothing more
        ri, _ = lay.locate(rank)
        start = sum(r.local_batch for r in lay.replicas[:ri])
        idx, tgt = batch(s, lay.global_batch)
        opt.zero_grad()
        b = lay.replicas[ri].local_batch
        loss = model.loss(idx[start : start + b].to(dev), tgt[start : start + b].to(dev))
        loss.backward()
        sync.sync()
        opt.step()
        # the global loss: sample-weighted mean over replicas (each TP rank holds the same loss)
        t = torch.tensor([loss.item() * lay.replicas[ri].local_batch / len(lay.replicas[ri].ranks)])
        dist.all_reduce(t, group=sync.layout_group)
        losses.append(t.item() / lay.global_batch)
    out: dict[str, Any] = {}
    if rank != 3:
        for name, p in model.named_parameters():
            out[name] = p.detach().cpu().numpy().copy()  # numpy: no shared-memory handoff
        units = shard_info(model)
    else:
        units = {}
    q.put((rank, losses, out, units, reused, reshard_staged))
    dist.destroy_process_group()


def test_reshard_moves_fetch_the_failed_ranks_units_from_the_peer_replica():
    moves = reshard_moves(L0, L1, alive={0, 1, 2, 4, 5, 6, 7})
    assert moves and all(m.src != 3 for m in moves)
    got = {(m.dst, m.family): set(m.units) for m in moves}
    lost = set(L0.units_of(3)["heads"])
    # every head rank 3 held now lives on a survivor of replica A, fetched from replica B
    fetched = {u for (d, f), us in got.items() if f == "heads" and d in (0, 1, 2) for u in us}
    assert lost <= fetched
    assert all(m.src in (4, 5, 6, 7) for m in moves if m.dst in (0, 1, 2) and set(m.units) & lost)


@pytest.mark.parametrize(("kind", "device"), [("sgd", "cpu"), ("adamw", "cpu"), ("adamw", "staged"),
                                             pytest.param("sgd", "cuda", marks=devices.NEEDS_CUDA),
                                             pytest.param("adamw", "cuda", marks=devices.NEEDS_CUDA)])
def test_failure_reshard_continue_matches_reference(kind: str, device: str):
    """Also with the moves through comm.py's staging buffers ("staged": forced, CPU tensors) and
    with CUDA tensors on gloo (staged: gloo's point-to-point cannot read device memory)."""
    ref_losses, ref_params = reference(kind)
    q = worker_context().SimpleQueue()
    ctx = mp.start_processes(_worker, args=(8, free_port(), kind, q, device), nprocs=8, join=False,
                             start_method="forkserver")
    results = sorted((q.get() for _ in range(8)), key=lambda r: r[0])  # read before joining: big payloads
    while not ctx.join():
        pass
    # the reshard's messages went through staging buffers where they must (rank 3's units moved)
    assert (sum(r[5] for r in results) > 0) == (device != "cpu")
    for rank, losses, params, units, reused, _ in results:
        if rank == 3:
            assert len(losses) == 2  # it trained until it failed
            continue
        assert reused, rank  # the new layout's sync took the old one's memory
        assert len(losses) == 4
        for a, b in zip(losses, ref_losses, strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, losses, ref_losses)
        for name, err in shard_errors(params, units, ref_params, kind).items():
            assert err <= tolerance(kind), (rank, name, err)
        if rank in (0, 1, 2):
            assert sum(len(units[m][1]) for m in units if m.endswith("attn.q")) // CFG.layers == len(
                L1.units_of(rank)["heads"])


def test_a_source_whose_shards_are_not_what_the_old_layout_says_is_refused_before_any_message():
    """The reshard slices each source's tensors by the old layout's unit lists; a model that holds
    other units (rank 1's, here, on rank 0) would move wrong values silently, so it is refused
    (no process group needed: nothing is sent)."""
    model = TinyGpt(CFG)
    fams = families_of(tp_plan(CFG), model)
    parallelize(model, tp_plan(CFG), L0.units_of(1), group=None)
    opt = make_opt("sgd", model.parameters())
    with pytest.raises(ValueError, match=r"rank 0's .* holds units .* but the old layout gives it"):
        apply_reshard(model, opt, L0, L1, {0, 1, 2, 4, 5, 6, 7}, 0, fams, None)


# ---- coalesced moves (comm.FlatExchange) against one message per tensor slice ----------------------
def _spy(calls: list[tuple[str, int, int]]) -> None:
    """Record every point-to-point message this process posts: (direction, peer, bytes)."""
    real_isend, real_irecv = dist.isend, dist.irecv

    def isend(t: torch.Tensor, dst: int, *a: Any, **kw: Any) -> Any:
        calls.append(("send", dst, t.numel() * t.element_size()))
        return real_isend(t, dst, *a, **kw)

    def irecv(t: torch.Tensor, src: int, *a: Any, **kw: Any) -> Any:
        calls.append(("recv", src, t.numel() * t.element_size()))
        return real_irecv(t, src, *a, **kw)

    dist.isend, dist.irecv = isend, irecv  # type: ignore[assignment]


def _flat_worker(rank: int, world: int, port: int, device: str, chunk: int | None, q: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    devices.setup(device, rank)
    if chunk is not None:
        comm.configure(chunk_bytes=chunk)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    calls: list[tuple[str, int, int]] = []
    _spy(calls)
    alive = {r for rep in L1.replicas for r in rep.ranks}
    out: dict[str, Any] = {}
    for coalesce in (False, True):
        torch.manual_seed(0)
        model = TinyGpt(CFG)
        fams = families_of(tp_plan(CFG), model)
        tp0 = [dist.new_group(ranks=list(r.ranks)) for r in L0.replicas]
        parallelize(model, tp_plan(CFG), L0.units_of(rank), group=tp0[L0.locate(rank)[0]])
        opt = make_opt("adamw", model.parameters())
        idx, tgt = batch(0, 4)
        model.loss(idx, tgt).backward()
        opt.step()  # moments exist (and differ per unit): they move too
        if rank >= 4:  # strided sources, as in the test above
            for m in model.modules():
                if isinstance(m, RowwiseLinear):
                    st = opt.state[m.weight]
                    for k in [k for k in st if isinstance(st[k], torch.Tensor) and st[k].dim() == 2]:
                        st[k] = st[k].contiguous()
        tp1 = [dist.new_group(ranks=list(r.ranks)) for r in L1.replicas]
        mine = next((g for g, r in zip(tp1, L1.replicas, strict=True) if rank in r.ranks), None)
        comm.configure(coalesce=coalesce)
        dist.barrier()
        calls.clear()
        zero_copy = comm.stats.flat_zero_copy
        opt = apply_reshard(model, opt, L0, L1, alive, rank, fams, mine)
        msgs = list(calls)
        dist.barrier()
        tensors = {n: p.detach().clone() for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim():
                    tensors[f"{n}.{k}"] = v.clone()
        out[f"coalesce={coalesce}"] = (msgs, {n: t.numpy().copy() for n, t in tensors.items()},
                                      comm.stats.flat_zero_copy - zero_copy)
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.mark.parametrize(("device", "chunk"), [("cpu", 4096), ("staged", 4096), ("cpu", None)])
def test_coalesced_reshard_sends_one_message_per_peer_pair_and_chunk_with_the_same_bytes(device: str,
                                                                                         chunk: int | None):
    """TP4 -> TP3 with AdamW state, once with one message per tensor slice (the old path) and once
    coalesced: the coalesced path posts, per peer pair and direction, ceil(bytes / chunk) messages
    (bytes: what the old path moved between the pair) -- one when the chunk is the default -- and
    every parameter and moment ends bit-identical. Chunks of 4 KiB cut tensors mid-way."""
    q = worker_context().SimpleQueue()
    ctx = mp.start_processes(_flat_worker, args=(8, free_port(), device, chunk, q), nprocs=8, join=False,
                             start_method="forkserver")
    res = dict(q.get() for _ in range(8))
    while not ctx.join():
        pass
    size = chunk or comm.CHUNK_BYTES
    coalesced_total = per_tensor_total = zero_copy = 0
    for rank, out in sorted(res.items()):
        old_msgs, old_vals, _ = out["coalesce=False"]
        new_msgs, new_vals, zc = out["coalesce=True"]
        zero_copy += zc
        pairs: dict[tuple[str, int], int] = {}
        for d, peer, n in old_msgs:
            pairs[(d, peer)] = pairs.get((d, peer), 0) + n
        got: dict[tuple[str, int], list[int]] = {}
        for d, peer, n in new_msgs:
            got.setdefault((d, peer), []).append(n)
        assert set(got) == set(pairs), rank
        for key, total in pairs.items():
            assert len(got[key]) == -(-total // size), (rank, key, total, got[key])
            assert sum(got[key]) == total and max(got[key]) <= size
        coalesced_total += len(new_msgs)
        per_tensor_total += len(old_msgs)
        assert old_vals.keys() == new_vals.keys()
        for name, v in old_vals.items():
            assert v.tobytes() == new_vals[name].tobytes(), (rank, name)
    assert per_tensor_total > coalesced_total > 0
    if chunk is None:
        assert coalesced_total == len({(r, d, p) for r, o in res.items() for d, p, _ in o["coalesce=True"][0]})
    # 4 KiB chunks inside one tensor go from/into it directly -- unless staging is forced
    assert (zero_copy > 0) == (device == "cpu" and chunk is not None)
