"""Comparing a rank's (sharded) parameters with a single-process reference model's."""

from __future__ import annotations

import numpy as np
import torch

from ntp_manager.worker.tp import feature_index


def shard_errors(params: dict[str, np.ndarray], units: dict[str, tuple[str, list[int], int]],
                 ref_params: dict[str, torch.Tensor], optimizer: str) -> dict[str, float]:
    """Relative error of every parameter against the same units of the reference. `units` maps a
    sharded module path to (class name, its units, unit size).

    Skipped for AdamW: `attn.k.bias`. Its true gradient is exactly zero (softmax ignores a shift
    shared by a query's scores), so Adam divides rounding noise by its own magnitude and takes
    lr-sized random steps in both runs. SGD checks this parameter; the losses check the rest."""
    out = {}
    for name, arr in params.items():
        if optimizer == "adamw" and name.endswith("attn.k.bias"):
            continue
        p, r = torch.from_numpy(arr), ref_params[name]
        mod = name.rpartition(".")[0]
        if mod in units:
            cls, us, size = units[mod]
            if cls == "ColwiseLinear":
                r = r[feature_index(us, size)]
            elif name.endswith("weight"):
                r = r[:, feature_index(us, size)]
        out[name] = float((p - r).norm() / max(r.norm().item(), 1e-2))
    return out


def tolerance(optimizer: str) -> float:
    """AdamW divides by sqrt(v): rounding differences of the sync's summation order grow about 10x
    through that, so its parameters get 1e-4; SGD and every loss hold 1e-5."""
    return 1e-4 if optimizer == "adamw" else 1e-5


