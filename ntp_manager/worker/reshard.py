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
from torch import nn

from ntp_manager.worker import comm
from ntp_manager.worker.comm import P2P
from ntp_manager.worker.sync import SyncLayout
from ntp_manager.worker.tp import ShardedModule, unit_major_empty, unit_slice

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
    return [(p, m) for p, m in model.named_modules() if isinstance(m, ShardedModule) and p in families]


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the stretches where both position lists go up by one."""
    out: list[tuple[int, int, int]] = []
    for a, b in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == a and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((a, b, 1))
    return out


def _copy_units(dst: torch.Tensor, src: torch.Tensor, dim: int, usize: int, src_pos: list[int],
                dst_pos: list[int]) -> None:
    """dst's units at `dst_pos` = src's units at `src_pos`, one slice copy per contiguous stretch."""
    for a, b, n in _runs(src_pos, dst_pos):
        dst.narrow(dim, b * usize, n * usize).copy_(src.narrow(dim, a * usize, n * usize))


def apply_reshard(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    old: SyncLayout,
    new: SyncLayout,
    alive: set[int],
    rank: int,
    families: Mapping[str, str],
    tp_group: Any,
    group: Any = None,
) -> torch.optim.Optimizer:
    """Move shards and optimizer state to the new layout; returns a new optimizer (same class and
    hyperparameters) over the rebuilt parameters. Every rank of `group` (the process group the
    messages run on; None: the default group) calls it; ranks not in `new` only serve as sources.

    Moved: every tensor of a unit family (weights, column-wise biases, their optimizer state).
    Tensors whose unit list does not change stay where they are; the others are rebuilt with slice
    copies (one per stretch of consecutive units), and messages go straight from and into the
    tensors: new tensors are unit-major like the shards (tp.py), so every slice is contiguous."""
    if len(optimizer.param_groups) != 1:
        raise ValueError("resharding supports optimizers with one parameter group")
    moves = reshard_moves(old, new, alive)
    mods = _sharded_modules(model, families)
    state = optimizer.state
    # a tied weight (one Parameter in two shards) moves with its first holder only
    first: dict[int, tuple[str, str]] = {}
    for path, mod in mods:
        for name, p, _ in mod.sharded_params():
            first.setdefault(id(p), (path, name))
    owner = {(path, name) for path, name in first.values()}

    def tensors_of(path: str, mod: ShardedModule) -> list[tuple[str, torch.Tensor, int]]:
        out = []
        for name, p, dim in mod.sharded_params():
            if (path, name) not in owner:
                continue
            out.append((name, p.detach(), dim))
            st = state.get(p, {})
            out += [(f"{name}.{k}", st[k], dim) for k in STATE_KEYS if k in st]
        return out

    # every sharded tensor of a family, in module order (the same on every rank)
    fam_tensors: dict[str, list[tuple[Any, str, torch.Tensor, int]]] = {f: [] for f in new.units}
    for path, mod in mods:
        fam_tensors[families[path]] += [(mod, name, t, dim) for name, t, dim in tensors_of(path, mod)]

    in_new = _in(new, rank)
    new_units = new.units_of(rank) if in_new else {}
    # the new tensors: a tensor whose unit list does not change is kept as it is
    new_tensors: dict[str, list[torch.Tensor]] = {}
    for f, entries in fam_tensors.items() if in_new else ():
        target = new_units[f]
        new_tensors[f] = []
        for mod, _, t, dim in entries:
            if rank in alive and list(mod.units) == list(target):
                new_tensors[f].append(t)
                continue
            shape = list(t.shape)
            shape[dim] = len(target) * mod.unit_size
            new_tensors[f].append(unit_major_empty(shape, dim, t))

    # Messages first, so that they move while the local copies run. A move is cut into stretches
    # of units that are consecutive both in the source's old list and in the destination's new
    # one (both sides compute the same cut from the layouts); each stretch of each tensor is one
    # message, sent from and received into the tensors themselves where the slice is contiguous.
    ops: list[P2P] = []
    for mv in moves:
        if mv.src == mv.dst or rank not in (mv.src, mv.dst):
            continue
        spos = {u: i for i, u in enumerate(old.units_of(mv.src)[mv.family])}
        dpos = {u: i for i, u in enumerate(new.units_of(mv.dst)[mv.family])}
        for a, b, n in _runs([spos[u] for u in mv.units], [dpos[u] for u in mv.units]):
            for k, (mod, _, t, dim) in enumerate(fam_tensors[mv.family]):
                us = mod.unit_size
                if mv.src == rank:
                    msg = unit_slice(t, dim, a * us, n * us).contiguous()
                    ops.append(P2P(True, msg, mv.dst))
                else:
                    view = unit_slice(new_tensors[mv.family][k], dim, b * us, n * us)
                    assert view.is_contiguous()  # received into a tensor made unit-major above
                    ops.append(P2P(False, view, mv.src))
    reqs = comm.exchange(ops, group)  # on NCCL one group call: no order of moves can deadlock
    if in_new and rank in alive:
        for f, entries in fam_tensors.items():
            tpos = {u: i for i, u in enumerate(new_units[f])}
            for (mod, _, t, dim), nt in zip(entries, new_tensors[f], strict=True):
                if nt is t:
                    continue
                pos = {u: i for i, u in enumerate(mod.units)}
                kept = [u for u in new_units[f] if u in pos]
                _copy_units(nt, t, dim, mod.unit_size, [pos[u] for u in kept], [tpos[u] for u in kept])
    for r in reqs:
        r.wait()

    if not in_new:
        return optimizer

    # rebuild the sharded modules and the optimizer state from the new tensors
    new_state: dict[nn.Parameter, dict[str, Any]] = {}
    step = next((s["step"] for s in state.values() if "step" in s), None)
    made = {f: iter(ts) for f, ts in new_tensors.items()}
    rebuilt: dict[int, nn.Parameter] = {}  # id of an old Parameter -> its rebuilt one (tied weights)
    for path, mod in mods:
        fam = families[path]
        units = new_units[fam]
        pieces = {name: next(made[fam]) for name, _, _ in tensors_of(path, mod)}
        olds = {name: p for name, p, _ in mod.sharded_params()}
        fresh = mod.with_units(units, {name: pieces[name] if name in pieces else rebuilt[id(p)]
                                       for name, p in olds.items()}, tp_group)
        for pname, p, _ in fresh.sharded_params():
            if pname not in pieces:
                continue  # the tied weight's first holder has its state already
            rebuilt[id(olds[pname])] = p
            st = {k: pieces[f"{pname}.{k}"] for k in STATE_KEYS if f"{pname}.{k}" in pieces}
            if st and step is not None:
                st["step"] = step.clone() if isinstance(step, torch.Tensor) else step
            if st:
                new_state[p] = st
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, name, fresh)
    for mod in model.modules():
        if isinstance(mod, ShardedModule):
            mod.group = tp_group
    # the same optimizer object: its one parameter group now lists the rebuilt parameters;
    # replicated parameters keep their state, sharded ones get the moved state
    params = list(model.parameters())
    moved: defaultdict[torch.Tensor, Any] = defaultdict(dict)  # the type of torch's Optimizer.state
    for p in params:
        if p in new_state:
            moved[p] = new_state[p]
        elif p in state:
            moved[p] = state[p]
    optimizer.param_groups[0]["params"] = params
    optimizer.state = moved
    return optimizer
