"""NTP gradient synchronisation between DP replicas of different TP degrees (REFERENCE.md section 1).

A core rank i's chunk buffer holds, for every sharded tensor of every unit family (heads, MLP
columns), that tensor's slice for all of sync chunk i, laid out as the tensor itself (the units
along its sharded dimension); the same layout on every replica, so one flat all-reduce syncs it.

1. Pre-sync: each extra rank (TP index >= sync degree) sends its borrowed units' slices back to
   their core rank (`ntp_map(...).transfers`, point-to-point inside the replica), so core rank i
   holds the gradient of all of sync chunk i.
2. DP sync: one all-reduce per sync index i, over {core rank i of every replica}, of the chunk
   buffer (one bucket). Each replica's gradient is a mean over its own local batch, so it is
   scaled by local batch / global batch before the sum: gradients are averaged by sample count,
   not by replica count.
3. Post-sync: core ranks send the synced slices back to the extras.
Parameters that are not sharded (embeddings, norms, row-wise biases) are replicated inside a TP
group; one all-reduce over every rank, each contributing local_batch / tp_degree of its gradient,
gives the same sample-weighted mean.

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
from ntp_manager.worker.tp import ColwiseLinear, RowwiseLinear


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


def _shaped(flat: torch.Tensor, off: int, shape: Sequence[int]) -> tuple[torch.Tensor, int]:
    n = math.prod(shape)
    return flat[off : off + n].view(*shape), off + n


class NtpGradSync:
    """Create on every rank of the job (it creates process groups, collectively), after
    `parallelize(model, plan, layout.units_of(rank), group=tp_group)`.

    Gradients live in buffers allocated once: after the first `sync()` every gradient is a view of
    them, and `zero_grad()` (instead of the optimizer's `set_to_none=True`) keeps it so, so that
    backward accumulates into the buffers and the DP all-reduce runs on them without copies. On a
    core rank whose load is its whole sync chunk (uniform layouts, reduced replicas) and for
    column-wise tensors the gradient *is* its part of the all-reduce buffer."""

    def __init__(self, model: nn.Module, layout: SyncLayout, rank: int, families: Mapping[str, str],
                 timeout: Any = None) -> None:
        """`families` maps a sharded module path to its unit family. `timeout` (a timedelta) bounds
        every collective of the groups created here (torch otherwise gives new groups its default,
        not the world group's)."""
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
            if isinstance(mod, ColwiseLinear | RowwiseLinear):
                fam = families[path]
                col = isinstance(mod, ColwiseLinear)
                self.shards[fam].append(_Shard(mod.weight, 0 if col else 1, mod.unit_size))
                sharded_ids.add(id(mod.weight))
                if col and mod.bias is not None:
                    self.shards[fam].append(_Shard(mod.bias, 0, mod.unit_size))
                    sharded_ids.add(id(mod.bias))
        self.replicated = [p for p in model.parameters() if id(p) not in sharded_ids]
        self._stage: dict[tuple[str, int, int], torch.Tensor] = {}  # see _staging
        self._allocate()

    def _allocate(self) -> None:
        j = self.tp_index
        self.core = j < self.n_sync
        fams = list(self.layout.units)
        dtype = next((p.dtype for p in self.model.parameters()), torch.float32)
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        # core ranks: the DP all-reduce buffer, one segment per sharded tensor shaped for the chunk
        aliased: set[int] = set()
        if self.core:
            segs = []
            for f in fams:
                a, b = self.maps[f].sync_chunks[j]
                for s in self.shards[f]:
                    shape = list(s.param.shape)
                    shape[s.udim] = (b - a) * s.usize
                    segs.append(shape)
            self.dp_flat = torch.zeros(sum(math.prod(sh) for sh in segs), dtype=dtype, device=device)
            off, k = 0, 0
            for f in fams:
                keep = self.maps[f].load(j)
                for s in self.shards[f]:
                    s.seg, off = _shaped(self.dp_flat, off, segs[k])
                    k += 1
                    own = s.units(s.seg, 0, keep)
                    if own.is_contiguous():  # the gradient can be its own part of the chunk
                        s.home = own
                        aliased.add(id(s))
        # the rest (extras, row-wise tensors of cores that lend units) get a home of their own
        rest = [s for f in fams for s in self.shards[f] if id(s) not in aliased]
        local = torch.zeros(sum(s.param.numel() for s in rest), dtype=dtype, device=device)
        off = 0
        for s in rest:
            s.home, off = _shaped(local, off, s.param.shape)
        self.rep_flat = torch.zeros(sum(p.numel() for p in self.replicated), dtype=dtype, device=device)
        self.rep_homes = []
        off = 0
        for p in self.replicated:
            h, off = _shaped(self.rep_flat, off, p.shape)
            self.rep_homes.append(h)

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
        j = self.tp_index
        # 4. (started first, it overlaps the rest) replicated parameters: every rank of the layout
        # gives local_batch / tp of its gradient
        rep_work = None
        if self.replicated:
            self.rep_flat.mul_(lb / (len(my) * gb))
            rep_work = dist.all_reduce(self.rep_flat, group=self.layout_group, async_op=True)
            self.bytes_all_reduced += self.rep_flat.numel() * self.rep_flat.element_size()

        self._exchange(to_core=True)  # 1. pre-sync: extras return borrowed units' gradients

        # 2. DP all-reduce of the chunk buffer, weighted by local batch: sum(lb_r / gb * g_r)
        if self.core:
            self.dp_flat.mul_(lb / gb)
            dist.all_reduce(self.dp_flat, group=self.dp_groups[j])
            self.bytes_all_reduced += self.dp_flat.numel() * self.dp_flat.element_size()

        self._exchange(to_core=False)  # 3. post-sync: the synced values go back to the extras

        if rep_work is not None:
            rep_work.wait()

    def _exchange(self, to_core: bool) -> None:
        """The transfers between a replica's extra and core ranks: before the all-reduce (`to_core`)
        extras send the gradients of their borrowed units into the core ranks' chunk buffers, after
        it the cores send the synced values back. A core rank's own units move between its
        gradient and the chunk buffer too, where the two are not the same memory."""
        my = self.layout.replicas[self.replica].ranks
        j = self.tp_index
        sending = self.core != to_core  # extras send first, cores second
        reqs, later = [], []
        for f, m in self.maps.items():
            if self.core:
                for s in self.shards[f]:
                    assert s.seg is not None
                    own = s.units(s.seg, 0, m.load(j))
                    if not _same(own, s.home):
                        (own if to_core else s.home).copy_(s.home if to_core else own)
            pos = self._positions(f)
            for ti, t in enumerate(m.transfers):
                if j not in (t.core, t.extra):  # core and extra indices never overlap
                    continue
                for si, s in enumerate(self.shards[f]):
                    if self.core:
                        assert s.seg is not None
                        a = m.sync_chunks[j][0]
                        mine, peer = s.units(s.seg, t.start - a, t.stop - a), my[t.extra]
                    else:
                        i0 = pos[t.start]
                        mine, peer = s.units(s.home, i0, i0 + t.count), my[t.core]
                    # a strided slice (row-wise tensors) goes through a buffer kept between syncs
                    buf = mine if mine.is_contiguous() else self._staging(f, ti, si, mine)
                    if sending:
                        if buf is not mine:
                            buf.copy_(mine)
                        reqs.append(dist.isend(buf, dst=peer))
                    else:
                        reqs.append(dist.irecv(buf, src=peer))
                        if buf is not mine:
                            later.append((mine, buf))
        _wait(reqs)
        for dst, buf in later:
            dst.copy_(buf)

    def _staging(self, fam: str, transfer: int, shard: int, like: torch.Tensor) -> torch.Tensor:
        key = (fam, transfer, shard)
        buf = self._stage.get(key)
        if buf is None:
            buf = self._stage[key] = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        return buf

    def _positions(self, fam: str) -> dict[int, int]:
        return {u: i for i, u in enumerate(self.maps[fam].units_of(self.tp_index))}


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
