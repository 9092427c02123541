"""What the runtime can do with an optimizer, checked before the first step, and the optimizer
values that are not tensors: every parameter group's hyperparameters and an LR scheduler's state.

The runtime moves optimizer state between layouts (reshard.py), to ranks that join or change
pipeline stage (a fresh optimizer from `optimizer_fn`, filled from a peer) and through checkpoints.
That is exact only for state it understands: per parameter, tensors shaped like the parameter
(`STATE_KEYS`) and a step count. SGD (momentum, Nesterov, dampening), Adam and AdamW (amsgrad
too) keep exactly that; anything else is refused here, at set-up, rather than losing state at the
first failure.

A fresh optimizer starts from `optimizer_fn`'s hyperparameters, while its peers may have had
their learning rate moved by a schedule: `group_values` / `set_group_values` carry every group's
values (all but its parameters) from a peer or a checkpoint, and `pack_values` carries them
together with the scheduler's state, so every rank always steps with the same values."""

from __future__ import annotations

import json
import pickle
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ntp_manager.worker.reshard import STATE_KEYS

SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class OptimizerError(ValueError):
    """An optimizer (or scheduler) the runtime cannot carry through reshards and checkpoints exactly."""


def check_optimizer(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    """Refuse, naming what and why, an optimizer whose state the runtime could not move exactly,
    or whose parameter groups it could not keep: call it on the first optimizer `optimizer_fn`
    makes, before any step."""
    kind = type(opt)
    if kind not in SUPPORTED:
        raise OptimizerError(
            f"{kind.__name__} is not supported by the runtime: it moves optimizer state between layouts "
            f"and checkpoints only for SGD, Adam and AdamW, whose per-parameter state is tensors shaped like "
            f"the parameter ({', '.join(STATE_KEYS)}, max_exp_avg_sq) and a step count; other state could "
            "not be cut by units, and would be lost at the first reshard")
    if opt.state:
        raise OptimizerError("optimizer_fn must return a fresh optimizer (this one has state already)")
    # a parameter in no group stays in none through every reshard (frozen by the user)
    ours = {id(p): n for n, p in model.named_parameters()}
    for i, group in enumerate(opt.param_groups):
        for p in group["params"]:
            if id(p) not in ours:
                raise OptimizerError(f"parameter group {i} holds a tensor that is not a parameter of the model "
                                     "the runtime gave optimizer_fn")
        for key, value in group.items():
            if key == "params":
                continue
            if key == "differentiable" and value:
                raise OptimizerError(f"parameter group {i}: differentiable=True keeps the optimizer's update in "
                                     "the autograd graph, which a reshard cannot carry")
            if isinstance(value, torch.Tensor):
                raise OptimizerError(f"parameter group {i}: {key} is a tensor; give it as a number, so that it "
                                     "can be carried to other ranks and into checkpoints")
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):
                raise OptimizerError(f"parameter group {i}: {key}={value!r} is not a plain value (number, bool, "
                                     "string, list); checkpoints store every hyperparameter as JSON") from None


def check_scheduler(scheduler: Any, opt: torch.optim.Optimizer) -> None:
    """Refuse a scheduler the runtime would step wrongly: one bound to another optimizer (a rank
    whose optimizer is replaced would move the old one's learning rate, silently), or one whose
    `step()` needs an argument the runtime does not have (ReduceLROnPlateau's metric: it would
    fail at the first committed step)."""
    if scheduler is None:
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise OptimizerError("ReduceLROnPlateau is not supported: the runtime steps the scheduler after every "
                             "committed step without arguments, and it needs the metric to step on")
    bound = getattr(scheduler, "optimizer", None)
    if bound is not opt:
        raise OptimizerError(f"scheduler_fn returned a {type(scheduler).__name__} bound to "
                             f"{'no' if bound is None else 'another'} optimizer: build it on the optimizer "
                             "scheduler_fn is given (never on rt.optimizer or one kept from earlier)")


def group_values(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every parameter group's values but its parameters, and how many parameters it holds."""
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": len(g["params"])} for g in opt.param_groups]


def check_group_values(opt: torch.optim.Optimizer, values: Sequence[dict[str, Any]], where: str) -> None:
    """Raise OptimizerError unless `values` fit `opt`'s groups (`set_group_values`), changing nothing."""
    mine = opt.param_groups
    if len(values) != len(mine) or any(v.get("params", len(g["params"])) != len(g["params"])
                                       for v, g in zip(values, mine, strict=False)):
        raise OptimizerError(
            f"optimizer_fn made groups of {[len(g['params']) for g in mine]} parameters here but {where} has "
            f"{[v.get('params') for v in values]}: a parameter's group must not depend on the rank or layout")


def set_group_values(opt: torch.optim.Optimizer, values: Sequence[dict[str, Any]], where: str) -> None:
    """Give `opt`'s groups `values` (from `group_values` of a peer's optimizer for the same stage,
    or a checkpoint's). Raises OptimizerError where the groups do not correspond: `optimizer_fn`
    must put a parameter in a group by something every rank and layout agrees on (its name, its
    number of dimensions), never by its shard's shape."""
    check_group_values(opt, values, where)
    for v, g in zip(values, opt.param_groups, strict=True):
        for k, x in v.items():
            if k == "params":
                continue
            old = g.get(k)
            g[k] = tuple(x) if isinstance(old, tuple) and isinstance(x, list) else x  # JSON has no tuples


def pack_values(opt: torch.optim.Optimizer, scheduler: Any) -> torch.Tensor:
    """The groups' values and the scheduler's state as bytes in a uint8 tensor (for a peer of the
    same job: it is unpickled there)."""
    blob = pickle.dumps({"groups": group_values(opt),
                         "scheduler": scheduler.state_dict() if scheduler is not None else None})
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


def unpack_values(data: torch.Tensor, opt: torch.optim.Optimizer, scheduler: Any, where: str) -> None:
    doc = pickle.loads(data.numpy().tobytes())
    set_group_values(opt, doc["groups"], where)
    load_scheduler(scheduler, doc["scheduler"], where)


def check_scheduler_state(scheduler: Any, state: dict[str, Any] | None, where: str) -> None:
    """Raise OptimizerError unless `state` fits `scheduler` (both or neither), changing nothing."""
    if (scheduler is None) != (state is None):
        raise OptimizerError(f"{where} {'has' if state is not None else 'has no'} LR scheduler state but this "
                             f"rank {'has no' if scheduler is None else 'has a'} scheduler: give every rank the "
                             "same scheduler_fn")


def load_scheduler(scheduler: Any, state: dict[str, Any] | None, where: str) -> None:
    check_scheduler_state(scheduler, state, where)
    if scheduler is not None:
        scheduler.load_state_dict(state)


def scheduler_json(scheduler: Any) -> dict[str, Any] | None:
    """The scheduler's state as a JSON document, for a checkpoint's manifest."""
    if scheduler is None:
        return None
    state = scheduler.state_dict()
    try:
        json.dumps(state, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise OptimizerError(f"{type(scheduler).__name__}'s state is not JSON ({e}); checkpoints store the "
                             "scheduler's state in their manifest") from None
    return dict(state)
