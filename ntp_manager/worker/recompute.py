"""Activation recomputation (a job's `RuntimeConfig(recompute=True)`): each transformer layer keeps
only its input for the backward and runs its forward again there (`torch.utils.checkpoint`,
non-reentrant), trading about one more forward per step for the activations inside the layers.

`enable_recompute(model)` turns it on for a whole model before the runtime cuts it into stages
and shards it, through the model's own switch where it has one:

- Hugging Face models: `activation_checkpointing_enable` (older transformers:
  `gradient_checkpointing_enable`) with `use_reentrant=False`; the decoder layers then checkpoint
  themselves whenever they are called in training mode, which the pipeline's Llama stage does too.
- `TinyGpt`: its `recompute` flag (its stages copy it), read by `tiny_gpt.run_block`.

Any other model is refused (`RecomputeError`, naming it): the runtime will not guess where its
layers are. What recomputation keeps exact: the layers have no randomness (the plans refuse
dropout) and the recomputed forward repeats the TP all-reduces of the first in the same order on
every rank of a TP group, so the gradients are bitwise those without it.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ntp_manager.worker.tiny_gpt import TinyGpt


class RecomputeError(ValueError):
    """A model the runtime cannot turn activation recomputation on for, refused at set-up."""


def enable_recompute(model: nn.Module) -> str:
    """Turn activation recomputation on for `model` (a whole model, before it is cut or
    sharded); returns how. Raises RecomputeError for a model without a switch."""
    if isinstance(model, TinyGpt):
        model.recompute = True
        return "TinyGpt.recompute"
    hf: Any = model
    if getattr(hf, "supports_gradient_checkpointing", False):
        kwargs = {"use_reentrant": False}
        if hasattr(hf, "activation_checkpointing_enable"):
            hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            return "activation_checkpointing_enable"
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        return "gradient_checkpointing_enable"
    raise RecomputeError(f"recompute=True: {type(model).__name__} has no activation-checkpointing switch the "
                         "runtime knows (Hugging Face models with supports_gradient_checkpointing, TinyGpt); turn "
                         "recompute off or wrap the model's layers in torch.utils.checkpoint yourself")
