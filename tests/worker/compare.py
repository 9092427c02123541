"""Comparing a rank's (sharded) parameters with a single-process reference model's, and the runs
both sides share: step-numbered random batches and the reference's own training loop."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from ntp_manager.worker.tp import ShardedModule, feature_index

Batch = tuple[torch.Tensor, torch.Tensor]

# a sharded module: the unit dim of each sharded parameter (by name), its units, the unit size
ShardInfo = tuple[dict[str, int], list[int], int]


def shard_info(model: nn.Module) -> dict[str, ShardInfo]:
    """Module path -> ShardInfo for every sharded module of `model` (picklable)."""
    return {path: ({n: d for n, _, d in m.sharded_params()}, list(m.units), m.unit_size)
            for path, m in model.named_modules() if isinstance(m, ShardedModule)}


def ref_part(ref: torch.Tensor, name: str, info: dict[str, ShardInfo]) -> torch.Tensor:
    """The part of the reference model's tensor for parameter `name` that the shard holds (all of
    it for a replicated parameter)."""
    mod, _, pname = name.rpartition(".")
    if mod in info and pname in info[mod][0]:
        dims, units, size = info[mod]
        return ref.index_select(dims[pname], feature_index(units, size))
    return ref


def shard_errors(params: dict[str, np.ndarray], units: dict[str, ShardInfo],
                 ref_params: dict[str, torch.Tensor], optimizer: str) -> dict[str, float]:
    """Relative error of every parameter against the same units of the reference. `units` is the
    rank's `shard_info`.

    Skipped for AdamW: `attn.k.bias`. Its true gradient is exactly zero (softmax ignores a shift
    shared by a query's scores), so Adam divides rounding noise by its own magnitude and takes
    lr-sized random steps in both runs. SGD checks this parameter; the losses check the rest."""
    out = {}
    for name, arr in params.items():
        if optimizer == "adamw" and name.endswith("attn.k.bias"):
            continue
        p, r = torch.from_numpy(arr), ref_part(ref_params[name], name, units)
        out[name] = float((p - r).norm() / max(r.norm().item(), 1e-2))
    return out


def update_errors(params: dict[str, np.ndarray], units: dict[str, ShardInfo], ref_params: dict[str, torch.Tensor],
                  initial: dict[str, torch.Tensor]) -> dict[str, float]:
    """Relative error of every parameter's *update* (final minus initial) against the same units of
    the reference's: what fp32 master state decides (bf16 compute moves every value by rounding
    noise of bf16's resolution, 2^-8 relative, which a parameter-relative error would hide the
    updates in). Skipped: `attn.k.bias`, whose true gradient is zero (see `shard_errors`)."""
    out = {}
    for name, arr in params.items():
        if name.endswith("attn.k.bias"):
            continue
        start = ref_part(initial[name], name, units)
        got, want = torch.from_numpy(arr).float() - start, ref_part(ref_params[name], name, units) - start
        out[name] = float((got - want).norm() / max(want.norm().item(), 1e-12))
    return out


# bf16 runs against one process doing bf16 compute with fp32 master state (pipeline_jobs.reference).
# Both compute in bf16, but not the same bf16 sums: the runtime's micro-batches round each one's
# weight gradients to bf16 before the fp32 accumulation, and a row-parallel layer rounds its partial
# sums to bf16 before the TP all-reduce. What is equal is the fp32 master state's arithmetic, so
# the check is on each parameter's update (final - initial, update_errors) at a tolerance a few
# times the spread of two equally valid one-process bf16 runs (the global batch in one pass against
# one sample per pass: worst parameter 0.016 with SGD, 0.044 with AdamW). AdamW takes an lr-sized
# step in a random direction wherever a gradient is at bf16's noise level, and on a shard of 12
# biases one such element moves the norm most: measured worst 0.028 (SGD) and 0.20 (AdamW, PP4's
# 12-unit mlp.up.bias shards in test_pipeline_runtime). Losses are fp32 means over every token of
# bf16 logits: worst measured 1.7e-4 relative. The negative control (bf16 parameters and optimizer
# state, one process) misses by 1.0-3.0: a weight near 1 does not move at all (its updates, ~lr =
# 1e-3, are below half of bf16's spacing there, 2^-8), which is what the fp32 master copy is for.
BF16_LOSS = 1e-3
BF16_UPDATE = {"sgd": 0.05, "adamw": 0.3}


def tolerance(optimizer: str) -> float:
    """AdamW divides by sqrt(v): rounding differences of the sync's summation order grow about 10x
    through that, so its parameters get 1e-4; SGD and every loss hold 1e-5."""
    return 1e-4 if optimizer == "adamw" else 1e-5




def random_batches(vocab: int, seq: int, size: int, seed: int) -> Callable[[int, int, int], Batch]:
    """`batch(step, start, count)` as the runtime takes it: samples [start, start+count) of step
    `step`'s global batch of `size` random token sequences (inputs, targets), drawn from a
    generator seeded with `seed + step`, so every layout slices the same global batch."""

    def batch(step: int, start: int, count: int) -> Batch:
        g = torch.Generator().manual_seed(seed + step)
        idx = torch.randint(0, vocab, (size, seq), generator=g)
        tgt = torch.randint(0, vocab, (size, seq), generator=g)
        return idx[start : start + count], tgt[start : start + count]

    return batch


def train_reference(model: nn.Module, opt: torch.optim.Optimizer, batches: Iterable[Any],
                    loss_fn: Callable[[Any], torch.Tensor], scheduler: Any = None,
                    clip: float | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process reference: one optimizer step (and scheduler step) per batch, the
    gradient clipped to norm `clip` first if given (asserted active: the norm exceeds it); every
    step's loss and the final parameters."""
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = loss_fn(b)
        loss.backward()
        if clip is not None:
            assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)) > clip
        opt.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}
