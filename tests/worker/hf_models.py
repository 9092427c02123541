"""Tiny Hugging Face models built from their configs (no download), for the worker's tests, and
helpers to compare a rank's shards with the unsharded model.

Every family the ready plans know, with and without tied embeddings: Llama with multi-head and
grouped-query attention (the GQA one with a padding token), Mistral, Qwen2 (q/k/v biases), Qwen3
(head_dim apart from hidden / heads, q/k norms) and GPT-2 (Conv1D, fused q|k|v). Attention units
are KV groups; every family has at least 4 so that TP 4 is possible."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ntp_manager.contract.ntp_map import ntp_map
from ntp_manager.worker.tp import ShardedModule

VOCAB = 64
SEQ = 8
MAX_BATCH = 16

SPECS = ("llama-mha", "llama-gqa", "mistral", "qwen2", "qwen3", "gpt2")


def config(spec: str, tied: bool) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(vocab_size=VOCAB, num_hidden_layers=2, tie_word_embeddings=tied,
                                  bos_token_id=1, eos_token_id=2, max_position_embeddings=64)
    if spec == "llama-mha":
        return tf.LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4,
                              **common)
    if spec == "llama-gqa":
        return tf.LlamaConfig(hidden_size=64, intermediate_size=40, num_attention_heads=8, num_key_value_heads=4,
                              pad_token_id=0, **common)
    if spec == "mistral":
        return tf.MistralConfig(hidden_size=64, intermediate_size=40, num_attention_heads=8, num_key_value_heads=4,
                                sliding_window=None, **common)
    if spec == "qwen2":
        return tf.Qwen2Config(hidden_size=64, intermediate_size=40, num_attention_heads=8, num_key_value_heads=4,
                              **common)
    if spec == "qwen3":  # head_dim 16 where hidden / heads is 8
        return tf.Qwen3Config(hidden_size=64, intermediate_size=40, num_attention_heads=8, num_key_value_heads=4,
                              head_dim=16, **common)
    if spec == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=40,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied,
                             bos_token_id=1, eos_token_id=2)
    raise ValueError(spec)


def build(spec: str, tied: bool, seed: int = 0) -> nn.Module:
    """The model, initialised from `seed` (the same on every rank)."""
    import transformers as tf

    torch.manual_seed(seed)
    c = config(spec, tied)
    cls = {"llama-mha": tf.LlamaForCausalLM, "llama-gqa": tf.LlamaForCausalLM, "mistral": tf.MistralForCausalLM,
           "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM, "gpt2": tf.GPT2LMHeadModel}[spec]
    m = cls(c)
    # HF initialises biases to zero; random ones (as trained weights have) make the test see
    # them, and keep a bias from being nothing but its first update, which under Adam is the
    # ill-conditioned quantity `make_opt` describes
    with torch.no_grad():
        for mod in m.modules():
            bias = getattr(mod, "bias", None)
            if isinstance(bias, nn.Parameter):
                bias.normal_(0, 0.02)
    return m


def tokens(step: int, n: int, pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` samples of step `step` (input ids, labels); the same samples whatever n is cut into.
    With `pad`, some trailing positions are padding (id 0, label -100: not counted)."""
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(3, VOCAB, (MAX_BATCH, SEQ), generator=g)[:n]
    labels = ids.clone()
    if pad:
        for i in range(n):
            k = (i % 3) + 1
            ids[i, SEQ - k:] = 0
            labels[i, SEQ - k:] = -100
    return ids, labels


def unit_lists(units: dict[str, int], tp: int, mode: str) -> list[dict[str, list[int]]]:
    """Per rank, its units of every family: contiguous (a replica syncing with its own degree)
    or a healthy replica's compute partition beside a TP-1 replica (non-contiguous)."""
    n_sync = tp if mode == "contiguous" else max(1, tp - 1)
    return [{f: ntp_map(n, tp, n_sync).units_of(r) for f, n in units.items()} for r in range(tp)]


def pairs(model: nn.Module, ref: nn.Module) -> Iterator[tuple[str, nn.Parameter, nn.Parameter, Any]]:
    """(name, parameter of the sharded model, the reference parameter it comes from, a function
    giving the part of a reference-shaped tensor that the parameter holds), each Parameter once."""
    seen: set[int] = set()
    for path, mod in model.named_modules():
        sharded = {n: mod.source_index(n) for n, _, _ in mod.sharded_params()} if isinstance(mod, ShardedModule) else {}
        for name, p in mod.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            rmod = ref.get_submodule(path)
            if name in sharded:
                src, dim, index = sharded[name]
                yield f"{path}.{name}", p, getattr(rmod, src), (lambda t, d=dim, i=index: t.index_select(d, i))
            else:
                yield f"{path}.{name}", p, getattr(rmod, name), (lambda t: t)


def rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-6) -> float:
    """Relative error, with an absolute floor on the reference's norm."""
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / max(b.norm().item(), floor))


def err(name: str, a: torch.Tensor, b: torch.Tensor) -> float:
    """A tensor's relative error. A key bias's true gradient is exactly zero (`exact_zero_grad`),
    so both runs give rounding noise, ~1e-9 here, and GPT-2's biases start at zero: for those a
    relative error means nothing, and the error is taken against a floor of 1e-3 (the other
    gradients' norms are 1e-2..1), i.e. it must stay below 1e-8 absolute."""
    return rel(a, b, 1e-3 if exact_zero_grad(name) else 1e-6)


def exact_zero_grad(name: str) -> bool:
    """A key bias: its true gradient is exactly zero (softmax ignores a shift shared by all of a
    query's scores), so what autograd gives is rounding noise, and Adam, which divides a gradient
    by its own magnitude, turns that into lr-sized steps of random sign in both runs. SGD checks
    these parameters; under Adam they are left out (as in tests/worker/compare.py)."""
    return name.endswith("k_proj.bias") or name.endswith("c_attn.bias_1")


def make_opt(kind: str, params: Any) -> torch.optim.Optimizer:
    """SGD with momentum, or AdamW (lr 1e-3, eps 1e-6). Adam moves a weight by about
    lr * g / (|g| + eps): where |g| is near or below eps, fp32 rounding of the gradient (~1e-9
    absolute here, for gradients of 1e-2) moves the weight by lr * 1e-9 / eps. With the default
    eps 1e-8 that is up to lr itself (a weight whose gradient is 3e-9 gets a sign that rounding
    decides): up to 3e-3 of a layer's norm after one step at lr 1e-2 in the sharded run, and up to
    2e-4 between two unsharded runs that only split the batch into micro-batches. At eps 1e-6
    and lr 1e-3 rounding moves weights by ~1e-6 of their norm, so a 1e-5 check sees real
    differences only."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def tied_ok(model: nn.Module, tied: bool) -> bool:
    """Whether the LM head and the token embedding share one Parameter exactly when they should."""
    emb = model.get_input_embeddings().weight  # type: ignore[operator]
    head = model.get_output_embeddings().weight  # type: ignore[operator]
    return (emb is head) == tied
