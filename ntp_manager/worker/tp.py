"""Nonuniform tensor parallelism for an unmodified torch model, from a plan of module names.

    plan = {
        "blocks.*.attn.q": ColwiseUnits("heads", unit_size=head_dim),
        "blocks.*.attn.k": ColwiseUnits("heads", unit_size=head_dim),
        "blocks.*.attn.v": ColwiseUnits("heads", unit_size=head_dim),
        "blocks.*.attn.o": RowwiseUnits("heads", unit_size=head_dim),
        "blocks.*.mlp.up": ColwiseUnits("mlp", unit_size=1),
        "blocks.*.mlp.down": RowwiseUnits("mlp", unit_size=1),
    }
    parallelize(model, plan, units={"heads": [0, 1, 5], "mlp": [...]}, group=tp_group)

In the spirit of `torch.distributed.tensor.parallel.parallelize_module`, with one difference that
NTP needs: a rank's share is a *set of units* (attention heads or KV groups, MLP columns), which
need not be contiguous (a healthy replica's compute partition from `ntp_map`). A column-wise
Linear keeps the output features of its units (weight rows, bias entries); the matching row-wise
Linear keeps the same units' input features (weight columns) and all-reduces its output over the
TP group, so the layer's output is exact whatever the assignment. Attention that reshapes with
`view(..., -1, head_dim)` finds its local head count from the shard.

Autograd: the input of a column-wise layer is replicated, so its gradient is all-reduced in
backward (identity forward); the output of a row-wise layer is all-reduced in forward (identity
backward) -- Megatron's f and g operators.

Memory layout: every shard is stored *unit-major*, so that the features of a run of consecutive
units are one contiguous block. Column-wise weights are that way already (units along rows); a
row-wise weight (units along columns) is kept column-major: `weight` is the transpose of a
contiguous [in, out] tensor. Linear layers read it at no cost (BLAS takes either orientation) and
autograd gives its gradient the same layout; gradient sync and resharding then move unit slices
of every tensor without a gather copy. `unit_slice` gives such a slice as a contiguous tensor.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class ColwiseUnits:
    family: str  # which unit map this module follows ("heads", "mlp", ...)
    unit_size: int = 1  # output features per unit


@dataclass(frozen=True)
class RowwiseUnits:
    family: str
    unit_size: int = 1  # input features per unit


ShardStyle = ColwiseUnits | RowwiseUnits


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce the gradient over the TP group in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        if ctx.group is not None and dist.get_world_size(ctx.group) > 1:
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce over the TP group in forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def feature_index(units: Sequence[int], unit_size: int) -> torch.Tensor:
    """Feature positions of `units` (in the given order), `unit_size` features each."""
    u = torch.as_tensor(list(units), dtype=torch.long)
    return (u[:, None] * unit_size + torch.arange(unit_size)[None, :]).reshape(-1)


def unit_major_empty(shape: Sequence[int], udim: int, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of `shape` whose units (along `udim`, 0 or 1) are contiguous blocks."""
    return unit_major_view(torch.empty(math.prod(shape), dtype=like.dtype, device=like.device), shape, udim)


def unit_major_view(flat: torch.Tensor, shape: Sequence[int], udim: int) -> torch.Tensor:
    """`flat` (one contiguous 1-D block) seen as a tensor of `shape` laid out unit-major."""
    if udim == 0:
        return flat.view(*shape)
    return flat.view(shape[1], shape[0]).t()


def unit_slice(t: torch.Tensor, udim: int, start: int, length: int) -> torch.Tensor:
    """Features [start, start+length) along `udim`, oriented units-first (the transpose for
    udim 1), so that the slice is a contiguous tensor whenever `t` is unit-major. Two ranks that
    exchange a slice both orient it this way, so its bytes agree whatever each side's layout."""
    s = t.narrow(udim, start, length)
    return s if udim == 0 else s.t()


class ColwiseLinear(nn.Module):
    def __init__(self, full: nn.Linear, units: Sequence[int], unit_size: int, group: Any) -> None:
        super().__init__()
        idx = feature_index(units, unit_size)
        self.weight = nn.Parameter(full.weight.detach()[idx].clone())
        self.bias = nn.Parameter(full.bias.detach()[idx].clone()) if full.bias is not None else None
        self.units, self.unit_size, self.group = list(units), unit_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(x, self.group)
        return nn.functional.linear(x, self.weight, self.bias)


class RowwiseLinear(nn.Module):
    def __init__(self, full: nn.Linear, units: Sequence[int], unit_size: int, group: Any) -> None:
        super().__init__()
        idx = feature_index(units, unit_size)
        # column-major: the transpose of a contiguous [in, out] tensor (see the module docstring)
        self.weight = nn.Parameter(full.weight.detach()[:, idx].t().contiguous().t())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None
        self.units, self.unit_size, self.group = list(units), unit_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        y = _ReduceFromTP.apply(y, self.group)
        return y + self.bias if self.bias is not None else y


def parallelize(
    model: nn.Module, plan: Mapping[str, ShardStyle], units: Mapping[str, Sequence[int]], group: Any = None
) -> nn.Module:
    """Replace the Linear modules named by `plan` (fnmatch patterns over module paths) with their
    shards for this rank. `units[family]` lists the units this rank holds. Returns the model.

    Raises ValueError when a pattern matches nothing, a matched module is not nn.Linear, or a
    family has no unit list."""
    matched: set[str] = set()
    for path, module in list(model.named_modules()):
        for pattern, style in plan.items():
            if not fnmatch.fnmatchcase(path, pattern):
                continue
            if not isinstance(module, nn.Linear):
                raise ValueError(f"{path} matches {pattern!r} but is a {type(module).__name__}, not nn.Linear")
            if style.family not in units:
                raise ValueError(f"no unit list for family {style.family!r} (needed by {path})")
            own = units[style.family]
            feats = module.out_features if isinstance(style, ColwiseUnits) else module.in_features
            if feats % style.unit_size:
                raise ValueError(f"{path}: {feats} features are not a multiple of unit size {style.unit_size}")
            n_units = feats // style.unit_size
            if any(not 0 <= u < n_units for u in own):
                raise ValueError(f"{path}: unit index out of range 0..{n_units - 1}")
            cls = ColwiseLinear if isinstance(style, ColwiseUnits) else RowwiseLinear
            _replace(model, path, cls(module, own, style.unit_size, group))
            matched.add(pattern)
            break
    missing = set(plan) - matched
    if missing:
        raise ValueError(f"plan patterns matched no module: {sorted(missing)}")
    return model


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, new)
