"""Resharding parameters and optimizer state between two layouts of a stage.

`reshard_moves(old, new, alive)` is pure: for every surviving rank it lists where each unit it must
hold under the new layout comes from. A unit is taken, in order of preference, from the rank itself,
from a surviving TP peer of its old replica, or from a surviving rank of another replica (a DP
peer: every replica holds every unit, so a failed rank's shards always have a live copy while one
replica of the stage survives). Moves between different ranks are grouped per (source,
destination, family).

`apply_reshard` executes the moves with point-to-point messages over the current process group
(coalesced per peer pair by comm.FlatExchange: a few large messages, not one per tensor) and
rebuilds the sharded modules and the optimizer state (SGD momentum, Adam/AdamW moments, amsgrad's
maximum and step) for the new unit lists; each rebuilt parameter stays in its parameter group.
Replicated parameters and their state are untouched.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ntp_manager.contract.ntp_map import Range
from ntp_manager.worker import comm
from ntp_manager.worker.comm import P2P
from ntp_manager.worker.sync import SyncLayout
from ntp_manager.worker.tp import ShardedModule, unit_major_empty, unit_slice

# per-parameter optimizer state shaped like the parameter: SGD momentum, Adam/AdamW moments (amsgrad: max_exp_avg_sq)
STATE_KEYS = ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")


@dataclass(frozen=True)
class Move:
    src: int
    dst: int
    family: str
    units: tuple[int, ...]


def reshard_moves(old: SyncLayout, new: SyncLayout, alive: set[int]) -> list[Move]:
    """Raises ValueError when some unit has no surviving holder.

    Worked on ranges of units, not unit by unit: every rank of every stage computes this (a
    job's vocabulary alone is tens of thousands of units), and on a host whose ranks share few
    cores that work adds up. Same result as the unit-by-unit rule: per unit, the rank itself,
    else the survivor of its old replica holding it, else the lowest-numbered survivor holding
    it; units of each move ascending."""
    moves: dict[tuple[int, int, str], list[Range]] = {}
    # the survivors' ranges of each family: per old replica, and all of them
    held: dict[str, list[list[tuple[int, int, int]]]] = {}
    for f in new.units:
        held[f] = [sorted((a, b, r) for j, r in enumerate(rep.ranks) if r in alive
                          for a, b in old.unit_map(f, ri).assignment[j]) if f in old.units else []
                   for ri, rep in enumerate(old.replicas)]
    everyone = {f: sorted(h for per in held[f] for h in per) for f in new.units}
    for nri, rep in enumerate(new.replicas):
        for j, rank in enumerate(rep.ranks):
            in_old = _in(old, rank)
            ori, oj = old.locate(rank) if in_old else (-1, -1)
            for f in new.units:
                own = list(old.unit_map(f, ori).assignment[oj]) if in_old and rank in alive and f in old.units else []
                same = held[f][ori] if in_old else []
                for a, b in _subtract(list(new.unit_map(f, nri).assignment[j]), own):
                    got = _cover(a, b, same, lowest=False)
                    for x, y in _subtract([(a, b)], [(c, d) for c, d, _ in got]):
                        more = _cover(x, y, everyone[f], lowest=True)
                        gap = _subtract([(x, y)], [(c, d) for c, d, _ in more])
                        if gap:
                            raise ValueError(f"unit {gap[0][0]} of {f!r} has no surviving holder")
                        got += more
                    for x, y, src in got:
                        moves.setdefault((src, rank, f), []).append((x, y))
    return [Move(s, d, f, tuple(u for a, b in sorted(rs) for u in range(a, b)))
            for (s, d, f), rs in sorted(moves.items())]


def _subtract(ranges: list[Range], minus: list[Range]) -> list[Range]:
    """The parts of `ranges` (sorted, disjoint) outside every range of `minus`, in order."""
    out: list[Range] = []
    cuts = sorted(minus)
    for a, b in ranges:
        pos = a
        for c, d in cuts:
            if d <= pos or c >= b:
                continue
            if c > pos:
                out.append((pos, c))
            pos = max(pos, d)
            if pos >= b:
                break
        if pos < b:
            out.append((pos, b))
    return out


def _cover(a: int, b: int, holders: list[tuple[int, int, int]], lowest: bool) -> list[tuple[int, int, int]]:
    """Pieces (start, stop, rank) of [a, b) that `holders` (start, stop, rank) hold. `lowest`:
    holders may overlap, and each piece goes to the lowest rank holding it; else they are
    disjoint (one replica's ranks)."""
    hits = [(max(a, x), min(b, y), r) for x, y, r in holders if x < b and y > a]
    if not lowest:
        return sorted(hits)
    edges = sorted({e for x, y, _ in hits for e in (x, y)})
    out: list[tuple[int, int, int]] = []
    for x, y in itertools.pairwise(edges):
        ranks = [r for c, d, r in hits if c <= x and d >= y]
        if not ranks:
            continue
        r = min(ranks)
        if out and out[-1][1] == x and out[-1][2] == r:
            out[-1] = (out[-1][0], y, r)
        else:
            out.append((x, y, r))
    return out


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


def _copy_stretches(dst: torch.Tensor, src: torch.Tensor, dim: int, usize: int,
                    stretches: list[tuple[int, int, int]]) -> None:
    """For each (src start, dst start, length) stretch of units, dst's units = src's, one slice copy each."""
    for a, b, n in stretches:
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
    moves: list[Move] | None = None,
    freed: list[torch.Tensor] | None = None,
) -> torch.optim.Optimizer:
    """Move shards and optimizer state to the new layout; returns the same optimizer, each of its
    parameter groups now over the rebuilt parameters of the ones it held. Every rank of `group` (the process group the
    messages run on; None: the default group) calls it; ranks not in `new` only serve as sources.

    Moved: every tensor of a unit family (weights, column-wise biases, their optimizer state).
    Tensors whose unit list does not change stay where they are; the others are rebuilt with slice
    copies (one per stretch of consecutive units), and messages go straight from and into the
    tensors: new tensors are unit-major like the shards (tp.py), so every slice is contiguous.
    `moves`: `reshard_moves(old, new, alive)` when the caller has it already. `freed`: gets, as
    1-D views, the memory of every replaced tensor that owns its storage whole -- nothing uses it
    after this returns, and memory already touched is cheaper to reuse than fresh pages (the
    runtime gives it to the new layout's gradient buffers)."""
    if moves is None:
        moves = reshard_moves(old, new, alive)
    mods = _sharded_modules(model, families)
    if rank in alive:  # the messages below slice tensors by `old`'s unit lists: they must be what is held
        held = old.units_of(rank)
        for path, mod in mods:
            if list(mod.units) != list(held[families[path]]):
                raise ValueError(f"rank {rank}'s {path} holds units {list(mod.units)} but the old layout gives it "
                                 f"{list(held[families[path]])}: resharding by that layout would move wrong values")
    tensors = _Tensors(mods, optimizer.state)
    # every sharded tensor of a family, in module order (the same on every rank)
    fam_tensors: dict[str, list[_Entry]] = {f: [] for f in new.units}
    for path, mod in mods:
        fam_tensors[families[path]] += [(mod, name, t, dim) for name, t, dim in tensors.of(path, mod)]

    in_new = _in(new, rank)
    new_units = new.units_of(rank) if in_new else {}
    new_tensors = _new_tensors(fam_tensors, new_units, rank in alive) if in_new else {}
    ops = _move_ops(moves, old, new, rank, fam_tensors, new_tensors)
    # coalesced: one byte stream per peer pair and direction, in bounded chunks (one message per
    # chunk; on NCCL one group call per round, so no order of moves can deadlock); else one
    # message per slice (on NCCL one group call for all)
    flat = comm.FlatExchange(ops, group).start() if comm.coalescing() else None
    reqs = comm.exchange(ops, group) if flat is None else []
    if in_new and rank in alive:
        _local_copies(fam_tensors, new_tensors, new_units)
    for r in reqs:
        r.wait()
    if flat is not None:
        flat.wait()

    if not in_new:
        return optimizer
    rebuilt, new_state = _rebuild_modules(model, mods, families, new_units, new_tensors, tensors, tp_group)
    _regroup_optimizer(model, optimizer, rebuilt, new_state)
    if freed is not None:
        for f, entries in fam_tensors.items():
            for (_, _, t, _), nt in zip(entries, new_tensors[f], strict=True):
                whole = t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()
                if nt is not t and whole:
                    freed.append(torch.as_strided(t, (t.numel(),), (1,), 0))
    return optimizer


_Entry = tuple[Any, str, torch.Tensor, int]  # (module, tensor name, tensor, unit dim)


class _Tensors:
    """The sharded tensors a module moves: its parameters and their optimizer state. A tied weight
    (one Parameter in two shards) moves with its first holder only."""

    def __init__(self, mods: list[tuple[str, ShardedModule]], state: Mapping[Any, Any]) -> None:
        self.state = state
        first: dict[int, tuple[str, str]] = {}
        for path, mod in mods:
            for name, p, _ in mod.sharded_params():
                first.setdefault(id(p), (path, name))
        self.owner = {(path, name) for path, name in first.values()}

    def of(self, path: str, mod: ShardedModule) -> list[tuple[str, torch.Tensor, int]]:
        out = []
        for name, p, dim in mod.sharded_params():
            if (path, name) not in self.owner:
                continue
            out.append((name, p.detach(), dim))
            st = self.state.get(p, {})
            out += [(f"{name}.{k}", st[k], dim) for k in STATE_KEYS if k in st]
        return out


def _new_tensors(fam_tensors: Mapping[str, list[_Entry]], new_units: Mapping[str, Sequence[int]],
                 alive: bool) -> dict[str, list[torch.Tensor]]:
    """The new tensors: a tensor whose unit list does not change is kept as it is."""
    new_tensors: dict[str, list[torch.Tensor]] = {}
    for f, entries in fam_tensors.items():
        target = new_units[f]
        new_tensors[f] = []
        for mod, _, t, dim in entries:
            if alive and list(mod.units) == list(target):
                new_tensors[f].append(t)
                continue
            shape = list(t.shape)
            shape[dim] = len(target) * mod.unit_size
            new_tensors[f].append(unit_major_empty(shape, dim, t))
    return new_tensors


def _move_ops(moves: list[Move], old: SyncLayout, new: SyncLayout, rank: int,
              fam_tensors: Mapping[str, list[_Entry]], new_tensors: Mapping[str, list[torch.Tensor]]) -> list[P2P]:
    """Messages first, so that they move while the local copies run. A move is cut into stretches
    of units that are consecutive both in the source's old list and in the destination's new
    one (both sides compute the same cut from the layouts); each stretch of each tensor is one
    message, sent from and received into the tensors themselves where the slice is contiguous."""
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
    return ops


def _local_copies(fam_tensors: Mapping[str, list[_Entry]], new_tensors: Mapping[str, list[torch.Tensor]],
                  new_units: Mapping[str, Sequence[int]]) -> None:
    """The units a rank keeps, copied from its old tensors into its new ones."""
    for f, entries in fam_tensors.items():
        tpos = {u: i for i, u in enumerate(new_units[f])}
        stretches: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}  # a family's modules share units
        for (mod, _, t, dim), nt in zip(entries, new_tensors[f], strict=True):
            if nt is t:
                continue
            key = tuple(mod.units)
            if key not in stretches:
                pos = {u: i for i, u in enumerate(key)}
                kept = [u for u in new_units[f] if u in pos]
                stretches[key] = _runs([pos[u] for u in kept], [tpos[u] for u in kept])
            _copy_stretches(nt, t, dim, mod.unit_size, stretches[key])


def _rebuild_modules(
    model: nn.Module, mods: list[tuple[str, ShardedModule]], families: Mapping[str, str],
    new_units: Mapping[str, Sequence[int]], new_tensors: Mapping[str, list[torch.Tensor]], tensors: _Tensors,
    tp_group: Any,
) -> tuple[dict[int, nn.Parameter], dict[nn.Parameter, dict[str, Any]]]:
    """Rebuild the sharded modules and their optimizer state from the new tensors. Returns (id of
    an old Parameter -> its rebuilt one, rebuilt Parameter -> its moved state)."""
    state = tensors.state
    new_state: dict[nn.Parameter, dict[str, Any]] = {}
    step = next((s["step"] for s in state.values() if "step" in s), None)
    made = {f: iter(ts) for f, ts in new_tensors.items()}
    rebuilt: dict[int, nn.Parameter] = {}  # id of an old Parameter -> its rebuilt one (tied weights)
    for path, mod in mods:
        fam = families[path]
        units = new_units[fam]
        pieces = {name: next(made[fam]) for name, _, _ in tensors.of(path, mod)}
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
    for m in model.modules():
        if isinstance(m, ShardedModule):
            m.group = tp_group
    return rebuilt, new_state


def _regroup_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, rebuilt: Mapping[int, nn.Parameter],
                       new_state: Mapping[nn.Parameter, dict[str, Any]]) -> None:
    """The same optimizer object: each parameter group now lists the rebuilt parameters of the old
    ones it held, in the model's order (a parameter in no group stays in none); replicated
    parameters keep their state, sharded ones get the moved state."""
    state = optimizer.state
    old_of = {id(p): old for old, p in rebuilt.items()}
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    groups: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
    moved: defaultdict[torch.Tensor, Any] = defaultdict(dict)  # the type of torch's Optimizer.state
    for p in model.parameters():
        i = group_of.get(old_of.get(id(p), id(p)))
        if i is None:
            continue
        groups[i].append(p)
        if p in new_state:
            moved[p] = new_state[p]
        elif p in state:
            moved[p] = state[p]
    for g, ps in zip(optimizer.param_groups, groups, strict=True):
        g["params"] = ps
    optimizer.state = moved
