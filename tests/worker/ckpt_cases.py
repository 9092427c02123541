"""Shared by the checkpoint tests: the model, the layouts, batches, optimizers, and an exact comparison
of a rank's state with the same units of a reference."""

from __future__ import annotations

from typing import Any

import torch

from ntp_manager.worker.sync import SyncLayout, replicas_from
from ntp_manager.worker.tiny_gpt import GptConfig, unit_counts
from tests.worker.compare import ref_part, shard_info

CFG = GptConfig(vocab=64, seq=16, d_model=48, heads=6, mlp=90, layers=2)
UNITS = unit_counts(CFG)


def layout(ranks: list[list[int]], batches: list[int] | None = None) -> SyncLayout:
    return SyncLayout(replicas_from(ranks, batches or [4] * len(ranks)), UNITS)


TP4x2 = layout([[0, 1, 2, 3], [4, 5, 6, 7]])
TARGETS = {
    "TP3+TP4": layout([[0, 1, 2], [3, 4, 5, 6]]),  # the TP4 replica's extra rank holds non-contiguous units
    "TP2xDP3": layout([[0, 1], [2, 3], [4, 5]], [3, 3, 2]),
    "TP1": layout([[0]], [8]),
    "TP4+TP2+TP1": layout([[0, 1, 2, 3], [4, 5], [6]], [4, 2, 2]),
}


def batch(step: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, CFG.vocab, (n, CFG.seq), generator=g),
            torch.randint(0, CFG.vocab, (n, CFG.seq), generator=g))


def make_opt(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-6, weight_decay=0.1)


def mismatches(m: Any, opt: Any, ref: Any, ref_opt: Any) -> list[str]:
    """Names whose values are not bitwise the reference's units (parameters and optimizer state)."""
    info, full = shard_info(m), dict(ref.named_parameters())
    bad = []
    for name, p in m.named_parameters():
        if not torch.equal(p.detach(), ref_part(full[name].detach(), name, info)):
            bad.append(name)
        mine, theirs = opt.state.get(p, {}), ref_opt.state[full[name]]
        if set(mine) != set(theirs):
            bad.append(f"{name} state keys {sorted(mine)} vs {sorted(theirs)}")
            continue
        for k, v in theirs.items():
            if not torch.equal(mine[k], ref_part(v, name, info) if v.dim() else v):
                bad.append(f"{name}.{k}")
    return bad
