"""Ready tensor-parallel plans: `plan_for(model)` turns a model into what `parallelize` and the
`Runtime` need, without hand-written module patterns.

    plan = plan_for(model)          # a ModelPlan: module patterns -> styles, unit counts, fix-up
    parallelize(model, plan, layout.units_of(rank), group=tp_group)

Known models:

- Hugging Face Llama, Mistral, Qwen2 and Qwen3 (`LlamaForCausalLM`, ..., or their base models):
  attention by KV groups (one unit = one key/value head and the query heads that share it, so
  `num_attention_heads / num_key_value_heads` query heads; plain multi-head attention is the case
  of one query head per group), `head_dim` from the config when it gives one apart from
  hidden / heads (Qwen3), the MLP by `intermediate_size` columns (gate, up and down together),
  the vocabulary by `vocab_size` entries (token embedding by rows, LM head by output columns with
  the logits gathered for the model's own loss). Biases (Qwen2's q/k/v) follow their layer;
  Qwen3's per-head q/k norms stay replicated with their gradients summed over the TP group.
- Hugging Face GPT-2 (`GPT2LMHeadModel`, `GPT2Model`): heads from `n_head`, the fused q|k|v
  `c_attn` cut per block, the MLP by `n_inner` (4 x `n_embd` by default) columns, the vocabulary;
  the position table stays replicated. Its fix-up sets each attention's split width to the
  rank's heads (GPT-2 splits the fused output at a fixed width).
- `tiny_gpt.TinyGpt`, the model written here.

The unit counts come from the config and are checked against the modules the plan covers. A
model the rules do not fully cover is refused, naming the module: every nn.Linear, Conv1D and
nn.Embedding must be matched by a rule or be one the plan keeps replicated on purpose (GPT-2's
position table), and so must any module with parameters that sits beside a sharded layer; a
layer nobody planned for (an extra projection, a classification head, cross attention, a norm
inside attention) would otherwise see sharded activations or get a partial gradient. Dropout is refused too: the
ranks of a TP group would draw different masks for the same replicated activations.

Only the config and module structure are read: transformers need not be importable here.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ntp_manager.worker.tp import (
    ColwiseUnits,
    ReplicatedPerUnit,
    RowwiseUnits,
    ShardedModule,
    ShardStyle,
    is_conv1d,
    unit_counts,
    unit_features,
)


@dataclass(frozen=True)
class ModelPlan(Mapping[str, ShardStyle]):
    """A plan for one model: module-path patterns -> styles (it is the mapping `parallelize`
    takes), the unit count of every family, and a fix-up that `parallelize` -- and the Runtime,
    after every reshard -- runs on the sharded model (attributes that depend on the rank's local
    shapes)."""

    styles: Mapping[str, ShardStyle]
    units: Mapping[str, int]
    kind: str = "custom"  # which ready plan made it
    fixup: Callable[[nn.Module], None] | None = field(default=None, compare=False)

    def __getitem__(self, key: str) -> ShardStyle:
        return self.styles[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.styles)

    def __len__(self) -> int:
        return len(self.styles)


LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
GPT2_LIKE = ("gpt2",)


def plan_for(model: nn.Module) -> ModelPlan:
    """The ready plan for `model` (see the module docstring), built from its config and checked
    against its modules. Raises ValueError for a model with no ready plan, a layer the plan does
    not cover, dropout, or a config that contradicts the modules."""
    from ntp_manager.worker.tiny_gpt import TinyGpt, tp_plan, unit_counts

    if isinstance(model, TinyGpt):
        c = model.config
        return _checked(model, ModelPlan(tp_plan(c), unit_counts(c), "tiny_gpt"), replicated=("pos",))
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind in LLAMA_LIKE:
        return _llama_like(model, config, str(kind))
    if kind in GPT2_LIKE:
        return _gpt2(model, config)
    ready = ", ".join((*LLAMA_LIKE, *GPT2_LIKE, "TinyGpt"))
    raise ValueError(f"no ready plan for {type(model).__name__} (model_type {kind!r}); plans exist for {ready}. "
                     "Write one by hand: module patterns -> ColwiseUnits / RowwiseUnits (docs/worker.md)")


def _cfg(config: Any, name: str, default: Any = None) -> Any:
    v = getattr(config, name, default)
    return default if v is None else v


def _llama_like(model: nn.Module, c: Any, kind: str) -> ModelPlan:
    heads = int(c.num_attention_heads)
    kv = int(_cfg(c, "num_key_value_heads", heads))
    hidden = int(c.hidden_size)
    head_dim = int(_cfg(c, "head_dim", hidden // heads))
    if heads % kv:
        raise ValueError(f"{kind}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    if int(_cfg(c, "pretraining_tp", 1)) != 1:
        raise ValueError(f"{kind}: pretraining_tp={c.pretraining_tp} slices the layers inside the model; "
                         "set it to 1 (the plan shards them)")
    _no_dropout(model, c, ("attention_dropout", "hidden_dropout", "mlp_dropout"))
    group = heads // kv  # query heads per KV group: the attention unit is one group
    rules: dict[str, ShardStyle] = {
        "self_attn.q_proj": ColwiseUnits("heads", group * head_dim),
        "self_attn.k_proj": ColwiseUnits("heads", head_dim),
        "self_attn.v_proj": ColwiseUnits("heads", head_dim),
        "self_attn.o_proj": RowwiseUnits("heads", group * head_dim),
        "mlp.gate_proj": ColwiseUnits("mlp", 1),
        "mlp.up_proj": ColwiseUnits("mlp", 1),
        "mlp.down_proj": RowwiseUnits("mlp", 1),
        "embed_tokens": RowwiseUnits("vocab", 1),
        "lm_head": ColwiseUnits("vocab", 1, gather_output=True),
        # Qwen3: RMSNorm of every head with one weight: replicated, its gradient summed over TP
        "self_attn.q_norm": ReplicatedPerUnit("heads"),
        "self_attn.k_norm": ReplicatedPerUnit("heads"),
    }
    units = {"heads": kv, "mlp": int(c.intermediate_size), "vocab": int(c.vocab_size)}
    return _checked(model, ModelPlan(_patterns(model, rules), units, kind))


def _gpt2(model: nn.Module, c: Any) -> ModelPlan:
    hidden, heads = int(c.n_embd), int(c.n_head)
    if _cfg(c, "add_cross_attention", False):
        raise ValueError("gpt2: add_cross_attention=True has no ready plan (the cross attention's q_attn and "
                         "c_attn cut differently)")
    _no_dropout(model, c, ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
    head_dim = hidden // heads
    rules: dict[str, ShardStyle] = {
        "attn.c_attn": ColwiseUnits("heads", head_dim, parts=3),
        "attn.c_proj": RowwiseUnits("heads", head_dim),
        "mlp.c_fc": ColwiseUnits("mlp", 1),
        "mlp.c_proj": RowwiseUnits("mlp", 1),
        "wte": RowwiseUnits("vocab", 1),
        "lm_head": ColwiseUnits("vocab", 1, gather_output=True),
    }
    units = {"heads": heads, "mlp": int(_cfg(c, "n_inner", 4 * hidden)), "vocab": int(c.vocab_size)}
    return _checked(model, ModelPlan(_patterns(model, rules), units, "gpt2", fixup=_gpt2_split_width),
                    replicated=("wpe",))


def _gpt2_split_width(model: nn.Module) -> None:
    """GPT-2 splits c_attn's output into q, k and v at `split_size` (the full width): on a shard
    the blocks are the rank's heads wide."""
    for mod in model.modules():
        shard = getattr(mod, "c_attn", None)
        if isinstance(shard, ShardedModule) and hasattr(mod, "split_size") and hasattr(mod, "head_dim"):
            local = len(shard.units) * shard.unit_size
            setattr(mod, "split_size", local)  # noqa: B010  (an attribute of GPT-2's class, not of nn.Module)
            setattr(mod, "num_heads", local // int(getattr(mod, "head_dim")))  # noqa: B009, B010


def _no_dropout(model: nn.Module, config: Any, fields: tuple[str, ...]) -> None:
    on = {f: getattr(config, f) for f in fields if float(getattr(config, f, 0.0) or 0.0) > 0}
    drops = [p for p, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if on or drops:
        where = ", ".join([f"{k}={v}" for k, v in on.items()] + drops[:3])
        raise ValueError(f"dropout ({where}): the ranks of a TP group would draw different masks for the same "
                         "replicated activations, so they would diverge; set it to 0 in the config")


def _matches(path: str, suffix: str) -> bool:
    return path == suffix or path.endswith("." + suffix)


def _patterns(model: nn.Module, rules: Mapping[str, ShardStyle]) -> dict[str, ShardStyle]:
    """The model's module paths that the rules (path suffixes) cover, with layer numbers as '*'."""
    out: dict[str, ShardStyle] = {}
    for path, _ in model.named_modules():
        for suffix, style in rules.items():
            if _matches(path, suffix):
                out.setdefault(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path), style)
                break
    return out


def _style_of(path: str, styles: Mapping[str, ShardStyle]) -> ShardStyle | None:
    return next((st for pat, st in styles.items() if fnmatch.fnmatchcase(path, pat)), None)


def _checked(model: nn.Module, plan: ModelPlan, replicated: tuple[str, ...] = ()) -> ModelPlan:
    """Every weight-bearing layer covered (or replicated on purpose), nothing with parameters
    beside a sharded layer that the plan does not know, and every family's unit count what the
    config said."""
    if any(isinstance(m, ShardedModule) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} is sharded already: plan_for takes the whole model")
    # modules whose direct children include a layer with sharded input or output: anything else
    # with parameters in there may see the rank's units only
    inside: set[str] = set()
    for path, _ in model.named_modules():
        st = _style_of(path, plan.styles)
        row = isinstance(st, RowwiseUnits) and st.family != "vocab"
        if row or (isinstance(st, ColwiseUnits) and not st.gather_output):
            inside.add(path.rpartition(".")[0])
    for path, mod in model.named_modules():
        if _style_of(path, plan.styles) is not None or any(_matches(path, r) for r in replicated):
            continue
        layer = isinstance(mod, nn.Linear | nn.Embedding) or is_conv1d(mod)
        beside = path.rpartition(".")[0] in inside and any(True for _ in mod.parameters(recurse=False))
        if layer or beside:
            why = ("a layer it does not know would see sharded activations it was not built for" if layer else
                   "it holds parameters beside sharded layers, so it may see only the rank's units and its "
                   "gradient would be partial (ReplicatedPerUnit handles a module applied per unit)")
            raise ValueError(f"{path} ({type(mod).__name__}) is not covered by the {plan.kind} plan: {why}. "
                             "Extend the plan (ModelPlan(styles={...}, units=...)) or remove the module")
    if not plan.styles:
        raise ValueError(f"the {plan.kind} plan matches no module of {type(model).__name__}: is it already sharded?")
    seen = unit_counts(model, plan.styles)
    if dict(seen) != dict(plan.units):
        raise ValueError(f"{plan.kind}: the config gives unit counts {dict(plan.units)} but the modules have "
                         f"{seen}; the model does not match its config")
    for path, mod in model.named_modules():  # the styles must fit the modules (sizes, kinds)
        st = _style_of(path, plan.styles)
        if st is not None and not isinstance(st, ReplicatedPerUnit):
            unit_features(path, mod, st)
    return plan
