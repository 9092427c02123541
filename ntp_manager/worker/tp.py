"""Nonuniform tensor parallelism for an unmodified torch model, from a plan of module names.

    plan = {
        "blocks.*.attn.q": ColwiseUnits("heads", unit_size=head_dim),
        "blocks.*.attn.k": ColwiseUnits("heads", unit_size=head_dim),
        "blocks.*.attn.v": ColwiseUnits("heads", unit_size=head_dim),
        "blocks.*.attn.o": RowwiseUnits("heads", unit_size=head_dim),
        "blocks.*.mlp.up": ColwiseUnits("mlp", unit_size=1),
        "blocks.*.mlp.down": RowwiseUnits("mlp", unit_size=1),
        "tok": RowwiseUnits("vocab", unit_size=1),                     # nn.Embedding, by rows
        "head": ColwiseUnits("vocab", unit_size=1, gather_output=True),  # LM head, whole logits out
    }
    parallelize(model, plan, units={"heads": [0, 1, 5], "mlp": [...], "vocab": [...]}, group=tp_group)

In the spirit of `torch.distributed.tensor.parallel.parallelize_module`, with one difference that
NTP needs: a rank's share is a *set of units* (attention heads or KV groups, MLP columns), which
need not be contiguous (a healthy replica's compute partition from `ntp_map`). A column-wise
Linear keeps the output features of its units (weight rows, bias entries); the matching row-wise
Linear keeps the same units' input features (weight columns) and all-reduces its output over the
TP group, so the layer's output is exact whatever the assignment. Attention that reshapes with
`view(..., -1, head_dim)` finds its local head count from the shard.

The vocabulary is a unit family too: a row-wise nn.Embedding keeps its units' rows, looks up only
the tokens it holds and all-reduces (Megatron's vocab-parallel embedding); a column-wise LM head
with `gather_output` computes its units' logits and gives the whole logits tensor back, so the
model's own loss runs unchanged (replicated) on every rank. Without it every rank would hold,
update and all-reduce the embedding and head whole -- at vocab 8192 and d_model 1024, 17M of a
118M model's ~42M parameters per TP4 rank.

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
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class ColwiseUnits:
    family: str  # which unit map this module follows ("heads", "mlp", "vocab", ...)
    unit_size: int = 1  # output features per unit
    gather_output: bool = False  # give the whole output, not the rank's features (an LM head)


@dataclass(frozen=True)
class RowwiseUnits:
    family: str
    unit_size: int = 1  # input features per unit (vocabulary entries for an nn.Embedding)


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


class _GatherFromTP(torch.autograd.Function):
    """Forward: the whole output, each rank's features placed at `index` of a zero tensor and the
    TP group's all-reduce filling the rest (any unit lists, no padding). Backward: the rank's
    features of the gradient, which is the same on every rank of the group because everything
    after the gather runs replicated."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, index: torch.Tensor, features: int, group: Any) -> torch.Tensor:
        ctx.save_for_backward(index)
        full = y.new_zeros(*y.shape[:-1], features)
        full.index_copy_(-1, index, y)
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(full, group=group)
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (index,) = ctx.saved_tensors
        return grad.index_select(-1, index), None, None, None


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


class ShardedModule(nn.Module):
    """A rank's shard of a module: the units it holds of one family (`units`, `unit_size` features
    each) and its TP group. `UNIT_DIMS` names the parameters that are sharded and the dimension
    their units run along; any other parameter is replicated inside the TP group. The gradient
    sync and the reshard see shards only through this interface."""

    UNIT_DIMS: ClassVar[dict[str, int]] = {}
    units: list[int]
    unit_size: int
    group: Any

    def sharded_params(self) -> list[tuple[str, nn.Parameter, int]]:
        """(name, parameter, unit dim) of every sharded parameter, in a fixed order."""
        out = []
        for name, dim in self.UNIT_DIMS.items():
            p = getattr(self, name)
            if p is not None:
                out.append((name, p, dim))
        return out

    def with_units(self, units: Sequence[int], tensors: Mapping[str, torch.Tensor], group: Any) -> ShardedModule:
        """A new shard of the same module holding `units`, whose sharded parameters are `tensors`
        (by name, already shaped for `units`); replicated parameters are shared with this one."""
        fresh = type(self).__new__(type(self))
        fresh.__dict__ = dict(self.__dict__)
        fresh._parameters = dict(self._parameters)
        fresh._buffers = dict(self._buffers)
        fresh._modules = dict(self._modules)
        for name, t in tensors.items():
            fresh._parameters[name] = nn.Parameter(t)
        fresh._set_units(units, group)
        return fresh

    def _set_units(self, units: Sequence[int], group: Any) -> None:
        self.units, self.group = list(units), group


class ColwiseLinear(ShardedModule):
    """Output features of the rank's units. With `gather_output` the layer's output is the whole
    (replicated) tensor, every unit's features in place, for code after it that needs them all
    (an LM head followed by the model's own loss)."""

    UNIT_DIMS = {"weight": 0, "bias": 0}

    def __init__(self, full: nn.Linear, units: Sequence[int], unit_size: int, group: Any,
                 gather_output: bool = False) -> None:
        super().__init__()
        idx = feature_index(units, unit_size)
        self.weight = nn.Parameter(full.weight.detach()[idx].clone())
        self.bias = nn.Parameter(full.bias.detach()[idx].clone()) if full.bias is not None else None
        self.unit_size, self.gather_output, self.out_features = unit_size, gather_output, full.out_features
        self._set_units(units, group)

    def _set_units(self, units: Sequence[int], group: Any) -> None:
        super()._set_units(units, group)
        # where the local features go in the gathered output (a non-persistent buffer: it follows .to())
        self.register_buffer("out_index", feature_index(units, self.unit_size).to(self.weight.device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTP.apply(x, self.group)
        y = nn.functional.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = _GatherFromTP.apply(y, self.out_index, self.out_features, self.group)
        return y


class RowwiseLinear(ShardedModule):
    UNIT_DIMS = {"weight": 1}

    def __init__(self, full: nn.Linear, units: Sequence[int], unit_size: int, group: Any) -> None:
        super().__init__()
        idx = feature_index(units, unit_size)
        # column-major: the transpose of a contiguous [in, out] tensor (see the module docstring)
        self.weight = nn.Parameter(full.weight.detach()[:, idx].t().contiguous().t())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None
        self.unit_size = unit_size
        self._set_units(units, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        y = _ReduceFromTP.apply(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabEmbedding(ShardedModule):
    """An nn.Embedding sharded by rows (vocabulary entries; `RowwiseUnits` in the plan, as in
    torch's RowwiseParallel): a rank looks up the tokens it holds, gives zeros for the others,
    and the TP group's all-reduce completes every row. Megatron's vocab-parallel embedding, for
    any set of units."""

    UNIT_DIMS = {"weight": 0}

    def __init__(self, full: nn.Embedding, units: Sequence[int], unit_size: int, group: Any) -> None:
        super().__init__()
        if full.padding_idx is not None or full.max_norm is not None or full.scale_grad_by_freq or full.sparse:
            raise ValueError("vocab sharding supports plain embeddings (no padding_idx, max_norm, "
                             "scale_grad_by_freq or sparse)")
        idx = feature_index(units, unit_size)
        self.weight = nn.Parameter(full.weight.detach()[idx].clone())
        self.unit_size, self.num_embeddings = unit_size, full.num_embeddings
        self._set_units(units, group)

    def _set_units(self, units: Sequence[int], group: Any) -> None:
        super()._set_units(units, group)
        # token -> its row here, -1 for tokens another rank holds
        local = torch.full((self.num_embeddings,), -1, dtype=torch.long)
        idx = feature_index(units, self.unit_size)
        local[idx] = torch.arange(len(idx))
        self.register_buffer("local_row", local.to(self.weight.device), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.local_row[tokens]
        here = (rows >= 0).unsqueeze(-1)
        y = nn.functional.embedding(rows.clamp(min=0), self.weight) * here
        return _ReduceFromTP.apply(y, self.group)


def unit_features(path: str, module: nn.Module, style: ShardStyle) -> int:
    """The number of features `style` cuts into units on `module` (found at `path`). Raises
    ValueError for a module `style` cannot shard: column-wise needs nn.Linear (output features),
    row-wise nn.Linear (input features) or nn.Embedding (vocabulary entries)."""
    if isinstance(module, nn.Linear):
        return module.out_features if isinstance(style, ColwiseUnits) else module.in_features
    if isinstance(module, nn.Embedding) and isinstance(style, RowwiseUnits):
        return module.num_embeddings
    kinds = "nn.Linear" if isinstance(style, ColwiseUnits) else "nn.Linear or nn.Embedding"
    raise ValueError(f"{path} ({type(module).__name__}): {type(style).__name__} shards only {kinds}")


def parallelize(
    model: nn.Module, plan: Mapping[str, ShardStyle], units: Mapping[str, Sequence[int]], group: Any = None
) -> nn.Module:
    """Replace the modules named by `plan` (fnmatch patterns over module paths) with their shards
    for this rank. `units[family]` lists the units this rank holds. Returns the model.

    Raises ValueError when a pattern matches nothing, a matched module cannot be sharded that way
    (see `unit_features`), a family has no unit list, or a unit is out of range."""
    matched: set[str] = set()
    for path, module in list(model.named_modules()):
        for pattern, style in plan.items():
            if not fnmatch.fnmatchcase(path, pattern):
                continue
            feats = unit_features(path, module, style)
            if style.family not in units:
                raise ValueError(f"no unit list for family {style.family!r} (needed by {path})")
            own = units[style.family]
            if feats % style.unit_size:
                raise ValueError(f"{path}: {feats} features are not a multiple of unit size {style.unit_size}")
            n_units = feats // style.unit_size
            if any(not 0 <= u < n_units for u in own):
                raise ValueError(f"{path}: unit index out of range 0..{n_units - 1}")
            shard: ShardedModule
            if isinstance(module, nn.Embedding):
                shard = VocabEmbedding(module, own, style.unit_size, group)
            elif isinstance(style, ColwiseUnits):
                shard = ColwiseLinear(module, own, style.unit_size, group, style.gather_output)
            else:
                shard = RowwiseLinear(module, own, style.unit_size, group)
            _replace(model, path, shard)
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
