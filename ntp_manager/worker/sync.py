"""NTP gradient synchronisation between DP replicas of different TP degrees (REFERENCE.md section 1).

A core rank i's chunk buffer holds, for every sharded tensor of every unit family (heads, MLP
columns), that tensor's slice for all of sync chunk i, laid out unit-major like the shards
themselves (tp.py); the same layout on every replica, so flat all-reduces sync it.

1. Pre-sync: each extra rank (TP index >= sync degree) sends its borrowed units' slices back to
   their core rank (`ntp_map(...).transfers`, point-to-point inside the replica), so core rank i
   holds the gradient of all of sync chunk i.
2. DP sync: all-reduce of the chunk buffer over {core rank i of every replica}, in buckets of
   whole tensors (`bucket_bytes`): a bucket's all-reduce starts as soon as its borrowed units have
   arrived, while the next buckets are still on their way. Each replica's gradient is a mean over
   its own local batch, so it is scaled by local batch / global batch before the sum: gradients
   are averaged by sample count, not by replica count.
3. Post-sync: core ranks send each bucket's synced slices back to the extras as soon as its
   all-reduce is done.
Parameters that are not sharded (position embeddings, norms, row-wise biases) are replicated
inside a TP group; one all-reduce over every rank, each contributing local_batch / tp_degree of
its gradient, gives the same sample-weighted mean. It starts first and overlaps all of the above.

Uniform replicas (all the same degree) have no transfers: the procedure degenerates to a bucketed
all-reduce per TP index plus one for the replicated parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ntp_manager.planner.ntp_map import NtpMap, ntp_map, sync_groups
from ntp_manager.worker.tp import ShardedModule, unit_major_view, unit_slice

DEFAULT_BUCKET_BYTES = 4 << 20  # see bench/RESULTS.md (sync) for how it was chosen


@dataclass(frozen=True)
class ReplicaGroup:
    ranks: tuple[int, ...]  # global ranks in TP order
    local_batch: int


@dataclass(frozen=True)
class SyncLayout:
    """One pipeline stage's replicas, as every rank of the job sees them."""

    replicas: tuple[ReplicaGroup, ...]
    units: Mapping[str, int]  # family -> unit count (heads, MLP columns)

    @property
    def sync_degree(self) -> int:
        return min(len(r.ranks) for r in self.replicas)

    @property
    def global_batch(self) -> int:
        return sum(r.local_batch for r in self.replicas)

    def locate(self, rank: int) -> tuple[int, int]:
        for ri, r in enumerate(self.replicas):
            if rank in r.ranks:
                return ri, r.ranks.index(rank)
        raise ValueError(f"rank {rank} is in no replica of this layout")

    def unit_map(self, family: str, replica: int) -> NtpMap:
        return ntp_map(self.units[family], len(self.replicas[replica].ranks), self.sync_degree)

    def units_of(self, rank: int) -> dict[str, list[int]]:
        """What `parallelize` should give this rank: its units per family."""
        ri, j = self.locate(rank)
        return {f: self.unit_map(f, ri).units_of(j) for f in self.units}


class _Shard:
    """One sharded tensor of a family: its parameter, the dimension its units run along (0 for a
    column-wise weight or bias, 1 for a row-wise weight) and the features per unit."""

    __slots__ = ("home", "param", "seg", "udim", "usize")

    def __init__(self, param: nn.Parameter, udim: int, usize: int) -> None:
        self.param, self.udim, self.usize = param, udim, usize
        self.home: torch.Tensor  # this rank's gradient lives here between steps (p.grad is it)
        self.seg: torch.Tensor | None = None  # core ranks: the whole sync chunk in the DP buffer

    def units(self, t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The slice of `t` (shaped like this tensor, along the unit dim) for units [start, stop)."""
        return t.narrow(self.udim, start * self.usize, (stop - start) * self.usize)

    def message(self, t: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The same slice oriented units-first: what goes on the wire (contiguous when `t` is
        unit-major, as every buffer here is)."""
        return unit_slice(t, self.udim, start * self.usize, (stop - start) * self.usize)


def _shaped(flat: torch.Tensor, off: int, shape: Sequence[int], udim: int = 0) -> tuple[torch.Tensor, int]:
    """The next block of `flat` as a tensor of `shape`, unit-major along `udim`; and the offset after it."""
    n = math.prod(shape)
    return unit_major_view(flat[off : off + n], shape, udim), off + n


class NtpGradSync:
    """Create on every rank of the job (it creates process groups, collectively), after
    `parallelize(model, plan, layout.units_of(rank), group=tp_group)`.

    Gradients live in buffers allocated once: after the first `sync()` every gradient is a view of
    them, and `zero_grad()` (instead of the optimizer's `set_to_none=True`) keeps it so, so that
    backward accumulates into the buffers and the DP all-reduce runs on them without copies. On a
    core rank every sharded gradient *is* its part of the all-reduce buffer: buffers are laid out
    unit-major like the shards (tp.py), so a rank's own units are one block of its sync chunk."""

    def __init__(self, model: nn.Module, layout: SyncLayout, rank: int, families: Mapping[str, str],
                 timeout: Any = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 reuse: Sequence[torch.Tensor] = ()) -> None:
        """`families` maps a sharded module path to its unit family. `timeout` (a timedelta) bounds
        every collective of the groups created here (torch otherwise gives new groups its default,
        not the world group's). `bucket_bytes`: the DP all-reduce runs per bucket of about this
        size, so that it overlaps the transfers of the other buckets. `reuse`: memory for the
        buffers, used where it fits -- a previous layout's `buffers()`, whose sync must not be
        used any more (`release()` it). Memory already touched is cheaper than fresh pages (on a
        VM several times a copy), and a layout switch would otherwise allocate every gradient
        buffer anew."""
        self.model, self.layout, self.rank = model, layout, rank
        self.n_sync = layout.sync_degree
        # Groups are created by every rank of the process group, members or not, in the same order
        # (a torch.distributed requirement); a rank outside the layout then stays inactive.
        self.dp_groups: list[Any] = []
        for ranks in sync_groups([list(r.ranks) for r in layout.replicas])[: self.n_sync]:
            self.dp_groups.append(dist.new_group(ranks=ranks, timeout=timeout))
        members = sorted(r for rep in layout.replicas for r in rep.ranks)
        self.layout_group = dist.new_group(ranks=members, timeout=timeout)
        self.active = rank in members
        self.bytes_all_reduced = 0
        if not self.active:
            return
        self.replica, self.tp_index = layout.locate(rank)
        self.maps = {f: layout.unit_map(f, self.replica) for f in layout.units}
        self.shards: dict[str, list[_Shard]] = {f: [] for f in layout.units}
        sharded_ids: set[int] = set()
        for path, mod in model.named_modules():
            if isinstance(mod, ShardedModule):
                for _, p, udim in mod.sharded_params():
                    self.shards[families[path]].append(_Shard(p, udim, mod.unit_size))
                    sharded_ids.add(id(p))
        self.replicated = [p for p in model.parameters() if id(p) not in sharded_ids]
        if reuse:
            # a gradient of the old layout means nothing under the new one, and it may be a view
            # of memory about to be reused
            for p in model.parameters():
                p.grad = None
        self._allocate(bucket_bytes, _Pool(list(reuse)))
        self._plan_messages()

    def _allocate(self, bucket_bytes: int, pool: _Pool) -> None:
        """Core ranks: the DP all-reduce buffer, cut into buckets of whole tensors (about
        `bucket_bytes` each; the same cut on every replica, as it depends only on the sync chunk),
        each bucket one contiguous block holding a segment per sharded tensor shaped for the
        chunk. Extra ranks: a home per sharded gradient. Everyone: the replicated gradients."""
        j = self.tp_index
        self.core = j < self.n_sync
        dtype = next((p.dtype for p in self.model.parameters()), torch.float32)
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        # the replicated gradients first: the same size under every layout, so a predecessor's
        # buffer for them fits exactly
        self.rep_flat = pool.take(sum(p.numel() for p in self.replicated), dtype, device)
        self.rep_homes = []
        off = 0
        for p in self.replicated:
            h, off = _shaped(self.rep_flat, off, p.shape)
            self.rep_homes.append(h)
        order = [(f, s) for f in self.layout.units for s in self.shards[f]]
        self._bucket_shards: list[list[tuple[str, _Shard]]] = [[]]
        self._blocks: list[torch.Tensor] = []  # core: one per bucket; extra: one for every home
        if self.core:
            shapes: dict[int, list[int]] = {}
            size = 0
            for f, s in order:
                a, b = self.maps[f].sync_chunks[j]
                shape = list(s.param.shape)
                shape[s.udim] = (b - a) * s.usize
                shapes[id(s)] = shape
                if size * s.param.element_size() >= bucket_bytes:
                    self._bucket_shards.append([])
                    size = 0
                self._bucket_shards[-1].append((f, s))
                size += math.prod(shape)
            for members in self._bucket_shards:
                buf = pool.take(sum(math.prod(shapes[id(s)]) for _, s in members), dtype, device)
                self._blocks.append(buf)
                off = 0
                for f, s in members:
                    s.seg, off = _shaped(buf, off, shapes[id(s)], s.udim)
                    # unit-major: the rank's own units are a block of the chunk buffer, so the
                    # gradient is that block (its layout matches the parameter's, see tp.py)
                    s.home = s.units(s.seg, 0, self.maps[f].load(j))
        else:  # an extra rank's gradients get a home of their own
            self._bucket_shards = [order]
            local = pool.take(sum(s.param.numel() for _, s in order), dtype, device)
            self._blocks.append(local)
            off = 0
            for _, s in order:
                s.home, off = _shaped(local, off, s.param.shape, s.udim)

    def buffers(self) -> list[torch.Tensor]:
        """Every gradient buffer this object holds (what a successor may `reuse`)."""
        return [self.rep_flat, *self._blocks] if self.active else []

    def release(self) -> None:
        """Forget every buffer (they may now belong to a successor); the object is unusable."""
        if not self.active:
            return
        self.active = False
        self._blocks, self._msgs, self.rep_homes = [], [], []
        self.rep_flat = torch.empty(0)
        for s in (s for shards in self.shards.values() for s in shards):
            s.seg, s.home = None, torch.empty(0)

    # ---- gradients in the buffers ---------------------------------------------------------------
    def _all(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        out = [(s.param, s.home) for f in self.shards for s in self.shards[f]]
        return out + list(zip(self.replicated, self.rep_homes, strict=True))

    def zero_grad(self) -> None:
        """Zero every gradient in place (the buffers stay the gradients)."""
        if not self.active:
            return
        for p, home in self._all():
            home.zero_()
            p.grad = home

    def _gather_grads(self) -> None:
        for p, home in self._all():
            g = p.grad
            if g is None:
                home.zero_()
            elif not _same(g, home):
                home.copy_(g)
            p.grad = home

    # ---- the sync ------------------------------------------------------------------------------
    def sync(self) -> None:
        if not self.active:
            return
        self._gather_grads()
        lay = self.layout
        lb, gb = lay.replicas[self.replica].local_batch, lay.global_batch
        my = lay.replicas[self.replica].ranks
        # 4. (started first, it overlaps the rest) replicated parameters: every rank of the layout
        # gives local_batch / tp of its gradient
        rep_work = None
        if self.replicated:
            self.rep_flat.mul_(lb / (len(my) * gb))
            rep_work = dist.all_reduce(self.rep_flat, group=self.layout_group, async_op=True)
            self.bytes_all_reduced += self.rep_flat.numel() * self.rep_flat.element_size()
        if self.core:
            # 1. pre-sync: receives for every bucket are posted at once; 2. each bucket's
            # all-reduce starts as soon as its borrowed units are in (weighted by local batch:
            # sum(lb_r / gb * g_r)), while later buckets still arrive; 3. post-sync: each bucket
            # goes back to the extras as soon as its all-reduce is done.
            group = self.dp_groups[self.tp_index]
            incoming = [self._post(msgs, send=False) for msgs in self._msgs]
            works = []
            for part, reqs in zip(self._blocks, incoming, strict=True):
                _wait(reqs)
                part.mul_(lb / gb)
                works.append(dist.all_reduce(part, group=group, async_op=True))
                self.bytes_all_reduced += part.numel() * part.element_size()
            outgoing = []
            for msgs, work in zip(self._msgs, works, strict=True):
                work.wait()
                outgoing += self._post(msgs, send=True)
            _wait(outgoing)
        else:  # an extra rank: its borrowed units' gradients go to their cores and come back synced
            msgs = self._msgs[0]
            _wait(self._post(msgs, send=True) + self._post(msgs, send=False))
        if rep_work is not None:
            rep_work.wait()

    def _plan_messages(self) -> None:
        """List each bucket's point-to-point messages: one per (sharded tensor, transfer) this rank
        is part of, a slice oriented units-first (contiguous: every buffer here is unit-major).
        Both ends of a pair list their messages in the same order (tensor, then transfer), which
        is how gloo matches them. Extra ranks keep one list (they have no buckets)."""
        my = self.layout.replicas[self.replica].ranks
        j = self.tp_index
        mine = {f: [t for t in m.transfers if j in (t.core, t.extra)] for f, m in self.maps.items()}
        pos = {f: self._positions(f) for f in self.maps}
        self._msgs: list[list[_Msg]] = []
        for members in self._bucket_shards:
            self._msgs.append([])
            for f, s in members:
                m = self.maps[f]
                for t in mine[f]:  # core and extra indices differ
                    if self.core:
                        assert s.seg is not None
                        a = m.sync_chunks[j][0]
                        view, peer = s.message(s.seg, t.start - a, t.stop - a), my[t.extra]
                    else:
                        i0 = pos[f][t.start]
                        view, peer = s.message(s.home, i0, i0 + t.count), my[t.core]
                    assert view.is_contiguous()  # home and seg are ours, allocated unit-major
                    self._msgs[-1].append(_Msg(view, peer))

    def _post(self, msgs: list[_Msg], send: bool) -> list[Any]:
        reqs = []
        for m in msgs:  # point-to-point on the layout's own group, never on the default one
            if send:
                reqs.append(dist.isend(m.view, dst=m.peer, group=self.layout_group))
            else:
                reqs.append(dist.irecv(m.view, src=m.peer, group=self.layout_group))
        return reqs

    def _positions(self, fam: str) -> dict[int, int]:
        return {u: i for i, u in enumerate(self.maps[fam].units_of(self.tp_index))}


class _Pool:
    """Memory for new gradient buffers: blocks of a predecessor's buffers first (first fit, a
    block's rest stays available), fresh zeroed memory for what does not fit."""

    def __init__(self, blocks: list[torch.Tensor]) -> None:
        self.blocks = [b.view(-1) for b in blocks if b.numel()]

    def take(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            if b.numel() >= n and b.dtype == dtype and b.device == device:
                self.blocks[i] = b[n:]
                return b[:n]
        return torch.zeros(n, dtype=dtype, device=device)


@dataclass(frozen=True)
class _Msg:
    """One point-to-point message of the sync: the slice it is sent from or received into (a
    contiguous view of a gradient buffer) and the other rank."""

    view: torch.Tensor
    peer: int


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape are the same memory."""
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def _wait(reqs: list[Any]) -> None:
    for r in reqs:
        r.wait()


def families_of(plan: Mapping[str, Any], model: nn.Module) -> dict[str, str]:
    """Module path -> unit family, from a TP plan of fnmatch patterns."""
    import fnmatch

    out = {}
    for path, _ in model.named_modules():
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(path, pattern):
                out[path] = style.family
                break
    return out


def replicas_from(ranks: Sequence[Sequence[int]], batches: Sequence[int]) -> tuple[ReplicaGroup, ...]:
    return tuple(ReplicaGroup(tuple(r), b) for r, b in zip(ranks, batches, strict=True))
