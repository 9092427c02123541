"""The global gradient norm from every rank's share (sync.global_norm), no processes: every rank
sums the same gathered shares, and the norm must come out with the same bits whatever the order
or memory layout the summation sees (the kernel torch picks differs between hosts' CPUs)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from ntp_manager.worker.sync import global_norm, norm_share
from ntp_manager.worker.tiny_gpt import GptConfig, TinyGpt, tp_plan, unit_counts
from ntp_manager.worker.tp import ShardedModule, parallelize


def _shares(seed: int, n: int) -> list[float]:
    rnd = random.Random(seed)
    return [rnd.random() * 10.0 ** rnd.randint(-6, 6) for _ in range(n)]


def test_the_norm_does_not_depend_on_the_summation_order() -> None:
    """Permutations and a strided copy of the same shares give the same bits, and the exactly
    rounded value. (What it guards against: torch's sum of the same values can differ between a
    strided column and a contiguous tensor -- on this machine in about a fifth of these cases --
    and which kernel runs depends on the host's CPU.)"""
    for seed in range(300):
        shares = _shares(seed, 8 + seed % 57)
        want = math.sqrt(math.fsum(shares) / 2)
        rnd = random.Random(seed)
        for _ in range(3):
            perm = shares[:]
            rnd.shuffle(perm)
            assert global_norm(perm, 2) == want
        column = torch.tensor(shares, dtype=torch.float64).unsqueeze(1).expand(-1, 4).clone()[:, 3]
        assert global_norm(column.tolist(), 2) == want


def test_non_finite_shares_give_a_non_finite_norm() -> None:
    assert math.isnan(global_norm([1.0, math.nan, 2.0], 2))
    assert global_norm([1.0, math.inf], 2) == math.inf
    assert global_norm([1e308, 1e308, 1.0], 2) == math.inf  # finite shares, sum beyond float64
    assert global_norm([0.0, 0.0], 3) == 0.0
    assert global_norm([8.0, 10.0], 2) == 3.0


def _tied() -> TinyGpt:
    torch.manual_seed(3)
    m = TinyGpt(CFG)
    m.head.weight = m.tok.weight
    return m


CFG = GptConfig(vocab=32, seq=8, d_model=24, heads=4, mlp=20, layers=2)


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_the_shares_of_a_stages_ranks_add_up_to_the_whole_models_norm(tp: int) -> None:
    """Every TP rank of one replica gets its units' slices of one process's gradient (units dealt
    round-robin: not contiguous at TP3); their norm_share values add up to the squared norm that
    clip_grad_norm_ takes over the whole model: sharded units once, the replicated parameters
    (layer norms, row-wise biases, positions) once, not tp times, the tied embedding/LM head once."""
    full = _tied()
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, CFG.vocab, (3, CFG.seq), generator=g)
    torch.autograd.backward(full.loss(idx, torch.randint(0, CFG.vocab, (3, CFG.seq), generator=g)))
    # head.weight too (the tied Parameter under both names)
    grads = {n: p.grad for n, p in full.named_parameters(remove_duplicate=False) if p.grad is not None}
    shares = []
    for r in range(tp):
        m = _tied()
        parallelize(m, tp_plan(CFG), {f: [u for u in range(n) if u % tp == r] for f, n in unit_counts(CFG).items()})
        for path, mod in m.named_modules():
            if isinstance(mod, ShardedModule):
                for name, p, _ in mod.sharded_params():
                    src, dim, pos = mod.source_index(name)
                    p.grad = grads[f"{path}.{src}"].index_select(dim, pos)
        for n, p in m.named_parameters():
            if p.grad is None:
                p.grad = grads[n].clone()
        shares.append(norm_share(m, r))
    want = float(torch.nn.utils.clip_grad_norm_(full.parameters(), 1.0))
    assert abs(global_norm(shares, 1) - want) <= 1e-6 * want
