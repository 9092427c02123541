"""Resharding parameters and optimizer state between two layouts of a stage.

`reshard_moves(old, new, alive)` is pure: for every surviving rank it lists where each unit it must
hold under the new layout comes from. A unit is taken, in order of preference, from the rank itself,
from a surviving TP peer of its old replica, or from a surviving rank of another replica (a DP
peer: every replica holds every unit, so a failed rank's shards always have a live copy while one
replica of the stage survives). Moves between different ranks are grouped per (source,
destination, family).

`apply_reshard` executes the moves with point-to-point sends over the current process group and
rebuilds the sharded modules and the optimizer state (SGD momentum, Adam/AdamW moments and step)
for the new unit lists. Replicated parameters and their state are untouched.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ntp_manager.worker.sync import SyncLayout
from ntp_manager.worker.tp import ColwiseLinear, RowwiseLinear

STATE_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Move:
    src: int
    dst: int
    family: str
    units: tuple[int, ...]


def reshard_moves(old: SyncLayout, new: SyncLayout, alive: set[int]) -> list[Move]:
    """Raises ValueError when some unit has no surviving holder."""
    holders: dict[str, dict[int, list[tuple[int, int]]]] = {f: {} for f in new.units}  # unit -> [(replica, rank)]
    for ri, rep in enumerate(old.replicas):
        for rank in rep.ranks:
            if rank not in alive:
                continue
            for f, units in old.units_of(rank).items():
                for u in units:
                    holders[f].setdefault(u, []).append((ri, rank))
    moves: dict[tuple[int, int, str], list[int]] = {}
    for rep in new.replicas:
        for rank in rep.ranks:
            mine_old = old.units_of(rank) if _in(old, rank) and rank in alive else {}
            old_replica = old.locate(rank)[0] if _in(old, rank) else -1
            for f, units in new.units_of(rank).items():
                have = set(mine_old.get(f, ()))
                for u in units:
                    if u in have:
                        continue
                    cands = holders[f].get(u)
                    if not cands:
                        raise ValueError(f"unit {u} of {f!r} has no surviving holder")
                    same = [r for ri, r in cands if ri == old_replica]
                    src = same[0] if same else min(r for _, r in cands)
                    moves.setdefault((src, rank, f), []).append(u)
    return [Move(s, d, f, tuple(us)) for (s, d, f), us in sorted(moves.items())]


def _in(layout: SyncLayout, rank: int) -> bool:
    return any(rank in r.ranks for r in layout.replicas)


def _sharded_modules(model: nn.Module, families: Mapping[str, str]) -> list[tuple[str, Any]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m, ColwiseLinear | RowwiseLinear)
            and p in families]


def _unit_rows(t: torch.Tensor, dim: int, n_units: int) -> torch.Tensor:
    return t.movedim(dim, 0).reshape(n_units, -1)


def _from_rows(rows: torch.Tensor, like_shape: list[int], dim: int, n_units: int, unit_size: int) -> torch.Tensor:
    shape = list(like_shape)
    shape[dim] = n_units * unit_size
    moved = [shape[dim], *[s for i, s in enumerate(shape) if i != dim]]
    return rows.reshape(moved).movedim(0, dim).contiguous()


def apply_reshard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    old: SyncLayout,
    new: SyncLayout,
    alive: set[int],
    rank: int,
    families: Mapping[str, str],
    tp_group: Any,
) -> torch.optim.Optimizer:
    """Move shards and optimizer state to the new layout; returns a new optimizer (same class and
    hyperparameters) over the rebuilt parameters. Every rank of the current process group calls it;
    ranks not in `new` only serve as sources."""
    if len(optimizer.param_groups) != 1:
        raise ValueError("resharding supports optimizers with one parameter group")
    moves = reshard_moves(old, new, alive)
    mods = _sharded_modules(model, families)
    state = optimizer.state

    def tensors_of(mod: Any) -> list[tuple[str, torch.Tensor, int]]:
        dim = 0 if isinstance(mod, ColwiseLinear) else 1
        out = [("weight", mod.weight.detach(), dim)]
        st = state.get(mod.weight, {})
        out += [(f"weight.{k}", st[k], dim) for k in STATE_KEYS if k in st]
        if isinstance(mod, ColwiseLinear) and mod.bias is not None:
            out.append(("bias", mod.bias.detach(), 0))
            bst = state.get(mod.bias, {})
            out += [(f"bias.{k}", bst[k], 0) for k in STATE_KEYS if k in bst]
        return out

    # one [units held, features] matrix per family on this rank: every sharded tensor side by side
    def family_matrix(fam: str) -> tuple[torch.Tensor, list[int]]:
        units = list(getattr(next((m for p, m in mods if families[p] == fam), None), "units", []))
        cols = [
            _unit_rows(t, dim, len(units)) for p, m in mods if families[p] == fam for _, t, dim in tensors_of(m)
        ]
        mat = torch.cat(cols, dim=1) if cols else torch.zeros(len(units), 0)
        return mat, units

    mats = {f: family_matrix(f) for f in new.units}
    in_new = _in(new, rank)
    new_units = new.units_of(rank) if in_new else {}
    new_mats: dict[str, torch.Tensor] = {}
    reqs = []
    for f in new.units:
        mat, units = mats[f]
        pos = {u: i for i, u in enumerate(units)}
        if in_new:
            target = new_units[f]
            nm = torch.empty(len(target), mat.shape[1], dtype=mat.dtype, device=mat.device)
            tpos = {u: i for i, u in enumerate(target)}
            for u in target:
                if u in pos and rank in alive:
                    nm[tpos[u]] = mat[pos[u]]
            new_mats[f] = nm
        for mv in moves:
            if mv.family != f:
                continue
            if mv.src == rank and mv.dst != rank:
                reqs.append(dist.isend(torch.stack([mat[pos[u]] for u in mv.units]).contiguous(), dst=mv.dst))
            elif mv.dst == rank and mv.src != rank:
                buf = torch.empty(len(mv.units), mat.shape[1], dtype=mat.dtype, device=mat.device)
                reqs.append((dist.irecv(buf, src=mv.src), buf, mv.units, f))  # type: ignore[arg-type]
    received = []
    for r in reqs:
        if isinstance(r, tuple):
            r[0].wait()
            received.append(r)
        else:
            r.wait()
    for _, buf, units, fam in received:
        tpos = {u: i for i, u in enumerate(new_units[fam])}
        for k, u in enumerate(units):
            new_mats[fam][tpos[u]] = buf[k]

    if not in_new:
        return optimizer

    # rebuild the sharded modules and the optimizer state from the new matrices
    new_state: dict[nn.Parameter, dict[str, Any]] = {}
    step = next((s["step"] for s in state.values() if "step" in s), None)
    col = dict.fromkeys(new.units, 0)
    for path, mod in mods:
        fam = families[path]
        units = new_units[fam]
        pieces = {}
        for name, t, dim in tensors_of(mod):
            width = _unit_rows(t, dim, len(mod.units)).shape[1]
            rows = new_mats[fam][:, col[fam] : col[fam] + width]
            col[fam] += width
            pieces[name] = _from_rows(rows, list(t.shape), dim, len(units), mod.unit_size)
        cls = type(mod)
        fresh = cls.__new__(cls)
        nn.Module.__init__(fresh)
        fresh.weight = nn.Parameter(pieces["weight"])
        if isinstance(mod, ColwiseLinear):
            fresh.bias = nn.Parameter(pieces["bias"]) if "bias" in pieces else None
        else:
            fresh.bias = mod.bias  # replicated
        fresh.units, fresh.unit_size, fresh.group = list(units), mod.unit_size, tp_group
        for pname in ("weight", "bias") if isinstance(mod, ColwiseLinear) else ("weight",):
            p = getattr(fresh, pname)
            if p is None:
                continue
            st = {k: pieces[f"{pname}.{k}"] for k in STATE_KEYS if f"{pname}.{k}" in pieces}
            if st and step is not None:
                st["step"] = step.clone() if isinstance(step, torch.Tensor) else step
            if st:
                new_state[p] = st
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, name, fresh)
    for mod in model.modules():
        if isinstance(mod, RowwiseLinear):
            mod.group = tp_group
    # the same optimizer object: its one parameter group now lists the rebuilt parameters;
    # replicated parameters keep their state, sharded ones get the moved state
    params = list(model.parameters())
    moved: defaultdict[nn.Parameter, dict[str, Any]] = defaultdict(dict)
    for p in params:
        if p in new_state:
            moved[p] = new_state[p]
        elif p in state:
            moved[p] = state[p]
    optimizer.param_groups[0]["params"] = params
    optimizer.state = moved
    return optimizer
