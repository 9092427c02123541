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
