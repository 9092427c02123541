"""NTP gradient synchronisation between DP replicas of different TP degrees (REFERENCE.md section 1).

For each unit family (heads, MLP columns) every sharded gradient is viewed as a matrix with one
row per unit the rank holds (the sharded dimension moved first, the rest flattened); a family's
parameters are concatenated column-wise, so every exchange below is a block of rows.

1. Pre-sync: each extra rank (TP index >= sync degree) sends the rows of the units it borrowed
   back to their core rank (`ntp_map(...).transfers`, point-to-point inside the replica), so core
   rank i holds the gradient of all of sync chunk i.
2. DP sync: one all-reduce per sync index i, over {core rank i of every replica}, of the flattened
   chunk buffers of every family (one bucket). Each replica's gradient is a mean over its own
   local batch, so it is weighted by its local batch and the sum divided by the global batch:
   gradients are averaged by sample count, not by replica count.
3. Post-sync: core ranks send the synced rows back to the extras.
Parameters that are not sharded (embeddings, norms, row-wise biases) are replicated inside a TP
group; one all-reduce over every rank, each contributing local_batch / tp_degree of its gradient,
gives the same sample-weighted mean.

Uniform replicas (all the same degree) have no transfers: the procedure degenerates to a bucketed
all-reduce per TP index plus one for the replicated parameters.
"""

from __future__ import annotations

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


class NtpGradSync:
    """Create on every rank of the job (it creates process groups, collectively), after
    `parallelize(model, plan, layout.units_of(rank), group=tp_group)`."""

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
        self.sharded: dict[str, list[tuple[nn.Parameter, int]]] = {f: [] for f in layout.units}
        sharded_ids: set[int] = set()
        for path, mod in model.named_modules():
            if isinstance(mod, ColwiseLinear | RowwiseLinear):
                fam = families[path]
                self.sharded[fam].append((mod.weight, 0 if isinstance(mod, ColwiseLinear) else 1))
                sharded_ids.add(id(mod.weight))
                if isinstance(mod, ColwiseLinear) and mod.bias is not None:
                    self.sharded[fam].append((mod.bias, 0))
                    sharded_ids.add(id(mod.bias))
        self.replicated = [p for p in model.parameters() if id(p) not in sharded_ids]

    # ---- unit-row views ----------------------------------------------------------------------
    def _rows(self, fam: str) -> tuple[torch.Tensor, list[tuple[nn.Parameter, int, int, int]]]:
        """The family's gradients as one [units held, features] matrix, and how to undo it."""
        n_local = len(self.maps[fam].units_of(self.tp_index))
        parts, layout = [], []
        for p, dim in self.sharded[fam]:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            g = g.movedim(dim, 0).contiguous()
            m = g.reshape(n_local, -1)
            layout.append((p, dim, m.shape[1], 0))
            parts.append(m)
        return torch.cat(parts, dim=1) if parts else torch.zeros(n_local, 0), layout

    def _write_rows(self, rows: torch.Tensor, layout: list[tuple[nn.Parameter, int, int, int]]) -> None:
        col = 0
        for p, dim, width, _ in layout:
            block = rows[:, col : col + width]
            col += width
            shape = list(p.shape)
            moved = [shape[dim], *[s for i, s in enumerate(shape) if i != dim]]
            g = block.reshape(moved).movedim(0, dim).contiguous()
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)

    # ---- the sync ------------------------------------------------------------------------------
    def sync(self) -> None:
        if not self.active:
            return
        lb = self.layout.replicas[self.replica].local_batch
        gb = self.layout.global_batch
        my = self.layout.replicas[self.replica].ranks
        j = self.tp_index
        core = j < self.n_sync
        fams = list(self.layout.units)
        mats = {f: self._rows(f) for f in fams}

        chunks: dict[str, torch.Tensor] = {}
        reqs = []
        for f in fams:
            m, (rows, _) = self.maps[f], mats[f]
            if core:
                a, b = m.sync_chunks[j]
                buf = torch.empty(b - a, rows.shape[1], dtype=rows.dtype, device=rows.device)
                keep = m.load(j)
                buf[:keep] = rows[:keep]
                for t in m.transfers:
                    if t.core == j:
                        reqs.append(dist.irecv(buf[t.start - a : t.stop - a], src=my[t.extra]))
                chunks[f] = buf
            else:
                pos = {u: i for i, u in enumerate(m.units_of(j))}
                for t in m.transfers:
                    if t.extra == j:
                        i0 = pos[t.start]
                        reqs.append(dist.isend(rows[i0 : i0 + t.count].contiguous(), dst=my[t.core]))
        for r in reqs:
            r.wait()

        if core:
            flat = torch.cat([chunks[f].reshape(-1) for f in fams]) * lb
            dist.all_reduce(flat, group=self.dp_groups[j])
            self.bytes_all_reduced += flat.numel() * flat.element_size()
            flat /= gb
            off = 0
            for f in fams:
                n = chunks[f].numel()
                chunks[f] = flat[off : off + n].reshape(chunks[f].shape)
                off += n

        reqs = []
        for f in fams:
            m, (rows, _) = self.maps[f], mats[f]
            if core:
                a, _b = m.sync_chunks[j]
                for t in m.transfers:
                    if t.core == j:
                        reqs.append(dist.isend(chunks[f][t.start - a : t.stop - a].contiguous(), dst=my[t.extra]))
                rows[: m.load(j)] = chunks[f][: m.load(j)]
            else:
                pos = {u: i for i, u in enumerate(m.units_of(j))}
                for t in m.transfers:
                    if t.extra == j:
                        i0 = pos[t.start]
                        reqs.append(dist.irecv(rows[i0 : i0 + t.count], src=my[t.core]))
        for r in reqs:
            r.wait()
        for f in fams:
            self._write_rows(*mats[f])

        if self.replicated:
            t = len(my)
            flat = torch.cat([
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in self.replicated
            ]) * (lb / t)
            dist.all_reduce(flat, group=self.layout_group)
            self.bytes_all_reduced += flat.numel() * flat.element_size()
            flat /= gb
            off = 0
            for p in self.replicated:
                n = p.numel()
                g = flat[off : off + n].reshape(p.shape)
                off += n
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)


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
