"""NTP gradient synchronisation between DP replicas of different TP degrees
(docs/references.md, "NTP: units and the gradient sync").

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
Steps 1 and 3 stay inside a replica (NVLink on a GPU). On CPU, where a socket would charge every
byte to both ends, a core maps its extra's gradient memory and copies the units itself
(`NtpGradSync._share`); across hosts and on NCCL they are point-to-point messages.
Parameters that are not sharded (position embeddings, norms, row-wise biases) are replicated
inside a TP group; one all-reduce over every rank, each contributing local_batch / tp of
its gradient, gives the same sample-weighted mean. It starts first and overlaps all of the above.

Uniform replicas (all the same degree) have no transfers: the procedure degenerates to a bucketed
all-reduce per TP index plus one for the replicated parameters.
"""

from __future__ import annotations

import math
import os
import socket
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ntp_manager.contract.ntp_map import NtpMap, ntp_map, sync_groups
from ntp_manager.worker import comm
from ntp_manager.worker.comm import P2P
from ntp_manager.worker.tp import ShardedModule, unit_major_view, unit_slice

DEFAULT_BUCKET_BYTES = 4 << 20  # see bench/RESULTS.md (sync) for how it was chosen
DEFAULT_PACK_BYTES = 256 << 10  # transfers smaller than this share a message (_coalesce)


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


def check_uniform_parameters(model: nn.Module) -> None:
    """Refuse a model whose parameters differ in dtype or device: the gradient buffers hold one
    dtype on one device (every gradient is a view of them), and a gradient of another dtype could
    only be a cast copy -- torch refuses that as `.grad` mid-step, with no hint why. Keep the
    parameters in one dtype (for example fp32 under `torch.autocast`) on one device."""
    first: tuple[str, torch.dtype, torch.device] | None = None
    for name, p in model.named_parameters():
        if first is None:
            first = (name, p.dtype, p.device)
        elif (p.dtype, p.device) != first[1:]:
            raise ValueError(f"parameter {name} is {p.dtype} on {p.device} but {first[0]} is {first[1]} on "
                             f"{first[2]}: NTP gradient sync keeps every gradient in one buffer of one dtype on "
                             "one device; give every parameter the same dtype and device (mixed precision: "
                             "keep parameters in one dtype and cast in the forward, e.g. torch.autocast)")


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
                 reuse: Sequence[torch.Tensor] = (), pack_bytes: int = DEFAULT_PACK_BYTES,
                 shared_memory: bool = True, scratch: Sequence[torch.Tensor] = ()) -> None:
        """`families` maps a sharded module path to its unit family. `timeout` (a timedelta) bounds
        every collective of the groups created here (torch otherwise gives new groups its default,
        not the world group's). `bucket_bytes`: the DP all-reduce runs per bucket of about this
        size, so that it overlaps the transfers of the other buckets. `reuse`: memory for the
        buffers, used where it fits -- a previous layout's `buffers()`, whose sync must not be
        used any more (`release()` it). Memory already touched is cheaper than fresh pages (on a
        VM several times a copy), and a layout switch would otherwise allocate every gradient
        buffer anew. `pack_bytes`: see `_plan_messages`. `shared_memory`: on CPU, an extra rank
        whose cores run on its host keeps its gradients in shared memory, and the cores copy the
        borrowed units in and out themselves (`_share`); off, or where that is impossible, the
        transfers are point-to-point messages. `scratch`: more memory that nothing else uses
        any more (a reshard's replaced shards), used like `reuse` for buffers that need not be
        shareable (not an extra rank's gradients), and not kept otherwise."""
        check_uniform_parameters(model)
        self.model, self.layout, self.rank = model, layout, rank
        self.bucket_bytes, self.pack_bytes = bucket_bytes, pack_bytes
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
        self._rest: list[torch.Tensor] = []  # the predecessor's memory this sync did not need
        self.fresh_elements = 0  # buffer elements that are fresh memory, not the predecessor's
        if not self.active:
            return
        self.replica, self.tp_index = layout.locate(rank)
        self.maps = {f: layout.unit_map(f, self.replica) for f in layout.units}
        self.shards: dict[str, list[_Shard]] = {f: [] for f in layout.units}
        sharded_ids: set[int] = set()
        for path, mod in model.named_modules():
            if isinstance(mod, ShardedModule):
                for _, p, udim in mod.sharded_params():
                    if id(p) in sharded_ids:
                        continue  # a tied weight: one Parameter in two shards, synced once
                    self.shards[families[path]].append(_Shard(p, udim, mod.unit_size))
                    sharded_ids.add(id(p))
        self.replicated = [p for p in model.parameters() if id(p) not in sharded_ids]
        if reuse:
            # a gradient of the old layout means nothing under the new one, and it may be a view
            # of memory about to be reused
            for p in model.parameters():
                p.grad = None
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        # the same on every rank of a job (one device type), so all or none join _share's exchange;
        # CPU memory only (device memory goes through comm.py), and off under forced staging, which
        # stands in for a GPU
        self._shm = shared_memory and device.type == "cpu" and not comm.staging_forced()
        self._msgs: list[list[_Msg]] = []  # per bucket (extras: one list)
        # core: per bucket, (extra, slice of the chunk buffer, the same units in the extra's
        # shared gradients) for the extras in shared memory
        self._copies: list[list[tuple[int, torch.Tensor, torch.Tensor]]] = []
        self._flags: dict[int, torch.Tensor] = {}  # peer -> flag in shared-memory transfers
        self._allocate(_Pool(list(reuse), shared=self._shm, scratch=scratch))
        self._share()
        self._plan_messages()

    def _allocate(self, pool: _Pool) -> None:
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
        self._blocks: list[torch.Tensor] = []  # core: one per bucket; extra: one for every home
        if self.core:
            self._buckets = self._cut(j)
            sizes = [sum(math.prod(shape) for _, _, shape in members) for members in self._buckets]
            for members, buf in zip(self._buckets, pool.take_all(sizes, dtype, device), strict=True):
                self._blocks.append(buf)
                off = 0
                for f, s, shape in members:
                    s.seg, off = _shaped(buf, off, shape, s.udim)
                    # unit-major: the rank's own units are a block of the chunk buffer, so the
                    # gradient is that block (its layout matches the parameter's, see tp.py)
                    s.home = s.units(s.seg, 0, self.maps[f].load(j))
        else:  # an extra rank's gradients get a home of their own
            order = [(f, s) for f in self.layout.units for s in self.shards[f]]
            local = pool.take(sum(s.param.numel() for _, s in order), dtype, device, shareable=self._shm)
            self._blocks.append(local)
            for s, view in zip((s for _, s in order), self._home_views(j, local), strict=True):
                s.home = view
        self._rest = pool.rest()
        self.fresh_elements = pool.fresh_elements

    def _cut(self, core: int) -> list[list[tuple[str, _Shard, list[int]]]]:
        """Core rank `core`'s DP buckets: runs of whole tensors (family order, then model order)
        of about `bucket_bytes`, each tensor shaped for sync chunk `core`. Every rank can compute
        any core's cut -- the extras need it to pack their messages the way the core expects."""
        buckets: list[list[tuple[str, _Shard, list[int]]]] = [[]]
        size = 0
        for f in self.layout.units:
            a, b = self.maps[f].sync_chunks[core]
            for s in self.shards[f]:
                shape = list(s.param.shape)
                shape[s.udim] = (b - a) * s.usize
                if size * s.param.element_size() >= self.bucket_bytes:
                    buckets.append([])
                    size = 0
                buckets[-1].append((f, s, shape))
                size += math.prod(shape)
        return buckets

    def _home_views(self, extra: int, flat: torch.Tensor) -> list[torch.Tensor]:
        """Extra rank `extra`'s gradient homes in `flat`, one per sharded tensor (family order,
        then model order), each unit-major and shaped like that rank's shard of the tensor. A core
        rank computes its extras' layout with this too, to find the units it copies."""
        out = []
        off = 0
        for f in self.layout.units:
            n = len(self.maps[f].units_of(extra))
            for s in self.shards[f]:
                shape = list(s.param.shape)
                shape[s.udim] = n * s.usize
                view, off = _shaped(flat, off, shape, s.udim)
                out.append(view)
        if off != flat.numel():
            raise ValueError(f"extra rank {extra}'s gradient buffer holds {flat.numel()} values, "
                             f"its shards {off}: the ranks do not run the same model")
        return out

    def _share(self) -> None:
        """Set up shared-memory transfers between this replica's extra ranks and the cores on
        their host: the stand-in, on CPU, for NVLink inside a GPU domain. Over loopback sockets
        every byte of the pre- and post-sync costs CPU on both ends (~0.25 ms per MB each way);
        here a core copies its borrowed units straight out of its extra's gradients, and the
        synced values straight back, and the extra only waits for a flag each way. Gradient
        memory is shareable from the start (`_shared_zeros`), so a rank that becomes an extra
        at a layout switch reuses its old buffers like any other rank. Collective over the
        layout: one exchange of where each extra's gradients are, one of what each core mapped."""
        self._mapped: dict[int, torch.Tensor] = {}  # core: extra's global rank -> its gradients
        self._shm_peers: list[int] = []  # extra: the cores that copy for it
        if not self._shm:
            return
        members = sorted(r for rep in self.layout.replicas for r in rep.ranks)
        my = self.layout.replicas[self.replica].ranks
        j = self.tp_index
        host = _host_key()
        where = None if self.core else _shared_address(self._blocks[0])
        infos: list[Any] = [None] * len(members)
        comm.all_gather_object(infos, (host, where), group=self.layout_group)
        info = dict(zip(members, infos, strict=True))
        if self.core:
            extras = sorted({t.extra for m in self.maps.values() for t in m.transfers if t.core == j})
            for e in extras:
                e_host, e_where = info[my[e]]
                if e_host != host or e_where is None:
                    continue  # this pair keeps to messages
                flat = _map_shared(e_where, self._blocks[0].dtype)
                if flat is None:
                    continue  # e.g. /proc hidden from us: messages
                self._home_views(e, flat)  # checks the size
                self._mapped[my[e]] = flat
        done: list[Any] = [None] * len(members)
        comm.all_gather_object(done, sorted(self._mapped), group=self.layout_group)
        if not self.core:
            self._shm_peers = [r for r, mapped in zip(members, done, strict=True) if self.rank in mapped]

    def buffers(self) -> list[torch.Tensor]:
        """Every gradient buffer this object holds (what a successor may `reuse`)."""
        return _merged([self.rep_flat, *self._blocks, *self._rest]) if self.active else []

    def release(self) -> None:
        """Forget every buffer (they may now belong to a successor); the object is unusable."""
        if not self.active:
            return
        self.active = False
        self._blocks, self._msgs, self.rep_homes, self._rest = [], [], [], []
        self._mapped, self._copies, self._shm_peers = {}, [], []
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

    def norm_share(self) -> float:
        """This rank's share of the squared L2 norm of the whole model's synced gradient
        (`norm_share(model, tp_index)`). Summed over every rank of the layout: replicas x the
        squared norm. Call after `sync()`."""
        return norm_share(self.model, self.tp_index) if self.active else 0.0

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
            rep_work = comm.all_reduce(self.rep_flat, group=self.layout_group, async_op=True)
            self.bytes_all_reduced += self.rep_flat.numel() * self.rep_flat.element_size()
        if self.core:
            # 1. pre-sync: receives for every bucket are posted at once; 2. each bucket's
            # all-reduce starts as soon as its borrowed units are in (weighted by local batch:
            # sum(lb_r / gb * g_r)), while later buckets still arrive; 3. post-sync: each bucket
            # goes back to the extras as soon as its all-reduce is done.
            # Extras in shared memory: wait for their flag, then copy.
            group = self.dp_groups[self.tp_index]
            ready = {e: comm.irecv(flag, src=e, group=self.layout_group) for e, flag in self._flags.items()}
            incoming = [self._post(msgs, send=False) for msgs in self._msgs]
            works = []
            for part, msgs, copies, reqs in zip(self._blocks, self._msgs, self._copies, incoming, strict=True):
                _wait(reqs)
                for m in msgs:
                    m.unpack()
                for e, seg, theirs in copies:
                    if e in ready:
                        ready.pop(e).wait()
                    seg.copy_(theirs)
                part.mul_(lb / gb)
                works.append(comm.all_reduce(part, group=group, async_op=True))
                self.bytes_all_reduced += part.numel() * part.element_size()
            _wait(list(ready.values()))  # an extra none of whose units are in a bucket (none in practice)
            outgoing = []
            for msgs, copies, work in zip(self._msgs, self._copies, works, strict=True):
                work.wait()
                outgoing += self._post(msgs, send=True)
                for _, seg, theirs in copies:
                    theirs.copy_(seg)
            outgoing += comm.exchange([P2P(True, flag, e) for e, flag in self._flags.items()], self.layout_group)
            _wait(outgoing)
        else:  # an extra rank: its borrowed units' gradients go to their cores and come back synced
            msgs = self._msgs[0]
            # one exchange: on NCCL one group call, so the sends and receives cannot deadlock
            ops = [P2P(True, self._flags[c], c) for c in self._shm_peers]
            ops += [P2P(False, self._flags[c], c) for c in self._shm_peers]
            _wait(comm.exchange(ops + self._ops(msgs, send=True) + self._ops(msgs, send=False), self.layout_group))
            for m in msgs:
                m.unpack()
        if rep_work is not None:
            rep_work.wait()

    def _plan_messages(self) -> None:
        """List each bucket's point-to-point messages. A transfer of a sharded tensor is a slice
        oriented units-first (contiguous: every buffer here is unit-major); per bucket and peer,
        the slices under `pack_bytes` travel together in one packed message (each message has a
        fixed cost, ~20 us of CPU on each end with gloo, worth ~0.5 MB of memcpy), the others go
        straight from and into the buffers. Both ends list a pair's messages in the same order
        (bucket of the core's cut, then tensor, then transfer), which is how gloo matches them.
        Extra ranks keep one list (they have no buckets of their own)."""
        my = self.layout.replicas[self.replica].ranks
        j = self.tp_index
        self._msgs, self._copies = [], []
        if self.core:
            theirs = {e: self._home_views(my.index(e), flat) for e, flat in self._mapped.items()}
            index = {id(s): i for i, s in enumerate(s for f in self.layout.units for s in self.shards[f])}
            extras = {my.index(e) for e in theirs}
            pos = {(f, e): self._positions(f, e) for f in self.maps for e in extras}
            self._flags = {e: torch.zeros(1) for e in self._mapped}
            for members in self._buckets:
                slices, copies = [], []
                for f, s, _ in members:
                    m = self.maps[f]
                    a = m.sync_chunks[j][0]
                    assert s.seg is not None
                    for t in m.transfers:  # core and extra indices differ
                        if t.core != j:
                            continue
                        mine = s.message(s.seg, t.start - a, t.stop - a)
                        if my[t.extra] in theirs:
                            i0 = pos[f, t.extra][t.start]
                            other = theirs[my[t.extra]][index[id(s)]]
                            copies.append((my[t.extra], mine, s.message(other, i0, i0 + t.count)))
                        else:
                            slices.append((mine, my[t.extra]))
                self._msgs.append(_coalesce(slices, self.pack_bytes))
                self._copies.append(copies)
            return
        self._flags = {c: torch.zeros(1) for c in self._shm_peers}
        places = {f: self._positions(f, j) for f in self.maps}
        cores = sorted({t.core for m in self.maps.values() for t in m.transfers if t.extra == j}
                       - {my.index(c) for c in self._shm_peers})
        msgs: list[_Msg] = []
        for c in cores:
            for members in self._cut(c):
                slices = []
                for f, s, _ in members:
                    for t in self.maps[f].transfers:
                        if t.core == c and t.extra == j:
                            i0 = places[f][t.start]
                            slices.append((s.message(s.home, i0, i0 + t.count), my[c]))
                msgs += _coalesce(slices, self.pack_bytes)
        self._msgs.append(msgs)

    def _ops(self, msgs: list[_Msg], send: bool) -> list[P2P]:
        ops = []
        for m in msgs:
            if send:
                m.pack()
            ops.append(P2P(send, m.out if send else m.into, m.peer))
        return ops

    def _post(self, msgs: list[_Msg], send: bool) -> list[Any]:
        # point-to-point on the layout's own group, never on the default one
        return comm.exchange(self._ops(msgs, send), self.layout_group)

    def _positions(self, fam: str, tp_index: int) -> dict[int, int]:
        """unit -> its position among the units of TP rank `tp_index` of this replica"""
        return {u: i for i, u in enumerate(self.maps[fam].units_of(tp_index))}


class _Pool:
    """Memory for new gradient buffers: blocks of a predecessor's buffers first (best fit: the
    smallest block that holds the request; a block's rest stays available), fresh zeroed memory
    for what does not fit -- shareable with this host's other processes if `shared` (CPU only)."""

    def __init__(self, blocks: list[torch.Tensor], shared: bool = False, scratch: Sequence[torch.Tensor] = ()) -> None:
        """`scratch`: more memory to use, which `rest()` does not hand on (it goes once unused)."""
        self.blocks = [b.view(-1) for b in blocks if b.numel()]
        self.keep = len(self.blocks)  # blocks[:keep] are the predecessor's buffers, the others scratch
        self.blocks += [b.view(-1) for b in scratch if b.numel()]
        self.shared = shared
        self.fresh_elements = 0  # what this pool could not serve from the predecessor's memory

    def _reuse(self, n: int, dtype: torch.dtype, device: torch.device, shareable: bool = False) -> torch.Tensor | None:
        fits = [i for i, b in enumerate(self.blocks) if b.numel() >= n and b.dtype == dtype and b.device == device
                and (not shareable or _is_shared(b))]
        if not fits:
            return None
        i = min(fits, key=lambda k: self.blocks[k].numel())
        b = self.blocks[i]
        self.blocks[i] = b[n:]
        return b[:n]

    def _fresh(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.fresh_elements += n
        if self.shared and device.type == "cpu" and n:
            t = _shared_zeros(n, dtype)
            if t is not None:
                return t
        return torch.zeros(n, dtype=dtype, device=device)

    def take(self, n: int, dtype: torch.dtype, device: torch.device, shareable: bool = False) -> torch.Tensor:
        """`shareable`: only a block other processes can map (or fresh shared memory): an extra
        rank's gradients, which its cores map."""
        got = self._reuse(n, dtype, device, shareable)
        return got if got is not None else self._fresh(n, dtype, device)

    def take_all(self, sizes: Sequence[int], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
        """One block per size: from the predecessor's memory where a block fits, the others cut
        from one fresh block -- not one fresh block each, which would leave a successor only
        bucket-sized blocks, too small for buckets of a larger chunk or an extra rank's home, so
        that it would touch fresh pages again (on a VM several times the cost of a copy)."""
        got = [self._reuse(n, dtype, device) for n in sizes]
        missing = sum(n for n, g in zip(sizes, got, strict=True) if g is None)
        fresh = self._fresh(missing, dtype, device) if missing else None
        out, off = [], 0
        for n, g in zip(sizes, got, strict=True):
            if g is None:
                assert fresh is not None
                g, off = fresh[off : off + n], off + n
            out.append(g)
        return out

    def rest(self) -> list[torch.Tensor]:
        """What is left of the predecessor's buffers (a successor may use it); what is left of
        the scratch memory is let go."""
        return [b for b in self.blocks[: self.keep] if b.numel()]


def _is_shared(t: torch.Tensor) -> bool:
    return getattr(t.untyped_storage(), "_ntp_fd", None) is not None


def _merged(views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """1-D views joined where they follow each other in one storage, largest first: the blocks
    they were cut from, as a successor's pool should see them."""
    flat = sorted((v.view(-1) for v in views if v.numel()),
                  key=lambda v: (v.untyped_storage().data_ptr(), v.storage_offset()))
    out: list[torch.Tensor] = []
    for v in flat:
        last = out[-1] if out else None
        if (last is not None and last.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
                and last.dtype == v.dtype and last.storage_offset() + last.numel() == v.storage_offset()):
            out[-1] = torch.as_strided(last, (last.numel() + v.numel(),), (1,), last.storage_offset())
        else:
            out.append(v)
    return sorted(out, key=lambda v: -v.numel())


class _Msg:
    """One point-to-point message of the sync with one peer: either one slice of a gradient
    buffer (sent from and received into directly), or several small slices packed into staging
    buffers (`out` filled by `pack()` before a send, `into` spread by `unpack()` after a receive;
    two buffers, so that a receive posted early never overwrites a send still in flight)."""

    __slots__ = ("into", "out", "parts", "peer")

    def __init__(self, slices: Sequence[torch.Tensor], peer: int) -> None:
        self.peer = peer
        self.parts = list(slices) if len(slices) > 1 else []
        if self.parts:
            n = sum(t.numel() for t in slices)
            self.out = torch.empty(n, dtype=slices[0].dtype, device=slices[0].device)
            self.into = torch.empty_like(self.out)
        else:
            self.out = self.into = slices[0]

    def pack(self) -> None:
        off = 0
        for t in self.parts:
            self.out[off : off + t.numel()].copy_(t.view(-1))
            off += t.numel()

    def unpack(self) -> None:
        off = 0
        for t in self.parts:
            t.view(-1).copy_(self.into[off : off + t.numel()])
            off += t.numel()


def _coalesce(slices: Sequence[tuple[torch.Tensor, int]], pack_bytes: int) -> list[_Msg]:
    """The messages for a bucket's slices (each with its peer): per peer, the slices under
    `pack_bytes` as one packed message first, then every other slice as a message of its own."""
    out = []
    for peer in dict.fromkeys(p for _, p in slices):
        mine = [t for t, p in slices if p == peer]
        small = [t for t in mine if t.numel() * t.element_size() < pack_bytes]
        if small:
            out.append(_Msg(small, peer))
        out += [_Msg([t], peer) for t in mine if t.numel() * t.element_size() >= pack_bytes]
    return out


def _host_key() -> str:
    """Which machine and process namespace this is: ranks with the same key can map each other's
    memory through /proc/<pid>. The boot id tells apart hosts (or containers on different hosts)
    that share a host name; the PID namespace, containers on one host (there /proc/<pid> would
    name another process)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(os.readlink("/proc/self/ns/pid"))
    except OSError:
        parts.append("")
    return "/".join(parts)


def _shared_zeros(n: int, dtype: torch.dtype) -> torch.Tensor | None:
    """`n` zeros of `dtype` that other processes of this host can map (`_shared_address`), or
    None where that is impossible (no memfd: not Linux). Anonymous shared memory: nothing in
    /dev/shm to fill or to leave behind; the pages go when the last mapping does. The tensor's
    storage keeps the descriptor open while it lives."""
    if not hasattr(os, "memfd_create") or not os.path.isdir("/proc/self/fd"):
        return None
    try:
        fd = os.memfd_create("ntp-grad", os.MFD_CLOEXEC)
    except OSError:
        return None
    try:
        t = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=n, dtype=dtype)
    except RuntimeError:
        os.close(fd)
        return None
    storage = t.untyped_storage()
    storage._ntp_fd = fd  # type: ignore[attr-defined]
    weakref.finalize(storage, os.close, fd)
    return t


def _shared_address(t: torch.Tensor) -> tuple[str, int, int, tuple[int, int]] | None:
    """Where another process of this host maps `t` (a contiguous view of `_shared_zeros`
    memory): (path, offset in elements, elements, the memory's (device, inode) to check the path
    against); None for ordinary memory."""
    storage = t.untyped_storage()
    fd = getattr(storage, "_ntp_fd", None)
    if fd is None or t.numel() == 0:
        return None
    st = os.fstat(fd)
    return f"/proc/{os.getpid()}/fd/{fd}", int(t.storage_offset()), t.numel(), (st.st_dev, st.st_ino)


def _map_shared(where: tuple[str, int, int, tuple[int, int]], dtype: torch.dtype) -> torch.Tensor | None:
    """Map another process's `_shared_address`; None if this process cannot, or if the path
    leads to other memory than the one named (then the pair keeps to messages)."""
    path, offset, n, ident = where
    try:
        st = os.stat(path)
        if (st.st_dev, st.st_ino) != tuple(ident):
            return None
        return torch.from_file(path, shared=True, size=offset + n, dtype=dtype)[offset:]
    except (OSError, RuntimeError):
        return None


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape are the same memory."""
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def _wait(reqs: list[Any]) -> None:
    for r in reqs:
        r.wait()


def norm_share(model: nn.Module, tp_index: int) -> float:
    """Rank `tp_index`'s share of the squared L2 norm of its stage's gradient: its own units of
    every sharded parameter (each unit is held by one rank of a replica's stage; a tied weight is
    one Parameter, counted once), and the replicated parameters only on the stage's first TP rank
    (every rank of the stage holds the same). Over a stage's ranks the shares add up to the squared
    norm of the stage's whole gradient, each parameter counted once."""
    seen: set[int] = set()
    grads = []
    for mod in model.modules():
        if isinstance(mod, ShardedModule):
            for _, p, _ in mod.sharded_params():
                if id(p) not in seen:
                    seen.add(id(p))
                    if p.grad is not None:
                        grads.append(p.grad)
    if tp_index == 0:
        grads += [p.grad for p in model.parameters() if id(p) not in seen and p.grad is not None]
    if not grads:
        return 0.0
    norms = torch.stack(torch._foreach_norm(grads))  # one kernel per dtype and device, as clip_grad_norm_ does
    return float(norms.double().square().sum().item())


def global_norm(shares: Sequence[float], replicas: int) -> float:
    """The whole model's gradient norm from every rank's `NtpGradSync.norm_share` (each replica
    contributes norm^2 once). Every rank calls this on the same gathered shares and must get the
    same bits, or the clip coefficients differ and replicas drift apart. `math.fsum` is correctly
    rounded, so its result depends on the values only; torch's sum depends on the kernel that runs
    it (a strided column and a contiguous copy of the same values differ in the last bit in about a
    fifth of cases on this machine), and the kernel is chosen per host by its CPU (AVX2, AVX-512),
    which two hosts of one job need not share. Not finite (NaN, inf, or beyond float64) -> inf or
    NaN, as the shares say."""
    try:
        total = math.fsum(shares)
    except OverflowError:  # finite shares whose sum exceeds float64
        total = math.inf
    except ValueError:  # inf and -inf among them (shares are >= 0, but say so rather than raise)
        total = math.nan
    return math.sqrt(total / replicas) if total >= 0 or math.isnan(total) else math.nan


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
