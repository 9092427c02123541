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

Tied weights (an LM head that is the embedding's Parameter, `tie_word_embeddings`): both uses cut
the vocabulary the same way (rows of the [vocab, hidden] weight), so the shared weight is sharded
once -- both modules hold the one shard Parameter, and autograd adds both uses' gradients into it.
A weight shared by modules that the plan cuts differently, or by one the plan leaves whole, is
refused: one Parameter cannot be two different shards.

Fused layers (GPT-2's `c_attn`: q, k and v of every head in one weight) take `ColwiseUnits(...,
parts=3)`: the output is `parts` equal blocks, each cut into the same units; the shard keeps one
parameter per block (`weight_0`, `weight_1`, ...) so that every sharded tensor stays unit-major.
HF's `Conv1D` (weight [in, out]) is sharded in its own orientation.

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
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ntp_manager.worker import comm


@dataclass(frozen=True)
class ColwiseUnits:
    family: str  # which unit map this module follows ("heads", "mlp", "vocab", ...)
    unit_size: int = 1  # output features per unit (per block when parts > 1)
    gather_output: bool = False  # give the whole output, not the rank's features (an LM head)
    parts: int = 1  # a fused layer: its output is `parts` equal blocks (q|k|v), each cut into the units


@dataclass(frozen=True)
class RowwiseUnits:
    family: str
    unit_size: int = 1  # input features per unit (vocabulary entries for an nn.Embedding)


@dataclass(frozen=True)
class ReplicatedPerUnit:
    """A module applied to every unit on its own with one shared set of parameters (Qwen3's
    per-head q/k RMSNorm between q_proj and attention): its parameters stay whole on every rank,
    but a rank's gradient covers only its own units, so backward sums it over the TP group. A
    replicated parameter used on sharded activations needs this; without it its gradient would be
    silently partial."""

    family: str
    unit_size: int = 1  # not used: nothing is cut


ShardStyle = ColwiseUnits | RowwiseUnits | ReplicatedPerUnit


class _TpWait(threading.local):
    """Seconds this thread spent blocked in TP all-reduces of CPU tensors since the last reset."""

    seconds = 0.0


TP_WAIT = _TpWait()


def _tp_all_reduce(t: torch.Tensor, group: Any) -> None:
    """The TP group's all-reduce. On CPU tensors (gloo) the call blocks until every member has
    contributed and the sum is in, so its host time is the rank's TP communication wait (waiting
    for slower members plus the transfer); it is added to `TP_WAIT` (fail-slow evidence, issue 21).
    Device tensors are not timed: their all-reduce is queued on a stream and timing it would need a
    sync."""
    if t.device.type != "cpu":
        comm.all_reduce(t, group=group)
        return
    t0 = time.perf_counter()
    comm.all_reduce(t, group=group)
    TP_WAIT.seconds += time.perf_counter() - t0


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
            _tp_all_reduce(grad, ctx.group)
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
            _tp_all_reduce(full, group)
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
            _tp_all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


# Typed entry points of the three functions (torch leaves `Function.apply` unannotated).
copy_to_tp: Callable[[torch.Tensor, Any], torch.Tensor] = _CopyToTP.apply
gather_from_tp: Callable[[torch.Tensor, torch.Tensor, int, Any], torch.Tensor] = _GatherFromTP.apply
reduce_from_tp: Callable[[torch.Tensor, Any], torch.Tensor] = _ReduceFromTP.apply


def _weight_and_bias(full: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight of a linear layer (nn.Linear or Conv1D), detached, and its bias (None without)."""
    w, b = full.weight, full.bias
    if not isinstance(w, torch.Tensor) or not (b is None or isinstance(b, torch.Tensor)):
        raise ValueError(f"{type(full).__name__}: expected tensors for weight and bias")
    return w.detach(), b


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
    each) and its TP group. `unit_dims` names the parameters that are sharded and the dimension
    their units run along; any other parameter is replicated inside the TP group. The gradient
    sync and the reshard see shards only through this interface.

    Two shards may hold the same Parameter (tied weights, see the module docstring): whoever walks
    the shards' parameters must take each Parameter once."""

    UNIT_DIMS: ClassVar[dict[str, int]] = {}  # the class's default for `unit_dims`
    units: list[int]
    unit_size: int
    group: Any

    @property
    def unit_dims(self) -> dict[str, int]:
        dims: dict[str, int] = self.__dict__.get("_unit_dims", self.UNIT_DIMS)
        return dims

    def sharded_params(self) -> list[tuple[str, nn.Parameter, int]]:
        """(name, parameter, unit dim) of every sharded parameter, in a fixed order."""
        out = []
        for name, dim in self.unit_dims.items():
            p = getattr(self, name)
            if p is not None:
                out.append((name, p, dim))
        return out

    def source_index(self, name: str) -> tuple[str, int, torch.Tensor]:
        """Where sharded parameter `name` comes from in the unsharded module: (that module's
        parameter name, the dimension, the positions along it), i.e. this shard's value is
        `full.<param>.index_select(dim, positions)`. For checkpoints and comparisons."""
        src, dim, offset = self.__dict__.get("_sources", {}).get(name, (name, self.unit_dims[name], 0))
        return src, dim, feature_index(self.units, self.unit_size) + offset

    def with_units(self, units: Sequence[int], tensors: Mapping[str, torch.Tensor], group: Any) -> ShardedModule:
        """A new shard of the same module holding `units`, whose sharded parameters are `tensors`
        (by name, already shaped for `units`); replicated parameters are shared with this one."""
        fresh = type(self).__new__(type(self))
        fresh.__dict__ = dict(self.__dict__)
        fresh._parameters = dict(self._parameters)
        fresh._buffers = dict(self._buffers)
        fresh._modules = dict(self._modules)
        for name, t in tensors.items():  # a Parameter is taken as it is (a tied weight's shard)
            fresh._parameters[name] = t if isinstance(t, nn.Parameter) else nn.Parameter(t)
        fresh._set_units(units, group)
        return fresh

    def _set_units(self, units: Sequence[int], group: Any) -> None:
        self.units, self.group = list(units), group


class PerUnitReplicated(ShardedModule):
    """The module itself, its parameters whole, run so that their gradients are summed over the
    TP group (`ReplicatedPerUnit`): every parameter enters the forward through the identity whose
    backward all-reduces. The original class's forward runs on this object, which carries the
    original's parameters, buffers and attributes under the same names."""

    def __init__(self, full: nn.Module, units: Sequence[int], group: Any) -> None:
        super().__init__()
        if any(True for _ in full.children()):
            raise ValueError(f"{type(full).__name__}: ReplicatedPerUnit takes a module without submodules")
        self.__dict__.update({k: v for k, v in full.__dict__.items() if k != "training"})
        self.training = full.training
        self._forward_of = type(full).forward
        self.unit_size = 1
        self._set_units(units, group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        group = self.group
        if group is None or dist.get_world_size(group) == 1:
            return self._forward_of(self, *args, **kwargs)
        saved = dict(self._parameters)
        try:
            for name, p in saved.items():
                if p is not None and p.requires_grad and torch.is_grad_enabled():
                    # the forward reads the identity's output in the parameter's place (not a Parameter)
                    self._parameters[name] = copy_to_tp(p, group)  # type: ignore[assignment]
            return self._forward_of(self, *args, **kwargs)
        finally:
            self._parameters.clear()
            self._parameters.update(saved)


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's `Conv1D` (GPT-2): a linear layer whose weight is stored [in, out]."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _columns_major(t: torch.Tensor) -> torch.Tensor:
    """A copy of 2-D `t` stored column-major (the transpose of a contiguous tensor): unit-major
    when the units run along dim 1."""
    return t.t().contiguous().t()


class ColwiseLinear(ShardedModule):
    """Output features of the rank's units. With `gather_output` the layer's output is the whole
    (replicated) tensor, every unit's features in place, for code after it that needs them all
    (an LM head followed by the model's own loss). An nn.Linear keeps weight rows; a Conv1D
    (weight [in, out]) keeps weight columns, stored column-major so its units stay contiguous."""

    UNIT_DIMS = {"weight": 0, "bias": 0}
    out_index: torch.Tensor  # a buffer (see _set_units)

    def __init__(self, full: nn.Module, units: Sequence[int], unit_size: int, group: Any,
                 gather_output: bool = False) -> None:
        super().__init__()
        idx = feature_index(units, unit_size)
        self.conv = is_conv1d(full)
        w, b = _weight_and_bias(full)
        self.weight = nn.Parameter(_columns_major(w[:, idx]) if self.conv else w[idx].clone())
        self.bias = nn.Parameter(b.detach()[idx].clone()) if b is not None else None
        if self.conv:
            self._unit_dims = {"weight": 1, "bias": 0}
        self.unit_size, self.gather_output = unit_size, gather_output
        self.out_features = int(w.shape[1] if self.conv else w.shape[0])
        self._set_units(units, group)

    def _set_units(self, units: Sequence[int], group: Any) -> None:
        super()._set_units(units, group)
        # where the local features go in the gathered output (a non-persistent buffer: it follows .to())
        self.register_buffer("out_index", feature_index(units, self.unit_size).to(self.weight.device),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group)
        y = nn.functional.linear(x, self.weight.t() if self.conv else self.weight, self.bias)
        if self.gather_output:
            y = gather_from_tp(y, self.out_index, self.out_features, self.group)
        return y


class ColwiseFused(ShardedModule):
    """A fused column-wise layer (`ColwiseUnits(parts=P)`): the output is P equal blocks (GPT-2's
    q|k|v), each cut into the same units. Block i of the rank's units is its own parameter
    `weight_i` (and `bias_i`), so every sharded tensor is unit-major; the output is the blocks'
    local features one after another, which is what the model's own split of the fused output
    expects once it knows the local block width (a model fix-up, see plans.py)."""

    def __init__(self, full: nn.Module, units: Sequence[int], unit_size: int, group: Any, parts: int) -> None:
        super().__init__()
        self.conv = is_conv1d(full)
        w, b = _weight_and_bias(full)
        block = int(w.shape[1] if self.conv else w.shape[0]) // parts
        idx = feature_index(units, unit_size)
        dims: dict[str, int] = {}
        sources: dict[str, tuple[str, int, int]] = {}
        for i in range(parts):
            j = idx + i * block
            self.register_parameter(f"weight_{i}", nn.Parameter(_columns_major(w[:, j]) if self.conv else w[j].clone()))
            dims[f"weight_{i}"] = 1 if self.conv else 0
            sources[f"weight_{i}"] = ("weight", dims[f"weight_{i}"], i * block)
            if b is not None:
                self.register_parameter(f"bias_{i}", nn.Parameter(b.detach()[j].clone()))
                dims[f"bias_{i}"], sources[f"bias_{i}"] = 0, ("bias", 0, i * block)
        self._unit_dims, self._sources = dims, sources
        self.parts, self.unit_size, self.has_bias = parts, unit_size, b is not None
        self._set_units(units, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group)
        outs = []
        for i in range(self.parts):
            w = getattr(self, f"weight_{i}")
            outs.append(nn.functional.linear(x, w.t() if self.conv else w,
                                             getattr(self, f"bias_{i}") if self.has_bias else None))
        return torch.cat(outs, dim=-1)


class RowwiseLinear(ShardedModule):
    """Input features of the rank's units; the output is all-reduced over the TP group and the
    (replicated) bias added once. nn.Linear: weight columns, stored column-major; Conv1D (weight
    [in, out]): weight rows, contiguous. Unit-major either way."""

    UNIT_DIMS = {"weight": 1}

    def __init__(self, full: nn.Module, units: Sequence[int], unit_size: int, group: Any) -> None:
        super().__init__()
        idx = feature_index(units, unit_size)
        self.conv = is_conv1d(full)
        w, b = _weight_and_bias(full)
        # nn.Linear: column-major, the transpose of a contiguous [in, out] tensor (module docstring)
        self.weight = nn.Parameter(w[idx].clone() if self.conv else _columns_major(w[:, idx]))
        self.bias = nn.Parameter(b.detach().clone()) if b is not None else None
        if self.conv:
            self._unit_dims = {"weight": 0}
        self.unit_size = unit_size
        self._set_units(units, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight.t() if self.conv else self.weight)
        y = reduce_from_tp(y, self.group)
        return y + self.bias if self.bias is not None else y


class VocabEmbedding(ShardedModule):
    """An nn.Embedding sharded by rows (vocabulary entries; `RowwiseUnits` in the plan, as in
    torch's RowwiseParallel): a rank looks up the tokens it holds, gives zeros for the others,
    and the TP group's all-reduce completes every row. Megatron's vocab-parallel embedding, for
    any set of units. `padding_idx` behaves as in torch: the padding row is looked up like any
    other, and its lookups add nothing to its gradient (on the rank that holds it)."""

    UNIT_DIMS = {"weight": 0}
    local_row: torch.Tensor  # a buffer (see _set_units)

    def __init__(self, full: nn.Embedding, units: Sequence[int], unit_size: int, group: Any) -> None:
        super().__init__()
        if full.max_norm is not None or full.scale_grad_by_freq or full.sparse:
            raise ValueError("vocab sharding supports embeddings without max_norm, scale_grad_by_freq "
                             "or sparse gradients (each needs every row of the table on one rank)")
        idx = feature_index(units, unit_size)
        self.weight = nn.Parameter(full.weight.detach()[idx].clone())
        self.unit_size, self.num_embeddings = unit_size, full.num_embeddings
        self.padding_idx: int | None = full.padding_idx
        self._set_units(units, group)

    def _set_units(self, units: Sequence[int], group: Any) -> None:
        super()._set_units(units, group)
        # token -> its row here, -1 for tokens another rank holds
        local = torch.full((self.num_embeddings,), -1, dtype=torch.long)
        idx = feature_index(units, self.unit_size)
        local[idx] = torch.arange(len(idx))
        self.register_buffer("local_row", local.to(self.weight.device), persistent=False)
        pad = int(local[self.padding_idx]) if self.padding_idx is not None else -1
        self.local_padding_idx: int | None = pad if pad >= 0 else None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.local_row[tokens]
        here = (rows >= 0).unsqueeze(-1)
        # tokens held elsewhere read row 0 and are zeroed: no value and no gradient from them
        y = nn.functional.embedding(rows.clamp(min=0), self.weight, padding_idx=self.local_padding_idx) * here
        return reduce_from_tp(y, self.group)


_LINEAR_KINDS = "nn.Linear or Conv1D"


def _plain(module: nn.Module, base: type[nn.Module]) -> bool:
    """Whether `module` computes what `base` computes: a subclass that overrides forward (a
    scaled embedding, say) would lose its extra work when replaced by a shard."""
    return type(module).forward is base.forward


def unit_features(path: str, module: nn.Module, style: ShardStyle) -> int:
    """The number of features `style` cuts into units on `module` (found at `path`); for a fused
    layer (`parts` > 1), the features of one block. Raises ValueError for a module `style` cannot
    shard: column-wise needs nn.Linear or Conv1D (output features), row-wise nn.Linear or Conv1D
    (input features) or nn.Embedding (vocabulary entries); a subclass that overrides forward is
    refused (its shard would not do what it does)."""
    if isinstance(style, ReplicatedPerUnit):
        raise ValueError(f"{path}: ReplicatedPerUnit cuts nothing into units")
    col = isinstance(style, ColwiseUnits)
    if isinstance(module, nn.Linear) or is_conv1d(module):
        if isinstance(module, nn.Linear) and not _plain(module, nn.Linear):
            raise ValueError(f"{path} ({type(module).__name__}) overrides nn.Linear.forward: its shard would "
                             "compute a plain linear layer; write a shard for it or leave it out of the plan")
        shape = tuple(_weight_and_bias(module)[0].shape)
        out_f, in_f = (int(shape[1]), int(shape[0])) if is_conv1d(module) else (int(shape[0]), int(shape[1]))
        feats = out_f if col else in_f
        parts = style.parts if isinstance(style, ColwiseUnits) else 1
        if parts < 1 or feats % parts:
            raise ValueError(f"{path}: {feats} output features do not split into {parts} equal parts")
        if parts > 1 and isinstance(style, ColwiseUnits) and style.gather_output:
            raise ValueError(f"{path}: gather_output is for an LM head, not a fused layer (parts={parts})")
        return feats // parts
    if isinstance(module, nn.Embedding) and not col:
        if not _plain(module, nn.Embedding):
            raise ValueError(f"{path} ({type(module).__name__}) overrides nn.Embedding.forward (a scaled "
                             "embedding?): its shard would lose that; write a shard for it or leave it out")
        return module.num_embeddings
    kinds = _LINEAR_KINDS if col else f"{_LINEAR_KINDS} or nn.Embedding"
    raise ValueError(f"{path} ({type(module).__name__}): {type(style).__name__} shards only {kinds}")


def unit_counts(model: nn.Module, plan: Mapping[str, ShardStyle]) -> dict[str, int]:
    """Family -> unit count, read off the unsharded model."""
    counts: dict[str, int] = {}
    for path, mod in model.named_modules():
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(path, pattern):
                if isinstance(style, ReplicatedPerUnit):
                    break  # nothing cut: its family's count comes from the cut modules
                n = unit_features(path, mod, style) // style.unit_size
                if counts.setdefault(style.family, n) != n:
                    raise ValueError(f"family {style.family!r}: {counts[style.family]} units elsewhere, {n} at {path}")
                break
    return counts


def _make_shard(module: nn.Module, style: ShardStyle, own: Sequence[int], group: Any) -> ShardedModule:
    if isinstance(style, ReplicatedPerUnit):
        return PerUnitReplicated(module, own, group)
    if isinstance(module, nn.Embedding):
        return VocabEmbedding(module, own, style.unit_size, group)
    if isinstance(style, ColwiseUnits):
        if style.parts > 1:
            return ColwiseFused(module, own, style.unit_size, group, style.parts)
        return ColwiseLinear(module, own, style.unit_size, group, style.gather_output)
    return RowwiseLinear(module, own, style.unit_size, group)


@dataclass
class _Cut:
    """How a shard cut one of its unsharded module's Parameters (to recognise tied weights): the
    pieces (dimension, positions, shard Parameter) in order -- several for a fused layer."""

    full: nn.Parameter  # held here so that its id stays unique while parallelize runs
    where: str  # module path and parameter name, for messages
    family: str
    pieces: list[tuple[int, torch.Tensor, nn.Parameter]]

    def same_cut(self, other: _Cut) -> bool:
        return self.family == other.family and len(self.pieces) == len(other.pieces) and all(
            a[0] == b[0] and torch.equal(a[1], b[1]) and a[2].shape == b[2].shape
            for a, b in zip(self.pieces, other.pieces, strict=True))


def parallelize(
    model: nn.Module, plan: Mapping[str, ShardStyle], units: Mapping[str, Sequence[int]], group: Any = None
) -> nn.Module:
    """Replace the modules named by `plan` (fnmatch patterns over module paths) with their shards
    for this rank. `units[family]` lists the units this rank holds. Returns the model. A plan that
    carries a model fix-up (`plans.ModelPlan`) has it run on the sharded model.

    Tied weights (one Parameter in several modules) are sharded once when every module holding it
    cuts it the same way; raises ValueError otherwise, and when a pattern matches nothing, a
    matched module cannot be sharded that way (see `unit_features`), a family has no unit list,
    or a unit is out of range. A refused plan leaves the model unchanged."""
    matched: set[str] = set()
    cuts: dict[int, _Cut] = {}  # id of an unsharded Parameter -> how it was cut
    shards: list[tuple[str, nn.Module, ShardedModule]] = []  # replaced once everything checked out
    for path, module in list(model.named_modules()):
        for pattern, style in plan.items():
            if not fnmatch.fnmatchcase(path, pattern):
                continue
            if style.family not in units:
                raise ValueError(f"no unit list for family {style.family!r} (needed by {path})")
            own = units[style.family]
            if isinstance(style, ReplicatedPerUnit):
                shards.append((path, module, _make_shard(module, style, own, group)))
                matched.add(pattern)
                break
            feats = unit_features(path, module, style)
            if feats % style.unit_size:
                raise ValueError(f"{path}: {feats} features are not a multiple of unit size {style.unit_size}")
            n_units = feats // style.unit_size
            if any(not 0 <= u < n_units for u in own):
                raise ValueError(f"{path}: unit index out of range 0..{n_units - 1}")
            shard = _make_shard(module, style, own, group)
            mine: dict[int, tuple[_Cut, list[str]]] = {}
            for name, p, _ in shard.sharded_params():
                src, dim, index = shard.source_index(name)
                full = getattr(module, src)
                cut, names = mine.setdefault(id(full), (_Cut(full, f"{path}.{src}", style.family, []), []))
                cut.pieces.append((dim, index, p))
                names.append(name)
            for key, (cut, names) in mine.items():
                first = cuts.setdefault(key, cut)
                if first is cut:
                    continue
                if not first.same_cut(cut):
                    raise ValueError(
                        f"{cut.where} is the same Parameter as {first.where} (tied weights), but the plan cuts "
                        f"them differently ({cut.family!r} along dim {cut.pieces[0][0]} vs {first.family!r} along "
                        f"dim {first.pieces[0][0]}): one Parameter can be only one shard; cut both the same way")
                for name, (_, _, shared) in zip(names, first.pieces, strict=True):
                    shard._parameters[name] = shared  # one shard Parameter serves both uses
            shards.append((path, module, shard))
            matched.add(pattern)
            break
    missing = set(plan) - matched
    if missing:
        raise ValueError(f"plan patterns matched no module: {sorted(missing)}")
    for path, _, shard in shards:
        _replace(model, path, shard)
    try:
        _check_no_whole_copies(model, cuts)
    except ValueError:
        for path, module, _ in reversed(shards):  # a refusal leaves the model as it was
            _replace(model, path, module)
        raise
    fixup = getattr(plan, "fixup", None)
    if fixup is not None:
        fixup(model)
    return model


def _check_no_whole_copies(model: nn.Module, cuts: Mapping[int, _Cut]) -> None:
    """Refuse a sharded Parameter that some module still holds whole (a tied weight whose other
    user the plan does not shard): that module would keep computing with the unsharded tensor,
    which no longer trains."""
    for path, mod in model.named_modules():
        sharded = {n for n, _, _ in mod.sharded_params()} if isinstance(mod, ShardedModule) else set()
        for name, p in mod._parameters.items():
            if p is not None and name not in sharded and id(p) in cuts:
                where = f"{path}.{name}" if path else name
                raise ValueError(f"{where} is the same Parameter as {cuts[id(p)].where} (tied weights), which the "
                                 "plan shards: shard every module that holds it the same way, or none")


def _replace(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, new)
